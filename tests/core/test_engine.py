"""The shared generation loop and the Engine, on the real default model through llama.cpp."""
import threading

import numpy as np
import pytest

from core.chat_session import fit_prompt
from core.generate import PREFILL_CHUNK
from core.request import split_at_stop
from core.types import SamplingParams
from core.engine import Engine
from kernels.types import GEMM_ROWS, LLAMA_BATCH, TILED_MIN_ROWS, prompt_pieces
from models.errors import BadInputError

GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def engine(qwen_path):
    e = Engine("qwen2.5-coder-0.5b-instruct", backend="llama.cpp", n_ctx=256, threads=2)
    yield e
    e.close()


def collect(events):
    ids, text = [], []
    for ev in events:
        if ev.id >= 0:
            ids.append(ev.id)
        text.append(ev.text)
    return ids, "".join(text)


def test_overflow_drops_oldest_turns_and_keeps_system(engine):
    system = {"role": "system", "content": "You are Kvbot, brief and exact."}
    turns = []
    for i in range(8):
        turns += [{"role": "user", "content": f"Question number {i}: tell me about the number {i} in detail."},
                  {"role": "assistant", "content": f"The number {i} is a number. " * 4}]
    messages = [system] + turns + [{"role": "user", "content": "Final question: what is 2+2?"}]
    ids, truncated = fit_prompt(engine, messages, reserve=32)
    text = engine.tokenizer.decode(ids, special=True)
    assert truncated and len(ids) < engine.n_ctx - 32
    assert "You are Kvbot" in text and "Final question" in text
    assert "Question number 0" not in text and "Question number 7" in text
    # it still generates
    out_ids, _ = collect(engine.generate(ids, GREEDY))
    assert out_ids


def test_fitting_conversation_is_untouched(engine):
    messages = [{"role": "user", "content": "hi"}]
    ids, truncated = fit_prompt(engine, messages)
    assert not truncated and ids == engine.prompt_ids(messages)


def test_one_message_longer_than_context_is_an_error(engine):
    with pytest.raises(BadInputError, match="context holds 256"):
        fit_prompt(engine, [{"role": "system", "content": "s"}, {"role": "user", "content": "word " * 400}])


def test_prefix_reuse_gives_the_same_tokens(engine):
    ids = engine.prompt_ids([{"role": "user", "content": "List three colors."}])
    cold, _ = collect(engine.generate(ids, GREEDY))
    warm, _ = collect(engine.generate(ids, GREEDY))
    assert engine.backend.timings.cache_n == len(ids) - 1
    assert warm == cold


def test_cancel_during_prefill_and_decode(engine):
    ids = engine.prompt_ids([{"role": "user", "content": "Count to fifty. " * 30}])
    cancel = threading.Event()
    cancel.set()
    assert collect(engine.generate(ids, GREEDY, cancel))[0] == []
    assert engine.backend.finish_reason == "cancelled"
    cancel = threading.Event()
    seen = []
    for ev in engine.generate(ids, SamplingParams(temperature=0, max_tokens=100), cancel):
        seen.append(ev)
        if len(seen) == 3:
            cancel.set()
    assert engine.backend.finish_reason == "cancelled" and 3 <= len(seen) <= 4


def test_stop_string_across_tokens_is_never_emitted(engine):
    ids = engine.prompt_ids("Count: 1, 2, 3, 4, 5, 6, 7, 8", chat=False)
    _, full = collect(engine.generate(ids, SamplingParams(temperature=0, max_tokens=12)))
    stop = full[3:9]                 # a stop string that surely spans several tokens
    _, text = collect(engine.generate(ids, SamplingParams(temperature=0, max_tokens=12, stop=(stop,))))
    assert text == full[:3] and engine.backend.finish_reason == "stop"


@pytest.mark.parametrize("text, stops, expected", [
    ("hello wor", ("world",), ("hello ", "wor", False)),
    ("hello world!", ("world",), ("hello ", "", True)),
    ("abc", ("x",), ("abc", "", False)),
    ("a\n\nUser:", ("\nUser:",), ("a\n", "", True)),
    ("ends with U", ("User", "Us"), ("ends with ", "U", False)),
])
def test_split_at_stop(text, stops, expected):
    assert split_at_stop(text, stops) == expected


def test_seeded_sampling_is_reproducible(engine):
    ids = engine.prompt_ids([{"role": "user", "content": "Write a creative name for a cat."}])
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, min_p=0.0, seed=1234, max_tokens=12)
    runs = []
    for _ in range(2):
        engine.backend.reuse_prefix([-1, -1])       # cold cache both times: identical logits
        runs.append(collect(engine.generate(ids, params))[0])
    assert runs[0] == runs[1]
    other = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, min_p=0.0, seed=99, max_tokens=12)
    engine.backend.reuse_prefix([-1, -1])
    assert collect(engine.generate(ids, other))[0] != runs[0]     # and the seed matters


def _arithmetic(batch: int, i: int) -> tuple[bool, bool]:
    """What llama.cpp computes row i of a batch of `batch` rows with: (the tiled types' tiled
    kernel, Q4_K's gemm)."""
    return batch >= TILED_MIN_ROWS, batch >= GEMM_ROWS and i < batch - batch % GEMM_ROWS


@pytest.mark.parametrize("most", [PREFILL_CHUNK, 16, 100])
def test_prompt_pieces_keep_every_rows_arithmetic(most):
    """generate feeds a prompt in pieces of at most PREFILL_CHUNK rows; each row must get the
    arithmetic llama.cpp's batches of LLAMA_BATCH give it (the oracle's logits_all), for every length."""
    for n in range(0, 3 * LLAMA_BATCH + 20):
        pieces = prompt_pieces(n, most)
        assert sum(pieces) == n and all(0 < p <= most for p in pieces), (n, pieces)
        ours = [_arithmetic(p, i) for p in pieces for i in range(p)]
        theirs = [_arithmetic(min(LLAMA_BATCH, n - s), i) for s in range(0, n, LLAMA_BATCH)
                  for i in range(min(LLAMA_BATCH, n - s))]
        assert ours == theirs, (n, pieces)
    with pytest.raises(ValueError):
        prompt_pieces(100, 10)
