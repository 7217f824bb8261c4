"""The backend interface: prompt token ids and sampling parameters in, a stream of TokenEvents out.

Every backend (llama.cpp, the native CPU engine, the CUDA engine) implements two primitives,
`_reuse_prefix` and `_forward`. The generation loop here is shared, so sampling, stop strings,
streaming detokenization, cancellation and timings behave the same whichever engine runs.
"""
from __future__ import annotations

import math
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import ClassVar, Iterator, Sequence

import numpy as np

from core.sampler import Sampler
from core.tokenizer import Tokenizer
from models.errors import BadInputError

PREFILL_CHUNK = 256  # prompt tokens per forward call: the granularity at which prefill can be cancelled


@dataclass(frozen=True)
class SamplingParams:
    """What the user asks of one generation. `validate` refuses values out of range."""
    temperature: float = 0.8        # 0 = greedy
    top_k: int = 40                 # 0 = off
    top_p: float = 0.95             # 1 = off
    min_p: float = 0.05             # 0 = off
    repeat_penalty: float = 1.0     # 1 = off
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 512
    stop: tuple[str, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit); -inf bans it
    banned: tuple[str, ...] = ()    # strings that must never appear in the output (back off and resample)

    def validate(self) -> "SamplingParams":
        checks = [
            (math.isfinite(self.temperature) and 0 <= self.temperature <= 10, "temperature must be in [0, 10]"),
            (self.top_k >= 0, "top-k must be >= 0"),
            (0 < self.top_p <= 1, "top-p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min-p must be in [0, 1]"),
            (math.isfinite(self.repeat_penalty) and 0 < self.repeat_penalty <= 10, "repeat penalty must be in (0, 10]"),
            (self.repeat_last_n >= 0, "repeat-last-n must be >= 0"),
            (abs(self.presence_penalty) <= 10, "presence penalty must be in [-10, 10]"),
            (abs(self.frequency_penalty) <= 10, "frequency penalty must be in [-10, 10]"),
            (self.max_tokens >= 1, "max tokens must be >= 1"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed must be in [0, 2^63)"),
            (all(self.stop), "a stop string must not be empty"),
            (all(self.banned), "a banned string must not be empty"),
            (all(t >= 0 and (math.isfinite(b) or b == -math.inf) for t, b in self.logit_bias),
             "logit bias needs a token id >= 0 and a finite bias (or -inf)"),
        ]
        for ok, message in checks:
            if not ok:
                raise BadInputError(message)
        return self


@dataclass(frozen=True)
class TokenEvent:
    """One generated token: its id, the text it completes (may be "" while a UTF-8 character or a
    possible stop string is held back), and when it was produced (time.perf_counter seconds)."""
    id: int
    text: str
    t: float


@dataclass
class Timings:
    """llama-server's field names, plus ttft_ms (request start to first token)."""
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    ttft_ms: float = 0.0
    cache_n: int = 0

    @property
    def prompt_per_second(self) -> float:
        return 1000 * self.prompt_n / self.prompt_ms if self.prompt_ms > 0 else 0.0

    @property
    def predicted_per_second(self) -> float:
        return 1000 * self.predicted_n / self.predicted_ms if self.predicted_ms > 0 else 0.0

    def as_dict(self) -> dict:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}

    def summary(self) -> str:
        return (f"ttft {self.ttft_ms:.0f} ms | prompt {self.prompt_n} tok, {self.prompt_per_second:.1f} tok/s"
                f" (cached {self.cache_n}) | eval {self.predicted_n} tok, {self.predicted_per_second:.1f} tok/s")


SPECULATIVE_METHODS = ("off", "lookup", "draft")


