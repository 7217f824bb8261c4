"""The torch engine (core.torch_backend over models.torch_decoder) on CPU tensors, its Triton
kernels in the interpreter: what a machine without a GPU can prove of the GPU engine.

The reference is the native engine with float32 activations and the online softmax (float32
probabilities), the torch engine's arithmetic but for two roundings: the torch engine rounds q to
float16 before attention (tl.dot takes q in the cache's dtype, as llama.cpp does too), and its GELU
is torch's tanh formula where the native engine reads ggml's float16 table. Both are relative
errors of about 2^-11 per element, carried through the layers, so the logits must agree within 1%
of the largest (measured: at most 0.25% on these models) with the same top token at every
position, and greedy decoding must pick the same 16 tokens.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from core.native_backend import NativeBackend
from core.sampler import Sampler
from core.torch_backend import TorchBackend, check_device, device_bytes
from core.types import SamplingParams
from models.errors import BadInputError

# Each weight type with a Triton GEMV on some architecture, and every architecture. Q6_K rides the
# 2-layer llama: its GEMV is the slowest in the interpreter (on the 6-layer gemma3 it took 12% of the suite).
CASES = [("llama", "Q6_K"), ("qwen2", "Q4_K"), ("gemma3", "Q8_0"), ("qwen2", "Q5_0"), ("qwen3", "Q8_0"),
         ("gemma2", "Q8_0"), ("phi3", "Q4_K"), ("llama", "Q4_0"),   # Q4_0: no Triton GEMV kernel, dequantized at load
         ("granite", "Q8_0"),                                       # granite: its four scales
         ("qwen3moe", "Q4_K")]                                      # a mixture of experts
# (arch, (rope base, scaling)): every rope the Triton kernel computes beyond the plain one
ROPE_CASES = [("llama", (5e5, "llama3")), ("llama", (1e4, "linear")), ("gemma3", (None, "linear")),
              ("phi3", (1e4, "longrope")), ("qwen2", (1e6, "yarn")), ("smollm3", (1e4, "yarn")),
              ("mistral3", (1e6, "yarn")), ("qwen3vl", (5e6, None))]
# every architecture/type case, then every rope scaling on Q8_0: (arch, qtype, rope args)
ALL_CASES = [(arch, qtype, ()) for arch, qtype in CASES] + [(arch, "Q8_0", rope) for arch, rope in ROPE_CASES]
IDS = [1] + [int(t) for t in np.random.default_rng(1).integers(3, 320, 39)]   # 40: three cache blocks
TOL = 0.01
N_GREEDY = 16


def engines(tiny_model, arch: str, qtype: str, *rope) -> tuple[TorchBackend, NativeBackend]:
    """The torch engine on the quantized file and, as its float32 reference, the native engine on the
    file's F32 twin (its exact dequantization: the native engine's float32 kernels, with the online
    softmax's float32 probabilities)."""
    g, tok = tiny_model(arch, qtype, *rope)
    twin, twin_tok = tiny_model(arch, qtype, *(rope or (None, None)), f32_twin=True)
    native = NativeBackend(twin, twin_tok, 128)
    native.model.set_attention_softmax("online")
    return TorchBackend(g, tok, 128, "cpu"), native


def close(a: np.ndarray, ref: np.ndarray) -> None:
    """Within TOL of the largest |logit|, and the same top-1 wherever ref's top-2 margin exceeds
    that bound (random weights make near-ties that no two float orders rank alike)."""
    assert a.shape == ref.shape
    bound = TOL * np.abs(ref).max()
    assert np.abs(a - ref).max() <= bound, np.abs(a - ref).max()
    top2 = np.sort(ref.reshape(-1, ref.shape[-1]), -1)[:, -2:]
    decisive = top2[:, 1] - top2[:, 0] > bound
    assert (a.reshape(top2.shape[0], -1).argmax(-1) == ref.reshape(top2.shape[0], -1).argmax(-1))[decisive].all()


