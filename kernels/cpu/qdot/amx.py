"""Prompts of the K-quants on AMX tiles (Intel Sapphire Rapids and later): llama.cpp's AVX2 numbers
bit for bit, with the integer products on the tile unit (TDPBUSD / TDPBSSD: a 16x64 by 64x16 byte
product into 16x16 int32 per instruction; README: measured).

Why the bits stay: the arithmetic llama.cpp's gemm kernels fix is, per output, one exact integer
per segment (Q4_K: isum = sc_2c dot_2c + sc_2c+1 dot_2c+1 per 64-element chunk; the tiled types
Q6_K, Q3_K, IQ4_XS, Q2_K: S = sum of value x sub-block scale per 256-element super-block), then
float steps. A tile product gives exact int32 sums of byte products, so each weight's
value x scale product is split into bytes that multiply exactly and recombine by a shift:
- Q4_K: q (0..15) x sc (0..63) = 8 q (sc >> 3) + q (sc & 7), both parts u8: isum = 8 C_hi + C_lo;
- Q6_K, Q3_K, IQ4_XS: p = value x scale within +-4096 = 64 (p >> 6) + (p & 63): an s8 part (TDPBSSD)
  and a u8 part (TDPBUSD): S = 64 C_hi + C_lo;
- Q2_K: p = q (0..3) x sc (0..15) is one u8 part, and the minimums' sum P = sum of mn x x another
  (each element's byte is its sub-block's minimum).
Then the float steps run lane-wise on 512-bit registers as in tiled16 and q4_k's 16-row kernels
(16 activation rows in the lanes: a tile row of C is one weight row against 16 activation rows).

The tiles: C 4 (2 parts x 2 groups of 16 activation rows), A 2 (the parts of 16 weight rows),
B 2 (the two groups' 64-element chunk; rows16.regroup_bytes is already the tile layout, 16 dwords
of 4 bytes per row). The blocking is a GEMM's: a panel of weight rows is unpacked into its parts
(2 bytes per element) one slab of super-blocks at a time, small enough for L2, and used by every
pair of activation groups; between slabs the sums wait in `out` itself (transposed in registers).
Q4_K stores its tiles after every chunk (a float step each), the others once per super-block,
which is why the tiled types gain the most. The kernel variant is kernels.cpu.isa's avx512amx
(KVCHAT_ISA); Linux grants the tile state per process (isa.amx_permitted).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import config, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels import types as T
from kernels.cpu.qdot.q4_k import Q4K_X8_BYTES
from kernels.cpu.qdot.rows16 import V32S
from kernels.cpu.qdot.tiled16 import unpack16
from kernels.cpu.simd import (AMX, V16F, V16I, V32B, V64B, array, byte_ptr, c32, c64, call, f16, f32, i8, i32, load_as, not_this_variant, splat, transpose,
                              vload, vstore)

PANEL_BYTES = 1 << 19          # a panel's unpacked parts stay in L2 beside two groups of activation rows
TILE = 1024                    # bytes of one 16 x 64-byte tile
_VOID = ir.VoidType()


def _asm(builder, text: str, args=()):
    """One AMX instruction. The tile registers are named in the text (LLVM allocates none of them),
    and every statement clobbers memory, so none moves across the loads and stores around it."""
    builder.asm(ir.FunctionType(_VOID, [a.type for a in args]), text,
                ",".join(["r"] * len(args) + ["~{memory}"]), list(args), side_effect=True)


def _configure(builder):
    """ldtilecfg: palette 1, tiles 0-7 each 16 rows of 64 bytes (its state is per thread: every
    kernel call loads it, and releases it at the end)."""
    cfg = bytearray(64)
    cfg[0] = 1
    for t in range(8):
        cfg[16 + 2 * t] = 64
        cfg[48 + t] = 16
    slot = cgutils.alloca_once(builder, ir.ArrayType(i8, 64))
    builder.store(ir.Constant(ir.ArrayType(i8, 64), cfg), slot)
    _asm(builder, "ldtilecfg ($0)", [byte_ptr(builder, slot)])


def _load(builder, tmm: int, ptr):
    _asm(builder, f"tileloadd ($0,$1,1), %tmm{tmm}", [ptr, c64(64)])


def _store(builder, tmm: int, ptr):
    _asm(builder, f"tilestored %tmm{tmm}, ($0,$1,1)", [ptr, c64(64)])


# --- the weight panels: (blocks, nb, 4 chunks, 2 parts, 16 rows, 64 bytes) uint8 -------------------

@intrinsic
def q4_k_parts(typingctx, wx8, g0, n_groups, sb0, ap, dwp, dmp, mnp):
    """Super-blocks sb0 .. sb0+nb-1 (a slab) of groups g0 .. g0+n_groups-1 of a Q4_K x8 matrix (8 rows
    each, two to a block of 16) -> ap (blocks, nb, 4, 2, 16, 64), the parts q (sc >> 3) and q (sc & 7)
    per chunk; dwp, dmp (P, nb) float32 d and dmin; mnp (P, nb, 4) int32: per chunk the two
    sub-blocks' minimums as int16 pairs."""
    sig = types.void(wx8, g0, n_groups, sb0, ap, dwp, dmp, mnp)

    def codegen(context, builder, signature, args):
        wa, _, _, _, pa, da, dma, ma = (array(context, builder, signature.args[k], args[k]) if k > 3 or k == 0 else None
                                        for k in range(8))
        g0v, ng, sb0v = args[1], args[2], args[3]
        nb = builder.extract_value(da.shape, 1)
        V64I = ir.VectorType(i32, 64)
        with cgutils.for_range(builder, ng) as gl:
            g = gl.index
            src = builder.gep(byte_ptr(builder, wa.data), [builder.add(builder.mul(builder.add(g0v, g), builder.extract_value(wa.strides, 0)),
                                                                       builder.mul(sb0v, c64(Q4K_X8_BYTES)))])
            blk = builder.sdiv(g, c64(2))
            r0 = builder.mul(g, c64(8))                                     # the group's first row in the panel
            dst = builder.gep(byte_ptr(builder, pa.data), [builder.add(builder.mul(blk, builder.mul(nb, c64(8 * TILE))),
                                                                       builder.mul(builder.srem(g, c64(2)), c64(8 * 64)))])
            with cgutils.for_range(builder, nb) as bl:
                b = bl.index
                p = builder.gep(src, [builder.mul(b, c64(Q4K_X8_BYTES))])
                for rr in range(8):
                    row = builder.add(r0, c64(rr))
                    at = builder.add(builder.mul(row, nb), b)
                    builder.store(builder.fpext(load_as(builder, p, f16, 1152 + 2 * rr), f32), builder.gep(da.data, [at]))
                    builder.store(builder.fpext(load_as(builder, p, f16, 1168 + 2 * rr), f32), builder.gep(dma.data, [at]))
                for c in range(4):
                    v = vload(builder, builder.gep(p, [c64(256 * c)]), V64I)          # qs[c][step 8][row 8][4]
                    for rr in range(8):
                        x = builder.bitcast(builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, 8), [8 * k + rr for k in range(8)])), V32B)
                        lo, hi = builder.and_(x, splat(builder, ir.Constant(i8, 15), V32B)), builder.lshr(x, splat(builder, ir.Constant(i8, 4), V32B))
                        s0, s1 = (load_as(builder, p, i8, 1024 + 16 * c + 2 * rr + h) for h in range(2))
                        m0, m1 = (builder.zext(load_as(builder, p, i8, 1088 + 16 * c + 2 * rr + h), i32) for h in range(2))
                        t = builder.gep(dst, [builder.add(builder.mul(b, c64(8 * TILE)), c64(2 * TILE * c + 64 * rr))])
                        for part, f in enumerate((lambda s: builder.lshr(s, ir.Constant(i8, 3)), lambda s: builder.and_(s, ir.Constant(i8, 7)))):
                            both = builder.shuffle_vector(builder.mul(lo, splat(builder, f(s0), V32B)), builder.mul(hi, splat(builder, f(s1), V32B)),
                                                          ir.Constant(ir.VectorType(i32, 64), list(range(64))))
                            vstore(builder, both, builder.gep(t, [c64(part * TILE)]))
                        mn = builder.or_(m0, builder.shl(m1, c32(16)))
                        builder.store(mn, builder.gep(ma.data, [builder.add(builder.mul(builder.add(builder.mul(builder.add(r0, c64(rr)), nb), b), c64(4)), c64(c))]))
        return context.get_dummy_value()

    return sig, codegen


