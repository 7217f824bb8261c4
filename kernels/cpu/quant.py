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
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from kernels.cpu import ops
from kernels.cpu.ops import serial_twin
from kernels.types import (BF16, F16, F32, IQ4_NL, IQ4_NL_VALUES, IQ4_XS, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1,
                           Q5_K, Q6_K, Q8_0, SUPPORTED, TRAITS)

# views of the type table (kernels.types): type id -> (elements per block, bytes per block), names
GGML_BLOCK: dict[int, tuple[int, int]] = {t: (tr.block, tr.size) for t, tr in TRAITS.items()}
SUPPORTED_TYPES: frozenset[int] = SUPPORTED
TYPE_NAMES: dict[int, str] = {t: tr.name for t, tr in TRAITS.items()}

# f16 bit pattern -> f32, exact by construction; 256 KiB, stays in L2 for F16 kernels.
F16_LUT = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@intrinsic
def round_f16(typingctx, a):
    """float32 a rounded to the nearest float16, as float32 (numba has no float16 type)."""
    sig = types.float32(a)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())

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
    if ggml_type in (Q4_0, IQ4_NL):
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
    if ggml_type == Q2_K:                 # scale bytes as stored (low nibble scale, high minimum)
        return _f16(k[..., 80:82]), _f16(k[..., 82:84]), _u8(k[..., 0:16]), _u8(k[..., 16:80])
    if ggml_type == Q3_K:
        return _f16(k[..., 108:110]), _q3_k_scales(k[..., 96:108]), _u8(k[..., 0:32]), _u8(k[..., 32:96])
    if ggml_type == IQ4_XS:
        return _f16(k[..., 0:2]), _iq4_xs_scales(k[..., 2:8]), _u8(k[..., 8:136])
    raise NotImplementedError(TYPE_NAMES.get(ggml_type, ggml_type))


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K packed 6-bit scales (N, nb, 12) -> (N, nb*16) int8, -32..31: scale j has low 4 bits
    from nibble j // 8 of byte j % 8, high 2 bits at shift 2*(j // 4) of byte 8 + j % 4."""
    s = s.astype(np.int16)
    lo = np.concatenate([s[..., 0:8] & 15, s[..., 0:8] >> 4], -1)
    hi = (s[..., None, 8:12] >> (2 * np.arange(4, dtype=np.int16))[:, None]) & 3
    return _u8((lo | (hi.reshape(lo.shape) << 4)) - 32).astype(np.int8)


def _iq4_xs_scales(s: np.ndarray) -> np.ndarray:
    """IQ4_XS scales_h (u16) + scales_l[4] (N, nb, 6) -> (N, nb*8) int8, -32..31."""
    s = s.astype(np.int16)
    c = np.arange(8)
    sh = s[..., 0] | (s[..., 1] << 8)
    ls = ((s[..., 2 + c // 2] >> (4 * (c % 2))) & 15) | (((sh[..., None] >> (2 * c)) & 3) << 4)
    return _u8(ls - 32).astype(np.int8)


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
def _deq_iq4_nl(d, qs, rows, out):
    for i in prange(rows.shape[0]):
        r = rows[i]
        for b in range(d.shape[1]):
            s = d[r, b]
            for l in range(16):
                v = qs[r, b * 16 + l]
                out[i, b * 32 + l] = s * np.float32(IQ4_NL_VALUES[v & 15])
                out[i, b * 32 + 16 + l] = s * np.float32(IQ4_NL_VALUES[v >> 4])


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


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_q2_k(d, dmin, sc, qs, rows, out):
    # element e = b*256 + h*128 + s*32 + l: 2 bits at shift 2s of qs[b*64 + h*32 + l]; scale and
    # minimum of e // 16 (gguf-py: (d*sc)*q - dmin*mn)
    for i in prange(rows.shape[0]):
        r = rows[i]
        for b in range(d.shape[1]):
            for j in range(16):
                v = sc[r, b * 16 + j]
                dl = d[r, b] * np.float32(v & 15)
                ml = dmin[r, b] * np.float32(v >> 4)
                h, s, l0 = j // 8, (j % 8) // 2, (j % 2) * 16
                for l in range(16):
                    q = (qs[r, b * 64 + h * 32 + l0 + l] >> (2 * s)) & 3
                    out[i, b * 256 + j * 16 + l] = dl * np.float32(q) - ml


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_q3_k(d, sc, hm, qs, rows, out):
    # element e = b*256 + h*128 + s*32 + l: low 2 bits at shift 2s of qs[b*64 + h*32 + l], third bit
    # bit 4h + s of hm[b*32 + l] (clear: -4); scale e // 16 (gguf-py: (d*sc)*q)
    for i in prange(rows.shape[0]):
        r = rows[i]
        for b in range(d.shape[1]):
            for j in range(16):
                dl = d[r, b] * np.float32(sc[r, b * 16 + j])
                h, s, l0 = j // 8, (j % 8) // 2, (j % 2) * 16
                for l in range(16):
                    q = np.int32((qs[r, b * 64 + h * 32 + l0 + l] >> (2 * s)) & 3)
                    q += 4 * np.int32((hm[r, b * 32 + l0 + l] >> (4 * h + s)) & 1) - 4
                    out[i, b * 256 + j * 16 + l] = dl * np.float32(q)


@njit(parallel=True, cache=True, error_model="numpy")
def _deq_iq4_xs(d, sc, qs, rows, out):
    for i in prange(rows.shape[0]):
        r = rows[i]
        for b in range(d.shape[1]):
            for c in range(8):
                dl = d[r, b] * np.float32(sc[r, b * 8 + c])
                for l in range(16):
                    v = qs[r, b * 128 + c * 16 + l]
                    out[i, b * 256 + c * 32 + l] = dl * np.float32(IQ4_NL_VALUES[v & 15])
                    out[i, b * 256 + c * 32 + 16 + l] = dl * np.float32(IQ4_NL_VALUES[v >> 4])


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
    Q5_1: _deq_q5_1, Q8_0: _deq_q8_0, Q4_K: _deq_q4_k, Q5_K: _deq_q5_k, Q6_K: _deq_q6_k, IQ4_NL: _deq_iq4_nl,
    Q2_K: _deq_q2_k, Q3_K: _deq_q3_k, IQ4_XS: _deq_iq4_xs,
}
_DEQ_SERIAL = {t: serial_twin(k) for t, k in _DEQ.items()}


def dequantize(raw: np.ndarray, ggml_type: int, n_cols: int) -> np.ndarray:
    """GGUF tensor data (uint8 blocks, or typed F32/F16/BF16) -> float32 (n_rows, n_cols)."""
    packed = repack(raw, ggml_type, n_cols)
    n_rows = packed[0].shape[0]
    return dequantize_rows(packed, ggml_type, n_cols, np.arange(n_rows))
