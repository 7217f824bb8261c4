"""Native logits against llama.cpp's, every position, for each architecture x weight type.

On AVX2 CPUs the native engine reproduces llama.cpp's arithmetic for the weight types with exact
kernels (the exact int8 kernels, llama.cpp's attention and softmax, the same activation
rounding), so for those the logits must be *equal*, bit for bit, at every position: the prompt in
one batch (llama.cpp's batched kernels) and token by token (its one-token kernels).

With the online (flash) softmax, whose probabilities stay float32 where llama.cpp rounds them to
float16, the logits are within 5% of the largest |logit| of llama.cpp's on the same file. Measured:
0.2% (gemma3) to 3.2% (phi3). The f16 probabilities differ by ~5e-4 each, and on these deliberately
sharp random models such a difference flips the q8 rounding of some activations after attention,
each flip moving the next matmul's output by a quantization step. Top-1 must agree at every
position where llama.cpp's top-2 margin exceeds the bound (random weights produce near-ties that no
two roundings can order alike).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from core.llamacpp_backend import LlamaCppBackend
from core.native_backend import COMPILING, NativeBackend, kernels_compiled
from core.precompile import by_name, compile_in_two, first_layer_args
from kernels.cpu import fused, moe
from models.architectures import load_config
from models.errors import BadInputError
from tests.engine import conftest as fx

ARCHS = ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"]
ONLINE_TOL = 0.05
IDS = [1] + [int(t) for t in np.random.default_rng(1).integers(3, fx.N_VOCAB, 39)]  # 40 > 2 cache blocks, > window


def _llama_logits(g, tok):
    ll = LlamaCppBackend(g, tok, 256, 2, logits_all=True)
    try:
        return ll.logits_all(IDS)
    finally:
        ll.close()


def _native_logits(g, tok, n_ctx=256, disk_arithmetic: list | None = None):
    """The native engine's logits_all(IDS) on this file (appending its disk cache's arithmetic tag
    to disk_arithmetic when given)."""
    native = NativeBackend(g, tok, n_ctx, 2)
    try:
        if disk_arithmetic is not None:
            native.attach_disk(g.path)
            disk_arithmetic.append(native.disk.fmt.arithmetic)
        return native.logits_all(IDS)
    finally:
        native.close()


def _check(native, ref, tol, what):
    scale = np.abs(ref).max()
    diff = np.abs(native - ref).max()
    assert diff <= tol * scale, f"{what}: max |diff| {diff:.4f} > {tol} x {scale:.2f}"
    top2 = np.sort(ref, -1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) > tol * scale
    bad = np.nonzero(decisive & (native.argmax(-1) != ref.argmax(-1)))[0]
    assert bad.size == 0, f"{what}: top-1 differs at positions {bad.tolist()}"


def test_llamacpp_oracle_is_the_avx2_build():
    """setup.sh builds llama.cpp for x86-64-v3 on every CPU: AVX-512 kernels sum in other orders,
    and the bit-for-bit tests below compare with the AVX2 arithmetic."""
    import llama_cpp
    info = llama_cpp.llama_print_system_info().decode()
    assert "AVX2 = 1" in info and "FMA = 1" in info and "F16C = 1" in info, info
    assert "AVX512" not in info and "AMX" not in info, info


# Rope bases: llama and qwen2 at Llama 2's 1e4 and Llama 3's 5e5, qwen3 at its 1e6; gemma3 at 1e6 (global layers) and
# 1e4 (local). An ulp of theta_scale (numpy's AVX-512 powf) grows with the position: these catch it.
# Rope scaling: Llama 3's per-pair frequency factors (rope_freqs.weight), linear scaling (gemma3's
# 4B-27B: on its global layers only), phi3's LongRoPE with each of its factor sets (and its
# attn_factor on cos and sin), and YaRN (Qwen's 128k files). SmolLM3: every fourth layer without rope
# (its layer 3 of 4), alone and beside YaRN on the others. ERNIE 4.5 (dense): llama's layer. Granite:
# llama's with its four scales (embeddings, scores, residual branches, logits). EXAONE 3.x: llama's with
# neox rope. Gemma (1): scaled embeddings, Q scaled before attention, GeGLU, no post-norms. Mistral 3:
# llama's layer with the file's YaRN betas and log multiplier, and an attention temperature. Qwen3-VL
# on text: interleaved multi-section rope (a pair of the extra section turns by position 0), deepstack zeros.
ROPE_CASES = [("llama", 1e4, None), ("llama", 5e5, None), ("qwen2", 1e4, None), ("qwen2", 5e5, None),
              ("qwen3", 1e6, None), ("phi3", 1e4, None), ("gemma2", None, None), ("gemma3", None, None), ("llama", 5e5, "llama3"),
              ("llama", 1e4, "linear"), ("gemma3", None, "linear"), ("phi3", 1e4, "longrope"), ("phi3", 1e4, "longrope-short"),
              ("llama", 1e4, "yarn"), ("qwen2", 1e6, "yarn"), ("smollm3", 1e4, None), ("smollm3", 5e5, "yarn"),
              ("ernie4_5", 5e5, None), ("granite", 1e4, None), ("granite", 5e5, "llama3"),
              ("exaone", 1e6, None), ("exaone", 5e5, "llama3"), ("gemma", 1e4, None),
              ("mistral3", 1e6, None), ("mistral3", 1e6, "yarn"), ("qwen3vl", 5e6, None)]


# The weight types with exact kernels. The rope cases and the weight type are independent parts of
# the computation (rope is float arithmetic on the projections' outputs), so every rope case runs
# with the registry's Q4_K and every type with each architecture at its default rope base.
EXACT_QTYPES = ["Q5_0", "Q8_0", "Q4_0", "IQ4_NL", "Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F32", "F16", "BF16",
                "Q3_K", "Q2_K", "IQ4_XS"]
BIT_CASES = ([(*case, "Q4_K") for case in ROPE_CASES]
             + [(arch, None, None, q) for q in EXACT_QTYPES if q != "Q4_K" for arch in ARCHS])


@pytest.mark.parametrize("arch,rope_base,rope_scaling,qtype", BIT_CASES,
                         ids=[f"{a}-{b or 'default'}" + (f"-{c}" if c else "") + f"-{q}" for a, b, c, q in BIT_CASES])
def test_native_equals_llamacpp_bit_for_bit(arch, rope_base, rope_scaling, qtype, tiny_model):
    """The same quantized file through both engines: identical logits, batched and stepwise."""
    _assert_bit_exact(*tiny_model(arch, qtype, rope_base, rope_scaling))


# Mixtures of experts (kernels.cpu.moe): Qwen3-MoE with every exact type (its experts' batches take
# each type's mul_mat_id arithmetic: the tiled types' from 8 rows routed to one expert, which the
# 40-token prompt gives some of the 8 experts and not others), and each other architecture whose
# llama.cpp graph runs experts (llama: Mixtral) with the registry's type.
MOE_CASES = ([("qwen3moe", False, q) for q in EXACT_QTYPES]
             + [(a, a not in fx.MOE_TWIN, "Q4_K") for a in ("qwen3vlmoe", "granitemoe", "llama", "granite", "mistral3")])


@pytest.mark.parametrize("arch,experts,qtype", MOE_CASES, ids=[f"{a}-{q}" for a, _, q in MOE_CASES])
def test_mixture_of_experts_equals_llamacpp_bit_for_bit(arch, experts, qtype, tiny_model, monkeypatch):
    made = []
    real = moe.expert_buffers
    monkeypatch.setattr(moe, "expert_buffers", lambda *a: made.append(real(*a)) or made[-1])
    _assert_bit_exact(*tiny_model(arch, qtype, experts=experts))
    # the prompt's pass (its 40 rows' buffers) gave some expert 8 rows or more and another fewer
    counts = np.concatenate([np.bincount(eb.sel.reshape(-1), minlength=fx.N_EXPERT) for eb in made if eb.sel.shape[0] == len(IDS)])
    assert counts.max() >= 8 and counts.min() < 8, counts


def _assert_bit_exact(g, tok):
    native = NativeBackend(g, tok, 256, 2)
    batched = native.logits_all(IDS)
    native.seq.release()
    stepwise = np.stack([native.extend([t]) for t in IDS])
    native.seq.release()
    for t in IDS[:3]:       # the context token by token (a batch of 3 rounds otherwise for the float types)
        native.extend([t])
    check = native.verify(IDS[3:8])         # a speculative check: 5 decode rows in one pass
    native.close()
    np.testing.assert_array_equal(check, stepwise[3:8])   # each row: the numbers it gets alone
    ll = LlamaCppBackend(g, tok, 256, 2, logits_all=True)
    try:
        ref_batched = ll.logits_all(IDS)
        ll.llm.reset()
        ll.llm._ctx.kv_cache_clear()
        ref_stepwise = np.stack([ll.extend([t]) for t in IDS])
    finally:
        ll.close()
    np.testing.assert_array_equal(batched, ref_batched)
    np.testing.assert_array_equal(stepwise, ref_stepwise)


def test_rope_scaling_is_read_from_the_file(tiny_model):
    """The rope-scaling cases above are not vacuous: the same weights with Llama 3's frequency
    factors, or with linear scaling (gemma3: its one global layer of six), give other logits than
    without (and llama.cpp agrees bit for bit with each, above)."""
    for arch, base, scaling in (("llama", 5e5, "llama3"), ("llama", 1e4, "linear"), ("gemma3", None, "linear"),
                                ("llama", 1e4, "yarn")):
        scaled, plain = _native_logits(*tiny_model(arch, "Q8_0", base, scaling)), _native_logits(*tiny_model(arch, "Q8_0", base))
        assert np.abs(scaled - plain).max() > 1e-2, (arch, scaling)


# Metadata that changes the arithmetic, each as llama.cpp reads it: a rope.scaling.factor with no
# type (linear), the older rope.scale_linear key, gemma3's optional final soft-cap, and the
# sliding-window pattern as a period (0: every layer local) or as per-layer flags.
META_CASES = [
    ("llama", (("rope.scaling.factor", 4.0),)),
    ("llama", (("rope.scale_linear", 2.0),)),
    ("gemma3", (("final_logit_softcapping", 3.0),)),
    ("gemma3", (("attention.sliding_window_pattern", 3),)),
    ("gemma3", (("attention.sliding_window_pattern", 0),)),
    ("gemma2", (("attention.sliding_window_pattern", [False, True, True, False]),)),
    ("granite", (("rope.scaling.finetuned", False),)),
]


@pytest.mark.parametrize("arch,meta", META_CASES, ids=[f"{a}-{m[0][0]}-{m[0][1]}" for a, m in META_CASES])
def test_metadata_read_as_llamacpp_reads_it(arch, meta, tiny_model):
    """Each key changes the logits (against the same weights without it), and llama.cpp agrees bit
    for bit."""
    g, tok = tiny_model(arch, "Q8_0", meta=meta)
    ours = _native_logits(g, tok)
    np.testing.assert_array_equal(ours, _llama_logits(g, tok))
    assert np.abs(ours - _native_logits(*tiny_model(arch, "Q8_0"))).max() > 1e-2


def test_longrope_picks_its_factors_by_context_as_llamacpp_does(tiny_model):
    """phi3's LongRoPE: the short factors while the context (rounded up to 256, as llama.cpp pads it)
    is within the file's original context, the long ones past it; each set changes the logits, and
    at a context of 257 tokens (the long set in both engines) the native engine is llama.cpp's bit
    for bit. The set is part of the disk cache's key: K rotated by one set is not the other's."""
    g, tok = tiny_model("phi3", "Q8_0", 1e4, "longrope-short")      # original context 256
    assert load_config(g, 256).rope_tag == "/rope-short" and load_config(g, 257).rope_tag == "/rope-long"
    assert load_config(g, 256).rope_attn_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)), rel=1e-6)

    arithmetic = []
    short, long = _native_logits(g, tok, 256, arithmetic), _native_logits(g, tok, 257, arithmetic)
    assert arithmetic[0].endswith("/rope-short") and arithmetic[1].endswith("/rope-long")
    plain = _native_logits(*tiny_model("phi3", "Q8_0", 1e4))
    assert np.abs(short - long).max() > 1e-2 and np.abs(short - plain).max() > 1e-2
    ll = LlamaCppBackend(g, tok, 257, 2, logits_all=True)
    try:
        np.testing.assert_array_equal(long, ll.logits_all(IDS))
    finally:
        ll.close()


def test_mistral_sliding_window_is_ignored_as_llamacpp_does(tiny_model):
    """A llama file with Mistral's `llama.attention.sliding_window` (8 here, shorter than the 40
    tokens): llama.cpp's llama graph never reads the key and attends to everything, and the native
    engine gives its logits bit for bit, the same as without the key."""
    g, tok = tiny_model("llama", "Q8_0", sliding_window=8)
    assert g.arch_get("attention.sliding_window") == 8
    ours = _native_logits(g, tok)
    np.testing.assert_array_equal(ours, _llama_logits(g, tok))
    np.testing.assert_array_equal(ours, _native_logits(*tiny_model("llama", "Q8_0")))


def test_gemma2_soft_caps_bend_these_models(tiny_model, tmp_path):
    """The gemma2 cases above are not vacuous: with caps too high to bend anything the same weights
    give other logits, for each cap; and the capped logits stay within the final cap."""
    from core.tokenizer import Tokenizer
    from models.gguf_file import open_model

    def logits(g, tok):
        native = NativeBackend(g, tok, 256, 2)
        try:
            return native.logits_all(IDS)
        finally:
            native.close()
    capped = logits(*tiny_model("gemma2", "Q8_0"))
    assert np.abs(capped).max() < fx.GEMMA2_FINAL_SOFTCAP
    for caps in ((1e6, fx.GEMMA2_FINAL_SOFTCAP), (fx.GEMMA2_ATTN_SOFTCAP, 1e6)):
        g = open_model(fx.write_tiny_model(tmp_path / f"g2-{caps[0]:g}-{caps[1]:g}.gguf", "gemma2", "Q8_0",
                                           softcaps=caps))
        assert np.abs(logits(g, Tokenizer.from_gguf(g)) - capped).max() > 1e-2, caps


@pytest.mark.parametrize("arch", ARCHS)
def test_online_softmax_matches_llamacpp(arch, tiny_model):
    """The flash-attention kernels (online softmax, float32 probabilities) run the whole model too:
    the prompt in one batch and token by token, against llama.cpp on the same file (bound: the
    module doc)."""
    g, tok = tiny_model(arch, "Q8_0")
    native = NativeBackend(g, tok, 256, 2)
    native.model.set_attention_softmax("online")
    prefill = native.logits_all(IDS)
    native.seq.release()
    decode = np.stack([native.extend([t]) for t in IDS])
    native.close()
    ref = _llama_logits(g, tok)
    assert not np.array_equal(prefill, ref)          # not llama.cpp's softmax under another name
    _check(decode, ref, ONLINE_TOL, f"{arch} online decode")
    _check(prefill, ref, ONLINE_TOL, f"{arch} online prefill")


def test_prefill_in_chunks_then_decode_equals_one_pass(tiny_model):
    """Prefix reuse and chunked prefill give the logits a fresh single pass gives."""
    g, tok = tiny_model("gemma3", "Q8_0")
    native = NativeBackend(g, tok, 256, 2, block_size=4)
    full = native.logits_all(IDS)
    native.seq.release()
    last = native.extend(IDS[:17])
    np.testing.assert_allclose(last, full[16], atol=2e-2 * np.abs(full).max())
    assert native.reuse_prefix(IDS[:12] + [5, 6]) == 12          # keeps 12, drops 5
    out = np.stack([native.extend([t]) for t in IDS[12:30]])
    np.testing.assert_allclose(out, full[12:30], atol=2e-2 * np.abs(full).max())
    assert "used" in native.kv_block_map() or "shared" in native.kv_block_map()
    native.close()


def test_mistral3_reads_its_yarn_keys_and_stops_at_its_temperature_floor(tiny_model):
    """mistral3's YaRN betas and log multiplier change the logits (against llama's reading of the
    same weights, which ignores them; each bit for bit with llama.cpp above). Its attention
    temperature is exactly 1 below the YaRN original context: the engines run the file with a
    context up to it, bit for bit with llama.cpp, and refuse a longer one (auto: llama.cpp)."""
    mistral, llama = (_native_logits(*tiny_model(a, "Q8_0", 1e6, "yarn")) for a in ("mistral3", "llama"))
    assert np.abs(mistral - llama).max() > 1e-2
    g, tok = tiny_model("mistral3", "Q8_0", meta=(("rope.scaling.original_context_length", 128),))
    assert g.unsupported(n_ctx=128) is None
    assert g.unsupported(n_ctx=129) == "attention temperature scaling past 128 tokens of context (--ctx 128 runs it)"
    with pytest.raises(BadInputError, match="attention temperature"):
        NativeBackend(g, tok, 129, 2)
    ll = LlamaCppBackend(g, tok, 128, 2, logits_all=True)
    try:
        np.testing.assert_array_equal(_native_logits(g, tok, 128), ll.logits_all(IDS))
    finally:
        ll.close()


def test_mixture_of_experts_batch_gives_each_sequence_its_own_numbers(tiny_model):
    """Continuous batching through experts: a 40-token prompt beside another sequence's decode row in
    one pass (each expert's rows split by the pass's runs: the prompt's a batch of its own, the decode
    row a single token) gives each the logits it gets alone; so does a step of decode rows only."""
    g, tok = tiny_model("qwen3moe", "Q6_K")
    nb = NativeBackend(g, tok, 256, 2)
    try:
        a, b = nb.new_sequence(), nb.new_sequence()
        nb.forward_batch([(b, IDS[5:9])])
        both = nb.forward_batch([(a, IDS[:40]), (b, [IDS[9]])])
        alone_a = nb.forward_batch([(nb.new_sequence(), IDS[:40])])
        b2 = nb.new_sequence()
        nb.forward_batch([(b2, IDS[5:9])])
        alone_b = nb.forward_batch([(b2, [IDS[9]])])
        np.testing.assert_array_equal(both, np.concatenate([alone_a, alone_b]))
        step = nb.forward_batch([(a, [IDS[1]]), (b, [IDS[10]])])
        np.testing.assert_array_equal(step[1], nb.forward_batch([(b2, [IDS[10]])])[0])
    finally:
        nb.close()


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "F16"])
def test_mixture_of_experts_prompt_then_decode_equals_llamacpp(qtype, tiny_model):
    """A prompt whose last row alone goes on after the last layer's attention (llama.cpp's graph
    without logits_all: that layer's experts see one row) and the decode steps after it."""
    g, tok = tiny_model("qwen3moe", qtype)
    native = NativeBackend(g, tok, 256, 2)
    ll = LlamaCppBackend(g, tok, 256, 2, logits_all=False)
    try:
        ours = [native.extend(IDS[:30])] + [native.extend([t]) for t in IDS[30:]]
        theirs = [ll.extend(IDS[:30])] + [ll.extend([t]) for t in IDS[30:]]
    finally:
        native.close()
        ll.close()
    np.testing.assert_array_equal(np.stack(ours), np.stack(theirs))


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_compiled_layer_loop_equals_the_python_loop(arch, tiny_model):
    """A pass runs its layers in one compiled call (fused.layers) where the model allows it; the
    numbers are those of the layers called one by one from Python, for a prompt and for decode steps
    (gemma3: two rope tables and two attention windows, each layer taking its own)."""
    g, tok = tiny_model(arch, "Q4_K")
    native = NativeBackend(g, tok, 256, 2)
    model = native.model
    assert model._loop is not None
    runs = {}
    for name, loop in (("compiled", model._loop), ("python", None)):
        model._loop = loop
        native.seq.release()
        full = native.logits_all(IDS[:30])
        native.seq.release()
        native.extend(IDS[:20])
        steps = np.stack([native.extend([t]) for t in IDS[20:30]])
        runs[name] = (full, steps)
    native.close()
    np.testing.assert_array_equal(runs["compiled"][0], runs["python"][0])
    np.testing.assert_array_equal(runs["compiled"][1], runs["python"][1])


