"""Q6_K weights (read in place) times q8_K activation rows: ggml_vec_dot_q6_K_q8_K's numbers for
fewer than 8 rows, the tiled kernel's for more, bit for bit."""
from __future__ import annotations

from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.cpu.qdot.common import PREFETCH, TILED_MIN_ROWS, X_CHUNK_BYTES
from kernels.cpu.simd import (
    REGISTERS, V8F, Chains, prefetch, V8I, V16B, V16S, V32B, array, byte_ptr, c32, c64, call, f16, f32, fma, hsum8, i32,
    load_as, madd16, dot4_scaled, splat, vconst, vload,
)

# --- Q6_K ---------------------------------------------------------------------------------------
# Both llama.cpp kernels build the same integer lanes: per 32-element chunk k of half j,
# vpmaddwd(vpmaddubsw(q, x), scales) with q the unsigned 6-bit values and the chunk's two 16-element
# scales, so lane l holds chunk offsets 4l..4l+3 times their scale, summed over the 8 chunks. The
# -32 offset comes from the 16-element sums of x: sub_l = 32 * (sc[2l]*bs[2l] + sc[2l+1]*bs[2l+1]).
# vec_dot (fewer than 8 rows): acc = fma(d_w*d_x, float(lane - sub), acc) per lane, hsum_float_8 at
# the end. tiled (8 rows or more): S = sum of all lanes - sum of all sub, out = fma(d_w*float(S), d_x, out).
Q6_K_BLOCK = 210


def _q6_k_half(builder, p, j):
    """Half j of the super-block at p: its 4 chunks of 32 unsigned 6-bit values (V32B), elements
    128j + 32k .. +31 for chunk k."""
    m15, m3 = vconst(V32B, 15), vconst(V32B, 3)
    q1 = vload(builder, builder.gep(p, [c64(64 * j)]), V32B)
    q2 = vload(builder, builder.gep(p, [c64(64 * j + 32)]), V32B)
    qh = vload(builder, builder.gep(p, [c64(128 + 32 * j)]), V32B)
    shr = lambda v, k: builder.lshr(v, vconst(V32B, k))       # noqa: E731
    shl = lambda v, k: builder.shl(v, vconst(V32B, k))        # noqa: E731
    return [builder.or_(builder.and_(q1, m15), shl(builder.and_(qh, m3), 4)),
            builder.or_(builder.and_(q2, m15), shl(builder.and_(shr(qh, 2), m3), 4)),
            builder.or_(shr(q1, 4), shl(builder.and_(shr(qh, 4), m3), 4)),
            builder.or_(shr(q2, 4), shl(shr(qh, 6), 4))]


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
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                p = builder.gep(row, [builder.mul(b, c64(Q6_K_BLOCK))])
                for line in range(0, Q6_K_BLOCK, 64):
                    prefetch(builder, builder.gep(p, [c64(PREFETCH + line)]))
                sc8 = vload(builder, builder.gep(p, [c64(192)]), V16B)
                sc16 = builder.sext(sc8, V16S)                                   # the 16 scales
                dw = builder.fpext(load_as(builder, p, f16, 208), f32)
                lane = Chains(builder, ir.Constant(V8I, [0] * 8)) if MR == 1 else None
                for j in range(2):
                    qv = _q6_k_half(builder, p, j)
                    for k in range(4):
                        s = 4 * j + k                                             # scales 2s, 2s+1
                        scv = builder.shuffle_vector(sc16, sc16, ir.Constant(ir.VectorType(i32, 16), [2 * s] * 8 + [2 * s + 1] * 8))
                        if MR == 1:        # one row: each chunk straight from the registers, no buffer
                            x = vload(builder, builder.gep(xrow[0], [builder.add(builder.mul(b, c64(256)), c64(32 * s))]), V32B)
                            lane.add(dot4_scaled, qv[k], x, scv)
                            continue
                        builder.store(qv[k], builder.gep(qbuf, [c32(0), c32(s)]))
                        builder.store(scv, builder.gep(sbuf, [c32(0), c32(s)]))
                if MR == 1:
                    builder.store(lane.total(), lanes[0])
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


# --- Q6_K prompts on 512-bit registers (kernels.cpu.qdot.tiled16) ------------------------------

def decode_signed(builder, p):
    """The super-block at p as tiled16.lane_unpack16 takes a lanes type's: per 32-element chunk the
    values q - 32 (signed bytes) and the chunk's two scales (V16S: lanes 0-7 elements 0..15, 8-15
    elements 16..31), and d."""
    sc16 = builder.sext(vload(builder, builder.gep(p, [c64(192)]), V16B), V16S)
    ws, ss = [], []
    for j in range(2):
        for k, q in enumerate(_q6_k_half(builder, p, j)):
            s = 4 * j + k
            ws.append(builder.sub(q, vconst(V32B, 32)))
            ss.append(builder.shuffle_vector(sc16, sc16, ir.Constant(ir.VectorType(i32, 16), [2 * s] * 8 + [2 * s + 1] * 8)))
    return None, ws, ss, builder.fpext(load_as(builder, p, f16, 208), f32), None, None
