"""Each sampling filter against a distribution computed by hand."""
import numpy as np
import pytest

from core.types import SamplingParams
from core.sampler import Sampler
from models.errors import BadInputError

LOGITS = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05], dtype=np.float32))   # probabilities 0.4 .. 0.05


def dist(**kw):
    params = SamplingParams(**{"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, **kw})
    sampler = Sampler(params, 5)
    ids, probs = sampler.candidates(sampler.apply_penalties(LOGITS.copy()))
    full = np.zeros(5)
    full[ids] = probs
    return full


def test_plain_softmax():
    np.testing.assert_allclose(dist(), [0.4, 0.3, 0.15, 0.1, 0.05], rtol=1e-5)


def test_top_k():
    np.testing.assert_allclose(dist(top_k=2), [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0], rtol=1e-5)


def test_top_p_keeps_smallest_set_reaching_p():
    np.testing.assert_allclose(dist(top_p=0.8), [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0], rtol=1e-5)


def test_min_p_relative_to_the_best():
    np.testing.assert_allclose(dist(min_p=0.3), [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0], rtol=1e-5)


def test_temperature_sharpens():
    p = np.array([0.4, 0.3, 0.15, 0.1, 0.05]) ** 2
    np.testing.assert_allclose(dist(temperature=0.5), p / p.sum(), rtol=1e-5)


def test_greedy_is_argmax_even_with_a_seed():
    s = Sampler(SamplingParams(temperature=0, seed=3), 5)
    assert s.sample(LOGITS) == 0


def test_repeat_presence_frequency_penalties():
    params = SamplingParams(temperature=0, repeat_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    s = Sampler(params, 5)
    s.remember([0, 0, 3])
    logits = np.array([2.0, 1.0, -1.0, -1.0, 0.5], dtype=np.float32)
    out = s.apply_penalties(logits)
    # token 0: 2/2 - 2*0.25 - 0.5 = 0 ; token 3: -1*2 - 0.25 - 0.5 = -2.75 ; others untouched
    np.testing.assert_allclose(out, [0.0, 1.0, -1.0, -2.75, 0.5])
    assert s.sample(logits) == 1


def test_logit_bias_shifts_and_bans():
    s = Sampler(SamplingParams(temperature=0, logit_bias=((0, -float("inf")), (3, 1.0))), 5)
    out = s.apply_penalties(LOGITS.copy())
    assert out[0] == -np.inf and out[3] == pytest.approx(LOGITS[3] + 1.0)
    assert s.sample(LOGITS) == 1                        # the best token is banned: the second wins
    np.testing.assert_allclose(dist(logit_bias=((4, float(np.log(2.0))),)),
                               np.array([0.4, 0.3, 0.15, 0.1, 0.1]) / 1.05, rtol=1e-5)


def test_sampling_frequencies_follow_the_distribution():
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7), 5)
    draws = np.bincount([s.sample(LOGITS) for _ in range(4000)], minlength=5) / 4000
    np.testing.assert_allclose(draws, [0.4, 0.3, 0.15, 0.1, 0.05], atol=0.03)


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(top_p=0), dict(top_k=-1), dict(min_p=1.5),
                                dict(repeat_penalty=0), dict(max_tokens=0), dict(seed=-1), dict(stop=("",)),
                                dict(temperature=float("nan")), dict(logit_bias=((-1, 1.0),)),
                                dict(logit_bias=((3, float("nan")),))])
def test_out_of_range_is_refused(kw):
    with pytest.raises(BadInputError):
        SamplingParams(**kw).validate()


@pytest.mark.parametrize("kw", [
    dict(temperature=0.0),
    dict(temperature=0.0, repeat_penalty=1.3, logit_bias=((7, -float("inf")), (3, 2.5))),
    dict(temperature=0.8),                                                # the defaults: top-k 40, top-p, min-p
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),                 # the whole vocabulary
    dict(temperature=1.3, top_k=0, top_p=0.5, min_p=0.0),
    dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.2),
    dict(temperature=1.0, top_k=5, top_p=0.9, min_p=0.1, repeat_penalty=1.2, presence_penalty=0.5,
         frequency_penalty=0.3, logit_bias=((11, 1.5),)),
])
def test_device_sampling_picks_the_host_samplers_tokens(kw):
    """core.device_sampling (the torch engine's sampler, here on CPU tensors) draws the same token as
    Sampler.sample from the same logits and seed, step after step (penalty window included)."""
    import torch

    from core.device_sampling import sample_on_device
    params = SamplingParams(seed=1234, **kw)
    host, device = Sampler(params, 300), Sampler(params, 300)
    rng = np.random.default_rng(5)
    picked = []
    for step in range(60):
        logits = (rng.standard_normal(300) * (1 + step % 4)).astype(np.float32)
        a = host.sample(logits)
        b = sample_on_device(device, torch.from_numpy(logits))
        assert a == b, (step, a, b)
        picked.append(a)
    assert list(host.recent) == list(device.recent)
    if kw["temperature"] > 0:
        assert len(set(picked)) > 3          # a real draw, not an argmax in disguise