@pytest.mark.parametrize("arch,qtype", CASES)
def test_prefill_decode_and_greedy_match_native(arch, qtype, tiny_model):
    torch_be, native = engines(tiny_model, arch, qtype)
    close(torch_be.logits_all(IDS), native.logits_all(IDS))               # one prefill of 40 rows
    torch_be.rollback(0)
    native.rollback(0)
    steps = [torch_be.extend(IDS[:30])] + [torch_be.extend([t]) for t in IDS[30:]]   # decode rows
    close(np.stack(steps), native.logits_all(IDS)[29:])
    greedy = SamplingParams(temperature=0, max_tokens=N_GREEDY, logit_bias=((2, -100.0),))   # no end token
    ours = [e.id for e in torch_be.generate(IDS[:10], greedy)]
    theirs = [e.id for e in native.generate(IDS[:10], greedy)]
    assert len(ours) == N_GREEDY and ours == theirs


@pytest.mark.parametrize("arch,rope", ROPE_CASES)
def test_rope_scaling_matches_native(tiny_model, arch, rope):
    """Llama 3's frequency factors, linear rope scaling (gemma3's on its global layers only),
    phi3's LongRoPE (its long factors, as a 128-token context padded to 256 exceeds the file's
    original 128, and its attn_factor) and YaRN in the Triton rope kernel; SmolLM3's layer without
    rope beside YaRN's; mistral3's YaRN betas and log multiplier; qwen3vl's extra-section pair."""
    torch_be, native = engines(tiny_model, arch, "Q8_0", *rope)
    close(torch_be.logits_all(IDS), native.logits_all(IDS))


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "phi3", "gemma2", "gemma3"])
def test_prefix_reuse_verify_rollback_and_batch(tiny_model, arch):
    """The Backend protocol on the torch engine: a reused prefix gives the logits a cold run gives;
    a verified draft gives each row's one-token logits, and rolling it back leaves the cache as
    before; a batch step gives each sequence what it gets alone. Each within the tolerance above:
    a pass of more than GEMV_MAX_ROWS rows multiplies dequantized weights, a smaller one runs the
    GEMV, and prefill and decode attention sum in different orders."""
    torch_be, _ = engines(tiny_model, arch, "Q8_0")
    cold = torch_be.extend(IDS)
    torch_be.rollback(0)                                               # its full blocks stay registered
    assert torch_be.reuse_prefix(IDS) == 32                           # two whole blocks of 16 tokens
    assert torch_be.kv_block_map().count("shared") == 2
    close(torch_be.extend(IDS[32:]), cold)                             # the 8-row tail reads the reused K/V

    torch_be.rollback(20)
    draft = IDS[20:26]
    checked = torch_be.verify(draft)                                   # (6, n_vocab): one pass
    torch_be.rollback(20)
    close(checked, np.stack([torch_be.extend([t]) for t in draft]))   # one decode step each
    close(torch_be.extend(IDS[26:]), cold)                             # the rolled-back cache is the cold one

    torch_be.reserve_sequences(2)
    a, b = torch_be.new_sequence(), torch_be.new_sequence()
    both = torch_be.forward_batch([(a, IDS[:17]), (b, IDS[5:9])])      # (2, n_vocab): a prefill and a short one
    alone_a = torch_be.forward_batch([(torch_be.new_sequence(), IDS[:17])])
    alone_b = torch_be.forward_batch([(torch_be.new_sequence(), IDS[5:9])])
    close(both, np.concatenate([alone_a, alone_b]))   # (21 rows read dequantized weights, 4 rows the GEMV)
    step = torch_be.forward_batch([(a, [IDS[17]]), (b, [IDS[9]])])   # then a decode step of both
    assert step.shape == both.shape and np.isfinite(step).all()


