"""The register-blocked pieces of the attention kernels, as LLVM vector IR (numba intrinsics).

numba's auto-vectorizer keeps accumulators in memory, which left the scalar attention loops at a
third of FMA peak; these keep 16 vector accumulators in registers. Prefill tiles put query rows
in the vector lanes (so every row gets the same chain of fused multiply-adds whichever vector it
sits in, and a row's result does not depend on the tile around it); decode puts keys in the
lanes for the scores and head_dim for P@V. The KV cache is float16, seen as uint16 bits (numba has
no float16) and widened with vcvtph2ps.
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.cpu.simd import V16F, as_i64 as _i64, c64 as _c64, f16, splat as _splat, vload as _vload

V16H = ir.VectorType(f16, 16)


def _store16(builder, ptr, val):
    builder.store(val, builder.bitcast(ptr, V16F.as_pointer()), align=4)


def _fma_into(builder, acc, a, b):
    prod = builder.fmul(a, b, flags=("contract",))
    builder.store(builder.fadd(builder.load(acc), prod, flags=("contract",)), acc)


def _qk_kernel(n_keys: int, n_vec: int):
    """qk(qt, kf, kbase, kstride, st, j0, i0): st[j0+j, i0:i0+16*n_vec] = sum_e kf[kbase + (j0+j)*kstride
    + e] * qt[e, i0:i0+16*n_vec] for j < n_keys. qt (hd, Rp) queries, kf float32 K rows (a cache
    block widened into scratch), st (bs, Rp) scores."""

    def kern(typingctx, qt, kf, kbase, kstride, st, j0, i0):
        sig = types.void(qt, kf, kbase, kstride, st, j0, i0)

        def codegen(context, builder, signature, args):
            qa = context.make_array(signature.args[0])(context, builder, args[0])
            ka = context.make_array(signature.args[1])(context, builder, args[1])
            sa = context.make_array(signature.args[4])(context, builder, args[4])
            kbase, kstride, j0, i0 = (_i64(builder, args[i]) for i in (2, 3, 5, 6))
            hd, rq = builder.extract_value(qa.shape, 0), builder.extract_value(qa.shape, 1)
            zero = ir.Constant(V16F, [0.0] * 16)
            accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(n_vec)] for _ in range(n_keys)]
            krows = [builder.gep(ka.data, [builder.add(kbase, builder.mul(builder.add(j0, _c64(j)), kstride))])
                     for j in range(n_keys)]
            with cgutils.for_range(builder, hd) as loop:
                e = loop.index
                qrow = builder.gep(qa.data, [builder.add(builder.mul(e, rq), i0)])
                qv = [_vload(builder, builder.gep(qrow, [_c64(16 * v)]), V16F) for v in range(n_vec)]
                for j in range(n_keys):
                    kv = _splat(builder, builder.load(builder.gep(krows[j], [e])), V16F)
                    for v in range(n_vec):
                        _fma_into(builder, accs[j][v], kv, qv[v])
            rs = builder.extract_value(sa.shape, 1)
            for j in range(n_keys):
                srow = builder.gep(sa.data, [builder.add(builder.mul(builder.add(j0, _c64(j)), rs), i0)])
                for v in range(n_vec):
                    _store16(builder, builder.gep(srow, [_c64(16 * v)]), builder.load(accs[j][v]))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"qk_{n_keys}x{n_vec}"
    return intrinsic(kern)


def _pv_kernel(n_dims: int, n_vec: int):
    """pv(st, vf, vbase, vstride, n, acct, e0, i0): acct[e0+d, i0:i0+16*n_vec] += sum_{j<n} st[j, i0:..]
    * vf[vbase + j*vstride + e0 + d] for d < n_dims, keys in order."""

    def kern(typingctx, st, vf, vbase, vstride, n, acct, e0, i0):
        sig = types.void(st, vf, vbase, vstride, n, acct, e0, i0)

        def codegen(context, builder, signature, args):
            sa = context.make_array(signature.args[0])(context, builder, args[0])
            va = context.make_array(signature.args[1])(context, builder, args[1])
            aa = context.make_array(signature.args[5])(context, builder, args[5])
            vbase, vstride, n, e0, i0 = (_i64(builder, args[i]) for i in (2, 3, 4, 6, 7))
            rs, ra = builder.extract_value(sa.shape, 1), builder.extract_value(aa.shape, 1)
            arows = [builder.gep(aa.data, [builder.add(builder.mul(builder.add(e0, _c64(d)), ra), i0)])
                     for d in range(n_dims)]
            accs = [[cgutils.alloca_once(builder, V16F) for _ in range(n_vec)] for _ in range(n_dims)]
            for d in range(n_dims):
                for v in range(n_vec):
                    builder.store(_vload(builder, builder.gep(arows[d], [_c64(16 * v)]), V16F), accs[d][v])
            with cgutils.for_range(builder, n) as loop:
                j = loop.index
                prow = builder.gep(sa.data, [builder.add(builder.mul(j, rs), i0)])
                pv = [_vload(builder, builder.gep(prow, [_c64(16 * v)]), V16F) for v in range(n_vec)]
                vrow = builder.gep(va.data, [builder.add(builder.add(vbase, builder.mul(j, vstride)), e0)])
                for d in range(n_dims):
                    vv = _splat(builder, builder.load(builder.gep(vrow, [_c64(d)])), V16F)
                    for v in range(n_vec):
                        _fma_into(builder, accs[d][v], pv[v], vv)
            for d in range(n_dims):
                for v in range(n_vec):
                    _store16(builder, builder.gep(arows[d], [_c64(16 * v)]), builder.load(accs[d][v]))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"pv_{n_dims}x{n_vec}"
    return intrinsic(kern)



def _vload_f16(builder, ptr):
    """16 float16 (uint16 bits) at ptr, widened to float32 (vcvtph2ps)."""
    return builder.fpext(_vload(builder, ptr, V16H), V16F)


def _hsum16x16(builder, vecs):
    """16 vectors of 16 partial sums -> one vector whose lane j is the total of vecs[j]. Each level
    adds pairs of vectors: with k keys per input vector, key i's P = 16/k partials in lanes
    [i*P, (i+1)*P), the sum of the two halves of each run packs a's keys then b's into one vector
    of 2k keys with P/2 partials each."""
    v16i = ir.VectorType(ir.IntType(32), 16)
    k = 1
    while len(vecs) > 1:
        P = 16 // k
        lo = [src + i * P + t for src in (0, 16) for i in range(k) for t in range(P // 2)]
        hi = [x + P // 2 for x in lo]
        vecs = [builder.fadd(builder.shuffle_vector(a, b, ir.Constant(v16i, lo)),
                             builder.shuffle_vector(a, b, ir.Constant(v16i, hi)))
                for a, b in zip(vecs[0::2], vecs[1::2])]
        k *= 2
    return vecs[0]


@intrinsic
def dec_qk16(typingctx, qg, kf, kbase, kstride, n, s):
    """Decode scores of one chunk of up to 16 keys: s[g, j] = qg[g] . kf[kbase + j*kstride : +hd]
    (kf: the float16 K cache as uint16) for every head g of the group and j < n (lanes j >= n
    repeat key n-1). The 16 keys' products accumulate along head_dim in 16 vectors, reduced at
    the end by _hsum16x16; hd % 16 == 0."""
    sig = types.void(qg, kf, kbase, kstride, n, s)

    def codegen(context, builder, signature, args):
        qa = context.make_array(signature.args[0])(context, builder, args[0])
        ka = context.make_array(signature.args[1])(context, builder, args[1])
        sa = context.make_array(signature.args[5])(context, builder, args[5])
        kbase, kstride, n = (_i64(builder, args[i]) for i in (2, 3, 4))
        G, hd = builder.extract_value(qa.shape, 0), builder.extract_value(qa.shape, 1)
        last = builder.sub(n, _c64(1))
        krows = []
        for j in range(16):
            jj = builder.select(builder.icmp_signed("<", _c64(j), n), _c64(j), last)
            krows.append(builder.gep(ka.data, [builder.add(kbase, builder.mul(jj, kstride))]))
        zero = ir.Constant(V16F, [0.0] * 16)
        accs = [cgutils.alloca_once(builder, V16F) for _ in range(16)]
        with cgutils.for_range(builder, G) as gl:
            g = gl.index
            for acc in accs:
                builder.store(zero, acc)
            qrow = builder.gep(qa.data, [builder.mul(g, hd)])
            with cgutils.for_range(builder, builder.udiv(hd, _c64(16))) as cl:
                e = builder.mul(cl.index, _c64(16))
                qv = _vload(builder, builder.gep(qrow, [e]), V16F)
                for j in range(16):
                    _fma_into(builder, accs[j], _vload_f16(builder, builder.gep(krows[j], [e])), qv)
            total = _hsum16x16(builder, [builder.load(acc) for acc in accs])
            srow = builder.gep(sa.data, [builder.mul(g, builder.extract_value(sa.shape, 1))])
            _store16(builder, srow, total)
        return context.get_dummy_value()

    return sig, codegen


def _dec_pv_kernel(n_vec: int):
    """dec_pv(s, vf, vbase, vstride, n, acc, e0): acc[g, e0:e0+16*n_vec] += sum_{j<n} s[g, j] *
    vf[vbase + j*vstride + e0 : ...] for every head g; keys in order (vf: float16 V as uint16)."""

    def kern(typingctx, s, vf, vbase, vstride, n, acc, e0):
        sig = types.void(s, vf, vbase, vstride, n, acc, e0)

        def codegen(context, builder, signature, args):
            sa = context.make_array(signature.args[0])(context, builder, args[0])
            va = context.make_array(signature.args[1])(context, builder, args[1])
            aa = context.make_array(signature.args[5])(context, builder, args[5])
            vbase, vstride, n, e0 = (_i64(builder, args[i]) for i in (2, 3, 4, 6))
            G, hd = builder.extract_value(aa.shape, 0), builder.extract_value(aa.shape, 1)
            rs = builder.extract_value(sa.shape, 1)
            regs = [cgutils.alloca_once(builder, V16F) for _ in range(n_vec)]
            with cgutils.for_range(builder, G) as gl:
                g = gl.index
                arow = builder.gep(aa.data, [builder.add(builder.mul(g, hd), e0)])
                for v in range(n_vec):
                    builder.store(_vload(builder, builder.gep(arow, [_c64(16 * v)]), V16F), regs[v])
                prow = builder.gep(sa.data, [builder.mul(g, rs)])
                with cgutils.for_range(builder, n) as jl:
                    j = jl.index
                    p = _splat(builder, builder.load(builder.gep(prow, [j])), V16F)
                    vrow = builder.gep(va.data, [builder.add(builder.add(vbase, builder.mul(j, vstride)), e0)])
                    for v in range(n_vec):
                        _fma_into(builder, regs[v], _vload_f16(builder, builder.gep(vrow, [_c64(16 * v)])), p)
                for v in range(n_vec):
                    _store16(builder, builder.gep(arow, [_c64(16 * v)]), builder.load(regs[v]))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"dec_pv_{n_vec}"
    return intrinsic(kern)


dec_pv_4, dec_pv_3, dec_pv_2, dec_pv_1 = (_dec_pv_kernel(v) for v in (4, 3, 2, 1))


@intrinsic
def prefetch_rows(typingctx, arr, base, stride, n_rows, row_len):
    """Software prefetch (into L2) of n_rows rows of row_len elements at arr[base + r*stride]: the
    next chunk's keys and values while this one computes (DRAM latency otherwise stalls decode
    attention at long contexts)."""
    sig = types.void(arr, base, stride, n_rows, row_len)

    def codegen(context, builder, signature, args):
        a = context.make_array(signature.args[0])(context, builder, args[0])
        base, stride, n_rows, row_len = (_i64(builder, args[i]) for i in (1, 2, 3, 4))
        i8p = ir.IntType(8).as_pointer()
        i32t = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32t, i32t, i32t]),
                                            "llvm.prefetch.p0")
        with cgutils.for_range(builder, n_rows) as rl:
            row = builder.bitcast(builder.gep(a.data, [builder.add(base, builder.mul(rl.index, stride))]), i8p)
            per_line = 64 // (signature.args[0].dtype.bitwidth // 8)
            n_lines = builder.udiv(builder.add(row_len, _c64(per_line - 1)), _c64(per_line))
            with cgutils.for_range(builder, n_lines) as cl:
                builder.call(fn, [builder.gep(row, [builder.mul(cl.index, _c64(64))]), ir.Constant(i32t, 0),
                                  ir.Constant(i32t, 2), ir.Constant(i32t, 1)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def widen_rows16(typingctx, src, base, stride, n, hd, dst):
    """dst[r*hd : (r+1)*hd] = float16 rows src[base + r*stride : +hd] (uint16 bits) as float32, for
    r < n, 16 values per vcvtph2ps; hd % 16 == 0."""
    sig = types.void(src, base, stride, n, hd, dst)

    def codegen(context, builder, signature, args):
        sa = context.make_array(signature.args[0])(context, builder, args[0])
        da = context.make_array(signature.args[5])(context, builder, args[5])
        base, stride, n, hd = (_i64(builder, args[i]) for i in (1, 2, 3, 4))
        with cgutils.for_range(builder, n) as rl:
            srow = builder.gep(sa.data, [builder.add(base, builder.mul(rl.index, stride))])
            drow = builder.gep(da.data, [builder.mul(rl.index, hd)])
            with cgutils.for_range(builder, builder.udiv(hd, _c64(16))) as cl:
                e = builder.mul(cl.index, _c64(16))
                _store16(builder, builder.gep(drow, [e]), _vload_f16(builder, builder.gep(srow, [e])))
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, inline="always")
def decode_pv(s, vf, vbase, vstride, n, acc):
    nv = acc.shape[1] // 16
    v0 = 0
    while v0 + 4 <= nv:
        dec_pv_4(s, vf, vbase, vstride, n, acc, 16 * v0)
        v0 += 4
    r = nv - v0
    if r == 3:
        dec_pv_3(s, vf, vbase, vstride, n, acc, 16 * v0)
    elif r == 2:
        dec_pv_2(s, vf, vbase, vstride, n, acc, 16 * v0)
    elif r == 1:
        dec_pv_1(s, vf, vbase, vstride, n, acc, 16 * v0)

# 4 keys (or 4 head dims) x 4 vectors = 16 accumulators, 8 loads per 16 FMAs; the 1-key and
# narrower variants take the edges.
qk_4x4, qk_4x3, qk_4x2, qk_4x1 = (_qk_kernel(4, v) for v in (4, 3, 2, 1))
qk_1x4, qk_1x3, qk_1x2, qk_1x1 = (_qk_kernel(1, v) for v in (4, 3, 2, 1))
pv_4x4, pv_4x3, pv_4x2, pv_4x1 = (_pv_kernel(4, v) for v in (4, 3, 2, 1))


@njit(cache=True, inline="always")
def _qk_rows(qt, kf, kbase, kstride, st, j0, nv):
    """Scores of keys j0..j0+3 over all nv vectors of rows."""
    v0 = 0
    while v0 + 4 <= nv:
        qk_4x4(qt, kf, kbase, kstride, st, j0, 16 * v0)
        v0 += 4
    r = nv - v0
    if r == 3:
        qk_4x3(qt, kf, kbase, kstride, st, j0, 16 * v0)
    elif r == 2:
        qk_4x2(qt, kf, kbase, kstride, st, j0, 16 * v0)
    elif r == 1:
        qk_4x1(qt, kf, kbase, kstride, st, j0, 16 * v0)


@njit(cache=True, inline="always")
def _qk_rows1(qt, kf, kbase, kstride, st, j0, nv):
    v0 = 0
    while v0 + 4 <= nv:
        qk_1x4(qt, kf, kbase, kstride, st, j0, 16 * v0)
        v0 += 4
    r = nv - v0
    if r == 3:
        qk_1x3(qt, kf, kbase, kstride, st, j0, 16 * v0)
    elif r == 2:
        qk_1x2(qt, kf, kbase, kstride, st, j0, 16 * v0)
    elif r == 1:
        qk_1x1(qt, kf, kbase, kstride, st, j0, 16 * v0)


@njit(cache=True, inline="always")
def tile_scores(qt, kf, kbase, kstride, st, n):
    """st[j, :] = K[j] . qt for the block's keys j < n (K row j at kf[kbase + j*kstride])."""
    nv = qt.shape[1] // 16
    j = 0
    while j + 4 <= n:
        _qk_rows(qt, kf, kbase, kstride, st, j, nv)
        j += 4
    while j < n:
        _qk_rows1(qt, kf, kbase, kstride, st, j, nv)
        j += 1


@njit(cache=True, inline="always")
def tile_pv(st, vf, vbase, vstride, n, acct):
    """acct[e, :] += sum_{j<n} st[j, :] * V[j, e] (V row j at vf[vbase + j*vstride]); hd % 4 == 0."""
    hd = acct.shape[0]
    nv = acct.shape[1] // 16
    for e0 in range(0, hd, 4):
        v0 = 0
        while v0 + 4 <= nv:
            pv_4x4(st, vf, vbase, vstride, n, acct, e0, 16 * v0)
            v0 += 4
        r = nv - v0
        if r == 3:
            pv_4x3(st, vf, vbase, vstride, n, acct, e0, 16 * v0)
        elif r == 2:
            pv_4x2(st, vf, vbase, vstride, n, acct, e0, 16 * v0)
        elif r == 1:
            pv_4x1(st, vf, vbase, vstride, n, acct, e0, 16 * v0)
