"""Paged attention (prefill tiles and decode) against explicit references: the default
("llama.cpp") softmax bit for bit against the numpy model of llama.cpp's attention
(kernels.reference.attention_llama_ref: tinyBLAS products for a prefill, ggml_vec_dot_f16 for one
token), the online (flash) softmax against float64 (attention_ref). Head dims that are not a
multiple of 64 run the online kernels under either name."""
import numpy as np
import pytest

from kernels.cpu.activations import round_to_f16
from kernels.cpu.attention import (attention_decode, attention_decode_rows, attention_prefill, block_slots,
                                  exact_head_dim, write_kv, write_kv_slots)
from kernels.reference import attention_llama_ref, attention_ref, gather_kv_ref

# decode and prefill round differently (llama.cpp's two products): a few ulps of |v| ~ 1
ATOL, RTOL = 1e-5, 1e-5
# online softmax in float32 vs float64: outputs are convex combinations of V rows (|v| ~ 1),
# rescaling adds a few ulps per block.
ONLINE_ATOL, ONLINE_RTOL = 2e-5, 1e-4
SOFTMAXES = ["llama.cpp", "online"]


def _check(got, q, k, v, q_start, scale, window, softmax, batched=True):
    """q: float16 values (the engine rounds Q before attention)."""
    if softmax == "online" or not exact_head_dim(q.shape[-1]):
        np.testing.assert_allclose(got, attention_ref(q, k, v, q_start, scale, window), rtol=ONLINE_RTOL, atol=ONLINE_ATOL)
    else:
        np.testing.assert_array_equal(got, attention_llama_ref(q, k, v, q_start, scale, window, batched))


