"""Tiled (flash) attention over a paged KV cache, numba.

Cache per layer: k_cache, v_cache (n_blocks, block_size, n_kv_heads, head_dim) float16 (as
llama.cpp keeps K and V; the kernels see it as uint16 bits, numba has no float16, and widen to
float32 on load: all arithmetic is float32); a sequence's block_table maps logical block i (positions i*bs .. i*bs+bs-1) to a physical
block. Key j is visible to the query at position p iff j <= p and, with window > 0,
p - j < window (llama.cpp's is_masked_swa masks p - j >= n_swa).

Both kernels process all query heads of one GQA group together so each K/V row is loaded
once per group, and keep an online softmax per query row (running max m, running sum l,
rescaled accumulator) so no (T x N) score matrix is ever formed.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.cpu.ops import PAR_MIN, pick, serial_twin, vexp
from kernels.cpu.quant import V16F, V16H, _c64, _i64, _splat, _vload

FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}  # no nnan/ninf: -inf marks masked scores


@intrinsic
def f16_bits(typingctx, x):
    """float32 x rounded to the nearest float16 (ties to even), as its uint16 bits."""
    sig = types.uint16(x)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


@intrinsic
def f16_value(typingctx, bits):
    """The float16 with these uint16 bits, as float32 (exact)."""
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@njit(parallel=True, cache=True, error_model="numpy")
def _write_kv(k_cache, v_cache, block_table, start_pos, k, v):
    """k_cache/v_cache: the float16 cache as uint16; k, v (T, Hkv, hd) float32."""
    bs = k_cache.shape[1]
    for t in prange(k.shape[0]):
        p = start_pos + t
        blk = block_table[p // bs]
        for h in range(k.shape[1]):
            for e in range(k.shape[2]):
                k_cache[blk, p % bs, h, e] = f16_bits(k[t, h, e])
                v_cache[blk, p % bs, h, e] = f16_bits(v[t, h, e])


_write_kv_serial = serial_twin(_write_kv)


def write_kv(k_cache, v_cache, block_table, start_pos: int, k, v) -> None:
    """Store k, v (T, Hkv, hd), rounded to float16, at positions start_pos .. start_pos+T-1."""
    T = k.shape[0]
    bs = k_cache.shape[1]
    if T == 0:
        return
    if (start_pos + T - 1) // bs >= len(block_table):
        raise ValueError(f"positions up to {start_pos + T - 1} need more than {len(block_table)} blocks")
    kernel = pick(_write_kv, _write_kv_serial, k.size)
    if k_cache.dtype != np.float16 or v_cache.dtype != np.float16:
        raise TypeError(f"KV cache must be float16, got {k_cache.dtype} / {v_cache.dtype}")
    kernel(k_cache.view(np.uint16), v_cache.view(np.uint16), np.ascontiguousarray(block_table, np.int32),
           int(start_pos), np.ascontiguousarray(k, np.float32), np.ascontiguousarray(v, np.float32))


# Register-blocked micro-kernels of the prefill tile (LLVM vector IR: numba's auto-vectorizer
# keeps the accumulators in memory, which left the scalar loops at a third of FMA peak).
# Rows of the tile are the vector lanes (16 per vector), so every lane (query row) gets the
# same sequence of fused multiply-adds whichever vector it sits in: a row's result does not
# depend on the tile around it.

def _store16(builder, ptr, val):
    builder.store(val, builder.bitcast(ptr, V16F.as_pointer()), align=4)


def _fma_into(builder, acc, a, b):
    prod = builder.fmul(a, b, flags=("contract",))
    builder.store(builder.fadd(builder.load(acc), prod, flags=("contract",)), acc)


def _qk_kernel(n_keys: int, n_vec: int):
    """qk(qt, kf, kbase, kstride, st, j0, i0): st[j0+j, i0:i0+16*n_vec] = sum_e kf[kbase + (j0+j)*kstride
    + e] * qt[e, i0:i0+16*n_vec] for j < n_keys. qt (hd, Rp) queries, kf the flat K cache, st (bs, Rp)."""

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
    (kf: the float16 K cache as uint16) for every head g of the group and j < n (lanes j >= n repeat key n-1). The 16 keys' products
    accumulate along head_dim in 16 vectors, reduced at the end by _hsum16x16; hd % 16 == 0."""
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
def _dec_accumulate_pv(s, vf, vbase, vstride, n, acc):
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
def _scores(qt, kf, kbase, kstride, st, n):
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
def _accumulate_pv(st, vf, vbase, vstride, n, acct):
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


