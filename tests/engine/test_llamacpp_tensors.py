"""Layer by layer against llama.cpp's own intermediate tensors (qwen2.5-coder-0.5b-instruct and
gemma-3-270m, one decode step): each native op is fed llama.cpp's input to that op and compared with llama.cpp's
output of it, so a difference cannot come from earlier layers.

llama.cpp's graph callback (cb_eval) hands us every tensor of the step. Every op must give
llama.cpp's tensor bit for bit:
- RMSNorm, rope, SwiGLU and gemma's GELU (ggml's evaluation order, its AVX2 expf, its float16
  GELU table);
- the quantized matmuls (activations quantized to q8_0 / q8_K as llama.cpp does, exact integer
  dots, and llama.cpp's float steps; q/k/v and gate/up run fused);
- the softmax (given llama.cpp's scores, our probabilities are its float16 ones) and attention
  over llama.cpp's own float16 cache.
(Without bit-exactness greedy decoding forks from llama.cpp at near ties: a flip of one q8
rounding downstream turns a 1e-7 difference into a 1e-3 one. On a CPU without AVX2 the exact
kernels are absent and these tests do not apply.)
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest


from core.engine import Engine
from models import registry

MODEL = "qwen2.5-coder-0.5b-instruct"
GEMMA = "gemma-3-270m"
# struct ggml_tensor (ggml.h of the llama.cpp that llama-cpp-python 0.3.36 vendors): type at 0,
# ne[4] at 16, nb[4] at 48, data at 248, name[64] at 256
_TYPE, _NE, _NB, _DATA, _NAME = 0, 16, 48, 248, 256
_F32, _F16 = 0, 1


def _read_tensor(ptr: int) -> tuple[str, np.ndarray] | None:
    typ = ctypes.c_int32.from_address(ptr + _TYPE).value
    data = ctypes.c_void_p.from_address(ptr + _DATA).value
    if typ not in (_F32, _F16) or not data:
        return None
    ne = [ctypes.c_int64.from_address(ptr + _NE + 8 * i).value for i in range(4)]
    nb = [ctypes.c_uint64.from_address(ptr + _NB + 8 * i).value for i in range(4)]
    item = 4 if typ == _F32 else 2
    span = sum((n - 1) * b for n, b in zip(ne, nb)) + item
    raw = np.frombuffer(ctypes.string_at(data, span), np.uint8)
    rows = np.lib.stride_tricks.as_strided(raw, (ne[3], ne[2], ne[1], ne[0] * item), (nb[3], nb[2], nb[1], 1))
    arr = np.ascontiguousarray(rows).view(np.float32 if typ == _F32 else np.float16)
    return ctypes.string_at(ptr + _NAME).decode(), arr.reshape(ne[::-1]).astype(np.float32)


def _decode_step(model: str):
    """(llama.cpp's tensors of one decode step, in graph order; the native engine; the step's position)."""
    import llama_cpp
    import llama_cpp.llama_cpp as lc

    registry.resolve(model)
    tensors: list[tuple[str, np.ndarray]] = []
    capture = [False]

    @lc.ggml_backend_sched_eval_callback
    def on_tensor(t, ask, _user_data):
        if not ask and capture[0]:
            got = _read_tensor(ctypes.cast(t, ctypes.c_void_p).value)
            if got is not None:
                tensors.append(got)
        return True

    default_params = lc.llama_context_default_params

    def params_with_callback():
        p = default_params()
        p.cb_eval = on_tensor
        return p

    mp = pytest.MonkeyPatch()
    mp.setattr(llama_cpp.llama.llama_cpp, "llama_context_default_params", params_with_callback)
    try:
        llama = Engine(model, backend="llama.cpp", n_ctx=256, threads=2)
    finally:
        mp.undo()
    native = Engine(model, backend="native", n_ctx=256, threads=2)
    ids = llama.prompt_ids("def add(a, b):\n    return", chat=False)
    llama.backend.extend(ids)
    capture[0] = True
    llama.backend.extend([ids[-1]])                   # one decode step at position len(ids)
    capture[0] = False
    yield tensors, native, len(ids)
    llama.close()
    native.close()


@pytest.fixture(scope="module")
def step():
    yield from _decode_step(MODEL)


@pytest.fixture(scope="module")
def gemma_step():
    yield from _decode_step(GEMMA)


def _get(tensors, name: str, nth: int = 0) -> np.ndarray:
    found = [a for n, a in tensors if n == name]
    assert len(found) > nth, f"llama.cpp produced no tensor {name!r} #{nth}"
    return found[nth]


def _ulps(a, b) -> int:
    a = np.asarray(a, np.float32).ravel().view(np.int32).astype(np.int64)
    b = np.asarray(b, np.float32).ravel().view(np.int32).astype(np.int64)
    return int(np.abs(a - b).max())


def test_norms_rope_swiglu_are_bit_exact(step):
    """RMSNorm (float32 squares summed in float64 in order), rope (ggml's float32 angles, fused
    rotation) and SwiGLU (ggml_v_expf's fused multiply-adds) reproduce llama.cpp to the bit."""
    from kernels.cpu import rms_norm, rope, swiglu
    tensors, native, pos = step
    model = native.backend.model
    block, cfg = model.blocks[0], model.cfg
    x = _get(tensors, "embd").reshape(1, -1)
    assert _ulps(rms_norm(x, block.attn_norm, cfg.norm_eps), _get(tensors, "attn_norm-0")) == 0
    ffn_in = _get(tensors, "ffn_inp-0").reshape(1, -1)
    assert _ulps(rms_norm(ffn_in, block.ffn_norm, cfg.norm_eps), _get(tensors, "ffn_norm-0")) == 0
    positions = np.array([pos])
    for name, heads in (("Qcur-0", cfg.n_head), ("Kcur-0", cfg.n_head_kv)):   # #1 biased, #3 rotated
        biased = _get(tensors, name, 1).reshape(1, heads, cfg.head_dim)
        rotated = rope(biased, positions, block.rope[0], cfg.rope_neox, cfg.n_rot)
        assert _ulps(rotated, _get(tensors, name, 3)) == 0, name
    gate, up = _get(tensors, "ffn_gate-0").reshape(1, -1), _get(tensors, "ffn_up-0").reshape(1, -1)
    assert _ulps(swiglu(gate, up), _get(tensors, "ffn_swiglu-0")) == 0


def _one_row(m, x: np.ndarray) -> np.ndarray:
    """x (1, K) through matrix m's exact kernel with a single token's arithmetic."""
    from kernels.cpu.qdot import Int8Rows
    from kernels.types import TRAITS
    return m.matmul_int8(Int8Rows(x, TRAITS[m.ggml_type].vec_dot), runs=[(0, 1, False)])


def _members(proj, x: np.ndarray) -> list[np.ndarray]:
    """Each member's output (q, k, v; gate, up) of a models.transformer.Projections for one row x."""
    outs = [_one_row(m, x) for m in proj.matrices()]
    return [outs[p][:, c0:c0 + n] for p, c0, n in proj.where]


@pytest.mark.parametrize("which", ["step", "gemma_step"])
def test_quantized_matmuls_are_bit_exact(which, request):
    tensors, native, _ = request.getfixturevalue(which)
    model = native.backend.model
    for il in (0, 1, model.cfg.n_layer - 1):
        block = model.blocks[il]
        q, k, v = _members(block.qkv, _get(tensors, f"attn_norm-{il}").reshape(1, -1))
        gate, up = _members(block.gate_up, _get(tensors, f"ffn_norm-{il}").reshape(1, -1))
        checks = [(q, f"Qcur-{il}"), (k, f"Kcur-{il}"), (v, f"Vcur-{il}"), (gate, f"ffn_gate-{il}"), (up, f"ffn_up-{il}")]
        act = "ffn_swiglu" if which == "step" else "ffn_geglu"
        checks.append((_one_row(block.w_down, _get(tensors, f"{act}-{il}").reshape(1, -1)), f"ffn_out-{il}"))
        checks.append((_one_row(block.wo, _get(tensors, f"kqv_out-{il}").reshape(1, -1)),
                       f"attn_out-{il}" if which == "gemma_step" else None))
        for got, name in checks:
            if name is not None and any(n == name for n, _ in tensors):
                assert _ulps(got, _get(tensors, name, 0)) == 0, name
    logits = _one_row(model.output, _get(tensors, "result_norm").reshape(1, -1))
    assert _ulps(logits, _get(tensors, "result_output")) == 0


def test_decode_attention_over_llama_cpp_cache(step):
    """Our split-KV decode kernel over llama.cpp's own f16 K/V cache and rotated query."""
    from kernels.cpu import attention_decode
    tensors, native, pos = step
    cfg = native.backend.model.cfg
    n_kv, hd, hkv = pos + 1, cfg.head_dim, cfg.n_head_kv
    k = _get(tensors, "cache_k_l0 (view)").reshape(-1, hkv, hd)[:n_kv]                 # (n, Hkv, hd)
    v = _get(tensors, "cache_v_l0 (view)").reshape(hd, hkv, -1)[:, :, :n_kv]          # V is stored transposed
    v = v.transpose(2, 1, 0)
    bs = 16
    n_blocks = -(-n_kv // bs)
    k_cache = np.zeros((n_blocks, bs, hkv, hd), np.float16)
    v_cache = np.zeros_like(k_cache)
    k_cache.reshape(-1, hkv, hd)[:n_kv] = k
    v_cache.reshape(-1, hkv, hd)[:n_kv] = v
    q = _get(tensors, "Qcur-0", 3).reshape(cfg.n_head, hd)
    q = q.astype(np.float16).astype(np.float32)                           # llama.cpp's f16 copy of Q
    out = attention_decode(q, k_cache, v_cache, np.arange(n_blocks, dtype=np.int32), n_kv, cfg.attn_scale)
    assert _ulps(out, _get(tensors, "kqv-0").reshape(cfg.n_head, hd)) == 0


@pytest.mark.parametrize("which", ["step", "gemma_step"])
def test_softmax_is_llama_cpps(which, request):
    """llama.cpp's scores of layer 0 (all n_kv cache cells, padded to 256, the unused ones masked)
    through our softmax give bit for bit the float16 probabilities llama.cpp multiplies V by."""
    from kernels.cpu.attention import _softmax_row
    tensors, native, pos = request.getfixturevalue(which)
    cfg = native.backend.model.cfg
    kq = _get(tensors, "kq-0")                                            # (1, Hq, 1, n_kv)
    kq_scale = 1.0 if cfg.scale_q else cfg.attn_scale                     # llama.cpp scales gemma's Q instead
    scores = np.ascontiguousarray(kq.reshape(-1, kq.shape[-1]), np.float32)   # (Hq, n_kv)
    for row in scores:
        _softmax_row(row, 0, row.shape[0], 0, 0, pos, np.float32(kq_scale), np.float32(0))   # keys past pos: not written yet
    theirs = _get(tensors, "kq_soft_max-0").reshape(-1, kq.shape[-1]).astype(np.float16).astype(np.float32)
    assert _ulps(scores, theirs) == 0


def test_gemma_norms_and_gelu_are_bit_exact(gemma_step):
    """gemma3: the pre/post norms, the per-head Q norm and GeGLU through ggml's float16 GELU table."""
    from kernels.cpu import geglu_tanh, rms_norm
    tensors, native, _ = gemma_step
    model = native.backend.model
    block, cfg = model.blocks[0], model.cfg
    for x_name, w, y_name in (("sa_out-0", block.ffn_norm, "ffn_norm-0"),
                              ("ffn_out-0", block.weights.post_ffn_norm, "ffn_post_norm-0")):
        assert _ulps(rms_norm(_get(tensors, x_name).reshape(1, -1), w, cfg.norm_eps), _get(tensors, y_name)) == 0
    q = _get(tensors, "Qcur-0", 1).reshape(-1, cfg.head_dim)
    assert _ulps(rms_norm(q, block.weights.q_norm, cfg.norm_eps), _get(tensors, "Qcur_normed-0")) == 0
    gate, up = _get(tensors, "ffn_gate-0").reshape(1, -1), _get(tensors, "ffn_up-0").reshape(1, -1)
    assert _ulps(geglu_tanh(gate, up), _get(tensors, "ffn_geglu-0")) == 0