def _cache(n_tokens, hkv, hd, bs, rng, n_spare=3):
    """A shuffled (non-identity) block table over a pool with spare blocks, and k, v on the float16
    grid of the cache (so write_kv stores them exactly and the float64 reference sees the same)."""
    n_seq_blocks = -(-n_tokens // bs)
    n_blocks = n_seq_blocks + n_spare
    k_cache = np.full((n_blocks, bs, hkv, hd), np.nan, np.float16)  # unwritten slots poison the result
    v_cache = np.full_like(k_cache, np.nan)
    table = rng.permutation(n_blocks)[:n_seq_blocks].astype(np.int32)
    k = rng.standard_normal((n_tokens, hkv, hd)).astype(np.float16).astype(np.float32)
    v = rng.standard_normal((n_tokens, hkv, hd)).astype(np.float16).astype(np.float32)
    return k_cache, v_cache, table, k, v


def test_write_kv_then_gather():
    rng = np.random.default_rng(0)
    k_cache, v_cache, table, k, v = _cache(37, 2, 64, 16, rng)
    write_kv(k_cache, v_cache, table, 0, k[:20], v[:20])
    write_kv(k_cache, v_cache, table, 20, k[20:], v[20:])
    np.testing.assert_array_equal(gather_kv_ref(k_cache, table, 37), k)
    np.testing.assert_array_equal(gather_kv_ref(v_cache, table, 37), v)


PREFILL_CASES = [
    # (n_tokens, q_start, hq, hkv, hd, bs, window)
    (1, 0, 2, 2, 64, 16, 0),
    (15, 0, 2, 1, 64, 16, 0),
    (16, 0, 14, 2, 64, 16, 0),
    (17, 0, 4, 2, 128, 32, 0),
    (100, 0, 14, 2, 64, 16, 0),
    (100, 60, 14, 2, 64, 16, 0),
    (40, 17, 4, 1, 256, 16, 0),
    (100, 0, 4, 2, 256, 32, 8),
    (50, 33, 14, 2, 64, 16, 8),
    (17, 16, 2, 2, 128, 16, 8),
    (20, 5, 4, 2, 40, 16, 0),      # head_dim not a multiple of 16
    (150, 0, 4, 1, 256, 16, 0),    # gemma's shape: 3 query tiles, paired first-with-last
    (300, 7, 4, 1, 64, 16, 32),    # 5 tiles paired, with a window
    (37, 5, 6, 2, 64, 4, 0),       # blocks smaller than an 8-key chunk: V^T key by key
    (90, 60, 14, 2, 64, 16, 0),    # a new turn after a long history: 4-row P.V groups and their rest
]


@pytest.mark.parametrize("softmax", SOFTMAXES)
@pytest.mark.parametrize("n, q_start, hq, hkv, hd, bs, window", PREFILL_CASES)
def test_prefill(n, q_start, hq, hkv, hd, bs, window, softmax):
    rng = np.random.default_rng(n * 31 + q_start)
    k_cache, v_cache, table, k, v = _cache(n, hkv, hd, bs, rng)
    write_kv(k_cache, v_cache, table, 0, k, v)
    q = round_to_f16(rng.standard_normal((n - q_start, hq, hd)).astype(np.float32))
    scale = hd ** -0.5
    got = attention_prefill(q, k_cache, v_cache, table, q_start, scale, window, softmax=softmax)
    _check(got, q, k, v, q_start, scale, window, softmax)


DECODE_CASES = [
    # (n_kv, hq, hkv, hd, bs, window, n_splits)
    (1, 2, 2, 64, 16, 0, 0),
    (15, 7, 1, 64, 16, 0, 0),
    (16, 14, 2, 64, 16, 0, 3),
    (17, 4, 2, 128, 32, 0, 2),
    (100, 14, 2, 64, 16, 0, 0),
    (100, 14, 2, 64, 16, 0, 7),
    (300, 4, 1, 256, 32, 0, 0),
    (300, 12, 2, 128, 16, 0, 0),   # qwen 1.5B's heads: two whole passes of PV_HEADS heads per kv head
    (100, 4, 2, 128, 16, 8, 0),
    (9, 8, 4, 256, 16, 8, 3),
    (700, 14, 2, 64, 16, 512, 0),
    (700, 14, 2, 64, 16, 45, 0),   # a window that starts inside a 32-key step
    (50, 4, 2, 40, 16, 0, 0),      # head_dim not a multiple of 16: the row-dot kernel
    (37, 6, 2, 64, 4, 0, 2),       # blocks smaller than a 16-key chunk
    (70, 8, 1, 64, 32, 0, 0),      # blocks larger than a 16-key chunk
]


@pytest.mark.parametrize("softmax", SOFTMAXES)
@pytest.mark.parametrize("n_kv, hq, hkv, hd, bs, window, n_splits", DECODE_CASES)
def test_decode(n_kv, hq, hkv, hd, bs, window, n_splits, softmax):
    rng = np.random.default_rng(n_kv * 7 + hq)
    k_cache, v_cache, table, k, v = _cache(n_kv, hkv, hd, bs, rng)
    write_kv(k_cache, v_cache, table, 0, k, v)
    q = round_to_f16(rng.standard_normal((hq, hd)).astype(np.float32))
    scale = hd ** -0.5
    got = attention_decode(q, k_cache, v_cache, table, n_kv, scale, window, n_splits, softmax=softmax)
    _check(got[None], q[None], k, v, n_kv - 1, scale, window, softmax, batched=False)


@pytest.mark.parametrize("softmax", SOFTMAXES)
def test_decode_equals_last_prefill_row(softmax):
    rng = np.random.default_rng(5)
    k_cache, v_cache, table, k, v = _cache(45, 2, 64, 16, rng)
    write_kv(k_cache, v_cache, table, 0, k, v)
    q = round_to_f16(rng.standard_normal((45, 14, 64)).astype(np.float32))
    pre = attention_prefill(q, k_cache, v_cache, table, 0, 0.125, softmax=softmax)
    dec = attention_decode(q[-1], k_cache, v_cache, table, 45, 0.125, n_splits=3, softmax=softmax)
    np.testing.assert_allclose(dec, pre[-1], rtol=RTOL, atol=ATOL)


def test_the_two_softmaxes_differ_by_float16_probabilities():
    """The default rounds probabilities to float16 as llama.cpp does (outputs ~1e-4 apart from
    float32 probabilities); online keeps float32. Each matches its own reference, not the other's."""
    rng = np.random.default_rng(9)
    k_cache, v_cache, table, k, v = _cache(60, 2, 64, 16, rng)
    write_kv(k_cache, v_cache, table, 0, k, v)
    q = rng.standard_normal((60, 14, 64)).astype(np.float32)
    llama = attention_prefill(q, k_cache, v_cache, table, 0, 0.125)
    online = attention_prefill(q, k_cache, v_cache, table, 0, 0.125, softmax="online")
    assert np.abs(llama - online).max() > 10 * ATOL
    with pytest.raises(ValueError, match="softmax"):
        attention_decode(q[0], k_cache, v_cache, table, 1, 0.125, softmax="exact")


@pytest.mark.parametrize("softmax", SOFTMAXES)
@pytest.mark.parametrize("q_tile", [1, 8, 64])
@pytest.mark.parametrize("window", [0, 8])
def test_prefill_tile_size_does_not_change_result(q_tile, window, softmax):
    rng = np.random.default_rng(q_tile)
    k_cache, v_cache, table, k, v = _cache(70, 2, 64, 16, rng)
    write_kv(k_cache, v_cache, table, 0, k, v)
    q = round_to_f16(rng.standard_normal((50, 14, 64)).astype(np.float32))
    got = attention_prefill(q, k_cache, v_cache, table, 20, 0.125, window, q_tile=q_tile, softmax=softmax)
    _check(got, q, k, v, 20, 0.125, window, softmax)


def test_prefill_kv_heads_widened_in_groups_give_the_same_bits():
    """The exact kernel widens K and V^T for as many kv heads at a time as kv_bytes allows: one head
    at a time (a long prompt of a model with many kv heads) gives the numbers all heads at once do."""
    rng = np.random.default_rng(5)
    k_cache, v_cache, table, k, v = _cache(90, 4, 64, 16, rng)
    write_kv(k_cache, v_cache, table, 0, k, v)
    q = round_to_f16(rng.standard_normal((40, 8, 64)).astype(np.float32))
    whole = attention_prefill(q, k_cache, v_cache, table, 50, 0.125, 0)
    one_head = attention_prefill(q, k_cache, v_cache, table, 50, 0.125, 0, kv_bytes=1)
    np.testing.assert_array_equal(one_head, whole)
    _check(one_head, q, k, v, 50, 0.125, 0, "llama.cpp")


@pytest.mark.parametrize("softmax", SOFTMAXES)
@pytest.mark.parametrize("window", [0, 8, 21])
@pytest.mark.parametrize("split", [(1,) * 6, (2, 3, 1), (6,)])
def test_prefill_rows_do_not_depend_on_chunking(window, split, softmax):
    """A prompt prefilled in chunks (prefix reuse, continuous batching) gives each query row bit
    for bit the numbers one big prefill gives it, whatever the tile size."""
    rng = np.random.default_rng(sum(split) + window)
    k_cache, v_cache, table, k, v = _cache(70, 2, 64, 16, rng)
    write_kv(k_cache, v_cache, table, 0, k, v)
    q = rng.standard_normal((6, 14, 64)).astype(np.float32)
    whole = attention_prefill(q, k_cache, v_cache, table, 64, 0.125, window, softmax=softmax)
    parts, row = [], 0
    for n in split:
        parts.append(attention_prefill(q[row:row + n], k_cache, v_cache, table, 64 + row, 0.125, window, q_tile=n,
                                       softmax=softmax))
        row += n
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_rejects_non_float16_cache():
    k_cache = np.zeros((2, 16, 1, 64), np.float32)
    table = np.arange(2, dtype=np.int32)
    with pytest.raises(TypeError):
        attention_decode(np.zeros((1, 64), np.float32), k_cache, k_cache, table, 3, 0.125)
    with pytest.raises(TypeError):
        write_kv(k_cache, k_cache, table, 0, np.zeros((1, 1, 64), np.float32), np.zeros((1, 1, 64), np.float32))


def test_write_kv_rounds_to_nearest_float16():
    """The cache holds K and V in float16 as llama.cpp does: write_kv rounds to nearest, ties to
    even, exactly like numpy's cast."""
    rng = np.random.default_rng(3)
    k_cache = np.zeros((2, 16, 2, 64), np.float16)
    v_cache = np.zeros_like(k_cache)
    k = (rng.standard_normal((20, 2, 64)) * np.logspace(-6, 4, 64)).astype(np.float32)
    k[0, 0, :4] = [np.float32(1 + 2 ** -11), np.float32(1 + 3 * 2 ** -11), 70000.0, -1e-9]  # ties, overflow, underflow
    v = -k
    table = np.array([1, 0], np.int32)
    write_kv(k_cache, v_cache, table, 0, k, v)
    with np.errstate(over="ignore"):                         # 70000 -> inf, as in the cache
        np.testing.assert_array_equal(gather_kv_ref(k_cache, table, 20), k.astype(np.float16))
        np.testing.assert_array_equal(gather_kv_ref(v_cache, table, 20), v.astype(np.float16))


@pytest.mark.parametrize("softmax", SOFTMAXES)
@pytest.mark.parametrize("threshold", [0, 1 << 62], ids=["parallel", "serial"])
def test_parallel_and_serial_kernels(threshold, softmax, monkeypatch):
    from kernels.cpu import ops

    monkeypatch.setattr(ops, "PAR_MIN", threshold)
    rng = np.random.default_rng(11)
    k_cache, v_cache, table, k, v = _cache(40, 2, 64, 16, rng)
    write_kv(k_cache, v_cache, table, 0, k, v)
    np.testing.assert_array_equal(gather_kv_ref(k_cache, table, 40), k)
    q = round_to_f16(rng.standard_normal((25, 4, 64)).astype(np.float32))
    got = attention_prefill(q, k_cache, v_cache, table, 15, 0.125, 8, softmax=softmax)
    _check(got, q, k, v, 15, 0.125, 8, softmax)
    dec = attention_decode(q[-1], k_cache, v_cache, table, 40, 0.125, softmax=softmax)
    _check(dec[None], q[-1:], k, v, 39, 0.125, 0, softmax, batched=False)


ROWS_CASES = [
    # (lengths of the sequences, hq, hkv, hd, bs, window)
    ((1, 2, 33, 300), 14, 2, 64, 16, 0),    # 300: P@V over several tiles of keys
    ((5, 70, 31), 4, 1, 256, 16, 8),       # gemma's head dim, a window (some rows start inside a 32-key step)
    ((17, 40), 8, 8, 128, 4, 0),           # blocks smaller than an 8-key chunk
    ((64, 65, 3), 4, 2, 64, 32, 45),
]


@pytest.mark.parametrize("threshold", [0, 1 << 62], ids=["parallel", "serial"])
@pytest.mark.parametrize("lengths, hq, hkv, hd, bs, window", ROWS_CASES)
def test_decode_rows_of_several_sequences(lengths, hq, hkv, hd, bs, window, threshold, monkeypatch):
    """Several sequences in one pool, their K/V written through write_kv_slots in one call, then one
    query each (the last position, and for the longest also two earlier ones, as a speculative check
    has them) through attention_decode_rows: every row equals the llama.cpp reference for its own
    sequence and attention_decode bit for bit."""
    from kernels.cpu import ops

    monkeypatch.setattr(ops, "PAR_MIN", threshold)
    rng = np.random.default_rng(sum(lengths) + hd)
    n_blocks = sum(-(-n // bs) for n in lengths) + 2
    k_cache = np.full((n_blocks, bs, hkv, hd), np.nan, np.float16)
    v_cache = np.full_like(k_cache, np.nan)
    free = list(rng.permutation(n_blocks))
    tables, kvs, slots = [], [], []
    for n in lengths:
        tables.append(np.array([free.pop() for _ in range(-(-n // bs))], np.int32))
        k = rng.standard_normal((n, hkv, hd)).astype(np.float16).astype(np.float32)
        v = rng.standard_normal((n, hkv, hd)).astype(np.float16).astype(np.float32)
        kvs.append((k, v))
        slots.append(block_slots(tables[-1], 0, n, bs))
    write_kv_slots(k_cache, v_cache, np.concatenate(slots), np.concatenate([k for k, _ in kvs]),
                   np.concatenate([v for _, v in kvs]))
    longest = int(np.argmax(lengths))
    rows = [(i, n) for i, n in enumerate(lengths)] + [(longest, lengths[longest] - 1), (longest, 1)]
    width = max(len(t) for t in tables)
    padded = np.zeros((len(rows), width), np.int32)
    for r, (i, _) in enumerate(rows):
        padded[r, :len(tables[i])] = tables[i]
    n_kvs = np.array([n for _, n in rows], np.int64)
    q = round_to_f16(rng.standard_normal((len(rows), hq, hd)).astype(np.float32))
    scale = hd ** -0.5
    got = attention_decode_rows(q, k_cache, v_cache, padded, n_kvs, scale, window)
    for r, (i, n) in enumerate(rows):
        k, v = kvs[i]
        np.testing.assert_array_equal(gather_kv_ref(k_cache, tables[i], lengths[i]), k)
        _check(got[r][None], q[r][None], k[:n], v[:n], n - 1, scale, window, "llama.cpp", batched=False)
        np.testing.assert_array_equal(got[r], attention_decode(q[r], k_cache, v_cache, tables[i], n, scale, window))


def test_decode_rows_rejects_keys_outside_the_table():
    k_cache = np.zeros((4, 16, 1, 64), np.float16)
    q = np.zeros((1, 2, 64), np.float32)
    with pytest.raises(ValueError, match="block table"):
        attention_decode_rows(q, k_cache, k_cache, np.zeros((1, 1), np.int32), np.array([17]), 0.125)
    with pytest.raises(ValueError, match="more than 1 blocks"):
        block_slots(np.zeros(1, np.int32), 10, 7, 16)


@pytest.mark.parametrize("softmax", SOFTMAXES)
def test_soft_capped_scores(softmax):
    """gemma2's soft-capping in the prefill, decode and decode-rows kernels of either softmax, against
    float64 with the cap applied to the raw scores (bit for bit against llama.cpp: the tiny gemma2
    models in tests/engine). The llama.cpp softmax rounds probabilities to float16: ~1e-3 of |v|."""
    rng = np.random.default_rng(13)
    k_cache, v_cache, table, k, v = _cache(45, 2, 64, 16, rng)
    write_kv(k_cache, v_cache, table, 0, k, v)
    q = round_to_f16(rng.standard_normal((45, 4, 64)).astype(np.float32) * 3)
    ref = attention_ref(q, k, v, 0, 0.5, 0, softcap=5.0)
    assert np.abs(ref - attention_ref(q, k, v, 0, 0.5, 0)).max() > 1e-2           # the cap bends these scores
    tol = dict(atol=2e-3, rtol=2e-3) if softmax == "llama.cpp" else dict(atol=ONLINE_ATOL, rtol=ONLINE_RTOL)
    np.testing.assert_allclose(attention_prefill(q, k_cache, v_cache, table, 0, 0.5, softmax=softmax, softcap=5.0),
                               ref, **tol)
    dec = attention_decode(q[-1], k_cache, v_cache, table, 45, 0.5, n_splits=3, softmax=softmax, softcap=5.0)
    np.testing.assert_allclose(dec, ref[-1], **tol)
    if softmax == "llama.cpp":                 # many one-token rows in one call: each equals its decode
        rows = attention_decode_rows(q[-3:], k_cache, v_cache, np.stack([table] * 3), np.array([43, 44, 45]), 0.5,
                                     softcap=5.0)
        np.testing.assert_array_equal(rows[-1], attention_decode(q[-1], k_cache, v_cache, table, 45, 0.5,
                                                                 softcap=5.0))