def _tiled_parts(mins: bool):
    """kern(wp, mnp, nr, ap): an int16 product panel wp (P, nb*256) from tiled16's unpackers (rows
    below nr) -> ap. The signed types: p >> 6 (s8) and p & 63 (u8); Q2_K (mins): the products (u8)
    and each element's sub-block minimum (mnp (P, nb, 16) int16)."""

    def kern(typingctx, wp, mnp, nr, ap):
        sig = types.void(wp, mnp, nr, ap)

        def codegen(context, builder, signature, args):
            wa, ma, _, pa = (array(context, builder, signature.args[k], args[k]) if k != 2 else None for k in range(4))
            nb = builder.extract_value(pa.shape, 1)
            V64S = ir.VectorType(ir.IntType(16), 64)
            with cgutils.for_range(builder, args[2]) as rl:
                r = rl.index
                src = builder.gep(byte_ptr(builder, wa.data), [builder.mul(r, builder.mul(nb, c64(512)))])
                dst = builder.gep(byte_ptr(builder, pa.data), [builder.add(builder.mul(builder.sdiv(r, c64(16)), builder.mul(nb, c64(8 * TILE))),
                                                                           builder.mul(builder.srem(r, c64(16)), c64(64)))])
                with cgutils.for_range(builder, builder.mul(nb, c64(4))) as cl:
                    ch = cl.index                                                       # chunk: b * 4 + c
                    v = vload(builder, builder.gep(src, [builder.mul(ch, c64(128))]), V64S)
                    t = builder.gep(dst, [builder.mul(ch, c64(2 * TILE))])
                    if mins:
                        m4 = builder.trunc(vload(builder, builder.gep(byte_ptr(builder, ma.data), [builder.add(builder.mul(r, builder.mul(nb, c64(32))), builder.mul(ch, c64(8)))]),
                                                 ir.VectorType(ir.IntType(16), 4)), ir.VectorType(i8, 4))
                        parts = (builder.trunc(v, V64B), builder.shuffle_vector(m4, m4, ir.Constant(ir.VectorType(i32, 64), [k // 16 for k in range(64)])))
                    else:
                        parts = (builder.trunc(builder.ashr(v, splat(builder, ir.Constant(ir.IntType(16), 6), V64S)), V64B),
                                 builder.trunc(builder.and_(v, splat(builder, ir.Constant(ir.IntType(16), 63), V64S)), V64B))
                    vstore(builder, parts[0], t)
                    vstore(builder, parts[1], builder.gep(t, [c64(TILE)]))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"tiled_parts{'_mins' if mins else ''}"
    return intrinsic(kern)


tiled_parts, tiled_parts_mins = _tiled_parts(False), _tiled_parts(True)


# --- the tile kernels -------------------------------------------------------------------------------

V16L = ir.VectorType(ir.IntType(64), 16)


def _masked_load(builder, ptr, mask):
    return call(builder, "llvm.masked.load.v16f32.p0", V16F,
                [builder.bitcast(ptr, V16F.as_pointer()), c32(4), mask, ir.Constant(V16F, [0.0] * 16)])


def _masked_store(builder, value, ptr, mask):
    call(builder, "llvm.masked.store.v16f32.p0", _VOID, [value, builder.bitcast(ptr, V16F.as_pointer()), c32(4), mask])


def _tiles(kind: str, X: int):
    """kern(ap, dwp, dmp, mnp, n_blk, xg, bsg, dxg, gx, sb0, out, n0, accm): one slab of
    super-blocks (sb0 on, as many as dwp's columns) of the products of a panel's blocks of 16 weight
    rows with X groups of 16 activation rows (gx on): out[16(gx+x) + l, n0 + 16 blk + j] (rows below
    out's, columns below its width) holds the sums between slabs (Q4_K: the minimums' sums in accm
    (G*16, 16 blocks), and out = acc - accm after the last slab). ap, dwp, dmp, mnp: the slab's parts;
    xg (G, K/4, 16, 4) int8, dxg (G, K/256, 16) float32, bsg (G, K/64, 16) int32 (Q4_K's 32-element
    sums as int16 pairs; unread for the tiled types) for the whole rows.
    kind "q4_k": per chunk acc = fma(float(8 C_hi + C_lo), d_w d_x, acc), accm = fma(float(mn . bs),
    dmin_w d_x, accm), out = acc - accm. "signed": per super-block res = d_w float(64 C_hi + C_lo),
    out = fma(res, d_x, out). "q2_k": res = fma(-dmin_w, float(C_mn), d_w float(C_q)).

    Software-pipelined by super-block: its tile products are issued (and stored to a scratch
    buffer), then the float steps of the super-block before, from the other buffer, run on the
    vector units while the tile unit works."""
    q4k = kind == "q4_k"

    def kern(typingctx, ap, dwp, dmp, mnp, n_blk, xg, bsg, dxg, gx, sb0, out, n0, accm_out):
        sig = types.void(ap, dwp, dmp, mnp, n_blk, xg, bsg, dxg, gx, sb0, out, n0, accm_out)

        def codegen(context, builder, signature, args):
            pa, da, dma, ma, _, xa, ba, dxa, _, _, oa, _, ama = (array(context, builder, signature.args[k], args[k]) if k not in (4, 8, 9, 11) else None
                                                                 for k in range(13))
            nblk, gxv, sb0v, n0v = args[4], args[8], args[9], args[11]
            nb = builder.extract_value(da.shape, 1)                         # the slab's super-blocks
            nbt = builder.extract_value(dxa.shape, 1)                       # the rows'
            M, N = builder.extract_value(oa.shape, 0), builder.extract_value(oa.shape, 1)
            Pm = builder.extract_value(ama.shape, 1)
            first = builder.icmp_signed("==", sb0v, c64(0))
            last = builder.icmp_signed("==", builder.add(sb0v, nb), nbt)
            xgs = [builder.gep(byte_ptr(builder, xa.data), [builder.add(builder.mul(builder.add(gxv, c64(x)), builder.mul(nbt, c64(256 * 16))),
                                                                        builder.mul(sb0v, c64(4 * TILE)))]) for x in range(X)]
            _configure(builder)
            drains = 4 if q4k else 1                      # tile stores per super-block (Q4_K: every chunk's)
            scratch = cgutils.alloca_once(builder, ir.ArrayType(V16I, 2 * drains * X * 2 * 16))   # [buffer][drain][x][part][row j]
            acc = [[cgutils.alloca_once(builder, V16F) for _ in range(16)] for _ in range(X)]
            accm = [[cgutils.alloca_once(builder, V16F) for _ in range(16)] for _ in range(X)] if q4k else None
            dp_hi = "tdpbssd" if kind == "signed" else "tdpbusd"

            def at(b, d, x, part, j=0):
                """Index into scratch of super-block b's drain d."""
                return builder.add(builder.mul(builder.srem(b, c64(2)), c64(drains * X * 32)), c64(((d * X + x) * 2 + part) * 16 + j))

            def drain(b, d):
                for x in range(X):
                    for part in range(2):
                        _store(builder, 2 * x + part, builder.bitcast(builder.gep(scratch, [c32(0), at(b, d, x, part)]), i8.as_pointer()))
                        _asm(builder, f"tilezero %tmm{2 * x + part}")

            def tiles(blk_base, b):
                """Super-block b's tile products into C (tmm 2x+part; A tmm4/5, B tmm6/7), stored to
                its scratch buffer after every chunk (Q4_K) or at its end."""
                for c in range(4):
                    ch = builder.add(builder.mul(b, c64(4)), c64(c))                  # chunk index in the slab
                    a = builder.gep(blk_base, [builder.mul(ch, c64(2 * TILE))])
                    _load(builder, 4, a)
                    _load(builder, 5, builder.gep(a, [c64(TILE)]))
                    for x in range(X):
                        _load(builder, 6 + x, builder.gep(xgs[x], [builder.mul(ch, c64(TILE))]))
                    for x in range(X):
                        _asm(builder, f"{dp_hi} %tmm{6 + x}, %tmm4, %tmm{2 * x}")
                        _asm(builder, f"tdpbusd %tmm{6 + x}, %tmm5, %tmm{2 * x + 1}")
                    if q4k or c == 3:
                        drain(b, c if q4k else 0)

            def epilogue(rows, b):
                def part_row(d, x, part, j):
                    return builder.load(builder.gep(scratch, [c32(0), at(b, d, x, part, j)]))

                dxv = [vload(builder, builder.gep(byte_ptr(builder, dxa.data), [builder.mul(builder.add(builder.mul(builder.add(gxv, c64(x)), nbt), builder.add(sb0v, b)), c64(64))]), V16F)
                       for x in range(X)]

                def d_of(arr, j):
                    return splat(builder, builder.load(builder.gep(arr.data, [builder.add(builder.mul(rows[j], nb), b)])), V16F)

                if q4k:                  # per chunk: acc += float(8 C_hi + C_lo) d_w d_x, accm += float(mn . bs) dmin_w d_x
                    bs = [[builder.bitcast(vload(builder, builder.gep(byte_ptr(builder, ba.data), [builder.mul(builder.add(builder.mul(builder.add(gxv, c64(x)), builder.mul(nbt, c64(4))), builder.add(builder.mul(builder.add(sb0v, b), c64(4)), c64(c))), c64(64))]), V16I), V32S)
                           for c in range(4)] for x in range(X)]
                    for j in range(16):
                        dw, dm = d_of(da, j), d_of(dma, j)
                        mn = [builder.bitcast(splat(builder, builder.load(builder.gep(ma.data, [builder.add(builder.mul(builder.add(builder.mul(rows[j], nb), b), c64(4)), c64(c))])), V16I), V32S)
                              for c in range(4)]
                        for x in range(X):
                            scale, scale_m = builder.fmul(dw, dxv[x]), builder.fmul(dm, dxv[x])     # fp32(d_w * d_x)
                            a, am = builder.load(acc[x][j]), builder.load(accm[x][j])
                            for c in range(4):
                                isum = builder.add(builder.shl(part_row(c, x, 0, j), splat(builder, c32(3), V16I)), part_row(c, x, 1, j))
                                a = call(builder, "llvm.fma.v16f32", V16F, [builder.sitofp(isum, V16F), scale, a])
                                msum = call(builder, "llvm.x86.avx512.pmaddw.d.512", V16I, [mn[c], bs[x][c]])
                                am = call(builder, "llvm.fma.v16f32", V16F, [builder.sitofp(msum, V16F), scale_m, am])
                            builder.store(a, acc[x][j])
                            builder.store(am, accm[x][j])
                    return
                def part_row0(x, part, j):
                    return part_row(0, x, part, j)
                for j in range(16):
                    dw = d_of(da, j)
                    dm = d_of(dma, j) if kind == "q2_k" else None
                    for x in range(X):
                        if kind == "signed":
                            S = builder.add(builder.shl(part_row0(x, 0, j), splat(builder, c32(6), V16I)), part_row0(x, 1, j))
                            res = builder.fmul(dw, builder.sitofp(S, V16F))
                        else:
                            res = builder.fmul(dw, builder.sitofp(part_row0(x, 0, j), V16F))
                            res = call(builder, "llvm.fma.v16f32", V16F, [builder.fneg(dm), builder.sitofp(part_row0(x, 1, j), V16F), res])
                        builder.store(call(builder, "llvm.fma.v16f32", V16F, [res, dxv[x], builder.load(acc[x][j])]), acc[x][j])

            with cgutils.for_range(builder, nblk) as bk:
                blk = bk.index
                blk_base = builder.gep(byte_ptr(builder, pa.data), [builder.mul(blk, builder.mul(nb, c64(8 * TILE)))])
                rows = [builder.add(builder.mul(blk, c64(16)), c64(j)) for j in range(16)]     # panel rows

                col0 = builder.add(n0v, builder.mul(blk, c64(16)))
                cmask = builder.icmp_signed("<", builder.add(splat(builder, col0, V16L), ir.Constant(V16L, list(range(16)))), splat(builder, N, V16L))

                def out_rows(x):
                    """(pointer, mask) of the 16 out rows of group x at this block's columns."""
                    res = []
                    for lane in range(16):
                        m = builder.add(builder.mul(builder.add(gxv, c64(x)), c64(16)), c64(lane))
                        ok = builder.and_(cmask, splat(builder, builder.icmp_signed("<", m, M), ir.VectorType(ir.IntType(1), 16)))
                        res.append((builder.gep(oa.data, [builder.add(builder.mul(m, N), col0)]), ok))
                    return res

                def accm_rows(x):
                    return [builder.gep(ama.data, [builder.add(builder.mul(builder.add(builder.mul(builder.add(gxv, c64(x)), c64(16)), c64(lane)), Pm),
                                                               builder.mul(blk, c64(16)))]) for lane in range(16)]

                with builder.if_else(first) as (then, otherwise):
                    with then:
                        for x in range(X):
                            for j in range(16):
                                builder.store(ir.Constant(V16F, [0.0] * 16), acc[x][j])
                                if q4k:
                                    builder.store(ir.Constant(V16F, [0.0] * 16), accm[x][j])
                    with otherwise:
                        for x in range(X):
                            t = transpose(builder, [_masked_load(builder, p, ok) for p, ok in out_rows(x)])
                            for j in range(16):
                                builder.store(t[j], acc[x][j])
                            if q4k:
                                t = transpose(builder, [vload(builder, p, V16F) for p in accm_rows(x)])
                                for j in range(16):
                                    builder.store(t[j], accm[x][j])
                for t in range(2 * X):
                    _asm(builder, f"tilezero %tmm{t}")
                tiles(blk_base, c64(0))
                with cgutils.for_range_slice(builder, c64(1), nb, c64(1)) as (sb, _):
                    tiles(blk_base, sb)
                    epilogue(rows, builder.sub(sb, c64(1)))
                epilogue(rows, builder.sub(nb, c64(1)))
                with builder.if_else(last) as (then, otherwise):
                    with then:
                        for x in range(X):
                            res = [builder.load(acc[x][j]) for j in range(16)]
                            if q4k:
                                res = [builder.fsub(r, builder.load(accm[x][j])) for j, r in enumerate(res)]
                            for (p, ok), v in zip(out_rows(x), transpose(builder, res)):
                                _masked_store(builder, v, p, ok)
                    with otherwise:
                        for x in range(X):
                            for (p, ok), v in zip(out_rows(x), transpose(builder, [builder.load(acc[x][j]) for j in range(16)])):
                                _masked_store(builder, v, p, ok)
                            if q4k:
                                for p, v in zip(accm_rows(x), transpose(builder, [builder.load(accm[x][j]) for j in range(16)])):
                                    vstore(builder, v, p)
            _asm(builder, "tilerelease")
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"amx_{kind}_{X}"
    return intrinsic(kern)


if AMX:
    _q4_k_2, _q4_k_1 = _tiles("q4_k", 2), _tiles("q4_k", 1)
    _signed_2, _signed_1 = _tiles("signed", 2), _tiles("signed", 1)
    _q2_k_2, _q2_k_1 = _tiles("q2_k", 2), _tiles("q2_k", 1)


NO_ACCM = np.zeros((0, 0), np.float32)      # the tiled types keep no minimums' sums
SLAB = 4                       # super-blocks per slab: a panel's parts for one slab stay in L2
# numba's thread pool (the CPU's count unless NUMBA_NUM_THREADS): a panel for each. A constant, as
# get_num_threads() would keep the kernels out of the compile cache; a smaller pool only gets more panels.
POOL = max(2, config.NUMBA_NUM_THREADS)


@njit(cache=True)
def _panel_blocks(n_blk, nb):
    """16-row blocks per panel: PANEL_BYTES of one slab's parts, and a panel for every thread."""
    return max(1, min(PANEL_BYTES // (min(nb, SLAB) * 8 * TILE), -(-n_blk // POOL)))


@njit(parallel=True, cache=True, error_model="numpy")
def _q4_k_prompt(wx8, xg, bsg, dxg, M, out):
    """Q4_K (x8 layout) x rows16-regrouped q8_K rows -> out (M, N) with llama.cpp's gemm arithmetic;
    prange over panels of 16-row blocks; per slab of super-blocks a panel is unpacked once for every
    pair of 16-row groups, the sums kept in the panel's accumulators between slabs."""
    out = out[:M]                                # the rows the caller gives this arithmetic
    n_groups = wx8.shape[0]
    nb = dxg.shape[1]
    G = xg.shape[0]
    nblk = -(-n_groups // 2)
    PB = _panel_blocks(nblk, nb)
    for p in prange(-(-nblk // PB)):
        b0 = p * PB
        nk = min(PB, nblk - b0)
        ng = min(2 * nk, n_groups - 2 * b0)
        accm = np.empty((16 * G, 16 * PB), np.float32)        # the minimums' sums between slabs
        for sb0 in range(0, nb, SLAB):
            ns = min(SLAB, nb - sb0)
            ap = np.empty((PB, ns, 4, 2, 16, 64), np.uint8)
            if ng < 2 * PB:
                ap[ng // 2:] = 0                                # an odd last group leaves zeros
            dwp = np.zeros((16 * PB, ns), np.float32)
            dmp = np.zeros((16 * PB, ns), np.float32)
            mnp = np.zeros((16 * PB, ns, 4), np.int32)
            q4_k_parts(wx8, 2 * b0, ng, sb0, ap, dwp, dmp, mnp)
            gx = 0
            while gx + 2 <= G:
                _q4_k_2(ap, dwp, dmp, mnp, nk, xg, bsg, dxg, gx, sb0, out, 16 * b0, accm)
                gx += 2
            if gx < G:
                _q4_k_1(ap, dwp, dmp, mnp, nk, xg, bsg, dxg, gx, sb0, out, 16 * b0, accm)


@njit(parallel=True, cache=True, error_model="numpy")
def _tiled_prompt(ggml_type, w, xg, dxg, M, out):
    """GGUF rows w of Q6_K, Q3_K, IQ4_XS or Q2_K x rows16-regrouped q8_K rows -> out (M, N) with
    llama.cpp's tiled arithmetic; prange over panels of 16-row blocks, slabs as in _q4_k_prompt."""
    out = out[:M]
    N = w.shape[0]
    nb = dxg.shape[1]
    G = xg.shape[0]
    bb = w.shape[1] // nb                        # bytes per super-block
    nblk = -(-N // 16)
    PB = _panel_blocks(nblk, nb)
    mins = ggml_type == T.Q2_K
    for p in prange(-(-nblk // PB)):
        r0 = 16 * p * PB
        nr = min(16 * PB, N - r0)
        nk = -(-nr // 16)
        for sb0 in range(0, nb, SLAB):
            ns = min(SLAB, nb - sb0)
            ws = w[:, sb0 * bb:(sb0 + ns) * bb]
            dwp = np.zeros((16 * PB, ns), np.float32)
            dmp = np.zeros((16 * PB, ns), np.float32)
            wps = np.empty((16 * PB, ns * 256), np.int16)
            mns = np.empty((16 * PB, ns, 16), np.int16)
            ap = np.empty((PB, ns, 4, 2, 16, 64), np.uint8)
            if nr < 16 * PB:
                ap[nr // 16:] = 0                               # rows past nr stay zero
            unpack16(ggml_type, ws, r0, nr, wps, dwp, dmp, mns)
            if mins:
                tiled_parts_mins(wps, mns, nr, ap)
            else:
                tiled_parts(wps, mns, nr, ap)
            gx = 0
            while gx + 2 <= G:
                if mins:
                    _q2_k_2(ap, dwp, dmp, mns, nk, xg, xg, dxg, gx, sb0, out, r0, NO_ACCM)
                else:
                    _signed_2(ap, dwp, dmp, mns, nk, xg, xg, dxg, gx, sb0, out, r0, NO_ACCM)
                gx += 2
            if gx < G:
                if mins:
                    _q2_k_1(ap, dwp, dmp, mns, nk, xg, xg, dxg, gx, sb0, out, r0, NO_ACCM)
                else:
                    _signed_1(ap, dwp, dmp, mns, nk, xg, xg, dxg, gx, sb0, out, r0, NO_ACCM)


# The tile kernels are compiled only where they run; elsewhere the dispatch never calls them.
q4_k_prompt = _q4_k_prompt if AMX else not_this_variant
tiled_prompt = _tiled_prompt if AMX else not_this_variant
