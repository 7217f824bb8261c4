"""Speculative decoding by prompt lookup: draft the tokens that followed the latest n-gram the last
time it appeared in the prompt or the output, verify them all in one forward pass, keep the
accepted ones and roll the KV cache back past the rest.

Greedy verification keeps exactly the tokens plain greedy decoding would produce (the backend runs
a small verification batch through its one-token kernels, so the logits are the same numbers).
Sampled verification uses the standard rule for a deterministic draft: accept draft token d with
probability p(d), else sample from p with d removed; the output distribution is unchanged.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from core.sampler import Sampler

MAX_NGRAM = 3


def lookup_draft(history: Sequence[int], draft_n: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """The tokens that followed the most recent earlier occurrence of the longest suffix n-gram
    (n = max_ngram .. 1) of `history`, at most draft_n of them."""
    n_hist = len(history)
    for n in range(min(max_ngram, n_hist - 1), 0, -1):
        suffix = list(history[n_hist - n:])
        for start in range(n_hist - n - 1, -1, -1):          # most recent match first
            if list(history[start:start + n]) == suffix:
                follow = list(history[start + n:start + n + draft_n])
                if follow:
                    return follow
    return []


def speculative_tokens(backend, logits: np.ndarray, sampler: Sampler, prompt_ids: Sequence[int],
                       config) -> Iterator[int]:
    """Yields tokens like Backend._plain_tokens, several per forward pass when drafts are accepted."""
    history = list(prompt_ids)
    stats = backend.stats
    token = sampler.sample(logits)
    while True:
        yield token
        history.append(token)
        room = backend.n_ctx - stats.n_past - 2                 # keep one slot for the bonus token
        draft = lookup_draft(history, min(config.draft_n, room)) if room > 0 else []
        base = stats.n_past
        rows = backend._forward_all([token] + draft)            # (1 + len(draft), n_vocab)
        accepted = 0
        for i, proposed in enumerate(draft):
            ok, chosen = sampler.verify(rows[i], proposed)
            if not ok:
                token = chosen
                break
            accepted += 1
            yield proposed
            history.append(proposed)
        else:
            token = sampler.sample(rows[len(draft)])            # the bonus token after a full accept
        stats.spec_drafted += len(draft)
        stats.spec_accepted += accepted
        keep = base + 1 + accepted
        if keep < base + 1 + len(draft):
            backend._rollback(keep)
        stats.n_past = keep