def test_mixture_of_experts_layers_are_called_from_python(tiny_model):
    """The experts' layers (kernels.cpu.moe.layer) do not go through fused.layers."""
    g, tok = tiny_model("qwen3moe", "Q4_K")
    native = NativeBackend(g, tok, 256, 2)
    assert native.model._loop is None
    native.close()


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_decode_rows_in_one_region_equal_the_split_kernels(arch, tiny_model, monkeypatch):
    """Decode steps and a speculative check's rows (verify) give the same numbers whether their
    attention runs in one parallel region (attention.DECODE_TOGETHER, where the plan allows it) or
    as the split kernels (scores, softmax, P@V per row), deep enough that those split the keys."""
    from kernels.cpu import attention
    g, tok = tiny_model(arch, "Q8_0")
    ids = [1] + [int(t) for t in np.random.default_rng(3).integers(3, fx.N_VOCAB, 199)]
    native = NativeBackend(g, tok, 256, 2)
    runs = {}
    for together in (True, False):
        monkeypatch.setattr(attention, "DECODE_TOGETHER", together)
        plan = attention.attention_plan([(np.arange(13, dtype=np.int32), 190, 1, True)], 0, fx.N_HEAD, fx.N_HEAD_KV,
                                        fx.HEAD_DIM, 16)
        assert plan.together == together
        assert plan.rows[0, 3] < 191                    # the split kernels split this row's keys
        native.seq.release()
        native.extend(ids[:180])
        steps = np.stack([native.extend([t]) for t in ids[180:190]])
        runs[together] = (steps, native.verify(ids[190:196]))
    native.close()
    np.testing.assert_array_equal(runs[True][0], runs[False][0])
    np.testing.assert_array_equal(runs[True][1], runs[False][1])


