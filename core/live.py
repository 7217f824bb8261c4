"""Requests that arrive while others run (`kvchat serve`): one engine thread owns the backend.

Callers on any thread `submit` a request (prompt ids, sampling parameters, a callback for each piece
of text and one for the end) and get a handle whose `cancel` ends it at the next step. The engine
thread runs them:
  - on an engine that batches (capabilities.batch: native, torch), through the continuous-batching
    scheduler (core.batch.BatchScheduler.serve) over the live queue, at most `max_concurrency`
    sequences at once; the rest wait in the queue, in order;
  - on llama.cpp, one at a time through core.generate (Engine.generate), in order.
Prefix reuse and the disk KV cache are the backend's, as for the chat and `kvchat batch`.

At most `max_queue` requests wait beyond those running: `submit` raises QueueFull past that, and the
caller refuses the request (the server answers 503). Callbacks run on the engine thread: they must
not block.
"""
from __future__ import annotations

import itertools
import queue
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Callable

from core.batch import END, BatchRequest, BatchResult, BatchScheduler
from core.types import SamplingParams

DEFAULT_MAX_CONCURRENCY = 4
DEFAULT_MAX_QUEUE = 64


class QueueFull(Exception):
    """More requests wait than the queue holds."""


@dataclass
class LiveRequest:
    """A submitted request: `cancel()` ends it (its on_done still comes, finish_reason "cancelled")."""
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    on_text: Callable[[str], None]
    on_done: Callable[[BatchResult], None]
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


class LiveEngine:
    """The engine thread and its queue (see the module's docstring)."""

    def __init__(self, engine, max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
                 max_queue: int = DEFAULT_MAX_QUEUE):
        self.engine = engine
        self.backend = engine.backend
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.batching = bool(self.backend.capabilities.batch)
        self._queue: queue.Queue[LiveRequest | None] = queue.Queue()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._live: dict[int, LiveRequest] = {}       # submitted and not yet finished
        self._taken: dict[int, LiveRequest] = {}      # of those, taken off the queue by the engine thread
        self.counts = {"served": 0, "cancelled": 0, "failed": 0}
        # the scheduler reserves its sequences now, before the first request (on the caller's thread,
        # which loads the model: nothing else touches the backend yet)
        self._scheduler = BatchScheduler(self.backend, parallel=max_concurrency) if self.batching else None
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kvchat-engine", daemon=True)
        self._thread.start()

    # --- any thread --------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, on_text: Callable[[str], None],
               on_done: Callable[[BatchResult], None]) -> LiveRequest:
        with self._lock:
            if self._closing:
                raise QueueFull("the server is shutting down")
            if len(self._live) >= self.max_concurrency + self.max_queue:
                raise QueueFull(f"{len(self._live)} requests are running or waiting "
                                f"(--max-concurrency {self.max_concurrency} + a queue of {self.max_queue})")
            req = LiveRequest(next(self._ids), list(prompt_ids), params, on_text, on_done)
            self._live[req.id] = req
        self._queue.put(req)
        return req

    def status(self) -> dict:
        with self._lock:
            return {"in_flight": len(self._live), **self.counts}

    def cancel_all(self) -> None:
        """Cancel what runs and waits, and take no more requests (shutting down; does not wait)."""
        with self._lock:
            self._closing = True
            live = list(self._live.values())
        for req in live:
            req.cancel()

    def close(self, timeout: float = 10.0) -> None:
        """cancel_all, and stop the engine thread."""
        self.cancel_all()
        self._queue.put(None)
        self._thread.join(timeout)

    # --- the engine thread -------------------------------------------------------------------
    def _finish(self, req: LiveRequest, result: BatchResult) -> None:
        self._taken.pop(req.id, None)
        with self._lock:
            self._live.pop(req.id, None)
            key = "failed" if result.error is not None else \
                "cancelled" if result.finish_reason == "cancelled" else "served"
            self.counts[key] += 1
        try:
            req.on_done(result)
        except Exception:
            traceback.print_exc(file=sys.stderr)

    def _take(self, block: bool):
        try:
            req = self._queue.get(block=block)
        except queue.Empty:
            return None
        if req is None:
            return END
        self._taken[req.id] = req
        return req

    def _run(self) -> None:
        while True:
            try:
                if self._scheduler is not None:
                    self._serve_batched()
                else:
                    self._serve_one_by_one()
                return
            except Exception:   # never the server's end: fail what was in flight, then go on
                traceback.print_exc(file=sys.stderr)
                for req in list(self._taken.values()):
                    self._finish(req, BatchResult(req.id, error="internal error in the engine"))
                if self._scheduler is not None:   # its sequences were lost with the failed step
                    self._scheduler = BatchScheduler(self.backend, parallel=self.max_concurrency)

    def _serve_batched(self) -> None:
        def take(block: bool):
            req = self._take(block)
            if isinstance(req, LiveRequest):
                return BatchRequest(req.id, req.prompt_ids, req.params, on_text=req.on_text, cancel=req.cancelled)
            return req

        def on_finish(result: BatchResult) -> None:
            self._finish(self._taken[result.id], result)

        self._scheduler.serve(take, on_finish)

    def _serve_one_by_one(self) -> None:
        from core.request import check_prompt
        from models.errors import BadInputError
        while True:
            req = self._take(True)
            if req is END:
                return
            if req.cancelled.is_set():
                self._finish(req, BatchResult(req.id, finish_reason="cancelled"))
                continue
            tokens: list[int] = []
            pieces: list[str] = []
            try:
                check_prompt(req.prompt_ids, self.backend.n_ctx)
                for event in self.engine.generate(req.prompt_ids, req.params, req.cancelled):
                    if event.id >= 0:
                        tokens.append(event.id)
                    if event.text:
                        pieces.append(event.text)
                        req.on_text(event.text)
            except BadInputError as e:
                self._finish(req, BatchResult(req.id, error=str(e)))
                continue
            b = self.backend
            self._finish(req, BatchResult(req.id, "".join(pieces), tokens, finish_reason=b.finish_reason, timings=b.timings))


__all__ = ["DEFAULT_MAX_CONCURRENCY", "DEFAULT_MAX_QUEUE", "LiveEngine", "LiveRequest", "QueueFull"]
