"""Continuous (in-flight) batching on the native engine.

Many requests share one loaded model. Every step runs ONE forward pass (Decoder.forward_batch)
over the tokens of all active sequences: the next prefill chunk of each sequence still reading its
prompt, plus one decode token for each sequence that is generating. A finished sequence leaves at
once and a waiting request joins in the same step, up to `parallel` active sequences. Each request
has its own KV sequence in the backend's paged cache, so prompts that share a prefix share its
registered full blocks (Sequence.reuse_prefix).

Per request, sampling, stop strings, end-of-generation tokens, max_tokens and the context limit
behave as Backend.generate does; with greedy sampling the output is the one generate gives for the
request alone (the batched pass keeps each sequence's numbers, see models.transformer).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from core.backend import PREFILL_CHUNK, SamplingParams, Timings, split_at_stop
from core.kv_cache import OutOfBlocks, PagedKVCache, Sequence
from core.sampler import Sampler
from models.errors import BadInputError

DEFAULT_PARALLEL = 16   # measured best on qwen 0.5B, 2 cores: 8 -> 78, 16 -> 85, 32 -> 75 tok/s
PREFILL_BUDGET = PREFILL_CHUNK  # prompt tokens per step across all joining sequences


@dataclass
class BatchRequest:
    id: Any
    prompt_ids: list[int]
    params: SamplingParams
    line: int | None = None     # where it came from in the input file (for the record)


@dataclass
class BatchResult:
    id: Any
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    timings: Timings = field(default_factory=Timings)
    error: str | None = None
    line: int | None = None

    def as_record(self) -> dict:
        where = {"id": self.id} | ({"line": self.line} if self.line is not None else {})
        if self.error is not None:
            return where | {"error": self.error}
        return where | {"text": self.text, "tokens": self.tokens, "finish_reason": self.finish_reason,
                "timings": self.timings.as_dict()}


class _Active:
    """One running request: its KV sequence, sampler, detokenizer and output so far."""

    def __init__(self, req: BatchRequest, seq: Sequence, tokenizer, n_vocab: int, t_start: float):
        self.req = req
        self.seq = seq
        self.t_start = t_start
        self.cache_n = seq.reuse_prefix(req.prompt_ids, len(req.prompt_ids) - 1)
        self.todo = list(req.prompt_ids[self.cache_n:])
        self.prompt_n = len(self.todo)
        self.sampler = Sampler(req.params, n_vocab)
        self.sampler.remember(req.prompt_ids)
        self.detok = tokenizer.stream_decoder()
        self.held = ""
        self.pieces: list[str] = []
        self.tokens: list[int] = []
        self.n_out = 0
        self.next_token: int | None = None
        self.t_prompt_end: float | None = None
        self.timings = Timings(prompt_n=self.prompt_n, cache_n=self.cache_n)
        self.finish_reason: str | None = None

    def step_tokens(self, budget: int) -> list[int]:
        """The tokens this sequence runs in the next step: a prefill chunk (the same chunks as
        Backend.generate) or the last sampled token. [] when the prefill budget is spent."""
        if self.todo:
            n = min(PREFILL_CHUNK, len(self.todo))
            return self.todo[:n] if n <= budget else []
        return [self.next_token]

    def result(self) -> BatchResult:
        return BatchResult(self.req.id, "".join(self.pieces), self.tokens, self.finish_reason, self.timings,
                           line=self.req.line)


class BatchScheduler:
    """Runs requests with continuous batching on a NativeBackend (core.native_backend)."""

    def __init__(self, backend, parallel: int = DEFAULT_PARALLEL, prefill_budget: int = PREFILL_BUDGET):
        if getattr(backend, "name", None) != "native":
            raise BadInputError(f"batch needs the native backend (not {getattr(backend, 'name', backend)})")
        if parallel < 1:
            raise BadInputError("--parallel must be >= 1")
        self.backend = backend
        self.model = backend.model
        self.tokenizer = backend.tokenizer
        self.n_ctx = backend.n_ctx
        self.parallel = parallel
        self.prefill_budget = prefill_budget
        self._ensure_capacity()
        self._free: list[Sequence] = []
        self.steps = 0

    def _ensure_capacity(self) -> None:
        """Give the cache room for `parallel` full-context sequences (pages are touched lazily)."""
        cache = self.backend.cache
        bs = cache.block_size
        need = self.parallel * -(-self.n_ctx // bs) + self.parallel
        if cache.n_blocks >= need:
            return
        cfg = self.model.cfg
        self.backend.seq.release()
        new = PagedKVCache(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, cache.n_ctx, bs, n_blocks=need)
        self.backend.cache = new
        self.backend.seq = new.new_sequence()

    def _sequence(self) -> Sequence:
        return self._free.pop() if self._free else self.backend.cache.new_sequence()

    def run(self, requests: Iterable[BatchRequest], on_finish: Callable[[BatchResult], None],
            on_start: Callable[[BatchRequest], None] | None = None) -> None:
        """Run every request; on_finish gets each result as soon as it is done (errors included)."""
        for _ in self.results(requests, on_start):
            on_finish(_)

    def results(self, requests: Iterable[BatchRequest],
                on_start: Callable[[BatchRequest], None] | None = None) -> Iterator[BatchResult]:
        waiting: Iterator[BatchRequest] = iter(requests)
        active: list[_Active] = []
        exhausted = False
        n_vocab = self.tokenizer.n_vocab
        while True:
            done: deque[BatchResult] = deque()
            while len(active) < self.parallel and not exhausted:   # join at once
                req = next(waiting, None)
                if req is None:
                    exhausted = True
                    break
                err = self._check(req)
                if err:
                    done.append(BatchResult(req.id, error=err, line=req.line))
                    continue
                if on_start:
                    on_start(req)
                active.append(_Active(req, self._sequence(), self.tokenizer, n_vocab, time.perf_counter()))
            yield from done
            if not active:
                if exhausted:
                    return
                continue
            yield from self._step(active)

    def _check(self, req: BatchRequest) -> str | None:
        try:
            req.params.validate()
        except BadInputError as e:
            return str(e)
        if not req.prompt_ids:
            return "the prompt is empty"
        if len(req.prompt_ids) >= self.n_ctx:
            return (f"the prompt is {len(req.prompt_ids)} tokens but the context holds {self.n_ctx}; "
                    "shorten it or raise --ctx")
        return None

    def _step(self, active: list[_Active]) -> Iterator[BatchResult]:
        """One forward pass over all active sequences; yields the requests that finished."""
        budget = max(self.prefill_budget, PREFILL_CHUNK)
        ran: list[tuple[_Active, list[int]]] = []
        for a in active:
            ids = a.step_tokens(budget)   # the budget starts at >= one chunk: some sequence always runs
            if not ids:
                continue
            if a.todo:
                budget -= len(ids)
            ran.append((a, ids))
        segments, tokens = [], []
        for a, ids in ran:
            a.seq.append_slots(len(ids))   # the cache holds parallel full contexts: cannot run out
            segments.append((a.seq, a.seq.n_tokens, len(ids)))
            tokens.extend(ids)
        logits = self.model.forward_batch(np.asarray(tokens, np.int64), segments)
        self.steps += 1
        self.backend._set_torch_threads()
        now = time.perf_counter()
        finished: list[_Active] = []
        for (a, ids), row in zip(ran, logits):
            a.seq.commit(ids)
            if a.todo:
                del a.todo[:len(ids)]
                if a.todo:
                    continue
                a.t_prompt_end = now
                a.timings.prompt_ms = (now - a.t_start) * 1000
            if self._take(a, a.sampler.sample(row), now):
                finished.append(a)
        for a in finished:
            active.remove(a)
            a.seq.release()     # its full blocks stay registered: later prompts can reuse them
            self._free.append(a.seq)
            yield a.result()

    def _take(self, a: _Active, token: int, now: float) -> bool:
        """Handle one sampled token as Backend.generate does; True when the request is finished."""
        p = a.req.params
        t = a.timings
        a.n_out += 1
        n_out = a.n_out
        if n_out == 1:
            t.ttft_ms = (now - a.t_start) * 1000
        t.predicted_n = n_out
        t.predicted_ms = (now - a.t_prompt_end) * 1000
        if token in self.tokenizer.eog_ids:
            a.pieces.append(a.held + a.detok.flush())
            a.finish_reason = "stop"
            return True
        a.tokens.append(token)   # an end-of-generation token counts in predicted_n but is not output
        a.held += a.detok.feed(token)
        emit, a.held, hit_stop = split_at_stop(a.held, p.stop)
        a.pieces.append(emit)
        if hit_stop:
            a.finish_reason = "stop"
            return True
        if n_out >= p.max_tokens or a.seq.n_tokens + 1 >= self.n_ctx:
            a.pieces.append(a.held + a.detok.flush())
            a.finish_reason = "length"
            return True
        a.next_token = token
        return False


def batch_generate(backend, requests: Iterable[BatchRequest], parallel: int = DEFAULT_PARALLEL) -> list[BatchResult]:
    """All results, in finishing order (tests, scripts)."""
    return list(BatchScheduler(backend, parallel).results(requests))


__all__ = ["BatchRequest", "BatchResult", "BatchScheduler", "batch_generate", "DEFAULT_PARALLEL", "OutOfBlocks"]
