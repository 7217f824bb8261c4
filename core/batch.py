"""Continuous (in-flight) batching on an engine that batches (capabilities.batch: native, torch).

Many requests share one loaded model. Every step runs ONE forward pass (Backend.forward_batch)
over the tokens of all active sequences: the next prefill chunk of each sequence still reading its
prompt, plus one decode token for each sequence that is generating. A finished sequence leaves at
once and a waiting request joins in the same step, up to `parallel` active sequences. Each request
has its own KV sequence in the backend's paged cache, so prompts that share a prefix share its
registered full blocks (Sequence.reuse_prefix).

Each request's life (stop strings, end-of-generation tokens, max_tokens, the context limit,
timings) is a core.request.Request, as in core.generate; with greedy sampling the output is the one generate gives for the
request alone (the batched pass keeps each sequence's numbers, see models.transformer).

The requests come from an iterator (`kvchat batch`: results/run) or from a live source that may
have none waiting while others run (`kvchat serve`: serve). A request may stream its text
(BatchRequest.on_text, called with each piece as its token is sampled) and may be cancelled
(BatchRequest.cancel, checked before every step: it finishes with finish_reason "cancelled" and its
sequence is released).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from core.backend import Backend
from core.generate import PREFILL_CHUNK
from core.kv_cache import Sequence
from core.request import Request, check_prompt
from core.sampler import Sampler
from core.types import SamplingParams, Timings
from kernels.types import prompt_pieces
from models.errors import BadInputError

DEFAULT_PARALLEL = 16   # the best of 8, 16 and 32 on qwen 0.5B, 2 cores (README: measured)
PREFILL_BUDGET = PREFILL_CHUNK  # prompt tokens per step across all joining sequences


@dataclass
class BatchRequest:
    id: Any
    prompt_ids: list[int]
    params: SamplingParams
    line: int | None = None     # where it came from in the input file (for the record)
    on_text: Callable[[str], None] | None = None   # each piece of text as it is released (streaming)
    cancel: threading.Event | None = None          # set it to end the request at the next step


# What a live source's `take` returns when no request will ever come again (serve stops).
END = object()


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
    """One running request: its KV sequence, sampler and Request (text, limits, timings)."""

    def __init__(self, req: BatchRequest, seq: Sequence, backend: Backend):
        self.req = req
        self.seq = seq
        self.state = Request(req.params, backend.tokenizer, backend.n_ctx)
        self.cache_n = backend.reuse_prefix(req.prompt_ids, seq)
        self.state.timings.cache_disk_n = seq.n_restored
        self.todo = list(req.prompt_ids[self.cache_n:])
        self.prompt_n = len(self.todo)
        self.cuts = prompt_pieces(self.prompt_n, PREFILL_CHUNK)
        self.sampler = Sampler(req.params, backend.tokenizer.n_vocab, backend.tokenizer)
        self.sampler.remember(req.prompt_ids)
        self.pieces: list[str] = []
        self.next_token: int | None = None

    def step_tokens(self, budget: int) -> list[int]:
        """The tokens this sequence runs in the next step: a prefill chunk (the same chunks as
        core.generate) or the last sampled token. [] when the prefill budget is spent."""
        if self.todo:
            n = self.cuts[0]
            return self.todo[:n] if n <= budget else []
        return [self.next_token]

    def take(self, token: int, now: float) -> bool:
        """One sampled token; True when the request is finished."""
        self._emit(self.state.take(token, self.seq.n_tokens, now))
        self.next_token = token
        return self.state.done

    def _emit(self, text: str) -> None:
        self.pieces.append(text)
        if text and self.req.on_text is not None:
            self.req.on_text(text)

    @property
    def cancelled(self) -> bool:
        return self.req.cancel is not None and self.req.cancel.is_set()

    def cancel(self) -> None:
        """End it now (before its next token): whatever text was held back is released."""
        self.state.timings.cache_n = self.cache_n
        self._emit(self.state.cancel(during_prefill_done=self.prompt_n - len(self.todo)))

    def result(self) -> BatchResult:
        s = self.state
        return BatchResult(self.req.id, "".join(self.pieces), s.tokens, s.finish_reason, s.timings, line=self.req.line)


class BatchScheduler:
    """Runs requests with continuous batching on a backend whose capabilities.batch is set."""

    def __init__(self, backend: Backend, parallel: int = DEFAULT_PARALLEL, prefill_budget: int = PREFILL_BUDGET):
        if not backend.capabilities.batch:
            raise BadInputError(f"the {backend.name} backend does not batch (native and torch do)")
        if parallel < 1:
            raise BadInputError("--parallel must be >= 1")
        self.backend = backend
        self.n_ctx = backend.n_ctx
        self.parallel = parallel
        self.prefill_budget = prefill_budget
        backend.reserve_sequences(parallel)
        self._free: list[Sequence] = []
        self.steps = 0

    def _sequence(self) -> Sequence:
        return self._free.pop() if self._free else self.backend.new_sequence()

    def run(self, requests: Iterable[BatchRequest], on_finish: Callable[[BatchResult], None],
            on_start: Callable[[BatchRequest], None] | None = None) -> None:
        """Run every request; on_finish gets each result as soon as it is done (errors included)."""
        for _ in self.results(requests, on_start):
            on_finish(_)

    def results(self, requests: Iterable[BatchRequest],
                on_start: Callable[[BatchRequest], None] | None = None) -> Iterator[BatchResult]:
        waiting: Iterator[BatchRequest] = iter(requests)
        return self._loop(lambda block: next(waiting, END), on_start)

    def serve(self, take: Callable[[bool], "BatchRequest | None | object"],
              on_finish: Callable[[BatchResult], None]) -> None:
        """Run requests from a live source until it says END. take(block) returns the next waiting
        request, or None when there is none: it is called with block=True only when no sequence is
        running (it may then wait for one), so running sequences never wait for new requests."""
        for result in self._loop(take):
            on_finish(result)

    def _loop(self, take: Callable[[bool], "BatchRequest | None | object"],
              on_start: Callable[[BatchRequest], None] | None = None) -> Iterator[BatchResult]:
        active: list[_Active] = []
        exhausted = False
        while True:
            done: deque[BatchResult] = deque()
            while len(active) < self.parallel and not exhausted:   # join at once
                req = take(not active)
                if req is END:
                    exhausted = True
                    break
                if req is None:
                    break
                err = self._check(req)
                if err:
                    done.append(BatchResult(req.id, error=err, line=req.line))
                    continue
                if req.cancel is not None and req.cancel.is_set():   # cancelled while it waited
                    done.append(BatchResult(req.id, finish_reason="cancelled", line=req.line))
                    continue
                if on_start:
                    on_start(req)
                active.append(_Active(req, self._sequence(), self.backend))
            yield from done
            if not active:
                if exhausted:
                    return
                continue
            yield from self._step(active)

    def _check(self, req: BatchRequest) -> str | None:
        try:
            req.params.validate()
            check_prompt(req.prompt_ids, self.n_ctx)
            if req.params.banned:   # backing off needs a rollback of one sequence mid-batch
                raise BadInputError("banned strings are not supported in batch (use kvchat run --ban)")
        except BadInputError as e:
            return str(e)
        return None

    def _step(self, active: list[_Active]) -> Iterator[BatchResult]:
        """One forward pass over all active sequences; yields the requests that finished."""
        for a in [a for a in active if a.cancelled]:
            a.cancel()
            active.remove(a)
            yield self._release(a)
        if not active:
            return
        budget = max(self.prefill_budget, PREFILL_CHUNK)
        ran: list[tuple[_Active, list[int]]] = []
        for a in active:
            ids = a.step_tokens(budget)   # the budget starts at >= one chunk: some sequence always runs
            if not ids:
                continue
            if a.todo:
                budget -= len(ids)
            ran.append((a, ids))
        logits = self.backend.forward_batch([(a.seq, ids) for a, ids in ran])   # (len(ran), n_vocab)
        self.steps += 1
        now = time.perf_counter()
        finished: list[_Active] = []
        for (a, ids), row in zip(ran, logits):
            if a.todo:
                del a.todo[:len(ids)]
                a.cuts.pop(0)
                if a.todo:
                    continue
                a.state.prompt_read(a.prompt_n, a.cache_n, now)
            if a.take(a.sampler.sample(row), now):
                finished.append(a)
        for a in finished:
            active.remove(a)
            yield self._release(a)

    def _release(self, a: _Active) -> BatchResult:
        self.backend.persist(a.seq)
        a.seq.release()     # its full blocks stay registered: later prompts can reuse them
        self._free.append(a.seq)
        return a.result()


__all__ = ["BatchRequest", "BatchResult", "BatchScheduler", "DEFAULT_PARALLEL", "END"]
