"""Token sampling over one logits vector, in llama.cpp's order:
grammar mask -> penalties -> top-k -> top-p -> min-p -> temperature -> draw.

Temperature 0 is greedy (argmax after penalties). The seed fixes our own generator, so a sampled run
is reproducible whichever backend produced the logits. A JSON schema or grammar (core.constrained)
sets the tokens it disallows to -inf first, and moves on with every token this sampler picks.
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Iterable

import numpy as np


class Sampler:
    def __init__(self, params, n_vocab: int, tokenizer=None):
        """`tokenizer` is needed only when params constrain the output (json_schema, grammar)."""
        self.params = params
        self.n_vocab = n_vocab
        seed = params.seed if params.seed is not None else np.random.SeedSequence().entropy
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.recent: deque[int] = deque(maxlen=max(params.repeat_last_n, 0))
        self.constraint = None
        if params.json_schema or params.grammar:
            from core.constrained import Constraint
            if tokenizer is None:
                raise ValueError("a constrained Sampler needs the tokenizer")
            self.constraint = Constraint(params, tokenizer)

    def remember(self, ids: Iterable[int]) -> None:
        """Add tokens to the penalty window (the prompt, then each sampled token)."""
        if self.recent.maxlen:
            self.recent.extend(ids)

    def picked(self, token: int) -> None:
        """The token is part of the output now: the penalty window and the grammar move past it."""
        self.remember([token])
        if self.constraint is not None:
            self.constraint.advance(token)

    def prepare(self, logits: np.ndarray) -> np.ndarray:
        """The grammar's mask, then logit bias and penalties: what top-k and the rest start from."""
        logits = np.asarray(logits, dtype=np.float32)
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        return self.apply_penalties(logits)

    def sample(self, logits: np.ndarray) -> int:
        logits = self.prepare(logits)
        if self.params.temperature <= 0:
            token = int(np.argmax(logits))
        else:
            ids, probs = self.candidates(logits)
            # Draw over the candidates in id order, not rank order: two backends whose logits differ
            # by float noise then pick the same token unless the draw lands right on a boundary.
            order = np.argsort(ids)
            token = int(ids[order][self.rng.choice(len(ids), p=probs[order])])
        self.picked(token)
        return token

    def verify(self, logits: np.ndarray, proposed: int) -> tuple[bool, int]:
        """Speculative decoding's check of one draft token against the target logits: (accepted,
        token). Greedy accepts iff the draft is the argmax. Sampled accepts with probability p(draft)
        and otherwise draws from p without the draft, which leaves the distribution unchanged. The
        logits are masked first, so a draft the grammar disallows (p = 0) is always rejected."""
        logits = self.prepare(logits)
        if self.params.temperature <= 0:
            token = int(np.argmax(logits))
            self.picked(token)
            return token == proposed, token
        ids, probs = self.candidates(logits)
        p_draft = float(probs[ids == proposed].sum())
        if self.rng.random() < p_draft:
            self.picked(proposed)
            return True, proposed
        rest = np.where(ids == proposed, 0.0, probs)
        order = np.argsort(ids)
        token = int(ids[order][self.rng.choice(len(ids), p=rest[order] / rest.sum())])
        self.picked(token)
        return False, token

    def apply_penalties(self, logits: np.ndarray) -> np.ndarray:
        """Logit bias first, then repetition / presence / frequency penalties over the window."""
        p = self.params
        if p.logit_bias:
            logits = logits.copy()
            for token, bias in p.logit_bias:
                if token < len(logits):
                    logits[token] += bias
        if not self.recent or (p.repeat_penalty == 1 and p.presence_penalty == 0 and p.frequency_penalty == 0):
            return logits
        logits = logits.copy()
        counts = Counter(self.recent)
        ids = np.fromiter(counts.keys(), dtype=np.int64)
        n = np.fromiter(counts.values(), dtype=np.float32)
        picked = logits[ids]
        picked = np.where(picked > 0, picked / p.repeat_penalty, picked * p.repeat_penalty)
        logits[ids] = picked - n * p.frequency_penalty - p.presence_penalty
        return logits

    def candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ids that survive top-k, top-p and min-p, with their final probabilities (after temperature)."""
        p = self.params
        k = p.top_k if 0 < p.top_k < len(logits) else len(logits)
        ids = np.argpartition(-logits, k - 1)[:k] if k < len(logits) else np.arange(len(logits))
        ids = ids[np.argsort(-logits[ids], kind="stable")]          # (k,) best first
        z = logits[ids].astype(np.float64)
        probs = np.exp(z - z[0])
        probs /= probs.sum()
        if p.top_p < 1:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)  # smallest set with mass >= top_p
            ids, z, probs = ids[:keep], z[:keep], probs[:keep]
        if p.min_p > 0:
            keep = max(1, int(np.sum(probs >= p.min_p * probs[0])))
            ids, z = ids[:keep], z[:keep]
        scaled = (z - z[0]) / p.temperature
        final = np.exp(scaled)
        return ids, final / final.sum()