@pytest.mark.real_model          # a kvchat subprocess
def test_cuda_without_cuda_is_one_clear_line():
    """Without CUDA (this torch build has none, or CUDA_VISIBLE_DEVICES= hides the GPU):
    check_device and --device cuda say so in one line, and the CLI exits 2."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    check = subprocess.run([sys.executable, "-c", "from core.torch_backend import check_device; check_device('cuda')"],
                           capture_output=True, text=True, timeout=120, env=env)
    assert check.returncode == 1 and "BadInputError: --device cuda: " in check.stderr, check.stderr
    assert "has no CUDA support" in check.stderr or "no CUDA device found" in check.stderr
    proc = subprocess.run([sys.executable, "-m", "app.cli", "run", "--device", "cuda", "-m", "/nonexistent.gguf", "hi"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--device cuda" in lines[0] and "CUDA" in lines[0], proc.stderr


def test_gemma_greedy_tokens_equal_native(gemma_path):
    """The issue's check as a user runs it: gemma-3-270m, 8 greedy tokens, the torch engine on the
    CPU (the backend sets TRITON_INTERPRET=1 itself) against the native engine."""
    def run(*backend):
        proc = subprocess.run([sys.executable, "-m", "app.cli", "run", *backend, "-m", str(gemma_path),
                               "--temperature", "0", "-n", "8", "--ctx", "256", "The capital of France is"],
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout
    torch_text = run("--backend", "torch", "--device", "cpu")
    assert torch_text.strip() and torch_text == run("--backend", "native")


def test_a_bad_cuda_graphs_setting_is_refused_on_any_device(tiny_model, monkeypatch):
    g, tok = tiny_model("qwen2", "Q8_0")
    monkeypatch.setenv("KVCHAT_CUDA_GRAPHS", "off")
    with pytest.raises(BadInputError, match="^KVCHAT_CUDA_GRAPHS='off' is not one of 0, 1$"):
        TorchBackend(g, tok, 64, "cpu")


def test_models_info_names_the_types_dequantized_at_load(tiny_model):
    """A type without a Triton GEMV kernel is dequantized at load, and `models info` says so."""
    g, tok = tiny_model("llama", "Q4_0")
    assert g.info()["torch_dequantized"] == ["Q4_0"]
    assert TorchBackend(g, tok, 64, "cpu").model.layers[0].wq.quantized is None
    g, tok = tiny_model("qwen2", "Q4_K")
    assert g.info()["torch_dequantized"] == []
    assert TorchBackend(g, tok, 64, "cpu").model.layers[0].wq.quantized is not None


def test_sampling_on_the_device_picks_the_host_samplers_tokens(tiny_model):
    """generate on the torch engine samples where its logits are (Backend.extend_sample): with a
    seed it picks what core.sampler picks from the same logits copied to the host."""
    torch_be, _ = engines(tiny_model, "llama", "Q8_0")
    params = SamplingParams(temperature=4.0, top_k=0, seed=11, max_tokens=12, logit_bias=((2, -100.0),))
    ours = [e.id for e in torch_be.generate(IDS[:10], params)]
    torch_be.reset()
    sampler = Sampler(params, torch_be.tokenizer.n_vocab)
    sampler.remember(IDS[:10])
    theirs = [sampler.sample(torch_be.extend(IDS[:10]))]
    while len(theirs) < 12:
        theirs.append(sampler.sample(torch_be.extend([theirs[-1]])))
    assert ours == theirs and len(set(ours)) > 3


def test_a_json_schema_masks_sampling_on_the_device(tiny_model):
    """A schema's mask (core.constrained) reaches the device sampler: the random tiny model's
    sampled output still validates, and it is what the host sampler picks from the same logits."""
    import json

    import jsonschema
    torch_be, _ = engines(tiny_model, "llama", "Q8_0")
    schema = {"enum": ["yes", "no", "maybe"]}
    params = SamplingParams(temperature=1.0, top_k=0, seed=4, max_tokens=10, json_schema=json.dumps(schema))
    events = list(torch_be.generate(IDS[:10], params))
    assert torch_be.finish_reason == "stop"                 # the grammar completed: only </s> was left
    jsonschema.validate(json.loads("".join(e.text for e in events)), schema)
    torch_be.reset()
    sampler = Sampler(params, torch_be.tokenizer.n_vocab, torch_be.tokenizer)
    sampler.remember(IDS[:10])
    theirs = [sampler.sample(torch_be.extend(IDS[:10]))]
    while theirs[-1] not in torch_be.tokenizer.eog_ids:
        theirs.append(sampler.sample(torch_be.extend([theirs[-1]])))
    assert [e.id for e in events if e.id >= 0] == theirs[:-1]


def test_decode_step_padding_is_invisible(tiny_model):
    """A decode step padded to a captured batch size and the full table width (as the CUDA graphs
    run it, here eagerly) gives the real rows the unpadded step's logits exactly, and its pad rows
    write nothing but the cache's pad block."""
    import torch
    torch_be, _ = engines(tiny_model, "llama", "Q8_0")
    torch_be.reserve_sequences(3)
    seqs = [torch_be.new_sequence() for _ in range(3)]
    for seq, n in zip(seqs, (5, 17, 9)):
        torch_be.forward_batch([(seq, IDS[:n])])
    segments = [(seq, seq.n_tokens, 1) for seq in seqs]
    for seq in seqs:
        seq.append_slots(1)
    m, k, v = torch_be.model, torch_be.cache.k, torch_be.cache.v
    with torch.inference_mode():
        plain = m.decode_step(*m.decode_inputs(IDS[30:33], segments), k, v)
        k_plain = [t.clone() for t in k]
        padded = m.decode_step(*m.decode_inputs(IDS[30:33], segments, batch=4, width=9), k, v)
    assert torch.equal(padded[:3], plain)
    for before, after in zip(k_plain, k):
        assert torch.equal(before[:-1], after[:-1])                     # the last block is the pad block


