"""GGML block formats: table, repacking into kernel-friendly arrays, exact dequantization.

A GGUF weight row is a run of fixed-size blocks. `repack` splits the blocks of a
(n_rows, row_bytes) uint8 matrix into separate contiguous arrays (f16 scales become
f32, packed 6-bit K-quant scales become one byte each, quants stay packed), so the
numba kernels in this module and in matmul.py index plain arrays instead of decoding
structs. Dequantization mirrors gguf-py's float operation order, so the result is
bit-identical to `gguf.quants.dequantize`.
"""
from __future__ import annotations

import numpy as np
from llvmlite import binding as _llvm, ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.cpu import ops
from kernels.cpu.ops import serial_twin
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as _T

# ggml type id -> (elements per block, bytes per block)
GGML_BLOCK: dict[int, tuple[int, int]] = {int(t): (int(b), int(s)) for t, (b, s) in GGML_QUANT_SIZES.items()}

F32, F16, BF16 = int(_T.F32), int(_T.F16), int(_T.BF16)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = int(_T.Q4_0), int(_T.Q4_1), int(_T.Q5_0), int(_T.Q5_1), int(_T.Q8_0)
Q4_K, Q5_K, Q6_K = int(_T.Q4_K), int(_T.Q5_K), int(_T.Q6_K)

SUPPORTED_TYPES: frozenset[int] = frozenset({F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K})

TYPE_NAMES: dict[int, str] = {int(t): t.name for t in _T}

# f16 bit pattern -> f32, exact by construction; 256 KiB, stays in L2 for F16 kernels.
F16_LUT = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@intrinsic
def bits_f32(typingctx, a, sa, b, sb, mb):
    """float32(((a >> sa) & 15) | (((b >> sb) & mb) << 4)) in 32-bit integer lanes.

    Numba widens every integer op to int64, which makes LLVM vectorize quant decoding with
    8-lane int64->float conversions; doing the bit work in i32 gives 16-lane AVX-512 code.
    """
    sig = types.float32(a, sa, b, sb, mb)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)

        def to32(v, t):
            w = v.type.width
            if w < 32:
                return builder.sext(v, i32) if t.signed else builder.zext(v, i32)
            return builder.trunc(v, i32) if w > 32 else v

        av, sav, bv, sbv, mbv = (to32(v, t) for v, t in zip(args, signature.args))
        lo = builder.and_(builder.lshr(av, sav), ir.Constant(i32, 15))
        hi = builder.shl(builder.and_(builder.lshr(bv, sbv), mbv), ir.Constant(i32, 4))
        return builder.sitofp(builder.or_(lo, hi), ir.FloatType())

    return sig, codegen


@intrinsic
def mad_nib(typingctx, acc, a, sa, xq):
    """acc + ((a >> sa) & 15) * xq as int32 (a: uint8 quant byte, xq: int8 activation).

    Written as one i32 multiply-add so LLVM turns the reduction into AVX-512 VNNI dot products."""
    sig = types.int32(acc, a, sa, xq)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        accv, av, sav, xv = args
        sav = builder.trunc(sav, i32) if sav.type.width > 32 else sav
        q = builder.and_(builder.lshr(builder.zext(av, i32), sav), ir.Constant(i32, 15))
        return builder.add(accv, builder.mul(q, builder.sext(xv, i32)))

    return sig, codegen


@intrinsic
def i8_f32(typingctx, a):
    """float32(int8 a) as one sitofp (numba's own cast vectorizes poorly)."""
    sig = types.float32(a)

    def codegen(context, builder, signature, args):
        return builder.sitofp(args[0], ir.FloatType())

    return sig, codegen


# --- 16-row interleaved tiles for int8-activation gemv (AVX-512 VNNI) -----------------------
# A tile holds 16 consecutive rows; per block it stores the 16 rows' quants interleaved so that
# one 64-byte vector holds 4 consecutive elements of each row (one int32 lane per row). The dot
# with int8 activations is then vpdpbusd (u8 weight x s8 activation, 4 products per lane) with
# the activation's 4 bytes broadcast: no horizontal sums, each x load serves 16 rows, and the
# tile's bytes stream contiguously. Kernels are written as LLVM vector IR (numba's
# auto-vectorizer does not find this shape). Only on CPUs with AVX-512 VNNI.
HAS_VNNI = bool(_llvm.get_host_cpu_features().get("avx512vnni", False))
i8, i32, f32, f16 = ir.IntType(8), ir.IntType(32), ir.FloatType(), ir.HalfType()
V16I = ir.VectorType(i32, 16)
V16F = ir.VectorType(f32, 16)
V16H = ir.VectorType(f16, 16)
V16B = ir.VectorType(i8, 16)
TILE_B_Q5_0 = 352  # bytes per (tile, block): qs 256, qh 64, d 32 (f16)


def _splat(builder, val, vty):
    undef = ir.Constant(vty, ir.Undefined)
    v = builder.insert_element(undef, val, ir.Constant(i32, 0))
    return builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(i32, vty.count), [0] * vty.count))


