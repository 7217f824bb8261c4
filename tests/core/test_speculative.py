"""Speculative decoding: drafting, the accept/reject rule, and greedy identity on the real model."""
import numpy as np
import pytest

from core.types import SamplingParams, SpeculativeConfig
from core.engine import Engine
from core.sampler import Sampler
from core import speculative
from core.speculative import LookupDrafter, ModelDrafter, lookup_draft
from models.errors import BadInputError


def test_lookup_draft_uses_the_latest_longest_match():
    history = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 2, 3, 4]
    assert lookup_draft(history, 3) == [6, 7, 2]          # "2 3 4" last followed by 6 7 2
    assert lookup_draft([5, 6, 7, 8, 6], 2) == [7, 8]     # falls back to a 1-gram
    assert lookup_draft([1, 2, 3], 3) == []               # nothing repeats
    assert lookup_draft([4, 4], 5) == [4]


def test_lookup_draft_length_grows_after_full_accepts_and_drops_after_a_miss():
    history = list(range(20)) * 2 + [0]                   # "0" was followed by 1, 2, 3, ...
    drafter = LookupDrafter()
    lengths = []
    for drafted_ok in (True, True, True, True, False, True):
        draft = drafter.propose(history, 7)
        lengths.append(len(draft))
        drafter.result(len(draft), len(draft) if drafted_ok else 0)
    assert lengths == [1, 2, 4, 7, 7, 1]                  # doubling, capped by the caller's limit; a miss resets
    assert drafter.propose(history, 7) == [1, 2]
    drafter.result(0, 0)                                  # no draft (no match): the length stays
    assert len(drafter.propose(history, 7)) == 2


def test_draft_n_defaults_per_method():
    assert SpeculativeConfig("lookup").validate().max_draft == 7
    assert SpeculativeConfig("draft", draft_model="m").validate().max_draft == 7
    assert SpeculativeConfig("draft", 3, draft_model="m").validate().max_draft == 3
    assert SpeculativeConfig("lookup", 2).validate().max_draft == 2


class ScriptedDraftModel:
    """A draft backend whose next-token distribution is scripted: after n tokens its greedy token is
    n + 1 with probability top_p[n] (the rest spread evenly), so the stop rule can be checked alone."""

    def __init__(self, top_p, n_vocab=50):
        self.top_p, self.n_vocab, self.n = top_p, n_vocab, 0
        self.stats = type("Stats", (), {"n_past": 0})()

    def reuse_prefix(self, ids):
        return 0

    def extend(self, ids, vocab_limit=None, decode_rows=None):
        self.n += len(ids)
        p = np.full(self.n_vocab, (1 - self.top_p[self.n]) / (self.n_vocab - 1))
        p[self.n + 1] = self.top_p[self.n]
        return np.log(p).astype(np.float32)

    def rollback(self, n_tokens):
        self.n = n_tokens


def test_draft_model_stops_where_the_whole_draft_is_unlikely():
    """Drafting stops before the token that brings the product of the draft's own probabilities
    below DRAFT_MIN_P; a first token below it gives no draft (a plain step)."""
    assert speculative.DRAFT_MIN_P == 0.7
    sure = ScriptedDraftModel([0.5, 0.5, 0.95, 0.9, 0.85, 0.5, 0.99, 0.99, 0.99, 0.99])
    drafter = ModelDrafter(sure, [7])                     # read the prompt: 1 token
    assert drafter.propose([7, 1], 7) == [3, 4, 5]        # 0.95 * 0.9 * 0.85 = 0.73; * 0.5 = 0.36
    drafter.keep(3)                                       # the target kept 7, 1, 3 and rejected 4, 5
    assert sure.n == 3
    assert drafter.propose([7, 1, 3, 9], 7) == [5]        # 0.85, then 0.85 * 0.5
    unsure = ScriptedDraftModel([0.5, 0.5, 0.6, 0.99, 0.99])
    assert ModelDrafter(unsure, [7]).propose([7, 1], 7) == []
    capped = ScriptedDraftModel([0.5, 0.5] + [0.999] * 12)
    assert ModelDrafter(capped, [7]).propose([7, 1], 3) == [3, 4, 5]


def test_sampled_verification_keeps_the_target_distribution():
    """Accept d with p(d), else draw from p without d: the result is distributed as p."""
    logits = np.log(np.array([0.5, 0.3, 0.2], dtype=np.float32))
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    sampler = Sampler(params, 3)
    draws = [sampler.verify(logits, proposed=1)[1] for _ in range(6000)]
    np.testing.assert_allclose(np.bincount(draws, minlength=3) / 6000, [0.5, 0.3, 0.2], atol=0.025)
    accepted = [sampler.verify(logits, proposed=1)[0] for _ in range(4000)]
    assert abs(np.mean(accepted) - 0.3) < 0.03


def test_greedy_verification_accepts_only_the_argmax():
    sampler = Sampler(SamplingParams(temperature=0), 3)
    logits = np.array([0.1, 2.0, 0.3], dtype=np.float32)
    assert sampler.verify(logits, 1) == (True, 1)
    assert sampler.verify(logits, 2) == (False, 1)


@pytest.fixture(scope="module")
def native(qwen_path):
    engine = Engine("qwen2.5-coder-0.5b-instruct", backend="native", n_ctx=1024, threads=2)
    yield engine
    engine.close()


