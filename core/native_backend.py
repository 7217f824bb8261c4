"""kvchat's own CPU engine behind the Backend interface: models/ decoders over kernels.cpu (numba),
with the paged KV cache of core.kv_cache and prefix reuse by block hash."""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Callable, Sequence

import numpy as np

from core.backend import Capabilities, PagedBackend
from core.kv_cache import DEFAULT_BLOCK_SIZE, PagedKVCache
from core.paths import weights_cache_dir
from core.tokenizer import Tokenizer
from kernels.types import LLAMA_BATCH
from models.errors import BadInputError
from models.gguf_file import GGUFFile
from models.architectures import load_model

Progress = Callable[[str, int, int], None]
# A warm-up step slower than this compiled kernels rather than loading them from the cache.
COMPILED_S = 1.0
# The warm-up's stage where numba's cache is empty (a machine's first start): minutes, not a second.
COMPILING = "compiling kernels for this CPU (once; a few minutes)"


def _keep_freed_memory() -> None:
    """Tell glibc's malloc to keep freed memory for reuse instead of handing it back to the kernel.

    A forward pass allocates its activations afresh (a 512-token chunk: ~10 MB per gate, up and
    SwiGLU output, every layer). glibc serves blocks that big with mmap and unmaps them on free, so
    each pass faulted in tens of thousands of zeroed pages again, a good part of a pp512's time in
    the kernel. Served from the heap and never trimmed, the same memory is reused pass after pass
    (README: measured). The process keeps its high-water mark, which is what it needs again at the
    next prompt anyway. No-op off glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    mallopt(M_MMAP_THRESHOLD, 1 << 30)
    mallopt(M_TRIM_THRESHOLD, 1 << 30)


def kernels_compiled() -> bool:
    """Whether numba's cache already holds the layer loop (kernels/cpu/fused.py `layers`) for this
    instruction-set choice: False on a machine's first start, or the first after the kernels
    changed, when preparing them means compiling for minutes rather than loading in about a second,
    which the start should say. (An index file of numba's cache, found by numba's private names;
    where they move, True: the start then says nothing more.)"""
    from kernels.cpu import fused
    try:
        return os.path.exists(fused.layers._cache._cache_file._index_path)
    except AttributeError:
        return True


def _stderr_progress(what: str, done: int, total: int) -> None:
    if sys.stderr.isatty():
        end = "\n" if done >= total else ""
        sys.stderr.write(f"\r{what} {done}/{total}{end}")
        sys.stderr.flush()


class NativeBackend(PagedBackend):
    capabilities = Capabilities("native", kv_map=True, kv_disk=True, speculative=True, batch=True,
                                decode_threads=True)

    def __init__(self, gguf: GGUFFile, tokenizer: Tokenizer, n_ctx: int, threads: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, progress: Progress | None = None,
                 n_blocks: int | None = None):
        gguf.require_supported(n_ctx=n_ctx)
        super().__init__(tokenizer, n_ctx)
        import numba

        from kernels.cpu.isa import variant
        self.capabilities = dataclasses.replace(type(self).capabilities, kernels=variant())

        _keep_freed_memory()
        threads = threads or os.cpu_count() or 1
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        self._threads = threads
        # Threads for the decode phase (None: all). The TUI leaves one core to the interface: on a
        # 2-core machine its rendering otherwise stalls numba's parallel regions, and decode in the
        # chat is faster on one thread than on two (README: measured); prefill keeps every thread.
        self._decode_threads: int | None = None
        self.progress = progress or _stderr_progress
        self.model = load_model(gguf, self.progress, weights_cache_dir(gguf.path), n_ctx)
        cfg = self.model.cfg
        if cfg.n_vocab != tokenizer.n_vocab:
            raise BadInputError(f"the model has {cfg.n_vocab} token rows, the vocabulary {tokenizer.n_vocab}")
        # n_blocks: a bigger pool than one context, for several sequences at once (core.batch)
        self.block_size = block_size
        self.cache = self.new_cache(n_blocks)
        self.seq = self.cache.new_sequence()
        self._warm_up()

    def _warm_up(self) -> None:
        """Run a 5-token step (the multi-row kernels) and a decode step so numba loads (or, on the
        very first start, compiles) its kernels now rather than inside the user's first prompt (on
        the first start, again with every kernel in its multi-threaded variant); reports progress
        while it does."""
        from kernels.cpu.ops import all_parallel

        t0 = time.perf_counter()
        compiled = kernels_compiled()
        stage = "preparing kernels" if compiled else COMPILING
        self.progress(stage, 0, 2)
        if not compiled and (os.cpu_count() or 1) > 1:
            from core.precompile import compile_in_two
            failed = compile_in_two(self.model)
            if failed:
                print(f"kvchat: the second compile process failed ({failed}); compiling on one core", file=sys.stderr)
        self.extend([self.tokenizer.bos_id or 0] * 5)
        self.extend([self.tokenizer.bos_id or 0])
        self.seq.release()
        self.progress(stage, 1, 2)
        if time.perf_counter() - t0 > COMPILED_S:
            # numba compiled (an empty cache): the multi-threaded variants that a long prompt and a
            # long context take would compile inside the user's first such prompt; do them now.
            # From a warm cache they load when first used, in milliseconds.
            with all_parallel():
                self.extend([self.tokenizer.bos_id or 0] * 5)
                self.extend([self.tokenizer.bos_id or 0])
            self.seq.release()
        self.progress(stage, 2, 2)

    def new_cache(self, n_blocks: int | None = None) -> PagedKVCache:
        cfg = self.model.cfg
        return PagedKVCache(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, self.n_ctx, self.block_size, n_blocks)

    def kv_arithmetic(self) -> str:
        from kernels.cpu.isa import chosen
        return f"native/{chosen()}/f16"

    def set_phase(self, phase: str) -> None:
        import numba
        n = self._decode_threads if phase == "decode" and self._decode_threads else self._threads
        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))  # per calling thread

    def _set_torch_threads(self) -> None:
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(self._threads)

    def set_decode_threads(self, n: int | None) -> None:
        self._decode_threads = n

    def extend(self, ids: Sequence[int], vocab_limit: int | None = None, decode_rows: bool | None = None) -> np.ndarray:
        """The last token's logits after `ids`; decode_rows: every row with a single token's
        arithmetic (a draft model's few-token feed takes the fused decode path)."""
        ids = list(ids)
        start = self.seq.n_tokens
        self.seq.append_slots(len(ids))
        logits = self.model.forward(np.asarray(ids, np.int64), start, self.seq, decode_rows=decode_rows,
                                    vocab_limit=vocab_limit)
        self.seq.commit(ids)
        self._set_torch_threads()
        return logits

    def verify(self, ids: Sequence[int]) -> np.ndarray:
        ids = list(ids)
        start = self.seq.n_tokens
        self.seq.append_slots(len(ids))
        logits = self.model.forward(np.asarray(ids, np.int64), start, self.seq, all_logits=True, decode_rows=True)
        self.seq.commit(ids)
        return logits

    def forward_batch(self, runs) -> np.ndarray:
        segments, tokens = [], []
        for seq, ids in runs:
            seq.append_slots(len(ids))
            segments.append((seq, seq.n_tokens, len(ids)))
            tokens.extend(ids)
        logits = self.model.forward_batch(np.asarray(tokens, np.int64), segments)   # (len(runs), n_vocab)
        for seq, ids in runs:
            seq.commit(list(ids))
        self._set_torch_threads()
        return logits

    def logits_all(self, ids: Sequence[int], chunk: int = LLAMA_BATCH) -> np.ndarray:
        """Logits at every position of `ids` from an empty cache: (T, n_vocab). Tests compare it."""
        self.seq.release()
        out = []
        for s in range(0, len(ids), chunk):
            part = list(ids[s:s + chunk])
            self.seq.append_slots(len(part))
            out.append(self.model.forward(np.asarray(part, np.int64), s, self.seq, all_logits=True))
            self.seq.commit(part)
        return np.concatenate(out)
