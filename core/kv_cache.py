"""The paged KV cache: preallocated fixed-size blocks, a ref-counted block pool, block tables,
and prefix caching by chained block hashes.

Layout per layer: k, v (n_blocks, block_size, n_kv_heads, head_dim) float16, as llama.cpp keeps
them, allocated once for the whole context (np.zeros: pages are only touched, and counted in RSS,
once written).

Ownership is explicit:
- `BlockPool` owns every physical block: a ref count per block (how many sequences' block tables
  hold it), a free list, and the prefix-hash map. A full block whose contents are known is
  registered under `hash(parent_hash, its tokens)`; when its ref count drops to 0 it is not freed
  but parked in an LRU of cached blocks, reusable by a later prompt with the same prefix, and
  evicted (oldest first) only when the free list is empty.
- `Sequence` owns one block table and the token ids it has written. It increments ref counts
  when it takes a block and decrements them when it lets go; it never writes into a block another
  sequence holds (copy-on-write) or into a block registered under a hash (unregistered first).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence as Seq

import numpy as np

DEFAULT_BLOCK_SIZE = 16


class OutOfBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self.ref = np.zeros(n_blocks, np.int32)
        self.free: list[int] = list(range(n_blocks - 1, -1, -1))  # pop() gives low ids first
        self.hash_of: dict[int, int] = {}                        # block -> its prefix hash
        self.block_of: dict[int, int] = {}                       # prefix hash -> block
        self.cached: OrderedDict[int, None] = OrderedDict()      # ref 0 but hashed, LRU first

    def allocate(self) -> int:
        if self.free:
            b = self.free.pop()
        elif self.cached:
            b, _ = self.cached.popitem(last=False)  # evict the least recently used cached block
            self.unregister(b)
        else:
            raise OutOfBlocks("the KV cache is full")
        self.ref[b] = 1
        return b

    def incref(self, b: int) -> None:
        if self.ref[b] == 0:
            self.cached.pop(b, None)
        self.ref[b] += 1

    def decref(self, b: int) -> None:
        self.ref[b] -= 1
        assert self.ref[b] >= 0, f"block {b} released twice"
        if self.ref[b] == 0:
            if b in self.hash_of:
                self.cached[b] = None
            else:
                self.free.append(b)

    def register(self, b: int, h: int) -> None:
        """Block b now holds the full block of tokens whose chained hash is h."""
        old = self.block_of.get(h)
        if old is not None and old != b:
            return  # an identical block is already registered; keep the first
        self.unregister(b)
        self.hash_of[b] = h
        self.block_of[h] = b

    def unregister(self, b: int) -> None:
        h = self.hash_of.pop(b, None)
        if h is not None and self.block_of.get(h) == b:
            del self.block_of[h]
        if b in self.cached:  # no longer reusable: plainly free
            del self.cached[b]
            self.free.append(b)

    def lookup(self, h: int) -> int | None:
        return self.block_of.get(h)


def chain_hash(parent: int, tokens: Seq[int]) -> int:
    return hash((parent, tuple(int(t) for t in tokens)))


class PagedKVCache:
    """Per-layer K/V block arrays plus the pool that hands their blocks out."""

    def __init__(self, n_layer: int, n_kv_heads: int, head_dim: int, n_ctx: int,
                 block_size: int = DEFAULT_BLOCK_SIZE, n_blocks: int | None = None, storage=None):
        """storage(n_blocks, block_size) -> (K, V) per layer: another engine's tensors (the torch
        engine's, on its device); default: numpy float16 arrays."""
        self.block_size = block_size
        self.n_ctx = n_ctx
        n_blocks = n_blocks or -(-n_ctx // block_size)
        shape = (n_blocks, block_size, n_kv_heads, head_dim)
        if storage is not None:
            self.k, self.v = storage(n_blocks, block_size)
        else:
            # one allocation per K and V: numpy asks for transparent huge pages on big arrays, so the
            # cache is faulted in 2 MB at a time instead of one 4 KB page every few tokens per layer
            self.k = list(np.zeros((n_layer,) + shape, np.float16))      # n_layer x (n_blocks, bs, Hkv, hd)
            self.v = list(np.zeros((n_layer,) + shape, np.float16))
        self.pool = BlockPool(n_blocks)
        self.sequences: list[Sequence] = []

    @property
    def n_blocks(self) -> int:
        return self.pool.n_blocks

    def new_sequence(self) -> "Sequence":
        seq = Sequence(self)
        self.sequences.append(seq)
        return seq

    def forget_prefixes(self) -> None:
        """Drop every prefix-hash registration: cached blocks become plain free blocks."""
        for b in list(self.pool.hash_of):
            self.pool.unregister(b)

    def copy_block(self, src: int, dst: int) -> None:
        for k, v in zip(self.k, self.v):
            k[dst] = k[src]
            v[dst] = v[src]

    def read_block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block b's K and V on the host: (n_layer, block_size, n_kv_heads, head_dim) float16 each."""
        return _stack_on_host([k[b] for k in self.k]), _stack_on_host([v[b] for v in self.v])

    def write_block(self, b: int, k: np.ndarray, v: np.ndarray) -> None:
        """Fill block b with read_block's K and V (into another engine's tensors on its device too)."""
        if not isinstance(self.k[0], np.ndarray):
            import torch
            k, v = (torch.tensor(x, device=self.k[0].device) for x in (k, v))   # (copies: x may be read-only)
        for layer in range(len(self.k)):
            self.k[layer][b] = k[layer]
            self.v[layer][b] = v[layer]

    def blocks_used(self) -> int:
        return int((self.pool.ref > 0).sum())

    def blocks_free(self) -> int:
        return self.n_blocks - self.blocks_used()

    def block_states(self) -> list[str]:
        """'used', 'shared' (held by several sequences, or reused from a cached prefix) or 'free'
        (cached but unreferenced blocks count as free: they are reclaimable)."""
        states = ["used" if r > 0 else "free" for r in self.pool.ref]
        for seq in self.sequences:
            for b in seq.blocks[:seq.n_reused // self.block_size]:
                states[b] = "shared"
        for b in np.nonzero(self.pool.ref > 1)[0]:
            states[b] = "shared"
        return states

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)


def _stack_on_host(blocks: list) -> np.ndarray:
    if isinstance(blocks[0], np.ndarray):
        return np.stack(blocks)
    import torch
    return torch.stack(blocks).cpu().numpy()


class Sequence:
    """One sequence's block table and tokens. The model reads `k_cache`, `v_cache`, `block_table`."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.blocks: list[int] = []
        self.tokens: list[int] = []
        self.n_reused = 0                      # leading tokens taken from an earlier computation
        self.n_restored = 0                    # of those, the tokens reuse_prefix's restore supplied
        self._hashes: list[int] = []           # chained hash of each full block, in order
        self._table: np.ndarray | None = None

    # --- what the model reads ----------------------------------------------------------------
    @property
    def k_cache(self):
        return self.cache.k

    @property
    def v_cache(self):
        return self.cache.v

    @property
    def block_table(self) -> np.ndarray:
        if self._table is None:  # rebuilt after any change to self.blocks
            self._table = np.asarray(self.blocks, np.int32)
        return self._table

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    # --- growing and shrinking ---------------------------------------------------------------
    def append_slots(self, n: int) -> None:
        """Make room for n more tokens after the current ones (slots are written by the model)."""
        bs = self.cache.block_size
        need = -(-(len(self.tokens) + n) // bs)
        if len(self.tokens) + n > self.cache.n_ctx:
            raise OutOfBlocks(f"{len(self.tokens) + n} tokens exceed the context of {self.cache.n_ctx}")
        self._make_tail_writable()
        pool = self.cache.pool
        while len(self.blocks) < need:
            self.blocks.append(pool.allocate())
        self._table = None

    def commit(self, tokens: Seq[int]) -> None:
        """Record the ids just written into the appended slots and register newly full blocks."""
        self.tokens.extend(int(t) for t in tokens)
        bs = self.cache.block_size
        pool = self.cache.pool
        while len(self._hashes) < len(self.tokens) // bs:
            i = len(self._hashes)
            parent = self._hashes[-1] if self._hashes else 0
            h = chain_hash(parent, self.tokens[i * bs:(i + 1) * bs])
            self._hashes.append(h)
            pool.register(self.blocks[i], h)

    def append(self, tokens: Seq[int]) -> None:
        """append_slots + commit, for callers that fill the slots themselves (tests)."""
        self.append_slots(len(tokens))
        self.commit(tokens)

    def truncate(self, n_tokens: int) -> None:
        """Keep the first n_tokens; release the blocks past them."""
        n_tokens = max(0, min(n_tokens, len(self.tokens)))
        bs = self.cache.block_size
        keep = -(-n_tokens // bs)
        pool = self.cache.pool
        for b in self.blocks[keep:]:
            pool.decref(b)
        del self.blocks[keep:]
        self._table = None
        del self.tokens[n_tokens:]
        del self._hashes[n_tokens // bs:]
        self.n_reused = min(self.n_reused, n_tokens)

    def _make_tail_writable(self) -> None:
        """The partly filled last block is about to be written: never into a block someone else
        holds (copy it first) nor one registered under a hash (its contents will change)."""
        bs = self.cache.block_size
        if not self.blocks or len(self.tokens) % bs == 0 or len(self.tokens) >= len(self.blocks) * bs:
            return
        pool = self.cache.pool
        b = self.blocks[-1]
        if pool.ref[b] > 1:
            nb = pool.allocate()
            self.cache.copy_block(b, nb)
            pool.decref(b)
            self.blocks[-1] = nb
            self._table = None
        elif b in pool.hash_of:
            pool.unregister(b)

    def release(self) -> None:
        self.truncate(0)

    # --- prefix reuse ------------------------------------------------------------------------
    def reuse_prefix(self, ids: Seq[int], limit: int, restore: Callable[[int], int | None] | None = None) -> int:
        """Keep the longest prefix of `ids` (at most `limit` tokens) this sequence already holds,
        extended by full blocks found in the prefix-hash map and then, where the map has none, by
        `restore(i)`: a block of the pool holding full block i of ids, filled from elsewhere (the
        disk cache, core.kv_disk), or None. Drops the rest. Returns the tokens kept; `n_restored`
        says how many of them restore supplied."""
        n = 0
        cap = min(limit, len(self.tokens))
        while n < cap and self.tokens[n] == ids[n]:
            n += 1
        bs = self.cache.block_size
        pool = self.cache.pool
        # full blocks of ids past our own common prefix that some earlier computation left cached
        k = n // bs
        parent = self._hashes[k - 1] if k else 0
        found: list[tuple[int, int]] = []          # (block, hash), each taken (ref'd) as it is found
        restored = 0
        while (k + len(found) + 1) * bs <= limit:
            i = k + len(found)
            h = chain_hash(parent, ids[i * bs:(i + 1) * bs])
            b = pool.lookup(h)
            if b is not None:
                pool.incref(b)
            elif restore is not None and (b := restore(i)) is not None:   # allocated: ref 1
                pool.register(b, h)
                restored += 1
            else:
                break
            found.append((b, h))
            parent = h
        self.n_restored = 0
        if found and (k + len(found)) * bs > n:
            self.truncate(k * bs)
            for b, h in found:
                self.blocks.append(b)
                self._hashes.append(h)
            self._table = None
            self.tokens.extend(int(t) for t in ids[k * bs:(k + len(found)) * bs])
            n = len(self.tokens)
            self.n_restored = restored * bs
        else:
            for b, _ in found:
                pool.decref(b)                     # registered: they stay cached
            self.truncate(n)
        self.n_reused = n
        return n