KERNELS_COMPILED = "import core; from core.native_backend import kernels_compiled; print(kernels_compiled())"


def test_a_start_says_when_it_compiles_the_kernels(tiny_model, tmp_path):
    """A start from numba's cache says "preparing kernels" (about a second); with an empty cache
    (a machine's first start: numba compiles for minutes) kernels_compiled() is False, and the start
    says it is compiling. That compile is not run through here: it is the minutes."""
    g, tok = tiny_model("qwen2", "Q8_0")
    stages = []
    NativeBackend(g, tok, 64, 2, progress=lambda stage, done, total: stages.append(stage)).close()
    assert kernels_compiled() and "preparing kernels" in stages and COMPILING not in stages
    for cache, expected in ((tmp_path, "False"), (None, "True")):
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"} | ({"NUMBA_CACHE_DIR": str(cache)} if cache else {})
        proc = subprocess.run([sys.executable, "-c", KERNELS_COMPILED], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0 and proc.stdout.strip() == expected, proc.stderr[-2000:]


def test_a_first_starts_two_compile_shares_are_the_layers_own(tiny_model):
    """A first start compiles the layer's kernels in two shares, one in a second process
    (core.precompile). Each share is typed as `layer` types its calls, so that the layer loop finds
    them in numba's cache: in a new process, with the loop compiled, every function of both shares
    loads from the cache and none compiles (a share typed otherwise would compile: a first start
    would then compile it twice). The second process runs for real, and bad input on its stdin
    gets one line and exit 2."""
    g, tok = tiny_model("qwen2", "Q8_0")
    be = NativeBackend(g, tok, 64, 2)                  # (compiles the loop if the cache lacks it)
    try:
        args = first_layer_args(be.model)
        calls = [c for share in fused.SHARES for c in fused.share_signatures(args, share)]
        helper = [sys.executable, "-m", "core.precompile"]
        proc = subprocess.run(helper, input=by_name(calls), capture_output=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.decode().split("\n")[:-1] == [
            "_attn_inputs loaded", "_attend loaded", "quantize_into loaded", "matmul_row loaded"], proc.stdout
        assert compile_in_two(be.model) is None
        bad = subprocess.run(helper, input=b"not a pickle", capture_output=True, timeout=300)
        err = bad.stderr.decode().strip()
        assert bad.returncode == 2 and err.startswith("kvchat precompile:") and "\n" not in err, err
        with pytest.raises(ValueError, match="unknown share"):
            fused.share_signatures(args, "norms")
    finally:
        be.close()