def _vload(builder, ptr, vty):
    return builder.load(builder.bitcast(ptr, vty.as_pointer()), align=1)


def _vconst(vty, c):
    return ir.Constant(vty, [c] * vty.count)


def _dpbusd(builder, acc, a, b):
    mod = builder.module
    fnty = ir.FunctionType(V16I, [V16I, V16I, V16I])
    fn = cgutils.get_or_insert_function(mod, fnty, "llvm.x86.avx512.vpdpbusd.512")
    return builder.call(fn, [acc, a, b])


def _shift(builder, v, s):
    if s > 0:
        return builder.shl(v, _vconst(V16I, s))
    if s < 0:
        return builder.lshr(v, _vconst(V16I, -s))
    return v


def repack_q5_0_tiles(raw: np.ndarray, n_cols: int) -> np.ndarray:
    """GGUF Q5_0 data (N rows of n_cols) -> (ceil(N/16), nb*352) uint8 tiles (see above);
    rows past N are zero (d = 0). Byte (g, r, j) of a block's qs holds elements 4g+j (low nibble)
    and 16+4g+j (high nibble) of row r; bits 2g / 2g+1 of qh byte (r, j) are their 5th bits."""
    raw_rows = as_block_bytes(raw, Q5_0, n_cols)
    pad = -raw_rows.shape[0] % 16
    if pad:
        raw_rows = np.concatenate([raw_rows, np.zeros((pad, raw_rows.shape[1]), np.uint8)])
    N = raw_rows.shape[0]
    nb = n_cols // 32
    T = N // 16
    k = raw_rows.reshape(N, nb, 22)
    d16 = k[..., 0:2]
    qh = np.ascontiguousarray(k[..., 2:6]).view("<u4")[..., 0].astype(np.uint32)
    qs = k[..., 6:22]
    qs_t = qs.reshape(T, 16, nb, 4, 4).transpose(0, 2, 3, 1, 4).reshape(T, nb, 256)
    hbyte = np.zeros((N, nb, 4), np.uint8)
    for g in range(4):
        for j in range(4):
            lo = (qh >> np.uint32(4 * g + j)) & np.uint32(1)
            hi = (qh >> np.uint32(16 + 4 * g + j)) & np.uint32(1)
            hbyte[..., j] |= ((lo << np.uint32(2 * g)) | (hi << np.uint32(2 * g + 1))).astype(np.uint8)
    qh_t = hbyte.reshape(T, 16, nb, 4).transpose(0, 2, 1, 3).reshape(T, nb, 64)
    d_t = d16.reshape(T, 16, nb, 2).transpose(0, 2, 1, 3).reshape(T, nb, 32)
    return np.ascontiguousarray(np.concatenate([qs_t, qh_t, d_t], axis=-1).reshape(T, nb * 352))



def _i64(builder, v):
    i64 = ir.IntType(64)
    w = v.type.width
    return builder.sext(v, i64) if w < 64 else (builder.trunc(v, i64) if w > 64 else v)


def _c64(v):
    return ir.Constant(ir.IntType(64), v)


def _at2(builder, arr, row, col):
    """Pointer to element (row, col) of a C-contiguous 2-D array struct."""
    ncols = builder.extract_value(arr.shape, 1)
    return builder.gep(arr.data, [builder.add(builder.mul(row, ncols), col)])


def _tile_kernel(name: str, n_rows: int, body):
    """An intrinsic kern(tiles, t, m0, xq32, dx, sums, out, t_out) that writes out[m0+m, 16t_out:16t_out+16]
    for m < n_rows: tile t of a 16-row tile matrix dotted with int8 activation rows m0.. (xq32: int8 x
    viewed as int32, (M, K/4); dx: per-block scales (M, nb); sums: the per-type block sums).
    `body(builder, p, b, rows, xa, da, sa, accs)` emits one block: p points at the block's bytes,
    it adds each row's float partial into accs[m]. The weights of a block are decoded once and
    used for all n_rows rows, so several tokens read W once (verify, batch, short prefill); every
    row gets exactly the float operations the one-row kernel gives it."""

    def kern(typingctx, tiles, t, m0, xq32, dx, sums, out, t_out):
        sig = types.void(tiles, t, m0, xq32, dx, sums, out, t_out)

        def codegen(context, builder, signature, args):
            arr = [context.make_array(signature.args[i])(context, builder, args[i]) if i not in (1, 2) else None
                   for i in range(7)]
            ta, xa, da, sa, oa = arr[0], arr[3], arr[4], arr[5], arr[6]
            t64, m064 = _i64(builder, args[1]), _i64(builder, args[2])
            nb = builder.extract_value(da.shape, 1)
            bytes_per_block = ir.Constant(ir.IntType(64), TILE_BYTES[name])
            base = builder.gep(ta.data, [builder.mul(t64, builder.mul(nb, bytes_per_block))])
            accs = [cgutils.alloca_once_value(builder, ir.Constant(V16F, [0.0] * 16)) for _ in range(n_rows)]
            rows = [builder.add(m064, _c64(m)) for m in range(n_rows)]
            with cgutils.for_range(builder, nb) as loop:
                p = builder.gep(base, [builder.mul(loop.index, bytes_per_block)])
                body(builder, p, loop.index, rows, xa, da, sa, accs)
            col = builder.mul(_i64(builder, args[7]), _c64(16))
            for m in range(n_rows):
                builder.store(builder.load(accs[m]), builder.bitcast(_at2(builder, oa, rows[m], col), V16F.as_pointer()),
                              align=1)
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"{name}_tile16_x{n_rows}"
    return intrinsic(kern)


