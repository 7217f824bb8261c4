"""A decoder layer for decode rows as one compiled call, on typed bundles.

The rows are one token, or the few tokens of a speculative check, each with the arithmetic it gets
alone. The call chains kernels that already exist (the same arithmetic, so the same bits) on row
buffers allocated once: a decode step runs one compiled call per layer instead of thirty
Python-level operations, whose glue was a large share of a small model's token time.

Its inputs are three named tuples, which numba types field by field:
- `LayerWeights`: the layer's exact weight layouts, norms, biases and scalars (built once per layer
  by models.transformer from its matrices);
- `RowBuffers`: the R-row work buffers (from a `RowBufferPool`, shared by layers of one shape);
- `attention.DecodePlan`: where the rows look in their sequence's paged cache (kernels.cpu.attention).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from kernels.cpu.activations import _round_to_f16
from kernels.cpu.attention import _decode_pv, _decode_scores, _decode_softmax, _write_kv_serial
from kernels.cpu.ops import _geglu_tanh_serial, _rms_norm_serial, _rope_serial, _swiglu_serial, soft_cap_rows
from kernels.cpu.qdot import Q8Buffers, matmul_row, quantize_into, run_arrays
from kernels.types import ACT_KIND, TRAITS

NONE = np.empty(0, np.float32)          # an absent optional vector (bias, Q/K norm, post-norm)


class Projection(NamedTuple):
    """Matrices that read one input (q, k, v or gate, up) as up to three exact layouts (parts);
    consecutive members of one type share a part (models.transformer.Projections)."""
    w0: np.ndarray
    w1: np.ndarray            # w1, w2: repeat w0 where there is no such part
    w2: np.ndarray
    types: np.ndarray         # (3,) int64 each part's GGML type; -1: no part
    where: np.ndarray         # (members, 3) int64: (part, first column, rows) of each member's output

    @staticmethod
    def of(parts: list[tuple[np.ndarray, int]], where) -> "Projection":
        layouts = [layout for layout, _ in parts]
        layouts += [layouts[0]] * (3 - len(parts))
        types = np.array([t for _, t in parts] + [-1] * (3 - len(parts)), np.int64)
        return Projection(*layouts, types, np.array(where, np.int64))


class LayerWeights(NamedTuple):
    """One decoder layer as decode_layer reads it (absent optional vectors: NONE)."""
    n_head: int
    n_head_kv: int
    head_dim: int
    eps: np.float32
    attn_norm: np.ndarray     # (D,)
    qkv: Projection
    bq: np.ndarray            # (Hq*hd,) q, k, v biases (qwen2)
    bk: np.ndarray
    bv: np.ndarray
    q_norm: np.ndarray        # (hd,) per-head RMSNorm of q and k (gemma3)
    k_norm: np.ndarray
    rope_neox: bool
    q_scale: np.float32       # q times this before attention (gemma3), else 1
    kq_scale: np.float32      # the scores times this (the others)
    softcap: np.float32       # the scores soft-capped at this before the softmax (gemma2), else 0
    wo: np.ndarray
    wo_type: int
    post_attn_norm: np.ndarray
    ffn_norm: np.ndarray
    gate_up: Projection
    geglu: bool               # GeGLU through ggml's float16 table, else SwiGLU
    gelu_table: np.ndarray
    w_down: np.ndarray
    w_down_type: int
    post_ffn_norm: np.ndarray


class RowBuffers(NamedTuple):
    """R rows' work buffers for decode_layer (x8 layouts' outputs padded to whole 8-row groups)."""
    h: np.ndarray             # (R, D) a normed row
    qkv: tuple                # the q, k, v parts' outputs (R, part rows)
    q16: np.ndarray           # (R, Hq, hd) q as attention reads it
    kbuf: np.ndarray          # (R, Hkv, hd) roped k
    att: np.ndarray           # (R, Hq, hd) attention's output
    o: np.ndarray             # (R, wo rows)
    gate_up: tuple            # the gate, up parts' outputs
    a: np.ndarray             # (R, F) act(gate) * up
    d: np.ndarray             # (R, w_down rows)
    q8_d: Q8Buffers           # quantized (R, D) rows
    q8_o: Q8Buffers           # ... (R, Hq*hd)
    q8_f: Q8Buffers           # ... (R, F)
    runs: tuple               # qdot.run_arrays: every row its single-token arithmetic


def _rows(ggml_type: int, layout: np.ndarray) -> int:
    return TRAITS[ggml_type].layout_rows(layout)


def row_buffers(w: LayerWeights, R: int) -> RowBuffers:
    f32 = lambda *shape: np.empty((R, *shape), np.float32)                   # noqa: E731
    D, Hq, Hkv, hd = w.attn_norm.shape[0], w.n_head, w.n_head_kv, w.head_dim
    F = _ff_width(w)

    def outs(p: Projection) -> tuple:
        layouts = (p.w0, p.w1, p.w2)
        return tuple(f32(_rows(int(t), layouts[i]) if t >= 0 else 1) for i, t in enumerate(p.types))

    return RowBuffers(f32(D), outs(w.qkv), f32(Hq, hd), f32(Hkv, hd), f32(Hq, hd), f32(_rows(w.wo_type, w.wo)),
                      outs(w.gate_up), f32(F), f32(_rows(w.w_down_type, w.w_down)),
                      Q8Buffers.alloc(R, D), Q8Buffers.alloc(R, Hq * hd), Q8Buffers.alloc(R, F),
                      run_arrays([(0, R, False)]))


def _ff_width(w: LayerWeights) -> int:
    """The FFN's width: the gate member's rows (where[0] = (part, column, rows))."""
    return int(w.gate_up.where[0, 2])


class RowBufferPool:
    """RowBuffers by (row count, the layer's shapes): the layers of a model share one set (a layer
    runs after the previous one is done with them)."""

    def __init__(self):
        self._pool: dict = {}

    def get(self, w: LayerWeights, R: int) -> RowBuffers:
        layouts = (w.qkv.w0, w.qkv.w1, w.qkv.w2, w.wo, w.gate_up.w0, w.gate_up.w1, w.gate_up.w2, w.w_down)
        types = (*w.qkv.types, w.wo_type, *w.gate_up.types, w.w_down_type)
        key = (R, w.attn_norm.shape[0], w.n_head, w.n_head_kv, w.head_dim, _ff_width(w),
               tuple(_rows(int(t), m) if t >= 0 else 1 for t, m in zip(types, layouts)))
        bufs = self._pool.get(key)
        if bufs is None:
            bufs = self._pool[key] = row_buffers(w, R)
        return bufs


@njit(cache=True, error_model="numpy")
def _attn_inputs(q, k, v, w, cs, k_cache, v_cache, plan, b):
    """R tokens' q (R, Hq, hd), k, v (R, Hkv, hd) as attention takes them, in the order of
    llama.cpp's graph: biases, per-head RMSNorm of q and k, rope (cs: the positions' cos/sin), q
    times q_scale and rounded to float16 into b.q16; k and v written into the float16 cache."""
    R, Hq, hd = q.shape
    Hkv = k.shape[1]
    for r in range(R):
        if w.bq.size:
            q[r] += w.bq.reshape(Hq, hd)
            k[r] += w.bk.reshape(Hkv, hd)
            v[r] += w.bv.reshape(Hkv, hd)
        if w.q_norm.size:
            _rms_norm_serial(q[r], w.q_norm, w.eps, q[r])
            _rms_norm_serial(k[r], w.k_norm, w.eps, k[r])
    _rope_serial(q, cs, w.rope_neox, b.q16)
    _rope_serial(k, cs, w.rope_neox, b.kbuf)
    if w.q_scale != np.float32(1.0):
        b.q16[:] *= w.q_scale
    for r in range(R):
        _round_to_f16(b.q16[r], b.q16[r])
    _write_kv_serial(k_cache, v_cache, plan.block_table, plan.pos, b.kbuf, v)


@njit(cache=True, error_model="numpy")
def _project(h, p, q8, runs, o0, o1, o2):
    """A projection's parts for rows h: h is quantized once per vec-dot type, as the general path
    shares it."""
    last = -1
    for i in range(3):
        t = p.types[i]
        if t < 0:
            break
        kind = ACT_KIND[t]
        if kind != last:
            quantize_into(h, kind, q8)
            last = kind
        if i == 0:
            matmul_row(p.w0, t, q8, runs, o0)
        elif i == 1:
            matmul_row(p.w1, t, q8, runs, o1)
        else:
            matmul_row(p.w2, t, q8, runs, o2)


@njit(cache=True, error_model="numpy", inline="always")
def _member(where, m, outs):
    part, c0, n = where[m, 0], where[m, 1], where[m, 2]
    out = outs[0] if part == 0 else (outs[1] if part == 1 else outs[2])
    return np.ascontiguousarray(out[:, c0:c0 + n])


@njit(cache=True, error_model="numpy")
def decode_layer(x, cs, w, k_cache, v_cache, plan, b):
    """One layer for R decode rows x (R, D) at positions plan.pos .. +R-1, in place: the general
    path's arithmetic for decode rows (models.transformer.Block.attention and ffn; every matrix
    with the one-row arithmetic; each row's attention as the one-token kernel gives it).
    cs: rope's cos/sin of the positions; k_cache, v_cache: this layer's float16 cache as uint16."""
    R, D = x.shape
    Hq, Hkv, hd = w.n_head, w.n_head_kv, w.head_dim
    # attention
    _rms_norm_serial(x, w.attn_norm, w.eps, b.h)
    _project(b.h, w.qkv, b.q8_d, b.runs, b.qkv[0], b.qkv[1], b.qkv[2])
    q = _member(w.qkv.where, 0, b.qkv).reshape(R, Hq, hd)
    k = _member(w.qkv.where, 1, b.qkv).reshape(R, Hkv, hd)
    v = _member(w.qkv.where, 2, b.qkv).reshape(R, Hkv, hd)
    _attn_inputs(q, k, v, w, cs, k_cache, v_cache, plan, b)
    for r in range(R):
        n_kv = plan.pos + r + 1
        key0, lo = plan.key0[r], plan.lo[r]
        S = np.empty((Hq, -(-(n_kv - key0) // 8) * 8), np.float32)    # scores, then probabilities
        _decode_scores(b.q16[r], k_cache, plan.block_table, lo, n_kv, plan.chunk[r], key0, S)
        _decode_softmax(S, key0, lo, n_kv, w.kq_scale, w.softcap)
        _decode_pv(S, v_cache, plan.block_table, key0, n_kv, b.att[r])
    quantize_into(b.att.reshape(R, Hq * hd), ACT_KIND[w.wo_type], b.q8_o)
    matmul_row(w.wo, w.wo_type, b.q8_o, b.runs, b.o)
    o = b.o[:, :D]
    if w.post_attn_norm.size:
        _rms_norm_serial(o, w.post_attn_norm, w.eps, o)
    x += o
    # feed-forward
    _rms_norm_serial(x, w.ffn_norm, w.eps, b.h)
    _project(b.h, w.gate_up, b.q8_d, b.runs, b.gate_up[0], b.gate_up[1], b.gate_up[2])
    gate = _member(w.gate_up.where, 0, b.gate_up)
    up = _member(w.gate_up.where, 1, b.gate_up)
    for r in range(R):
        if w.geglu:
            _geglu_tanh_serial(gate[r], up[r], b.a[r], w.gelu_table)
        else:
            _swiglu_serial(gate[r], up[r], b.a[r])
    quantize_into(b.a, ACT_KIND[w.w_down_type], b.q8_f)
    matmul_row(w.w_down, w.w_down_type, b.q8_f, b.runs, b.d)
    d = b.d[:, :D]
    if w.post_ffn_norm.size:
        _rms_norm_serial(d, w.post_ffn_norm, w.eps, d)
    x += d


@njit(cache=True, error_model="numpy")
def output_rows(x, norm, eps, layout, ggml_type, q8, runs, softcap, logits):
    """The final norm and the output matrix for decode rows x (R, D) into logits (R, layout rows),
    soft-capped at softcap when it is > 0 (gemma2)."""
    h = np.empty_like(x)
    _rms_norm_serial(x, norm, eps, h)
    quantize_into(h, ACT_KIND[ggml_type], q8)
    matmul_row(layout, ggml_type, q8, runs, logits)
    if softcap > 0:
        soft_cap_rows(logits, softcap)
