"""Attention over a paged KV cache, numba.

Cache per layer: k_cache, v_cache (n_blocks, block_size, n_kv_heads, head_dim) float16, as
llama.cpp keeps K and V (the kernels see uint16 bits, numba has no float16). A sequence's
block_table maps logical block i (positions i*bs .. i*bs+bs-1) to a physical block. Key j is
visible to the query at position p iff j <= p and, with window > 0, p - j < window (llama.cpp's
is_masked_swa masks p - j >= n_swa).

Two softmaxes:
- "llama.cpp" (the default): llama.cpp's attention without flash attention, bit for bit (AVX2
  build): the scores are float16 matrix products of K and the float16-rounded Q; ggml's soft_max
  scales them, takes the exact max, ggml_v_expf, sums 8-key chunks (hsum_float_8) in float64 and
  multiplies by float32(1/sum); the probabilities, rounded to float16, weight V in a second
  float16 product. For a batch of queries both products follow tinyBLAS (8 lanes per output,
  hsum at the end), for one query ggml_vec_dot_f16 (4 x 8 lanes, its own reduction); the inner
  loops are in attention_avx2. A prefill tile keeps its rows' scores over all the keys they see
  (at most SCORES_BYTES_MAX; never the whole T x N matrix), because each probability needs its
  row's final max and sum before it can be rounded.
- "online" (attention_online): flash attention and flash-decoding, a running max and sum per row
  and rescaled partial outputs, merged across splits by log-sum-exp; float32 probabilities.
"""
from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
from numba import njit, prange

from kernels.cpu.attention_tiles import prefetch_rows
from kernels.cpu.attention_online import (decode_partial, decode_partial_serial, decode_partial_v, decode_partial_v_serial,
                                         merge_splits, prefill_online, prefill_online_serial)
from kernels.cpu import ops
from kernels.cpu.attention_avx2 import (PV_DIMS, PV_HEAD_STRIDE, PV_TILE, TB512_RN, pair_rows8, tb_1x1_f32, tb_1x4_f32, tb_2x1_f32, tb_2x4_f32, tb_4x3_f32, vd_dot_heads, vd_pv_tile,
                                        scale_max8, tb512_1x1, tb512_1xn, tb512_2x1, tb512_2xn, widen8, widen_transpose8)
from kernels.cpu.ops import f16_bits, f16_value, ggml_expf, pick, serial_twin, soft_cap
from kernels.cpu.quant import round_f16
from kernels.cpu.simd import WIDE

# Decode attention reads each key's K and V rows once, from memory where the weights streaming past
# have evicted the layer's cache, a 4 KB cache block per 16 keys (qwen 0.5B's heads) where the
# hardware prefetchers start over; so the kernels prefetch the rows this many keys ahead. It pays
# where the reads wait on memory, not where attention is compute (README: measured).
PREFETCH_KEYS = 32


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


@njit(parallel=True, cache=True, error_model="numpy")
def _write_kv_slots(k_cache, v_cache, slots, k, v):
    """k, v (T, Hkv, hd) float32 -> the float16 cache cells slots[t] (physical block * bs + offset)."""
    bs = k_cache.shape[1]
    for t in prange(k.shape[0]):
        blk, off = slots[t] // bs, slots[t] % bs
        for h in range(k.shape[1]):
            for e in range(k.shape[2]):
                k_cache[blk, off, h, e] = f16_bits(k[t, h, e])
                v_cache[blk, off, h, e] = f16_bits(v[t, h, e])


_write_kv_slots_serial = serial_twin(_write_kv_slots)


def write_kv_slots(k_cache, v_cache, slots, k, v) -> None:
    """Store k, v (T, Hkv, hd), rounded to float16, in the cache cells `slots` (T,) (block_slots gives
    them): the rows of several sequences in one call."""
    if k.shape[0] != slots.shape[0]:
        raise ValueError(f"{k.shape[0]} rows for {slots.shape[0]} slots")
    if k_cache.dtype != np.float16 or v_cache.dtype != np.float16:
        raise TypeError(f"KV cache must be float16, got {k_cache.dtype} / {v_cache.dtype}")
    kernel = pick(_write_kv_slots, _write_kv_slots_serial, k.size)
    kernel(k_cache.view(np.uint16), v_cache.view(np.uint16), np.ascontiguousarray(slots, np.int64),
           np.ascontiguousarray(k, np.float32), np.ascontiguousarray(v, np.float32))


