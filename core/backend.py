"""The public Backend protocol: a loaded model that extends KV-cached sequences and returns logits.

Every engine (kvchat's native CPU engine, llama.cpp, and those to come) implements it; everything
above it (the generation loop in core.generate, speculative decoding, the batch scheduler, the
bench) uses only these methods and reads `capabilities` instead of probing attributes. A backend
owns its KV cache: callers see sequences and token counts, never the cache itself.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Sequence

import numpy as np

from core.tokenizer import Tokenizer
from core.types import LiveStats, SamplingParams, SpeculativeConfig, Timings, TokenEvent

if TYPE_CHECKING:
    from core.kv_cache import PagedKVCache, Sequence as KVSequence
    from core.kv_disk import DiskKV
    from core.sampler import Sampler


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond extending one sequence."""
    engine: str                    # "native", "llama.cpp", …
    device: str = "cpu"
    kv_map: bool = False           # kv_block_map() shows its paged cache block by block
    kv_disk: bool = False          # attach_disk(): full KV blocks saved to and restored from disk
    speculative: bool = False      # verify() + rollback(): a draft checked in one forward pass
    batch: bool = False            # new_sequence() + forward_batch(): many sequences per forward pass
    decode_threads: bool = False   # set_decode_threads(): fewer threads while decoding (a core for a UI)
    kernels: str = ""              # the CPU kernels' variant (native: avx512vnni, avxvnni or avx2)


class Described:
    """Anything that shows a backend's face: its name and device come from its capabilities."""
    capabilities: Capabilities

    @property
    def name(self) -> str:
        return self.capabilities.engine

    @property
    def device(self) -> str:
        return self.capabilities.device

    @property
    def where(self) -> str:
        """How it runs, for people: "native on cpu (avx512vnni)", "llama.cpp on cpu"."""
        kernels = f" ({self.capabilities.kernels})" if self.capabilities.kernels else ""
        return f"{self.name} on {self.device}{kernels}"


class Backend(Described, ABC):
    """One loaded model and its KV cache, holding one current sequence (and, with capabilities.batch,
    any number of others). `stats`, `timings` and `finish_reason` describe the current generation."""
    capabilities: ClassVar[Capabilities]

    def __init__(self, tokenizer: Tokenizer, n_ctx: int):
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.stats = LiveStats(n_ctx=n_ctx)
        self.timings = Timings()
        self.finish_reason: str | None = None

    # --- the current sequence ----------------------------------------------------------------
    @abstractmethod
    def reuse_prefix(self, ids: Sequence[int], seq: "KVSequence | None" = None) -> int:
        """Keep the longest cached prefix of `ids` (at most len(ids)-1 tokens, so there is always one
        token left to run) and drop the rest of the sequence (seq: one of new_sequence()'s; default
        the current one). Returns the number of tokens kept; stats.cache_disk_n says how many of
        them came from the disk cache."""

    @abstractmethod
    def extend(self, ids: Sequence[int], vocab_limit: int | None = None) -> np.ndarray:
        """Append `ids` to the sequence; the logits of the last one, (n_vocab,) float32 (only the
        first vocab_limit of them when given: a draft model's greedy pick needs no more)."""

    def extend_sample(self, ids: Sequence[int], sampler: "Sampler") -> int:
        """Append `ids` and draw the next token from the last one's logits with `sampler` (whose
        state advances as with sampler.sample). An engine on a GPU samples there, so only the
        token id crosses to the host (core.device_sampling)."""
        return sampler.sample(self.extend(ids))

    def verify(self, ids: Sequence[int]) -> np.ndarray:
        """Append `ids` and return the logits at every one of them, (len(ids), n_vocab): a
        speculative draft checked in one pass (capabilities.speculative)."""
        raise NotImplementedError(f"the {self.name} backend cannot verify drafts")

    @abstractmethod
    def rollback(self, n_tokens: int) -> None:
        """Drop the sequence's tokens past the first n_tokens (rejected drafts, banned strings)."""

    def attach_disk(self, model_path: Path | None, max_bytes: int | None = None,
                    warn: Callable[[str], None] | None = None) -> None:
        """Save full KV blocks to the disk cache (core.kv_disk) and restore them from it, for the
        model file at model_path (capabilities.kv_disk); None: off."""
        raise NotImplementedError(f"the {self.name} backend keeps no KV cache on disk")

    def kv_arithmetic(self) -> str:
        """What decides the bits of this backend's KV blocks (engine, instruction set or GPU, KV
        dtype): blocks on disk are keyed by it (core.kv_disk)."""
        return f"{self.name}/{self.device}/f16"

    def persist(self, seq: "KVSequence | None" = None) -> int:
        """Save the sequence's full KV blocks that the disk cache lacks (after a turn, a run, a
        batch request). Returns how many were written."""
        return 0

    def set_phase(self, phase: str) -> None:
        """Generation enters "prefill" or "decode" (a backend may retune its threads)."""

    def set_decode_threads(self, n: int | None) -> None:
        """Threads for the decode phase; None: all (capabilities.decode_threads)."""
        raise NotImplementedError(f"the {self.name} backend has no separate decode threads")

    def kv_block_map(self) -> list[str]:
        """State of each KV block: 'used', 'shared' (holds a reused prefix) or 'free' (capabilities.kv_map)."""
        return []

    def reset(self) -> None:
        """Empty the sequence and forget cached prefixes: the next prompt runs cold."""
        self.rollback(0)

    def close(self) -> None:
        """Release the model's memory."""

    # --- many sequences (capabilities.batch) -------------------------------------------------
    def reserve_sequences(self, parallel: int) -> None:
        """Make room for `parallel` full-context sequences at once."""
        raise NotImplementedError(f"the {self.name} backend does not batch")

    def new_sequence(self) -> "KVSequence":
        """A new, empty sequence in this backend's cache; it can reuse prefixes others registered."""
        raise NotImplementedError(f"the {self.name} backend does not batch")

    def forward_batch(self, runs: Sequence[tuple["KVSequence", Sequence[int]]]) -> np.ndarray:
        """Append each run's ids to its sequence in ONE forward pass; the logits of each run's last
        token, (len(runs), n_vocab)."""
        raise NotImplementedError(f"the {self.name} backend does not batch")

    # --- generation --------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 cancel: threading.Event | None = None,
                 speculative: SpeculativeConfig | None = None, draft_backend: "Backend | None" = None
                 ) -> Iterator[TokenEvent]:
        """core.generate.generate on this backend."""
        from core.generate import generate
        return generate(self, prompt_ids, params, cancel, speculative, draft_backend)