def _acc_add(builder, acc, iacc, scale):
    """acc += float(iacc) * scale, as one fused multiply-add (llama.cpp's _mm256_fmadd_ps)."""
    prod = builder.fmul(builder.sitofp(iacc, V16F), scale, flags=("contract",))
    builder.store(builder.fadd(builder.load(acc), prod, flags=("contract",)), acc)


def _block32_rows(builder, first, second, dw, b, rows, xa, da, sa, accs):
    """The per-row part of a 32-element block kernel (Q5_0, Q8_0): `first[g]` / `second[g]` hold
    elements 4g..4g+3 / 16+4g..16+4g+3 of 16 weight rows as unsigned bytes, dw their f16 scales
    widened; sums[row, b] is the type's offset times the block sum of x, folded into the integer dot."""
    xi = builder.mul(b, _c64(8))
    for m, row in enumerate(rows):
        acc0 = _splat(builder, builder.load(_at2(builder, sa, row, b)), V16I)
        acc1 = ir.Constant(V16I, [0] * 16)
        for g in range(4):
            x0 = builder.load(_at2(builder, xa, row, builder.add(xi, _c64(g))))
            x1 = builder.load(_at2(builder, xa, row, builder.add(xi, _c64(4 + g))))
            acc0 = _dpbusd(builder, acc0, first[g], _splat(builder, x0, V16I))
            acc1 = _dpbusd(builder, acc1, second[g], _splat(builder, x1, V16I))
        scale = builder.fmul(dw, _splat(builder, builder.load(_at2(builder, da, row, b)), V16F))
        _acc_add(builder, accs[m], builder.add(acc0, acc1), scale)


def _q5_0_block(builder, p, b, rows, xa, da, sa, accs):
    # sums = -16 * per-32 sums of int8 x: the Q5_0 offset.
    m0f, m10 = _vconst(V16I, 0x0F0F0F0F), _vconst(V16I, 0x10101010)
    hb = _vload(builder, builder.gep(p, [_c64(256)]), V16I)
    lo, hi = [], []
    for g in range(4):
        v = _vload(builder, builder.gep(p, [_c64(64 * g)]), V16I)
        lo.append(builder.or_(builder.and_(v, m0f), builder.and_(_shift(builder, hb, 4 - 2 * g), m10)))
        hi.append(builder.or_(builder.and_(builder.lshr(v, _vconst(V16I, 4)), m0f),
                              builder.and_(_shift(builder, hb, 3 - 2 * g), m10)))
    dw = builder.fpext(_vload(builder, builder.gep(p, [_c64(320)]), V16H), V16F)
    _block32_rows(builder, lo, hi, dw, b, rows, xa, da, sa, accs)


def _q8_0_block(builder, p, b, rows, xa, da, sa, accs):
    # weights stored as q + 128 (unsigned for vpdpbusd); sums = -128 * per-32 sums of int8 x.
    w = [_vload(builder, builder.gep(p, [_c64(64 * g)]), V16I) for g in range(8)]
    dw = builder.fpext(_vload(builder, builder.gep(p, [_c64(512)]), V16H), V16F)
    _block32_rows(builder, w[:4], w[4:], dw, b, rows, xa, da, sa, accs)


