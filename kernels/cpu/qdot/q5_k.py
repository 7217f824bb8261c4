"""Q5_K weights (read in place) times q8_K activation rows: ggml_vec_dot_q5_K_q8_K's numbers for
fewer than 8 rows, the tiled kernel's for more, bit for bit."""
from __future__ import annotations

from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.cpu.qdot.common import PREFETCH, TILED_MIN_ROWS, X_CHUNK_BYTES
from kernels.cpu.simd import (
    V8F, Chains, prefetch, V8I, V16B, V16S, V32B, array, byte_ptr, c32, c64, call, f16, f32, fma, hsum8, i16, i32,
    lanes, load_as, dot4_scaled, pshufb, splat, vconst, vload,
)

# --- Q5_K ---------------------------------------------------------------------------------------
# A 256-element super-block: d, dmin (f16), 12 bytes of 6-bit scales sc and minimums mn of the 8
# 32-element sub-blocks, qh[32], qs[128]. Sub-block s = 2j (2j+1) holds the low (high) nibbles of
# qs[32j..32j+31] with bit s of qh[l] as the 5th bit: q in 0..31, value d*sc_s*q - dmin*mn_s.
# Both llama.cpp kernels build the same exact integers: per sub-block vpmaddwd(vpmaddubsw(q, x),
# sc_s), so lane l holds offsets 4l..4l+3 of every sub-block times its scale, and
# M = sum_s mn_s * (sum of x over sub-block s).
# vec_dot (fewer than 8 rows): acc = fma(d_x*d_w, float(lane), acc) per lane, and apart
# summs = fma(-(d_x*dmin_w), float(M), summs) (the oracle's compiler contracts `summs += dmin * M`
# into one vfmadd231ss); at the end hsum_float_8(acc) + summs.
# tiled (8 rows or more, tiled_run_microtile_avx2<32, true, 0, false>): S = sum of all lanes,
# res = fnmadd(dmin_w, float(M), d_w*float(S)), out = fma(res, d_x, out). d_x is not in res.
Q5_K_BLOCK = 176


def _scales_mins(builder, p):
    """The 12 scale bytes of the super-block at p as llama.cpp decodes them (utmp): V16B, bytes 0..7
    the sub-blocks' scales, 8..15 their minimums."""
    u0, u1, u2 = (load_as(builder, p, i32, 4 + 4 * k) for k in range(3))
    km1, km2, km3 = (ir.Constant(i32, v) for v in (0x3F3F3F3F, 0x0F0F0F0F, 0x03030303))
    lsr = lambda v, k: builder.lshr(v, ir.Constant(i32, k))       # noqa: E731
    lsl = lambda v, k: builder.shl(v, ir.Constant(i32, k))        # noqa: E731
    t3 = builder.or_(builder.and_(lsr(u2, 4), km2), lsl(builder.and_(lsr(u1, 6), km3), 4))
    t2 = builder.and_(u1, km1)
    t1 = builder.or_(builder.and_(u2, km2), lsl(builder.and_(lsr(u0, 6), km3), 4))
    t0 = builder.and_(u0, km1)
    utmp = ir.Constant(ir.VectorType(i32, 4), ir.Undefined)
    for k, t in enumerate((t0, t1, t2, t3)):
        utmp = builder.insert_element(utmp, t, c32(k))
    return builder.bitcast(utmp, V16B)


