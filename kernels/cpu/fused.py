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
from kernels.cpu.qdot import (Q5_0_KIND, Q8_0_KIND, _q0_x8_rows, _q4_k_rows, _q6_k_rows, _quantize_q8_0_serial,
                              _quantize_q8_k_serial)

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


@njit(cache=True, error_model="numpy")
def matmul_row(layout, ggml_type, xq, dx0, sx, dxk, bs16, bsp, run_start, run_len, run_batched, out):
    """qdot.matmul_into inside compiled code: one quantized row times an exact layout."""
    if ggml_type == 14:
        _q6_k_rows(layout, xq, dxk, bs16, run_start, run_len, run_batched, out)
    elif ggml_type == 12:
        _q4_k_rows(layout, xq, dxk, bsp, run_start, run_len, run_batched, out)
    elif ggml_type == 8:
        _q0_x8_rows(Q8_0_KIND, layout, xq, dx0, sx, out)
    else:
        _q0_x8_rows(Q5_0_KIND, layout, xq, dx0, sx, out)


@njit(cache=True, error_model="numpy")
def project(h, W0, W1, W2, types, xq, dx0, sx, dxk, bs16, bsp, rs, rl, rb, out0, out1, out2):
    """A projection group's parts (1 to 3 exact layouts; types[p] < 0: no part p) for one row h:
    h is quantized once per vec-dot type, as the general path shares it."""
    last = -1
    for p in range(3):
        t = types[p]
        if t < 0:
            break
        kind = Q8_0 if t == 6 or t == 8 else Q8_K
        if kind != last:
            quantize_into(h, kind, xq, dx0 if kind == Q8_0 else dxk, sx, bs16, bsp)
            last = kind
        W, out = (W0, out0) if p == 0 else ((W1, out1) if p == 1 else (W2, out2))
        matmul_row(W, t, xq, dx0, sx, dxk, bs16, bsp, rs, rl, rb, out)


@njit(cache=True, error_model="numpy")
def decode_layer(x, pos, cs, lo, chunk, key0,                                   # this token
                 eps, attn_norm, ffn_norm, post_attn_norm, post_ffn_norm,       # norms (post: size 0 = none)
                 Wqkv0, Wqkv1, Wqkv2, qkv_types, qkv_where, qkv0, qkv1, qkv2,   # q, k, v: parts and members
                 bq, bk, bv, qn, kn, neox, q_scale, kq_scale,
                 k_cache, v_cache, block_table, q16, kbuf, att,
                 Wo, o_type, o_buf,
                 Wgu0, Wgu1, gu_types, gu_where, gu0, gu1, geglu, gelu_tab, a,
                 Wd, d_type, d_buf, h,
                 xq_d, dx0_d, sx_d, dxk_d, bs16_d, bsp_d,                      # q8 forms of a (1, D) row
                 xq_o, dx0_o, sx_o, dxk_o, bs16_o, bsp_o,                      # ... of attention's (1, Hq*hd)
                 xq_f, dx0_f, sx_f, dxk_f, bs16_f, bsp_f,                      # ... of the FFN's (1, F)
                 rs, rl, rb):
    """One layer of one decode token, in place on x (1, D): models.transformer.Block.decode_one's
    steps (the general path's arithmetic) in one compiled call, so a token costs one dispatch per
    layer instead of a few dozen Python operations. where[m] = (part, first column, n_rows) of
    member m (q, k, v / gate, up) in its part's output."""
    D = x.shape[1]
    _, Hq, hd = q16.shape
    Hkv = kbuf.shape[1]
    # attention
    _rms_norm_serial(x, attn_norm, eps, h)
    project(h, Wqkv0, Wqkv1, Wqkv2, qkv_types, xq_d, dx0_d, sx_d, dxk_d, bs16_d, bsp_d, rs, rl, rb,
            qkv0, qkv1, qkv2)
    mq, mk, mv = _member(qkv_where, 0, qkv0, qkv1, qkv2), _member(qkv_where, 1, qkv0, qkv1, qkv2), \
        _member(qkv_where, 2, qkv0, qkv1, qkv2)
    q = np.ascontiguousarray(mq).reshape(1, Hq, hd)
    k = np.ascontiguousarray(mk).reshape(1, Hkv, hd)
    v = np.ascontiguousarray(mv).reshape(1, Hkv, hd)
    attn_inputs(q, k, v, bq, bk, bv, qn, kn, eps, cs, neox, q_scale, k_cache, v_cache, block_table, pos, q16, kbuf)
    n_kv = pos + 1
    S = np.empty((Hq, -(-(n_kv - key0) // 8) * 8), np.float32)
    attend_one(q16[0], k_cache, v_cache, block_table, lo, n_kv, chunk, key0, kq_scale, S, att)
    kind = Q8_0 if o_type == 6 or o_type == 8 else Q8_K
    quantize_into(att.reshape(1, Hq * hd), kind, xq_o, dx0_o if kind == Q8_0 else dxk_o, sx_o, bs16_o, bsp_o)
    matmul_row(Wo, o_type, xq_o, dx0_o, sx_o, dxk_o, bs16_o, bsp_o, rs, rl, rb, o_buf)
    o = o_buf[:, :D]
    if post_attn_norm.size:
        _rms_norm_serial(o, post_attn_norm, eps, o)
    x += o
    # feed-forward
    _rms_norm_serial(x, ffn_norm, eps, h)
    project(h, Wgu0, Wgu1, Wgu1, gu_types, xq_d, dx0_d, sx_d, dxk_d, bs16_d, bsp_d, rs, rl, rb, gu0, gu1, gu1)
    gate = np.ascontiguousarray(_member(gu_where, 0, gu0, gu1, gu1))
    up = np.ascontiguousarray(_member(gu_where, 1, gu0, gu1, gu1))
    kind = Q8_0 if d_type == 6 or d_type == 8 else Q8_K
    act_quantize(gate, up, geglu, gelu_tab, a, kind, xq_f, dx0_f if kind == Q8_0 else dxk_f, sx_f, bs16_f, bsp_f)
    matmul_row(Wd, d_type, xq_f, dx0_f, sx_f, dxk_f, bs16_f, bsp_f, rs, rl, rb, d_buf)
    d = d_buf[:, :D]
    if post_ffn_norm.size:
        _rms_norm_serial(d, post_ffn_norm, eps, d)
    x += d


@njit(cache=True, error_model="numpy", inline="always")
def _member(where, m, out0, out1, out2):
    p, c0, n = where[m, 0], where[m, 1], where[m, 2]
    out = out0 if p == 0 else (out1 if p == 1 else out2)
    return out[:, c0:c0 + n]
