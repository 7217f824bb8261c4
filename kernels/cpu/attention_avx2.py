"""The inner loops of attention with llama.cpp's rounding (AVX2 build, no flash attention), as LLVM
vector IR.

llama.cpp computes attention as two float16 matrix products around ggml's softmax:
- a batch of tokens (n >= 2): tinyBLAS, per output 8 float lanes (element l of the shared axis
  goes to lane l % 8, fma chain in order), hsum_float_8 at the end: the scores K.Q over head_dim
  and the output V.P over the key cells (P rounded to float16);
- one token: ggml_vec_dot_f16, 4 accumulators of 8 lanes (element e to accumulator (e // 8) % 4,
  lane e % 8), chains over steps of 32, then GGML_F32x8_REDUCE.
These kernels give every output exactly that chain, so the results equal llama.cpp's bit for bit.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.cpu.simd import (V8F, V8H, V16F, WIDE, array, as_i64, c32, c64, call, fma, hsum8, hsum8_pairs, not_this_variant,
                              reduce4x8, splat, vload, vstore)



def _load8(builder, base, idx, is_f16):
    """8 consecutive float32 (or float16 widened) elements of a flat array at element idx."""
    p = builder.gep(base, [idx])
    return builder.fpext(vload(builder, p, V8H), V8F) if is_f16 else vload(builder, p, V8F)


def _shuffle8(builder, a, b, mask):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), 8), mask))


def _hsum8_x8(builder, accs, shuffle=_shuffle8):
    """hsum8 of 8 vectors at once -> one vector (lane k: hsum8(accs[k])), with the same adds:
    r = hi + lo half, then (r0 + r2) + (r1 + r3), computed on vectors that hold several outputs'
    partial sums after 128-bit permutes and in-lane shuffles (fewer shuffles than 8 separate hsums).
    shuffle=_shuffle16: the same in each 256-bit half of V16F accumulators (two rows each)."""
    u = [builder.fadd(shuffle(builder, accs[k], accs[k + 1], [4, 5, 6, 7, 12, 13, 14, 15]),
                      shuffle(builder, accs[k], accs[k + 1], [0, 1, 2, 3, 8, 9, 10, 11])) for k in range(0, 8, 2)]
    # u[p]: [r0..r3 of accs[2p] | r0..r3 of accs[2p+1]]
    w = [builder.fadd(shuffle(builder, u[k], u[k + 1], [0, 1, 8, 9, 4, 5, 12, 13]),
                      shuffle(builder, u[k], u[k + 1], [2, 3, 10, 11, 6, 7, 14, 15])) for k in (0, 2)]
    # w[0]: [r0+r2, r1+r3 of accs 0, 2 | of accs 1, 3]; w[1]: the same for accs 4, 6 | 5, 7
    x = builder.fadd(shuffle(builder, w[0], w[1], [0, 2, 8, 10, 4, 6, 12, 14]),
                     shuffle(builder, w[0], w[1], [1, 3, 9, 11, 5, 7, 13, 15]))
    # x: accs 0, 2, 4, 6 | 1, 3, 5, 7
    return shuffle(builder, x, x, [0, 4, 1, 5, 2, 6, 3, 7])


def _tb_kernel(RM: int, RN: int):
    """kern(A, ia, lda, B, ib, ldb, L, C, ic, ldc): C[ic + i*ldc + j] = tinyBLAS dot of row i of A
    (A[ia + i*lda : +L]) and row j of B (B[ib + j*ldb : +L]) for i < RM, j < RN; L % 8 == 0.
    A and B float32."""

    def kern(typingctx, A, ia, lda, B, ib, ldb, L, C, ic, ldc):
        sig = types.void(A, ia, lda, B, ib, ldb, L, C, ic, ldc)

        def codegen(context, builder, signature, args):
            aa, ba, ca = (array(context, builder, signature.args[k], args[k]) for k in (0, 3, 7))
            ia, lda, ib, ldb, L, ic, ldc = (as_i64(builder, args[k]) for k in (1, 2, 4, 5, 6, 8, 9))
            arow = [builder.add(ia, builder.mul(c64(i), lda)) for i in range(RM)]
            brow = [builder.add(ib, builder.mul(c64(j), ldb)) for j in range(RN)]
            zero = ir.Constant(V8F, [0.0] * 8)
            acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(RN)] for _ in range(RM)]
            with cgutils.for_range_slice(builder, c64(0), L, c64(8)) as (l, _):
                av = [_load8(builder, aa.data, builder.add(arow[i], l), False) for i in range(RM)]
                bv = [_load8(builder, ba.data, builder.add(brow[j], l), False) for j in range(RN)]
                for i in range(RM):
                    for j in range(RN):
                        builder.store(fma(builder, av[i], bv[j], builder.load(acc[i][j])), acc[i][j])
            if (RM, RN) == (2, 4):
                sums = _hsum8_x8(builder, [builder.load(acc[i][j]) for i in range(RM) for j in range(RN)])
                for i in range(RM):
                    row = builder.shuffle_vector(sums, sums, ir.Constant(ir.VectorType(ir.IntType(32), 4),
                                                                         list(range(4 * i, 4 * i + 4))))
                    ptr = builder.gep(ca.data, [builder.add(ic, builder.mul(c64(i), ldc))])
                    builder.store(row, builder.bitcast(ptr, row.type.as_pointer()), align=1)
                return context.get_dummy_value()
            for i in range(RM):
                for j in range(RN):
                    idx = builder.add(ic, builder.add(builder.mul(c64(i), ldc), c64(j)))
                    builder.store(hsum8(builder, builder.load(acc[i][j])), builder.gep(ca.data, [idx]))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"tb_{RM}x{RN}_f32"
    return intrinsic(kern)


# scores: A = the tile's queries, B = a block of K rows widened to float32; P.V: A = probabilities, B = V^T.
tb_2x4_f32, tb_1x4_f32, tb_2x1_f32, tb_1x1_f32 = (_tb_kernel(m, n) for m, n in ((2, 4), (1, 4), (2, 1), (1, 1)))
tb_4x3_f32 = _tb_kernel(4, 3)


# --- the same dots on 512-bit registers: two rows of A per register -------------------------------
# With AVX-512 (32 registers) a tile holds two A rows per register (lanes 0-7 row 2p, 8-15 row 2p+1,
# from pair_rows8) and each 8 floats of a B row broadcast into both halves: every output keeps its
# 8-lane fma chain and hsum_float_8, both halves at once (simd.hsum8_pairs), as the dense types'
# 512-bit tiles do (kernels/cpu/qdot/dense.py).
TB512_RN = 8


def _shuffle16(builder, a, b, mask8):
    """_shuffle8's mask applied in each 256-bit half of two V16F (the halves are two rows' vectors)."""
    m = [(x if x < 8 else 8 + x) + 8 * h for h in range(2) for x in mask8]
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), 16), m))


def _tb512_kernel(RP: int, RN: int):
    """kern(A2, ia, pstride, B, ib, ldb, L, C, ic, ldr, n_rows): C[ic + (2p+h)*ldr + j] = tinyBLAS dot
    of row 2p+h of A and row j of B (B[ib + j*ldb : +L]) for p < RP, h < 2 (rows below n_rows),
    j < RN. A2: pair_rows8's layout, pair p's 16 floats for elements 8l..8l+7 at
    A2[ia + p*pstride + 16l]; L % 8 == 0. With RN = 8 the hsums of a pair's 8 outputs are done
    together (_hsum8_x8 in each half) and stored as one vector per row."""

    def kern(typingctx, A2, ia, pstride, B, ib, ldb, L, C, ic, ldr, n_rows):
        sig = types.void(A2, ia, pstride, B, ib, ldb, L, C, ic, ldr, n_rows)

        def codegen(context, builder, signature, args):
            aa, ba, ca = (array(context, builder, signature.args[k], args[k]) for k in (0, 3, 7))
            ia, ps, ib, ldb, L, ic, ldr, nr = (as_i64(builder, args[k]) for k in (1, 2, 4, 5, 6, 8, 9, 10))
            arow = [builder.add(ia, builder.mul(c64(p), ps)) for p in range(RP)]
            brow = [builder.add(ib, builder.mul(c64(j), ldb)) for j in range(RN)]
            zero = ir.Constant(V16F, [0.0] * 16)
            twice = ir.Constant(ir.VectorType(ir.IntType(32), 16), list(range(8)) * 2)
            acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(RN)] for _ in range(RP)]
            with cgutils.for_range_slice(builder, c64(0), L, c64(8)) as (l, _):
                av = [vload(builder, builder.gep(aa.data, [builder.add(arow[p], builder.add(l, l))]), V16F) for p in range(RP)]
                for j in range(RN):
                    b8 = _load8(builder, ba.data, builder.add(brow[j], l), False)
                    bv = builder.shuffle_vector(b8, b8, twice)
                    for p in range(RP):
                        builder.store(call(builder, "llvm.fma.v16f32", V16F, [av[p], bv, builder.load(acc[p][j])]), acc[p][j])
            for p in range(RP):
                if RN == 8:
                    t = _hsum8_x8(builder, [builder.load(acc[p][j]) for j in range(8)], _shuffle16)
                    for h in range(2):
                        row = c64(2 * p + h)
                        with builder.if_then(builder.icmp_signed("<", row, nr)):
                            half = builder.shuffle_vector(t, t, ir.Constant(ir.VectorType(ir.IntType(32), 8), list(range(8 * h, 8 * h + 8))))
                            vstore(builder, half, builder.gep(ca.data, [builder.add(ic, builder.mul(row, ldr))]))
                    continue
                for j in range(RN):
                    t = hsum8_pairs(builder, builder.load(acc[p][j]))
                    for h in range(2):
                        row = c64(2 * p + h)
                        with builder.if_then(builder.icmp_signed("<", row, nr)):
                            idx = builder.add(ic, builder.add(builder.mul(row, ldr), c64(j)))
                            builder.store(builder.extract_element(t, c32(8 * h)), builder.gep(ca.data, [idx]))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"tb512_{RP}x{RN}_f32"
    return intrinsic(kern)


if WIDE:
    tb512_2xn, tb512_1xn, tb512_2x1, tb512_1x1 = (_tb512_kernel(p, n) for p, n in ((2, TB512_RN), (1, TB512_RN), (2, 1), (1, 1)))
else:
    tb512_2xn = tb512_1xn = tb512_2x1 = tb512_1x1 = not_this_variant


@intrinsic
def pair_rows8(typingctx, A, ia, lda, n_rows, L, A2):
    """A2[p*2L + 16l + 8h + e] = A[ia + (2p+h)*lda + 8l + e] for the rows below n_rows (zeros for the
    odd row's partner), l < L/8, e < 8: rows of A two to a 512-bit register (_tb512_kernel's A2)."""
    sig = types.void(A, ia, lda, n_rows, L, A2)

    def codegen(context, builder, signature, args):
        aa, da = array(context, builder, signature.args[0], args[0]), array(context, builder, signature.args[5], args[5])
        ia, lda, nr, L = (as_i64(builder, args[k]) for k in (1, 2, 3, 4))
        zero = ir.Constant(V8F, [0.0] * 8)
        with cgutils.for_range(builder, builder.sdiv(builder.add(nr, c64(1)), c64(2))) as pl:
            p = pl.index
            second = builder.icmp_signed("<", builder.add(builder.add(p, p), c64(1)), nr)
            with cgutils.for_range_slice(builder, c64(0), L, c64(8)) as (l, _):
                src = builder.add(ia, builder.add(builder.mul(builder.add(p, p), lda), l))
                lo = _load8(builder, aa.data, src, False)
                hi = builder.select(second, _load8(builder, aa.data, builder.select(second, builder.add(src, lda), src), False), zero)
                dst = builder.gep(da.data, [builder.add(builder.mul(p, builder.add(L, L)), builder.add(l, l))])
                vstore(builder, builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(ir.IntType(32), 16), list(range(16)))), dst)
        return context.get_dummy_value()

    return sig, codegen


def in_head_blocks(builder, G, per: int, emit) -> None:
    """emit(g0, nh) for heads g0 .. g0+nh-1 of G (an i64 value): blocks of `per` heads, then the
    rest (nh < per) once."""
    full = builder.sdiv(G, c64(per))
    with cgutils.for_range(builder, full) as bl:
        emit(builder.mul(bl.index, c64(per)), per)
    g_rest = builder.mul(full, c64(per))
    rest = builder.sub(G, g_rest)
    for nh in range(1, per):
        with builder.if_then(builder.icmp_signed("==", rest, c64(nh))):
            emit(g_rest, nh)


# Query heads per pass over a key's row in vd_dot_heads: each widened K vector is loaded once for
# this many heads, whose accumulators stay in registers side by side (README: measured).
DOT_HEADS = 3


@intrinsic
def vd_dot_heads(typingctx, a, ia, stride, G, b, ib, n, out, io, ostride):
    """ggml_vec_dot_f16 of G query rows and one key: out[io + g * ostride] = the dot of a[ia + g *
    stride : +n] (float32 holding float16 values) and b[ib : ib+n] (float16 bits), for g < G: 4
    accumulators of 8 lanes, chains over steps of 32, GGML_F32x8_REDUCE; n % 32 == 0. The key's row
    is widened once for DOT_HEADS heads at a time."""
    sig = types.void(a, ia, stride, G, b, ib, n, out, io, ostride)

    def codegen(context, builder, signature, args):
        aa, ba, oa = (array(context, builder, signature.args[k], args[k]) for k in (0, 4, 7))
        ia, stride, G, ib, n, io, ostride = (as_i64(builder, args[k]) for k in (1, 2, 3, 5, 6, 8, 9))
        bdata = builder.bitcast(ba.data, ir.HalfType().as_pointer())
        zero = ir.Constant(V8F, [0.0] * 8)

        def heads(g0, nh):
            rows = [builder.add(ia, builder.mul(builder.add(g0, c64(h)), stride)) for h in range(nh)]
            acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(4)] for _ in range(nh)]
            with cgutils.for_range_slice(builder, c64(0), n, c64(32)) as (e, _):
                bv = [_load8(builder, bdata, builder.add(ib, builder.add(e, c64(8 * k))), True) for k in range(4)]
                for h in range(nh):
                    for k in range(4):
                        av = _load8(builder, aa.data, builder.add(rows[h], builder.add(e, c64(8 * k))), False)
                        builder.store(fma(builder, av, bv[k], builder.load(acc[h][k])), acc[h][k])
            for h in range(nh):
                r = reduce4x8(builder, [builder.load(x) for x in acc[h]])
                builder.store(r, builder.gep(oa.data, [builder.add(io, builder.mul(builder.add(g0, c64(h)), ostride))]))

        in_head_blocks(builder, G, DOT_HEADS, heads)
        return context.get_dummy_value()

    return sig, codegen


PV_DIMS = 32     # head dims per P@V work item: 32 chains x PV_DIMS x G heads of accumulators fit L1
PV_TILE = 128    # keys whose V rows (PV_DIMS of them) are widened to float32 once for the G heads
# floats between two heads' accumulators: 64 bytes more than 4 KB, so that one head's accumulators
# do not alias (mod 4096) the previous one's
PV_HEAD_STRIDE = 32 * PV_DIMS + 16


# Heads per P@V pass over a chain's keys: each widened V vector is loaded once for this many heads,
# whose chains (PV_DIMS / 8 vectors each) stay in registers side by side, independent of each other
# (README: measured).
PV_HEADS = 3


@intrinsic
def vd_pv_tile(typingctx, P, G, i0, n, vbuf, acc, first):
    """One tile of P@V for the G query heads of a kv head: the keys i0 .. i0+n-1 of P's rows (i0 %
    32 == 0), their V rows widened in vbuf[(i - i0) * PV_DIMS ..] (float32). Key i goes into chain
    i % 32 of each head: acc[g * PV_HEAD_STRIDE + (i % 32) * PV_DIMS ..], in order of i, which is
    ggml_vec_dot_f16's chain over the key cells (accumulator (i % 32) // 8, lane i % 8). A chain's
    PV_DIMS / 8 vectors stay in registers over its keys of the tile, for PV_HEADS heads at a time.
    first != 0: the chains start from zero (acc is not read; all 32 chains are written). Why: each V
    row is widened once per kv head (not once per query head) and V is read in key order (not 32
    keys apart), which pays off over long contexts and costs a little over short ones (README:
    measured)."""
    sig = types.void(P, G, i0, n, vbuf, acc, first)
    NV = PV_DIMS // 8

    def codegen(context, builder, signature, args):
        pa, ba, aa = (array(context, builder, signature.args[k], args[k]) for k in (0, 4, 5))
        G, i0, n, first = (as_i64(builder, args[k]) for k in (1, 2, 3, 6))
        is_first = builder.icmp_signed("!=", first, c64(0))
        zero = ir.Constant(V8F, [0.0] * 8)
        span = builder.sdiv(builder.extract_value(pa.strides, 0), c64(4))       # P's row stride in floats
        n_chains = builder.select(builder.or_(is_first, builder.icmp_signed(">", n, c64(32))), c64(32), n)

        def heads(g0, nh):
            """Heads g0 .. g0+nh-1, every chain of the tile."""
            prows = [builder.gep(pa.data, [builder.add(builder.mul(builder.add(g0, c64(h)), span), i0)]) for h in range(nh)]
            with cgutils.for_range(builder, n_chains) as rl:
                r = rl.index
                accp = [builder.gep(aa.data, [builder.add(builder.mul(builder.add(g0, c64(h)), c64(PV_HEAD_STRIDE)),
                                                          builder.mul(r, c64(PV_DIMS)))]) for h in range(nh)]
                regs = [[cgutils.alloca_once(builder, V8F) for _ in range(NV)] for _ in range(nh)]
                with builder.if_else(is_first) as (then, otherwise):
                    with then:
                        for h in range(nh):
                            for v in range(NV):
                                builder.store(zero, regs[h][v])
                    with otherwise:
                        for h in range(nh):
                            for v in range(NV):
                                builder.store(vload(builder, builder.gep(accp[h], [c64(8 * v)]), V8F), regs[h][v])
                steps = builder.sdiv(builder.add(builder.sub(n, r), c64(31)), c64(32))
                with cgutils.for_range(builder, steps) as tl:
                    kl = builder.add(r, builder.mul(tl.index, c64(32)))
                    vrow = builder.gep(ba.data, [builder.mul(kl, c64(PV_DIMS))])
                    vv = [vload(builder, builder.gep(vrow, [c64(8 * v)]), V8F) for v in range(NV)]
                    for h in range(nh):
                        pv = splat(builder, builder.load(builder.gep(prows[h], [kl])), V8F)
                        for v in range(NV):
                            builder.store(fma(builder, pv, vv[v], builder.load(regs[h][v])), regs[h][v])
                for h in range(nh):
                    for v in range(NV):
                        vstore(builder, builder.load(regs[h][v]), builder.gep(accp[h], [c64(8 * v)]))

        in_head_blocks(builder, G, PV_HEADS, heads)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def widen8(typingctx, src, isrc, dst, idst, n):
    """dst[idst : idst+n] = float32(src[isrc : isrc+n]) for float16 bits src (exact); n % 8 == 0."""
    sig = types.void(src, isrc, dst, idst, n)

    def codegen(context, builder, signature, args):
        sa, da = array(context, builder, signature.args[0], args[0]), array(context, builder, signature.args[2], args[2])
        isrc, idst, n = (as_i64(builder, args[k]) for k in (1, 3, 4))
        sdata = builder.bitcast(sa.data, ir.HalfType().as_pointer())
        with cgutils.for_range_slice(builder, c64(0), n, c64(8)) as (e, _):
            vstore(builder, _load8(builder, sdata, builder.add(isrc, e), True), builder.gep(da.data, [builder.add(idst, e)]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def widen_transpose8(typingctx, src, isrc, stride, dst, idst, ld):
    """dst[idst + e*ld + k] = float32(src[isrc + k*stride + e]) for k, e < 8: an 8 x 8 block of
    float16 bits (8 rows of 8 consecutive elements, `stride` apart) widened and transposed, with
    unpack / shuffle / 128-bit permute steps (the V^T of 8 keys x 8 head dims for P@V)."""
    sig = types.void(src, isrc, stride, dst, idst, ld)

    def codegen(context, builder, signature, args):
        sa, da = array(context, builder, signature.args[0], args[0]), array(context, builder, signature.args[3], args[3])
        isrc, stride, idst, ld = (as_i64(builder, args[k]) for k in (1, 2, 4, 5))
        sdata = builder.bitcast(sa.data, ir.HalfType().as_pointer())
        r = [_load8(builder, sdata, builder.add(isrc, builder.mul(c64(k), stride)), True) for k in range(8)]
        a = []
        for k in range(0, 8, 2):       # a: pairs of rows interleaved (unpacklo / unpackhi)
            a += [_shuffle8(builder, r[k], r[k + 1], [0, 8, 1, 9, 4, 12, 5, 13]),
                  _shuffle8(builder, r[k], r[k + 1], [2, 10, 3, 11, 6, 14, 7, 15])]
        b = []
        for k in (0, 4):               # b: 4 rows' elements e and e + 4 in each 128-bit half
            for u in (0, 1):
                b += [_shuffle8(builder, a[k + u], a[k + 2 + u], [0, 1, 8, 9, 4, 5, 12, 13]),
                      _shuffle8(builder, a[k + u], a[k + 2 + u], [2, 3, 10, 11, 6, 7, 14, 15])]
        for e in range(8):             # column e: rows 0..3 from b[e % 4], rows 4..7 from b[4 + e % 4]
            half = [0, 1, 2, 3, 8, 9, 10, 11] if e < 4 else [4, 5, 6, 7, 12, 13, 14, 15]
            col = _shuffle8(builder, b[e % 4], b[4 + e % 4], half)
            vstore(builder, col, builder.gep(da.data, [builder.add(idst, builder.mul(c64(e), ld))]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def scale_max8(typingctx, S, i0, n, scale, m):
    """S[i0 : i0+n] *= scale (float32 products, in place), returning max(m, the products); n % 8 == 0.
    Eight lanes of running maxima (max is exact in any order; the scores are finite)."""
    sig = types.float32(S, i0, n, scale, m)

    def codegen(context, builder, signature, args):
        sa = array(context, builder, signature.args[0], args[0])
        i0, n = as_i64(builder, args[1]), as_i64(builder, args[2])
        sv = splat(builder, args[3], V8F)
        run = cgutils.alloca_once_value(builder, splat(builder, args[4], V8F))
        with cgutils.for_range_slice(builder, c64(0), n, c64(8)) as (c, _):
            p = builder.gep(sa.data, [builder.add(i0, c)])
            x = builder.fmul(vload(builder, p, V8F), sv)
            vstore(builder, x, p)
            cur = builder.load(run)
            builder.store(builder.select(builder.fcmp_ordered(">", x, cur), x, cur), run)
        v = builder.load(run)
        e = [builder.extract_element(v, c32(k)) for k in range(8)]
        while len(e) > 1:
            e = [builder.select(builder.fcmp_ordered(">", e[k], e[k + 1]), e[k], e[k + 1]) for k in range(0, len(e), 2)]
        return e[0]

    return sig, codegen
