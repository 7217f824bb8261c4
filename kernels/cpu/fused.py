"""The small steps of decode tokens, fused: each call chains kernels that already exist (the same
arithmetic, so the same bits), on preallocated row buffers. A decode step runs one compiled call
per layer instead of thirty Python-level operations, whose glue was a sixth of a token's time on
qwen 0.5B (models.transformer.Block.decode_rows uses them). The rows are one token, or the few
tokens of a speculative check, each with the arithmetic it gets alone."""
from __future__ import annotations

import numpy as np
from numba import njit

from kernels.cpu.activations import _round_to_f16
from kernels.cpu.attention import _decode_pv, _decode_scores, _decode_softmax, _write_kv_serial
from kernels.cpu.ops import _geglu_tanh_serial, _rms_norm_serial, _rope_serial, _swiglu_serial
from kernels.cpu.qdot import _quantize_q8_0_serial, _quantize_q8_k_serial, matmul_row
from kernels.types import ACT_KIND, ACT_Q8_0


@njit(cache=True, error_model="numpy")
def quantize_into(h, kind, xq, dx, sx, bs16, bsp):
    """Quantize one row for a weight type's vec-dot type (kind: types.ACT_Q8_0 or ACT_Q8_K)."""
    if kind == ACT_Q8_0:
        _quantize_q8_0_serial(h, xq, dx, sx)
    else:
        _quantize_q8_k_serial(h, xq, dx, bs16, bsp)


@njit(cache=True, error_model="numpy")
def attn_inputs(q, k, v, bq, bk, bv, qn, kn, eps, cs, neox, q_scale, k_cache, v_cache, block_table, pos, q16, kbuf):
    """R tokens' q (R, Hq, hd), k, v (R, Hkv, hd) as the attention takes them, in the order of
    llama.cpp's graph: biases (bq.size > 0), per-head RMSNorm of q and k (qn.size > 0), rope (cs:
    the positions' cos/sin), q times q_scale (gemma; 1 = none) and rounded to float16 into q16;
    k and v written into the float16 cache at pos .. pos+R-1."""
    R, Hq, hd = q.shape
    Hkv = k.shape[1]
    for r in range(R):
        if bq.size:
            q[r] += bq.reshape(Hq, hd)
            k[r] += bk.reshape(Hkv, hd)
            v[r] += bv.reshape(Hkv, hd)
        if qn.size:
            _rms_norm_serial(q[r], qn, eps, q[r])
            _rms_norm_serial(k[r], kn, eps, k[r])
    _rope_serial(q, cs, neox, q16)
    _rope_serial(k, cs, neox, kbuf)
    if q_scale != np.float32(1.0):
        q16 *= q_scale
    for r in range(R):
        _round_to_f16(q16[r], q16[r])
    _write_kv_serial(k_cache, v_cache, block_table, pos, kbuf, v)


@njit(cache=True, error_model="numpy")
def attend_one(q16, k_cache, v_cache, block_table, lo, hi, chunk, key0, scale, S, out):
    """attention_decode's three steps for one token (scores, softmax, P@V), llama.cpp's arithmetic."""
    _decode_scores(q16, k_cache, block_table, lo, hi, chunk, key0, S)
    _decode_softmax(S, key0, lo, hi, scale)
    _decode_pv(S, v_cache, block_table, key0, hi, out)


@njit(cache=True, error_model="numpy")
def act_quantize(gate, up, geglu, gelu_table, a, kind, xq, dx, sx, bs16, bsp):
    """a = act(gate) * up (SwiGLU, or GeGLU through ggml's float16 table) row by row, then quantized."""
    for r in range(gate.shape[0]):
        if geglu:
            _geglu_tanh_serial(gate[r], up[r], a[r], gelu_table)
        else:
            _swiglu_serial(gate[r], up[r], a[r])
    quantize_into(a, kind, xq, dx, sx, bs16, bsp)


