"""Q6_K weights (read in place) times q8_K activation rows: ggml_vec_dot_q6_K_q8_K's numbers for
fewer than 8 rows, the tiled kernel's for more, bit for bit."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.cpu.qdot.common import PREFETCH, TILED_MIN_ROWS, X_CHUNK_BYTES
from kernels.cpu.qdot.rows16 import V16F, V16I, store_lanes, vpdpwssd
from kernels.cpu.simd import (
    REGISTERS, V8F, prefetch, V8I, V16B, V16S, V32B, array, byte_ptr, c32, c64, call, f16, f32, fma, hsum8, i32,
    load_as, madd16, dot4_scaled, splat, vconst, vload, vstore,
)

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
                    if MR == 1 and j == 0:
                        lane = ir.Constant(V8I, [0] * 8)
                    for k in range(4):
                        s = 4 * j + k                                             # scales 2s, 2s+1
                        scv = builder.shuffle_vector(sc16, sc16, ir.Constant(ir.VectorType(i32, 16), [2 * s] * 8 + [2 * s + 1] * 8))
                        if MR == 1:        # one row: each chunk straight from the registers, no buffer
                            x = vload(builder, builder.gep(xrow[0], [builder.add(builder.mul(b, c64(256)), c64(32 * s))]), V32B)
                            lane = dot4_scaled(builder, qv[k], x, scv, lane)
                            continue
                        builder.store(qv[k], builder.gep(qbuf, [c32(0), c32(s)]))
                        builder.store(scv, builder.gep(sbuf, [c32(0), c32(s)]))
                if MR == 1:
                    builder.store(lane, lanes[0])
                else:
                    for i in range(MR):
                        builder.store(ir.Constant(V8I, [0] * 8), lanes[i])
                    with cgutils.for_range(builder, c64(8)) as chunks:             # chunk c: elements 32c .. 32c+31
                        c = chunks.index
                        qv = builder.load(builder.gep(qbuf, [c32(0), c]))
                        scv = builder.load(builder.gep(sbuf, [c32(0), c]))
                        xoff = builder.add(builder.mul(b, c64(256)), builder.mul(c, c64(32)))
                        for i in range(MR):
                            x = vload(builder, builder.gep(xrow[i], [xoff]), V32B)
                            builder.store(dot4_scaled(builder, qv, x, scv, builder.load(lanes[i])), lanes[i])
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


@njit(parallel=True, cache=True, error_model="numpy")
def _q6_k_rows(w, xq, dx, bs16, run_start, run_len, run_batched, out):
    """Q6_K rows x q8_K rows -> out (M, N): a batched run of 8 rows or more takes the tiled
    arithmetic, every other row the vec_dot arithmetic. Chunks of rows; prange over weight rows."""
    K = xq.shape[1]
    N = w.shape[0]
    chunk = max(4, X_CHUNK_BYTES // K // 4 * 4)
    for r in range(run_start.shape[0]):
        r0, n = run_start[r], run_len[r]
        tiled = run_batched[r] and n >= TILED_MIN_ROWS
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


# --- Q6_K prompts on 512-bit registers: 16 activation rows in the lanes ---------------------------
# The tiled arithmetic needs only one exact integer per (output, super-block), S = sum_k w_k x_k with
# w_k = (q_k - 32) * sc (|w| <= 4096, an int16) and |S| <= 256 * 4096 * 128 < 2^31. So a panel of
# weight rows is unpacked once into those int16 products (q6_k_unpack16), the activations are
# regrouped 16 rows to a register (int16 pairs, rows16.regroup_pairs), and one vpdpwssd takes a pair of w of
# one weight row (broadcast) against the same pair of 16 rows: S for 16 outputs with no scale
# multiplies and no -32 correction. Then per super-block res = d_w * float(S) and out = fma(res,
# d_x, out) lane-wise: the tiled kernel's float steps, bit for bit.
V32S = ir.VectorType(ir.IntType(16), 32)
WIDE_PROMPT = REGISTERS == 32
Q6K_NW = 8                  # weight rows per tile (each with one accumulator per 16 activation rows)
Q6K_PANEL_BYTES = 512 << 10  # the unpacked panel (rows x K int16) stays in L2 beside the activations
# From this many activation rows on, a batched Q6_K run takes the 16-row kernel (at 8 rows the two
# kernels are even; README: measured).
Q6K_PROMPT_MIN_ROWS = 16


@intrinsic
def q6_k_unpack16(typingctx, w, r0, n_rows, wp, dwp):
    """Weight rows r0 .. r0+n_rows-1 (GGUF Q6_K) -> wp (P, K) int16 (q - 32) * scale, dwp (P, nb) float32 d."""
    sig = types.void(w, r0, n_rows, wp, dwp)

    def codegen(context, builder, signature, args):
        wa, _, _, pa, da = (array(context, builder, signature.args[k], args[k]) if k not in (1, 2) else None for k in range(5))
        r0v, nr = args[1], args[2]
        nb = builder.extract_value(da.shape, 1)
        K = builder.extract_value(pa.shape, 1)
        m15, m3 = vconst(V32B, 15), vconst(V32B, 3)
        with cgutils.for_range(builder, nr) as rl:
            r = rl.index
            src = builder.gep(byte_ptr(builder, wa.data), [builder.mul(builder.add(r0v, r), builder.extract_value(wa.strides, 0))])
            dst = builder.gep(byte_ptr(builder, pa.data), [builder.mul(r, builder.mul(K, c64(2)))])
            with cgutils.for_range(builder, nb) as bl:
                b = bl.index
                p = builder.gep(src, [builder.mul(b, c64(Q6_K_BLOCK))])
                sc16 = builder.sext(vload(builder, builder.gep(p, [c64(192)]), V16B), V16S)
                builder.store(builder.fpext(load_as(builder, p, f16, 208), f32),
                              builder.gep(da.data, [builder.add(builder.mul(r, nb), b)]))
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
                        s = 4 * j + k                                             # elements 32s .. 32s+31
                        scv = builder.shuffle_vector(sc16, sc16, ir.Constant(ir.VectorType(i32, 32), [2 * s] * 16 + [2 * s + 1] * 16))
                        wv = builder.mul(builder.sub(builder.zext(qv[k], V32S), vconst(V32S, 32)), scv)
                        off = builder.mul(builder.add(builder.mul(b, c64(256)), c64(32 * s)), c64(2))
                        vstore(builder, wv, builder.gep(dst, [off]))
        return context.get_dummy_value()

    return sig, codegen


def _q6_k_tile16(NW: int, MX: int):
    """kern(wp, dwp, j0, x16, dx16, g, out, n0, M): out[16(g+x) + l, n0+j0+j] for j < NW, x < MX and
    the 16 lanes l (rows below M). wp (P, K) int16 and dwp (P, nb) from q6_k_unpack16; x16 (G, K/2,
    16, 2) int16 and dx16 (G, nb, 16) float32 from rows16 (regroup_pairs(xq), lanes(dx))."""

    def kern(typingctx, wp, dwp, j0, x16, dx16, g, out, n0, M):
        sig = types.void(wp, dwp, j0, x16, dx16, g, out, n0, M)

        def codegen(context, builder, signature, args):
            wa, da, _, xa, dxa, _, oa = (array(context, builder, signature.args[k], args[k]) if k not in (2, 5) else None
                                         for k in range(7))
            j0v, gv, n0v, Mv = args[2], args[5], args[7], args[8]
            K = builder.extract_value(wa.shape, 1)
            nb = builder.extract_value(da.shape, 1)
            N = builder.extract_value(oa.shape, 1)
            wrow = [builder.gep(byte_ptr(builder, wa.data), [builder.mul(builder.add(j0v, c64(j)), builder.mul(K, c64(2)))])
                    for j in range(NW)]
            drow = [builder.gep(da.data, [builder.mul(builder.add(j0v, c64(j)), nb)]) for j in range(NW)]
            xg = [builder.gep(byte_ptr(builder, xa.data), [builder.mul(builder.add(gv, c64(x)), builder.mul(K, c64(32)))])
                  for x in range(MX)]
            dxg = [builder.gep(dxa.data, [builder.mul(builder.add(gv, c64(x)), builder.mul(nb, c64(16)))]) for x in range(MX)]
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
                    for j in range(NW):
                        dw = splat(builder, builder.load(builder.gep(drow[j], [b])), V16F)
                        res = builder.fmul(dw, builder.sitofp(builder.load(S[j][x]), V16F))
                        builder.store(call(builder, "llvm.fma.v16f32", V16F, [res, dxv, builder.load(acc[j][x])]), acc[j][x])
            for x in range(MX):
                for j in range(NW):
                    store_lanes(builder, builder.load(acc[j][x]), oa.data, N, Mv, builder.add(gv, c64(x)),
                                builder.add(n0v, builder.add(j0v, c64(j))))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"q6_k_tile16_{NW}x{MX}"
    return intrinsic(kern)


if WIDE_PROMPT:
    q6_k_tile16_2, q6_k_tile16_1 = _q6_k_tile16(Q6K_NW, 2), _q6_k_tile16(Q6K_NW, 1)


@njit(parallel=True, cache=True, error_model="numpy")
def _q6_k_prompt(w, x16, dx16, M, out):
    """Q6_K rows (N % Q6K_NW == 0) x regrouped q8_K rows -> out (M, N) with the tiled arithmetic; prange
    over panels of weight rows, each unpacked once for every group of 16 activation rows."""
    N = w.shape[0]
    K = x16.shape[1] * 2
    nb = dx16.shape[1]
    G = x16.shape[0]
    P = max(Q6K_NW, min(64, Q6K_PANEL_BYTES // (2 * K)) // Q6K_NW * Q6K_NW)
    for p in prange(-(-N // P)):
        r0 = p * P
        nr = min(P, N - r0)
        wp = np.empty((P, K), np.int16)
        dwp = np.empty((P, nb), np.float32)
        q6_k_unpack16(w, r0, nr, wp, dwp)
        g = 0
        while g + 2 <= G:
            for j0 in range(0, nr, Q6K_NW):
                q6_k_tile16_2(wp, dwp, j0, x16, dx16, g, out, r0, M)
            g += 2
        if g < G:
            for j0 in range(0, nr, Q6K_NW):
                q6_k_tile16_1(wp, dwp, j0, x16, dx16, g, out, r0, M)


@njit(cache=True)
def _no_wide_kernel(w, x16, dx16, M, out):
    raise RuntimeError("the 16-row Q6_K kernel needs AVX-512 (qdot._wide_q6_k never picks it here)")


# The 512-bit kernel is compiled only where it runs; elsewhere the dispatch never calls it.
q6_k_prompt = _q6_k_prompt if WIDE_PROMPT else _no_wide_kernel
