"""Speculative decoding: draft a few tokens cheaply, verify them all in one forward pass of the
target model, keep the accepted ones and roll the KV cache back past the rest.

Two drafters:
- prompt lookup: the tokens that followed the latest n-gram the last time it appeared in the
  prompt or the output (free, strong on input-grounded answers such as "rewrite this code");
- a draft model with the same vocabulary (qwen2.5-coder-0.5b drafting for -1.5b): its greedy
  continuation, from its own KV cache, which is rolled back with the target's.

Greedy verification keeps exactly the tokens plain greedy decoding would produce (the backend runs
a small verification batch through its one-token kernels, so the logits are the same numbers).
Sampled verification uses the standard rule for a deterministic draft: accept draft token d with
probability p(d), else sample from p with d removed; the output distribution is unchanged.
Under a JSON schema or grammar (core.constrained) the draft is cut where the grammar stops allowing
it, and each row is verified against masked logits, so the output follows the grammar.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from core.sampler import Sampler

# Suffix n-grams up to this long are looked up, longest first (a longer match predicts better: on
# the code-rewrite benchmark 5 beats 3).
MAX_NGRAM = 5
# A draft model stops drafting when its own probability that the whole draft so far is right (the
# product of its probabilities for its greedy tokens) falls below this: a draft token is worth its
# cost (a draft step plus a verified row, about half a plain step on the 1.5B) only when it is
# likely to be accepted together with all before it. Chosen by replaying recorded draft chains
# against a per-token threshold (README: measured).
DRAFT_MIN_P = 0.7
# A draft model scores only the first DRAFT_VOCAB tokens of its vocabulary. Its output matrix is a
# third of what a 0.5B model reads per token; BPE vocabularies put the common merges first, so the
# tokens a draft gets accepted for are nearly all there (code rewrite, 0.5B for 1.5B: 89% of drafts
# accepted vs 92% with the whole vocabulary; 83% at 32768), and verification keeps the output exact.
DRAFT_VOCAB = 65536


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


class LookupDrafter:
    """Prompt lookup with an adaptive length: one token after a miss, twice as many after a check
    that accepted the whole draft (up to the caller's limit). Inside a span the answer copies, drafts
    grow and most tokens come several per check; where the answer departs from its input, a short
    draft wastes little of the check (README: measured against a fixed length)."""

    def __init__(self):
        self.length = 1

    def propose(self, history: Sequence[int], n: int) -> list[int]:
        return lookup_draft(history, min(self.length, n))

    def result(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.length = min(2 * self.length, 64) if accepted == drafted else 1

    def keep(self, n_tokens: int) -> None:
        pass


class ModelDrafter:
    """Greedy drafts from a smaller model on its own backend (KV cache). The draft backend has seen
    `fed` tokens of the history: the whole prompt once constructed (the part its cache does not
    hold is read then, with the target's prompt processing); each proposal first feeds it what it
    has not seen (the last accepted token and the target's correction) in one pass."""

    def __init__(self, backend, prompt_ids: Sequence[int]):
        self.backend = backend
        prompt_ids = list(prompt_ids)
        self.fed = backend.reuse_prefix(prompt_ids)
        for s in range(self.fed, len(prompt_ids), 256):
            backend.extend(prompt_ids[s:s + 256], DRAFT_VOCAB)
        self.fed = len(prompt_ids)
        backend.stats.n_past = self.fed

    def propose(self, history: Sequence[int], n: int) -> list[int]:
        b = self.backend
        new = list(history[self.fed:])
        logits = None
        for s in range(0, len(new), 256):
            chunk = new[s:s + 256]
            logits = b.extend(chunk, DRAFT_VOCAB, decode_rows=len(chunk) <= 8)   # the usual 1-2 tokens: fused
        self.fed += len(new)
        out: list[int] = []
        p_all = 1.0                        # the draft's own probability that its whole draft is right
        for i in range(n):
            best = int(np.argmax(logits))
            p_all *= self._confidence(logits, best)
            if p_all < DRAFT_MIN_P:
                break                      # a likely miss: verifying it costs more than it saves
            out.append(best)
            if i < n - 1:
                logits = b.extend([best], DRAFT_VOCAB)
                self.fed += 1
        return out

    @staticmethod
    def _confidence(logits: np.ndarray, best: int) -> float:
        """The draft model's probability of its own greedy token."""
        z = logits.astype(np.float64) - float(logits[best])
        return float(1.0 / np.exp(z).sum())

    def result(self, drafted: int, accepted: int) -> None:
        pass

    def keep(self, n_tokens: int) -> None:
        """The target kept n_tokens of history; drop the draft's rejected tokens beyond them."""
        if self.fed > n_tokens:
            self.backend.rollback(n_tokens)
            self.fed = n_tokens


def speculative_tokens(backend, logits: np.ndarray, sampler: Sampler, prompt_ids: Sequence[int],
                       config, drafter=None) -> Iterator[int]:
    """Yields tokens like core.generate's plain decoding, several per forward pass when drafts are accepted.
    `drafter` proposes (LookupDrafter when None)."""
    drafter = drafter or LookupDrafter()
    history = list(prompt_ids)
    stats = backend.stats
    token = sampler.sample(logits)
    while True:
        yield token
        history.append(token)
        room = backend.n_ctx - stats.n_past - 2                 # keep one slot for the bonus token
        draft = drafter.propose(history, min(config.max_draft, room)) if room > 0 else []
        if sampler.constraint is not None:      # draft tokens the grammar disallows would be rejected
            draft = draft[:sampler.constraint.valid_prefix(draft)]
        base = stats.n_past
        rows = backend.verify([token] + draft)            # (1 + len(draft), n_vocab)
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
        drafter.result(len(draft), accepted)
        keep = base + 1 + accepted
        if keep < base + 1 + len(draft):
            backend.rollback(keep)
        stats.n_past = keep
        drafter.keep(len(history))
