"""Quantized matrix products that round exactly as llama.cpp's AVX2 build does.

llama.cpp never multiplies a quantized weight by a float activation: it quantizes the activation
row (q8_0 for Q5_0/Q8_0 weights, q8_K for the K-quants), takes exact integer dot products, and
folds them into float32 accumulators with fused multiply-adds. Which integers are summed before
each float step depends on the kernel it picks, so we reproduce each one (read from llama.cpp
0.3.36's ggml-cpu sources; the numpy models in kernels/reference.py say the same in plain code):

- Q8_0 / Q5_0 (ggml_vec_dot_q*_q8_0 for one row, tinyBLAS_Q0_AVX for more; the same numbers):
  per output 8 float lanes; lane k of block b gets fma(d_w*d_x, sum of the 4 products at 4k..4k+3);
  at the end hsum_float_8.
- Q4_K (weights repacked 8 rows at a time, ggml_gemv/gemm_q4_K_8x8_q8_K): per output
  acc += float(sum_j sc_j*dot_j) * (d_w*d_x), acc_min += float(sum_j mn_j*bsum_j) * (dmin_w*d_x),
  result acc - acc_min; gemv does one step per 256-element super-block, gemm (rows in groups of 4
  when there are more than 3) one per pair of 32-element sub-blocks.
- Q6_K: fewer than 8 rows: ggml_vec_dot_q6_K_q8_K (8 lanes per super-block, hsum_float_8);
  8 rows or more: the tiled kernel (one exact integer per super-block, d_w*float(S), then
  out = fma(that, d_x, out)).

Each kernel here gives every output exactly those float operations, so the results equal
llama.cpp's bit for bit while the work is organised for this machine: decode streams every
weight byte once per token, a prompt reuses each unpacked weight panel for all its rows.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels import types as T
from kernels.cpu.ops import f16_bits, f16_value, serial_twin
from kernels.types import ACT_Q8_0, ACT_Q8_K, TRAITS
from kernels.cpu.simd import (
    HAS_AVX2, V8F, prefetch, V8I, V16B, V16S, V32B, V8H, array, byte_ptr, c32, c64, call, f16, f32, fma, hsum8, i8, i32,
    load_as, madd16, maddubs, psign, splat, vconst, vload, vstore,
)

Q8_0_BLOCK, Q5_0_BLOCK = 34, 22   # bytes per 32-element GGUF block
NB_PAD = 8                        # the per-block scale arrays are padded to a multiple of this
PREFETCH = 4096                   # decode reads each weight once per token: fetch this far ahead


# --- Q8_0 / Q5_0 --------------------------------------------------------------------------------

# Prompt-sized batches of Q5_0 rows: a panel of PANEL weight rows is unpacked once into int8 (q - 16,
# at most 16 in magnitude) with each block's correction 128 * (sum of each 4-group of w), and the
# activations are stored biased, x + 128 as uint8. Then vpmaddubsw(x + 128, w) cannot saturate
# (2 * 255 * 16 < 32767) and its 4-sums minus the correction are the exact dots: no sign
# instructions, which on Zen 3 share ports with the conversions and the FMAs (1.9 against 2.3 cycles
# per (row, row, block)). d_w * d_x for the tile is computed once per call, 8 blocks per multiply.
PANEL = 16
PANEL_NR, PANEL_MR = 2, 3


def _q5_0_panel_kernel(NR: int, MR: int):
    """kern(wp, cp, dwp, j0, xb, dxb, g, D, out, n0, m0, m_valid): out[m0+i, n0+j0+j] for j < NR and
    i < min(MR, m_valid). wp (P, nb, 32) int8 values, cp (P, nb, 8) int32 corrections, dwp (P, nbp)
    float32 scales of the panel; xb (G, nb, MR, 32) uint8 biased activations, dxb (G, MR, nbp) their
    scales; D (NR*MR, nbp) float32 scratch."""

    def kern(typingctx, wp, cp, dwp, j0, xb, dxb, g, D, out, n0, m0, m_valid):
        sig = types.void(wp, cp, dwp, j0, xb, dxb, g, D, out, n0, m0, m_valid)

        def codegen(context, builder, signature, args):
            wa, ca, dwa, _, xa, dxa, _, Da, oa = (array(context, builder, signature.args[k], args[k])
                                                  if k not in (3, 6) else None for k in range(9))
            j0v, gv, n0v, m0v, m_valid = args[3], args[6], args[9], args[10], args[11]
            nb = builder.extract_value(wa.shape, 1)
            nbp = builder.extract_value(dwa.shape, 1)
            N = builder.extract_value(oa.shape, 1)
            wbase = byte_ptr(builder, wa.data)
            cbase = byte_ptr(builder, ca.data)
            # D[j*MR + i, b] = d_w[j0+j, b] * d_x[i, b], 8 blocks per step (the arrays are padded)
            dw_rows = [builder.gep(dwa.data, [builder.mul(builder.add(j0v, c64(j)), nbp)]) for j in range(NR)]
            dx_rows = [builder.gep(dxa.data, [builder.mul(builder.add(builder.mul(gv, c64(MR)), c64(i)), nbp)])
                       for i in range(MR)]
            with cgutils.for_range_slice(builder, c64(0), nbp, c64(8)) as (b, _):
                dwv = [vload(builder, builder.gep(r, [b]), V8F) for r in dw_rows]
                for j in range(NR):
                    for i in range(MR):
                        dst = builder.gep(Da.data, [builder.add(builder.mul(c64(j * MR + i), nbp), b)])
                        vstore(builder, builder.fmul(dwv[j], vload(builder, builder.gep(dx_rows[i], [b]), V8F)), dst)
            row_w = builder.mul(nb, c64(32))
            wrow = [builder.gep(wbase, [builder.mul(builder.add(j0v, c64(j)), row_w)]) for j in range(NR)]
            crow = [builder.gep(cbase, [builder.mul(builder.add(j0v, c64(j)), row_w)]) for j in range(NR)]
            xg = builder.gep(byte_ptr(builder, xa.data), [builder.mul(gv, builder.mul(nb, c64(MR * 32)))])
            zero = ir.Constant(V8F, [0.0] * 8)
            accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(NR)] for _ in range(MR)]
            ones = vconst(V16S, 1)
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                off = builder.mul(b, c64(32))
                ws = [vload(builder, builder.gep(wrow[j], [off]), V32B) for j in range(NR)]
                cs = [vload(builder, builder.gep(crow[j], [off]), V8I) for j in range(NR)]
                xb_b = builder.gep(xg, [builder.mul(b, c64(MR * 32))])
                for i in range(MR):
                    x = vload(builder, builder.gep(xb_b, [c64(32 * i)]), V32B)
                    for j in range(NR):
                        isum = builder.sub(madd16(builder, maddubs(builder, x, ws[j]), ones), cs[j])
                        dp = builder.gep(Da.data, [builder.add(builder.mul(c64(j * MR + i), nbp), b)])
                        scale = splat(builder, builder.load(dp), V8F)
                        acc = accs[i][j]
                        builder.store(fma(builder, scale, builder.sitofp(isum, V8F), builder.load(acc)), acc)
            for i in range(MR):
                with builder.if_then(builder.icmp_signed("<", c64(i), m_valid)):
                    for j in range(NR):
                        row = builder.add(m0v, c64(i))
                        col = builder.add(n0v, builder.add(j0v, c64(j)))
                        idx = builder.add(builder.mul(row, N), col)
                        builder.store(hsum8(builder, builder.load(accs[i][j])), builder.gep(oa.data, [idx]))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"q5_0_panel_{NR}x{MR}"
    return intrinsic(kern)


q5_0_panel = _q5_0_panel_kernel(PANEL_NR, PANEL_MR)


@njit(parallel=True, cache=True, error_model="numpy")
def _bias_groups(xq, dx, MR, xb, dxb):
    """q8_0 rows -> groups of MR rows: xb (G, nb, MR, 32) uint8 = x + 128 (zero rows pad the last
    group), dxb (G, MR, nbp) scales (zero padding)."""
    M, K = xq.shape
    nb = K // 32
    for g in prange(xb.shape[0]):
        for i in range(MR):
            m = g * MR + i
            for b in range(nb):
                for e in range(32):
                    xb[g, b, i, e] = np.uint8(np.int32(xq[m, b * 32 + e]) + 128) if m < M else np.uint8(128)
            for b in range(dxb.shape[2]):
                dxb[g, i, b] = dx[m, b] if (m < M and b < nb) else np.float32(0.0)


@njit(parallel=True, cache=True, error_model="numpy")
def _q5_0_prompt(wx8, xb, dxb, M, out):
    """Q5_0 (x8 layout) x biased activation groups -> out (M, N); prange over panels of PANEL rows,
    each unpacked once and used by every activation group."""
    n_groups = wx8.shape[0]
    N = n_groups * 8
    nb = xb.shape[1]
    nbp = dxb.shape[2]
    G = xb.shape[0]
    per_panel = PANEL // 8
    for p in prange((n_groups + per_panel - 1) // per_panel):
        wp = np.zeros((PANEL, nb, 32), np.int8)
        cp = np.zeros((PANEL, nb, 8), np.int32)
        dwp = np.zeros((PANEL, nbp), np.float32)
        D = np.empty((PANEL_NR * PANEL_MR, nbp), np.float32)
        g0 = p * per_panel
        ng = min(per_panel, n_groups - g0)
        _unpack_q5_0_x8_panel(wx8, g0, ng, wp, cp, dwp)
        r0 = g0 * 8
        for g in range(G):
            for j0 in range(0, ng * 8, PANEL_NR):
                q5_0_panel(wp, cp, dwp, j0, xb, dxb, g, D, out, r0, g * PANEL_MR, M - g * PANEL_MR)


Q8_0_KIND, Q5_0_KIND = 0, 1         # which weight format a q8_0-activation kernel reads


def q0_kind(ggml_type: int) -> int:
    return Q8_0_KIND if ggml_type == T.Q8_0 else Q5_0_KIND


# --- Q4_K: 8 weight rows in the 8 lanes ---------------------------------------------------------
# llama.cpp repacks Q4_K weights (ne[1] % 8 == 0) into 8-row groups and runs
# ggml_gemv_q4_K_8x8_q8_K / ggml_gemm_q4_K_8x8_q8_K, whose lanes are the 8 weight rows. Our layout
# keeps the bytes of GGUF (4% more for unpacked 6-bit scales) in the order our loop reads them. Per
# 8-row group and 256-element super-block, Q4K_X8_BYTES bytes:
#   qs [c 4][step 8][row 8][4 bytes]: GGUF qs bytes 32c+4step..+3 of each row; low nibbles are
#      elements 64c+4step..+3 (sub-block 2c), high nibbles elements 64c+32+4step..+3 (2c+1)
#   sc [c][row][2]: the 6-bit scales of sub-blocks 2c, 2c+1; mn [c][row][2]: their minimums
#   d [row] f16, dmin [row] f16
Q4K_X8_BYTES = 1024 + 64 + 64 + 16 + 16


def repack_q4_k_x8(raw: np.ndarray, n_cols: int) -> np.ndarray:
    """GGUF Q4_K data (N rows, N % 8 == 0) -> (N/8, nb * Q4K_X8_BYTES) uint8, layout above."""
    rows = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, n_cols // 256 * 144)
    N, nb = rows.shape[0], n_cols // 256
    if N % 8:
        raise ValueError(f"Q4_K x8 layout needs a multiple of 8 rows, got {N}")
    G = N // 8
    k = rows.reshape(G, 8, nb, 144)
    s = k[..., 4:16].astype(np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)   # (G, 8, nb, 8)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    qs = k[..., 16:144].reshape(G, 8, nb, 4, 8, 4).transpose(0, 2, 3, 4, 1, 5)                        # G nb c step row 4
    sc_t = sc.reshape(G, 8, nb, 4, 2).transpose(0, 2, 3, 1, 4)                                       # G nb c row 2
    mn_t = mn.reshape(G, 8, nb, 4, 2).transpose(0, 2, 3, 1, 4)
    d = k[..., 0:2].transpose(0, 2, 1, 3)                                                             # G nb row 2
    dmin = k[..., 2:4].transpose(0, 2, 1, 3)
    parts = [qs.reshape(G, nb, 1024), sc_t.reshape(G, nb, 64), mn_t.reshape(G, nb, 64),
             d.reshape(G, nb, 16), dmin.reshape(G, nb, 16)]
    return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(G, nb * Q4K_X8_BYTES))


def _q4_k_kernel(MR: int, per_pair: bool):
    """kern(wx8, g, xq, dx, bsp, m0, out): out[m0+i, 8g..8g+8] for i < MR. wx8: repack_q4_k_x8;
    xq (M, K) int8, dx (M, nb) float32: q8_K rows; bsp (M, nb*4) int32: per 64 elements the two
    32-element sums of xq as two int16 (low: sub-block 2c, high: 2c+1). per_pair: llama.cpp's gemm
    (a float step per sub-block pair) instead of its gemv (one per super-block)."""

    def kern(typingctx, wx8, g, xq, dx, bsp, m0, out):
        sig = types.void(wx8, g, xq, dx, bsp, m0, out)

        def codegen(context, builder, signature, args):
            wa, _, xa, da, ba, _, oa = (array(context, builder, signature.args[k], args[k]) if k not in (1, 5) else None
                                        for k in range(7))
            gv, m0v = args[1], args[5]
            nb = builder.extract_value(da.shape, 1)
            K = builder.extract_value(xa.shape, 1)
            N = builder.extract_value(oa.shape, 1)
            group = builder.gep(byte_ptr(builder, wa.data), [builder.mul(gv, builder.mul(nb, c64(Q4K_X8_BYTES)))])
            xrow = [builder.gep(byte_ptr(builder, xa.data), [builder.mul(builder.add(m0v, c64(i)), K)]) for i in range(MR)]
            drow = [builder.gep(da.data, [builder.mul(builder.add(m0v, c64(i)), nb)]) for i in range(MR)]
            brow = [builder.gep(ba.data, [builder.mul(builder.add(m0v, c64(i)), builder.mul(nb, c64(4)))]) for i in range(MR)]
            zero = ir.Constant(V8F, [0.0] * 8)
            acc = [cgutils.alloca_once_value(builder, zero) for _ in range(MR)]
            accm = [cgutils.alloca_once_value(builder, zero) for _ in range(MR)]
            itot = [cgutils.alloca_once_value(builder, ir.Constant(V8I, [0] * 8)) for _ in range(MR)]
            mtot = [cgutils.alloca_once_value(builder, ir.Constant(V8I, [0] * 8)) for _ in range(MR)]
            m0f = vconst(V32B, 0x0F)
            lo_pairs = ir.Constant(ir.VectorType(i32, 16), [2 * (e // 2) for e in range(16)])
            hi_pairs = ir.Constant(ir.VectorType(i32, 16), [2 * (e // 2) + 1 for e in range(16)])
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                p = builder.gep(group, [builder.mul(b, c64(Q4K_X8_BYTES))])
                for line in range(0, Q4K_X8_BYTES, 64):
                    prefetch(builder, builder.gep(p, [c64(PREFETCH + line)]))
                d8 = builder.fpext(vload(builder, builder.gep(p, [c64(1152)]), V8H), V8F)
                dmin8 = builder.fpext(vload(builder, builder.gep(p, [c64(1168)]), V8H), V8F)
                dxb = [splat(builder, builder.load(builder.gep(drow[i], [b])), V8F) for i in range(MR)]
                scale = [builder.fmul(d8, dxb[i]) for i in range(MR)]          # fp32(d_w * d_x) per row
                scale_min = [builder.fmul(dmin8, dxb[i]) for i in range(MR)]
                for i in range(MR):
                    builder.store(ir.Constant(V8I, [0] * 8), itot[i])
                    builder.store(ir.Constant(V8I, [0] * 8), mtot[i])
                # the 4 64-element chunks in a loop, not unrolled: unrolled, LLVM hoisted loads
                # across them and spilled (about 300 stack moves per super-block for 4 rows)
                with cgutils.for_range(builder, c64(4)) as cloop:
                    c = cloop.index
                    sc = builder.zext(vload(builder, builder.gep(p, [builder.add(c64(1024), builder.mul(c, c64(16)))]), V16B), V16S)
                    mn = builder.zext(vload(builder, builder.gep(p, [builder.add(c64(1088), builder.mul(c, c64(16)))]), V16B), V16S)
                    sc_lo = builder.shuffle_vector(sc, sc, lo_pairs)
                    sc_hi = builder.shuffle_vector(sc, sc, hi_pairs)
                    ilo = [ir.Constant(V16S, [0] * 16)] * MR
                    ihi = [ir.Constant(V16S, [0] * 16)] * MR
                    xoff = builder.add(builder.mul(b, c64(256)), builder.mul(c, c64(64)))
                    pc = builder.gep(p, [builder.mul(c, c64(256))])
                    for step in range(8):
                        v = vload(builder, builder.gep(pc, [c64(32 * step)]), V32B)
                        lo = builder.and_(v, m0f)
                        hi = builder.and_(builder.lshr(v, vconst(V32B, 4)), m0f)
                        for i in range(MR):
                            xa4 = load_as(builder, xrow[i], i32, builder.add(xoff, c64(4 * step)))
                            xb4 = load_as(builder, xrow[i], i32, builder.add(xoff, c64(32 + 4 * step)))
                            xa_v = builder.bitcast(splat(builder, xa4, V8I), V32B)
                            xb_v = builder.bitcast(splat(builder, xb4, V8I), V32B)
                            ilo[i] = builder.add(ilo[i], maddubs(builder, lo, xa_v))
                            ihi[i] = builder.add(ihi[i], maddubs(builder, hi, xb_v))
                    for i in range(MR):
                        isum = builder.add(madd16(builder, ilo[i], sc_lo), madd16(builder, ihi[i], sc_hi))
                        bs = builder.bitcast(splat(builder, builder.load(builder.gep(brow[i], [builder.add(builder.mul(b, c64(4)), c)])), V8I), V16S)
                        msum = madd16(builder, mn, bs)
                        if per_pair:
                            builder.store(fma(builder, builder.sitofp(isum, V8F), scale[i], builder.load(acc[i])), acc[i])
                            builder.store(fma(builder, builder.sitofp(msum, V8F), scale_min[i], builder.load(accm[i])), accm[i])
                        else:
                            builder.store(builder.add(builder.load(itot[i]), isum), itot[i])
                            builder.store(builder.add(builder.load(mtot[i]), msum), mtot[i])
                if not per_pair:
                    for i in range(MR):
                        builder.store(fma(builder, builder.sitofp(builder.load(itot[i]), V8F), scale[i], builder.load(acc[i])), acc[i])
                        builder.store(fma(builder, builder.sitofp(builder.load(mtot[i]), V8F), scale_min[i], builder.load(accm[i])), accm[i])
            for i in range(MR):
                res = builder.fsub(builder.load(acc[i]), builder.load(accm[i]))
                idx = builder.add(builder.mul(builder.add(m0v, c64(i)), N), builder.mul(gv, c64(8)))
                vstore(builder, res, builder.gep(oa.data, [idx]))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"q4_k_x8_{'gemm' if per_pair else 'gemv'}_{MR}"
    return intrinsic(kern)


q4_k_gemv_1, q4_k_gemm_4 = _q4_k_kernel(1, False), _q4_k_kernel(4, True)


# Activation rows per pass over W: the chunk (rows x K int8) stays in L2 while every weight group
# reads it; without it a prompt re-streams all its rows from L3 for each 8-row group.
X_CHUNK_BYTES = 192 << 10


q4_k_gemv_4 = _q4_k_kernel(4, False)
q4_k_gemv_2 = _q4_k_kernel(2, False)     # two rows left over: one unpack for both (a speculative check)


@njit(parallel=True, cache=True, error_model="numpy")
def _q4_k_rows(wx8, xq, dx, bsp, run_start, run_len, run_batched, out):
    """Q4_K (x8 layout) x q8_K rows -> out (M, N). The rows come in runs: a batched run of n rows is
    split as llama.cpp splits a batch (with n > 3 the first n - n % 4 rows go 4 at a time through
    the gemm arithmetic, the rest through the gemv arithmetic); a one-row run gives every row the
    gemv arithmetic (decode, speculative checks). Chunks of rows; prange over 8-row groups of W."""
    K = xq.shape[1]
    chunk = max(4, X_CHUNK_BYTES // K // 4 * 4)
    for r in range(run_start.shape[0]):
        r0, n = run_start[r], run_len[r]
        n_gemm = n - n % 4 if (run_batched[r] and n > 3) else 0
        for c0 in range(r0, r0 + n, chunk):
            c1 = min(r0 + n, c0 + chunk)
            for g in prange(wx8.shape[0]):
                m = c0
                while m + 4 <= min(c1, r0 + n_gemm):
                    q4_k_gemm_4(wx8, g, xq, dx, bsp, m, out)
                    m += 4
                while m + 4 <= c1:
                    q4_k_gemv_4(wx8, g, xq, dx, bsp, m, out)
                    m += 4
                if m + 2 <= c1:
                    q4_k_gemv_2(wx8, g, xq, dx, bsp, m, out)
                    m += 2
                if m < c1:
                    q4_k_gemv_1(wx8, g, xq, dx, bsp, m, out)


# --- Q6_K ---------------------------------------------------------------------------------------
# Both llama.cpp kernels build the same integer lanes: per 32-element chunk k of half j,
# vpmaddwd(vpmaddubsw(q, x), scales) with q the unsigned 6-bit values and the chunk's two 16-element
# scales, so lane l holds chunk offsets 4l..4l+3 times their scale, summed over the 8 chunks. The
# -32 offset comes from the 16-element sums of x: sub_l = 32 * (sc[2l]*bs[2l] + sc[2l+1]*bs[2l+1]).
# vec_dot (fewer than 8 rows): acc = fma(d_w*d_x, float(lane - sub), acc) per lane, hsum_float_8 at
# the end. tiled (8 rows or more): S = sum of all lanes - sum of all sub, out = fma(d_w*float(S), d_x, out).
Q6_K_BLOCK = 210


def _q6_k_kernel(MR: int, tiled: bool):
    """kern(w, n, xq, dx, bs16, m0, out): out[m0+i, n] for i < MR; w: GGUF Q6_K rows (N, nb*210);
    xq (M, K) int8, dx (M, nb) float32: q8_K rows; bs16 (M, K/16) int16: their 16-element sums.

    Per super-block the 8 unpacked 32-byte chunks and their scale pairs go to a stack buffer, then an
    IR loop over the chunks reads them back for all MR rows. Unrolled (every chunk live in a register
    for every row), LLVM spilled ~60 moves per super-block at 4 rows and could not go beyond 4."""

    def kern(typingctx, w, n, xq, dx, bs16, m0, out):
        sig = types.void(w, n, xq, dx, bs16, m0, out)

        def codegen(context, builder, signature, args):
            wa, _, xa, da, ba, _, oa = (array(context, builder, signature.args[k], args[k]) if k not in (1, 5) else None
                                        for k in range(7))
            nv, m0v = args[1], args[5]
            nb = builder.extract_value(da.shape, 1)
            K = builder.extract_value(xa.shape, 1)
            N = builder.extract_value(oa.shape, 1)
            row = builder.gep(byte_ptr(builder, wa.data), [builder.mul(nv, builder.extract_value(wa.strides, 0))])
            xrow = [builder.gep(byte_ptr(builder, xa.data), [builder.mul(builder.add(m0v, c64(i)), K)]) for i in range(MR)]
            drow = [builder.gep(da.data, [builder.mul(builder.add(m0v, c64(i)), nb)]) for i in range(MR)]
            brow = [builder.gep(byte_ptr(builder, ba.data), [builder.mul(builder.add(m0v, c64(i)), builder.mul(nb, c64(32)))])
                    for i in range(MR)]
            acc = [cgutils.alloca_once_value(builder, ir.Constant(V8F, [0.0] * 8)) for _ in range(MR)]
            acc1 = [cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0)) for _ in range(MR)]
            qbuf = cgutils.alloca_once(builder, ir.ArrayType(V32B, 8))          # the chunks' 6-bit values
            sbuf = cgutils.alloca_once(builder, ir.ArrayType(V16S, 8))          # their scale pairs
            lanes = [cgutils.alloca_once(builder, V8I) for _ in range(MR)]
            m15, m3 = vconst(V32B, 15), vconst(V32B, 3)
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                p = builder.gep(row, [builder.mul(b, c64(Q6_K_BLOCK))])
                for line in range(0, Q6_K_BLOCK, 64):
                    prefetch(builder, builder.gep(p, [c64(PREFETCH + line)]))
                sc8 = vload(builder, builder.gep(p, [c64(192)]), V16B)
                sc16 = builder.sext(sc8, V16S)                                   # the 16 scales
                dw = builder.fpext(load_as(builder, p, f16, 208), f32)
                for j in range(2):
                    q1 = vload(builder, builder.gep(p, [c64(64 * j)]), V32B)
                    q2 = vload(builder, builder.gep(p, [c64(64 * j + 32)]), V32B)
                    qh = vload(builder, builder.gep(p, [c64(128 + 32 * j)]), V32B)
                    shr = lambda v, k: builder.lshr(v, vconst(V32B, k))       # noqa: E731
                    shl = lambda v, k: builder.shl(v, vconst(V32B, k))        # noqa: E731
                    qv = [builder.or_(builder.and_(q1, m15), shl(builder.and_(qh, m3), 4)),
                          builder.or_(builder.and_(q2, m15), shl(builder.and_(shr(qh, 2), m3), 4)),
                          builder.or_(shr(q1, 4), shl(builder.and_(shr(qh, 4), m3), 4)),
                          builder.or_(shr(q2, 4), shl(shr(qh, 6), 4))]
                    for k in range(4):
                        s = 4 * j + k                                             # scales 2s, 2s+1
                        builder.store(qv[k], builder.gep(qbuf, [c32(0), c32(s)]))
                        scv = builder.shuffle_vector(sc16, sc16, ir.Constant(ir.VectorType(i32, 16), [2 * s] * 8 + [2 * s + 1] * 8))
                        builder.store(scv, builder.gep(sbuf, [c32(0), c32(s)]))
                for i in range(MR):
                    builder.store(ir.Constant(V8I, [0] * 8), lanes[i])
                with cgutils.for_range(builder, c64(8)) as chunks:                 # chunk c: elements 32c .. 32c+31
                    c = chunks.index
                    qv = builder.load(builder.gep(qbuf, [c32(0), c]))
                    scv = builder.load(builder.gep(sbuf, [c32(0), c]))
                    xoff = builder.add(builder.mul(b, c64(256)), builder.mul(c, c64(32)))
                    for i in range(MR):
                        x = vload(builder, builder.gep(xrow[i], [xoff]), V32B)
                        builder.store(builder.add(builder.load(lanes[i]), madd16(builder, maddubs(builder, qv, x), scv)), lanes[i])
                for i in range(MR):
                    lanes_i = builder.load(lanes[i])
                    bsv = vload(builder, builder.gep(brow[i], [builder.mul(b, c64(32))]), V16S)
                    sub = builder.shl(madd16(builder, bsv, sc16), vconst(V8I, 5))
                    dxb = builder.load(builder.gep(drow[i], [b]))
                    if tiled:
                        tot = builder.sub(lanes_i, sub)
                        e = [builder.extract_element(tot, ir.Constant(i32, q)) for q in range(8)]
                        S = e[0]
                        for q in range(1, 8):
                            S = builder.add(S, e[q])
                        res = builder.fmul(dw, builder.sitofp(S, f32))
                        builder.store(call(builder, "llvm.fma.f32", f32, [res, dxb, builder.load(acc1[i])]), acc1[i])
                    else:
                        d = splat(builder, builder.fmul(dxb, dw), V8F)                  # y.d * fp16(x.d)
                        tot = builder.sitofp(builder.sub(lanes_i, sub), V8F)
                        builder.store(fma(builder, d, tot, builder.load(acc[i])), acc[i])
            for i in range(MR):
                value = builder.load(acc1[i]) if tiled else hsum8(builder, builder.load(acc[i]))
                idx = builder.add(builder.mul(builder.add(m0v, c64(i)), N), nv)
                builder.store(value, builder.gep(oa.data, [idx]))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"q6_k_{'tiled' if tiled else 'vec_dot'}_{MR}"
    return intrinsic(kern)


q6_k_vec_dot_1, q6_k_vec_dot_4 = _q6_k_kernel(1, False), _q6_k_kernel(4, False)
q6_k_tiled_1, q6_k_tiled_4 = _q6_k_kernel(1, True), _q6_k_kernel(4, True)
# A speculative check verifies 1 to 8 rows with the one-row arithmetic: one unpack of W for up to 8.
(q6_k_vec_dot_2, q6_k_vec_dot_3, q6_k_vec_dot_5, q6_k_vec_dot_6, q6_k_vec_dot_7,
 q6_k_vec_dot_8) = (_q6_k_kernel(m, False) for m in (2, 3, 5, 6, 7, 8))
Q6_K_TILED_MIN_ROWS = 8     # llama.cpp's ggml_tiled_min_batch


@njit(parallel=True, cache=True, error_model="numpy")
def _q6_k_rows(w, xq, dx, bs16, run_start, run_len, run_batched, out):
    """Q6_K rows x q8_K rows -> out (M, N): a batched run of 8 rows or more takes the tiled
    arithmetic, every other row the vec_dot arithmetic. Chunks of rows; prange over weight rows."""
    K = xq.shape[1]
    N = w.shape[0]
    chunk = max(4, X_CHUNK_BYTES // K // 4 * 4)
    for r in range(run_start.shape[0]):
        r0, n = run_start[r], run_len[r]
        tiled = run_batched[r] and n >= Q6_K_TILED_MIN_ROWS
        for c0 in range(r0, r0 + n, chunk):
            c1 = min(r0 + n, c0 + chunk)
            for row in prange(N):
                m = c0
                if tiled:
                    while m + 4 <= c1:
                        q6_k_tiled_4(w, row, xq, dx, bs16, m, out)
                        m += 4
                    while m < c1:
                        q6_k_tiled_1(w, row, xq, dx, bs16, m, out)
                        m += 1
                    continue
                while m < c1:                       # up to 8 rows per pass over the weight row
                    left = c1 - m
                    if left >= 8:
                        q6_k_vec_dot_8(w, row, xq, dx, bs16, m, out)
                    elif left == 7:
                        q6_k_vec_dot_7(w, row, xq, dx, bs16, m, out)
                    elif left == 6:
                        q6_k_vec_dot_6(w, row, xq, dx, bs16, m, out)
                    elif left == 5:
                        q6_k_vec_dot_5(w, row, xq, dx, bs16, m, out)
                    elif left == 4:
                        q6_k_vec_dot_4(w, row, xq, dx, bs16, m, out)
                    elif left == 3:
                        q6_k_vec_dot_3(w, row, xq, dx, bs16, m, out)
                    elif left == 2:
                        q6_k_vec_dot_2(w, row, xq, dx, bs16, m, out)
                    else:
                        q6_k_vec_dot_1(w, row, xq, dx, bs16, m, out)
                    m += min(8, left)


# --- activation rows, quantized as llama.cpp's matmul quantizes them ------------------------------

@njit(cache=True, error_model="numpy", inline="always")
def _rint_small(v):
    """Round half to even for |v| < 2**22, as _mm256_round_ps / nearest_int do (adding and taking
    away 1.5 * 2**23 rounds the float32 sum; no libm call, so the loops vectorize). Callers are
    compiled without fastmath, so the two additions stay."""
    return (v + np.float32(12582912.0)) - np.float32(12582912.0)


@njit(fastmath=True, cache=True, error_model="numpy")
def _absmax(x, m, lo, n):
    """max |x[m, lo:lo+n]|: the same in any order (activations hold no NaN)."""
    a = np.float32(0.0)
    for i in range(lo, lo + n):
        a = max(a, abs(x[m, i]))
    return a


@njit(parallel=True, cache=True, error_model="numpy")
def _quantize_q8_0(x, xq, dx, sx):
    """quantize_row_q8_0 (AVX2): per 32 elements d = f16(amax / 127), q = round(x * (127 / amax));
    sx: 16 x the sum of every 4 q (the Q5_0 x8 kernel's offset)."""
    for m in prange(x.shape[0]):
        for b in range(dx.shape[1]):
            amax = _absmax(x, m, b * 32, 32)
            idv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
            for i in range(32):
                xq[m, b * 32 + i] = np.int32(_rint_small(x[m, b * 32 + i] * idv))
            dx[m, b] = f16_value(f16_bits(amax / np.float32(127.0)))
            for k in range(8):
                i = b * 32 + 4 * k
                sx[m, b * 8 + k] = 16 * (np.int32(xq[m, i]) + np.int32(xq[m, i + 1]) + np.int32(xq[m, i + 2]) +
                                         np.int32(xq[m, i + 3]))


@njit(parallel=True, cache=True, error_model="numpy")
def _quantize_q8_k(x, xq, dx, bs16, bsp):
    """quantize_row_q8_K_ref: per 256 elements the first value of largest magnitude, vmax, maps to
    -127 (iscale = -127 / vmax, q = min(127, round(iscale * x)), d = 1 / iscale); bs16: 16-element
    sums of q. (The 4-row quantizer of the Q4_K gemm breaks +-vmax ties the other way; that flips the
    signs of q and d together and leaves every product unchanged.)"""
    for m in prange(x.shape[0]):
        for b in range(dx.shape[1]):
            amax = np.float32(0.0)
            vmax = np.float32(0.0)
            for i in range(256):
                v = x[m, b * 256 + i]
                if abs(v) > amax:
                    amax = abs(v)
                    vmax = v
            if amax == 0:
                dx[m, b] = 0.0
                for i in range(256):
                    xq[m, b * 256 + i] = 0
            else:
                iscale = np.float32(-127.0) / vmax
                for i in range(256):
                    xq[m, b * 256 + i] = min(127, np.int32(_rint_small(iscale * x[m, b * 256 + i])))
                dx[m, b] = np.float32(1.0) / iscale
            for j in range(16):
                s = np.int32(0)
                for i in range(16):
                    s += np.int32(xq[m, b * 256 + 16 * j + i])
                bs16[m, b * 16 + j] = s
            for c in range(4):                  # per 64 elements the two 32-sums as two int16 (Q4_K)
                lo = np.int32(bs16[m, b * 16 + 4 * c]) + np.int32(bs16[m, b * 16 + 4 * c + 1])
                hi = np.int32(bs16[m, b * 16 + 4 * c + 2]) + np.int32(bs16[m, b * 16 + 4 * c + 3])
                bsp[m, b * 4 + c] = (lo & 0xFFFF) | (hi << 16)


_quantize_q8_0_serial = serial_twin(_quantize_q8_0)
_quantize_q8_k_serial = serial_twin(_quantize_q8_k)


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (M, K) float32 -> (xq (M, K) int8, dx (M, K/32) float32 holding f16 values,
    16 x the 4-element group sums (M, K/4) int32)."""
    M, K = x.shape
    xq, dx, sx = np.empty((M, K), np.int8), np.empty((M, K // 32), np.float32), np.empty((M, K // 4), np.int32)
    (_quantize_q8_0 if M > 1 else _quantize_q8_0_serial)(x, xq, dx, sx)
    return xq, dx, sx


def quantize_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x (M, K) float32 -> (xq (M, K) int8, dx (M, K/256) float32, 16-element sums (M, K/16) int16,
    per 64 elements the two 32-element sums as two int16 in an int32 (M, K/64))."""
    M, K = x.shape
    xq, dx = np.empty((M, K), np.int8), np.empty((M, K // 256), np.float32)
    bs16, bsp = np.empty((M, K // 16), np.int16), np.empty((M, K // 64), np.int32)
    (_quantize_q8_k if M > 1 else _quantize_q8_k_serial)(x, xq, dx, bs16, bsp)
    return xq, dx, bs16, bsp


class Int8Rows:
    """Activation rows quantized once for one vec-dot type (types.ACT_Q8_0 or ACT_Q8_K) and shared by
    every matrix that reads the same x (q/k/v, gate/up); the kernel-specific forms are derived on demand."""

    def __init__(self, x: np.ndarray, kind: int):
        x = np.ascontiguousarray(x, np.float32)
        self.kind = kind
        if kind == ACT_Q8_0:
            self.xq, self.dx, self.sx = quantize_q8_0(x)
        elif kind == ACT_Q8_K:
            self.xq, self.dx, self.bs16, self.bsp = quantize_q8_k(x)
        else:
            raise ValueError(f"unknown activation type {kind!r}")
        self._derived: dict = {}

    @property
    def n_rows(self) -> int:
        return self.xq.shape[0]

    def biased_groups(self):
        """(xb, dxb) for the Q5_0 panel kernel (see _bias_groups)."""
        if "biased" not in self._derived:
            M, K = self.xq.shape
            G = -(-M // PANEL_MR)
            nbp = -(-(K // 32) // NB_PAD) * NB_PAD
            xb = np.empty((G, K // 32, PANEL_MR, 32), np.uint8)
            dxb = np.empty((G, PANEL_MR, nbp), np.float32)
            _bias_groups(self.xq, self.dx, PANEL_MR, xb, dxb)
            self._derived["biased"] = (xb, dxb)
        return self._derived["biased"]


# From this many activation rows on, Q5_0 goes through the unpacked panel kernel (below it the
# multi-row x8 kernel is faster; README: measured).
Q5_0_PANEL_MIN_ROWS = 48
EXACT_TYPES = frozenset(t for t, tr in TRAITS.items() if tr.exact) if HAS_AVX2 else frozenset()


def exact_layout(raw: np.ndarray, ggml_type: int, n_rows: int, n_cols: int) -> np.ndarray | None:
    """The weights as the exact kernels read them, 8 rows interleaved (the same bytes as GGUF): Q8_0 and
    Q5_0 padded to a multiple of 8 rows, Q4_K only if it has one (llama.cpp does not repack such a
    matrix either, and its other kernel is not reproduced here), Q6_K rows in place; None where no
    exact kernel applies."""
    if ggml_type not in EXACT_TYPES:
        return None
    if ggml_type == T.Q4_K:
        return repack_q4_k_x8(raw, n_cols) if n_rows % 8 == 0 else None
    if not TRAITS[ggml_type].x8:
        return np.ascontiguousarray(raw).view(np.uint8).reshape(n_rows, -1)
    return repack_q0_x8(raw, ggml_type, n_cols)



def run_arrays(runs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[(start, length, batched)] -> the three arrays the drivers take. Adjacent runs whose rows all
    get the single-token arithmetic (unbatched, or a batch of one) become one run, so that they share
    one pass over W (32 decoding sequences: one pass, not 32)."""
    merged: list[list] = []
    for start, n, batched in runs:
        single = not batched or n == 1
        if merged and single and not merged[-1][2] and merged[-1][0] + merged[-1][1] == start:
            merged[-1][1] += n
        else:
            merged.append([start, n, not single])
    return (np.array([r[0] for r in merged], np.int64), np.array([r[1] for r in merged], np.int64),
            np.array([r[2] for r in merged], np.bool_))


def _run_arrays(runs, M: int):
    if isinstance(runs, tuple) and len(runs) == 3 and isinstance(runs[0], np.ndarray):
        return runs                                       # prebuilt (models.transformer.RowPlan)
    if runs is None:
        runs = [(0, M, True)]
    starts, lens, batched = run_arrays(runs)
    if lens.sum() != M:
        raise ValueError(f"runs cover {lens.sum()} rows, the activation has {M}")
    return starts, lens, batched


def matmul(layout: np.ndarray, ggml_type: int, rows: Int8Rows, n_out: int, runs=None) -> np.ndarray:
    """rows (M, K) @ W.T -> (M, n_out) float32 for the first n_out rows of W, llama.cpp's numbers bit
    for bit. W is read once per call for all M rows. runs: [(start, length, batched)] covering the
    rows (default: one batched run); llama.cpp picks its Q4_K and Q6_K arithmetic by the size of the
    batch it is given, so a batched run gets the arithmetic of a llama.cpp batch of its length and a
    one-row run (decode, speculative checks) gives each row the arithmetic of a single token."""
    M = rows.n_rows
    traits = TRAITS[ggml_type]
    w = traits.layout_prefix(layout, n_out)                     # the rows (or 8-row groups) needed
    out = np.empty((M, traits.layout_rows(w)), np.float32)
    if ggml_type == T.Q6_K:
        _q6_k_rows(w, rows.xq, rows.dx, rows.bs16, *_run_arrays(runs, M), out)
    elif ggml_type == T.Q4_K:
        _q4_k_rows(w, rows.xq, rows.dx, rows.bsp, *_run_arrays(runs, M), out)
    elif ggml_type == T.Q5_0 and M >= Q5_0_PANEL_MIN_ROWS:
        xb, dxb = rows.biased_groups()
        _q5_0_prompt(w, xb, dxb, M, out)
    else:
        _q0_x8_rows(q0_kind(ggml_type), w, rows.xq, rows.dx, rows.sx, out)
    return out if out.shape[1] == n_out else out[:, :n_out]



# --- Q8_0 / Q5_0 with 8 weight rows in the lanes (decode, short batches) ------------------------
# The same float steps as above, vectorized the other way: lane r holds weight row r, and each of
# the 8 four-element groups of a block has its own accumulator (acc_k[r] is llama.cpp's lane k of
# row r), so a block costs one vector step per group for 8 rows instead of per row, the scale is a
# vector of the 8 rows' d_w * d_x, and hsum_float_8 becomes the same tree across the 8
# accumulators. The x8 layouts keep GGUF's bytes per block (the 5th bits of Q5_0 permuted):
#   Q8_0: q [group k 8][row 8][4 bytes], then d [row] f16                    (272 bytes)
#   Q5_0: qs [j 4][row 8][4 bytes] (GGUF qs bytes 4j..4j+3: low nibbles group j, high group j+4),
#         qh [row 8] 32 bits, bit 8e + k = 5th bit of element 4k + e, then d [row] f16   (176 bytes)
# Q5_0 takes the unsigned 5-bit values q and x as is: sum (q - 16) x = sum q x - 16 sum x, with the
# group sums of x computed once per activation row (no sign instructions).
X8_BLOCK = {T.Q8_0: 272, T.Q5_0: 176}


def repack_q0_x8(raw: np.ndarray, ggml_type: int, n_cols: int) -> np.ndarray:
    """GGUF Q8_0 / Q5_0 rows -> (ceil(N/8), nb * X8_BLOCK) uint8, layout above."""
    block = Q8_0_BLOCK if ggml_type == T.Q8_0 else Q5_0_BLOCK
    nb = n_cols // 32
    rows = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, nb * block)
    if rows.shape[0] % 8:           # zero rows (scale 0) pad the last group; their outputs are dropped
        rows = np.concatenate([rows, np.zeros((-rows.shape[0] % 8, rows.shape[1]), np.uint8)])
    G = rows.shape[0] // 8
    k = rows.reshape(G, 8, nb, block)
    d = k[..., 0:2].transpose(0, 2, 1, 3).reshape(G, nb, 16)
    if ggml_type == T.Q8_0:
        q = k[..., 2:34].reshape(G, 8, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(G, nb, 256)
        parts = [q, d]
    else:
        qs = k[..., 6:22].reshape(G, 8, nb, 4, 4).transpose(0, 2, 3, 1, 4).reshape(G, nb, 128)
        qh = np.ascontiguousarray(k[..., 2:6]).view("<u4")[..., 0]                     # (G, 8, nb)
        w = np.zeros_like(qh)
        for grp in range(8):
            for e in range(4):
                w |= ((qh >> np.uint32(4 * grp + e)) & np.uint32(1)) << np.uint32(8 * e + grp)
        qh_t = w.transpose(0, 2, 1).copy().view(np.uint8).reshape(G, nb, 32)
        parts = [qs, qh_t, d]
    return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(G, nb * X8_BLOCK[ggml_type]))


def _q0_x8_kernel(ggml_type: int):
    """kern(wx8, g, xq, dx, sx, m, out): out[m, 8g .. 8g+8] for activation row m. sx (M, nb*8) int32:
    16 x the 4-element group sums of xq (Q5_0's offset); unused for Q8_0."""
    is_q8 = ggml_type == T.Q8_0
    block = X8_BLOCK[ggml_type]

    def kern(typingctx, wx8, g, xq, dx, sx, m, out):
        sig = types.void(wx8, g, xq, dx, sx, m, out)

        def codegen(context, builder, signature, args):
            wa, _, xa, da, sa, _, oa = (array(context, builder, signature.args[k], args[k]) if k not in (1, 5) else None
                                        for k in range(7))
            gv, mv = args[1], args[5]
            nb = builder.extract_value(da.shape, 1)
            K = builder.extract_value(xa.shape, 1)
            N = builder.extract_value(oa.shape, 1)
            group = builder.gep(byte_ptr(builder, wa.data), [builder.mul(gv, builder.mul(nb, c64(block)))])
            xrow = builder.gep(byte_ptr(builder, xa.data), [builder.mul(mv, K)])
            drow = builder.gep(da.data, [builder.mul(mv, nb)])
            srow = builder.gep(sa.data, [builder.mul(mv, builder.mul(nb, c64(8)))])
            zero = ir.Constant(V8F, [0.0] * 8)
            acc = [cgutils.alloca_once_value(builder, zero) for _ in range(8)]
            ones, m0f, bit4 = vconst(V16S, 1), vconst(V32B, 0x0F), vconst(V8I, 0x10101010)
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                p = builder.gep(group, [builder.mul(b, c64(block))])
                for line in range(0, block, 64):              # the stream PREFETCH bytes ahead
                    prefetch(builder, builder.gep(p, [c64(PREFETCH + line)]))
                d8 = builder.fpext(vload(builder, builder.gep(p, [c64(block - 16)]), V8H), V8F)
                scale = builder.fmul(d8, splat(builder, builder.load(builder.gep(drow, [b])), V8F))   # d_w * d_x per row
                xb = builder.gep(xrow, [builder.mul(b, c64(32))])
                if not is_q8:
                    qh = vload(builder, builder.gep(p, [c64(128)]), V8I)
                    qsv = [vload(builder, builder.gep(p, [c64(32 * j)]), V32B) for j in range(4)]
                for k in range(8):
                    x4 = builder.bitcast(splat(builder, load_as(builder, xb, i32, 4 * k), V8I), V32B)
                    if is_q8:
                        w = vload(builder, builder.gep(p, [c64(32 * k)]), V32B)
                        isum = madd16(builder, maddubs(builder, psign(builder, w, w), psign(builder, x4, w)), ones)
                    else:
                        v = qsv[k % 4]
                        nib = builder.and_(v, m0f) if k < 4 else builder.and_(builder.lshr(v, vconst(V32B, 4)), m0f)
                        # bit 8e + k -> bit 4 of byte e: one shift and one mask
                        sh = builder.shl(qh, vconst(V8I, 4 - k)) if k <= 4 else builder.lshr(qh, vconst(V8I, k - 4))
                        q5 = builder.or_(nib, builder.bitcast(builder.and_(sh, bit4), V32B))
                        s16 = builder.load(builder.gep(srow, [builder.add(builder.mul(b, c64(8)), c64(k))]))
                        isum = builder.sub(madd16(builder, maddubs(builder, q5, x4), ones), splat(builder, s16, V8I))
                    builder.store(fma(builder, scale, builder.sitofp(isum, V8F), builder.load(acc[k])), acc[k])
            accs = [builder.load(a) for a in acc]
            r = [builder.fadd(accs[4 + k], accs[k]) for k in range(4)]
            res = builder.fadd(builder.fadd(r[0], r[2]), builder.fadd(r[1], r[3]))      # hsum_float_8, 8 rows at once
            vstore(builder, res, builder.gep(oa.data, [builder.add(builder.mul(mv, N), builder.mul(gv, c64(8)))]))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"{'q8_0' if is_q8 else 'q5_0'}_x8"
    return intrinsic(kern)


q8_0_x8, q5_0_x8 = _q0_x8_kernel(8), _q0_x8_kernel(6)

X8_ROWS = 8     # activation rows per pass of the multi-row kernels


def _q0_x8_multi_kernel(ggml_type: int):
    """kern(wx8, g, xq, dx, sx, m0, n, out): out[m0+i, 8g .. 8g+8] for i < n <= X8_ROWS, the one-row
    kernel's float steps for every row. Per block the 8 weight vectors are decoded once into a stack
    buffer (Q5_0: the 5-bit values, Q8_0: their magnitudes) and read back for each row, whose 8
    accumulators live on the stack, in an IR loop over the rows (unrolled, n x 8 accumulators do not
    fit the 16 registers). Before, each row decoded every block again: 2 rows cost 2 one-row passes."""
    is_q8 = ggml_type == T.Q8_0
    block = X8_BLOCK[ggml_type]

    def kern(typingctx, wx8, g, xq, dx, sx, m0, n, out):
        sig = types.void(wx8, g, xq, dx, sx, m0, n, out)

        def codegen(context, builder, signature, args):
            wa, _, xa, da, sa, _, _, oa = (array(context, builder, signature.args[k], args[k]) if k not in (1, 5, 6) else None
                                           for k in range(8))
            gv, m0v, nv = args[1], args[5], args[6]
            nb = builder.extract_value(da.shape, 1)
            K = builder.extract_value(xa.shape, 1)
            N = builder.extract_value(oa.shape, 1)
            group = builder.gep(byte_ptr(builder, wa.data), [builder.mul(gv, builder.mul(nb, c64(block)))])
            wbuf = cgutils.alloca_once(builder, ir.ArrayType(V32B, 8))
            accs = cgutils.alloca_once(builder, ir.ArrayType(V8F, 8 * X8_ROWS))
            acc_at = lambda r, k: builder.gep(accs, [c32(0), builder.add(builder.mul(r, c64(8)), c64(k))])   # noqa: E731
            w_at = lambda k: builder.gep(wbuf, [c32(0), c32(k)])                                                # noqa: E731
            zero = ir.Constant(V8F, [0.0] * 8)
            with cgutils.for_range(builder, nv) as rl:
                for k in range(8):
                    builder.store(zero, acc_at(rl.index, k))
            ones, m0f, bit4 = vconst(V16S, 1), vconst(V32B, 0x0F), vconst(V8I, 0x10101010)
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                p = builder.gep(group, [builder.mul(b, c64(block))])
                for line in range(0, block, 64):
                    prefetch(builder, builder.gep(p, [c64(PREFETCH + line)]))
                d8 = builder.fpext(vload(builder, builder.gep(p, [c64(block - 16)]), V8H), V8F)
                if is_q8:
                    for k in range(8):
                        w = vload(builder, builder.gep(p, [c64(32 * k)]), V32B)
                        builder.store(psign(builder, w, w), w_at(k))
                else:
                    qh = vload(builder, builder.gep(p, [c64(128)]), V8I)
                    qsv = [vload(builder, builder.gep(p, [c64(32 * j)]), V32B) for j in range(4)]
                    for k in range(8):
                        v = qsv[k % 4]
                        nib = builder.and_(v, m0f) if k < 4 else builder.and_(builder.lshr(v, vconst(V32B, 4)), m0f)
                        sh = builder.shl(qh, vconst(V8I, 4 - k)) if k <= 4 else builder.lshr(qh, vconst(V8I, k - 4))
                        builder.store(builder.or_(nib, builder.bitcast(builder.and_(sh, bit4), V32B)), w_at(k))
                with cgutils.for_range(builder, nv) as rl:
                    r = rl.index
                    m = builder.add(m0v, r)
                    xb = builder.gep(byte_ptr(builder, xa.data), [builder.add(builder.mul(m, K), builder.mul(b, c64(32)))])
                    dxm = builder.load(builder.gep(da.data, [builder.add(builder.mul(m, nb), b)]))
                    scale = builder.fmul(d8, splat(builder, dxm, V8F))                 # d_w * d_x per weight row
                    srow = builder.gep(sa.data, [builder.add(builder.mul(m, builder.mul(nb, c64(8))), builder.mul(b, c64(8)))])
                    for k in range(8):
                        x4 = builder.bitcast(splat(builder, load_as(builder, xb, i32, 4 * k), V8I), V32B)
                        wk = builder.load(w_at(k))
                        if is_q8:
                            w = vload(builder, builder.gep(p, [c64(32 * k)]), V32B)
                            isum = madd16(builder, maddubs(builder, wk, psign(builder, x4, w)), ones)
                        else:
                            s16 = builder.load(builder.gep(srow, [c64(k)]))
                            isum = builder.sub(madd16(builder, maddubs(builder, wk, x4), ones), splat(builder, s16, V8I))
                        ap = acc_at(r, k)
                        builder.store(fma(builder, scale, builder.sitofp(isum, V8F), builder.load(ap)), ap)
            with cgutils.for_range(builder, nv) as rl:
                r = rl.index
                a = [builder.load(acc_at(r, k)) for k in range(8)]
                t = [builder.fadd(a[4 + k], a[k]) for k in range(4)]
                res = builder.fadd(builder.fadd(t[0], t[2]), builder.fadd(t[1], t[3]))     # hsum_float_8 per row, 8 rows at once
                idx = builder.add(builder.mul(builder.add(m0v, r), N), builder.mul(gv, c64(8)))
                vstore(builder, res, builder.gep(oa.data, [idx]))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"{'q8_0' if is_q8 else 'q5_0'}_x8_multi"
    return intrinsic(kern)


q8_0_x8_multi, q5_0_x8_multi = _q0_x8_multi_kernel(8), _q0_x8_multi_kernel(6)


@njit(parallel=True, cache=True, error_model="numpy")
def _q0_x8_rows(kind, wx8, xq, dx, sx, out):
    """Q8_0 (kind 0) / Q5_0 (kind 1) x8 layout x q8_0 rows -> out (M, N); prange over 8-row groups,
    each group's bytes stay in L1 while every activation row reads them: one row (decode) with the
    accumulators in registers, more in passes of up to X8_ROWS rows that decode each block once."""
    M = xq.shape[0]
    for g in prange(wx8.shape[0]):
        if M == 1:
            if kind == Q8_0_KIND:
                q8_0_x8(wx8, g, xq, dx, sx, 0, out)
            else:
                q5_0_x8(wx8, g, xq, dx, sx, 0, out)
        else:
            for m0 in range(0, M, X8_ROWS):
                n = min(X8_ROWS, M - m0)
                if kind == Q8_0_KIND:
                    q8_0_x8_multi(wx8, g, xq, dx, sx, m0, n, out)
                else:
                    q5_0_x8_multi(wx8, g, xq, dx, sx, m0, n, out)


def _transpose8x8(builder, vs):
    """8 vectors of 8 int32 -> their transpose (vector r holds lane r of every input)."""
    V = ir.VectorType(i32, 8)
    sh = lambda a, b, idx: builder.shuffle_vector(a, b, ir.Constant(V, idx))   # noqa: E731
    t = []
    for a, b in zip(vs[0::2], vs[1::2]):                       # unpack lo / hi epi32
        t += [sh(a, b, [0, 8, 1, 9, 4, 12, 5, 13]), sh(a, b, [2, 10, 3, 11, 6, 14, 7, 15])]
    u = []
    for a, b in ((t[0], t[2]), (t[1], t[3]), (t[4], t[6]), (t[5], t[7])):   # unpack lo / hi epi64
        u += [sh(a, b, [0, 1, 8, 9, 4, 5, 12, 13]), sh(a, b, [2, 3, 10, 11, 6, 7, 14, 15])]
    # u: [r0|r4 low halves...]: combine 128-bit halves
    out = [None] * 8
    for r, (a, b) in enumerate(((u[0], u[4]), (u[1], u[5]), (u[2], u[6]), (u[3], u[7]))):
        out[r] = sh(a, b, [0, 1, 2, 3, 8, 9, 10, 11])
        out[r + 4] = sh(a, b, [4, 5, 6, 7, 12, 13, 14, 15])
    return out


@intrinsic
def _unpack_q5_0_x8_panel(typingctx, wx8, g0, n_groups, wp, cp, dwp):
    """Groups g0 .. g0+n_groups-1 of a Q5_0 x8 matrix -> panel rows 0 .. 8*n_groups-1: wp (P, nb, 32)
    int8 values q - 16, cp (P, nb, 8) int32 = 128 * each 4-group sum, dwp (P, nbp) float32 scales."""
    sig = types.void(wx8, g0, n_groups, wp, cp, dwp)

    def codegen(context, builder, signature, args):
        wa, _, _, pa, ca, da = (array(context, builder, signature.args[k], args[k]) if k not in (1, 2) else None
                                for k in range(6))
        g0v, n_groups = args[1], args[2]
        nb = builder.extract_value(pa.shape, 1)
        nbp = builder.extract_value(da.shape, 1)
        block = X8_BLOCK[6]
        wbase, pbase, cbase = byte_ptr(builder, wa.data), byte_ptr(builder, pa.data), byte_ptr(builder, ca.data)
        m0f, bit4, ones8, ones16 = vconst(V32B, 0x0F), vconst(V8I, 0x10101010), vconst(V32B, 1), vconst(V16S, 1)
        with cgutils.for_range(builder, n_groups) as gl:
            grp = gl.index
            src = builder.gep(wbase, [builder.mul(builder.add(g0v, grp), builder.mul(nb, c64(block)))])
            with cgutils.for_range(builder, nb) as bl:
                b = bl.index
                p = builder.gep(src, [builder.mul(b, c64(block))])
                qh = vload(builder, builder.gep(p, [c64(128)]), V8I)
                qsv = [vload(builder, builder.gep(p, [c64(32 * j)]), V32B) for j in range(4)]
                groups = []
                for k in range(8):
                    v = qsv[k % 4]
                    nib = builder.and_(v, m0f) if k < 4 else builder.and_(builder.lshr(v, vconst(V32B, 4)), m0f)
                    sh = builder.shl(qh, vconst(V8I, 4 - k)) if k <= 4 else builder.lshr(qh, vconst(V8I, k - 4))
                    q5 = builder.or_(nib, builder.bitcast(builder.and_(sh, bit4), V32B))
                    groups.append(builder.bitcast(builder.sub(q5, vconst(V32B, 16)), V8I))
                rows = _transpose8x8(builder, groups)                # row r: its 32 values
                d8 = builder.fpext(vload(builder, builder.gep(p, [c64(block - 16)]), V8H), V8F)
                for r in range(8):
                    row = builder.add(builder.mul(grp, c64(8)), c64(r))
                    off = builder.add(builder.mul(row, builder.mul(nb, c64(32))), builder.mul(b, c64(32)))
                    w = builder.bitcast(rows[r], V32B)
                    vstore(builder, w, builder.gep(pbase, [off]))
                    sums = madd16(builder, maddubs(builder, ones8, w), ones16)
                    vstore(builder, builder.shl(sums, vconst(V8I, 7)), builder.gep(cbase, [off]))
                    builder.store(builder.extract_element(d8, ir.Constant(i32, r)),
                                  builder.gep(da.data, [builder.add(builder.mul(row, nbp), b)]))
        return context.get_dummy_value()

    return sig, codegen


# --- rows into preallocated buffers (the fused decode layer, kernels.cpu.fused) -----------------

class Q8Buffers(NamedTuple):
    """R activation rows' quantized forms for both vec-dot types, allocated once and reused by
    every decode step (a typed bundle for compiled code)."""
    xq: np.ndarray       # (R, K) int8
    dx0: np.ndarray      # (R, K/32) float32: q8_0 scales
    sx: np.ndarray       # (R, K/4) int32: q8_0 4-group sums x 16
    dxk: np.ndarray      # (R, max(1, K/256)) float32: q8_K scales
    bs16: np.ndarray     # (R, K/16) int16: q8_K 16-element sums
    bsp: np.ndarray      # (R, max(1, K/64)) int32: q8_K paired 32-element sums

    @staticmethod
    def alloc(R: int, K: int) -> "Q8Buffers":
        return Q8Buffers(np.empty((R, K), np.int8), np.empty((R, K // 32), np.float32),
                         np.empty((R, K // 4), np.int32), np.empty((R, max(1, K // 256)), np.float32),
                         np.empty((R, K // 16), np.int16), np.empty((R, max(1, K // 64)), np.int32))


@njit(cache=True, error_model="numpy")
def quantize_into(h, kind, q):
    """Quantize rows h (R, K) for a vec-dot type (kind: types.ACT_Q8_0 or ACT_Q8_K) into q (Q8Buffers)."""
    if kind == ACT_Q8_0:
        _quantize_q8_0_serial(h, q.xq, q.dx0, q.sx)
    else:
        _quantize_q8_k_serial(h, q.xq, q.dxk, q.bs16, q.bsp)


@njit(cache=True, error_model="numpy")
def matmul_row(layout, ggml_type, q, runs, out):
    """Quantized activation rows q (Q8Buffers) times an exact layout into out (R, rows of the
    layout), inside compiled code: the dispatch over the exact types, written once. runs: the three
    arrays of run_arrays."""
    run_start, run_len, run_batched = runs
    if ggml_type == T.Q6_K:
        _q6_k_rows(layout, q.xq, q.dxk, q.bs16, run_start, run_len, run_batched, out)
    elif ggml_type == T.Q4_K:
        _q4_k_rows(layout, q.xq, q.dxk, q.bsp, run_start, run_len, run_batched, out)
    elif ggml_type == T.Q8_0:
        _q0_x8_rows(Q8_0_KIND, layout, q.xq, q.dx0, q.sx, out)
    else:
        _q0_x8_rows(Q5_0_KIND, layout, q.xq, q.dx0, q.sx, out)