# Most tokens drafted per check by default: prompt lookup adapts its length up to this (see
# core.speculative.LookupDrafter); a draft model stops earlier where it is unsure of its draft
# (core.speculative.DRAFT_MIN_P), so a high cap costs little (code rewrite, 0.5B for 1.5B, stopping
# at a token below 0.5: 1.10-1.13x at 3, 1.29-1.39x at 7).
DEFAULT_DRAFT_N = {"off": 1, "lookup": 7, "draft": 7}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "off"            # off | lookup | draft
    draft_n: int | None = None     # most tokens drafted per verification pass; None = the method's default
    draft_model: str | None = None # registry name or path of the draft model (method "draft")

    @property
    def max_draft(self) -> int:
        return DEFAULT_DRAFT_N.get(self.method, 1) if self.draft_n is None else self.draft_n

    def validate(self) -> "SpeculativeConfig":
        if self.method not in SPECULATIVE_METHODS:
            raise BadInputError(f"unknown speculative method '{self.method}' ({', '.join(SPECULATIVE_METHODS)})")
        if self.method == "draft" and not self.draft_model:
            raise BadInputError("--speculative draft needs --draft-model (e.g. qwen2.5-coder-0.5b-instruct)")
        if not 1 <= self.max_draft <= 7:   # 1 + 7 tokens per check stay on the one-token kernels
            raise BadInputError("--draft-n must be between 1 and 7")
        return self


@dataclass
class LiveStats:
    """Counters the engine updates as it works; the TUI's X-ray panel reads them (never estimates)."""
    phase: str = "idle"            # idle | prefill | decode | done
    prefill_done: int = 0
    prefill_total: int = 0
    cache_n: int = 0
    n_past: int = 0                # tokens in the KV cache for the current sequence
    n_ctx: int = 0
    token_latencies_ms: list[float] = field(default_factory=list)
    spec_drafted: int = 0          # draft tokens proposed / accepted this turn (speculative decoding)
    spec_accepted: int = 0


MAX_BACKOFFS = 1000


@dataclass
class HeldToken:
    """A token decoded but not yet handed out (banned strings): what backing off to it restores."""
    token: int
    text: str
    pos: int                    # its position in the sequence (the cache held pos tokens before it)
    logits: np.ndarray          # the logits it was sampled from
    recent: list                # the sampler's penalty window before it
    utf8_state: tuple           # the stream decoder's state before it