class PagedBackend(Backend):
    """A backend over core.kv_cache's paged cache (the native and torch engines): the sequence
    bookkeeping they share. A subclass sets `model` (its decoder, whose `cfg` is a
    models.transformer.DecoderConfig), `cache` (from its new_cache) and `seq`, its current sequence,
    in __init__."""
    model: Any
    cache: "PagedKVCache"
    seq: "KVSequence"
    disk: "DiskKV | None" = None

    @abstractmethod
    def new_cache(self, n_blocks: int | None = None) -> "PagedKVCache":
        """An empty cache of n_blocks blocks (None: one context's worth) in this engine's storage."""

    def reuse_prefix(self, ids: Sequence[int], seq: "KVSequence | None" = None) -> int:
        from core.kv_disk import restorer
        seq = seq or self.seq
        restore = restorer(self.disk, self.cache, ids) if self.disk is not None and self.disk.on else None
        n = seq.reuse_prefix(ids, len(ids) - 1, restore)
        self.stats.cache_disk_n = seq.n_restored
        return n

    def attach_disk(self, model_path: Path | None, max_bytes: int | None = None,
                    warn: Callable[[str], None] | None = None) -> None:
        from core.kv_disk import BlockFormat, DiskKV, file_sha256
        if model_path is None:
            self.disk = None
            return
        k = self.cache.k
        shape = (len(k),) + tuple(k[0].shape[1:])               # (n_layer, block_size, Hkv, hd)
        # (a LongRoPE model's K depends on the factor set its context picked: models.transformer)
        self.disk = DiskKV(BlockFormat(file_sha256(model_path), self.kv_arithmetic() + self.model.cfg.rope_tag, shape),
                           max_bytes=max_bytes, warn=warn)

    def persist(self, seq: "KVSequence | None" = None) -> int:
        if self.disk is None or not self.disk.on:
            return 0
        return self.disk.persist(self.cache, seq or self.seq)

    def rollback(self, n_tokens: int) -> None:
        self.seq.truncate(n_tokens)

    def reserve_sequences(self, parallel: int) -> None:
        """A bigger pool when one context's worth is too small (native pages are touched lazily)."""
        need = parallel * -(-self.n_ctx // self.cache.block_size) + parallel
        if self.cache.n_blocks >= need:
            return
        self.seq.release()
        self.cache = None                  # the old blocks go before the new ones are allocated
        self.cache = self.new_cache(need)
        self.seq = self.cache.new_sequence()

    def new_sequence(self) -> "KVSequence":
        return self.cache.new_sequence()

    def reset(self) -> None:
        """Empty the cache, prefix registrations included: the next prompt runs cold."""
        self.seq.release()
        self.cache.forget_prefixes()

    def kv_block_map(self) -> list[str]:
        return self.cache.block_states()

    def close(self) -> None:
        self.seq.release()
        self.model = None
        self.cache = None