def test_weights_stay_quantized_and_the_memory_estimate_covers_them(tiny_model):
    """Matrices of the types the Triton kernels read keep only their GGUF blocks (a prompt
    dequantizes one matrix at a time into the shared scratch buffer), so the weights take the
    file's bytes; device_bytes, which --device auto holds against free GPU memory, covers them,
    the KV cache and the scratch buffer in float16."""
    g, tok = tiny_model("qwen2", "Q4_K")
    torch_be = TorchBackend(g, tok, 128, "cpu")
    m = torch_be.model
    assert all(x.dense is None for x in m.matrices())
    assert m.nbytes == sum(t.n_bytes for t in g.tensors.values() if len(t.shape) == 2)
    kv = sum(t.nbytes for t in torch_be.cache.k + torch_be.cache.v)
    assert device_bytes(g, 128) >= m.nbytes + kv + m.scratch.buffer.numel() * 2


def test_fp16_rows_scales_only_the_rows_that_would_overflow():
    """A float16 product's activations: a row past 65504 (as gate * up was in these models on a GPU)
    is divided by a power of two, exactly; a row that fits is rounded as it is."""
    import torch

    from models.torch_decoder import fp16_rows
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((3, 64)).astype(np.float32))
    x[1] *= 1e5
    x[2, 5] = 70000.0
    assert not torch.isfinite(x.half()).all()                 # what rounding as it is would give
    x16, scale = fp16_rows(x)
    assert torch.isfinite(x16).all() and scale[0, 0] == 1.0 and scale[1, 0] >= 8 and scale[2, 0] == 4
    assert torch.equal(torch.log2(scale), torch.log2(scale).round())   # powers of two
    assert torch.equal(x16[0], x[0].half())
    assert torch.equal(x16.float() * scale, (x / scale).half().float() * scale)
    w = torch.from_numpy(rng.standard_normal((5, 64)).astype(np.float32)).half()
    got = (x16.float() @ w.float().T) * scale
    ref = x.double() @ w.double().T
    bound = 2.0 ** -10 * (x.abs().double() @ w.abs().double().T)   # float16's rounding of x, summed
    assert ((got.double() - ref).abs() <= bound).all()


def test_float16_mode_on_the_cpu_rounds_as_the_gpu(tiny_model):
    """float16=True on the CPU: weights and a prompt's rows in float16, as on CUDA (the reference of
    the GPU test below). A matrix's product is the float16 values' exact products summed in float32:
    the float64 sum of the rounded values within float32's summation error, and not the float32
    product. A prompt through a whole model takes that path and stays finite; on this case it stays
    within TOL of the native engine's float32 logits too (it does not for every tiny model: float16
    rounding of every product grew to 1.3% of the largest logit on phi3's LongRoPE one)."""
    import torch

    from kernels.types import F32
    from models.torch_decoder import GEMV_MAX_ROWS, Scratch, TorchMatrix
    rng = np.random.default_rng(3)
    w = rng.standard_normal((7, 96)).astype(np.float32)
    m = TorchMatrix(w, F32, 7, 96, torch.device("cpu"), torch.float16, Scratch())
    assert m.dense.dtype == torch.float16
    x = torch.from_numpy(rng.standard_normal((GEMV_MAX_ROWS + 4, 96)).astype(np.float32))
    got = m(x).double()
    exact = x.half().double() @ torch.from_numpy(w).half().double().T
    assert (got - exact).abs().max() <= 96 * 2.0 ** -24 * (x.abs().double() @ torch.from_numpy(w).abs().double().T).max()
    assert (got - (x @ torch.from_numpy(w).T).double()).abs().max() > 1e-4        # rounded, not float32

    torch_be, native = engines(tiny_model, "qwen2", "Q4_K")
    g, tok = tiny_model("qwen2", "Q4_K")
    half = TorchBackend(g, tok, 128, "cpu", float16=True)
    assert half.model.scratch.buffer.dtype == torch.float16
    logits = half.logits_all(IDS)
    assert np.isfinite(logits).all() and not np.array_equal(logits, torch_be.logits_all(IDS))
    close(logits, native.logits_all(IDS))


