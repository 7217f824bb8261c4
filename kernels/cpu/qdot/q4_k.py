"""Q4_K weights (repacked 8 rows at a time, as llama.cpp does) times q8_K activation rows:
ggml_gemv_q4_K_8x8_q8_K's and ggml_gemm_q4_K_8x8_q8_K's numbers bit for bit."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.cpu.qdot.common import PREFETCH, X_CHUNK_BYTES
from kernels.cpu.simd import (
    REGISTERS, VNNI, V8F, prefetch, V8I, V16B, V16S, V32B, V8H, array, byte_ptr, c64, dot4, fma, i32, load_as,
    madd16, maddubs, splat, vconst, vload, vstore,
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
DOTS_VNNI = VNNI and REGISTERS == 32


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
                    ilo, ihi = [zero] * MR, [zero] * MR
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
                                ilo[i] = dot4(builder, lo, xa_v, ilo[i])
                                ihi[i] = dot4(builder, hi, xb_v, ihi[i])
                            else:
                                ilo[i] = builder.add(ilo[i], maddubs(builder, lo, xa_v))
                                ihi[i] = builder.add(ihi[i], maddubs(builder, hi, xb_v))
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
GEMM_MR = 8 if REGISTERS == 32 else 4
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
        n_gemm = n - n % 4 if (run_batched[r] and n > 3) else 0
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
