"""Triton kernels (kernels/cuda) against the plain references in kernels/reference.py.

Without CUDA they run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set here
before triton is imported): that is how CI, which has no GPU, checks them. With CUDA the same
tests run natively on the GPU. Shapes are tiny because the interpreter is slow.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.cuda.attention import attention_decode, attention_prefill, choose_splits  # noqa: E402
from kernels.cpu import dequantize  # noqa: E402
from kernels.cuda.dequant import dequantize_rows  # noqa: E402
from kernels.cuda.dequant_gemv import QK, dequant_gemv  # noqa: E402
from kernels.cuda import norm_rope as norm_rope_module  # noqa: E402
from kernels.cuda.norm_rope import norm_rope, rms_norm, rope  # noqa: E402
from kernels.reference import (  # noqa: E402
    attention_ref, dequantize_ref, gather_kv_ref, random_quantized, rms_norm_ref, rope_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}


def _paged_cache(rng, n_tokens, n_kv, hd, bs, dtype, n_seqs=1):
    """A shuffled pool with spare blocks; returns caches, block tables (n_seqs, max_blocks) int32."""
    per_seq = -(-n_tokens // bs)
    n_blocks = per_seq * n_seqs + 3
    perm = rng.permutation(n_blocks)[: per_seq * n_seqs].reshape(n_seqs, per_seq).astype(np.int32)
    k = torch.from_numpy(rng.standard_normal((n_blocks, bs, n_kv, hd)).astype(np.float32)).to(dtype)
    v = torch.from_numpy(rng.standard_normal((n_blocks, bs, n_kv, hd)).astype(np.float32)).to(dtype)
    return k.to(DEVICE), v.to(DEVICE), torch.from_numpy(perm).to(DEVICE)


def _np(t):
    return t.detach().float().cpu().numpy()


# ------------------------------------------------------------------------------------ prefill

PREFILL_CASES = [
    # dtype, hd, bs, n_kv, group, window, q_start, T
    *[(dt, 64, bs, 1, g, w, 0, 33) for dt in (torch.float32, torch.float16) for bs in (16, 32)
      for g in (1, 7) for w in (0, 8)],
    (torch.float32, 64, 16, 2, 1, 0, 17, 16),     # cached prefix, 2 KV heads
    (torch.float32, 64, 16, 1, 7, 8, 31, 9),      # cached prefix + window, keys cross 3 blocks
    (torch.float32, 64, 32, 1, 1, 0, 39, 1),      # one new token after a prefix
    (torch.float32, 128, 16, 1, 7, 0, 5, 35),
    (torch.float16, 128, 32, 2, 1, 8, 0, 40),
    (torch.float32, 256, 16, 1, 1, 0, 3, 18),
    (torch.float32, 80, 16, 1, 1, 8, 0, 20),      # head_dim not a power of two (masked lanes)
]


@pytest.mark.parametrize("dtype,hd,bs,n_kv,group,window,q_start,T", PREFILL_CASES)
def test_prefill_matches_reference(dtype, hd, bs, n_kv, group, window, q_start, T):
    rng = np.random.default_rng(hd * 1000 + bs * 10 + group + window + q_start)
    N = q_start + T
    k_cache, v_cache, bt = _paged_cache(rng, N, n_kv, hd, bs, dtype)
    q = torch.from_numpy(rng.standard_normal((T, n_kv * group, hd)).astype(np.float32)).to(dtype).to(DEVICE)
    scale = hd ** -0.5
    out = attention_prefill(q, k_cache, v_cache, bt[0], q_start, scale, window)
    assert out.shape == q.shape and out.dtype == dtype
    k = gather_kv_ref(_np(k_cache), _np(bt[0]).astype(np.int64), N)
    v = gather_kv_ref(_np(v_cache), _np(bt[0]).astype(np.int64), N)
    ref = attention_ref(_np(q), k, v, q_start, scale, window)
    torch.testing.assert_close(out.float().cpu(), torch.from_numpy(ref), **TOL[dtype])


def test_prefill_matches_sdpa():
    """Cross-check with torch's scaled_dot_product_attention (GQA expanded, causal, no prefix)."""
    rng = np.random.default_rng(7)
    T, n_kv, group, hd, bs = 24, 2, 3, 64, 16
    k_cache, v_cache, bt = _paged_cache(rng, T, n_kv, hd, bs, torch.float32)
    q = torch.from_numpy(rng.standard_normal((T, n_kv * group, hd)).astype(np.float32)).to(DEVICE)
    out = attention_prefill(q, k_cache, v_cache, bt[0], 0, hd ** -0.5)
    pos = torch.arange(T, device=DEVICE)
    k = k_cache[bt[0].long()[pos // bs], pos % bs].repeat_interleave(group, dim=1)  # (T, Hq, hd)
    v = v_cache[bt[0].long()[pos // bs], pos % bs].repeat_interleave(group, dim=1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------------------------------ decode

DECODE_CASES = [
    # dtype, hd, bs, n_kv, group, window, seq_lens, n_splits (0 = the launcher's rule)
    *[(dt, 64, bs, 1, g, w, (1, 16, 33, 40), s) for dt in (torch.float32, torch.float16)
      for bs in (16, 32) for g in (1, 7) for w in (0, 8) for s in (1, 3)],
    (torch.float32, 64, 16, 2, 7, 0, (17, 40), 0),
    (torch.float32, 128, 16, 1, 7, 8, (32, 9), 5),
    (torch.float16, 256, 32, 1, 1, 0, (31, 40, 2), 4),
    (torch.float32, 64, 16, 1, 1, 0, (40,), 40),        # more splits than KV tiles: empty splits
]


@pytest.mark.parametrize("dtype,hd,bs,n_kv,group,window,seq_lens,n_splits", DECODE_CASES)
def test_decode_matches_reference(dtype, hd, bs, n_kv, group, window, seq_lens, n_splits):
    rng = np.random.default_rng(hd + bs + group * 10 + window * 100 + n_splits + len(seq_lens))
    B, Hq = len(seq_lens), n_kv * group
    k_cache, v_cache, bts = _paged_cache(rng, max(seq_lens), n_kv, hd, bs, dtype, n_seqs=B)
    q = torch.from_numpy(rng.standard_normal((B, Hq, hd)).astype(np.float32)).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = hd ** -0.5
    out = attention_decode(q, k_cache, v_cache, bts, lens, scale, window, n_splits=n_splits)
    assert out.shape == q.shape and out.dtype == dtype
    for b, n in enumerate(seq_lens):
        bt = _np(bts[b]).astype(np.int64)
        k, v = gather_kv_ref(_np(k_cache), bt, n), gather_kv_ref(_np(v_cache), bt, n)
        ref = attention_ref(_np(q[b])[None], k, v, n - 1, scale, window)[0]
        torch.testing.assert_close(out[b].float().cpu(), torch.from_numpy(ref), **TOL[dtype])


def test_soft_capped_scores_match_reference():
    """gemma2's score soft-capping in both kernels (a cap small enough to bend these scores)."""
    rng = np.random.default_rng(21)
    N, hd, bs = 37, 64, 16
    k_cache, v_cache, bts = _paged_cache(rng, N, 1, hd, bs, torch.float32)
    q = torch.from_numpy(rng.standard_normal((5, 2, hd)).astype(np.float32)).to(DEVICE)
    k, v = gather_kv_ref(_np(k_cache), _np(bts[0]).astype(np.int64), N), gather_kv_ref(_np(v_cache), _np(bts[0]).astype(np.int64), N)
    ref = attention_ref(_np(q), k, v, N - 5, 0.125, 0, softcap=3.0)
    assert not np.allclose(ref, attention_ref(_np(q), k, v, N - 5, 0.125), atol=1e-3)     # the cap bends them
    pre = attention_prefill(q, k_cache, v_cache, bts[0], N - 5, 0.125, softcap=3.0)
    torch.testing.assert_close(pre.cpu(), torch.from_numpy(ref), atol=2e-5, rtol=2e-5)
    dec = attention_decode(q[-1], k_cache, v_cache, bts[0], [N], 0.125, n_splits=2, softcap=3.0)
    torch.testing.assert_close(dec.cpu(), torch.from_numpy(ref[-1]), atol=2e-5, rtol=2e-5)


def test_decode_single_sequence_matches_prefill_last_row():
    """(Hq, hd) query + 1-D block table, the engine's batch-1 call, equals prefill's last row."""
    rng = np.random.default_rng(3)
    N, hd, bs = 37, 64, 16
    k_cache, v_cache, bts = _paged_cache(rng, N, 1, hd, bs, torch.float32)
    q = torch.from_numpy(rng.standard_normal((4, 7, hd)).astype(np.float32)).to(DEVICE)
    pre = attention_prefill(q, k_cache, v_cache, bts[0], N - 4, 0.125, 8)
    dec = attention_decode(q[-1], k_cache, v_cache, bts[0], [N], 0.125, 8, n_splits=2)
    torch.testing.assert_close(dec, pre[-1], atol=2e-5, rtol=2e-5)


def test_choose_splits_rule():
    cpu = torch.device("cpu")   # 4 "SMs" off the GPU: want ceil(8 / (B * Hq)) splits
    assert choose_splits(100, 1, 1, cpu) == 1                  # < 2 x 256 keys: no split
    assert choose_splits(4096, 1, 1, cpu) == 8                 # occupancy-bound
    assert choose_splits(4096, 1, 2, cpu) == 4
    assert choose_splits(4096, 4, 14, cpu) == 1                # enough programs already
    assert choose_splits(600, 1, 1, cpu) == 2                  # key-bound: >= 256 keys per split
    assert choose_splits(4096, 1, 1, cpu, window=512) == 2     # only the window is read
    if torch.cuda.is_available():
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert choose_splits(1 << 20, 1, 1, torch.device("cuda")) == min(64, 2 * sms)


# ------------------------------------------------------------------------------------ dequant GEMV

GEMV_CASES = [
    # ggml type, n_rows, n_cols, M (rows of x), x dtype
    (8, 13, 96, 1, torch.float32),       # Q8_0, K not a multiple of the column tile
    (8, 9, 512, 3, torch.float16),
    (6, 13, 160, 1, torch.float32),      # Q5_0
    (6, 8, 512, 2, torch.float32),
    (12, 13, 512, 1, torch.float32),     # Q4_K: two super-blocks per row
    (12, 5, 256, 2, torch.float16),
    (14, 13, 512, 1, torch.float32),     # Q6_K
    (14, 17, 256, 3, torch.float32),
    (8, 5, 800, 1, torch.float32),       # Q8_0: 25 blocks, not a whole number of steps
    (12, 7, 768, 2, torch.float32),      # Q4_K: three super-blocks, not a whole number of block-wise steps
    (14, 6, 1280, 1, torch.float16),     # Q6_K: five, so odd blocks start 2 bytes past a 4-byte boundary
]
# (BLOCK_R, quant blocks a step, num_warps, per_column), 0 for the launcher's choice: its choice for the
# device, a GPU's K-quant tile (one row, two blocks a step), several rows and blocks a step, and the
# per-column kernel for the K-quants too (Q8_0 and Q5_0 take it always)
GEMV_TILES = {"default": (0, 0, 0, False), "gpu-tile": (1, 2, 2, False), "4x4-blocks": (4, 4, 4, False),
              "per-column": (0, 0, 0, True)}


@pytest.mark.parametrize("tile", GEMV_TILES.values(), ids=GEMV_TILES.keys())
@pytest.mark.parametrize("ggml_type,n_rows,n_cols,M,xdtype", GEMV_CASES)
def test_dequant_gemv_matches_reference(ggml_type, n_rows, n_cols, M, xdtype, tile):
    """Both kernels, at several tiles, against float64 products of gguf-py's dequantized weights
    (fp32 sums in a different order: 2e-6 of the largest product absolute, 1e-5 relative)."""
    rng = np.random.default_rng(ggml_type * 100 + n_rows + M)
    raw = random_quantized(ggml_type, n_rows, n_cols, rng)
    x = torch.from_numpy(rng.standard_normal((M, n_cols)).astype(np.float32)).to(xdtype)
    w = torch.from_numpy(raw).to(DEVICE)
    block_r, blocks, warps, per_column = tile
    block_k = blocks * QK[ggml_type][0]
    y = dequant_gemv(w, ggml_type, n_cols, x.to(DEVICE) if M > 1 else x[0].to(DEVICE), block_r, block_k, warps,
                     per_column)
    ref = x.double().numpy() @ dequantize_ref(raw, ggml_type, n_cols).astype(np.float64).T  # (M, N)
    ref = torch.from_numpy(ref.astype(np.float32))
    assert y.dtype == torch.float32
    scale = float(ref.abs().max())
    torch.testing.assert_close(y.cpu().reshape(M, n_rows), ref, atol=2e-6 * scale, rtol=1e-5)


@pytest.mark.parametrize("ggml_type", [12, 14])
def test_dequant_gemv_reads_rows_at_any_address(ggml_type):
    """A Q4_K or Q6_K matrix whose bytes start 2 past a 4-byte boundary (a view into a larger
    buffer): Q4_K's 32-bit word loads must not see it misaligned (it is copied), Q6_K's 16-bit
    ones read it in place, and the products are those of an aligned copy."""
    rng = np.random.default_rng(7)
    raw = torch.from_numpy(random_quantized(ggml_type, 3, 512, rng)).to(DEVICE)
    shifted = torch.empty(raw.numel() + 2, dtype=torch.uint8, device=DEVICE)[2:].view(raw.shape)
    shifted.copy_(raw)
    x = torch.randn(512, device=DEVICE)
    assert shifted.data_ptr() % 4 == 2
    assert torch.equal(dequant_gemv(shifted, ggml_type, 512, x), dequant_gemv(raw, ggml_type, 512, x))


def test_dequant_gemv_rejects_bad_input():
    with pytest.raises(NotImplementedError):
        dequant_gemv(torch.zeros((1, 18), dtype=torch.uint8), 2, 32, torch.zeros(32))   # Q4_0
    with pytest.raises(ValueError):
        dequant_gemv(torch.zeros((1, 33), dtype=torch.uint8), 8, 32, torch.zeros(32))


# ------------------------------------------------------------------------------------ dequantize rows

DEQ_CASES = [(8, 7, 96), (6, 5, 160), (12, 6, 512), (14, 5, 256)]   # ggml type, n_rows, n_cols


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("ggml_type,n_rows,n_cols", DEQ_CASES)
def test_dequantize_rows_matches_cpu(ggml_type, n_rows, n_cols, dtype):
    """Bit-exact against kernels.cpu.dequantize (fp16: the fp32 reference rounded once), all rows
    and gathers with repeated, out-of-order int64 and int32 indices."""
    rng = np.random.default_rng(ggml_type * 10 + n_rows)
    raw = random_quantized(ggml_type, n_rows, n_cols, rng)
    ref = torch.from_numpy(dequantize(raw, ggml_type, n_cols)).to(dtype)          # (n_rows, n_cols)
    w = torch.from_numpy(raw).to(DEVICE)
    y = dequantize_rows(w, ggml_type, n_cols, dtype=dtype)
    assert y.shape == (n_rows, n_cols) and y.dtype == dtype
    assert torch.equal(y.cpu(), ref)
    idx = [n_rows - 1, 0, 2, 2, n_rows - 1, 1]
    for idt in (torch.int64, torch.int32):
        y = dequantize_rows(w, ggml_type, n_cols, rows=torch.tensor(idx, dtype=idt, device=DEVICE), dtype=dtype)
        assert torch.equal(y.cpu(), ref[idx])
    y = dequantize_rows(w, ggml_type, n_cols, rows=torch.tensor(idx[:1], device=DEVICE), dtype=dtype)
    assert torch.equal(y.cpu(), ref[idx[:1]])                  # one embedding row


@pytest.mark.parametrize("ggml_type,n_rows,n_cols", DEQ_CASES)
def test_dequantize_rows_into_scratch(ggml_type, n_rows, n_cols):
    """`out` as views of larger buffers: the first M rows of a flat scratch buffer, and a window
    with a row stride wider than n_cols; nothing outside the view is written."""
    rng = np.random.default_rng(ggml_type + n_cols)
    raw = random_quantized(ggml_type, n_rows, n_cols, rng)
    ref = torch.from_numpy(dequantize(raw, ggml_type, n_cols))                    # fp32 (n_rows, n_cols)
    w = torch.from_numpy(raw).to(DEVICE)
    scratch = torch.full(((n_rows + 3) * n_cols,), -7.0, dtype=torch.float16, device=DEVICE)
    out = scratch[: n_rows * n_cols].view(n_rows, n_cols)
    assert dequantize_rows(w, ggml_type, n_cols, out=out) is out
    assert torch.equal(out.cpu(), ref.half()) and bool((scratch[n_rows * n_cols:] == -7).all())
    rows = torch.tensor([1, 0, 1], device=DEVICE)
    scratch = torch.full((5, n_cols + 64), -7.0, dtype=torch.float32, device=DEVICE)
    out = scratch[1:4, 32: 32 + n_cols]
    y = dequantize_rows(w, ggml_type, n_cols, rows=rows, out=out, dtype=torch.float32)
    assert y is out and torch.equal(out.cpu(), ref[[1, 0, 1]])
    keep = torch.ones_like(scratch, dtype=torch.bool)
    keep[1:4, 32: 32 + n_cols] = False
    assert bool((scratch[keep] == -7).all())


def test_dequantize_rows_bf16_and_empty():
    rng = np.random.default_rng(5)
    raw = random_quantized(12, 3, 256, rng)
    ref = torch.from_numpy(dequantize(raw, 12, 256))
    w = torch.from_numpy(raw).to(DEVICE)
    y = dequantize_rows(w, 12, 256, dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    if DEVICE == "cuda":
        assert torch.equal(y.cpu(), ref.bfloat16())
    else:       # the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even
        torch.testing.assert_close(y.float(), ref, atol=0, rtol=2 ** -7)
    y = dequantize_rows(w, 12, 256, rows=torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert y.shape == (0, 256) and y.dtype == torch.float16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_dequantize_rows_captures_in_cuda_graph():
    """No host sync in the launcher: a captured gather replays with new indices in place."""
    rng = np.random.default_rng(9)
    raw = random_quantized(14, 6, 256, rng)
    ref = torch.from_numpy(dequantize(raw, 14, 256)).half()
    w = torch.from_numpy(raw).cuda()
    rows = torch.tensor([0, 1, 2], device="cuda")
    out = torch.empty((3, 256), dtype=torch.float16, device="cuda")
    dequantize_rows(w, 14, 256, rows=rows, out=out)                 # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dequantize_rows(w, 14, 256, rows=rows, out=out)
    rows.copy_(torch.tensor([5, 3, 5], device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), ref[[5, 3, 5]])


def test_dequantize_rows_rejects_bad_input():
    w = torch.zeros((2, 34), dtype=torch.uint8)
    with pytest.raises(NotImplementedError):
        dequantize_rows(torch.zeros((1, 18), dtype=torch.uint8), 2, 32)                  # Q4_0
    with pytest.raises(ValueError):
        dequantize_rows(torch.zeros((1, 33), dtype=torch.uint8), 8, 32)                  # row bytes
    with pytest.raises(ValueError):
        dequantize_rows(w, 8, 48)                                                        # partial block
    with pytest.raises(TypeError):
        dequantize_rows(w.to(torch.int8), 8, 32)
    with pytest.raises(TypeError):
        dequantize_rows(w.reshape(-1), 8, 32)
    with pytest.raises(TypeError):
        dequantize_rows(w, 8, 32, rows=torch.zeros(1))                                   # float indices
    with pytest.raises(TypeError):
        dequantize_rows(w, 8, 32, rows=torch.zeros((1, 1), dtype=torch.int64))
    with pytest.raises(TypeError):
        dequantize_rows(w, 8, 32, dtype=torch.float64)
    with pytest.raises(TypeError):
        dequantize_rows(w, 8, 32, out=torch.empty((2, 32)))                              # fp32 out, fp16 asked
    with pytest.raises(ValueError):
        dequantize_rows(w, 8, 32, out=torch.empty((3, 32), dtype=torch.float16))
    with pytest.raises(ValueError):
        dequantize_rows(w, 8, 32, out=torch.empty((32, 2), dtype=torch.float16).t())     # column stride 2


# ------------------------------------------------------------------------------------ norm / rope


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D", [64, 896, 1000])
def test_rms_norm_matches_reference(dtype, D):
    rng = np.random.default_rng(D)
    x = torch.from_numpy(rng.standard_normal((3, 2, D)).astype(np.float32)).to(dtype)
    w = torch.from_numpy(rng.standard_normal(D).astype(np.float32))
    y = rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6)
    assert y.shape == x.shape and y.dtype == dtype
    ref = rms_norm_ref(x.float().numpy().reshape(-1, D), w.numpy(), 1e-6).reshape(x.shape)
    torch.testing.assert_close(y.float().cpu(), torch.from_numpy(ref), **TOL[dtype])


ROPE_POS = [0, 1, 5, 16, 39]


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("hd,n_rot", [(64, 64), (128, 128), (64, 32), (256, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_matches_reference(neox, hd, n_rot, dtype):
    rng = np.random.default_rng(hd + n_rot)
    x = torch.from_numpy(rng.standard_normal((len(ROPE_POS), 3, hd)).astype(np.float32)).to(dtype)
    pos = torch.tensor(ROPE_POS, dtype=torch.int32)
    y = rope(x.to(DEVICE), pos.to(DEVICE), 1e6 if hd == 128 else 1e4, neox, n_rot)
    ref = rope_ref(x.float().numpy(), pos.numpy(), 1e6 if hd == 128 else 1e4, neox, n_rot)
    torch.testing.assert_close(y.float().cpu(), torch.from_numpy(ref), **TOL[dtype])


@pytest.mark.parametrize("neox", [True, False])
def test_rope_frequency_factors_and_linear_scaling(neox):
    """Llama 3's rope_freqs (each pair's angle divided by its factor), linear scaling (every angle
    times freq_scale) and LongRoPE's attn_factor (cos and sin times it), as ggml_rope_ext applies them."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((len(ROPE_POS), 2, 64)).astype(np.float32)
    ff = rng.uniform(1, 8, 32).astype(np.float32)
    pos = np.array(ROPE_POS)
    y = rope(torch.from_numpy(x).to(DEVICE), torch.from_numpy(pos).to(DEVICE), 5e5, neox,
             freq_factors=torch.from_numpy(ff).to(DEVICE), freq_scale=0.25, attn_factor=1.19)
    ref = rope_ref(x, pos, 5e5, neox, freq_factors=ff, freq_scale=0.25, attn_factor=1.19)
    torch.testing.assert_close(y.cpu(), torch.from_numpy(ref), atol=2e-5, rtol=2e-5)
    assert not np.allclose(ref, rope_ref(x, pos, 5e5, neox), atol=1e-3)     # the factors matter


def test_rope_yarn_matches_the_cpu_table():
    """YaRN in the Triton kernel: the angles ramp from scaled to unscaled between the ramp's pairs,
    cos and sin times its factor, against kernels.cpu.rope_table's (ggml's) table applied by hand."""
    from kernels.cpu.libm import rope_yarn_corr_dims, yarn_mscale
    from kernels.cpu.ops import rope_table
    rng = np.random.default_rng(4)
    x = rng.standard_normal((len(ROPE_POS), 2, 64)).astype(np.float32)
    pos = np.array(ROPE_POS)
    yarn, mscale = tuple(map(float, rope_yarn_corr_dims(64, 4096, 1e6))), float(yarn_mscale(0.25))
    y = rope(torch.from_numpy(x).to(DEVICE), torch.from_numpy(pos).to(DEVICE), 1e6, True, freq_scale=0.25,
             attn_factor=mscale, yarn=yarn)
    cs = rope_table(pos, 1e6, 64, freq_scale=0.25, attn_factor=mscale, yarn=yarn)        # (T, 2, 32)
    c, s = cs[:, None, 0], cs[:, None, 1]
    a, b = x[..., :32], x[..., 32:]
    ref = np.concatenate([a * c - b * s, a * s + b * c], -1)
    torch.testing.assert_close(y.cpu(), torch.from_numpy(ref), atol=2e-5, rtol=2e-5)
    linear = rope(torch.from_numpy(x).to(DEVICE), torch.from_numpy(pos).to(DEVICE), 1e6, True, freq_scale=0.25)
    assert not torch.allclose(y.cpu(), linear.cpu(), atol=1e-3)                 # the ramp matters


@pytest.mark.parametrize("tile", [64, 512, None] if DEVICE == "cpu" else [None])   # of 20 rows a program takes 1 (as on a GPU), 8 or 32
@pytest.mark.parametrize("neox", [True, False])
def test_fused_norm_rope_matches_reference(neox, tile, monkeypatch):
    """Per-head q/k RMSNorm then RoPE (gemma3's q_norm/k_norm), in one pass, whatever number of
    rows a program takes."""
    if tile:
        monkeypatch.setattr(norm_rope_module, "INTERPRETED_TILE", tile)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((len(ROPE_POS), 4, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    pos = np.array(ROPE_POS)
    y = norm_rope(torch.from_numpy(x).to(DEVICE), torch.from_numpy(w).to(DEVICE), 1e-6,
                  torch.from_numpy(pos).to(DEVICE), 1e4, neox)
    ref = rope_ref(rms_norm_ref(x, w, 1e-6), pos, 1e4, neox)
    torch.testing.assert_close(y.cpu(), torch.from_numpy(ref), atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------------------------------ packaging


def test_package_imports_without_triton():
    """kernels.cuda must import on a CPU install, where triton is absent."""
    code = "import sys; sys.modules['triton'] = None; import kernels.cuda; print('ok')"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


_AOT = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.cuda import attention as A, dequant as D, dequant_gemv as G, norm_rope as N

def comp(fn, sig, consts, options=None):
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", int(sys.argv[1]), 32),
                       options=options)
    assert k.asm.get("ptx") and k.asm.get("cubin"), sorted(k.asm)

i32 = "i32"
for dt, prec, w in (("fp32", "ieee", False), ("fp16", None, True)):
    sig = dict(q_ptr="*" + dt, k_ptr="*" + dt, v_ptr="*" + dt, bt_ptr="*i32", o_ptr="*" + dt, T=i32, q_start=i32,
               qk_scale="fp32", softcap="fp32", window=i32, s_qt=i32, s_qh=i32, s_kb=i32, s_ks=i32, s_kh=i32, s_ot=i32,
               s_oh=i32)
    c = dict(GROUP=7, BS=16, HD=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=32, HAS_WINDOW=w, DOT_PREC=prec, HAS_SOFTCAP=w)
    comp(A._prefill_kernel, {**sig, **{n: "constexpr" for n in c}}, c)
sig = dict(q_ptr="*fp16", k_ptr="*fp16", v_ptr="*fp16", bt_ptr="*i32", lens_ptr="*i32", o_ptr="*fp32", m_ptr="*fp32",
           l_ptr="*fp32", qk_scale="fp32", softcap="fp32", window=i32, s_qb=i32, s_qh=i32, s_kb=i32, s_ks=i32,
           s_kh=i32, s_btb=i32, s_ob=i32, s_oh=i32, s_os=i32)
for cap in (False, True):
    c = dict(N_SPLITS=3, GROUP=7, BS=16, HD=64, BLOCK_D=64, BLOCK_N=64, HAS_WINDOW=True, HAS_SOFTCAP=cap)
    comp(A._decode_partial_kernel, {**sig, **{n: "constexpr" for n in c}}, c)
sig = dict(o_part_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", out_ptr="*fp16", s_ob=i32, s_oh=i32, s_os=i32,
           s_outb=i32, s_outh=i32)
c = dict(N_SPLITS=5, BLOCK_S=8, HD=80, BLOCK_D=128)
comp(A._decode_merge_kernel, {**sig, **{n: "constexpr" for n in c}}, c)
for q in G.SUPPORTED:
    for xdt in ("fp16", "fp32"):        # the torch engine passes fp32 activations
        sig = dict(w_ptr="*u8", x_ptr="*" + xdt, y_ptr="*fp32", N=i32, K=i32, row_bytes=i32, s_xm=i32, s_ym=i32)
        c = dict(QTYPE=q, BLOCK_R=1, BLOCK_K=256)     # the per-column kernel's tile on a GPU
        comp(G._gemv_kernel, {**sig, **{n: "constexpr" for n in c}}, c)
for q in G.BLOCKWISE:                   # the block-wise kernel: a GPU's tile, and several rows a step
    for xdt, rows in (("fp32", 1), ("fp16", 4)):
        sig = dict(w_ptr="*u8", x_ptr="*" + xdt, y_ptr="*fp32", N=i32, NB=i32, row_bytes=i32, s_xm=i32, s_ym=i32)
        c = dict(QTYPE=q, PER=G.QK[q][0], BYTES=G.QK[q][1], BLOCK_R=rows, BLOCK_B=2)
        comp(G._gemv_blocks_kernel, {**sig, **{n: "constexpr" for n in c}}, c)
for j, q in enumerate(G.SUPPORTED):     # all rows (rows_ptr is w_raw, unused) and gathers; fp16 out, and fp32/bf16
    for rows_t, out_t in (("*u8", "fp16"), ("*i64", "fp16"), ("*i32", ("fp32", "bf16")[j % 2])):
        sig = dict(w_ptr="*u8", rows_ptr=rows_t, out_ptr="*" + out_t, M=i32, K=i32, row_bytes=i32, s_om=i32)
        c = dict(QTYPE=q, HAS_ROWS=rows_t != "*u8", BLOCK_R=16, BLOCK_K=256)
        comp(D._dequant_kernel, {**sig, **{n: "constexpr" for n in c}}, c, dict(enable_fp_fusion=False))
sig = dict(x_ptr="*bf16", w_ptr="*fp32", pos_ptr="*i32", ff_ptr="*fp32", y_ptr="*bf16", R=i32, D=i32, H=i32,
           s_x=i32, s_y=i32, eps="fp32", log2_base="fp32", freq_scale="fp32", mscale="fp32", corr_lo="fp32",
           corr_hi="fp32")
for ff, yarn in ((False, False), (True, False), (False, True)):
    c = dict(N_ROT=64, NEOX=False, HAS_NORM=True, HAS_ROPE=True, HAS_FF=ff, HAS_YARN=yarn, BLOCK_R=1,
             BLOCK_D=128)                                                                  # (a GPU's BLOCK_R)
    comp(N._norm_rope_kernel, {**sig, **{n: "constexpr" for n in c}}, c)
print("ok")
'''


@pytest.mark.parametrize("sm", [80, 90])
def test_kernels_compile_for_sm80_and_sm90(sm):
    """The interpreter does not lower kernels; compile each one (every dtype/branch family) to
    PTX + cubin for sm_80 (A100) and sm_90 (H100) with triton's bundled ptxas, which needs no GPU.
    Catches type, loop-carry and layout errors that only show up in the real compiler."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", _AOT, str(sm)], capture_output=True, text=True, timeout=300, cwd=root,
                         env=env)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