def block_slots(block_table, start_pos: int, n: int, block_size: int) -> np.ndarray:
    """The cache cells (physical block * block_size + offset) of positions start_pos .. start_pos+n-1."""
    pos = np.arange(start_pos, start_pos + n, dtype=np.int64)
    if n and (start_pos + n - 1) // block_size >= len(block_table):
        raise ValueError(f"positions up to {start_pos + n - 1} need more than {len(block_table)} blocks")
    return np.asarray(block_table, np.int64)[pos // block_size] * block_size + pos % block_size


# No fastmath here nor in any caller: numba compiles a function called from a fastmath function
# with the caller's flags (measured: reassociated sums), and these roundings are llama.cpp's.
@njit(cache=True, error_model="numpy", inline="always")
def _softmax_row(S, i0, n, key0, lo, hi, scale, softcap):
    """ggml's soft_max of one row in place: S[i0 : i0+n] holds the scores of keys key0 .. key0+n-1
    (key0 % 8 == 0); keys outside [lo, hi] are masked. With softcap > 0 (gemma2) the visible scores
    are first soft-capped as llama.cpp's graph does it: s * (1/softcap), tanhf, times softcap (three
    float32 roundings; numba's float32 math.tanh is libm's tanhf). x = s * scale (-inf where masked), e =
    ggml_expf(x - max), the sum in float64 of each 8-key chunk's hsum_float_8, then every entry
    becomes float16(e * float32(1 / sum)) (the rounding of the float16 product that follows)."""
    a = min(max(lo - key0, 0), n)                  # visible: S[i0 + a : i0 + b]
    b = max(min(hi - key0 + 1, n), a)
    a8 = min((a + 7) // 8 * 8, b)                   # [a8, b8): whole 8-lane steps
    b8 = max(a8, b // 8 * 8)
    if softcap > 0:
        soft_cap(S, i0 + a, i0 + b, softcap)
    m = np.float32(-np.inf)
    for jj in range(a, a8):
        S[i0 + jj] *= scale
        m = max(m, S[i0 + jj])
    m = scale_max8(S, i0 + a8, b8 - a8, scale, m)
    for jj in range(b8, b):
        S[i0 + jj] *= scale
        m = max(m, S[i0 + jj])
    row = S[i0:i0 + n]            # loops over a view: no per-index offset arithmetic
    for jj in range(a):
        row[jj] = np.float32(-np.inf)
    for jj in range(b, n):
        row[jj] = np.float32(-np.inf)
    for jj in range(n):
        row[jj] = ggml_expf(row[jj] - m)
    tot = 0.0
    for c in range(0, n, 8):
        e = row[c:c + 8]
        tot += np.float64(((e[4] + e[0]) + (e[6] + e[2])) + ((e[5] + e[1]) + (e[7] + e[3])))
    inv = np.float32(1.0 / tot) if tot > 0 else np.float32(0.0)
    for jj in range(n):
        row[jj] = round_f16(row[jj] * inv)


@njit(cache=True, error_model="numpy")
def _softmax_rows(S, R, span, k_lo, lo_pos, pos, scale, softcap):
    """_softmax_row for each of a tile's R rows (row i: keys lo_pos[i] .. pos[i] visible). A
    function of its own, not inlined: inlined into _prefill_tile, LLVM left its loops scalar."""
    for i in range(R):
        _softmax_row(S, i * span, span, k_lo, lo_pos[i], pos[i], scale, softcap)


# The scores sweep the keys in blocks of about this many bytes of widened K, each block for all of
# a tile's rows: the block stays in L1 while every row pair reads it (sweeping all keys per row
# pair streamed K from L2 at about the pace of the FMAs, leaving them waiting).
SCORE_BLOCK_BYTES = 16 << 10


@njit(cache=True, error_model="numpy", inline="always")
def _tile_scores(qbuf, R, hd, kw, pos, lo_pos, k_lo, span, S):
    """S[i, j - k_lo] = tinyBLAS dot of query row i and key j (kw: the kv head's keys widened to
    float32, (keys, hd)), for every key a row pair can see (the rest of S stays garbage:
    _softmax_row masks it). The keys are swept in blocks, each read by every row pair while in L1."""
    kb_len = max(4, SCORE_BLOCK_BYTES // (4 * hd))
    q2 = np.empty(((R + 1) // 2) * 2 * hd if WIDE else 0, np.float32)
    if WIDE:
        pair_rows8(qbuf, 0, hd, R, hd, q2)
    j_end = pos[R - 1] + 1                              # rows go up in position: the last sees most
    for kb in range(lo_pos[0], j_end, kb_len):
        kb_end = min(j_end, kb + kb_len)
        if WIDE:
            _tile_scores512(q2, R, hd, kw, kb, kb_end, pos, lo_pos, k_lo, span, S)
            continue
        for i in range(0, R, 2):
            pair = min(2, R - i)
            j = max(lo_pos[i], kb)
            j_hi = min(pos[i + pair - 1], kb_end - 1)
            while j + 4 <= j_hi + 1:
                if pair == 2:
                    tb_2x4_f32(qbuf, i * hd, hd, kw, j * hd, hd, hd, S, i * span + j - k_lo, span)
                else:
                    tb_1x4_f32(qbuf, i * hd, hd, kw, j * hd, hd, hd, S, i * span + j - k_lo, span)
                j += 4
            while j <= j_hi:
                if pair == 2:
                    tb_2x1_f32(qbuf, i * hd, hd, kw, j * hd, hd, hd, S, i * span + j - k_lo, span)
                else:
                    tb_1x1_f32(qbuf, i * hd, hd, kw, j * hd, hd, hd, S, i * span + j - k_lo, span)
                j += 1


@njit(cache=True, error_model="numpy", inline="always")
def _tb512_sweep(A2, ia, pstride, B, ib, ldb, L, C, ic, ldc, rows, n):
    """A group of `rows` <= 4 paired rows (A2 from pair_rows8) times n rows of B (ib, ib + ldb, ...)
    on 512-bit registers, into C's columns ic .. ic + n - 1: TB512_RN of B's rows at a time, then one."""
    c = 0
    while c + TB512_RN <= n:
        if rows > 2:
            tb512_2xn(A2, ia, pstride, B, ib + c * ldb, ldb, L, C, ic + c, ldc, rows)
        else:
            tb512_1xn(A2, ia, pstride, B, ib + c * ldb, ldb, L, C, ic + c, ldc, rows)
        c += TB512_RN
    while c < n:
        if rows > 2:
            tb512_2x1(A2, ia, pstride, B, ib + c * ldb, ldb, L, C, ic + c, ldc, rows)
        else:
            tb512_1x1(A2, ia, pstride, B, ib + c * ldb, ldb, L, C, ic + c, ldc, rows)
        c += 1


@njit(cache=True, error_model="numpy", inline="always")
def _tile_scores512(q2, R, hd, kw, kb, kb_end, pos, lo_pos, k_lo, span, S):
    """_tile_scores' products for one block of keys on 512-bit registers: groups of 4 query rows
    (two to a register, q2 from pair_rows8) x the keys of the block each group sees."""
    for i in range(0, R, 4):
        rows = min(4, R - i)
        j = max(lo_pos[i], kb)
        j_hi = min(pos[i + rows - 1], kb_end - 1)
        _tb512_sweep(q2, i * hd, 2 * hd, kw, j * hd, hd, hd, S, i * span + j - k_lo, span, rows, j_hi + 1 - j)


@njit(cache=True, error_model="numpy", inline="always")
def _tile_pv512(S, R, span, vt, ld, hd, pos, lo_pos, k_lo, obuf):
    """_tile_pv on 512-bit registers: the probabilities two rows to a register (pair_rows8), groups
    of 4 rows x every head dim over the 8-key chunks the group sees."""
    S2 = np.empty(((R + 1) // 2) * 2 * span, np.float32)
    pair_rows8(S, 0, span, R, span, S2)
    for i in range(0, R, 4):
        rows = min(4, R - i)
        c_lo = (lo_pos[i] - k_lo) // 8 * 8
        c_hi = min(span, (pos[i + rows - 1] - k_lo) // 8 * 8 + 8)
        _tb512_sweep(S2, i * span + 2 * c_lo, 2 * span, vt, k_lo + c_lo, ld, c_hi - c_lo, obuf, i * hd, hd, rows, hd)


@njit(cache=True, error_model="numpy", inline="always")
def _tile_pv(S, R, span, vt, ld, hd, pos, lo_pos, k_lo, obuf):
    """obuf[i, e] = tinyBLAS dot of row i's probabilities and V^T row e (vt (hd, ld): the kv head's
    values widened and transposed, keys from 0) over the 8-key chunks a
    group of rows sees (the other chunks hold zero probabilities: leaving them out is exact). Groups
    of 4 rows x 3 head dims (12 accumulators: the fma chains hide their latency), then the rest."""
    if WIDE:
        _tile_pv512(S, R, span, vt, ld, hd, pos, lo_pos, k_lo, obuf)
        return
    i = 0
    while i < R:
        rows = 4 if i + 4 <= R else min(2, R - i)
        c_lo = (lo_pos[i] - k_lo) // 8 * 8
        c_hi = min(span, (pos[i + rows - 1] - k_lo) // 8 * 8 + 8)
        L = c_hi - c_lo
        e = 0
        if rows == 4:
            while e + 3 <= hd:
                tb_4x3_f32(S, i * span + c_lo, span, vt, e * ld + k_lo + c_lo, ld, L, obuf, i * hd + e, hd)
                e += 3
            for r in range(0, 4, 2):
                for e1 in range(e, hd):
                    tb_2x1_f32(S, (i + r) * span + c_lo, span, vt, e1 * ld + k_lo + c_lo, ld, L, obuf, (i + r) * hd + e1, hd)
        else:
            while e + 4 <= hd:
                if rows == 2:
                    tb_2x4_f32(S, i * span + c_lo, span, vt, e * ld + k_lo + c_lo, ld, L, obuf, i * hd + e, hd)
                else:
                    tb_1x4_f32(S, i * span + c_lo, span, vt, e * ld + k_lo + c_lo, ld, L, obuf, i * hd + e, hd)
                e += 4
            while e < hd:
                if rows == 2:
                    tb_2x1_f32(S, i * span + c_lo, span, vt, e * ld + k_lo + c_lo, ld, L, obuf, i * hd + e, hd)
                else:
                    tb_1x1_f32(S, i * span + c_lo, span, vt, e * ld + k_lo + c_lo, ld, L, obuf, i * hd + e, hd)
                e += 1
        i += rows


@njit(cache=True, error_model="numpy", inline="always")
def _prefill_tile(q, kw, vt, ld, Hkv, q_start, scale, softcap, window, kvh, t0, t1, out):
    """Query positions t0..t1-1 of kv head kvh's group (rows (t - t0) * G + g): scores, softmax and
    P@V with llama.cpp's batched arithmetic (kw, vt: the kv head's widened K and V^T, _widen_kv).
    Each row's result depends only on its own scores."""
    T, Hq, hd = q.shape
    G = Hq // Hkv
    R = (t1 - t0) * G
    qbuf = np.empty(R * hd, np.float32)
    pos = np.empty(R, np.int64)
    lo_pos = np.empty(R, np.int64)
    for t in range(t0, t1):
        for g in range(G):
            i = (t - t0) * G + g
            for e in range(hd):
                qbuf[i * hd + e] = q[t, kvh * G + g, e]
            pos[i] = q_start + t
            lo_pos[i] = max(0, q_start + t - window + 1) if window > 0 else 0
    k_lo = lo_pos[0] - lo_pos[0] % 8                    # chunks of 8 keys from key 0, as llama.cpp sums them
    k_hi = q_start + t1                                 # one past the last visible key
    span = (k_hi - k_lo + 7) // 8 * 8
    S = np.empty(R * span, np.float32)
    _tile_scores(qbuf, R, hd, kw, pos, lo_pos, k_lo, span, S)
    _softmax_rows(S, R, span, k_lo, lo_pos, pos, scale, softcap)
    obuf = np.empty(R * hd, np.float32)
    _tile_pv(S, R, span, vt, ld, hd, pos, lo_pos, k_lo, obuf)
    for t in range(t0, t1):
        for g in range(G):
            i = (t - t0) * G + g
            for e in range(hd):
                out[t, kvh * G + g, e] = obuf[i * hd + e]


# The prompt's K and V^T widened to float32 once per kv head, for every query tile to read, at most
# this many bytes at a time (kv heads in groups; at least one).
WIDE_KV_BYTES = 64 << 20


@njit(cache=True, error_model="numpy", inline="always")
def _widen_kv(kf, vf, Hkv, bs, block_table, kvh, c, kw, vt, ld):
    """Keys 8c .. 8c+7 (those below kw's rows) of kv head kvh from the float16 cache: K rows into kw
    (keys, hd) and V^T columns into vt (hd, ld), exactly; the last chunk also zeroes vt's columns
    past the keys (P.V's 8-key steps read them, times probabilities of zero)."""
    NK, hd = kw.shape
    kstride = Hkv * hd
    j = 8 * c
    if bs % 8 == 0 and j + 8 <= NK:                     # 8 keys x 8 dims at a time, within one cache block
        base = (block_table[j // bs] * bs + j % bs) * kstride + kvh * hd
        for e in range(0, hd, 8):
            widen_transpose8(vf, base + e, kstride, vt.reshape(-1), e * ld + j, ld)
        for r in range(8):
            widen8(kf, base + r * kstride, kw.reshape(-1), (j + r) * hd, hd)
        return
    for jj in range(j, min(j + 8, NK)):
        base = (block_table[jj // bs] * bs + jj % bs) * kstride + kvh * hd
        for e in range(hd):
            x = f16_value(vf[base + e])
            vt[e, jj] = x
            kw[jj, e] = f16_value(kf[base + e])
    for jj in range(NK, min(j + 8, ld)):
        vt[:, jj] = 0.0


@njit(parallel=True, cache=True, error_model="numpy")
def _prefill(q, k_cache, v_cache, block_table, q_start, scale, softcap, window, q_tile, paired, kv_bytes, out):
    """paired: each work item takes query tiles p and n_tiles-1-p of one kv head. Under the causal
    mask a tile's cost grows with its position, so the threads' contiguous shares of the work
    items then cost the same. K and V^T are widened once per kv head (not once per tile: each
    tile reads all the keys before it), for as many kv heads at a time as kv_bytes holds."""
    T, _, hd = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    kf, vf = k_cache.reshape(-1), v_cache.reshape(-1)
    NK = q_start + T
    ld = (NK + 7) // 8 * 8
    HG = max(1, min(Hkv, kv_bytes // (8 * ld * hd)))
    kw = np.empty((HG, NK, hd), np.float32)
    vt = np.empty((HG, hd, ld), np.float32)
    n_tiles = (T + q_tile - 1) // q_tile
    n_items = (n_tiles + 1) // 2 if paired else n_tiles
    for h0 in range(0, Hkv, HG):
        nh = min(HG, Hkv - h0)
        n_chunks = ld // 8
        for w in prange(nh * n_chunks):
            _widen_kv(kf, vf, Hkv, bs, block_table, h0 + w // n_chunks, w % n_chunks, kw[w // n_chunks], vt[w // n_chunks], ld)
        for w in prange(nh * n_items):
            h = w // n_items
            tile = w % n_items
            t0 = tile * q_tile
            _prefill_tile(q, kw[h].reshape(-1), vt[h].reshape(-1), ld, Hkv, q_start, scale, softcap, window, h0 + h, t0,
                          min(T, t0 + q_tile), out)
            mirror = n_tiles - 1 - tile
            if paired and mirror != tile:
                t0 = mirror * q_tile
                _prefill_tile(q, kw[h].reshape(-1), vt[h].reshape(-1), ld, Hkv, q_start, scale, softcap, window, h0 + h, t0,
                              min(T, t0 + q_tile), out)


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


# A prefill tile keeps the scores of its rows over all the keys they see (rows x keys float32):
# at most this much, so a long context takes narrower tiles instead of an ever larger slab.
SCORES_BYTES_MAX = 2 << 20


def _choose_q_tile(T: int, n_q_heads: int, n_kv_heads: int, head_dim: int = 64, n_keys: int = 0) -> int:
    """Query positions per work item: tiles of up to ~256 rows (positions x GQA group) so the
    row-vectorized loops are long, but with the tile's queries (head_dim x rows float32) within
    64 KB (gemma's head_dim 256: 64 rows, faster at pp512 than larger tiles) and its scores (rows x n_keys)
    within SCORES_BYTES_MAX, as few tiles as that allows, of equal size (a short tail tile runs at
    a fraction of the speed), and at least one work item per thread."""
    group = n_q_heads // n_kv_heads
    rows_max = max(16, min(256, (64 << 10) // (4 * head_dim), SCORES_BYTES_MAX // (4 * max(1, n_keys))))
    tile_max = max(1, min(64, rows_max // group))
    n_tiles = -(-T // tile_max)
    while n_kv_heads * n_tiles < numba.get_num_threads() and n_tiles < T:
        n_tiles += 1
    return max(1, -(-T // n_tiles))


SOFTMAXES = ("llama.cpp", "online")


def _check_softmax(softmax: str) -> None:
    if softmax not in SOFTMAXES:
        raise ValueError(f"softmax must be one of {SOFTMAXES}, got {softmax!r}")


def attention_prefill(q, k_cache, v_cache, block_table, q_start: int, scale: float, window: int = 0,
                      q_tile: int = 0, softmax: str = "llama.cpp", softcap: float = 0.0, kv_bytes: int = WIDE_KV_BYTES):
    """q (T, Hq, hd) at positions q_start.. over keys 0..q_start+T-1 already in the cache -> (T, Hq, hd).

    softmax: "llama.cpp" (its rounding, see the module doc) or "online" (flash attention with a
    running max and sum in float32, attention_online). softcap: gemma2's score soft-capping (0: none).
    kv_bytes: the float32 copies of K and V^T the exact kernel makes at a time (WIDE_KV_BYTES)."""
    _check_softmax(softmax)
    q = np.ascontiguousarray(q, np.float32)
    _check_cache(q, k_cache, v_cache, block_table, q_start + q.shape[0])
    out = np.empty_like(q)
    online = softmax == "online" or not exact_head_dim(q.shape[2])
    if q_tile <= 0:  # (the online kernel holds one block of scores at a time: no cap from n_keys)
        q_tile = _choose_q_tile(q.shape[0], q.shape[1], k_cache.shape[2], q.shape[2],
                                0 if online else q_start + q.shape[0])
    if q.shape[0]:
        work = q.shape[0] * (q_start + q.shape[0]) * q.shape[1] * q.shape[2] // 16  # ~ MACs / 16
        kernel = (pick(prefill_online, prefill_online_serial, work) if online
                  else pick(_prefill, _prefill_serial, work))
        n_tiles = -(-q.shape[0] // q_tile)
        paired = k_cache.shape[2] * ((n_tiles + 1) // 2) >= numba.get_num_threads()
        args = (q, k_cache.view(np.uint16), v_cache.view(np.uint16), np.ascontiguousarray(block_table, np.int32),
                int(q_start), np.float32(scale), np.float32(softcap), int(window), int(q_tile), paired)
        if online:
            kernel(*args, out)
        else:
            kernel(*args, int(kv_bytes), out)
    return out


@njit(cache=True, error_model="numpy", inline="always")
def _next_cell(blk, off, bs):
    """The cache cell after (logical block blk, offset off): decode attention walks a sequence's
    keys cell by cell, without a division per key."""
    if off + 1 == bs:
        return blk + 1, 0
    return blk, off + 1


@njit(cache=True, error_model="numpy", inline="always")
def _key_scores(qf, q0, G, hd, kf, table, bs, kstride, koff, j0, j_end, key0, sf, s0, ld):
    """ggml_vec_dot_f16 scores of G query heads (qf[q0 + g*hd : +hd]) against the keys j0 .. j_end-1
    of a kv head (key j's row at kf[(table[j // bs]*bs + j % bs)*kstride + koff]) into
    sf[s0 + g*ld + j - key0], each key's row prefetched PREFETCH_KEYS ahead."""
    blk, off = j0 // bs, j0 % bs                   # key j's cache cell
    jp = j0 + PREFETCH_KEYS
    pblk, poff = jp // bs, jp % bs                 # and the one PREFETCH_KEYS ahead
    for j in range(j0, j_end):
        if jp < j_end:
            prefetch_rows(kf, (table[pblk] * bs + poff) * kstride + koff, kstride, 1, hd)
            jp += 1
            pblk, poff = _next_cell(pblk, poff, bs)
        base = (table[blk] * bs + off) * kstride + koff
        blk, off = _next_cell(blk, off, bs)
        vd_dot_heads(qf, q0, hd, G, kf, base, hd, sf, s0 + j - key0, ld)


@njit(parallel=True, cache=True, error_model="numpy")
def _decode_scores(q, k_cache, block_table, lo, hi, chunk, key0, S):
    """Decode scores S[h, j - key0] = ggml_vec_dot_f16(q[h], K[j]) for keys lo <= j < hi; work item
    (kv head, chunk of keys) takes the group's G query heads, so each K row is read once."""
    Hq, hd = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    kf = k_cache.reshape(-1)
    qf = q.reshape(-1)
    kstride = Hkv * hd
    G = Hq // Hkv
    n_splits = -(-(hi - lo) // chunk)
    sf = S.reshape(-1)
    for w in prange(Hkv * n_splits):
        kvh = w // n_splits
        j0 = lo + (w % n_splits) * chunk
        _key_scores(qf, kvh * G * hd, G, hd, kf, block_table, bs, kstride, kvh * hd, j0, min(hi, j0 + chunk), key0,
                    sf, kvh * G * S.shape[1], S.shape[1])


@njit(parallel=True, cache=True, error_model="numpy")
def _decode_softmax(S, key0, lo, hi, scale, softcap):
    """ggml's soft_max per head (row of S over keys key0.., key0 % 32 == 0; visible lo .. hi-1)."""
    for h in prange(S.shape[0]):
        _softmax_row(S[h], 0, S.shape[1], key0, lo, hi - 1, scale, softcap)


@njit(cache=True, error_model="numpy", inline="always")
def _pv_lane(a, lane, e):
    """Lane `lane` of GGML_F32x8_REDUCE's (s0+s2) + (s1+s3) for head dim e: accumulator j's lane is
    chain 8j + lane of vd_pv_tile (a: one head's chains, chain c at a[c*PV_DIMS ..])."""
    return (a[lane * PV_DIMS + e] + a[(16 + lane) * PV_DIMS + e]) + (a[(8 + lane) * PV_DIMS + e] + a[(24 + lane) * PV_DIMS + e])


@njit(cache=True, error_model="numpy", inline="always")
def _pv_reduce(acc, G, h0, e0, out):
    """GGML_F32x8_REDUCE of vd_pv_tile's 32 chains per head dim: out[h0+g, e0 .. e0+PV_DIMS]. The
    head dims are the innermost loop (no scratch array), so the compiler runs the tree on vectors
    of them."""
    for g in range(G):
        a = acc[g * PV_HEAD_STRIDE:g * PV_HEAD_STRIDE + 32 * PV_DIMS]
        for e in range(PV_DIMS):
            out[h0 + g, e0 + e] = ((_pv_lane(a, 0, e) + _pv_lane(a, 4, e)) + (_pv_lane(a, 1, e) + _pv_lane(a, 5, e))) + \
                ((_pv_lane(a, 2, e) + _pv_lane(a, 6, e)) + (_pv_lane(a, 3, e) + _pv_lane(a, 7, e)))


@njit(cache=True, error_model="numpy", inline="always")
def _pv_group(P, G, vf, block_table, bs, head_off, kstride, key0, hi, e0, acc, vbuf):
    """P@V chains of a kv head's G query heads (P's rows), head dims e0 .. e0+PV_DIMS-1, tile by
    tile of keys from key0 (key0 % 32 == 0) to hi > key0, into acc (see vd_pv_tile). Each key's V
    row is prefetched PREFETCH_KEYS ahead."""
    blk, off = key0 // bs, key0 % bs
    jp = key0 + PREFETCH_KEYS
    pblk, poff = jp // bs, jp % bs
    for t0 in range(key0, hi, PV_TILE):
        n = min(PV_TILE, hi - t0)
        for j in range(t0, t0 + n):
            if jp < hi:
                prefetch_rows(vf, (block_table[pblk] * bs + poff) * kstride + head_off + e0, kstride, 1, PV_DIMS)
                jp += 1
                pblk, poff = _next_cell(pblk, poff, bs)
            widen8(vf, (block_table[blk] * bs + off) * kstride + head_off + e0, vbuf, (j - t0) * PV_DIMS, PV_DIMS)
            blk, off = _next_cell(blk, off, bs)
        vd_pv_tile(P, G, t0 - key0, n, vbuf, acc, 1 if t0 == key0 else 0)


@njit(parallel=True, cache=True, error_model="numpy")
def _decode_pv(P, v_cache, block_table, key0, hi, out):
    """out[h] = ggml_vec_dot_f16 of the probabilities P[h] and each V column over the key cells:
    key j feeds accumulator (j % 32) // 8, lane j % 8, chains in steps of 32 keys, then
    GGML_F32x8_REDUCE. Key j's residue r = j % 32 is one chain per head dim (head dims in the
    vector lanes), and the 32 chains per dim are reduced in the same tree. Work items: (kv head,
    PV_DIMS head dims), for all the query heads of the group at once (each V row is widened once
    for them, vd_pv_tile)."""
    Hq, span = P.shape
    bs, Hkv, hd = v_cache.shape[1], v_cache.shape[2], v_cache.shape[3]
    vf = v_cache.reshape(-1)
    kstride = Hkv * hd
    G = Hq // Hkv
    n_e = hd // PV_DIMS
    for w in prange(Hkv * n_e):
        kvh = w // n_e
        e0 = (w % n_e) * PV_DIMS
        acc = np.empty(G * PV_HEAD_STRIDE, np.float32)
        vbuf = np.empty(PV_TILE * PV_DIMS, np.float32)
        _pv_group(P[kvh * G:(kvh + 1) * G], G, vf, block_table, bs, kvh * hd, kstride, key0, hi, e0, acc, vbuf)
        _pv_reduce(acc, G, kvh * G, e0, out)


_decode_scores_serial = serial_twin(_decode_scores)
_decode_softmax_serial = serial_twin(_decode_softmax)
_decode_pv_serial = serial_twin(_decode_pv)


@njit(parallel=True, cache=True, error_model="numpy")
def _decode_rows(q, k_cache, v_cache, tables, n_kvs, window, scale, softcap, out):
    """Many one-token queries at once, each over its own sequence's cache: query r (row r of q, at
    position n_kvs[r] - 1, block table tables[r]) gets exactly attention_decode's numbers (the same
    vd_dot_heads scores, _softmax_row and P@V chains; only the work is split differently: one
    item per (query, kv head)). Why: a batch step with 32 sequences otherwise pays 32 x 3 kernel
    launches per layer, most of the step for short contexts."""
    R, Hq, hd = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    kf = k_cache.reshape(-1)
    vf = v_cache.reshape(-1)
    qf = q.reshape(-1)
    kstride = Hkv * hd
    G = Hq // Hkv
    for w in prange(R * Hkv):
        r = w // Hkv
        kvh = w % Hkv
        hi = n_kvs[r]
        lo = max(0, hi - window) if window > 0 else 0
        key0 = lo - lo % 32
        width = (hi - key0 + 7) // 8 * 8
        table = tables[r]
        S = np.empty((G, width), np.float32)
        _key_scores(qf, (r * Hq + kvh * G) * hd, G, hd, kf, table, bs, kstride, kvh * hd, lo, hi, key0, S.reshape(-1),
                    0, width)
        _softmax_rows(S.reshape(-1), G, width, key0, np.full(G, lo, np.int64), np.full(G, hi - 1, np.int64), scale,
                      softcap)
        acc = np.empty(G * PV_HEAD_STRIDE, np.float32)
        vbuf = np.empty(PV_TILE * PV_DIMS, np.float32)
        for e0 in range(0, hd, PV_DIMS):
            _pv_group(S, G, vf, table, bs, kvh * hd, kstride, key0, hi, e0, acc, vbuf)
            _pv_reduce(acc, G, kvh * G, e0, out[r])


_decode_rows_serial = serial_twin(_decode_rows)


def attention_decode_rows(q, k_cache, v_cache, tables, n_kvs, scale: float, window: int = 0, softcap: float = 0.0):
    """Queries q (R, Hq, hd), query r at position n_kvs[r] - 1 of the sequence whose block table is
    tables[r] (R, max blocks; rows padded), over its cached keys [0, n_kvs[r]) -> (R, Hq, hd): for
    each row exactly what attention_decode (llama.cpp's softmax) gives it. Head dims: exact_head_dim."""
    q = np.ascontiguousarray(q, np.float32)
    n_kvs = np.ascontiguousarray(n_kvs, np.int64)
    tables = np.ascontiguousarray(tables, np.int32)
    if not exact_head_dim(q.shape[2]):
        raise ValueError(f"attention_decode_rows takes head dims that are a multiple of 64, got {q.shape[2]}")
    if k_cache.dtype != np.float16 or v_cache.dtype != np.float16:
        raise TypeError(f"KV cache must be float16, got {k_cache.dtype} / {v_cache.dtype}")
    if q.shape[0] != n_kvs.shape[0] or tables.shape[0] != n_kvs.shape[0]:
        raise ValueError("attention_decode_rows needs one block table and one length per query")
    if (n_kvs <= 0).any() or ((n_kvs - 1) // k_cache.shape[1] >= tables.shape[1]).any():
        raise ValueError("attention_decode_rows: a query's keys are not all in its block table")
    out = np.empty_like(q)
    lo = np.maximum(0, n_kvs - window) if window > 0 else np.zeros_like(n_kvs)
    work = int(((n_kvs - lo) * k_cache.shape[2]).sum()) * q.shape[2]
    kernel = pick(_decode_rows, _decode_rows_serial, work)
    kernel(q, k_cache.view(np.uint16), v_cache.view(np.uint16), tables, n_kvs, int(window), np.float32(scale),
           np.float32(softcap), out)
    return out


def _split_chunk(n_keys: int, n_splits: int, block_size: int, online: bool) -> int:
    """Keys per split when one query's n_keys split n_splits ways (the online kernels take whole
    cache blocks per split)."""
    n_splits = max(1, min(int(n_splits), n_keys))
    chunk = -(-n_keys // n_splits)
    if online and n_splits > 1 and chunk > block_size:
        chunk = -(-chunk // block_size) * block_size
    return chunk


def _choose_splits(n_keys: int, n_kv_heads: int, block_size: int) -> int:
    threads = numba.get_num_threads()
    want = max(1, -(-2 * threads // n_kv_heads))  # ~2 work items per thread
    most = max(1, n_keys // max(64, block_size))  # keep >= 64 keys per split
    return min(want, most)


# Decode rows in one parallel region (_decode_rows: an item per row and kv head) where those items
# keep every thread busy, or where no row's keys split anyway (a short context); elsewhere three
# regions per row (scores, softmax, P@V), split over the keys. The same bits either way; the fewer
# regions, the less a layer waits on their launches (README: measured). False: always the split
# kernels (the tests run both).
DECODE_TOGETHER = True


class AttentionPlan(NamedTuple):
    """Where a forward pass's rows look in the paged cache, for one attention window: made here from
    the cache's geometry, read by kernels.cpu.fused.layer. A row is either a decode row (a decode
    step, a speculative check, a batch's one-token sequence: each with the numbers it gets alone)
    or a row of a prompt segment (a sequence's chunk as llama.cpp evaluates a batch)."""
    slots: np.ndarray         # (T,) int64 the cache cell of each row's K and V
    online: bool              # flash attention (float32 probabilities): asked for, or a head dim the
                              # llama.cpp kernels do not take
    window: int
    rows: np.ndarray          # (R, 5) int64 the decode rows: row, keys it sees (its position + 1), its
                              # first visible key, keys per split (the threads' work items), where its
                              # scores start (ggml's f16 dot steps 32 keys from key 0)
    tables: np.ndarray        # (R, blocks) int32 their sequences' block tables (zero-padded)
    together: bool            # the decode rows in one call (_decode_rows), not one split call each
    segs: np.ndarray          # (S, 5) int64 prompt segments: first row, rows, first position, q tile, paired
    seg_tables: np.ndarray    # (S, blocks) int32 their block tables (zero-padded)


def _padded(tables: list) -> np.ndarray:
    out = np.zeros((len(tables), max((len(t) for t in tables), default=0)), np.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out


def attention_plan(segments, window: int, n_q_heads: int, n_kv_heads: int, head_dim: int, block_size: int,
                   softmax: str = "llama.cpp") -> AttentionPlan:
    """segments: (block_table, first position, rows, decode_rows) of each sequence's run of rows, in
    row order; their K and V go to the cache cells of those positions."""
    _check_softmax(softmax)
    online = softmax == "online" or not exact_head_dim(head_dim)
    threads = numba.get_num_threads()
    slots, rows, tables, n_kv, segs, seg_tables = [], [], [], [], [], []
    row = 0
    for table, start, n, decode_rows in segments:
        slots.append(block_slots(table, start, n, block_size))
        if decode_rows:
            rows.extend(range(row, row + n))
            tables.extend([table] * n)
            n_kv.extend(range(start + 1, start + n + 1))
        else:
            q_tile = _choose_q_tile(n, n_q_heads, n_kv_heads, head_dim, 0 if online else start + n)
            paired = n_kv_heads * ((-(-n // q_tile) + 1) // 2) >= threads
            segs.append((row, n, start, q_tile, paired))
            seg_tables.append(table)
        row += n
    n_kv = np.array(n_kv, np.int64)
    lo = np.maximum(0, n_kv - window) if window > 0 else np.zeros_like(n_kv)
    chunk = np.empty_like(n_kv)
    for i, (hi, first) in enumerate(zip(n_kv, lo)):
        n_keys = int(hi - first)
        # online: as attention_decode splits one row's keys (the merge's bits depend on it); llama.cpp's
        # softmax gives the same bits however the keys split, so they always split across the threads
        serial = online and n_keys * n_kv_heads * head_dim < ops.PAR_MIN
        chunk[i] = _split_chunk(n_keys, 1 if serial else _choose_splits(n_keys, n_kv_heads, block_size), block_size,
                                online)
    items = len(rows) * n_kv_heads
    short = bool(np.all(chunk >= n_kv - lo))
    together = (DECODE_TOGETHER and not online and items > 0
                and (len(segments) > 1 and len(rows) > 1 or items % threads == 0 or short))
    # (one array, not five: the layer unboxes its arguments on every call)
    per_row = np.stack([np.array(rows, np.int64), n_kv, lo, chunk, lo - lo % 32], axis=1)
    return AttentionPlan(np.concatenate(slots), online, int(window), per_row, _padded(tables), together,
                         np.array(segs, np.int64).reshape(-1, 5), _padded(seg_tables))


def exact_head_dim(hd: int) -> bool:
    """The llama.cpp-exact kernels take head dims that are a multiple of 64 (ggml's f16 dot needs 32,
    our P@V kernel works 64 dims at a time); others run the online kernels."""
    return hd % 64 == 0


def attention_decode(q, k_cache, v_cache, block_table, n_kv: int, scale: float, window: int = 0,
                     n_splits: int = 0, softmax: str = "llama.cpp", softcap: float = 0.0):
    """One query q (Hq, hd) at position n_kv-1 over cached keys [0, n_kv) -> (Hq, hd).

    softmax "llama.cpp", in three steps: the scores, split across threads by keys; ggml's softmax
    per head; P@V split across threads by heads and head dims (each output is one fixed chain
    over the keys, as llama.cpp sums it). softmax "online" (flash-decoding): each split of the keys
    keeps its own running max and sum, and the partial outputs are merged by log-sum-exp.
    softcap: gemma2's score soft-capping (0: none)."""
    _check_softmax(softmax)
    q = np.ascontiguousarray(q, np.float32)
    _check_cache(q, k_cache, v_cache, block_table, n_kv)
    if n_kv <= 0:
        raise ValueError("attention_decode needs at least one cached key")
    lo = max(0, n_kv - window) if window > 0 else 0
    n_keys = n_kv - lo
    bs = k_cache.shape[1]
    Hq, hd = q.shape
    kv_elems = n_keys * k_cache.shape[2] * hd  # K (and as many V) floats to read
    parallel = kv_elems >= ops.PAR_MIN
    if n_splits <= 0:
        n_splits = _choose_splits(n_keys, k_cache.shape[2], bs) if parallel else 1
    online = softmax == "online" or not exact_head_dim(hd)
    chunk = _split_chunk(n_keys, n_splits, bs, online)
    table = np.ascontiguousarray(block_table, np.int32)
    out = np.empty((Hq, hd), np.float32)
    if online:
        n_splits = -(-n_keys // chunk)
        o_part = np.empty((Hq, n_splits, hd), np.float32)
        m_part = np.empty((Hq, n_splits), np.float32)
        l_part = np.empty((Hq, n_splits), np.float32)
        if hd % 16 == 0:
            kernel = decode_partial_v if parallel else decode_partial_v_serial
        else:
            kernel = decode_partial if parallel else decode_partial_serial
        kernel(q, k_cache.view(np.uint16), v_cache.view(np.uint16), table, lo, n_kv, chunk, np.float32(scale),
               np.float32(softcap), o_part, m_part, l_part)
        merge_splits(o_part, m_part, l_part, out)
        return out
    key0 = lo - lo % 32                                   # the 32-key steps of ggml's f16 dot start at key 0
    S = np.empty((Hq, -(-(n_kv - key0) // 8) * 8), np.float32)   # scores, then probabilities
    (_decode_scores if parallel else _decode_scores_serial)(q, k_cache.view(np.uint16), table, lo, n_kv, chunk, key0, S)
    (_decode_softmax if parallel else _decode_softmax_serial)(S, key0, lo, n_kv, np.float32(scale), np.float32(softcap))
    (_decode_pv if parallel else _decode_pv_serial)(S, v_cache.view(np.uint16), table, key0, n_kv, out)
    return out
