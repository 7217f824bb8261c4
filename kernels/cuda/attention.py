"""Triton attention over the paged KV cache: flash prefill and split-KV flash-decoding.

Cache per layer: k_cache, v_cache (n_blocks, block_size, n_kv_heads, head_dim) (fp32/fp16/bf16,
the same logical layout as kernels/cpu/attention.py); a sequence's block_table (int32) maps
logical block i (positions i*bs .. i*bs+bs-1) to a physical block. Key j is visible to the
query at position p iff j <= p and, with window > 0, p - j < window (llama.cpp's is_masked_swa).

Both kernels keep an online softmax (running max m, running sum l, rescaled fp32 accumulator)
in base 2: scores are pre-multiplied by scale * log2(e) so exp2 replaces exp. K/V rows are
gathered through the block table per key, so a KV tile (BLOCK_N keys) need not match the
cache block size. Masked scores are -inf; the running max starts at a finite -1e30 so a row
whose first tiles are fully masked (sliding window) never computes inf - inf.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------- prefill


@triton.jit
def _soft_cap(s, cap):
    """gemma2's score soft-capping, cap * tanh(s / cap), with tanh as 1 - 2 / (exp(2x) + 1)."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * (s / cap)) + 1.0))


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, o_ptr,
    T, q_start, qk_scale, softcap, window,
    s_qt, s_qh,                     # q (T, Hq, hd), last dim contiguous
    s_kb, s_ks, s_kh,               # cache (n_blocks, bs, Hkv, hd), last dim contiguous
    s_ot, s_oh,
    GROUP: tl.constexpr, BS: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """Program (query tile, query head): BLOCK_M query rows against the visible keys, tiled by BLOCK_N."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)          # query row index t
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HD
    row_ok = offs_m < T
    pos = q_start + offs_m                                      # (BLOCK_M,) absolute positions

    q = tl.load(q_ptr + offs_m[:, None] * s_qt + h * s_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    last = tl.minimum(q_start + (pid_m + 1) * BLOCK_M, q_start + T)   # one past the last key
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, q_start + pid_m * BLOCK_M - window + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
    for j0 in range(lo, last, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)                     # key positions
        n_ok = offs_n < last
        blk = tl.load(bt_ptr + offs_n // BS, mask=n_ok, other=0)
        kv_off = blk.to(tl.int64) * s_kb + (offs_n % BS) * s_ks + kvh * s_kh
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC).to(tl.float32)          # (BLOCK_M, BLOCK_N)
        if HAS_SOFTCAP:
            s = _soft_cap(s, softcap)
        s = s * qk_scale
        visible = (offs_n[None, :] <= pos[:, None]) & n_ok[None, :]
        if HAS_WINDOW:
            visible = visible & ((pos[:, None] - offs_n[None, :]) < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC).to(tl.float32)
        m_i = m_new

    l_i = tl.where(l_i > 0, l_i, 1.0)                          # rows past T: never stored anyway
    out = acc / l_i[:, None]
    tl.store(o_ptr + offs_m[:, None] * s_ot + h * s_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _check(q, k_cache, v_cache, block_table, n_pos):
    if k_cache.shape != v_cache.shape or k_cache.ndim != 4:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} must match (n_blocks, bs, Hkv, hd)")
    Hq, hd = q.shape[-2], q.shape[-1]
    if hd != k_cache.shape[3] or Hq % k_cache.shape[2]:
        raise ValueError(f"q heads/dim {tuple(q.shape[-2:])} incompatible with cache {tuple(k_cache.shape)}")
    if k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache / v_cache must share strides with a contiguous head_dim")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32, got {block_table.dtype}")
    if n_pos > 0 and (n_pos - 1) // k_cache.shape[1] >= block_table.shape[-1]:
        raise ValueError(f"{n_pos} positions need more than {block_table.shape[-1]} blocks")


def attention_prefill(q, k_cache, v_cache, block_table, q_start: int, scale: float, window: int = 0,
                      block_m: int = 0, block_n: int = 0, num_warps: int = 0, softcap: float = 0.0):
    """q (T, Hq, hd) at positions q_start.. over keys 0..q_start+T-1 already in the cache -> (T, Hq, hd).

    Grid (ceil(T / BLOCK_M), Hq). BLOCK_M/BLOCK_N default to 64/64 for hd <= 64, 64/32 above
    and 32/32 for hd 256 (registers: q, acc and one K/V tile per program), 16/16 under the
    interpreter, where tiles cost time and not registers. tl.dot needs every tile dim >= 16.
    fp32 inputs use IEEE fp32 dots (no TF32), so results match the CPU engine's tolerances.
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    T, Hq, hd = q.shape
    _check(q, k_cache, v_cache, block_table, q_start + T)
    if q.dtype != k_cache.dtype:
        raise TypeError(f"q {q.dtype} and the cache {k_cache.dtype} must share a dtype (tl.dot)")
    out = torch.empty_like(q)
    if T == 0:
        return out
    interp = q.device.type == "cpu"
    if not block_m:
        block_m = 16 if interp else (64 if hd <= 128 else 32)
    if not block_n:
        block_n = 16 if interp else (64 if hd <= 64 else 32)
    if not num_warps:
        num_warps = 4 if hd <= 64 else 8
    grid = (triton.cdiv(T, block_m), Hq)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_table, out,
        T, int(q_start), float(scale) * LOG2E, float(softcap), int(window),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1),
        GROUP=Hq // k_cache.shape[2], BS=k_cache.shape[1], HD=hd, BLOCK_D=triton.next_power_of_2(hd),
        BLOCK_M=block_m, BLOCK_N=block_n, HAS_WINDOW=window > 0,
        DOT_PREC="ieee" if q.dtype == torch.float32 else None, HAS_SOFTCAP=softcap > 0, num_warps=num_warps,
    )
    return out