CODE = '''def area(width, height):
    """Area of a rectangle."""
    return width * height


def perimeter(width, height):
    """Perimeter of a rectangle."""
    return 2 * (width + height)
'''
PROMPTS = [
    (True, "Rename the function area to rectangle_area in this code:\n\n" + CODE),
    (True, "Add type hints to this code and change nothing else:\n\n" + CODE),
    (True, "Repeat this sentence three times: the quick brown fox jumps over the lazy dog."),
    (True, "Translate to French: I like apples. I like pears. I like plums."),
    (True, "Write a Python function that reverses a string."),
    (True, "Что такое рекурсия? Объясни кратко."),
    (False, "1, 2, 3, 4, 5, 6, 7, 8,"),
    (False, "def fibonacci(n):\n"),
    (False, "The capital of France is"),
    (False, "SELECT name, COUNT(*) FROM users GROUP BY name; SELECT name, COUNT(*) FROM"),
]


def test_lookup_greedy_is_token_identical(native):
    greedy = SamplingParams(temperature=0, max_tokens=48)
    drafted = accepted = 0
    for chat, text in PROMPTS:
        ids = native.prompt_ids(text, chat=chat)
        native.backend.reset()       # both runs from a cold cache (no prefix registry hit): same prefill
        plain = [e.id for e in native.generate(ids, greedy) if e.id >= 0]
        native.backend.reset()
        spec = [e.id for e in native.generate(ids, greedy, speculative=SpeculativeConfig("lookup", 3)) if e.id >= 0]
        assert spec == plain, text[:40]
        drafted += native.backend.stats.spec_drafted
        accepted += native.backend.stats.spec_accepted
    assert drafted > 0 and accepted > 0.2 * drafted      # input-grounded prompts do get accepted drafts


def test_speculative_needs_the_native_backend(qwen_path):
    engine = Engine("qwen2.5-coder-0.5b-instruct", backend="llama.cpp", n_ctx=256, threads=2)
    with pytest.raises(BadInputError, match="native"):
        list(engine.generate(engine.prompt_ids("hi"), SamplingParams(), speculative=SpeculativeConfig("lookup")))
    engine.close()


@pytest.mark.parametrize("method, n", [("draft", 3), ("guess", 3), ("lookup", 0), ("lookup", 9)])
def test_bad_speculative_config(method, n):
    with pytest.raises(BadInputError):
        SpeculativeConfig(method, n).validate()     # draft without a draft model is an error too


@pytest.fixture(scope="module")
def target15(qwen15_path, qwen_path):
    engine = Engine("qwen2.5-coder-1.5b-instruct", backend="native", n_ctx=1024, threads=2)
    yield engine
    engine.close()


def test_draft_model_greedy_is_token_identical(target15):
    """qwen2.5-coder-0.5b drafts for -1.5b; the 1.5b verifies every draft in one pass and both caches
    roll back on a rejection. Greedy output equals plain greedy on every prompt."""
    greedy = SamplingParams(temperature=0, max_tokens=32)
    config = SpeculativeConfig("draft", 3, "qwen2.5-coder-0.5b-instruct")
    drafted = accepted = rejected_rounds = 0
    for chat, text in PROMPTS:
        ids = target15.prompt_ids(text, chat=chat)
        target15.backend.reset()
        plain = [e.id for e in target15.generate(ids, greedy) if e.id >= 0]
        target15.backend.reset()
        spec = [e.id for e in target15.generate(ids, greedy, speculative=config) if e.id >= 0]
        assert spec == plain, text[:40]
        stats = target15.backend.stats
        drafted += stats.spec_drafted
        accepted += stats.spec_accepted
        rejected_rounds += stats.spec_drafted > stats.spec_accepted
    draft = target15.draft_backend("qwen2.5-coder-0.5b-instruct")
    assert draft.seq.n_tokens <= target15.backend.seq.n_tokens   # the draft cache followed the target's
    assert drafted > 0 and accepted > 0.5 * drafted
    assert rejected_rounds > 0                                   # rollbacks were exercised


def test_draft_model_must_share_the_vocabulary(target15, gemma_path):
    ids = target15.prompt_ids("hi")
    with pytest.raises(BadInputError, match="vocabulary"):
        list(target15.generate(ids, SamplingParams(max_tokens=2),
                               speculative=SpeculativeConfig("draft", 3, "gemma-3-270m")))


def test_decode_threads_apply_to_the_decode_phase_only(native):
    """The chat leaves a core to the interface while decoding (decode_threads); prefill keeps all
    threads. Below 512 cached keys decode attention runs unsplit and every matmul row is computed
    the same way at any thread count, so the tokens are the same."""
    import numba

    backend = native.backend
    ids = native.prompt_ids("Name three primes.")
    greedy = SamplingParams(temperature=0, max_tokens=12)
    backend.reset()
    both = [e.id for e in native.generate(ids, greedy)]
    try:
        backend.set_decode_threads(1)
        backend.set_phase("decode")
        assert numba.get_num_threads() == 1
        backend.set_phase("prefill")
        assert numba.get_num_threads() == min(2, numba.config.NUMBA_NUM_THREADS)
        backend.reset()
        assert [e.id for e in native.generate(ids, greedy)] == both
        assert numba.get_num_threads() == 1                 # generation ended in the decode phase
    finally:
        backend.set_decode_threads(None)
        backend.set_phase("prefill")