def _q5_k_kernel(MR: int, tiled: bool):
    """kern(w, n, xq, dx, bsp, m0, out): out[m0+i, n] for i < MR; w: GGUF Q5_K rows (N, nb*176);
    xq (M, K) int8, dx (M, nb) float32: q8_K rows; bsp (M, nb*4) int32: their 32-element sums as
    int16 pairs, in sub-block order.

    As in q6_k, per super-block the 8 unpacked 32-byte sub-blocks and their splatted scales go to a
    stack buffer that an IR loop reads back for all MR rows (unrolled, the rows' chunks spill)."""

    def kern(typingctx, w, n, xq, dx, bsp, m0, out):
        sig = types.void(w, n, xq, dx, bsp, m0, out)

        def codegen(context, builder, signature, args):
            wa, _, xa, da, ba, _, oa = (array(context, builder, signature.args[k], args[k]) if k not in (1, 5) else None
                                        for k in range(7))
            nv, m0v = args[1], args[5]
            nb = builder.extract_value(da.shape, 1)
            K = builder.extract_value(xa.shape, 1)
            N = builder.extract_value(oa.shape, 1)
            V8S, V4I = ir.VectorType(i16, 8), ir.VectorType(i32, 4)
            row = builder.gep(byte_ptr(builder, wa.data), [builder.mul(nv, builder.extract_value(wa.strides, 0))])
            xrow = [builder.gep(byte_ptr(builder, xa.data), [builder.mul(builder.add(m0v, c64(i)), K)]) for i in range(MR)]
            drow = [builder.gep(da.data, [builder.mul(builder.add(m0v, c64(i)), nb)]) for i in range(MR)]
            brow = [builder.gep(byte_ptr(builder, ba.data), [builder.mul(builder.add(m0v, c64(i)), builder.mul(nb, c64(16)))])
                    for i in range(MR)]                                       # 8 int16 sums per super-block
            acc = [cgutils.alloca_once_value(builder, ir.Constant(V8F, [0.0] * 8)) for _ in range(MR)]
            acc1 = [cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0)) for _ in range(MR)]   # tiled: out; vec_dot: summs
            qbuf = cgutils.alloca_once(builder, ir.ArrayType(V32B, 8))          # the sub-blocks' 5-bit values
            sbuf = cgutils.alloca_once(builder, ir.ArrayType(V16S, 8))          # their scales, splatted
            lanes_i32 = [cgutils.alloca_once(builder, V8I) for _ in range(MR)]
            m15, one = vconst(V32B, 15), vconst(V32B, 1)
            shr = lambda v, k: builder.lshr(v, vconst(V32B, k)) if k else v    # noqa: E731
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                p = builder.gep(row, [builder.mul(b, c64(Q5_K_BLOCK))])
                for line in range(0, Q5_K_BLOCK, 64):
                    prefetch(builder, builder.gep(p, [c64(PREFETCH + line)]))
                dw = builder.fpext(load_as(builder, p, f16, 0), f32)
                dmin = builder.fpext(load_as(builder, p, f16, 2), f32)
                ms = _scales_mins(builder, p)
                ms2 = builder.shuffle_vector(ms, ms, ir.Constant(ir.VectorType(i32, 32), list(range(16)) * 2))
                mn = builder.zext(builder.shuffle_vector(ms, ms, ir.Constant(ir.VectorType(i32, 8), list(range(8, 16)))), V8S)
                qh = vload(builder, builder.gep(p, [c64(16)]), V32B)
                lane = Chains(builder, ir.Constant(V8I, [0] * 8))
                for j in range(4):
                    qs = vload(builder, builder.gep(p, [c64(48 + 32 * j)]), V32B)
                    halves = (builder.and_(qs, m15), shr(qs, 4))
                    for h in range(2):
                        s = 2 * j + h                                          # sub-block s: qh bit s
                        hb = builder.shl(builder.and_(shr(qh, s), one), vconst(V32B, 4))
                        qv = builder.or_(halves[h], hb)
                        scv = builder.bitcast(pshufb(builder, ms2, ir.Constant(V32B, [s, -128] * 16)), V16S)  # sc_s
                        if MR == 1:    # one row: each sub-block straight from the registers, no buffer
                            x = vload(builder, builder.gep(xrow[0], [builder.add(builder.mul(b, c64(256)), c64(32 * s))]), V32B)
                            lane.add(dot4_scaled, qv, x, scv)
                            continue
                        builder.store(qv, builder.gep(qbuf, [c32(0), c32(s)]))
                        builder.store(scv, builder.gep(sbuf, [c32(0), c32(s)]))
                if MR == 1:
                    builder.store(lane.total(), lanes_i32[0])
                else:
                    for i in range(MR):
                        builder.store(ir.Constant(V8I, [0] * 8), lanes_i32[i])
                    with cgutils.for_range(builder, c64(8)) as chunks:             # sub-block c: elements 32c .. 32c+31
                        c = chunks.index
                        qv = builder.load(builder.gep(qbuf, [c32(0), c]))
                        scv = builder.load(builder.gep(sbuf, [c32(0), c]))
                        xoff = builder.add(builder.mul(b, c64(256)), builder.mul(c, c64(32)))
                        for i in range(MR):
                            x = vload(builder, builder.gep(xrow[i], [xoff]), V32B)
                            builder.store(dot4_scaled(builder, qv, x, scv, builder.load(lanes_i32[i])), lanes_i32[i])
                for i in range(MR):
                    lanes_i = builder.load(lanes_i32[i])
                    bs = vload(builder, builder.gep(brow[i], [builder.mul(b, c64(16))]), V8S)
                    mp = call(builder, "llvm.x86.sse2.pmadd.wd", V4I, [bs, mn])       # exact: any order
                    mp = builder.add(mp, builder.shuffle_vector(mp, mp, ir.Constant(V4I, [2, 3, 2, 3])))
                    M = builder.add(builder.extract_element(mp, c32(0)), builder.extract_element(mp, c32(1)))
                    Mf = builder.sitofp(M, f32)
                    dxb = builder.load(builder.gep(drow[i], [b]))
                    if tiled:
                        e = lanes(builder, lanes_i)
                        S = e[0]
                        for q in range(1, 8):
                            S = builder.add(S, e[q])
                        res = builder.fmul(dw, builder.sitofp(S, f32))
                        res = call(builder, "llvm.fma.f32", f32, [builder.fneg(dmin), Mf, res])       # fnmadd
                        builder.store(call(builder, "llvm.fma.f32", f32, [res, dxb, builder.load(acc1[i])]), acc1[i])
                    else:
                        d = splat(builder, builder.fmul(dxb, dw), V8F)                  # y.d * fp16(x.d)
                        builder.store(fma(builder, d, builder.sitofp(lanes_i, V8F), builder.load(acc[i])), acc[i])
                        dm = builder.fneg(builder.fmul(dxb, dmin))                      # -y.d * fp16(x.dmin)
                        builder.store(call(builder, "llvm.fma.f32", f32, [dm, Mf, builder.load(acc1[i])]), acc1[i])
            for i in range(MR):
                value = builder.load(acc1[i])
                if not tiled:
                    value = builder.fadd(hsum8(builder, builder.load(acc[i])), value)
                idx = builder.add(builder.mul(builder.add(m0v, c64(i)), N), nv)
                builder.store(value, builder.gep(oa.data, [idx]))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"q5_k_{'tiled' if tiled else 'vec_dot'}_{MR}"
    return intrinsic(kern)