def _q4_k_block(builder, p, b, rows, xa, da, sa, accs):
    # sums = per-32 sums of int8 x (for the minimums); dx is per 256.
    m0f = _vconst(V16I, 0x0F0F0F0F)
    zero = ir.Constant(V16I, [0] * 16)
    isum = [zero] * len(rows)
    msum = [zero] * len(rows)
    for c in range(4):
        acc = [[zero, zero] for _ in rows]
        for g in range(8):
            v = _vload(builder, builder.gep(p, [_c64(c * 512 + g * 64)]), V16I)
            qv = (builder.and_(v, m0f), builder.and_(builder.lshr(v, _vconst(V16I, 4)), m0f))
            for m, row in enumerate(rows):
                for h in range(2):
                    xv = builder.load(_at2(builder, xa, row, builder.add(builder.mul(b, _c64(64)), _c64(c * 16 + h * 8 + g))))
                    acc[m][h] = _dpbusd(builder, acc[m][h], qv[h], _splat(builder, xv, V16I))
        for h in range(2):
            j = 2 * c + h
            sc = builder.zext(_vload(builder, builder.gep(p, [_c64(2048 + j * 16)]), V16B), V16I)
            mn = builder.zext(_vload(builder, builder.gep(p, [_c64(2176 + j * 16)]), V16B), V16I)
            for m, row in enumerate(rows):
                isum[m] = builder.add(isum[m], builder.mul(acc[m][h], sc))
                bs = builder.load(_at2(builder, sa, row, builder.add(builder.mul(b, _c64(8)), _c64(j))))
                msum[m] = builder.add(msum[m], builder.mul(mn, _splat(builder, bs, V16I)))
    d = builder.fpext(_vload(builder, builder.gep(p, [_c64(2304)]), V16H), V16F)
    dmin = builder.fpext(_vload(builder, builder.gep(p, [_c64(2336)]), V16H), V16F)
    for m, row in enumerate(rows):
        dxb = _splat(builder, builder.load(_at2(builder, da, row, b)), V16F)
        part = builder.fsub(builder.fmul(d, builder.sitofp(isum[m], V16F)), builder.fmul(dmin, builder.sitofp(msum[m], V16F)))
        builder.store(builder.fadd(builder.load(accs[m]), builder.fmul(part, dxb), flags=("contract",)), accs[m])


