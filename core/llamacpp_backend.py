"""llama.cpp (through llama-cpp-python) behind kvchat's Backend interface.

It is the second backend, the correctness oracle in tests and the peer in benchmarks. We drive
its low-level eval ourselves, so sampling, stop strings and timings are the shared ones in
core.backend, and prefix reuse is llama.cpp's own KV cache trimmed to the common prefix.
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from core.backend import Backend, Capabilities
from core.tokenizer import Tokenizer
from kernels.types import LLAMA_BATCH
from models.errors import BadInputError
from models.gguf_file import GGUFFile


class LlamaCppBackend(Backend):
    capabilities = Capabilities("llama.cpp")

    def __init__(self, gguf: GGUFFile, tokenizer: Tokenizer, n_ctx: int, threads: int | None = None,
                 logits_all: bool = False):
        super().__init__(tokenizer, n_ctx)
        import llama_cpp

        threads = threads or os.cpu_count() or 1
        try:
            # YaRN's betas -1: the file's (llama.cpp's own default; llama-cpp-python's would force 32 and 1)
            self.llm = llama_cpp.Llama(model_path=str(gguf.path), n_ctx=n_ctx, n_batch=LLAMA_BATCH, n_threads=threads,
                                       n_threads_batch=threads, logits_all=logits_all, verbose=False,
                                       yarn_beta_fast=-1.0, yarn_beta_slow=-1.0)
        except (ValueError, RuntimeError) as e:
            raise BadInputError(f"llama.cpp could not load {gguf.path.name}: {e}") from None
        if self.llm.n_vocab() != tokenizer.n_vocab:
            raise BadInputError(f"llama.cpp sees {self.llm.n_vocab()} tokens, the GGUF vocabulary has {tokenizer.n_vocab}")

    def reuse_prefix(self, ids: Sequence[int], seq=None) -> int:   # (one sequence: seq is never given)
        llm = self.llm
        cached = llm.input_ids[:llm.n_tokens]
        limit = min(len(cached), len(ids) - 1)
        n = 0
        while n < limit and cached[n] == ids[n]:
            n += 1
        llm.n_tokens = n
        llm._ctx.kv_cache_seq_rm(-1, n, -1)
        return n

    def rollback(self, n_tokens: int) -> None:
        self.llm.n_tokens = n_tokens
        self.llm._ctx.kv_cache_seq_rm(-1, n_tokens, -1)

    def extend(self, ids: Sequence[int], vocab_limit: int | None = None) -> np.ndarray:
        self.llm.eval(list(ids))
        ptr = self.llm._ctx.get_logits_ith(-1)
        n = self.tokenizer.n_vocab if vocab_limit is None else min(vocab_limit, self.tokenizer.n_vocab)
        return np.ctypeslib.as_array(ptr, shape=(self.tokenizer.n_vocab,))[:n].copy()  # (n,)

    def logits_all(self, ids: Sequence[int]) -> np.ndarray:
        """Logits at every position of `ids` from an empty cache (needs logits_all=True): (T, n_vocab)."""
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()
        self.llm.eval(list(ids))
        return self.llm.scores[:len(ids)].copy()

    def close(self) -> None:
        if getattr(self, "llm", None) is not None:
            self.llm.close()
            self.llm = None