@njit(fastmath=FAST, cache=True, error_model="numpy", inline="always")
def _attend_tile(qt, kf, vf, kstride, block_table, bs, kvh, pos, lo_pos, n_keys_lo, n_keys_hi,
                 m, l, acct, st, alpha, kbuf, vbuf):
    """Prefill: online-softmax update of R query rows over keys [n_keys_lo, n_keys_hi).

    The R rows (positions x the GQA group, padded to a multiple of 16) are the vector lanes:
    qt (hd, R) holds the scaled queries, st (bs, R) the scores of one cache block, acct (hd, R)
    the unnormalised output. Scores and P@V run in the register-blocked micro-kernels, each
    loaded K/V element serving 16-64 rows; the softmax bookkeeping (mask, max, exp, rescale) is
    elementwise over R. kf/vf: the layer's float16 K/V cache (uint16 bits) flattened from
    (n_blocks, bs, Hkv, hd), so key (blk, off) of head kvh starts at ((blk*bs + off)*Hkv + kvh)*hd
    and kstride = Hkv*hd; each block's rows are widened once into kbuf/vbuf (bs*hd float32).
    pos/lo_pos (R,): a row at position p sees keys lo_pos <= j <= p (padding rows: none).
    """
    hd, R = qt.shape
    j0 = n_keys_lo
    while j0 < n_keys_hi:
        blk = block_table[j0 // bs]
        off0 = j0 % bs
        j1 = min(n_keys_hi, j0 - off0 + bs)
        n = j1 - j0
        base = (blk * bs + off0) * kstride + kvh * hd
        if hd % 16 == 0:
            widen_rows16(kf, base, kstride, n, hd, kbuf)
            widen_rows16(vf, base, kstride, n, hd, vbuf)
        else:
            for jj in range(n):
                for e in range(hd):
                    kbuf[jj * hd + e] = f16_value(kf[base + jj * kstride + e])
                    vbuf[jj * hd + e] = f16_value(vf[base + jj * kstride + e])
        _scores(qt, kbuf, 0, hd, st, n)
        # new running max (alpha holds it for now); masked scores become -inf
        for i in range(R):
            alpha[i] = m[i]
        for jj in range(n):
            j = j0 + jj
            srow = st[jj]
            for i in range(R):
                sv = srow[i] if (j <= pos[i] and j >= lo_pos[i]) else np.float32(-np.inf)
                srow[i] = sv
                alpha[i] = max(alpha[i], sv)
        for i in range(R):
            m_new = alpha[i]
            m_ref = m_new if m_new > -np.inf else np.float32(0.0)  # row with nothing visible yet
            alpha[i] = vexp(m[i] - m_ref) if m[i] > -np.inf else np.float32(0.0)
            m[i] = m_new
            l[i] *= alpha[i]
        for e in range(hd):
            arow = acct[e]
            for i in range(R):
                arow[i] *= alpha[i]
        for jj in range(n):
            srow = st[jj]
            for i in range(R):
                m_ref = m[i] if m[i] > -np.inf else np.float32(0.0)
                pv = vexp(srow[i] - m_ref) if srow[i] > -np.inf else np.float32(0.0)
                srow[i] = pv
                l[i] += pv
        _accumulate_pv(st, vbuf, 0, hd, n, acct)
        j0 = j1


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _prefill(q, k_cache, v_cache, block_table, q_start, scale, window, q_tile, out):
    T, Hq, hd = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    kf, vf = k_cache.reshape(-1), v_cache.reshape(-1)
    G = Hq // Hkv
    n_tiles = (T + q_tile - 1) // q_tile
    for w in prange(Hkv * n_tiles):
        kvh = w // n_tiles
        t0 = (w % n_tiles) * q_tile
        t1 = min(T, t0 + q_tile)
        R = (t1 - t0) * G
        Rp = (R + 15) // 16 * 16                # lanes: rows padded to whole vectors
        qt = np.zeros((hd, Rp), np.float32)     # column i = (t - t0) * G + g
        pos = np.full(Rp, -1, np.int64)         # padding rows see no key
        lo_pos = np.zeros(Rp, np.int64)
        for t in range(t0, t1):
            for g in range(G):
                i = (t - t0) * G + g
                for e in range(hd):
                    qt[e, i] = q[t, kvh * G + g, e] * scale
                pos[i] = q_start + t
                lo_pos[i] = max(0, q_start + t - window + 1) if window > 0 else 0
        m = np.full(Rp, -np.inf, np.float32)
        l = np.zeros(Rp, np.float32)
        acct = np.zeros((hd, Rp), np.float32)
        st = np.empty((bs, Rp), np.float32)
        alpha = np.empty(Rp, np.float32)
        kbuf = np.empty(bs * hd, np.float32)
        vbuf = np.empty(bs * hd, np.float32)
        # keys from the block holding the tile's first visible key: every row then sees its keys
        # in the same groups whatever tile it is in (masked keys add exact zeros), so a row's
        # result does not depend on how the queries are chunked
        _attend_tile(qt, kf, vf, Hkv * hd, block_table, bs, kvh, pos, lo_pos, lo_pos[0] - lo_pos[0] % bs,
                     q_start + t1, m, l, acct, st, alpha, kbuf, vbuf)
        for t in range(t0, t1):
            for g in range(G):
                i = (t - t0) * G + g
                inv = np.float32(1.0) / l[i]
                for e in range(hd):
                    out[t, kvh * G + g, e] = acct[e, i] * inv


_prefill_serial = serial_twin(_prefill)


def _check_cache(q, k_cache, v_cache, block_table, n_pos):
    if k_cache.dtype != np.float16 or v_cache.dtype != np.float16:
        raise TypeError(f"KV cache must be float16, got {k_cache.dtype} / {v_cache.dtype}")
    if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        raise ValueError("the KV cache of a layer must be C-contiguous")
    if k_cache.shape != v_cache.shape or k_cache.ndim != 4:
        raise ValueError(f"k_cache {k_cache.shape} / v_cache {v_cache.shape} must match (n_blocks, bs, Hkv, hd)")
    Hq, hd = q.shape[-2], q.shape[-1]
    if hd != k_cache.shape[3] or Hq % k_cache.shape[2]:
        raise ValueError(f"q heads/dim {q.shape[-2:]} incompatible with cache {k_cache.shape}")
    if n_pos > 0 and (n_pos - 1) // k_cache.shape[1] >= len(block_table):
        raise ValueError(f"{n_pos} positions need more than {len(block_table)} blocks")


def _choose_q_tile(T: int, n_q_heads: int, n_kv_heads: int) -> int:
    """Query positions per work item: tiles of up to ~256 rows (positions x GQA group) so the
    row-vectorized loops are long, as few tiles as that allows, of equal size (a short tail tile
    runs at a fraction of the speed), and at least one work item per thread."""
    group = n_q_heads // n_kv_heads
    tile_max = max(8, min(64, 256 // group))
    n_tiles = -(-T // tile_max)
    while n_kv_heads * n_tiles < numba.get_num_threads() and n_tiles < T:
        n_tiles += 1
    return max(1, -(-T // n_tiles))


def attention_prefill(q, k_cache, v_cache, block_table, q_start: int, scale: float, window: int = 0,
                      q_tile: int = 0):
    """q (T, Hq, hd) at positions q_start.. over keys 0..q_start+T-1 already in the cache -> (T, Hq, hd)."""
    q = np.ascontiguousarray(q, np.float32)
    _check_cache(q, k_cache, v_cache, block_table, q_start + q.shape[0])
    out = np.empty_like(q)
    if q_tile <= 0:
        q_tile = _choose_q_tile(q.shape[0], q.shape[1], k_cache.shape[2])
    if q.shape[0]:
        work = q.shape[0] * (q_start + q.shape[0]) * q.shape[1] * q.shape[2] // 16  # ~ MACs / 16
        kernel = pick(_prefill, _prefill_serial, work)
        kernel(q, k_cache.view(np.uint16), v_cache.view(np.uint16), np.ascontiguousarray(block_table, np.int32),
               int(q_start), np.float32(scale), int(window), int(q_tile), out)
    return out


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _decode_partial_v(q, k_cache, v_cache, block_table, lo, hi, chunk, scale, o_part, m_part, l_part):
    """Split-KV decode (head_dim % 16 == 0): work item (kv head, split) attends the group's G query
    heads over keys [lo + split*chunk, ...) in chunks of up to 16 keys and leaves unnormalised
    (out, max, sumexp) for the merge. Scores: dec_qk16 (keys as lanes, products along head_dim,
    one shuffle reduction per head); P@V: dec_pv (head_dim as lanes). All keys seen are visible."""
    Hq, hd = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    kf, vf = k_cache.reshape(-1), v_cache.reshape(-1)
    kstride = Hkv * hd
    G = Hq // Hkv
    n_splits = m_part.shape[1]
    for w in prange(Hkv * n_splits):
        kvh = w // n_splits
        sp = w % n_splits
        qg = np.empty((G, hd), np.float32)
        for g in range(G):
            for e in range(hd):
                qg[g, e] = q[kvh * G + g, e] * scale
        m = np.full(G, -np.inf, np.float32)
        l = np.zeros(G, np.float32)
        acc = np.zeros((G, hd), np.float32)
        s = np.empty((G, 16), np.float32)
        j0 = lo + sp * chunk
        j_end = min(hi, j0 + chunk)
        while j0 < j_end:
            off0 = j0 % bs
            j1 = min(j_end, j0 - off0 + bs, j0 + 16)
            n = j1 - j0
            base = (block_table[j0 // bs] * bs + off0) * kstride + kvh * hd
            jp = j1 + 16  # prefetch two chunks ahead (in place, 3.5k keys: attention -14% vs none)
            if jp < j_end:
                off1 = jp % bs
                n1 = min(j_end, jp - off1 + bs, jp + 16) - jp
                base1 = (block_table[jp // bs] * bs + off1) * kstride + kvh * hd
                prefetch_rows(kf, base1, kstride, n1, hd)
                prefetch_rows(vf, base1, kstride, n1, hd)
            dec_qk16(qg, kf, base, kstride, n, s)
            for g in range(G):
                sg = s[g]
                mx = m[g]
                for jj in range(n):
                    mx = max(mx, sg[jj])
                alpha = vexp(m[g] - mx)  # m = -inf on the first chunk: ~0
                lsum = l[g] * alpha
                for jj in range(n):
                    pv = vexp(sg[jj] - mx)
                    sg[jj] = pv
                    lsum += pv
                l[g] = lsum
                m[g] = mx
                if alpha != 1.0:
                    a = acc[g]
                    for e in range(hd):
                        a[e] *= alpha
            _dec_accumulate_pv(s, vf, base, kstride, n, acc)
            j0 = j1
        for g in range(G):
            m_part[kvh * G + g, sp] = m[g]
            l_part[kvh * G + g, sp] = l[g]
            o_part[kvh * G + g, sp, :] = acc[g, :]


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _decode_partial(q, k_cache, v_cache, block_table, lo, hi, chunk, scale, o_part, m_part, l_part):
    """Split-KV decode: work item (kv head, split) attends the group's G query heads over keys
    [lo + split*chunk, ...) and leaves unnormalised (out, max, sumexp) for the merge. Scores
    are dots over head_dim held as (G, bs) rows so the softmax is vectorized over keys."""
    Hq, hd = q.shape
    bs = k_cache.shape[1]
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    n_splits = m_part.shape[1]
    for w in prange(Hkv * n_splits):
        kvh = w // n_splits
        sp = w % n_splits
        qg = np.empty((G, hd), np.float32)
        for g in range(G):
            for e in range(hd):
                qg[g, e] = q[kvh * G + g, e] * scale
        m = np.full(G, -np.inf, np.float32)
        l = np.zeros(G, np.float32)
        acc = np.zeros((G, hd), np.float32)
        s = np.empty((G, bs), np.float32)
        j0 = lo + sp * chunk
        j_end = min(hi, j0 + chunk)
        while j0 < j_end:
            blk = block_table[j0 // bs]
            off0 = j0 % bs
            j1 = min(j_end, j0 - off0 + bs)
            n = j1 - j0
            for jj in range(n):
                kr = k_cache[blk, off0 + jj, kvh]
                for g in range(G):
                    qr = qg[g]
                    dot = np.float32(0.0)
                    for e in range(hd):
                        dot += qr[e] * f16_value(kr[e])
                    s[g, jj] = dot
            for g in range(G):
                sg = s[g]
                mx = m[g]
                for jj in range(n):
                    mx = max(mx, sg[jj])
                alpha = vexp(m[g] - mx)  # m = -inf on the first block: ~0
                lsum = l[g] * alpha
                for jj in range(n):
                    pv = vexp(sg[jj] - mx)
                    sg[jj] = pv
                    lsum += pv
                l[g] = lsum
                m[g] = mx
                a = acc[g]
                for e in range(hd):
                    a[e] *= alpha
            for jj in range(n):
                vr = v_cache[blk, off0 + jj, kvh]
                for g in range(G):
                    pv = s[g, jj]
                    a = acc[g]
                    for e in range(hd):
                        a[e] += pv * f16_value(vr[e])
            j0 = j1
        for g in range(G):
            m_part[kvh * G + g, sp] = m[g]
            l_part[kvh * G + g, sp] = l[g]
            o_part[kvh * G + g, sp, :] = acc[g, :]


@njit(fastmath=FAST, cache=True, error_model="numpy")
def _merge_splits(o_part, m_part, l_part, out):
    """Log-sum-exp merge of partial (unnormalised out, max, sumexp) per head."""
    Hq, S, hd = o_part.shape
    for h in range(Hq):
        mx = np.float32(-np.inf)
        for s in range(S):
            mx = max(mx, m_part[h, s])
        tot = np.float32(0.0)
        for e in range(hd):
            out[h, e] = 0.0
        for s in range(S):
            if m_part[h, s] == -np.inf:
                continue
            c = np.exp(m_part[h, s] - mx)
            tot += c * l_part[h, s]
            for e in range(hd):
                out[h, e] += c * o_part[h, s, e]
        inv = np.float32(1.0) / tot
        for e in range(hd):
            out[h, e] *= inv


_decode_partial_serial = serial_twin(_decode_partial)
_decode_partial_v_serial = serial_twin(_decode_partial_v)


def _choose_splits(n_keys: int, n_kv_heads: int, block_size: int) -> int:
    threads = numba.get_num_threads()
    want = max(1, -(-2 * threads // n_kv_heads))  # ~2 work items per thread
    most = max(1, n_keys // max(64, block_size))  # keep >= 64 keys per split
    return min(want, most)


def attention_decode(q, k_cache, v_cache, block_table, n_kv: int, scale: float, window: int = 0,
                     n_splits: int = 0):
    """One query q (Hq, hd) at position n_kv-1 over cached keys [0, n_kv) -> (Hq, hd). Flash-decoding."""
    q = np.ascontiguousarray(q, np.float32)
    _check_cache(q, k_cache, v_cache, block_table, n_kv)
    if n_kv <= 0:
        raise ValueError("attention_decode needs at least one cached key")
    lo = max(0, n_kv - window) if window > 0 else 0
    n_keys = n_kv - lo
    bs = k_cache.shape[1]
    Hq, hd = q.shape
    kv_elems = n_keys * k_cache.shape[2] * hd  # K (and as many V) floats to read
    parallel = kv_elems >= PAR_MIN
    if n_splits <= 0:
        n_splits = _choose_splits(n_keys, k_cache.shape[2], bs) if parallel else 1
    n_splits = max(1, min(int(n_splits), n_keys))
    chunk = -(-n_keys // n_splits)
    if n_splits > 1 and chunk > bs:
        chunk = -(-chunk // bs) * bs  # whole cache blocks per split
        n_splits = -(-n_keys // chunk)
    o_part = np.empty((Hq, n_splits, hd), np.float32)
    m_part = np.empty((Hq, n_splits), np.float32)
    l_part = np.empty((Hq, n_splits), np.float32)
    if hd % 16 == 0:
        kernel = _decode_partial_v if parallel else _decode_partial_v_serial
    else:
        kernel = _decode_partial if parallel else _decode_partial_serial
    kernel(q, k_cache.view(np.uint16), v_cache.view(np.uint16), np.ascontiguousarray(block_table, np.int32),
           lo, n_kv, chunk, np.float32(scale), o_part, m_part, l_part)
    out = np.empty((Hq, hd), np.float32)
    _merge_splits(o_part, m_part, l_part, out)
    return out
