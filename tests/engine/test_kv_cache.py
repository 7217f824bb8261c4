"""The paged KV cache: block accounting, truncation, copy-on-write, prefix reuse by block hash."""
from __future__ import annotations

import numpy as np
import pytest

from core.kv_cache import OutOfBlocks, PagedKVCache

BS = 4


def make(n_ctx=32, n_blocks=None):
    return PagedKVCache(n_layer=2, n_kv_heads=1, head_dim=2, n_ctx=n_ctx, block_size=BS, n_blocks=n_blocks)


def test_append_allocates_whole_blocks_and_truncate_frees_them():
    cache = make()
    seq = cache.new_sequence()
    assert cache.blocks_used() == 0 and cache.blocks_free() == 8
    seq.append(list(range(9)))
    assert len(seq.block_table) == 3 and cache.blocks_used() == 3
    assert seq.block_table.dtype == np.int32
    seq.truncate(4)
    assert seq.n_tokens == 4 and len(seq.block_table) == 1 and cache.blocks_used() == 1
    seq.release()
    assert cache.blocks_used() == 0
    assert cache.block_states().count("free") == 8


def test_context_overflow_is_refused():
    cache = make(n_ctx=8)
    seq = cache.new_sequence()
    seq.append(list(range(8)))
    with pytest.raises(OutOfBlocks):
        seq.append_slots(1)


def test_reuse_prefix_keeps_common_tokens_capped():
    cache = make()
    seq = cache.new_sequence()
    seq.append([1, 2, 3, 4, 5, 6])
    assert seq.reuse_prefix([1, 2, 3, 9, 9], limit=4) == 3
    assert seq.tokens == [1, 2, 3]
    assert seq.reuse_prefix([1, 2, 3], limit=2) == 2


def test_full_blocks_of_an_earlier_prefix_are_reused_by_hash():
    cache = make()
    seq = cache.new_sequence()
    prompt_a = list(range(100, 112))            # three full blocks
    seq.append(prompt_a)
    for k in cache.k:                           # mark the blocks' contents
        k[seq.block_table, :, 0, 0] = np.arange(3)[:, None] + 1
    blocks_a = list(seq.block_table)
    seq.reuse_prefix([7, 7, 7, 7, 7], limit=4)  # a different conversation drops them all
    seq.append_slots(1)
    seq.commit([7])
    assert cache.blocks_used() == 1
    n = seq.reuse_prefix(prompt_a + [1, 2], limit=13)   # the first one comes back
    assert n == 12 and list(seq.block_table) == blocks_a
    assert cache.k[0][blocks_a[2], 0, 0, 0] == 3
    assert cache.block_states().count("shared") == 3


def test_lru_eviction_of_unreferenced_cached_blocks():
    cache = make(n_ctx=8, n_blocks=2)
    seq = cache.new_sequence()
    seq.append([1, 2, 3, 4, 5, 6, 7, 8])
    seq.release()                                # both blocks cached, none free
    assert cache.blocks_free() == 2
    seq.append([9, 9, 9, 9])                     # evicts the least recently used one
    assert seq.reuse_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0], limit=8) == 0


def test_writing_into_a_shared_tail_block_copies_it():
    cache = make()
    a, b = cache.new_sequence(), cache.new_sequence()
    a.append([1, 2, 3, 4, 5, 6, 7, 8])
    cache.k[0][a.block_table[1], :, 0, 0] = 42
    assert b.reuse_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9], limit=8) == 8
    assert list(b.block_table) == list(a.block_table)
    assert cache.block_states().count("shared") == 2
    b.truncate(6)                                 # b will now write into block 1
    b.append_slots(1)
    assert b.block_table[1] != a.block_table[1]
    assert cache.k[0][b.block_table[1], 0, 0, 0] == 42   # copied before writing
    assert a.reuse_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9], limit=8) == 8  # a's block untouched