# --------------------------------------------------------------------------- decode


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, o_ptr, m_ptr, l_ptr,
    qk_scale, softcap, window,
    s_qb, s_qh,                     # q (B, Hq, hd)
    s_kb, s_ks, s_kh,               # cache
    s_btb,                          # block_tables (B, max_blocks)
    s_ob, s_oh, s_os,               # o_part (B, Hq, S, hd) fp32; m/l (B, Hq, S) contiguous
    N_SPLITS: tl.constexpr, GROUP: tl.constexpr, BS: tl.constexpr, HD: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    """Program (sequence, query head, split): the query at position n_kv-1 over its share of the keys.

    The split's key range is computed here from the device-side length, so the grid depends
    only on (B, Hq, N_SPLITS): a CUDA graph captured once replays for any length.
    Writes the unnormalised accumulator, the running max (base 2) and the sum of exps.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    kvh = h // GROUP
    n_kv = tl.load(lens_ptr + b)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, n_kv - window)
    n_keys = n_kv - lo
    chunk = tl.cdiv(tl.cdiv(n_keys, N_SPLITS), BLOCK_N) * BLOCK_N     # whole KV tiles per split
    j_lo = lo + sp * chunk
    j_hi = tl.minimum(n_kv, j_lo + chunk)

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HD
    q = tl.load(q_ptr + b * s_qb + h * s_qh + offs_d, mask=d_ok, other=0.0).to(tl.float32)

    m_i = tl.full([1], -1.0e30, tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for j0 in range(j_lo, j_hi, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < j_hi
        blk = tl.load(bt_ptr + b * s_btb + offs_n // BS, mask=n_ok, other=0)
        kv_off = blk.to(tl.int64) * s_kb + (offs_n % BS) * s_ks + kvh * s_kh
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], 1)                             # (BLOCK_N,)
        if HAS_SOFTCAP:
            s = _soft_cap(s, softcap)
        s = s * qk_scale
        s = tl.where(n_ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        v = tl.load(v_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new

    base = b * s_ob + h * s_oh + sp * s_os
    tl.store(o_ptr + base + offs_d, acc, mask=d_ok)
    ml = (b * tl.num_programs(1) + h) * N_SPLITS + sp + tl.arange(0, 1)
    tl.store(m_ptr + ml, m_i)                                     # -1e30 with l = 0: empty split
    tl.store(l_ptr + ml, l_i)


@triton.jit
def _decode_merge_kernel(
    o_part_ptr, m_ptr, l_ptr, out_ptr,
    s_ob, s_oh, s_os, s_outb, s_outh,
    N_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (sequence, query head): log-sum-exp merge of the N_SPLITS partials."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < N_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HD
    ml = (b * tl.num_programs(1) + h) * N_SPLITS + offs_s
    m = tl.load(m_ptr + ml, mask=s_ok, other=-1.0e30)
    l = tl.load(l_ptr + ml, mask=s_ok, other=0.0)
    mx = tl.max(m, 0)
    c = tl.exp2(m - mx)                                           # empty splits: l = 0, acc = 0
    tot = tl.sum(c * l, 0)
    o = tl.load(o_part_ptr + b * s_ob + h * s_oh + offs_s[:, None] * s_os + offs_d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(c[:, None] * o, 0) / tot
    tl.store(out_ptr + b * s_outb + h * s_outh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4   # the interpreter: any small number; tests pass n_splits explicitly too
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


MIN_KEYS_PER_SPLIT = 256


def choose_splits(max_kv: int, batch: int, n_q_heads: int, device: torch.device, window: int = 0) -> int:
    """Number of KV splits for decode.

    Rule: aim for >= 2 programs per SM (two waves' worth hides the tail and gives each SM two
    resident programs to overlap loads), i.e. ceil(2 * SMs / (batch * Hq)) splits, but never
    fewer than MIN_KEYS_PER_SPLIT keys per split (below that the per-split fixed cost and
    the merge outweigh the parallelism), and at most 64 splits. max_kv is the largest KV
    length the launch must serve (the context size when the launch is captured in a CUDA
    graph, so the split count stays fixed while the true lengths live on the device).
    """
    n_keys = min(max_kv, window) if window > 0 else max_kv
    want = -(-2 * _sm_count(device) // max(1, batch * n_q_heads))
    most = max(1, n_keys // MIN_KEYS_PER_SPLIT)
    return max(1, min(want, most, 64))


def attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale: float, window: int = 0,
                     n_splits: int = 0, max_kv: int = 0, block_n: int = 0, softcap: float = 0.0):
    """Flash-decoding: one query per sequence.

    q (B, Hq, hd) (or (Hq, hd) for one sequence), the query of sequence b at position
    seq_lens[b] - 1 over its cached keys [0, seq_lens[b]); block_tables (B, max_blocks) int32
    (or 1-D); seq_lens (B,) int32 on the device -> (B, Hq, hd) (or (Hq, hd)).
    Grid (B, Hq, n_splits) for the partials, then (B, Hq) for the merge.
    """
    squeeze = q.dim() == 2
    if squeeze:
        q = q.unsqueeze(0)
    if block_tables.dim() == 1:
        block_tables = block_tables.unsqueeze(0)
    if not torch.is_tensor(seq_lens):
        seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=q.device)
    seq_lens = seq_lens.reshape(-1).to(torch.int32)
    if q.stride(-1) != 1:
        q = q.contiguous()
    B, Hq, hd = q.shape
    if block_tables.shape[0] != B or seq_lens.shape[0] != B:
        raise ValueError(f"batch {B}: block_tables {tuple(block_tables.shape)}, seq_lens {tuple(seq_lens.shape)}")
    if not max_kv:
        max_kv = block_tables.shape[1] * k_cache.shape[1] if q.device.type == "cuda" else int(seq_lens.max())
    _check(q, k_cache, v_cache, block_tables, max_kv)
    if not n_splits:
        n_splits = choose_splits(max_kv, B, Hq, q.device, window)
    if not block_n:
        block_n = 16 if q.device.type == "cpu" else 64
    BLOCK_D = triton.next_power_of_2(hd)
    o_part = torch.empty((B, Hq, n_splits, hd), dtype=torch.float32, device=q.device)
    m_part = torch.empty((B, Hq, n_splits), dtype=torch.float32, device=q.device)
    l_part = torch.empty((B, Hq, n_splits), dtype=torch.float32, device=q.device)
    _decode_partial_kernel[(B, Hq, n_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, o_part, m_part, l_part,
        float(scale) * LOG2E, float(softcap), int(window),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        N_SPLITS=n_splits, GROUP=Hq // k_cache.shape[2], BS=k_cache.shape[1], HD=hd,
        BLOCK_D=BLOCK_D, BLOCK_N=block_n, HAS_WINDOW=window > 0, HAS_SOFTCAP=softcap > 0, num_warps=4,
    )
    out = torch.empty_like(q)
    _decode_merge_kernel[(B, Hq)](
        o_part, m_part, l_part, out,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), out.stride(0), out.stride(1),
        N_SPLITS=n_splits, BLOCK_S=triton.next_power_of_2(n_splits), HD=hd, BLOCK_D=BLOCK_D,
        num_warps=1 if BLOCK_D <= 64 else 2,
    )
    return out[0] if squeeze else out


def write_kv(k_cache, v_cache, block_table, start_pos: int, k, v) -> None:
    """Store k, v (T, Hkv, hd) at positions start_pos.. of the sequence (plain torch indexing)."""
    T = k.shape[0]
    if T == 0:
        return
    bs = k_cache.shape[1]
    pos = torch.arange(start_pos, start_pos + T, device=k.device)
    blk = block_table.to(k.device).long()[pos // bs]
    k_cache[blk, pos % bs] = k.to(k_cache.dtype)
    v_cache[blk, pos % bs] = v.to(v_cache.dtype)

