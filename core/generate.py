"""The generation loop: prompt ids and sampling parameters in, a stream of TokenEvents out.

It runs on any Backend through its public protocol, so sampling, stop strings, streaming
detokenization, cancellation and timings (one core.request.Request) behave the same whichever
engine runs. Tokens come from one of three sources: plain decoding (one forward pass per token),
guarded decoding (banned strings: back off and resample), or speculative decoding (core.speculative).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from core.request import Request, check_prompt, partial_match_len
from core.sampler import Sampler
from core.types import SamplingParams, SpeculativeConfig, TokenEvent
from kernels.types import prompt_pieces
from models.errors import BadInputError

if TYPE_CHECKING:
    from core.backend import Backend

# Prompt tokens per forward call at most: the granularity at which prefill can be cancelled. The
# calls are llama.cpp's batches cut so that every row keeps its arithmetic (types.prompt_pieces).
PREFILL_CHUNK = 256
MAX_BACKOFFS = 1000


def generate(backend: "Backend", prompt_ids: Sequence[int], params: SamplingParams,
             cancel: threading.Event | None = None,
             speculative: SpeculativeConfig | None = None, draft_backend: "Backend | None" = None
             ) -> Iterator[TokenEvent]:
    """Yield TokenEvents until the request ends (core.request). Afterwards `backend.timings` and
    `backend.finish_reason` describe the run. With `speculative`, tokens are drafted and verified
    several per forward pass; greedy output is unchanged, and sampled output keeps its
    distribution (standard accept/reject rule)."""
    params.validate()
    speculating = speculative is not None and speculative.method != "off"
    if speculating and not backend.capabilities.speculative:
        raise BadInputError(f"speculative decoding needs the native backend (not {backend.name})")
    if speculating and params.banned:
        raise BadInputError("banned strings and speculative decoding cannot be combined")
    prompt_ids = list(prompt_ids)
    check_prompt(prompt_ids, backend.n_ctx)
    cancel = cancel or threading.Event()
    req = Request(params, backend.tokenizer, backend.n_ctx)
    backend.timings, backend.finish_reason = req.timings, None
    stats = backend.stats
    stats.token_latencies_ms = []
    stats.spec_drafted = stats.spec_accepted = 0

    cache_n = backend.reuse_prefix(prompt_ids)          # (sets stats.cache_disk_n)
    todo = prompt_ids[cache_n:]
    req.timings.cache_disk_n = stats.cache_disk_n
    stats.phase, stats.cache_n, stats.prefill_done, stats.prefill_total = "prefill", cache_n, 0, len(todo)
    backend.set_phase("prefill")
    stats.n_past = cache_n
    sampler = Sampler(params, backend.tokenizer.n_vocab, backend.tokenizer)
    sampler.remember(prompt_ids)
    plain = not speculating and not params.banned
    logits = first = None
    start = 0
    for n in prompt_pieces(len(todo), PREFILL_CHUNK):
        if cancel.is_set():
            req.timings.cache_n = cache_n
            req.cancel(during_prefill_done=start)
            return _finish(backend, req)
        chunk = todo[start:start + n]
        start += n
        if plain and start == len(todo):
            first = backend.extend_sample(chunk, sampler)     # plain decoding samples where the logits are
        else:
            logits = backend.extend(chunk)
        stats.prefill_done = start
        stats.n_past = cache_n + stats.prefill_done
    drafter = None
    if speculative is not None and speculative.method == "draft":
        # the draft model reads the prompt now, as part of prompt processing (llama.cpp's
        # speculative example does the same), not inside the first draft
        from core.speculative import ModelDrafter
        if draft_backend is None:
            raise BadInputError("--speculative draft needs a loaded draft model")
        drafter = ModelDrafter(draft_backend, prompt_ids)
    req.prompt_read(len(todo), cache_n)

    stats.phase = "decode"
    backend.set_phase("decode")
    t_last = req.t_prompt_end
    if speculating:
        from core.speculative import speculative_tokens
        source = speculative_tokens(backend, logits, sampler, prompt_ids, speculative, drafter)
    elif params.banned:
        source = _guarded_tokens(backend, logits, sampler, params.banned)
    else:
        source = _plain_tokens(backend, first, sampler)
    try:
        for token in source:
            now = time.perf_counter()
            stats.token_latencies_ms.append((now - t_last) * 1000)
            t_last = now
            text = req.take(token, stats.n_past, now)
            if token in req.eog_ids:
                if text:
                    yield TokenEvent(-1, text, now)
            else:
                yield TokenEvent(token, text, now)
            if req.done:
                break
            if cancel.is_set():
                if tail := req.cancel():
                    yield TokenEvent(-1, tail, time.perf_counter())
                break
    finally:
        source.close()
        _finish(backend, req)


def _finish(backend: "Backend", req: Request) -> None:
    """The request has ended (or was abandoned): its full KV blocks go to the disk cache, if any."""
    backend.finish_reason = req.finish_reason
    backend.persist()
    backend.stats.phase = "done"


def _plain_tokens(backend: "Backend", first: int, sampler: Sampler) -> Iterator[int]:
    """One forward pass per token: hand the token out, then extend the cache with it and sample the
    next (Backend.extend_sample: on a GPU only the token id comes back)."""
    token = first
    while True:
        yield token
        token = backend.extend_sample([token], sampler)
        backend.stats.n_past += 1


@dataclass
class HeldToken:
    """A token decoded but not yet handed out (banned strings): what backing off to it restores."""
    token: int
    text: str
    pos: int                    # its position in the sequence (the cache held pos tokens before it)
    logits: np.ndarray          # the logits it was sampled from
    recent: list                # the sampler's penalty window before it
    utf8_state: tuple           # the stream decoder's state before it


def _guarded_tokens(backend: "Backend", logits: np.ndarray, sampler: Sampler,
                    banned: Sequence[str]) -> Iterator[int]:
    """Plain decoding in which no banned string ever appears. Tokens whose text could still grow
    into a banned string are held back (computed, not handed out). When one completes, decoding
    backs off: the KV cache is rolled back to the held token where the match starts, that token is
    banned at that position, and sampling resumes there with the logits it had."""
    stats = backend.stats
    decoder = backend.tokenizer.stream_decoder()
    held: list[HeldToken] = []
    bans: dict[int, set[int]] = {}          # position -> token ids banned there
    backoffs = 0
    while True:
        pos = stats.n_past
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
            if sampler.constraint is not None:      # the grammar forgets the tokens backed off from
                sampler.constraint.rollback(len(held) - k)
            bans.setdefault(first.pos, set()).add(first.token)
            if stats.n_past > first.pos:
                backend.rollback(first.pos)
            stats.n_past = first.pos
            sampler.recent.clear()
            sampler.recent.extend(first.recent)
            decoder.setstate(first.utf8_state)
            logits = first.logits
            del held[k:]
            continue
        if token in backend.tokenizer.eog_ids:
            yield from (h.token for h in held)
            return
        # hand out the held tokens whose text can no longer start a banned string
        keep = len(text) - partial_match_len(text, banned)
        released = 0
        while held and released + len(held[0].text) <= keep:
            released += len(held[0].text)
            yield held.pop(0).token
        logits = backend.extend([token])
        stats.n_past += 1
