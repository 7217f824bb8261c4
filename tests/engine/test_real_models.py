"""The native engine against llama.cpp on the real registry models (qwen2.5-coder-0.5b-instruct,
gemma-3-270m), 11 prompts: chat and raw, English and Russian, code; greedy, 64 tokens.

The native engine reproduces llama.cpp's arithmetic (AVX2 build) bit for bit, so:
1. greedy: the first 32 tokens equal llama.cpp's on >= 90% of the prompts (the issue's bar; all
   of them in practice);
2. teacher forcing (llama.cpp's greedy sequence through the native engine in one pass, every row
   with the arithmetic of the decode step that produced it, as a speculative check computes it):
   the top-1 equals llama.cpp's greedy token at >= 98% of positions (all of them in practice);
3. teacher forcing through the batched (prompt) arithmetic gives llama.cpp's batched logits_all
   bit for bit. (llama.cpp's own batched top-1 agrees with its stepwise greedy choice at only
   ~97-99% of positions: its two kernel families round differently, which is why (2) compares
   like with like.)
"""
from __future__ import annotations

import numpy as np
import pytest

from core.types import SamplingParams
from core.engine import Engine
from core.llamacpp_backend import LlamaCppBackend
from core.native_backend import NativeBackend
from core.tokenizer import Tokenizer
from models import registry
from models.gguf_file import open_model
from tests.engine.conftest import requantized

N_GEN = 64
GREEDY = SamplingParams(temperature=0, top_k=0, top_p=1, min_p=0, max_tokens=N_GEN)

PROMPTS = [
    (True, "Write a Python function that reverses a string."),
    (True, "Что такое рекурсия? Объясни кратко."),
    (True, "List three uses of a hash map."),
    (True, "Напиши функцию на Python, которая считает факториал."),
    (True, "Explain the difference between a list and a tuple in Python."),
    (False, "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    (False, "The capital of France is"),
    (False, "Москва — столица"),
    (False, "#include <stdio.h>\n\nint main(void) {\n"),
    (False, "Once upon a time, in a small village by the sea,"),
    (False, "SELECT name, COUNT(*) FROM users"),
]


@pytest.fixture(scope="module", params=["qwen2.5-coder-0.5b-instruct", "gemma-3-270m"])
def engines(request, qwen_path, gemma_path):          # both pulled on the first run, like a user's
    eng = Engine(request.param, backend="llama.cpp", n_ctx=512, threads=2)
    native = NativeBackend(eng.gguf, eng.tokenizer, 512, 2)
    batched = LlamaCppBackend(eng.gguf, eng.tokenizer, 512, 2, logits_all=True)
    yield eng, native, batched
    batched.close()
    native.close()
    eng.close()


def _greedy(backend, ids):
    return [e.id for e in backend.generate(ids, GREEDY) if e.id >= 0]


def test_native_tracks_llama_cpp(engines):
    eng, native, batched = engines
    tf_rows = tf_batched = total = same32 = 0
    report = []
    for chat, text in PROMPTS:
        ids = eng.prompt_ids(text, chat=chat and eng.has_chat_template)
        # both engines from an empty cache: a reused prefix changes the size of the batch the rest
        # of the prompt runs in, and with it llama.cpp's choice of kernels
        eng.backend.llm.reset()
        eng.backend.llm._ctx.kv_cache_clear()
        native.reset()
        ref = _greedy(eng.backend, ids)
        out = _greedy(native, ids)
        same32 += ref[:32] == out[:32]
        fork = next((i for i in range(min(32, len(ref), len(out))) if ref[i] != out[i]), None)
        if fork is not None:
            report.append(f"{text[:28]!r}: fork at {fork}")
        # teacher forcing, decode arithmetic: the prompt as one batch, then every generated token
        # in one pass with decode rows
        native.reset()
        first = native.extend(ids)
        rows = native.verify(ref[:-1])                              # (len(ref) - 1, n_vocab)
        pred = np.concatenate([[first.argmax()], rows.argmax(-1)])
        tf_rows += int((pred == np.asarray(ref)).sum())
        # teacher forcing, batched arithmetic: bit for bit llama.cpp's logits_all
        seq = ids + ref[:-1]
        native_logits = native.logits_all(seq)
        llama_logits = batched.logits_all(seq)
        np.testing.assert_array_equal(native_logits, llama_logits)
        tf_batched += int((native_logits[len(ids) - 1:].argmax(-1) == np.asarray(ref)).sum())
        total += len(ref)
    summary = (f"first 32 equal on {same32}/{len(PROMPTS)} prompts; teacher-forced top-1: decode rows "
               f"{tf_rows / total:.3f}, batched (= llama.cpp batched) {tf_batched / total:.3f}\n" + "\n".join(report))
    print(summary)
    assert same32 >= 0.9 * len(PROMPTS), summary
    assert tf_rows >= 0.98 * total, summary


def test_a_prompt_through_generate_keeps_llama_cpps_batches(engines):
    """The chat path (generate) feeds a prompt in pieces of at most PREFILL_CHUNK tokens, cut where
    every row keeps the arithmetic of llama.cpp's batches of 512 (types.prompt_pieces): after a
    prompt of 260 tokens through generate, 8 more give llama.cpp's logits_all of all 268 bit for bit
    (a batch of 268 gives every row the tiled and gemm arithmetic, as the pieces 252, 8 and 8 do).
    Cut at 256, the prompt's last 4 rows took the K-quants' vec_dot instead, and these logits moved
    by up to 0.25."""
    eng, native, batched = engines
    ids = [int(t) for t in np.random.default_rng(7).integers(100, 20000, 268)]
    native.reset()
    events = list(native.generate(ids[:260], SamplingParams(temperature=0, max_tokens=1)))
    assert native.seq.n_tokens == 260 and [e.id for e in events if e.id >= 0], (native.seq.n_tokens, events)
    np.testing.assert_array_equal(native.extend(ids[260:]), batched.logits_all(ids)[-1])


@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_0", "Q4_1", "IQ4_NL", "Q5_K_M", "F16", "BF16",
                                   "Q3_K_M", "Q2_K", "IQ4_XS"])
def test_requantized_registry_model_is_bit_exact(ftype, qwen_path):
    """The default model requantized by llama.cpp's own quantizer to other common file types (each
    mixes types: IQ4_NL files hold Q5_1 and Q5_K, Q5_K_M ones Q6_K; this model's 896-wide rows leave
    Q3_K_M files without Q3_K, Q2_K ones with Q3_K and no Q2_K, IQ4_XS ones with IQ4_XS): logits_all
    bit for bit llama.cpp's, batched and step by step (the engine loads a file only when every matrix
    has an exact kernel). The prompt is long enough (>= 48 tokens) for the prompt kernels: the panel,
    16-row and tile kernels where this CPU has them."""
    g = open_model(requantized(qwen_path, ftype))
    tok = Tokenizer.from_gguf(g)
    ids = tok.encode("Write a Python function that reverses a string, then explain how it works. " * 4)
    assert len(ids) >= 48, len(ids)
    native = NativeBackend(g, tok, 256, 2)
    ll = LlamaCppBackend(g, tok, 256, 2, logits_all=True)
    try:
        np.testing.assert_array_equal(native.logits_all(ids), ll.logits_all(ids))
        native.seq.release()
        ll.llm.reset()
        ll.llm._ctx.kv_cache_clear()
        for t in ids[:6]:
            np.testing.assert_array_equal(native.extend([t]), ll.extend([t]))
    finally:
        ll.close()
        native.close()
