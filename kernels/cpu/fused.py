"""The small steps of one decode token, fused: each call chains kernels that already exist (the same
arithmetic, so the same bits), on preallocated one-row buffers. A decode step runs a dozen of
these per layer instead of thirty Python-level operations, which on qwen 0.5B was ~4 ms of a
~25 ms token (models.transformer.Block.decode_one uses them)."""
from __future__ import annotations

import numpy as np
from numba import njit

from kernels.cpu.activations import _round_to_f16
from kernels.cpu.attention import _decode_pv, _decode_scores, _decode_softmax, _write_kv_serial
from kernels.cpu.ops import _geglu_tanh_serial, _rms_norm_serial, _rope_serial, _swiglu_serial
from kernels.cpu.qdot import _quantize_q8_0_serial, _quantize_q8_k_serial

Q8_0, Q8_K = 0, 1


@njit(cache=True, error_model="numpy")
def quantize_into(h, kind, xq, dx, sx, bs16, bsp):
    """Quantize one row for a weight type's vec-dot type (kind Q8_0 or Q8_K)."""
    if kind == Q8_0:
        _quantize_q8_0_serial(h, xq, dx, sx)
    else:
        _quantize_q8_k_serial(h, xq, dx, bs16, bsp)


@njit(cache=True, error_model="numpy")
def norm_quantize(x, w, eps, h, kind, xq, dx, sx, bs16, bsp):
    """h = rms_norm(x) * w, then quantized as quantize_into."""
    _rms_norm_serial(x, w, eps, h)
    quantize_into(h, kind, xq, dx, sx, bs16, bsp)


@njit(cache=True, error_model="numpy")
def attn_inputs(q, k, v, bq, bk, bv, qn, kn, eps, cs, neox, q_scale, k_cache, v_cache, block_table, pos, q16, kbuf):
    """One token's q (1, Hq, hd), k, v (1, Hkv, hd) as the attention takes them, in the order of
    llama.cpp's graph: biases (bq.size > 0), per-head RMSNorm of q and k (qn.size > 0), rope (cs:
    this position's cos/sin), q times q_scale (gemma; 1 = none) and rounded to float16 into q16;
    k and v written into the float16 cache at pos."""
    if bq.size:
        q += bq.reshape(q.shape)
        k += bk.reshape(k.shape)
        v += bv.reshape(v.shape)
    if qn.size:
        _rms_norm_serial(q[0], qn, eps, q[0])
        _rms_norm_serial(k[0], kn, eps, k[0])
    _rope_serial(q, cs, neox, q16)
    _rope_serial(k, cs, neox, kbuf)
    if q_scale != np.float32(1.0):
        q16 *= q_scale
    _round_to_f16(q16[0], q16[0])
    _write_kv_serial(k_cache, v_cache, block_table, pos, kbuf, v)


@njit(cache=True, error_model="numpy")
def attend_one(q16, k_cache, v_cache, block_table, lo, hi, chunk, key0, scale, S, out):
    """attention_decode's three steps for one token (scores, softmax, P@V), llama.cpp's arithmetic."""
    _decode_scores(q16, k_cache, block_table, lo, hi, chunk, key0, S)
    _decode_softmax(S, key0, lo, hi, scale)
    _decode_pv(S, v_cache, block_table, key0, hi, out)


@njit(cache=True, error_model="numpy")
def act_quantize(gate, up, geglu, gelu_table, a, kind, xq, dx, sx, bs16, bsp):
    """a = act(gate) * up (SwiGLU, or GeGLU through ggml's float16 table), then quantized."""
    if geglu:
        _geglu_tanh_serial(gate[0], up[0], a[0], gelu_table)
    else:
        _swiglu_serial(gate[0], up[0], a[0])
    quantize_into(a, kind, xq, dx, sx, bs16, bsp)
