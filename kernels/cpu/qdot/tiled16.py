"""Prompts of the K-quants with llama.cpp's tiled arithmetic (Q6_K, Q3_K, IQ4_XS, Q2_K) on
512-bit registers, 16 activation rows in the lanes.

The tiled arithmetic (8 rows or more, tiled_run_microtile_avx2) needs one exact integer per
(output, super-block), S = sum_k w_k x_k with w_k the element's value times its sub-block's scale,
then res = d_w * float(S) and out = fma(res, d_x, out). Every such w_k fits an int16 (Q6_K (q-32)*sc
up to 4096, IQ4_XS level*(ls-32) up to 4064, Q3_K up to 128) and |S| <= 256 * 4096 * 128 < 2^31.
So a panel of weight rows is unpacked once into those int16 products (lane_unpack16, from the
type's decoder), the activations are regrouped 16 rows to a register (int16
pairs, rows16.regroup_pairs), and one vpdpwssd takes a pair of w of one weight row (broadcast)
against the same pair of 16 rows: S for 16 outputs with no scale multiplies. Then the float steps
lane-wise (Q2_K's minimums: P = sum of mn * the 16-element sums of x, also by vpdpwssd, and
res = fma(-dmin_w, float(P), res)): the tiled kernel's numbers, bit for bit. AVX-512 only (simd.WIDE); elsewhere the
per-type kernels run every prompt.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels import types as T
from kernels.cpu.qdot.iq4_xs import IQ4_XS_BLOCK, _decode as _iq4_xs_decode
from kernels.cpu.qdot.q2_k import Q2_K_BLOCK, _decode as _q2_k_decode
from kernels.cpu.qdot.q3_k import Q3_K_BLOCK, _decode as _q3_k_decode
from kernels.cpu.qdot.q6_k import Q6_K_BLOCK, decode_signed as _q6_k_decode
from kernels.cpu.qdot.rows16 import V32S, store_lanes, vpdpwssd
from kernels.cpu.simd import (V16F, V16I, WIDE, array, byte_ptr, c64, call, i32, load_as, not_this_variant, splat,
                              vload, vstore)

NW = 8                       # weight rows per tile (each with one accumulator per 16 activation rows)
PANEL_BYTES = 512 << 10      # the unpacked panel (rows x K int16) stays in L2 beside the activations
# From this many activation rows on, a batched run takes these kernels (Q6_K: at 8 rows the two
# kernels are even; README: measured).
PROMPT_MIN_ROWS = 16


def lane_unpack16(name: str, block_bytes: int, decode, signed: bool, mins: bool):
    """An unpacker (w, r0, n_rows, wp, dwp, dmp, mnp): GGUF rows r0 .. r0+n_rows-1 of a type on
    kernels.cpu.qdot.lanes (or Q6_K, q6_k.decode_signed) -> wp (P, K) int16 and dwp (P, nb) d, from
    its decoder: per 32-element chunk the values (signed: ws, else qs)
    widened to int16 and times the chunk's two scales (ss: lanes 0-7 elements 0..15, lanes 8-15
    elements 16..31); with mins (Q2_K) also dmin into dmp (P, nb) and the 16 minimums into mnp
    (P, nb, 16) int16."""

    def kern(typingctx, w, r0, n_rows, wp, dwp, dmp, mnp):
        sig = types.void(w, r0, n_rows, wp, dwp, dmp, mnp)

        def codegen(context, builder, signature, args):
            wa, _, _, pa, da, dma, mna = (array(context, builder, signature.args[k], args[k]) if k not in (1, 2) else None
                                          for k in range(7))
            r0v, nr = args[1], args[2]
            nb = builder.extract_value(da.shape, 1)
            K = builder.extract_value(pa.shape, 1)
            halves = ir.Constant(ir.VectorType(i32, 32), [0] * 16 + [8] * 16)
            with cgutils.for_range(builder, nr) as rl:
                r = rl.index
                src = builder.gep(byte_ptr(builder, wa.data), [builder.mul(builder.add(r0v, r), builder.extract_value(wa.strides, 0))])
                dst = builder.gep(byte_ptr(builder, pa.data), [builder.mul(r, builder.mul(K, c64(2)))])
                with cgutils.for_range(builder, nb) as bl:
                    b = bl.index
                    qs, ws, ss, dw, dmin, mn = decode(builder, builder.gep(src, [builder.mul(b, c64(block_bytes))]))
                    builder.store(dw, builder.gep(da.data, [builder.add(builder.mul(r, nb), b)]))
                    if mins:
                        builder.store(dmin, builder.gep(dma.data, [builder.add(builder.mul(r, nb), b)]))
                        vstore(builder, mn, builder.gep(byte_ptr(builder, mna.data), [builder.mul(builder.add(builder.mul(r, nb), b), c64(32))]))
                    for c in range(8):
                        v = builder.sext(ws[c], V32S) if signed else builder.zext(qs[c], V32S)
                        wv = builder.mul(v, builder.shuffle_vector(ss[c], ss[c], halves))
                        vstore(builder, wv, builder.gep(dst, [builder.mul(builder.add(builder.mul(b, c64(256)), c64(32 * c)), c64(2))]))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"{name}_unpack16"
    return intrinsic(kern)


q6_k_unpack16 = lane_unpack16("q6_k", Q6_K_BLOCK, _q6_k_decode, True, False)
q3_k_unpack16 = lane_unpack16("q3_k", Q3_K_BLOCK, _q3_k_decode, True, False)
iq4_xs_unpack16 = lane_unpack16("iq4_xs", IQ4_XS_BLOCK, _iq4_xs_decode, True, False)
q2_k_unpack16 = lane_unpack16("q2_k", Q2_K_BLOCK, _q2_k_decode, False, True)


def _tile16(NW: int, MX: int, mins: bool):
    """kern(wp, dwp, dmp, mnp, j0, x16, dx16, bs16, g, out, n0, M): out[16(g+x) + l, n0+j0+j] for
    j < NW, x < MX and the 16 lanes l (rows below M). wp (P, K) int16, dwp (P, nb) and (mins) dmp,
    mnp from an unpacker; x16 (G, K/2, 16, 2) int16, dx16 (G, nb, 16) float32 and (mins) bs16
    (G, K/32, 16, 2) int16, the 16-element sums, from rows16. With mins (Q2_K) per super-block
    P = sum of mn * bs16 (vpdpwssd on their pairs) and res = fma(-dmin_w, float(P), res)."""

    def kern(typingctx, wp, dwp, dmp, mnp, j0, x16, dx16, bs16, g, out, n0, M):
        sig = types.void(wp, dwp, dmp, mnp, j0, x16, dx16, bs16, g, out, n0, M)

        def codegen(context, builder, signature, args):
            wa, da, dma, mna, _, xa, dxa, ba, _, oa = (array(context, builder, signature.args[k], args[k])
                                                      if k not in (4, 8) else None for k in range(10))
            j0v, gv, n0v, Mv = args[4], args[8], args[10], args[11]
            K = builder.extract_value(wa.shape, 1)
            nb = builder.extract_value(da.shape, 1)
            N = builder.extract_value(oa.shape, 1)
            wrow = [builder.gep(byte_ptr(builder, wa.data), [builder.mul(builder.add(j0v, c64(j)), builder.mul(K, c64(2)))])
                    for j in range(NW)]
            drow = [builder.gep(da.data, [builder.mul(builder.add(j0v, c64(j)), nb)]) for j in range(NW)]
            xg = [builder.gep(byte_ptr(builder, xa.data), [builder.mul(builder.add(gv, c64(x)), builder.mul(K, c64(32)))])
                  for x in range(MX)]
            dxg = [builder.gep(dxa.data, [builder.mul(builder.add(gv, c64(x)), builder.mul(nb, c64(16)))]) for x in range(MX)]
            bg = [builder.gep(byte_ptr(builder, ba.data), [builder.mul(builder.add(gv, c64(x)), builder.mul(nb, c64(8 * 64)))])
                  for x in range(MX)] if mins else None
            zero_i = ir.Constant(V16I, [0] * 16)
            acc = [[cgutils.alloca_once_value(builder, ir.Constant(V16F, [0.0] * 16)) for _ in range(MX)] for _ in range(NW)]
            S = [[cgutils.alloca_once(builder, V16I) for _ in range(MX)] for _ in range(NW)]
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                for j in range(NW):
                    for x in range(MX):
                        builder.store(zero_i, S[j][x])
                with cgutils.for_range_slice(builder, c64(0), c64(256), c64(8)) as (k, _):   # 4 pairs per step
                    e = builder.add(builder.mul(b, c64(256)), k)                 # element index
                    for u in range(4):
                        ek = builder.add(e, c64(2 * u))
                        xs = [vload(builder, builder.gep(xg[x], [builder.mul(ek, c64(32))]), V16I) for x in range(MX)]
                        for j in range(NW):
                            wd = splat(builder, load_as(builder, wrow[j], i32, builder.mul(ek, c64(2))), V16I)
                            for x in range(MX):
                                builder.store(vpdpwssd(builder, builder.load(S[j][x]), xs[x], wd), S[j][x])
                for x in range(MX):
                    dxv = vload(builder, builder.gep(dxg[x], [builder.mul(b, c64(16))]), V16F)
                    if mins:                                                   # 8 pairs of 16-element sums
                        bsx = [vload(builder, builder.gep(bg[x], [builder.mul(builder.add(builder.mul(b, c64(8)), c64(q)), c64(64))]), V16I)
                               for q in range(8)]
                    for j in range(NW):
                        dw = splat(builder, builder.load(builder.gep(drow[j], [b])), V16F)
                        res = builder.fmul(dw, builder.sitofp(builder.load(S[j][x]), V16F))
                        if mins:
                            at = builder.mul(builder.add(builder.mul(builder.add(j0v, c64(j)), nb), b), c64(32))
                            P = ir.Constant(V16I, [0] * 16)
                            for q in range(8):
                                mq = splat(builder, load_as(builder, byte_ptr(builder, mna.data), i32, builder.add(at, c64(4 * q))), V16I)
                                P = vpdpwssd(builder, P, bsx[q], mq)
                            dm = splat(builder, builder.fneg(builder.load(builder.gep(dma.data, [builder.add(builder.mul(builder.add(j0v, c64(j)), nb), b)]))), V16F)
                            res = call(builder, "llvm.fma.v16f32", V16F, [dm, builder.sitofp(P, V16F), res])
                        builder.store(call(builder, "llvm.fma.v16f32", V16F, [res, dxv, builder.load(acc[j][x])]), acc[j][x])
            for x in range(MX):
                for j in range(NW):
                    store_lanes(builder, builder.load(acc[j][x]), oa.data, N, Mv, builder.add(gv, c64(x)),
                                builder.add(n0v, builder.add(j0v, c64(j))))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"tiled16_{NW}x{MX}{'_mins' if mins else ''}"
    return intrinsic(kern)


if WIDE:
    tile16_2, tile16_1 = _tile16(NW, 2, False), _tile16(NW, 1, False)
    tile16_2m, tile16_1m = _tile16(NW, 2, True), _tile16(NW, 1, True)


@njit(cache=True, inline="always")
def unpack16(ggml_type, w, r0, n_rows, wp, dwp, dmp, mnp):
    """The unpacker of ggml_type (Q6_K, Q3_K, Q2_K, or IQ4_XS): see lane_unpack16."""
    if ggml_type == T.Q6_K:
        q6_k_unpack16(w, r0, n_rows, wp, dwp, dmp, mnp)
    elif ggml_type == T.Q3_K:
        q3_k_unpack16(w, r0, n_rows, wp, dwp, dmp, mnp)
    elif ggml_type == T.Q2_K:
        q2_k_unpack16(w, r0, n_rows, wp, dwp, dmp, mnp)
    else:
        iq4_xs_unpack16(w, r0, n_rows, wp, dwp, dmp, mnp)


@njit(cache=True)
def wide(ggml_type, n_out, run_start, run_len, run_batched):
    """Does a product take these kernels? Q6_K, Q3_K, IQ4_XS or Q2_K, one batched run (a prompt) of
    PROMPT_MIN_ROWS rows or more, on 512-bit registers, whole tiles of weight rows."""
    return (WIDE and (ggml_type == T.Q6_K or ggml_type == T.Q3_K or ggml_type == T.IQ4_XS or ggml_type == T.Q2_K)
            and run_start.shape[0] == 1 and run_batched[0] and run_len[0] >= PROMPT_MIN_ROWS and n_out % NW == 0)


@njit(parallel=True, cache=True, error_model="numpy")
def _prompt(ggml_type, w, x16, dx16, bs16, M, out):
    """GGUF rows w (N % NW == 0) of ggml_type x regrouped q8_K rows -> out (M, N) with the tiled
    arithmetic; prange over panels of weight rows, each unpacked once for every group of 16
    activation rows. bs16: rows16.lanes of the 16-element sums as int16 pairs (read for Q2_K)."""
    N = w.shape[0]
    K = x16.shape[1] * 2
    nb = dx16.shape[1]
    G = x16.shape[0]
    P = max(NW, min(64, PANEL_BYTES // (2 * K)) // NW * NW)
    mins = ggml_type == T.Q2_K
    for p in prange(-(-N // P)):
        r0 = p * P
        nr = min(P, N - r0)
        wp = np.empty((P, K), np.int16)
        dwp = np.empty((P, nb), np.float32)
        dmp = np.empty((P, nb), np.float32)
        mnp = np.empty((P, nb, 16), np.int16)
        unpack16(ggml_type, w, r0, nr, wp, dwp, dmp, mnp)
        g = 0
        while g + 2 <= G:
            for j0 in range(0, nr, NW):
                if mins:
                    tile16_2m(wp, dwp, dmp, mnp, j0, x16, dx16, bs16, g, out, r0, M)
                else:
                    tile16_2(wp, dwp, dmp, mnp, j0, x16, dx16, bs16, g, out, r0, M)
            g += 2
        if g < G:
            for j0 in range(0, nr, NW):
                if mins:
                    tile16_1m(wp, dwp, dmp, mnp, j0, x16, dx16, bs16, g, out, r0, M)
                else:
                    tile16_1(wp, dwp, dmp, mnp, j0, x16, dx16, bs16, g, out, r0, M)


# The 512-bit kernels are compiled only where they run; elsewhere the dispatch never calls them.
prompt = _prompt if WIDE else not_this_variant
