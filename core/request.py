"""One request's life, from its prompt to its last token: the text it streams, when it ends and why,
and its timings.

The generation loop (core.generate), the batch scheduler (core.batch) and the server all drive a
Request, so a request ends the same way whichever path runs it: at an end-of-generation token, at a
stop string (never printed, even when it spans tokens), at max_tokens or a full context, or when it
is cancelled. Text is released through an incremental UTF-8 decoder, so a character is never cut.
"""
from __future__ import annotations

import time
from typing import Sequence

from core.tokenizer import Tokenizer
from core.types import SamplingParams, Timings
from models.errors import BadInputError


def check_prompt(prompt_ids: Sequence[int], n_ctx: int) -> None:
    """A prompt must leave room for at least one generated token."""
    if not prompt_ids:
        raise BadInputError("the prompt is empty")
    if len(prompt_ids) >= n_ctx:
        raise BadInputError(f"the prompt is {len(prompt_ids)} tokens but the context holds {n_ctx}; "
                            "shorten it or raise --ctx")


def partial_match_len(text: str, strings: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `strings`: the text
    that must be held back because more tokens could still complete one of them."""
    return max((k for s in strings for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)


def split_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str, bool]:
    """Split streamed text into (safe to emit, held back, stop found). Text is held back while its
    tail could still grow into a stop string, so a stop string is never emitted, even when it
    spans several tokens."""
    if not stops:
        return text, "", False
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if first >= 0:
        return text[:first], "", True
    keep = partial_match_len(text, stops)
    return text[:len(text) - keep], text[len(text) - keep:], False


class Request:
    """The state of one generation after its prompt: feed it each sampled token with `take`."""

    def __init__(self, params: SamplingParams, tokenizer: Tokenizer, n_ctx: int, t_start: float | None = None):
        self.params = params
        self.n_ctx = n_ctx
        self.eog_ids = tokenizer.eog_ids
        self.detok = tokenizer.stream_decoder()
        self.held = ""                       # text that may be the start of a stop string
        self.tokens: list[int] = []          # the generated ids (an end-of-generation token is not output)
        self.timings = Timings()
        self.finish_reason: str | None = None
        self.t_start = time.perf_counter() if t_start is None else t_start
        self.t_prompt_end: float | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def prompt_read(self, prompt_n: int, cache_n: int, now: float | None = None) -> None:
        """The prompt is in the KV cache: cache_n tokens reused, prompt_n computed."""
        self.t_prompt_end = time.perf_counter() if now is None else now
        t = self.timings
        t.prompt_n, t.cache_n = prompt_n, cache_n
        t.prompt_ms = (self.t_prompt_end - self.t_start) * 1000

    def take(self, token: int, n_past: int, now: float | None = None) -> str:
        """Account for one sampled token (n_past: tokens in the KV cache before it) and return the
        text it releases. When the request ends with it, finish_reason is set and the text
        includes whatever was held back, except text after a stop string."""
        now = time.perf_counter() if now is None else now
        t = self.timings
        t.predicted_n += 1
        if t.predicted_n == 1:
            t.ttft_ms = (now - self.t_start) * 1000
        t.predicted_ms = (now - self.t_prompt_end) * 1000 if self.t_prompt_end is not None else 0.0
        if token in self.eog_ids:
            self.finish_reason = "stop"
            return self._flush()
        self.tokens.append(token)
        self.held += self.detok.feed(token)
        emit, self.held, hit_stop = split_at_stop(self.held, self.params.stop)
        if hit_stop:
            self.finish_reason = "stop"
            return emit
        if t.predicted_n >= self.params.max_tokens or n_past + 1 >= self.n_ctx:
            self.finish_reason = "length"
            return emit + self._flush()
        return emit

    def cancel(self, during_prefill_done: int | None = None) -> str:
        """End the request early; returns the text still held back. during_prefill_done: the
        prompt tokens computed when it was cancelled before its first token."""
        self.finish_reason = "cancelled"
        if self.t_prompt_end is None:
            self.timings.prompt_n = during_prefill_done or 0
            self.timings.prompt_ms = (time.perf_counter() - self.t_start) * 1000
        return self._flush()

    def _flush(self) -> str:
        text, self.held = self.held + self.detok.flush(), ""
        return text