def _q6_k_block(builder, p, b, rows, xa, da, sa, accs):
    # sums = -32 * per-16 sums of int8 x (the Q6_K offset). Element e = 128h + 32k + 4pp + j has
    # scale group e // 16 = 8h + 2k + pp // 4: per (h, pp // 4) four groups, one per stream k.
    m0f, m30 = _vconst(V16I, 0x0F0F0F0F), _vconst(V16I, 0x30303030)
    zero = ir.Constant(V16I, [0] * 16)
    isum = [zero] * len(rows)
    for h in range(2):
        for ph in range(2):
            groups = [8 * h + 2 * k + ph for k in range(4)]
            acc = [[_splat(builder, builder.load(_at2(builder, sa, row, builder.add(builder.mul(b, _c64(16)), _c64(s)))), V16I)
                    for s in groups] for row in rows]
            for pp in range(4 * ph, 4 * ph + 4):
                o = (h * 8 + pp) * 192
                A = _vload(builder, builder.gep(p, [_c64(o)]), V16I)
                B = _vload(builder, builder.gep(p, [_c64(o + 64)]), V16I)
                H = _vload(builder, builder.gep(p, [_c64(o + 128)]), V16I)
                vals = (
                    builder.or_(builder.and_(A, m0f), builder.and_(_shift(builder, H, 4), m30)),
                    builder.or_(builder.and_(B, m0f), builder.and_(_shift(builder, H, 2), m30)),
                    builder.or_(builder.and_(builder.lshr(A, _vconst(V16I, 4)), m0f), builder.and_(H, m30)),
                    builder.or_(builder.and_(builder.lshr(B, _vconst(V16I, 4)), m0f), builder.and_(_shift(builder, H, -2), m30)),
                )
                for k, qv in enumerate(vals):
                    xi = builder.add(builder.mul(b, _c64(64)), _c64((h * 128 + 32 * k + 4 * pp) // 4))
                    for m, row in enumerate(rows):
                        xv = builder.load(_at2(builder, xa, row, xi))
                        acc[m][k] = _dpbusd(builder, acc[m][k], qv, _splat(builder, xv, V16I))
            for k, s in enumerate(groups):
                sc = builder.sext(_vload(builder, builder.gep(p, [_c64(3072 + 16 * s)]), V16B), V16I)
                for m in range(len(rows)):
                    isum[m] = builder.add(isum[m], builder.mul(acc[m][k], sc))
    d = builder.fpext(_vload(builder, builder.gep(p, [_c64(3328)]), V16H), V16F)
    for m, row in enumerate(rows):
        dxb = _splat(builder, builder.load(_at2(builder, da, row, b)), V16F)
        part = builder.fmul(d, builder.sitofp(isum[m], V16F))
        builder.store(builder.fadd(builder.load(accs[m]), builder.fmul(part, dxb), flags=("contract",)), accs[m])


TILE_BYTES = {"q5_0": 352, "q8_0": 544, "q4_k": 2368, "q6_k": 3360}
TILE_B_Q4_K, TILE_B_Q6_K, TILE_B_Q8_0 = TILE_BYTES["q4_k"], TILE_BYTES["q6_k"], TILE_BYTES["q8_0"]
# Rows per multi-row kernel call: weights decoded once serve this many activation rows. Measured
# best on the dev box: 4 keeps every accumulator of Q5_0/Q8_0/Q6_K in the 32 vector registers;
# Q4_K holds 2 accumulators per row per sub-block pair and spills beyond 2.
MR_Q5_0, MR_Q8_0, MR_Q4_K, MR_Q6_K = 4, 4, 2, 4
q5_0_tile16, q5_0_tile16_mr = _tile_kernel("q5_0", 1, _q5_0_block), _tile_kernel("q5_0", MR_Q5_0, _q5_0_block)
q8_0_tile16, q8_0_tile16_mr = _tile_kernel("q8_0", 1, _q8_0_block), _tile_kernel("q8_0", MR_Q8_0, _q8_0_block)
q4_k_tile16, q4_k_tile16_mr = _tile_kernel("q4_k", 1, _q4_k_block), _tile_kernel("q4_k", MR_Q4_K, _q4_k_block)
q6_k_tile16, q6_k_tile16_mr = _tile_kernel("q6_k", 1, _q6_k_block), _tile_kernel("q6_k", MR_Q6_K, _q6_k_block)


@intrinsic
def q5_0_tile_as_q8_0(typingctx, tiles, t, dst):
    """dst[0] = tile t of a Q5_0 tile matrix in the Q8_0 tile layout: per block the 5-bit values
    (q + 16, unsigned) as 8 vectors [g][row][4 bytes], then the 16 f16 scales. The Q8_0 block
    kernel on dst, given Q5_0's block sums (-16 x sum x), makes exactly the Q5_0 kernel's integer
    and float operations; a long prompt decodes each tile once instead of once per MR rows."""
    sig = types.void(tiles, t, dst)

    def codegen(context, builder, signature, args):
        ta = context.make_array(signature.args[0])(context, builder, args[0])
        da = context.make_array(signature.args[2])(context, builder, args[2])
        t64 = _i64(builder, args[1])
        nb = builder.udiv(builder.extract_value(ta.shape, 1), _c64(TILE_BYTES["q5_0"]))
        src0 = builder.gep(ta.data, [builder.mul(t64, builder.mul(nb, _c64(TILE_BYTES["q5_0"])))])
        m0f, m10 = _vconst(V16I, 0x0F0F0F0F), _vconst(V16I, 0x10101010)
        with cgutils.for_range(builder, nb) as loop:
            p = builder.gep(src0, [builder.mul(loop.index, _c64(TILE_BYTES["q5_0"]))])
            q = builder.gep(da.data, [builder.mul(loop.index, _c64(TILE_BYTES["q8_0"]))])
            hb = _vload(builder, builder.gep(p, [_c64(256)]), V16I)
            for g in range(4):
                v = _vload(builder, builder.gep(p, [_c64(64 * g)]), V16I)
                lo = builder.or_(builder.and_(v, m0f), builder.and_(_shift(builder, hb, 4 - 2 * g), m10))
                hi = builder.or_(builder.and_(builder.lshr(v, _vconst(V16I, 4)), m0f),
                                 builder.and_(_shift(builder, hb, 3 - 2 * g), m10))
                builder.store(lo, builder.bitcast(builder.gep(q, [_c64(64 * g)]), V16I.as_pointer()), align=1)
                builder.store(hi, builder.bitcast(builder.gep(q, [_c64(256 + 64 * g)]), V16I.as_pointer()), align=1)
            scales = builder.load(builder.bitcast(builder.gep(p, [_c64(320)]), V16H.as_pointer()), align=1)
            builder.store(scales, builder.bitcast(builder.gep(q, [_c64(512)]), V16H.as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


def repack_q8_0_tiles(raw: np.ndarray, n_cols: int) -> np.ndarray:
    """GGUF Q8_0 data -> (ceil(N/16), nb*544) uint8 tiles; rows past N are zero. Per block: qs + 128
    as [g][row][4 bytes] (elements 4g..4g+3), then d [row] f16."""
    rows = _pad16(as_block_bytes(raw, Q8_0, n_cols))
    N, nb, T = rows.shape[0], n_cols // 32, rows.shape[0] // 16
    k = rows.reshape(N, nb, 34)
    qs = (k[..., 2:34] ^ np.uint8(0x80)).reshape(T, 16, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(T, nb, 512)
    d = k[..., 0:2].reshape(T, 16, nb, 2).transpose(0, 2, 1, 3).reshape(T, nb, 32)
    return np.ascontiguousarray(np.concatenate([qs, d], axis=-1).reshape(T, nb * 544))


def repack_q6_k_tiles(raw: np.ndarray, n_cols: int) -> np.ndarray:
    """GGUF Q6_K data -> (ceil(N/16), nb*3360) uint8 tiles; rows past N are zero. Per super-block,
    for half h and position p (r = 4p..4p+3): ql[64h+r] (A: elements r, r+64), ql[64h+32+r]
    (B: r+32, r+96), qh[32h+r] (their 2-bit highs), each [row][4 bytes]; then sc [16][row], d [row]."""
    rows = _pad16(as_block_bytes(raw, Q6_K, n_cols))
    N, nb, T = rows.shape[0], n_cols // 256, rows.shape[0] // 16
    k = rows.reshape(N, nb, 210)
    ql = k[..., 0:128].reshape(T, 16, nb, 2, 2, 8, 4).transpose(0, 2, 3, 5, 4, 1, 6)  # T nb h p AB row j
    qh = k[..., 128:192].reshape(T, 16, nb, 2, 1, 8, 4).transpose(0, 2, 3, 5, 4, 1, 6)  # T nb h p 1 row j
    q = np.concatenate([ql, qh], axis=4).reshape(T, nb, 3072)
    sc = k[..., 192:208].reshape(T, 16, nb, 16).transpose(0, 2, 3, 1).reshape(T, nb, 256)
    d = k[..., 208:210].reshape(T, 16, nb, 2).transpose(0, 2, 1, 3).reshape(T, nb, 32)
    return np.ascontiguousarray(np.concatenate([q, sc, d], axis=-1).reshape(T, nb * TILE_B_Q6_K))


def _pad16(rows: np.ndarray) -> np.ndarray:
    pad = -rows.shape[0] % 16
    return np.concatenate([rows, np.zeros((pad, rows.shape[1]), np.uint8)]) if pad else rows


def repack_q4_k_tiles(raw: np.ndarray, n_cols: int) -> np.ndarray:
    """GGUF Q4_K data -> (ceil(N/16), nb*2368) uint8 tiles; rows past N are zero. Per super-block:
    qs as [c][g][row][4 bytes] (bytes 4g..4g+3 of 32-byte group c: elements 64c+4g+j low nibble,
    64c+32+4g+j high nibble), then sc and mn as [sub-block][row] bytes, then d and dmin [row] f16."""
    rows = _pad16(as_block_bytes(raw, Q4_K, n_cols))
    N, nb, T = rows.shape[0], n_cols // 256, rows.shape[0] // 16
    k = rows.reshape(N, nb, 144)
    sc, mn = _k_scales(k[..., 4:16])  # (N, nb*8)
    qs = k[..., 16:144].reshape(T, 16, nb, 4, 8, 4).transpose(0, 2, 3, 4, 1, 5).reshape(T, nb, 2048)
    sc_t = sc.reshape(T, 16, nb, 8).transpose(0, 2, 3, 1).reshape(T, nb, 128)
    mn_t = mn.reshape(T, 16, nb, 8).transpose(0, 2, 3, 1).reshape(T, nb, 128)
    d_t = k[..., 0:2].reshape(T, 16, nb, 2).transpose(0, 2, 1, 3).reshape(T, nb, 32)
    dm_t = k[..., 2:4].reshape(T, 16, nb, 2).transpose(0, 2, 1, 3).reshape(T, nb, 32)
    return np.ascontiguousarray(np.concatenate([qs, sc_t, mn_t, d_t, dm_t], axis=-1).reshape(T, nb * TILE_B_Q4_K))


@intrinsic
def round_f16(typingctx, a):
    """float32 a rounded to the nearest float16, as float32 (numba has no float16 type)."""
    sig = types.float32(a)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.fptrunc(args[0], f16), f32)

    return sig, codegen


def _f16(a: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 little-endian half floats -> (...) float32 (exact)."""
    return np.ascontiguousarray(a).view(np.float16)[..., 0].astype(np.float32)


def _u8(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(a.shape[0], -1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K packed 6-bit scales (N, nb, 12) -> sc, mn (N, nb*8) uint8."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return _u8(sc), _u8(mn)


def as_block_bytes(raw: np.ndarray, ggml_type: int, n_cols: int) -> np.ndarray:
    """Any GGUFReader tensor.data (uint8 blocks or typed F32/F16/BF16) -> (n_rows, row_bytes) uint8."""
    if ggml_type not in SUPPORTED_TYPES:
        raise NotImplementedError(f"ggml type {TYPE_NAMES.get(ggml_type, ggml_type)} is not supported")
    blk, size = GGML_BLOCK[ggml_type]
    if n_cols % blk:
        raise ValueError(f"row length {n_cols} is not a multiple of the {TYPE_NAMES[ggml_type]} block ({blk})")
    row_bytes = n_cols // blk * size
    raw = np.ascontiguousarray(raw)
    b = raw.view(np.uint8).reshape(-1)
    if b.size % row_bytes:
        raise ValueError(f"{b.size} bytes is not a whole number of {row_bytes}-byte rows")
    return b.reshape(-1, row_bytes)


def repack(raw: np.ndarray, ggml_type: int, n_cols: int) -> tuple[np.ndarray, ...]:
    """Split the blocks of each row into contiguous per-field arrays (see module doc)."""
    b = as_block_bytes(raw, ggml_type, n_cols)
    n = b.shape[0]
    if ggml_type == F32:
        return (np.ascontiguousarray(b).view(np.float32),)
    if ggml_type in (F16, BF16):
        return (np.ascontiguousarray(b).view(np.uint16),)
    blk, size = GGML_BLOCK[ggml_type]
    nb = n_cols // blk
    k = b.reshape(n, nb, size)
    if ggml_type == Q4_0:
        return _f16(k[..., 0:2]), _u8(k[..., 2:18])
    if ggml_type == Q4_1:
        return _f16(k[..., 0:2]), _f16(k[..., 2:4]), _u8(k[..., 4:20])
    if ggml_type == Q5_0:
        qh = np.ascontiguousarray(k[..., 2:6]).view("<u4")[..., 0].astype(np.uint32)
        return _f16(k[..., 0:2]), qh, _u8(k[..., 6:22])
    if ggml_type == Q5_1:
        qh = np.ascontiguousarray(k[..., 4:8]).view("<u4")[..., 0].astype(np.uint32)
        return _f16(k[..., 0:2]), _f16(k[..., 2:4]), qh, _u8(k[..., 8:24])
    if ggml_type == Q8_0:
        return _f16(k[..., 0:2]), _u8(k[..., 2:34]).view(np.int8)
    if ggml_type == Q4_K:
        sc, mn = _k_scales(k[..., 4:16])
        return _f16(k[..., 0:2]), _f16(k[..., 2:4]), sc, mn, _u8(k[..., 16:144])
    if ggml_type == Q5_K:
        sc, mn = _k_scales(k[..., 4:16])
        return _f16(k[..., 0:2]), _f16(k[..., 2:4]), sc, mn, _u8(k[..., 16:48]), _u8(k[..., 48:176])
    if ggml_type == Q6_K:
        return _f16(k[..., 208:210]), _u8(k[..., 192:208]).view(np.int8), _u8(k[..., 0:128]), _u8(k[..., 128:192])
    raise NotImplementedError(TYPE_NAMES.get(ggml_type, ggml_type))


# --- exact dequantization of selected rows -------------------------------------------------
# Each kernel writes out[i, :] = row rows[i]. No fastmath: gguf-py's rounding order is kept
# (e.g. Q4_K is (d*sc)*q - (dmin*m), two roundings, no FMA).

@njit(parallel=True, cache=True, error_model="numpy")
def _deq_f32(w, rows, out):
    for i in prange(rows.shape[0]):
        out[i, :] = w[rows[i], :]


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_f16(w, lut, rows, out):
    for i in prange(rows.shape[0]):
        r = rows[i]
        for j in range(w.shape[1]):
            out[i, j] = lut[w[r, j]]


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_bf16(w, rows, out):
    bits = out.view(np.uint32)
    for i in prange(rows.shape[0]):
        r = rows[i]
        for j in range(w.shape[1]):
            bits[i, j] = np.uint32(w[r, j]) << np.uint32(16)


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_q4_0(d, qs, rows, out):
    for i in prange(rows.shape[0]):
        r = rows[i]
        for b in range(d.shape[1]):
            s = d[r, b]
            for l in range(16):
                v = qs[r, b * 16 + l]
                out[i, b * 32 + l] = s * np.float32(np.int32(v & 15) - 8)
                out[i, b * 32 + 16 + l] = s * np.float32(np.int32(v >> 4) - 8)


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_q4_1(d, m, qs, rows, out):
    for i in prange(rows.shape[0]):
        r = rows[i]
        for b in range(d.shape[1]):
            s = d[r, b]
            mm = m[r, b]
            for l in range(16):
                v = qs[r, b * 16 + l]
                out[i, b * 32 + l] = s * np.float32(v & 15) + mm
                out[i, b * 32 + 16 + l] = s * np.float32(v >> 4) + mm


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_q5_0(d, qh, qs, rows, out):
    for i in prange(rows.shape[0]):
        r = rows[i]
        for b in range(d.shape[1]):
            s = d[r, b]
            h = qh[r, b]
            for l in range(16):
                v = qs[r, b * 16 + l]
                q0 = np.int32(v & 15) | np.int32(((h >> np.uint32(l)) & np.uint32(1)) << np.uint32(4))
                q1 = np.int32(v >> 4) | np.int32(((h >> np.uint32(l + 16)) & np.uint32(1)) << np.uint32(4))
                out[i, b * 32 + l] = s * np.float32(q0 - 16)
                out[i, b * 32 + 16 + l] = s * np.float32(q1 - 16)


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_q5_1(d, m, qh, qs, rows, out):
    for i in prange(rows.shape[0]):
        r = rows[i]
        for b in range(d.shape[1]):
            s = d[r, b]
            mm = m[r, b]
            h = qh[r, b]
            for l in range(16):
                v = qs[r, b * 16 + l]
                q0 = np.int32(v & 15) | np.int32(((h >> np.uint32(l)) & np.uint32(1)) << np.uint32(4))
                q1 = np.int32(v >> 4) | np.int32(((h >> np.uint32(l + 16)) & np.uint32(1)) << np.uint32(4))
                out[i, b * 32 + l] = s * np.float32(q0) + mm
                out[i, b * 32 + 16 + l] = s * np.float32(q1) + mm


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_q8_0(d, qs, rows, out):
    for i in prange(rows.shape[0]):
        r = rows[i]
        for b in range(d.shape[1]):
            s = d[r, b]
            for l in range(32):
                out[i, b * 32 + l] = np.float32(qs[r, b * 32 + l]) * s


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_q4_k(d, dmin, sc, mn, qs, rows, out):
    for i in prange(rows.shape[0]):
        r = rows[i]
        for b in range(d.shape[1]):
            for c in range(4):
                j = b * 8 + 2 * c
                d0 = d[r, b] * np.float32(sc[r, j])
                d1 = d[r, b] * np.float32(sc[r, j + 1])
                m0 = dmin[r, b] * np.float32(mn[r, j])
                m1 = dmin[r, b] * np.float32(mn[r, j + 1])
                for l in range(32):
                    v = qs[r, b * 128 + c * 32 + l]
                    out[i, b * 256 + c * 64 + l] = d0 * np.float32(v & 15) - m0
                    out[i, b * 256 + c * 64 + 32 + l] = d1 * np.float32(v >> 4) - m1


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_q5_k(d, dmin, sc, mn, qh, qs, rows, out):
    for i in prange(rows.shape[0]):
        r = rows[i]
        for b in range(d.shape[1]):
            for c in range(4):
                j = b * 8 + 2 * c
                d0 = d[r, b] * np.float32(sc[r, j])
                d1 = d[r, b] * np.float32(sc[r, j + 1])
                m0 = dmin[r, b] * np.float32(mn[r, j])
                m1 = dmin[r, b] * np.float32(mn[r, j + 1])
                for l in range(32):
                    v = qs[r, b * 128 + c * 32 + l]
                    h = qh[r, b * 32 + l]
                    q0 = (v & 15) | (((h >> (2 * c)) & 1) << 4)
                    q1 = (v >> 4) | (((h >> (2 * c + 1)) & 1) << 4)
                    out[i, b * 256 + c * 64 + l] = d0 * np.float32(q0) - m0
                    out[i, b * 256 + c * 64 + 32 + l] = d1 * np.float32(q1) - m1


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_q6_k(d, sc, ql, qh, rows, out):
    # element e = b*256 + h*128 + r7 (h half, r7 in 0..127): low 4 bits from ql[h*64 + r7%64]
    # (nibble r7//64), high 2 bits from qh[h*32 + r7%32] (shift 2*(r7//32)); scale e//16.
    for i in prange(rows.shape[0]):
        r = rows[i]
        for b in range(d.shape[1]):
            for h in range(2):
                for s in range(4):
                    for l in range(32):
                        e = h * 128 + s * 32 + l
                        lo = ql[r, b * 128 + h * 64 + (s & 1) * 32 + l]
                        if s >= 2:
                            lo = lo >> 4
                        hi = (qh[r, b * 64 + h * 32 + l] >> (2 * s)) & 3
                        q = np.int32((lo & 15) | (hi << 4)) - 32
                        scale = d[r, b] * np.float32(sc[r, b * 16 + e // 16])
                        out[i, b * 256 + e] = scale * np.float32(q)


def dequantize_rows(packed: tuple[np.ndarray, ...], ggml_type: int, n_cols: int, rows: np.ndarray) -> np.ndarray:
    """Rows `rows` of a repacked matrix -> float32 (len(rows), n_cols)."""
    rows = np.ascontiguousarray(rows, dtype=np.int64).reshape(-1)
    out = np.empty((rows.shape[0], n_cols), dtype=np.float32)
    if rows.shape[0] == 0:
        return out
    n_rows = packed[0].shape[0]
    if rows.min() < 0 or rows.max() >= n_rows:
        raise IndexError(f"row index out of range [0, {n_rows})")
    table = _DEQ if out.size >= ops.PAR_MIN else _DEQ_SERIAL  # e.g. one embedding row: no thread pool
    if ggml_type == F16:
        table[F16](packed[0], F16_LUT, rows, out)
    else:
        table[ggml_type](*packed, rows, out)
    return out


_DEQ = {
    F32: _deq_f32, F16: _deq_f16, BF16: _deq_bf16, Q4_0: _deq_q4_0, Q4_1: _deq_q4_1, Q5_0: _deq_q5_0,
    Q5_1: _deq_q5_1, Q8_0: _deq_q8_0, Q4_K: _deq_q4_k, Q5_K: _deq_q5_k, Q6_K: _deq_q6_k,
}
_DEQ_SERIAL = {t: serial_twin(k) for t, k in _DEQ.items()}


def dequantize(raw: np.ndarray, ggml_type: int, n_cols: int) -> np.ndarray:
    """GGUF tensor data (uint8 blocks, or typed F32/F16/BF16) -> float32 (n_rows, n_cols)."""
    packed = repack(raw, ggml_type, n_cols)
    n_rows = packed[0].shape[0]
    return dequantize_rows(packed, ggml_type, n_cols, np.arange(n_rows))