q5_k_vec_dot_1, q5_k_vec_dot_4 = _q5_k_kernel(1, False), _q5_k_kernel(4, False)
q5_k_tiled_1, q5_k_tiled_4 = _q5_k_kernel(1, True), _q5_k_kernel(4, True)
# A speculative check verifies 1 to 8 rows with the one-row arithmetic: one unpack of W for up to 8.
(q5_k_vec_dot_2, q5_k_vec_dot_3, q5_k_vec_dot_5, q5_k_vec_dot_6, q5_k_vec_dot_7,
 q5_k_vec_dot_8) = (_q5_k_kernel(m, False) for m in (2, 3, 5, 6, 7, 8))


@njit(parallel=True, cache=True, error_model="numpy")
def _q5_k_rows(w, xq, dx, bsp, run_start, run_len, run_batched, out):
    """Q5_K rows x q8_K rows -> out (M, N): a batched run of 8 rows or more takes the tiled
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
                        q5_k_tiled_4(w, row, xq, dx, bsp, m, out)
                        m += 4
                    while m < c1:
                        q5_k_tiled_1(w, row, xq, dx, bsp, m, out)
                        m += 1
                    continue
                while m < c1:                       # up to 8 rows per pass over the weight row
                    left = c1 - m
                    if left >= 8:
                        q5_k_vec_dot_8(w, row, xq, dx, bsp, m, out)
                    elif left == 7:
                        q5_k_vec_dot_7(w, row, xq, dx, bsp, m, out)
                    elif left == 6:
                        q5_k_vec_dot_6(w, row, xq, dx, bsp, m, out)
                    elif left == 5:
                        q5_k_vec_dot_5(w, row, xq, dx, bsp, m, out)
                    elif left == 4:
                        q5_k_vec_dot_4(w, row, xq, dx, bsp, m, out)
                    elif left == 3:
                        q5_k_vec_dot_3(w, row, xq, dx, bsp, m, out)
                    elif left == 2:
                        q5_k_vec_dot_2(w, row, xq, dx, bsp, m, out)
                    else:
                        q5_k_vec_dot_1(w, row, xq, dx, bsp, m, out)
                    m += min(8, left)


# --- Q5_K prompts on 512-bit registers (kernels.cpu.qdot.tiled16) ------------------------------

def decode_lanes(builder, p):
    """The super-block at p as tiled16.lane_unpack_bytes takes a lanes type's (see lanes.lane_kernel):
    per 32-element sub-block its 5-bit values and its scale (V16S, every lane), d, dmin, and the
    minimums per 16 elements (V16S: each sub-block's twice), so that the tiled kernel's
    M = sum_s mn_s bsum32_s is their products with the 16-element sums."""
    ms = _scales_mins(builder, p)
    qh = vload(builder, builder.gep(p, [c64(16)]), V32B)
    m15, one = vconst(V32B, 15), vconst(V32B, 1)
    qv, sv = [], []
    for j in range(4):
        qs = vload(builder, builder.gep(p, [c64(48 + 32 * j)]), V32B)
        halves = (builder.and_(qs, m15), builder.lshr(qs, vconst(V32B, 4)))
        for h in range(2):
            s = 2 * j + h                                          # sub-block s: qh bit s
            hb = builder.shl(builder.and_(builder.lshr(qh, vconst(V32B, s)) if s else qh, one), vconst(V32B, 4))
            qv.append(builder.or_(halves[h], hb))
            sv.append(builder.zext(builder.shuffle_vector(ms, ms, ir.Constant(ir.VectorType(i32, 16), [s] * 16)), V16S))
    mn = builder.zext(builder.shuffle_vector(ms, ms, ir.Constant(ir.VectorType(i32, 16), [8 + k // 2 for k in range(16)])), V16S)
    dw = builder.fpext(load_as(builder, p, f16, 0), f32)
    dmin = builder.fpext(load_as(builder, p, f16, 2), f32)
    return qv, None, sv, dw, dmin, mn
