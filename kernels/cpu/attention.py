"""Tiled (flash) attention over a paged KV cache, numba.

Cache per layer: k_cache, v_cache (n_blocks, block_size, n_kv_heads, head_dim) float16, as
llama.cpp keeps K and V (the kernels see uint16 bits, numba has no float16, and widen to float32
on load: all arithmetic is float32). A sequence's block_table maps logical block i (positions
i*bs .. i*bs+bs-1) to a physical block. Key j is visible to the query at position p iff j <= p and, with window > 0,
p - j < window (llama.cpp's is_masked_swa masks p - j >= n_swa).

Both kernels process all query heads of one GQA group together so each K/V row is loaded
once per group; the inner products run in the register-blocked micro-kernels of
attention_tiles. Two softmaxes:
- "llama.cpp" (the default): ggml's soft_max followed by its float16 matmul with V (llama.cpp
  without flash attention): exact max, ggml_v_expf, the row sum in float64 of 16-key chunk sums,
  and the probabilities normalised and rounded to float16 before they weight V. Greedy decoding
  against llama.cpp is most sensitive to this rounding (gemma-3-270m: the first 32 greedy tokens
  equal llama.cpp's on 4 of 11 test prompts, against 1 of 11 with probabilities in float32). It
  needs each row's final max and sum before any probability weights V, so a prefill tile keeps
  its rows' scores over all their keys (at most SCORES_BYTES_MAX; never the whole T x N matrix),
  and decode takes three steps: the scores, the softmax, P@V.
- "online" (attention_online): flash attention and flash-decoding, a running max and sum per row
  and rescaled partial outputs, merged across splits by log-sum-exp; float32 probabilities.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from kernels.cpu.attention_online import (decode_partial, decode_partial_serial, decode_partial_v, decode_partial_v_serial,
                                         merge_splits, prefill_online, prefill_online_serial)
from kernels.cpu.attention_tiles import dec_qk16, decode_pv, prefetch_rows, tile_pv, tile_scores, widen_rows16
from kernels.cpu import ops
from kernels.cpu.ops import f16_bits, f16_value, ggml_expf, pick, serial_twin
from kernels.cpu.quant import round_f16

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


# No fastmath here nor in any caller: numba compiles a function called from a fastmath function
# with the caller's flags (measured: reassociated chunk sums), and these roundings are llama.cpp's.
@njit(cache=True, error_model="numpy")
def _softmax_f16(S, n, key0, m, inv):
    """llama.cpp's softmax over the first n score rows of S (n, R) in place, for the R columns (query
    rows) at once: S[j, i] (key key0 + j; -inf where masked) becomes float16(e * inv[i]) with
    e = ggml_v_expf(S[j, i] - m[i]) and inv = float32(1 / sum), the sum in float64 of each 16-key
    chunk's float32 sum (keys 16c..16c+15, in _mm512_reduce_add_ps's tree). So the probabilities are
    normalised and rounded to float16 before they weight V, as ggml's soft_max followed by its f16
    matmul with V does. m (R,) holds each row's max; a row that sees no key gets zeros. Every loop
    runs along R without branches, so it vectorizes (ggml_expf(-inf) is 0)."""
    R = S.shape[1]
    m_ref = np.empty(R, np.float32)
    for i in range(R):
        m_ref[i] = m[i] if m[i] > -np.inf else np.float32(0.0)   # a row with nothing visible: all -inf
    for j in range(n):
        srow = S[j]
        for i in range(R):
            srow[i] = ggml_expf(srow[i] - m_ref[i])
    tot = np.zeros(R, np.float64)
    lane = np.zeros((16, R), np.float32)
    for c in range(key0 - key0 % 16, key0 + n, 16):
        for k in range(16):
            j = c + k - key0
            lk = lane[k]
            if 0 <= j < n:
                srow = S[j]
                for i in range(R):
                    lk[i] = srow[i]
            else:
                for i in range(R):
                    lk[i] = np.float32(0.0)
        for i in range(R):
            t0 = lane[0, i] + lane[8, i]
            t1 = lane[1, i] + lane[9, i]
            t2 = lane[2, i] + lane[10, i]
            t3 = lane[3, i] + lane[11, i]
            t4 = lane[4, i] + lane[12, i]
            t5 = lane[5, i] + lane[13, i]
            t6 = lane[6, i] + lane[14, i]
            t7 = lane[7, i] + lane[15, i]
            tot[i] += np.float64(((t0 + t4) + (t2 + t6)) + ((t1 + t5) + (t3 + t7)))
    for i in range(R):
        inv[i] = np.float32(1.0 / tot[i]) if tot[i] > 0 else np.float32(0.0)
    for j in range(n):
        srow = S[j]
        for i in range(R):
            srow[i] = round_f16(srow[i] * inv[i])


@njit(cache=True, error_model="numpy", inline="always")  # no fastmath: see _softmax_f16
def _attend_tile(qt, kf, vf, kstride, block_table, bs, kvh, pos, lo_pos, pos_min, lo_max, n_keys_lo,
                 n_keys_hi, scale, m, inv, acct, S, kbuf, vbuf):
    """Prefill: R query rows over keys [n_keys_lo, n_keys_hi) with llama.cpp's softmax (_softmax_f16).

    The R rows (positions x the GQA group, padded to a multiple of 16) are the vector lanes:
    qt (hd, R) holds the queries, S (n_keys, R) every score of the tile (q.k, then times scale, as
    ggml's soft_max scales), acct (hd, R) the output. Three passes: the scores (register-blocked micro-kernel, each loaded K element serving
    16-64 rows) and each row's max; the softmax; P@V. kf/vf: the layer's float16 K/V cache (uint16
    bits) flattened from (n_blocks, bs, Hkv, hd), so key (blk, off) of head kvh starts at
    ((blk*bs + off)*Hkv + kvh)*hd and kstride = Hkv*hd; each block's rows are widened once into
    kbuf/vbuf (bs*hd float32). pos/lo_pos (R,): a row at position p sees keys lo_pos <= j <= p
    (padding rows: none); pos_min / lo_max: the least p and the largest lo_pos of the real rows.
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
        else:
            for jj in range(n):
                for e in range(hd):
                    kbuf[jj * hd + e] = f16_value(kf[base + jj * kstride + e])
        st = S[j0 - n_keys_lo:j1 - n_keys_lo]
        tile_scores(qt, kbuf, 0, hd, st, n)
        if j0 >= lo_max and j1 - 1 <= pos_min:      # every row sees every key of the block
            for jj in range(n):
                srow = st[jj]
                for i in range(R):
                    sv = srow[i] * scale
                    srow[i] = sv
                    m[i] = max(m[i], sv)
        else:                                        # masked scores become -inf
            for jj in range(n):
                j = j0 + jj
                srow = st[jj]
                for i in range(R):
                    sv = srow[i] * scale if (j <= pos[i] and j >= lo_pos[i]) else np.float32(-np.inf)
                    srow[i] = sv
                    m[i] = max(m[i], sv)
        j0 = j1
    _softmax_f16(S, n_keys_hi - n_keys_lo, n_keys_lo, m, inv)
    j0 = n_keys_lo
    while j0 < n_keys_hi:
        blk = block_table[j0 // bs]
        off0 = j0 % bs
        j1 = min(n_keys_hi, j0 - off0 + bs)
        n = j1 - j0
        base = (blk * bs + off0) * kstride + kvh * hd
        if hd % 16 == 0:
            widen_rows16(vf, base, kstride, n, hd, vbuf)
        else:
            for jj in range(n):
                for e in range(hd):
                    vbuf[jj * hd + e] = f16_value(vf[base + jj * kstride + e])
        tile_pv(S[j0 - n_keys_lo:j1 - n_keys_lo], vbuf, 0, hd, n, acct)
        j0 = j1


@njit(cache=True, error_model="numpy", inline="always")
def _prefill_tile(q, kf, vf, Hkv, bs, block_table, q_start, scale, window, kvh, t0, t1, out):
    """Query positions t0..t1-1 of kv head kvh's group: gather the rows, attend."""
    T, Hq, hd = q.shape
    G = Hq // Hkv
    R = (t1 - t0) * G
    Rp = (R + 15) // 16 * 16                # lanes: rows padded to whole vectors
    qt = np.zeros((hd, Rp), np.float32)     # column i = (t - t0) * G + g
    pos = np.full(Rp, -1, np.int64)         # padding rows see no key
    lo_pos = np.zeros(Rp, np.int64)
    for t in range(t0, t1):
        for g in range(G):
            i = (t - t0) * G + g
            for e in range(hd):
                qt[e, i] = q[t, kvh * G + g, e]
            pos[i] = q_start + t
            lo_pos[i] = max(0, q_start + t - window + 1) if window > 0 else 0
    m = np.full(Rp, -np.inf, np.float32)
    inv = np.empty(Rp, np.float32)
    acct = np.zeros((hd, Rp), np.float32)
    # keys from the block holding the tile's first visible key: every row then sees its keys
    # in the same groups whatever tile it is in (masked keys add exact zeros), so a row's
    # result does not depend on how the queries are chunked
    key_lo = lo_pos[0] - lo_pos[0] % bs
    S = np.empty((q_start + t1 - key_lo, Rp), np.float32)
    kbuf = np.empty(bs * hd, np.float32)
    vbuf = np.empty(bs * hd, np.float32)
    _attend_tile(qt, kf, vf, Hkv * hd, block_table, bs, kvh, pos, lo_pos, pos[0], lo_pos[R - 1],
                 key_lo, q_start + t1, scale, m, inv, acct, S, kbuf, vbuf)
    for t in range(t0, t1):
        for g in range(G):
            i = (t - t0) * G + g
            for e in range(hd):
                out[t, kvh * G + g, e] = acct[e, i]


@njit(parallel=True, cache=True, error_model="numpy")
def _prefill(q, k_cache, v_cache, block_table, q_start, scale, window, q_tile, paired, out):
    """paired: each work item takes query tiles p and n_tiles-1-p of one kv head. Under the causal
    mask a tile's cost grows with its position, so the threads' contiguous shares of the work
    items then cost the same (one kv head's tiles in order left the last thread 1.4x the work)."""
    T = q.shape[0]
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    kf, vf = k_cache.reshape(-1), v_cache.reshape(-1)
    n_tiles = (T + q_tile - 1) // q_tile
    n_items = (n_tiles + 1) // 2 if paired else n_tiles
    for w in prange(Hkv * n_items):
        kvh = w // n_items
        tile = w % n_items
        t0 = tile * q_tile
        _prefill_tile(q, kf, vf, Hkv, bs, block_table, q_start, scale, window, kvh, t0, min(T, t0 + q_tile), out)
        mirror = n_tiles - 1 - tile
        if paired and mirror != tile:
            t0 = mirror * q_tile
            _prefill_tile(q, kf, vf, Hkv, bs, block_table, q_start, scale, window, kvh, t0, min(T, t0 + q_tile),
                          out)


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
    64 KB (gemma's head_dim 256: 64 rows, 63 vs 70 ms at pp512) and its scores (rows x n_keys)
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
                      q_tile: int = 0, softmax: str = "llama.cpp"):
    """q (T, Hq, hd) at positions q_start.. over keys 0..q_start+T-1 already in the cache -> (T, Hq, hd).

    softmax: "llama.cpp" (its rounding, see the module doc) or "online" (flash attention with a
    running max and sum in float32, attention_online)."""
    _check_softmax(softmax)
    q = np.ascontiguousarray(q, np.float32)
    _check_cache(q, k_cache, v_cache, block_table, q_start + q.shape[0])
    out = np.empty_like(q)
    online = softmax == "online"
    if q_tile <= 0:  # (the online kernel holds one block of scores at a time: no cap from n_keys)
        q_tile = _choose_q_tile(q.shape[0], q.shape[1], k_cache.shape[2], q.shape[2],
                                0 if online else q_start + q.shape[0])
    if q.shape[0]:
        work = q.shape[0] * (q_start + q.shape[0]) * q.shape[1] * q.shape[2] // 16  # ~ MACs / 16
        kernel = (pick(prefill_online, prefill_online_serial, work) if online
                  else pick(_prefill, _prefill_serial, work))
        n_tiles = -(-q.shape[0] // q_tile)
        paired = k_cache.shape[2] * ((n_tiles + 1) // 2) >= numba.get_num_threads()
        kernel(q, k_cache.view(np.uint16), v_cache.view(np.uint16), np.ascontiguousarray(block_table, np.int32),
               int(q_start), np.float32(scale), int(window), int(q_tile), paired, out)
    return out


@njit(parallel=True, cache=True, error_model="numpy")
def _decode_scores(q, k_cache, block_table, lo, hi, chunk, S):
    """Decode scores S[h, j - lo] = q[h] . K[j] for keys lo <= j < hi: work item (kv head, split)
    takes the group's G query heads over keys [lo + split*chunk, ...). hd % 16 == 0: dec_qk16
    (16 keys as lanes, products along head_dim, one shuffle reduction per head); else row dots."""
    Hq, hd = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    kf = k_cache.reshape(-1)
    kstride = Hkv * hd
    G = Hq // Hkv
    n_splits = -(-(hi - lo) // chunk)
    for w in prange(Hkv * n_splits):
        kvh = w // n_splits
        sp = w % n_splits
        qg = np.empty((G, hd), np.float32)
        for g in range(G):
            for e in range(hd):
                qg[g, e] = q[kvh * G + g, e]
        s = np.empty((G, 16), np.float32)
        j0 = lo + sp * chunk
        j_end = min(hi, j0 + chunk)
        while j0 < j_end:
            off0 = j0 % bs
            j1 = min(j_end, j0 - off0 + bs, j0 + 16)
            n = j1 - j0
            base = (block_table[j0 // bs] * bs + off0) * kstride + kvh * hd
            if hd % 16 == 0:
                jp = j1 + 16  # prefetch two chunks ahead (in place, 3.5k keys: attention -14% vs none)
                if jp < j_end:
                    off1 = jp % bs
                    n1 = min(j_end, jp - off1 + bs, jp + 16) - jp
                    prefetch_rows(kf, (block_table[jp // bs] * bs + off1) * kstride + kvh * hd, kstride, n1, hd)
                dec_qk16(qg, kf, base, kstride, n, s)
            else:
                for jj in range(n):
                    for g in range(G):
                        dot = np.float32(0.0)
                        for e in range(hd):
                            dot += qg[g, e] * f16_value(kf[base + jj * kstride + e])
                        s[g, jj] = dot
            for g in range(G):
                for jj in range(n):
                    S[kvh * G + g, j0 - lo + jj] = s[g, jj]
            j0 = j1


@njit(parallel=True, cache=True, error_model="numpy")
def _decode_pv(P, v_cache, block_table, lo, hi, chunk, o_part):
    """o_part[h, split] = sum_j P[h, j - lo] * V[j] over the split's keys (P: float16-rounded
    probabilities); work items as in _decode_scores."""
    Hq, n_splits, hd = o_part.shape
    bs, Hkv = v_cache.shape[1], v_cache.shape[2]
    vf = v_cache.reshape(-1)
    kstride = Hkv * hd
    G = Hq // Hkv
    for w in prange(Hkv * n_splits):
        kvh = w // n_splits
        sp = w % n_splits
        acc = np.zeros((G, hd), np.float32)
        s = np.empty((G, 16), np.float32)
        j0 = lo + sp * chunk
        j_end = min(hi, j0 + chunk)
        while j0 < j_end:
            off0 = j0 % bs
            j1 = min(j_end, j0 - off0 + bs, j0 + 16)
            n = j1 - j0
            base = (block_table[j0 // bs] * bs + off0) * kstride + kvh * hd
            for g in range(G):
                for jj in range(n):
                    s[g, jj] = P[kvh * G + g, j0 - lo + jj]
            if hd % 16 == 0:
                jp = j1 + 16
                if jp < j_end:
                    off1 = jp % bs
                    n1 = min(j_end, jp - off1 + bs, jp + 16) - jp
                    prefetch_rows(vf, (block_table[jp // bs] * bs + off1) * kstride + kvh * hd, kstride, n1, hd)
                decode_pv(s, vf, base, kstride, n, acc)
            else:
                for jj in range(n):
                    for g in range(G):
                        pv = s[g, jj]
                        for e in range(hd):
                            acc[g, e] += pv * f16_value(vf[base + jj * kstride + e])
            j0 = j1
        for g in range(G):
            for e in range(hd):
                o_part[kvh * G + g, sp, e] = acc[g, e]


@njit(parallel=True, cache=True, error_model="numpy")
def _decode_softmax(S, lo, scale):
    """_softmax_f16 for decode, a head per row of S (Hq, n): scores of keys lo.. times scale become
    float16(e * float32(1/sum)), e = ggml_v_expf(s - max), the sum in float64 of the float32 sums of
    16-key chunks (keys 16c..16c+15, _mm512_reduce_add_ps's tree). Every key is visible."""
    Hq, n = S.shape
    for h in prange(Hq):
        row = S[h]
        m = np.float32(-np.inf)
        for j in range(n):
            v = row[j] * scale
            row[j] = v
            m = max(m, v)
        for j in range(n):
            row[j] = ggml_expf(row[j] - m)
        tot = 0.0
        lane = np.zeros(16, np.float32)
        for c in range(lo - lo % 16, lo + n, 16):
            for k in range(16):
                j = c + k - lo
                lane[k] = row[j] if 0 <= j < n else np.float32(0.0)
            t0, t1, t2, t3 = lane[0] + lane[8], lane[1] + lane[9], lane[2] + lane[10], lane[3] + lane[11]
            t4, t5, t6, t7 = lane[4] + lane[12], lane[5] + lane[13], lane[6] + lane[14], lane[7] + lane[15]
            u0, u1, u2, u3 = t0 + t4, t1 + t5, t2 + t6, t3 + t7
            tot += np.float64((u0 + u2) + (u1 + u3))
        inv = np.float32(1.0 / tot)
        for j in range(n):
            row[j] = round_f16(row[j] * inv)


@njit(cache=True, error_model="numpy")
def _sum_splits(o_part, out):
    """The splits' partial outputs added in order (the probabilities are normalised already)."""
    Hq, n_splits, hd = o_part.shape
    for h in range(Hq):
        for e in range(hd):
            acc = o_part[h, 0, e]
            for sp in range(1, n_splits):
                acc += o_part[h, sp, e]
            out[h, e] = acc


_decode_scores_serial = serial_twin(_decode_scores)
_decode_softmax_serial = serial_twin(_decode_softmax)
_decode_pv_serial = serial_twin(_decode_pv)


def _choose_splits(n_keys: int, n_kv_heads: int, block_size: int) -> int:
    threads = numba.get_num_threads()
    want = max(1, -(-2 * threads // n_kv_heads))  # ~2 work items per thread
    most = max(1, n_keys // max(64, block_size))  # keep >= 64 keys per split
    return min(want, most)


def attention_decode(q, k_cache, v_cache, block_table, n_kv: int, scale: float, window: int = 0,
                     n_splits: int = 0, softmax: str = "llama.cpp"):
    """One query q (Hq, hd) at position n_kv-1 over cached keys [0, n_kv) -> (Hq, hd), split-KV.

    softmax "llama.cpp", in three steps: the scores, split across threads; llama.cpp's softmax
    over all of them (probabilities normalised and rounded to float16, as ggml's soft_max and f16
    matmul give them); P@V split across threads again, the partial outputs added. softmax
    "online" (flash-decoding): each split keeps its own running max and sum, and the partial
    outputs are merged by log-sum-exp."""
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
    n_splits = max(1, min(int(n_splits), n_keys))
    chunk = -(-n_keys // n_splits)
    if n_splits > 1 and chunk > bs:
        chunk = -(-chunk // bs) * bs  # whole cache blocks per split
    n_splits = -(-n_keys // chunk)
    table = np.ascontiguousarray(block_table, np.int32)
    o_part = np.empty((Hq, n_splits, hd), np.float32)
    out = np.empty((Hq, hd), np.float32)
    if softmax == "online":
        m_part = np.empty((Hq, n_splits), np.float32)
        l_part = np.empty((Hq, n_splits), np.float32)
        if hd % 16 == 0:
            kernel = decode_partial_v if parallel else decode_partial_v_serial
        else:
            kernel = decode_partial if parallel else decode_partial_serial
        kernel(q, k_cache.view(np.uint16), v_cache.view(np.uint16), table, lo, n_kv, chunk, np.float32(scale),
               o_part, m_part, l_part)
        merge_splits(o_part, m_part, l_part, out)
        return out
    S = np.empty((Hq, n_keys), np.float32)                # scores, then probabilities
    (_decode_scores if parallel else _decode_scores_serial)(q, k_cache.view(np.uint16), table, lo, n_kv, chunk, S)
    (_decode_softmax if parallel else _decode_softmax_serial)(S, lo, np.float32(scale))
    (_decode_pv if parallel else _decode_pv_serial)(S, v_cache.view(np.uint16), table, lo, n_kv, chunk, o_part)
    _sum_splits(o_part, out)
    return out