@pytest.mark.parametrize("arch,qtype,rope", ALL_CASES)
def test_float16_prompts_stay_finite(tiny_model, arch, qtype, rope):
    """Every case through the GPU's float16 roundings on the CPU: no product overflows float16 into
    inf or NaN (as an FFN's gate * up once did on a GPU, which fp16_rows fixed), so CI sees what
    only a GPU showed before."""
    g, tok = tiny_model(arch, qtype, *rope)
    assert np.isfinite(TorchBackend(g, tok, 128, "cpu", float16=True).logits_all(IDS)).all()


# logits_all of the torch engine: argv out.npy, ids, path, device (cpu: with the GPU's float16 roundings)
LOGITS = """
import sys, numpy as np
from core.tokenizer import Tokenizer
from core.torch_backend import TorchBackend
from models.gguf_file import open_model
out, ids, path, device = sys.argv[1], [int(i) for i in sys.argv[2].split(",")], sys.argv[3], sys.argv[4]
g = open_model(path)
be = TorchBackend(g, Tokenizer.from_gguf(g), 128, device, float16=True if device == "cpu" else None)
np.save(out, be.logits_all(ids))
be.close()
"""


GPU = pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")


def on_device(device: str, script: str, *args: str) -> subprocess.CompletedProcess:
    """A check in its own process, on the GPU (compiled Triton kernels: the child must not inherit
    this process's TRITON_INTERPRET=1, where the CPU tests set it) or on the CPU in Triton's
    interpreter (on a GPU machine this process compiles Triton for the GPU, so the interpreted run
    gets a process of its own too)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@GPU
@pytest.mark.parametrize("arch,qtype,rope", ALL_CASES)
def test_cuda_engine_matches_its_cpu_run(tiny_model, tmp_path, arch, qtype, rope):
    """The engine on the GPU (compiled Triton kernels, cuBLAS) against the same engine on the CPU
    in Triton's interpreter with the GPU's float16 roundings (float16=True): every architecture/type
    case, and every rope scaling on Q8_0. The 40-token prompt takes the float16 matrix products
    (more than GEMV_MAX_ROWS rows); the CPU tests above hold the float32 run to the native engine.

    Within TOL: the two runs differ in the order of float32 sums and in the GPU's approximate exp2
    and sqrt, a few units of 2^-24 each, but these random models magnify such a change where it
    moves a value across a float16 rounding boundary (the next product then sees 2^-11). On the
    CPU, summing the float16 products in float64 instead of float32 moved the logits by up to
    1.6e-3 of the largest (smollm3 with YaRN), a sixth of TOL; a wrong kernel is off by the logits'
    own size."""
    g, _ = tiny_model(arch, qtype, *rope)
    got = {}
    for device in ("cuda", "cpu"):
        on_device(device, LOGITS, str(tmp_path / f"{device}.npy"), ",".join(map(str, IDS)), str(g.path), device)
        got[device] = np.load(tmp_path / f"{device}.npy")
    assert np.isfinite(got["cuda"]).all()
    close(got["cuda"], got["cpu"])


@GPU
def test_cuda_graph_decode_equals_eager(tiny_model):
    """Decode steps replayed from CUDA graphs (batch 1 and a batch of 3 padded to 4) give eager
    decoding's logits. Both engines take the same tokens at every step (eager's greedy picks), so
    one near-tie cannot send them down different paths. Attention's split count follows the table
    width (the graph's is the context's), so with enough keys the sums differ in order: the logits
    must agree within 1% of the largest and pick the same top token wherever eager's top-2 margin
    exceeds that. (Here every sequence has one split either way; on an H200 the batch-1 steps came
    out identical, and the batch-3 step showed the NaN that fp16_rows fixed.)"""
    g, _ = tiny_model("qwen2", "Q4_K")
    proc = on_device("cuda", """