class Backend(ABC):
    """A loaded model that can extend one sequence's KV cache and return next-token logits."""
    name: ClassVar[str]
    device: str = "cpu"

    def __init__(self, tokenizer: Tokenizer, n_ctx: int):
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.stats = LiveStats(n_ctx=n_ctx)
        self.timings = Timings()
        self.finish_reason: str | None = None

    # --- the two primitives each engine provides -------------------------------------------
    @abstractmethod
    def _reuse_prefix(self, ids: Sequence[int]) -> int:
        """Keep the longest cached prefix of `ids` (at most len(ids)-1 tokens, so there is always one
        token left to run) and drop the rest of the cache. Returns the number of tokens kept."""

    @abstractmethod
    def _forward(self, ids: Sequence[int]) -> np.ndarray:
        """Append `ids` to the cached sequence and return the logits of the last one, (n_vocab,) float32."""

    def close(self) -> None:
        """Release the model's memory."""

    def kv_block_map(self) -> list[str]:
        """State of each KV block: 'used', 'shared' (holds a reused prefix) or 'free'."""
        return []

    # --- the shared generation loop --------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 cancel: threading.Event | None = None,
                 speculative: "SpeculativeConfig | None" = None, draft_backend: "Backend | None" = None
                 ) -> Iterator[TokenEvent]:
        """Yield TokenEvents until an end-of-generation token, a stop string, max_tokens, a full
        context or `cancel`. Afterwards `self.timings` and `self.finish_reason` describe the run.
        With `speculative`, tokens are drafted and verified several per forward pass; greedy output
        is unchanged, and sampled output keeps its distribution (standard accept/reject rule)."""
        params.validate()
        if speculative is not None and speculative.method != "off" and not self.supports_speculative:
            raise BadInputError(f"speculative decoding needs the native backend (not {self.name})")
        if speculative is not None and speculative.method != "off" and params.banned:
            raise BadInputError("banned strings and speculative decoding cannot be combined")
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise BadInputError("the prompt is empty")
        if len(prompt_ids) >= self.n_ctx:
            raise BadInputError(f"the prompt is {len(prompt_ids)} tokens but the context holds {self.n_ctx}; "
                                "shorten it or raise --ctx")
        cancel = cancel or threading.Event()
        t_start = time.perf_counter()
        self.timings = Timings()
        self.finish_reason = None
        stats = self.stats
        stats.token_latencies_ms = []
        stats.spec_drafted = stats.spec_accepted = 0

        cache_n = self._reuse_prefix(prompt_ids)
        todo = prompt_ids[cache_n:]
        stats.phase, stats.cache_n, stats.prefill_done, stats.prefill_total = "prefill", cache_n, 0, len(todo)
        self._enter_phase("prefill")
        stats.n_past = cache_n
        logits = None
        for start in range(0, len(todo), PREFILL_CHUNK):
            if cancel.is_set():
                return self._finish("cancelled", t_start, None, cache_n, start)
            logits = self._forward(todo[start:start + PREFILL_CHUNK])
            stats.prefill_done = min(start + PREFILL_CHUNK, len(todo))
            stats.n_past = cache_n + stats.prefill_done
        drafter = None
        if speculative is not None and speculative.method == "draft":
            # the draft model reads the prompt now, as part of prompt processing (llama.cpp's
            # speculative example does the same), not inside the first draft
            from core.speculative import ModelDrafter
            if draft_backend is None:
                raise BadInputError("--speculative draft needs a loaded draft model")
            drafter = ModelDrafter(draft_backend, prompt_ids)
        t_prompt_end = time.perf_counter()
        self.timings.prompt_n, self.timings.cache_n = len(todo), cache_n
        self.timings.prompt_ms = (t_prompt_end - t_start) * 1000

        sampler = Sampler(params, self.tokenizer.n_vocab)
        sampler.remember(prompt_ids)
        detok = self.tokenizer.stream_decoder()
        held = ""              # text that may be the start of a stop string
        stats.phase = "decode"
        self._enter_phase("decode")
        t_last = t_prompt_end
        n_out = 0
        if speculative is not None and speculative.method != "off":
            from core.speculative import speculative_tokens
            source = speculative_tokens(self, logits, sampler, prompt_ids, speculative, drafter)
        elif params.banned:
            source = self._guarded_tokens(logits, sampler, params.banned)
        else:
            source = self._plain_tokens(logits, sampler)
        for token in source:
            n_out += 1
            now = time.perf_counter()
            if n_out == 1:
                self.timings.ttft_ms = (now - t_start) * 1000
            stats.token_latencies_ms.append((now - t_last) * 1000)
            t_last = now
            self.timings.predicted_n = n_out
            self.timings.predicted_ms = (now - t_prompt_end) * 1000
            if token in self.tokenizer.eog_ids:
                source.close()
                tail = held + detok.flush()
                if tail:
                    yield TokenEvent(-1, tail, now)
                return self._finish("stop", t_start, t_prompt_end, cache_n, len(todo))
            held += detok.feed(token)
            emit, held, hit_stop = split_at_stop(held, params.stop)
            yield TokenEvent(token, emit, now)
            if hit_stop:
                source.close()
                return self._finish("stop", t_start, t_prompt_end, cache_n, len(todo))
            if n_out >= params.max_tokens or stats.n_past + 1 >= self.n_ctx or cancel.is_set():
                break
        source.close()
        tail = held + detok.flush()
        if tail:
            yield TokenEvent(-1, tail, time.perf_counter())
        self._finish("cancelled" if cancel.is_set() else "length", t_start, t_prompt_end, cache_n, len(todo))

    def _enter_phase(self, phase: str) -> None:
        """Called as generation enters "prefill" and "decode" (a backend may retune its threads)."""

    def _plain_tokens(self, logits: np.ndarray, sampler: Sampler) -> Iterator[int]:
        """One forward pass per token: sample, hand the token out, then extend the cache with it."""
        while True:
            token = sampler.sample(logits)
            yield token
            logits = self._forward([token])
            self.stats.n_past += 1

    def _guarded_tokens(self, logits: np.ndarray, sampler: Sampler, banned: Sequence[str]) -> Iterator[int]:
        """Plain decoding in which no banned string ever appears. Tokens whose text could still grow
        into a banned string are held back (computed, not handed out). When one completes, decoding
        backs off: the KV cache is rolled back to the held token where the match starts, that token is
        banned at that position, and sampling resumes there with the logits it had."""
        decoder = self.tokenizer.stream_decoder()
        held: list[HeldToken] = []
        bans: dict[int, set[int]] = {}          # position -> token ids banned there
        backoffs = 0
        while True:
            pos = self.stats.n_past
            masked = logits
            if pos in bans:
                masked = logits.copy()
                masked[list(bans[pos])] = -np.inf
            recent = list(sampler.recent)
            utf8_state = decoder.getstate()
            token = sampler.sample(masked)
            held.append(HeldToken(token, decoder.feed(token), pos, logits, recent, utf8_state))
            text = "".join(h.text for h in held)
            hit = min((i for i in (text.find(b) for b in banned) if i >= 0), default=-1)
            if hit >= 0:                        # back off to the held token where the match starts
                backoffs += 1
                if backoffs > MAX_BACKOFFS:
                    raise BadInputError(f"gave up after {MAX_BACKOFFS} back-offs avoiding the banned strings")
                k, end = 0, len(held[0].text)
                while end <= hit:
                    k += 1
                    end += len(held[k].text)
                first = held[k]
                bans.setdefault(first.pos, set()).add(first.token)
                if self.stats.n_past > first.pos:
                    self._rollback(first.pos)
                self.stats.n_past = first.pos
                sampler.recent.clear()
                sampler.recent.extend(first.recent)
                decoder.setstate(first.utf8_state)
                logits = first.logits
                del held[k:]
                continue
            if token in self.tokenizer.eog_ids:
                yield from (h.token for h in held)
                return
            # hand out the held tokens whose text can no longer start a banned string
            keep = len(text) - max((n for b in banned for n in range(min(len(b) - 1, len(text)), 0, -1)
                                    if text.endswith(b[:n])), default=0)
            released = 0
            while held and released + len(held[0].text) <= keep:
                released += len(held[0].text)
                yield held.pop(0).token
            logits = self._forward([token])
            self.stats.n_past += 1

    # Speculative decoding needs two more primitives; backends that have them set this True.
    supports_speculative: ClassVar[bool] = False

    def _forward_all(self, ids: Sequence[int]) -> np.ndarray:
        """Append `ids` and return the logits at every one of them, (len(ids), n_vocab)."""
        raise NotImplementedError

    def _rollback(self, n_tokens: int) -> None:
        """Drop cached tokens past the first n_tokens (rejected drafts, banned strings)."""
        raise NotImplementedError

    def _finish(self, reason: str, t_start: float, t_prompt_end: float | None, cache_n: int,
                prompt_done: int) -> None:
        self.finish_reason = reason
        self.stats.phase = "done"
        if t_prompt_end is None:  # cancelled during prefill
            self.timings.prompt_n, self.timings.cache_n = prompt_done, cache_n
            self.timings.prompt_ms = (time.perf_counter() - t_start) * 1000


def split_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str, bool]:
    """Split streamed text into (safe to emit, held back, stop found). Text is held back while its
    tail could still grow into a stop string, so a stop string is never emitted, even when it
    spans several tokens."""
    if not stops:
        return text, "", False
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if first >= 0:
        return text[:first], "", True
    keep = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                keep = max(keep, k)
                break
    return text[:len(text) - keep], text[len(text) - keep:], False
