"""Q4_K weights (repacked 8 rows at a time, as llama.cpp does) times q8_K activation rows:
ggml_gemv_q4_K_8x8_q8_K's and ggml_gemm_q4_K_8x8_q8_K's numbers bit for bit."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.cpu.qdot.common import PREFETCH, X_CHUNK_BYTES
from kernels.types import GEMM_ROWS
from kernels.cpu.qdot.rows16 import V32S, store_lanes
from kernels.cpu.simd import (
    VNNI, WIDE, V8F, Chains, add_to, prefetch, V8I, V16B, V16F, V16I, V16S, V32B, V8H, array, byte_ptr, c64, call, dot4, f32, fma, i32, load_as,
    madd16, maddubs, not_this_variant, splat, vconst, vload, vstore,
)

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
# The sub-blocks' dots as vpdpbusd (then vpmulld by the scale) with AVX-512 VNNI; with AVX-VNNI's 16
# registers the vpmaddubsw + vpmaddwd chain measured faster (README: measured).
DOTS_VNNI = VNNI and WIDE


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
            even = ir.Constant(ir.VectorType(i32, 8), [2 * e for e in range(8)])
            odd = ir.Constant(ir.VectorType(i32, 8), [2 * e + 1 for e in range(8)])
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
                    # a sub-block's integer dot per row: with DOTS_VNNI 8 vpdpbusd into int32 lanes, then
                    # times its scale (vpmulld); without, vpmaddubsw pairs summed in int16 (at most
                    # 8*2*15*127, no overflow), then vpmaddwd with the scale. The same integers.
                    if DOTS_VNNI:
                        sc_lo = builder.zext(builder.shuffle_vector(sc, sc, even), V8I)
                        sc_hi = builder.zext(builder.shuffle_vector(sc, sc, odd), V8I)
                    else:
                        sc_lo = builder.shuffle_vector(sc, sc, lo_pairs)
                        sc_hi = builder.shuffle_vector(sc, sc, hi_pairs)
                    zero = ir.Constant(V8I, [0] * 8) if DOTS_VNNI else ir.Constant(V16S, [0] * 16)
                    # one or two rows: each half's sum in two chains (simd.Chains); more rows have
                    # chains enough, one per row and half
                    ilo = [Chains(builder, zero, 2 if MR <= 2 else 1) for _ in range(MR)]
                    ihi = [Chains(builder, zero, 2 if MR <= 2 else 1) for _ in range(MR)]
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
                            if DOTS_VNNI:
                                ilo[i].add(dot4, lo, xa_v)
                                ihi[i].add(dot4, hi, xb_v)
                            else:
                                ilo[i].add(add_to, maddubs(builder, lo, xa_v))
                                ihi[i].add(add_to, maddubs(builder, hi, xb_v))
                    ilo, ihi = [c.total() for c in ilo], [c.total() for c in ihi]
                    for i in range(MR):
                        if DOTS_VNNI:
                            isum = builder.add(builder.mul(ilo[i], sc_lo), builder.mul(ihi[i], sc_hi))
                        else:
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
# With 32 vector registers (AVX-512) a prompt's unpacked weights serve 8 rows at a time, each row
# still with the gemm arithmetic llama.cpp gives it (its groups of 4 only pick which rows get it).
GEMM_MR = 8 if WIDE else 4
q4_k_gemm_wide = _q4_k_kernel(GEMM_MR, True)
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
        n_gemm = n - n % GEMM_ROWS if (run_batched[r] and n >= GEMM_ROWS) else 0
        for c0 in range(r0, r0 + n, chunk):
            c1 = min(r0 + n, c0 + chunk)
            for g in prange(wx8.shape[0]):
                m = c0
                while m + GEMM_MR <= min(c1, r0 + n_gemm):
                    q4_k_gemm_wide(wx8, g, xq, dx, bsp, m, out)
                    m += GEMM_MR
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


# --- Q4_K prompts on 512-bit registers: 16 activation rows in the lanes ---------------------------
# llama.cpp's gemm arithmetic is per output and per 64-element chunk: the exact integers
# isum = sc_2c dot_2c + sc_2c+1 dot_2c+1 and msum = mn_2c bsum_2c + mn_2c+1 bsum_2c+1, then
# acc = fma(float(isum), d_w*d_x, acc), accm = fma(float(msum), dmin_w*d_x, accm), out = acc - accm.
# Nothing ties the lanes to weight rows, so here they hold 16 activation rows (rows16.regroup_bytes):
# a panel of weight groups has its nibbles unpacked once (q4_k_unpack16, in the x8 order), and one
# vpdpbusd takes a broadcast dword of one weight row against the same dword of 16 rows; each
# sub-block's dot times its scale (vpmulld), the minimums' sums one vpmaddwd, all lane-wise.
Q4K_NW = 8                       # weight rows per tile (one 8-row group), times Q4K_MX groups of 16 rows
Q4K_MX = 1
Q4K_PANEL_BYTES = 512 << 10      # the unpacked panel stays in L2 beside the activations
# From this many gemm rows on, a batched run takes the 16-row kernel (at 16 the two kernels are
# even; README: measured).
Q4K_PROMPT_MIN_ROWS = 32
# per 8-row group and super-block: nibbles [half 2][c 4][step 8][row 8][4], then the scales as float32
# [c][row][2], the minimums as int16 pairs [c][row][2], d [row] and dmin [row] as float32
_U_SC, _U_MN, _U_D, _U_DMIN = 2048, 2048 + 256, 2048 + 256 + 128, 2048 + 256 + 128 + 32
Q4K_U_BYTES = _U_DMIN + 32


@intrinsic
def q4_k_unpack16(typingctx, wx8, g0, n_groups, wu):
    """Groups g0 .. g0+n_groups-1 of a Q4_K x8 matrix -> wu (n, nb, Q4K_U_BYTES) uint8, the layout above."""
    sig = types.void(wx8, g0, n_groups, wu)

    def codegen(context, builder, signature, args):
        wa, _, _, ua = (array(context, builder, signature.args[k], args[k]) if k in (0, 3) else None for k in range(4))
        g0v, ng = args[1], args[2]
        nb = builder.extract_value(ua.shape, 1)
        m0f = vconst(V32B, 0x0F)
        with cgutils.for_range(builder, ng) as gl:
            src = builder.gep(byte_ptr(builder, wa.data), [builder.mul(builder.add(g0v, gl.index), builder.mul(nb, c64(Q4K_X8_BYTES)))])
            dst = builder.gep(byte_ptr(builder, ua.data), [builder.mul(gl.index, builder.mul(nb, c64(Q4K_U_BYTES)))])
            with cgutils.for_range(builder, nb) as bl:
                p = builder.gep(src, [builder.mul(bl.index, c64(Q4K_X8_BYTES))])
                u = builder.gep(dst, [builder.mul(bl.index, c64(Q4K_U_BYTES))])
                for off in range(0, 1024, 32):
                    v = vload(builder, builder.gep(p, [c64(off)]), V32B)
                    vstore(builder, builder.and_(v, m0f), builder.gep(u, [c64(off)]))
                    vstore(builder, builder.and_(builder.lshr(v, vconst(V32B, 4)), m0f), builder.gep(u, [c64(1024 + off)]))
                sc = builder.uitofp(vload(builder, builder.gep(p, [c64(1024)]), ir.VectorType(ir.IntType(8), 64)), ir.VectorType(f32, 64))
                vstore(builder, sc, builder.gep(u, [c64(_U_SC)]))
                mn = builder.zext(vload(builder, builder.gep(p, [c64(1088)]), ir.VectorType(ir.IntType(8), 64)), ir.VectorType(ir.IntType(16), 64))
                vstore(builder, mn, builder.gep(u, [c64(_U_MN)]))
                vstore(builder, builder.fpext(vload(builder, builder.gep(p, [c64(1152)]), V8H), V8F), builder.gep(u, [c64(_U_D)]))
                vstore(builder, builder.fpext(vload(builder, builder.gep(p, [c64(1168)]), V8H), V8F), builder.gep(u, [c64(_U_DMIN)]))
        return context.get_dummy_value()

    return sig, codegen


def _q4_k_tile16(NW: int, MX: int):
    """kern(wu, gw, j0, xg, bsg, dxg, gx, out, n0, M): out[16(gx+x) + l, n0 + 8gw + j0 + j] for j < NW,
    x < MX and the 16 lanes l (rows below M), with the gemm arithmetic. wu: q4_k_unpack16's panel;
    xg (G, K/4, 16, 4) int8, bsg (G, nb*4, 16) int32 (bsp's int16 pairs), dxg (G, nb, 16) float32."""

    def kern(typingctx, wu, gw, j0, xg, bsg, dxg, gx, out, n0, M):
        sig = types.void(wu, gw, j0, xg, bsg, dxg, gx, out, n0, M)

        def codegen(context, builder, signature, args):
            ua, _, _, xa, ba, da, _, oa = (array(context, builder, signature.args[k], args[k]) if k not in (1, 2, 6) else None
                                           for k in range(8))
            gwv, j0v, gxv, n0v, Mv = args[1], args[2], args[6], args[8], args[9]
            nb = builder.extract_value(ua.shape, 1)
            K = builder.mul(nb, c64(256))
            N = builder.extract_value(oa.shape, 1)
            wbase = builder.gep(byte_ptr(builder, ua.data), [builder.mul(gwv, builder.mul(nb, c64(Q4K_U_BYTES)))])
            xgs = [builder.gep(byte_ptr(builder, xa.data), [builder.mul(builder.add(gxv, c64(x)), builder.mul(K, c64(16)))]) for x in range(MX)]
            bgs = [builder.gep(byte_ptr(builder, ba.data), [builder.mul(builder.add(gxv, c64(x)), builder.mul(nb, c64(256)))]) for x in range(MX)]
            dgs = [builder.gep(byte_ptr(builder, da.data), [builder.mul(builder.add(gxv, c64(x)), builder.mul(nb, c64(64)))]) for x in range(MX)]
            zf = ir.Constant(V16F, [0.0] * 16)
            acc = [[cgutils.alloca_once_value(builder, zf) for _ in range(MX)] for _ in range(NW)]
            accm = [[cgutils.alloca_once_value(builder, zf) for _ in range(MX)] for _ in range(NW)]
            scale = [[cgutils.alloca_once(builder, V16F) for _ in range(MX)] for _ in range(NW)]
            scale_m = [[cgutils.alloca_once(builder, V16F) for _ in range(MX)] for _ in range(NW)]
            zi = ir.Constant(V16I, [0] * 16)
            row = [builder.add(j0v, c64(j)) for j in range(NW)]          # rows of the 8-row group
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                u = builder.gep(wbase, [builder.mul(b, c64(Q4K_U_BYTES))])
                for x in range(MX):
                    dxv = vload(builder, builder.gep(dgs[x], [builder.mul(b, c64(64))]), V16F)
                    for j in range(NW):
                        dw = splat(builder, load_as(builder, u, f32, builder.add(c64(_U_D), builder.mul(row[j], c64(4)))), V16F)
                        dm = splat(builder, load_as(builder, u, f32, builder.add(c64(_U_DMIN), builder.mul(row[j], c64(4)))), V16F)
                        builder.store(builder.fmul(dw, dxv), scale[j][x])           # fp32(d_w * d_x)
                        builder.store(builder.fmul(dm, dxv), scale_m[j][x])
                with cgutils.for_range(builder, c64(4)) as cloop:                # 64-element chunks
                    c = cloop.index
                    dots = [[[zi, zi] for _ in range(MX)] for _ in range(NW)]      # [j][x][lo/hi]
                    for step in range(8):
                        xs = [[vload(builder, builder.gep(xgs[x], [builder.add(builder.mul(builder.add(builder.mul(b, c64(64)), builder.add(builder.mul(c, c64(16)), c64(8 * h + step))), c64(64)), c64(0))]), V16I)
                               for h in range(2)] for x in range(MX)]
                        for j in range(NW):
                            for h in range(2):
                                at = builder.add(builder.add(c64(1024 * h + 32 * step), builder.mul(c, c64(256))), builder.mul(row[j], c64(4)))
                                wd = builder.bitcast(splat(builder, load_as(builder, u, i32, at), V16I), ir.VectorType(ir.IntType(8), 64))
                                for x in range(MX):
                                    dots[j][x][h] = call(builder, "llvm.x86.avx512.vpdpbusd.512", V16I,
                                                         [dots[j][x][h], builder.bitcast(wd, V16I), xs[x][h]])
                    for j in range(NW):
                        sc_at = builder.add(builder.add(c64(_U_SC), builder.mul(c, c64(64))), builder.mul(row[j], c64(8)))
                        sc_lo = splat(builder, load_as(builder, u, f32, sc_at), V16F)
                        sc_hi = splat(builder, load_as(builder, u, f32, builder.add(sc_at, c64(4))), V16F)
                        mn_at = builder.add(builder.add(c64(_U_MN), builder.mul(c, c64(32))), builder.mul(row[j], c64(4)))
                        mn = builder.bitcast(splat(builder, load_as(builder, u, i32, mn_at), V16I), V32S)
                        for x in range(MX):
                            # float(isum) exactly: |dot| <= 32*15*128, sc <= 63, |isum| < 2^23
                            isum = call(builder, "llvm.fma.v16f32", V16F, [builder.sitofp(dots[j][x][1], V16F), sc_hi,
                                                                           builder.fmul(builder.sitofp(dots[j][x][0], V16F), sc_lo)])
                            bs = builder.bitcast(vload(builder, builder.gep(bgs[x], [builder.mul(builder.add(builder.mul(b, c64(4)), c), c64(64))]), V16I), V32S)
                            msum = call(builder, "llvm.x86.avx512.pmaddw.d.512", V16I, [mn, bs])
                            a = call(builder, "llvm.fma.v16f32", V16F, [isum, builder.load(scale[j][x]), builder.load(acc[j][x])])
                            builder.store(a, acc[j][x])
                            am = call(builder, "llvm.fma.v16f32", V16F, [builder.sitofp(msum, V16F), builder.load(scale_m[j][x]), builder.load(accm[j][x])])
                            builder.store(am, accm[j][x])
            for x in range(MX):
                for j in range(NW):
                    res = builder.fsub(builder.load(acc[j][x]), builder.load(accm[j][x]))
                    store_lanes(builder, res, oa.data, N, Mv, builder.add(gxv, c64(x)),
                                builder.add(n0v, builder.add(builder.mul(gwv, c64(8)), row[j])))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"q4_k_tile16_{NW}x{MX}"
    return intrinsic(kern)


if WIDE:
    q4_k_tile16_wide, q4_k_tile16_1 = _q4_k_tile16(Q4K_NW, Q4K_MX), _q4_k_tile16(Q4K_NW, 1)


@njit(cache=True)
def wide_gemm_rows(run_start, run_len, run_batched):
    """The rows of a Q4_K product the 16-row kernel takes: for one batched run (a prompt) the rows
    llama.cpp's gemm takes, n - n % 4, when there are Q4K_PROMPT_MIN_ROWS of them on 512-bit
    registers; else 0 (the rows go to _q4_k_rows)."""
    if not WIDE or run_start.shape[0] != 1 or not run_batched[0]:
        return 0
    n = run_len[0] - run_len[0] % GEMM_ROWS
    return n if n >= Q4K_PROMPT_MIN_ROWS else 0


@njit(parallel=True, cache=True, error_model="numpy")
def _q4_k_prompt(wx8, xg, bsg, dxg, M, out):
    """Q4_K (x8 layout) x rows16-regrouped q8_K rows -> out (M, N), every row with the gemm arithmetic
    (the caller gives it the rows llama.cpp's gemm takes); prange over panels of 8-row groups, each
    unpacked once for every group of 16 activation rows."""
    n_groups = wx8.shape[0]
    nb = dxg.shape[1]
    G = xg.shape[0]
    PG = max(1, min(8, Q4K_PANEL_BYTES // (nb * Q4K_U_BYTES)))
    for p in prange(-(-n_groups // PG)):
        g0 = p * PG
        ng = min(PG, n_groups - g0)
        wu = np.empty((PG, nb, Q4K_U_BYTES), np.uint8)
        q4_k_unpack16(wx8, g0, ng, wu)
        gx = 0
        while gx + Q4K_MX <= G:
            for gw in range(ng):
                for j0 in range(0, 8, Q4K_NW):
                    q4_k_tile16_wide(wu, gw, j0, xg, bsg, dxg, gx, out, g0 * 8, M)
            gx += Q4K_MX
        while gx < G:
            for gw in range(ng):
                for j0 in range(0, 8, Q4K_NW):
                    q4_k_tile16_1(wu, gw, j0, xg, bsg, dxg, gx, out, g0 * 8, M)
            gx += 1


# The 512-bit kernel is compiled only where it runs; elsewhere the dispatch never calls it.
q4_k_prompt = _q4_k_prompt if WIDE else not_this_variant