import sys, numpy as np
from core.tokenizer import Tokenizer
from core.torch_backend import TorchBackend
from models.gguf_file import open_model
g = open_model(sys.argv[1]); tok = Tokenizer.from_gguf(g)
eager, graphed = TorchBackend(g, tok, 128, "cuda"), TorchBackend(g, tok, 128, "cuda")
eager.graph_batch_max = 0
seqs = {}
for be in (eager, graphed):
    be.reserve_sequences(3)
    seqs[be] = [be.new_sequence() for _ in range(3)]
both = lambda step: [np.atleast_2d(step(be, seqs[be])) for be in (eager, graphed)]
first = both(lambda be, ss: np.stack([be.forward_batch([(s, list(range(3, 3 + n)))])[0]
                                      for s, n in zip(ss, (5, 17, 9))]))
tokens = [int(r.argmax()) for r in first[0]]
steps = [both(lambda be, ss: be.extend([7])) for _ in range(4)]              # batch 1
for _ in range(6):                                                           # batch 3 (graph of 4)
    steps.append(both(lambda be, ss: be.forward_batch([(s, [t]) for s, t in zip(ss, tokens)])))
    tokens = [int(r.argmax()) for r in steps[-1][0]]
for i, (a, b) in enumerate(steps):
    bound = 0.01 * np.abs(a).max()
    top2 = np.sort(a, -1)[:, -2:]
    decisive = top2[:, 1] - top2[:, 0] > bound
    same = a.argmax(-1) == b.argmax(-1)
    print(f"step {i}: max diff {np.abs(a - b).max() / np.abs(a).max():.2e} of the largest; "
          f"top-1 same {same.tolist()}, decisive {decisive.tolist()}")
    assert np.isfinite(b).all() and np.abs(a - b).max() <= bound and same[decisive].all()
assert graphed._graphs is not None and sorted(graphed._graphs.graphs) == [1, 4]
""", str(g.path))
    print(proc.stdout)


@GPU
def test_out_of_gpu_memory_is_one_line_and_auto_falls_back_to_the_cpu(tiny_model):
    """With the process allowed almost no GPU memory, loading runs out of it: --device auto says so
    on stderr and runs the CPU engine; --device cuda is a BadInputError (exit 2)."""
    g, _ = tiny_model("qwen2", "Q8_0")
    proc = on_device("cuda", """
import sys, torch
torch.cuda.set_per_process_memory_fraction(1e-6)
from core.engine import Engine
from models.errors import BadInputError
engine = Engine(sys.argv[1], device="auto", n_ctx=64)
assert engine.backend_name == "native" and engine.device == "cpu"
try:
    Engine(sys.argv[1], device="cuda", n_ctx=64)
    raise SystemExit("no error")
except BadInputError as e:
    assert "out of GPU memory" in str(e) and "\\n" not in str(e)
""", str(g.path))
    assert proc.stderr.count("out of GPU memory") == 1 and "running on the CPU" in proc.stderr


def test_experts_compute_llamacpps_mixture(tiny_model):
    """The torch engine's mixture of experts against a numpy model of llama.cpp's (the routing of
    kernels.reference, the experts' SwiGLU in float64, the weighted outputs added in order of
    probability) on random rows, within float32 rounding: the logits' 1% bound above would not see
    the weights' normalization, which scales this FFN's output by about 1.5."""
    import torch
    from kernels.reference import moe_route_ref
    from tests.engine.conftest import N_EMBD, N_EXPERT_USED
    g, tok = tiny_model("qwen3moe", "Q4_K")
    model = TorchBackend(g, tok, 128, "cpu").model
    layer = model.layers[1]
    h = torch.from_numpy(np.random.default_rng(5).normal(0, 1, (6, N_EMBD)).astype(np.float32))
    got = model._experts(layer, h).numpy()
    sel, wts = moe_route_ref(layer.router(h).numpy(), N_EXPERT_USED)
    gate, up, down = ([m.dense.double().numpy() for m in ms] for ms in layer.experts)
    x = h.double().numpy()
    want = np.zeros_like(x)
    for r in range(len(x)):
        for j, e in enumerate(sel[r]):
            a = gate[e] @ x[r]
            want[r] += down[e] @ (a / (1 + np.exp(-a)) * (up[e] @ x[r])) * wts[r, j]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
