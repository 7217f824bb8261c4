"""Quantized matrix products: y = x @ W.T with W (N, K) in a GGML block format.

Two families:
- the exact int8 path (kernels/cpu/qdot/; the types whose kernels.types record is `exact`, on AVX2 CPUs): x is quantized
  as llama.cpp's matmul quantizes it (q8_0 / q8_K) and every output gets llama.cpp's float
  operations, so the result equals llama.cpp's bit for bit. W stays as the GGUF stores it (or
  repacked 8 rows at a time, the same bytes); one pass over W serves all rows of x.
- the float path (every type; exact float32 x): gemv reads every packed block once per call,
  decodes it in registers and dots it with x, rows split across threads, offsets and minimums
  folded out of the inner loop with per-block sums of x:
      sum_l (d*q_l - m) * x_l = d * sum_l q_l x_l - m * sum_l x_l;
  gemm dequantizes tiles of W, rounds them to bf16 and multiplies with torch (oneDNN).
The models layer takes the exact path with llama.cpp rounding (its default) and the float path for
the other types or with exact float32 activations.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels.cpu.ops import serial_twin
from kernels.cpu import qdot
from kernels.cpu.qdot import EXACT_TYPES, Int8Rows
from kernels.types import IQ4_NL_VALUES, TRAITS
from kernels.cpu.quant import (
    BF16, F16, F16_LUT, F32, IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0,
    GGML_BLOCK, SUPPORTED_TYPES, TYPE_NAMES, bits_f32, dequantize_rows, i8_f32, repack,
)

FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}
_F0 = np.float32(0.0)
_EMPTY = np.empty(0, np.float32)


# --- gemv kernels: (packed fields..., x (K,), sx16 (K/16,), sx32 (K/32,), out (N,)) -----------

# Kernel shape: prange over chunks of ROWS rows. Each inner loop covers 128-256 elements
# (4 small blocks, or one K-quant super-block), with the block scales broadcast as scalars,
# so the horizontal sum that ends a vectorized reduction happens once per 128-256 elements
# (reducing per 32-element block costs several times more). Offsets and minimums are folded out with
# per-block sums of x. Inner loops index per-block slices with the loop variable only: a
# computed signed index (b*32 + l) makes numba emit a negative-index wraparound select per
# element, which LLVM turns into gathers. bits_f32/i8_f32 keep the decode in 32-bit lanes.
ROWS = 8


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _gemv_f32(w, x, sx16, sx32, out):
    for r in prange(w.shape[0]):
        wr = w[r]
        acc = _F0
        for j in range(wr.shape[0]):
            acc += wr[j] * x[j]
        out[r] = acc


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _gemv_f16(w, lut, x, sx16, sx32, out):
    for r in prange(w.shape[0]):
        wr = w[r]
        acc = _F0
        for j in range(wr.shape[0]):
            acc += lut[wr[j]] * x[j]
        out[r] = acc


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _gemv_bf16(w, x, sx16, sx32, out):
    K = w.shape[1]
    N = w.shape[0]
    for ch in prange((N + ROWS - 1) // ROWS):
        buf = np.empty(K, np.uint32)
        f = buf.view(np.float32)
        for r in range(ch * ROWS, min(N, ch * ROWS + ROWS)):
            wr = w[r]
            for j in range(K):
                buf[j] = np.uint32(wr[j]) << np.uint32(16)
            acc = _F0
            for j in range(K):
                acc += f[j] * x[j]
            out[r] = acc


@njit(fastmath=FAST, cache=True, error_model="numpy", inline="always")
def _q4_pair(q, l, xb, o):
    """Low and high nibble of q[l] times x at block offset o (elements o+l, o+16+l)."""
    return bits_f32(q[l], 0, q[l], 0, 0) * xb[o + l] + bits_f32(q[l], 4, q[l], 0, 0) * xb[o + 16 + l]


@njit(fastmath=FAST, cache=True, error_model="numpy", inline="always")
def _q5_pair(q, l, h, xb, o):
    return bits_f32(q[l], 0, h, l, 1) * xb[o + l] + bits_f32(q[l], 4, h, l + 16, 1) * xb[o + 16 + l]


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _gemv_q4_0(d, qs, x, sx16, sx32, out):
    N, nb = d.shape
    ng = nb // 4
    for ch in prange((N + ROWS - 1) // ROWS):
        part = np.empty(ng, np.float32)  # per-group sums: no loop-carried reduction chain
        for r in range(ch * ROWS, min(N, ch * ROWS + ROWS)):
            for g in range(ng):
                d0, d1, d2, d3 = d[r, 4 * g], d[r, 4 * g + 1], d[r, 4 * g + 2], d[r, 4 * g + 3]
                q = qs[r, 64 * g:64 * g + 64]
                xb = x[128 * g:128 * g + 128]
                s = _F0
                for l in range(16):
                    s += (d0 * _q4_pair(q, l, xb, 0) + d1 * _q4_pair(q, 16 + l, xb, 16)) + \
                     (d2 * _q4_pair(q, 32 + l, xb, 32) + d3 * _q4_pair(q, 48 + l, xb, 48))
                part[g] = s
            tot = _F0
            for g in range(ng):
                tot += part[g]
            for b in range(4 * ng, nb):
                q = qs[r, b * 16:b * 16 + 16]
                xb = x[b * 32:b * 32 + 32]
                s = _F0
                for l in range(16):
                    s += _q4_pair(q, l, xb, 0)
                tot += d[r, b] * s
            off = _F0
            for b in range(nb):
                off += d[r, b] * sx32[b]
            out[r] = tot - np.float32(8.0) * off


_IQ4_NL_F32 = IQ4_NL_VALUES.astype(np.float32)


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _gemv_iq4_nl(d, qs, x, sx16, sx32, out):
    """Q4_0's gemv with the non-linear levels read from a 16-entry table (no offset to fold out)."""
    N, nb = d.shape
    for r in prange(N):
        tot = _F0
        for b in range(nb):
            q = qs[r, b * 16:b * 16 + 16]
            xb = x[b * 32:b * 32 + 32]
            s = _F0
            for l in range(16):
                s += _IQ4_NL_F32[q[l] & 15] * xb[l] + _IQ4_NL_F32[q[l] >> 4] * xb[16 + l]
            tot += d[r, b] * s
        out[r] = tot


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _gemv_q4_1(d, m, qs, x, sx16, sx32, out):
    N, nb = d.shape
    ng = nb // 4
    for ch in prange((N + ROWS - 1) // ROWS):
        part = np.empty(ng, np.float32)  # per-group sums: no loop-carried reduction chain
        for r in range(ch * ROWS, min(N, ch * ROWS + ROWS)):
            for g in range(ng):
                d0, d1, d2, d3 = d[r, 4 * g], d[r, 4 * g + 1], d[r, 4 * g + 2], d[r, 4 * g + 3]
                q = qs[r, 64 * g:64 * g + 64]
                xb = x[128 * g:128 * g + 128]
                s = _F0
                for l in range(16):
                    s += (d0 * _q4_pair(q, l, xb, 0) + d1 * _q4_pair(q, 16 + l, xb, 16)) + \
                     (d2 * _q4_pair(q, 32 + l, xb, 32) + d3 * _q4_pair(q, 48 + l, xb, 48))
                part[g] = s
            tot = _F0
            for g in range(ng):
                tot += part[g]
            for b in range(4 * ng, nb):
                q = qs[r, b * 16:b * 16 + 16]
                xb = x[b * 32:b * 32 + 32]
                s = _F0
                for l in range(16):
                    s += _q4_pair(q, l, xb, 0)
                tot += d[r, b] * s
            off = _F0
            for b in range(nb):
                off += m[r, b] * sx32[b]
            out[r] = tot + off


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _gemv_q5_0(d, qh, qs, x, sx16, sx32, out):
    N, nb = d.shape
    ng = nb // 4
    for ch in prange((N + ROWS - 1) // ROWS):
        part = np.empty(ng, np.float32)  # per-group sums: no loop-carried reduction chain
        for r in range(ch * ROWS, min(N, ch * ROWS + ROWS)):
            for g in range(ng):
                d0, d1, d2, d3 = d[r, 4 * g], d[r, 4 * g + 1], d[r, 4 * g + 2], d[r, 4 * g + 3]
                h0, h1, h2, h3 = qh[r, 4 * g], qh[r, 4 * g + 1], qh[r, 4 * g + 2], qh[r, 4 * g + 3]
                q = qs[r, 64 * g:64 * g + 64]
                xb = x[128 * g:128 * g + 128]
                s = _F0
                for l in range(16):
                    s += (d0 * _q5_pair(q, l, h0, xb, 0) + d1 * _q5_pair(q[16:], l, h1, xb, 32)) + \
                     (d2 * _q5_pair(q[32:], l, h2, xb, 64) + d3 * _q5_pair(q[48:], l, h3, xb, 96))
                part[g] = s
            tot = _F0
            for g in range(ng):
                tot += part[g]
            for b in range(4 * ng, nb):
                q = qs[r, b * 16:b * 16 + 16]
                xb = x[b * 32:b * 32 + 32]
                s = _F0
                for l in range(16):
                    s += _q5_pair(q, l, qh[r, b], xb, 0)
                tot += d[r, b] * s
            off = _F0
            for b in range(nb):
                off += d[r, b] * sx32[b]
            out[r] = tot - np.float32(16.0) * off


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _gemv_q5_1(d, m, qh, qs, x, sx16, sx32, out):
    N, nb = d.shape
    ng = nb // 4
    for ch in prange((N + ROWS - 1) // ROWS):
        part = np.empty(ng, np.float32)  # per-group sums: no loop-carried reduction chain
        for r in range(ch * ROWS, min(N, ch * ROWS + ROWS)):
            for g in range(ng):
                d0, d1, d2, d3 = d[r, 4 * g], d[r, 4 * g + 1], d[r, 4 * g + 2], d[r, 4 * g + 3]
                h0, h1, h2, h3 = qh[r, 4 * g], qh[r, 4 * g + 1], qh[r, 4 * g + 2], qh[r, 4 * g + 3]
                q = qs[r, 64 * g:64 * g + 64]
                xb = x[128 * g:128 * g + 128]
                s = _F0
                for l in range(16):
                    s += (d0 * _q5_pair(q, l, h0, xb, 0) + d1 * _q5_pair(q[16:], l, h1, xb, 32)) + \
                     (d2 * _q5_pair(q[32:], l, h2, xb, 64) + d3 * _q5_pair(q[48:], l, h3, xb, 96))
                part[g] = s
            tot = _F0
            for g in range(ng):
                tot += part[g]
            for b in range(4 * ng, nb):
                q = qs[r, b * 16:b * 16 + 16]
                xb = x[b * 32:b * 32 + 32]
                s = _F0
                for l in range(16):
                    s += _q5_pair(q, l, qh[r, b], xb, 0)
                tot += d[r, b] * s
            off = _F0
            for b in range(nb):
                off += m[r, b] * sx32[b]
            out[r] = tot + off


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _gemv_q8_0(d, qs, x, sx16, sx32, out):
    N, nb = d.shape
    ng = nb // 4
    for ch in prange((N + ROWS - 1) // ROWS):
        part = np.empty(ng, np.float32)  # per-group sums: no loop-carried reduction chain
        for r in range(ch * ROWS, min(N, ch * ROWS + ROWS)):
            for g in range(ng):
                d0, d1, d2, d3 = d[r, 4 * g], d[r, 4 * g + 1], d[r, 4 * g + 2], d[r, 4 * g + 3]
                q = qs[r, 128 * g:128 * g + 128]
                xb = x[128 * g:128 * g + 128]
                s = _F0
                for l in range(32):
                    s += (d0 * (i8_f32(q[l]) * xb[l]) + d1 * (i8_f32(q[32 + l]) * xb[32 + l])) + \
                     (d2 * (i8_f32(q[64 + l]) * xb[64 + l]) + d3 * (i8_f32(q[96 + l]) * xb[96 + l]))
                part[g] = s
            tot = _F0
            for g in range(ng):
                tot += part[g]
            for b in range(4 * ng, nb):
                q = qs[r, b * 32:b * 32 + 32]
                xb = x[b * 32:b * 32 + 32]
                s = _F0
                for l in range(32):
                    s += i8_f32(q[l]) * xb[l]
                tot += d[r, b] * s
            out[r] = tot


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _gemv_q4_k(d, dmin, sc, mn, qs, x, sx16, sx32, out):
    # 256-element super-block: byte l of 32-byte group c holds elements 64c+l (low nibble,
    # sub-block 2c) and 64c+32+l (high nibble, sub-block 2c+1).
    N, nb = d.shape
    for ch in prange((N + ROWS - 1) // ROWS):
        for r in range(ch * ROWS, min(N, ch * ROWS + ROWS)):
            tot = _F0
            off = _F0
            for b in range(nb):
                s = sc[r, b * 8:b * 8 + 8]
                s0, s1, s2, s3 = np.float32(s[0]), np.float32(s[1]), np.float32(s[2]), np.float32(s[3])
                s4, s5, s6, s7 = np.float32(s[4]), np.float32(s[5]), np.float32(s[6]), np.float32(s[7])
                q = qs[r, b * 128:b * 128 + 128]
                xb = x[b * 256:b * 256 + 256]
                bs = _F0
                for l in range(32):
                    v0, v1, v2, v3 = q[l], q[32 + l], q[64 + l], q[96 + l]
                    bs += (s0 * (bits_f32(v0, 0, v0, 0, 0) * xb[l]) + s2 * (bits_f32(v1, 0, v1, 0, 0) * xb[64 + l])) + \
                          (s4 * (bits_f32(v2, 0, v2, 0, 0) * xb[128 + l]) + s6 * (bits_f32(v3, 0, v3, 0, 0) * xb[192 + l]))
                    bs += (s1 * (bits_f32(v0, 4, v0, 0, 0) * xb[32 + l]) + s3 * (bits_f32(v1, 4, v1, 0, 0) * xb[96 + l])) + \
                          (s5 * (bits_f32(v2, 4, v2, 0, 0) * xb[160 + l]) + s7 * (bits_f32(v3, 4, v3, 0, 0) * xb[224 + l]))
                ms = _F0
                for j in range(8):
                    ms += np.float32(mn[r, b * 8 + j]) * sx32[b * 8 + j]
                tot += d[r, b] * bs
                off += dmin[r, b] * ms
            out[r] = tot - off


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _gemv_q5_k(d, dmin, sc, mn, qh, qs, x, sx16, sx32, out):
    # as Q4_K, plus bit j of qh[l] is the 5th bit of element l of sub-block j.
    N, nb = d.shape
    for ch in prange((N + ROWS - 1) // ROWS):
        for r in range(ch * ROWS, min(N, ch * ROWS + ROWS)):
            tot = _F0
            off = _F0
            for b in range(nb):
                s = sc[r, b * 8:b * 8 + 8]
                s0, s1, s2, s3 = np.float32(s[0]), np.float32(s[1]), np.float32(s[2]), np.float32(s[3])
                s4, s5, s6, s7 = np.float32(s[4]), np.float32(s[5]), np.float32(s[6]), np.float32(s[7])
                q = qs[r, b * 128:b * 128 + 128]
                hb = qh[r, b * 32:b * 32 + 32]
                xb = x[b * 256:b * 256 + 256]
                bs = _F0
                for l in range(32):
                    v0, v1, v2, v3, h = q[l], q[32 + l], q[64 + l], q[96 + l], hb[l]
                    bs += (s0 * (bits_f32(v0, 0, h, 0, 1) * xb[l]) + s2 * (bits_f32(v1, 0, h, 2, 1) * xb[64 + l])) + \
                          (s4 * (bits_f32(v2, 0, h, 4, 1) * xb[128 + l]) + s6 * (bits_f32(v3, 0, h, 6, 1) * xb[192 + l]))
                    bs += (s1 * (bits_f32(v0, 4, h, 1, 1) * xb[32 + l]) + s3 * (bits_f32(v1, 4, h, 3, 1) * xb[96 + l])) + \
                          (s5 * (bits_f32(v2, 4, h, 5, 1) * xb[160 + l]) + s7 * (bits_f32(v3, 4, h, 7, 1) * xb[224 + l]))
                ms = _F0
                for j in range(8):
                    ms += np.float32(mn[r, b * 8 + j]) * sx32[b * 8 + j]
                tot += d[r, b] * bs
                off += dmin[r, b] * ms
            out[r] = tot - off


@njit(fastmath=FAST, cache=True, error_model="numpy", inline="always")
def _q6_quad(lq, hq, xb, l, c0, c1, c2, c3):
    """Elements l, 32+l, 64+l, 96+l of a 128-element Q6_K half, scaled by c0..c3."""
    return (c0 * (bits_f32(lq[l], 0, hq[l], 0, 3) * xb[l]) + c1 * (bits_f32(lq[32 + l], 0, hq[l], 2, 3) * xb[32 + l])) + \
           (c2 * (bits_f32(lq[l], 4, hq[l], 4, 3) * xb[64 + l]) + c3 * (bits_f32(lq[32 + l], 4, hq[l], 6, 3) * xb[96 + l]))


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _gemv_q6_k(d, sc, ql, qh, x, sx16, sx32, out):
    # layout: see quant._deq_q6_k. In half h, lane l (0..31) feeds elements l, 32+l, 64+l, 96+l
    # (ql[l] and ql[32+l] both nibbles, 2-bit fields of qh[l]); element e has scale e // 16,
    # i.e. 8h + 2s + (l >= 16) for stream s. One 16-lane loop covers all 16 scales.
    N, nb = d.shape
    for ch in prange((N + ROWS - 1) // ROWS):
        for r in range(ch * ROWS, min(N, ch * ROWS + ROWS)):
            tot = _F0
            off = _F0
            for b in range(nb):
                s = sc[r, b * 16:b * 16 + 16]
                a0, a1, a2, a3 = np.float32(s[0]), np.float32(s[2]), np.float32(s[4]), np.float32(s[6])
                b0, b1, b2, b3 = np.float32(s[1]), np.float32(s[3]), np.float32(s[5]), np.float32(s[7])
                c0, c1, c2, c3 = np.float32(s[8]), np.float32(s[10]), np.float32(s[12]), np.float32(s[14])
                e0, e1, e2, e3 = np.float32(s[9]), np.float32(s[11]), np.float32(s[13]), np.float32(s[15])
                lq0 = ql[r, b * 128:b * 128 + 64]
                lq1 = ql[r, b * 128 + 64:b * 128 + 128]
                hq0 = qh[r, b * 64:b * 64 + 32]
                hq1 = qh[r, b * 64 + 32:b * 64 + 64]
                x0 = x[b * 256:b * 256 + 128]
                x1 = x[b * 256 + 128:b * 256 + 256]
                bs = _F0
                for l in range(16):
                    bs += (_q6_quad(lq0, hq0, x0, l, a0, a1, a2, a3) + _q6_quad(lq0, hq0, x0, 16 + l, b0, b1, b2, b3)) + \
                          (_q6_quad(lq1, hq1, x1, l, c0, c1, c2, c3) + _q6_quad(lq1, hq1, x1, 16 + l, e0, e1, e2, e3))
                so = _F0
                for j in range(16):
                    so += np.float32(s[j]) * sx16[b * 16 + j]
                tot += d[r, b] * bs
                off += d[r, b] * so
            out[r] = tot - np.float32(32.0) * off


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _gemv_q2_k(d, dmin, sc, qs, x, sx16, sx32, out):
    # layout: see quant._deq_q2_k. Per 16 elements one scale and one minimum (folded out with sx16).
    N, nb = d.shape
    for ch in prange((N + ROWS - 1) // ROWS):
        for r in range(ch * ROWS, min(N, ch * ROWS + ROWS)):
            tot = _F0
            off = _F0
            for b in range(nb):
                bs = _F0
                ms = _F0
                for j in range(16):
                    v = sc[r, b * 16 + j]
                    o = b * 64 + (j // 8) * 32 + (j % 2) * 16
                    q = qs[r, o:o + 16]
                    xb = x[b * 256 + j * 16:b * 256 + j * 16 + 16]
                    sh = 2 * ((j % 8) // 2)
                    t = _F0
                    for l in range(16):
                        t += np.float32((q[l] >> sh) & 3) * xb[l]
                    bs += np.float32(v & 15) * t
                    ms += np.float32(v >> 4) * sx16[b * 16 + j]
                tot += d[r, b] * bs
                off += dmin[r, b] * ms
            out[r] = tot - off


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _gemv_q3_k(d, sc, hm, qs, x, sx16, sx32, out):
    # layout: see quant._deq_q3_k. q = (low | bit << 2) - 4: the -4 folded out with sx16.
    N, nb = d.shape
    for ch in prange((N + ROWS - 1) // ROWS):
        for r in range(ch * ROWS, min(N, ch * ROWS + ROWS)):
            tot = _F0
            for b in range(nb):
                bs = _F0
                for j in range(16):
                    o = (j // 8) * 32 + (j % 2) * 16
                    q = qs[r, b * 64 + o:b * 64 + o + 16]
                    h = hm[r, b * 32 + (j % 2) * 16:b * 32 + (j % 2) * 16 + 16]
                    xb = x[b * 256 + j * 16:b * 256 + j * 16 + 16]
                    sl = 2 * ((j % 8) // 2)
                    sb = (j // 8) * 4 + (j % 8) // 2
                    t = _F0
                    for l in range(16):
                        t += np.float32(((q[l] >> sl) & 3) | (((h[l] >> sb) & 1) << 2)) * xb[l]
                    bs += np.float32(sc[r, b * 16 + j]) * (t - np.float32(4.0) * sx16[b * 16 + j])
                tot += d[r, b] * bs
            out[r] = tot


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _gemv_iq4_xs(d, sc, qs, x, sx16, sx32, out):
    """IQ4_NL's gemv with a 6-bit scale per 32 elements."""
    N, nb = d.shape
    for ch in prange((N + ROWS - 1) // ROWS):
        for r in range(ch * ROWS, min(N, ch * ROWS + ROWS)):
            tot = _F0
            for b in range(nb):
                bs = _F0
                for c in range(8):
                    q = qs[r, b * 128 + c * 16:b * 128 + c * 16 + 16]
                    xb = x[b * 256 + c * 32:b * 256 + c * 32 + 32]
                    s = _F0
                    for l in range(16):
                        s += _IQ4_NL_F32[q[l] & 15] * xb[l] + _IQ4_NL_F32[q[l] >> 4] * xb[16 + l]
                    bs += np.float32(sc[r, b * 8 + c]) * s
                tot += d[r, b] * bs
            out[r] = tot


_GEMV = {
    F32: _gemv_f32, F16: _gemv_f16, BF16: _gemv_bf16, Q4_0: _gemv_q4_0, Q4_1: _gemv_q4_1, Q5_0: _gemv_q5_0,
    Q5_1: _gemv_q5_1, Q8_0: _gemv_q8_0, Q4_K: _gemv_q4_k, Q5_K: _gemv_q5_k, Q6_K: _gemv_q6_k, IQ4_NL: _gemv_iq4_nl,
    Q2_K: _gemv_q2_k, Q3_K: _gemv_q3_k, IQ4_XS: _gemv_iq4_xs,
}
_GEMV_SERIAL = {t: serial_twin(k) for t, k in _GEMV.items()}
# weights smaller than this (e.g. a 128x896 k_proj) are read on the calling thread
GEMV_PAR_MIN_BYTES = 1 << 18


@njit(fastmath=FAST, cache=True, error_model="numpy")
def _block_sums(x, sx16, sx32):
    """Sums of x over 16- and 32-element blocks (for the folded offsets/minimums)."""
    for i in range(sx16.shape[0]):
        s = _F0
        for j in range(16):
            s += x[i * 16 + j]
        sx16[i] = s
    for i in range(sx32.shape[0]):
        sx32[i] = sx16[2 * i] + sx16[2 * i + 1]


@njit(parallel=True, cache=True, error_model="numpy")
def _f32_to_bf16(src, dst):
    bits = src.view(np.uint32)
    for i in prange(src.shape[0]):
        for j in range(src.shape[1]):
            u = bits[i, j]
            # round to nearest even, as torch/ggml do (inputs are finite)
            dst[i, j] = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


def f32_to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 (R, C) -> bf16 bit patterns uint16 (R, C), round-to-nearest-even."""
    a = np.ascontiguousarray(a, np.float32)
    out = np.empty(a.shape, np.uint16)
    _f32_to_bf16(a, out)
    return out


@njit(parallel=True, cache=True, error_model="numpy")
def _bf16_into(src, out, c0):
    """out[:, c0:c0+C] = bf16 bits src (R, C) as float32."""
    bits = out.view(np.uint32)
    for i in prange(src.shape[0]):
        for j in range(src.shape[1]):
            bits[i, c0 + j] = np.uint32(np.uint16(src[i, j])) << np.uint32(16)


class QMatrix:
    """A GGUF weight W (n_rows=N, n_cols=K) kept in its quantized form.

    The blocks are repacked once into per-field arrays (quant.repack); nothing is
    dequantized permanently. gemv/gemm compute x @ W.T, rows() gathers dequantized rows.
    """

    # gemm: up to this many input rows run as repeated gemv (weights read once per row anyway
    # are cheaper than a dequantize-plus-GEMM pass).
    GEMV_MAX_M = 4
    # gemm: elements of W dequantized per tile (16 MiB f32 + 8 MiB bf16 transient); smaller
    # tiles shrink the GEMM N dimension and lose oneDNN efficiency.
    TILE_ELEMS = 1 << 22

    def __init__(self, raw: np.ndarray | None, ggml_type: int, n_rows: int, n_cols: int,
                 exact: np.ndarray | None = None, build_exact: bool = True):
        ggml_type = int(ggml_type)
        if ggml_type not in SUPPORTED_TYPES:
            raise NotImplementedError(f"ggml type {TYPE_NAMES.get(ggml_type, ggml_type)} is not supported")
        self.ggml_type = ggml_type
        self.n_rows = int(n_rows)
        self.n_cols = int(n_cols)
        self.raw = raw
        # The exact kernels' layout (qdot.exact_layout): the GGUF rows themselves, or for Q4_K the
        # x8 repack, which `exact` may bring from an earlier load (the models layer caches it on
        # disk). The float kernels' per-field layout is only built if they ever run.
        if raw is not None:                       # the GGUF data must hold exactly n_rows rows
            blk, size = GGML_BLOCK[ggml_type]
            row_bytes = self.n_cols // blk * size
            n_bytes = np.asarray(raw).view(np.uint8).size
            if self.n_cols % blk or n_bytes != self.n_rows * row_bytes:
                raise ValueError(f"data holds {n_bytes} bytes, expected {self.n_rows} rows of {row_bytes}")
        # build_exact=False: a member of a fused group (models.transformer.Projections), whose exact
        # kernels run on the group's layout; raw=None: such a group, which has only that layout.
        if exact is not None:
            self.exact = np.asarray(exact)
            held = TRAITS[ggml_type].layout_rows(self.exact)
            if not 0 <= held - self.n_rows < 8:
                raise ValueError(f"layout holds {held} rows, expected {self.n_rows}")
        else:
            self.exact = qdot.exact_layout(raw, ggml_type, self.n_rows, self.n_cols) if build_exact else None
        self._packed = None                       # the float kernels' layout: built on first use
        self.nbytes = int(self.exact.nbytes if self.exact is not None else np.asarray(raw).nbytes)

    @property
    def packed(self) -> tuple:
        """The float kernels' per-field layout (built on first use for the exact types)."""
        if self._packed is None:
            if self.raw is None:
                raise ValueError(f"{self!r} is a fused group: it has only the exact layout")
            self._packed = repack(self.raw, self.ggml_type, self.n_cols)
        return self._packed

    @property
    def shape(self) -> tuple[int, int]:
        return self.n_rows, self.n_cols

    def __repr__(self) -> str:
        return f"QMatrix({TYPE_NAMES[self.ggml_type]}, {self.n_rows}x{self.n_cols}, {self.nbytes / 2**20:.1f} MiB)"

    def _check_x(self, x: np.ndarray, ndim: int) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != ndim or x.shape[-1] != self.n_cols:
            raise ValueError(f"x has shape {x.shape}, expected {'(M, ' if ndim == 2 else '('}{self.n_cols},)")
        return x

    def _gemv_into(self, x: np.ndarray, out: np.ndarray) -> None:
        K = self.n_cols
        if self.ggml_type in (F32, F16, BF16):
            sx16 = sx32 = _EMPTY
        else:
            sx16 = np.empty(K // 16, np.float32)
            sx32 = np.empty(K // 32, np.float32)
            _block_sums(x, sx16, sx32)
        kernel = (_GEMV if self.nbytes >= GEMV_PAR_MIN_BYTES else _GEMV_SERIAL)[self.ggml_type]
        if self.ggml_type == F16:
            kernel(self.packed[0], F16_LUT, x, sx16, sx32, out)
        else:
            kernel(*self.packed, x, sx16, sx32, out)

    def matmul_int8(self, rows: Int8Rows, n_out: int | None = None, runs=None) -> np.ndarray:
        """Quantized activation rows (M, K) -> rows @ W.T (M, N) on the exact kernels (only where
        self.exact is set): llama.cpp's result bit for bit, W read once for all M rows.
        n_out: only the first n_out rows of W (a draft model's truncated vocabulary); runs: see
        qdot.matmul."""
        if self.exact is None:
            raise ValueError(f"{self!r} has no exact int8 kernel")
        return qdot.matmul(self.exact, self.ggml_type, rows, self.n_rows if n_out is None else min(n_out, self.n_rows), runs)

    def gemv(self, x: np.ndarray) -> np.ndarray:
        """x (K,) -> x @ W.T (N,). Decode path, reads W once."""
        x = self._check_x(x, 1)
        out = np.empty(self.n_rows, np.float32)
        self._gemv_into(x, out)
        return out

    def gemm(self, x: np.ndarray) -> np.ndarray:
        """x (M, K) -> x @ W.T (M, N). Prefill path: bf16 GEMM over dequantized tiles of W.

        x, W and the result are rounded to bf16 (relative 2^-9 each), like a bf16 GPU path;
        the accumulation is fp32."""
        x = self._check_x(x, 2)
        M = x.shape[0]
        out = np.empty((M, self.n_rows), np.float32)
        if M <= self.GEMV_MAX_M:
            for i in range(M):
                self._gemv_into(x[i], out[i])
            return out
        import torch  # deferred: importing torch costs ~1 s and decode never needs it

        xb = torch.from_numpy(f32_to_bf16(x)).view(torch.bfloat16)
        tile = max(16, self.TILE_ELEMS // self.n_cols // 16 * 16)
        for r0 in range(0, self.n_rows, tile):
            r1 = min(self.n_rows, r0 + tile)
            wb = torch.from_numpy(f32_to_bf16(self.row_range(r0, r1))).view(torch.bfloat16)
            y = torch.matmul(xb, wb.T)  # (M, r1-r0) bf16; oneDNN accumulates in fp32
            _bf16_into(y.view(torch.int16).numpy(), out, r0)
        return out

    def row_range(self, r0: int, r1: int) -> np.ndarray:
        """Dequantized rows W[r0:r1] (r1 - r0, K) float32; a slice of the GGUF data, no gather."""
        if self._packed is None and self.raw.ndim == 2:
            part = repack(self.raw[r0:r1], self.ggml_type, self.n_cols)
            return dequantize_rows(part, self.ggml_type, self.n_cols, np.arange(r1 - r0))
        return self.rows(np.arange(r0, r1))

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantized rows W[ids] (len(ids), K) float32, e.g. an embedding lookup."""
        ids = np.asarray(ids)
        if self._packed is None and self.raw.ndim == 2:        # repack just these rows of the GGUF data
            part = repack(np.ascontiguousarray(self.raw[ids]), self.ggml_type, self.n_cols)
            return dequantize_rows(part, self.ggml_type, self.n_cols, np.arange(len(ids)))
        return dequantize_rows(self.packed, self.ggml_type, self.n_cols, ids)

    def dequantize(self) -> np.ndarray:
        """The whole W as float32 (tests, small tensors)."""
        return self.rows(np.arange(self.n_rows))