@njit(cache=True, error_model="numpy")
def project(h, W0, W1, W2, types, xq, dx0, sx, dxk, bs16, bsp, rs, rl, rb, out0, out1, out2):
    """A projection group's parts (1 to 3 exact layouts; types[p] < 0: no part p) for one row h:
    h is quantized once per vec-dot type, as the general path shares it."""
    last = -1
    for p in range(3):
        t = types[p]
        if t < 0:
            break
        kind = ACT_KIND[t]
        if kind != last:
            quantize_into(h, kind, xq, dx0 if kind == ACT_Q8_0 else dxk, sx, bs16, bsp)
            last = kind
        W, out = (W0, out0) if p == 0 else ((W1, out1) if p == 1 else (W2, out2))
        matmul_row(W, t, xq, dx0, sx, dxk, bs16, bsp, rs, rl, rb, out)


@njit(cache=True, error_model="numpy")
def decode_layer(x, pos, cs, lo, chunk, key0,                                   # these tokens
                 eps, attn_norm, ffn_norm, post_attn_norm, post_ffn_norm,       # norms (post: size 0 = none)
                 Wqkv0, Wqkv1, Wqkv2, qkv_types, qkv_where, qkv0, qkv1, qkv2,   # q, k, v: parts and members
                 bq, bk, bv, qn, kn, neox, q_scale, kq_scale,
                 k_cache, v_cache, block_table, q16, kbuf, att,
                 Wo, o_type, o_buf,
                 Wgu0, Wgu1, gu_types, gu_where, gu0, gu1, geglu, gelu_tab, a,
                 Wd, d_type, d_buf, h,
                 xq_d, dx0_d, sx_d, dxk_d, bs16_d, bsp_d,                      # q8 forms of (R, D) rows
                 xq_o, dx0_o, sx_o, dxk_o, bs16_o, bsp_o,                      # ... of attention's (R, Hq*hd)
                 xq_f, dx0_f, sx_f, dxk_f, bs16_f, bsp_f,                      # ... of the FFN's (R, F)
                 rs, rl, rb):
    """One layer of R decode tokens at positions pos .. pos+R-1, in place on x (R, D):
    models.transformer.Block.decode_rows's steps (the general path's arithmetic for decode rows:
    every matrix with the one-row arithmetic, runs rs/rl/rb; each row's attention as the one-token
    kernel gives it) in one compiled call. lo, chunk, key0 (R,): each row's first visible key and
    its attention split. where[m] = (part, first column, n_rows) of member m (q, k, v / gate, up)
    in its part's output."""
    R, D = x.shape
    _, Hq, hd = q16.shape
    Hkv = kbuf.shape[1]
    # attention
    _rms_norm_serial(x, attn_norm, eps, h)
    project(h, Wqkv0, Wqkv1, Wqkv2, qkv_types, xq_d, dx0_d, sx_d, dxk_d, bs16_d, bsp_d, rs, rl, rb,
            qkv0, qkv1, qkv2)
    mq, mk, mv = _member(qkv_where, 0, qkv0, qkv1, qkv2), _member(qkv_where, 1, qkv0, qkv1, qkv2), \
        _member(qkv_where, 2, qkv0, qkv1, qkv2)
    q = np.ascontiguousarray(mq).reshape(R, Hq, hd)
    k = np.ascontiguousarray(mk).reshape(R, Hkv, hd)
    v = np.ascontiguousarray(mv).reshape(R, Hkv, hd)
    attn_inputs(q, k, v, bq, bk, bv, qn, kn, eps, cs, neox, q_scale, k_cache, v_cache, block_table, pos, q16, kbuf)
    for r in range(R):
        n_kv = pos + r + 1
        S = np.empty((Hq, -(-(n_kv - key0[r]) // 8) * 8), np.float32)
        attend_one(q16[r], k_cache, v_cache, block_table, lo[r], n_kv, chunk[r], key0[r], kq_scale, S, att[r])
    kind = ACT_KIND[o_type]
    quantize_into(att.reshape(R, Hq * hd), kind, xq_o, dx0_o if kind == ACT_Q8_0 else dxk_o, sx_o, bs16_o, bsp_o)
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
    kind = ACT_KIND[d_type]
    act_quantize(gate, up, geglu, gelu_tab, a, kind, xq_f, dx0_f if kind == ACT_Q8_0 else dxk_f, sx_f, bs16_f, bsp_f)
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
