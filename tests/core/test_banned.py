"""Banned strings: decoding backs off and resamples so that a banned string never appears, on both
backends, whether the string is one token or spans several."""
import pytest

from core.types import SamplingParams, SpeculativeConfig
from core.engine import Engine
from models.errors import BadInputError

PROMPT = "Name the planets of the solar system in order, one per line."


@pytest.fixture(scope="module", params=["native", "llama.cpp"])
def engine(request, qwen_path):
    eng = Engine("qwen2.5-coder-0.5b-instruct", backend=request.param, n_ctx=512, threads=2)
    yield eng
    eng.close()


def _run(engine, **params):
    events = list(engine.generate(engine.prompt_ids(PROMPT), SamplingParams(**({"temperature": 0, "max_tokens": 48} | params))))
    return "".join(e.text for e in events), [e.id for e in events if e.id >= 0]


@pytest.mark.parametrize("banned", [("Mars",), ("Earth, Mars", "Saturn"), ("Venus", "enus")])
def test_banned_strings_never_appear(engine, banned):
    plain, _ = _run(engine)
    assert all(b in plain for b in banned)                   # greedy would write each of them
    text, ids = _run(engine, banned=banned)
    assert not any(b in text for b in banned), text
    first = min(plain.find(b) for b in banned)
    assert text[:first] == plain[:first]                     # unchanged up to where a ban begins
    assert text != plain and len(ids) > 0
    assert engine.tokenizer.decode(ids) == text              # the handed-out tokens are the text


def test_banned_strings_sampled_reproducible(engine):
    params = dict(temperature=0.9, seed=5, banned=("Jupiter",))
    a, _ = _run(engine, **params)
    b, _ = _run(engine, **params)
    assert a == b and "Jupiter" not in a


def test_banned_string_checks():
    with pytest.raises(BadInputError, match="banned"):
        SamplingParams(banned=("",)).validate()


def test_banned_strings_and_speculation_do_not_mix(engine):
    with pytest.raises(BadInputError):     # native: "cannot be combined"; llama.cpp: no speculation at all
        list(engine.generate(engine.prompt_ids("hi"), SamplingParams(banned=("x",)),
                             speculative=SpeculativeConfig("lookup")))
