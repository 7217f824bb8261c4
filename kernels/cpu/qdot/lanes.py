"""The kernel skeleton of the K-quants whose llama.cpp kernels take 8 integer lanes per super-block
(Q2_K, Q3_K, IQ4_XS; read in place, GGUF rows): one type differs from another only in how a
super-block is unpacked (its decode) and in whether it has minimums (Q2_K).

ggml_vec_dot_q2_K/q3_K/iq4_xs_q8_K (AVX2) form, per 32-element chunk c of a super-block,
vpmaddwd(vpmaddubsw(weights, x), scales) with the chunk's scale for elements 0..15 in int16 lanes
0..7 and the one for 16..31 in lanes 8..15, so int32 lane l holds offsets 4l..4l+3 of every chunk
times their scale, summed over the 8 chunks. Every product is exact (no int16 saturation for these
value ranges; q8_K values are -127..127), so any way of forming the same products gives the same
lanes: here weights with a sign (Q3_K's -4..3, IQ4_XS's levels) go through the sign trick
vpmaddubsw(|w|, sign(x, w)), as llama.cpp's mul_add_epi8.
vec_dot (fewer than 8 rows): per super-block, Q2_K first acc = fma(-(d_x*dmin_w), float(P), acc)
with P lane l = mn[2l]*bsum16[2l] + mn[2l+1]*bsum16[2l+1]; then acc = fma(d_x*d_w, float(lane), acc);
at the end hsum_float_8(acc).
tiled (8 rows or more, tiled_run_microtile_avx2<16 or 32, ...>): S = sum of all lanes (an exact
int, whatever the tile's MAC: act-bias for Q3_K, sign trick for IQ4_XS), res = d_w*float(S),
Q2_K: res = fnmadd(dmin_w, float(sum P), res); then out = fma(res, d_x, out).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.cpu.qdot.common import PREFETCH
from kernels.cpu.simd import (
    V8F, V8I, V16S, V32B, Chains, array, byte_ptr, c32, c64, call, f32, fma, hsum8, lanes, madd16, dot4_scaled, prefetch,
    psign, splat, vload,
)


def lane_kernel(name: str, block_bytes: int, decode, signed: bool, mins: bool, MR: int, tiled: bool):
    """kern(w, n, xq, dx, bs16, m0, out): out[m0+i, n] for i < MR; w: GGUF rows (N, nb*block_bytes);
    xq (M, K) int8, dx (M, nb) float32: q8_K rows; bs16 (M, K/16) int16: their 16-element sums
    (read only with mins).

    decode(builder, p) unpacks the super-block at p into (qs, ws, ss, d_w, dmin_w, mn): per chunk c
    the unsigned maddubs operand qs[c] (signed: |w|, with w itself in ws[c], else ws is None), its
    two scales splatted (ss[c], V16S); with mins dmin_w and the 16 minimums (V16S), else None.
    As in q6_k, the chunks go to a stack buffer that an IR loop reads back for all MR rows."""

    def kern(typingctx, w, n, xq, dx, bs16, m0, out):
        sig = types.void(w, n, xq, dx, bs16, m0, out)

        def codegen(context, builder, signature, args):
            wa, _, xa, da, ba, _, oa = (array(context, builder, signature.args[k], args[k]) if k not in (1, 5) else None
                                        for k in range(7))
            nv, m0v = args[1], args[5]
            nb = builder.extract_value(da.shape, 1)
            N = builder.extract_value(oa.shape, 1)
            stride = lambda a: builder.extract_value(a.strides, 0)          # noqa: E731  (bytes)
            rowp = lambda a, i: builder.gep(byte_ptr(builder, a.data),      # noqa: E731
                                            [builder.mul(builder.add(m0v, c64(i)), stride(a))])
            row = builder.gep(byte_ptr(builder, wa.data), [builder.mul(nv, stride(wa))])
            xrow = [rowp(xa, i) for i in range(MR)]
            drow = [builder.bitcast(rowp(da, i), f32.as_pointer()) for i in range(MR)]
            brow = [rowp(ba, i) for i in range(MR)] if mins else None
            acc = [cgutils.alloca_once_value(builder, ir.Constant(V8F, [0.0] * 8)) for _ in range(MR)]
            acc1 = [cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0)) for _ in range(MR)]   # tiled: out
            qbuf = cgutils.alloca_once(builder, ir.ArrayType(V32B, 8))          # maddubs' unsigned operand
            wbuf = cgutils.alloca_once(builder, ir.ArrayType(V32B, 8))          # the signs (signed types)
            sbuf = cgutils.alloca_once(builder, ir.ArrayType(V16S, 8))          # the chunks' scales
            lanes_i32 = [cgutils.alloca_once(builder, V8I) for _ in range(MR)]
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                p = builder.gep(row, [builder.mul(b, c64(block_bytes))])
                for line in range(0, block_bytes, 64):
                    prefetch(builder, builder.gep(p, [c64(PREFETCH + line)]))
                qs, ws, ss, dw, dmin, mn = decode(builder, p)
                if MR == 1:        # one row: each chunk straight from the registers, no buffer
                    lane = Chains(builder, ir.Constant(V8I, [0] * 8))
                    for c in range(8):
                        x = vload(builder, builder.gep(xrow[0], [builder.add(builder.mul(b, c64(256)), c64(32 * c))]), V32B)
                        if signed:
                            x = psign(builder, x, ws[c])
                        lane.add(dot4_scaled, qs[c], x, ss[c])
                    builder.store(lane.total(), lanes_i32[0])
                else:
                    for i in range(MR):
                        builder.store(ir.Constant(V8I, [0] * 8), lanes_i32[i])
                    for c in range(8):
                        builder.store(qs[c], builder.gep(qbuf, [c32(0), c32(c)]))
                        builder.store(ss[c], builder.gep(sbuf, [c32(0), c32(c)]))
                        if signed:
                            builder.store(ws[c], builder.gep(wbuf, [c32(0), c32(c)]))
                    with cgutils.for_range(builder, c64(8)) as chunks:             # chunk c: elements 32c .. 32c+31
                        c = chunks.index
                        qv = builder.load(builder.gep(qbuf, [c32(0), c]))
                        scv = builder.load(builder.gep(sbuf, [c32(0), c]))
                        wv = builder.load(builder.gep(wbuf, [c32(0), c])) if signed else None
                        xoff = builder.add(builder.mul(b, c64(256)), builder.mul(c, c64(32)))
                        for i in range(MR):
                            x = vload(builder, builder.gep(xrow[i], [xoff]), V32B)
                            if signed:
                                x = psign(builder, x, wv)
                            builder.store(dot4_scaled(builder, qv, x, scv, builder.load(lanes_i32[i])), lanes_i32[i])
                for i in range(MR):
                    lanes_i = builder.load(lanes_i32[i])
                    dxb = builder.load(builder.gep(drow[i], [b]))
                    if mins:
                        bs = vload(builder, builder.gep(brow[i], [builder.mul(b, c64(32))]), V16S)
                        P = madd16(builder, mn, bs)                                  # (8,) int32
                    if tiled:
                        e = lanes(builder, lanes_i)
                        S = e[0]
                        for q in range(1, 8):
                            S = builder.add(S, e[q])
                        res = builder.fmul(dw, builder.sitofp(S, f32))
                        if mins:
                            e = lanes(builder, P)
                            S2 = e[0]
                            for q in range(1, 8):
                                S2 = builder.add(S2, e[q])
                            res = call(builder, "llvm.fma.f32", f32, [builder.fneg(dmin), builder.sitofp(S2, f32), res])
                        builder.store(call(builder, "llvm.fma.f32", f32, [res, dxb, builder.load(acc1[i])]), acc1[i])
                    else:
                        a = builder.load(acc[i])
                        if mins:
                            dm = splat(builder, builder.fneg(builder.fmul(dxb, dmin)), V8F)   # -y.d * fp16(x.dmin)
                            a = fma(builder, dm, builder.sitofp(P, V8F), a)
                        d = splat(builder, builder.fmul(dxb, dw), V8F)                        # y.d * fp16(x.d)
                        builder.store(fma(builder, d, builder.sitofp(lanes_i, V8F), a), acc[i])
            for i in range(MR):
                value = builder.load(acc1[i]) if tiled else hsum8(builder, builder.load(acc[i]))
                idx = builder.add(builder.mul(builder.add(m0v, c64(i)), N), nv)
                builder.store(value, builder.gep(oa.data, [idx]))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"{name}_{'tiled' if tiled else 'vec_dot'}_{MR}"
    return intrinsic(kern)
