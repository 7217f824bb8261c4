"""core.sampler's pipeline on a torch device: the torch engine's logits stay where they were made.

A decode step on a GPU produces n_vocab float32 logits; copying them to the host and sampling
there costs a transfer and a synchronisation per token that a fast GPU step would then wait on.
Here the same steps as Sampler.sample (logit bias, penalties, top-k, top-p, min-p, temperature,
the draw in id order) run as torch operations on the logits' device, and only the chosen id is
read back. The uniform number of the draw comes from the host Sampler's generator, and the
candidate probabilities are float64 as on the host, so a seeded run picks the tokens the host
sampler would pick from the same logits (tests check this on CPU tensors).

The cut-offs are masks, not slices, and scalars enter as Python numbers, so that no step waits for
the device (a tensor built from host data is a blocking copy: the few ids of a logit bias or a
penalty window go through pinned memory, asynchronously). A grammar's mask (core.constrained) is
computed on the host and crosses the same way, as one bool a token.
"""
from __future__ import annotations

from collections import Counter

import torch

from core.sampler import Sampler


def _to(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host numbers on the device without waiting for it (pinned memory, a non-blocking copy)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def penalized(sampler: Sampler, logits: torch.Tensor) -> torch.Tensor:
    """Sampler.prepare on a (n_vocab,) device tensor: the grammar's mask, bias, then the window's penalties."""
    p = sampler.params
    z = logits.float()
    if sampler.constraint is not None:
        allowed = torch.from_numpy(sampler.constraint.allowed(z.shape[0]))              # (V,) bool, host
        allowed = allowed.pin_memory().to(z.device, non_blocking=True) if z.device.type == "cuda" else allowed.to(z.device)
        z = z.masked_fill(~allowed, float("-inf"))
    if p.logit_bias:
        pairs = [(t, b) for t, b in p.logit_bias if t < z.shape[0]]
        if pairs:
            ids = _to([t for t, _ in pairs], torch.int64, z.device)
            bias = _to([b for _, b in pairs], torch.float32, z.device)
            z = z.index_add(0, ids, bias)
    if not sampler.recent or (p.repeat_penalty == 1 and p.presence_penalty == 0 and p.frequency_penalty == 0):
        return z
    counts = Counter(sampler.recent)
    ids = _to(list(counts.keys()), torch.int64, z.device)
    n = _to(list(counts.values()), torch.float32, z.device)
    picked = z[ids]
    picked = torch.where(picked > 0, picked / p.repeat_penalty, picked * p.repeat_penalty)
    z = z.clone()
    z[ids] = picked - n * p.frequency_penalty - p.presence_penalty
    return z


def candidates(sampler: Sampler, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampler.candidates on the device: (k,) ids best first and their final float64 probabilities,
    zero where top-p or min-p cut the candidate off."""
    p = sampler.params
    V = z.shape[0]
    k = p.top_k if 0 < p.top_k < V else V
    if k < V:
        vals, ids = torch.topk(z, k)                                    # (k,) best first
    else:
        vals, ids = torch.sort(z, descending=True, stable=True)
    zd = vals.double()
    keep = torch.ones(k, dtype=torch.bool, device=z.device)
    if p.top_p < 1 or p.min_p > 0:
        probs = torch.exp(zd - zd[0])
        probs = probs / probs.sum()
        if p.top_p < 1:                  # the smallest prefix with mass >= top_p (numpy's searchsorted, left)
            n_keep = (torch.cumsum(probs, 0) < p.top_p).sum() + 1
            keep &= torch.arange(k, device=z.device) < n_keep
        if p.min_p > 0:                  # probs are sorted: the kept ones are a prefix; the best always stays
            keep &= (probs >= p.min_p * probs[0]) | (torch.arange(k, device=z.device) == 0)
    final = torch.exp((zd - zd[0]) / p.temperature) * keep
    return ids, final / final.sum()


def sample_on_device(sampler: Sampler, logits: torch.Tensor) -> int:
    """Sampler.sample for a (n_vocab,) logits tensor on any torch device: the same token for the
    same logits and generator state. Only the chosen id leaves the device."""
    z = penalized(sampler, logits)
    if sampler.params.temperature <= 0:
        token = int(torch.argmax(z))
    else:
        ids, probs = candidates(sampler, z)
        order = torch.argsort(ids)                       # draw in id order, as the host sampler does
        cdf = torch.cumsum(probs[order], 0)
        # numpy's Generator.choice: cdf /= cdf[-1], then the first index whose cdf exceeds u
        idx = (cdf / cdf[-1] <= sampler.rng.random()).sum().clamp_(max=cdf.shape[0] - 1)
        token = int(ids[order][idx])
    sampler.picked(token)
    return token
