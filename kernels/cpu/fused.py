"""A decoder layer as one compiled call, on typed bundles: the one place the CPU engine computes a
layer (norms, q/k/v, Q/K norm, rope, attention, the output projection, the FFN, post-norms).

Every forward pass runs through it: a decode step, a speculative check, a prompt chunk, a batch of
sequences. Its rows are decode rows (each with the arithmetic a single token gets) or rows of a
prompt segment (llama.cpp's arithmetic for a batch of that sequence's rows), as the attention plan
and the run arrays say. It chains kernels that already exist (the same arithmetic, so the same
bits) on row buffers allocated once per shape: a decode step runs one compiled call per layer
instead of thirty Python-level operations, whose glue was a large share of a small model's token time.

Its inputs are three named tuples, which numba types field by field:
- `LayerWeights`: the layer's exact weight layouts, norms, biases and scalars (built once per layer
  by models.transformer from its matrices);
- `RowBuffers`: the T-row work buffers and the rows' matmul runs (pooled by models.transformer, shared
  by layers of one shape);
- `attention.AttentionPlan`: where the rows look in the paged cache (kernels.cpu.attention).

The layer's orchestration (`layer`, `last_layer`, `_attention`, `_ffn`, `_project`) is inlined into
its callers by numba (inline="always"). numba links each compiled function's callees into its own
module and has LLVM optimize and emit them again, so each of these levels cost a first start all
its kernels' LLVM time once more; inlined, only `layers` does (README: measured).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, typed, typeof

from kernels.cpu.attention import (WIDE_KV_BYTES, _decode_pv, _decode_rows, _decode_scores, _decode_softmax, _prefill, _write_kv_slots,
                                   _write_kv_slots_serial)
from kernels.cpu.attention_online import decode_partial, decode_partial_v, merge_splits, prefill_online
from kernels.cpu.ops import (_add_rows, _add_rows_serial, _geglu_tanh, _geglu_tanh_serial, _head_rows, _head_rows_serial,
                             _rms_norm, _rms_norm_serial, _swiglu, _swiglu_serial, soft_cap_rows)
from kernels.cpu.qdot import Q8Buffers, matmul_row, quantize_into
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
    """One decoder layer as `layer` reads it (absent optional vectors: NONE)."""
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
    residual_scale: np.float32   # attention's and the FFN's outputs times this before the residual add (granite), else 0


class RowBuffers(NamedTuple):
    """T rows' work buffers for layer (x8 layouts' outputs padded to whole 8-row groups), and how
    the rows go through the matmuls."""
    h: np.ndarray             # (T, D) a normed row
    qkv: tuple                # the q, k, v parts' outputs (T, part rows)
    q16: np.ndarray           # (T, Hq, hd) q as attention reads it
    kbuf: np.ndarray          # (T, Hkv, hd) roped k
    vbuf: np.ndarray          # (T, Hkv, hd) v
    att: np.ndarray           # (T, Hq, hd) attention's output
    o: np.ndarray             # (T, wo rows)
    gate_up: tuple            # the gate, up parts' outputs
    a: np.ndarray             # (T, F) act(gate) * up
    d: np.ndarray             # (T, w_down rows)
    q8_d: Q8Buffers           # quantized (T, D) rows
    q8_o: Q8Buffers           # ... (T, Hq*hd)
    q8_f: Q8Buffers           # ... (T, F)
    runs: tuple               # qdot.run_arrays: which rows get a batch's arithmetic, which a single token's


def _rows(ggml_type: int, layout: np.ndarray) -> int:
    return TRAITS[ggml_type].layout_rows(layout)


def row_buffers(w: LayerWeights, T: int, runs: tuple) -> RowBuffers:
    f32 = lambda *shape: np.empty((T, *shape), np.float32)                   # noqa: E731
    D, Hq, Hkv, hd = w.attn_norm.shape[0], w.n_head, w.n_head_kv, w.head_dim
    F = _ff_width(w)

    def outs(p: Projection) -> tuple:
        layouts = (p.w0, p.w1, p.w2)
        return tuple(f32(_rows(int(t), layouts[i]) if t >= 0 else 1) for i, t in enumerate(p.types))

    return RowBuffers(f32(D), outs(w.qkv), f32(Hq, hd), f32(Hkv, hd), f32(Hkv, hd), f32(Hq, hd), f32(_rows(w.wo_type, w.wo)),
                      outs(w.gate_up), f32(F), f32(_rows(w.w_down_type, w.w_down)),
                      Q8Buffers.alloc(T, D), Q8Buffers.alloc(T, Hq * hd), Q8Buffers.alloc(T, F), runs)


def _ff_width(w: LayerWeights) -> int:
    """The FFN's width: the gate member's rows (where[0] = (part, column, rows))."""
    return int(w.gate_up.where[0, 2])


def buffer_shape(w: LayerWeights) -> tuple:
    """What row_buffers' shapes depend on besides the row count: layers equal in it share buffers."""
    layouts = (w.qkv.w0, w.qkv.w1, w.qkv.w2, w.wo, w.gate_up.w0, w.gate_up.w1, w.gate_up.w2, w.w_down)
    types = (*w.qkv.types, w.wo_type, *w.gate_up.types, w.w_down_type)
    return (w.attn_norm.shape[0], w.n_head, w.n_head_kv, w.head_dim, _ff_width(w),
            tuple(_rows(int(t), m) if t >= 0 else 1 for t, m in zip(types, layouts)))


@njit(cache=True, error_model="numpy")
def _norm(x, w, eps, out, parallel):
    """RMSNorm of rows x into out, across threads or on the calling thread (the same numbers): a
    pass of one token stays on the calling thread, as every step of it does."""
    if parallel:
        _rms_norm(x, w, eps, out)
    else:
        _rms_norm_serial(x, w, eps, out)


@njit(cache=True, error_model="numpy")
def _residual(x, y, parallel):
    """x += y, the residual add of rows y (a view of a projection's output) to x, across threads or
    on the calling thread (as _norm)."""
    if parallel:
        _add_rows(x, y)
    else:
        _add_rows_serial(x, y)


@njit(cache=True, error_model="numpy")
def _attn_inputs(w, cs, k_cache, v_cache, plan, b):
    """T tokens' q, k, v (members of the fused q/k/v outputs b.qkv, read in place) as attention
    takes them, in the order of llama.cpp's graph: biases, per-head RMSNorm of q and k, rope (cs:
    the positions' cos/sin), q times q_scale and rounded to float16 into b.q16; k and v written
    into the float16 cache."""
    T = b.q16.shape[0]
    qb, q0 = _part(w.qkv.where, 0, b.qkv)
    kb, k0 = _part(w.qkv.where, 1, b.qkv)
    vb, v0 = _part(w.qkv.where, 2, b.qkv)
    # q, k and v pass arguments of one numba type each (flags as values, not literals; v's absent
    # norm and rope as writable C arrays), so that a first start compiles one _head_rows, not three
    yes, no, one = np.bool_(True), np.bool_(False), np.float32(1.0)
    no_norm, no_rope = np.empty(0, np.float32), np.ascontiguousarray(cs[:, :, :0])
    if T > 1:
        _head_rows(qb, q0, w.bq, w.q_norm, w.eps, cs, w.rope_neox, w.q_scale, yes, b.q16)
        _head_rows(kb, k0, w.bk, w.k_norm, w.eps, cs, w.rope_neox, one, no, b.kbuf)
        _head_rows(vb, v0, w.bv, no_norm, w.eps, no_rope, w.rope_neox, one, no, b.vbuf)
        _write_kv_slots(k_cache, v_cache, plan.slots, b.kbuf, b.vbuf)
    else:
        _head_rows_serial(qb, q0, w.bq, w.q_norm, w.eps, cs, w.rope_neox, w.q_scale, yes, b.q16)
        _head_rows_serial(kb, k0, w.bk, w.k_norm, w.eps, cs, w.rope_neox, one, no, b.kbuf)
        _head_rows_serial(vb, v0, w.bv, no_norm, w.eps, no_rope, w.rope_neox, one, no, b.vbuf)
        _write_kv_slots_serial(k_cache, v_cache, plan.slots, b.kbuf, b.vbuf)


def softmax_choice(plan) -> bool | None:
    """The `online` argument of layer, layers and last_layer for a pass with this plan: None for
    llama.cpp's softmax, True for online (flash) attention. It is told apart by its type, not its
    value, so numba drops the other choice's branches before compiling (an `is None` test of an
    argument) and a model's first start compiles only the attention kernels it takes."""
    return True if plan.online else None


@njit(cache=True, error_model="numpy")
def _attend(w, k_cache, v_cache, plan, b, online):
    """Attention of every row (b.q16, its keys already in the cache) into b.att: decode rows with
    the one-token kernels (row by row, split over the keys; or all at once across sequences),
    prompt segments with the prefill kernels; llama.cpp's softmax, or online (flash) attention
    (online: softmax_choice(plan))."""
    Hq, hd = w.n_head, w.head_dim
    R = plan.rows.shape[0]
    if online is None and plan.together:        # (never online: attention_plan)
        out = np.empty((R, Hq, hd), np.float32)
        rows = np.ascontiguousarray(plan.rows[:, 0])
        _decode_rows(b.q16[rows], k_cache, v_cache, plan.tables, np.ascontiguousarray(plan.rows[:, 1]), plan.window,
                     w.kq_scale, w.softcap, out)
        for i in range(R):
            b.att[rows[i]] = out[i]
    else:
        for i in range(R):
            r, hi, lo, chunk, key0 = plan.rows[i]
            table = plan.tables[i]
            if online is not None:
                n_splits = -(-(hi - lo) // chunk)
                o_part = np.empty((Hq, n_splits, hd), np.float32)
                m_part = np.empty((Hq, n_splits), np.float32)
                l_part = np.empty((Hq, n_splits), np.float32)
                if hd % 16 == 0:
                    decode_partial_v(b.q16[r], k_cache, v_cache, table, lo, hi, chunk, w.kq_scale, w.softcap,
                                     o_part, m_part, l_part)
                else:
                    decode_partial(b.q16[r], k_cache, v_cache, table, lo, hi, chunk, w.kq_scale, w.softcap,
                                   o_part, m_part, l_part)
                merge_splits(o_part, m_part, l_part, b.att[r])
            else:
                S = np.empty((Hq, -(-(hi - key0) // 8) * 8), np.float32)    # scores, then probabilities
                _decode_scores(b.q16[r], k_cache, table, lo, hi, chunk, key0, S)
                _decode_softmax(S, key0, lo, hi, w.kq_scale, w.softcap)
                _decode_pv(S, v_cache, table, key0, hi, b.att[r])
    for s in range(plan.segs.shape[0]):
        r0, n, start, q_tile, paired = plan.segs[s]
        q, out = b.q16[r0:r0 + n], b.att[r0:r0 + n]        # the rows in place (C-contiguous slices)
        if online is not None:
            prefill_online(q, k_cache, v_cache, plan.seg_tables[s], start, w.kq_scale, w.softcap, plan.window,
                           q_tile, paired != 0, out)
        else:
            _prefill(q, k_cache, v_cache, plan.seg_tables[s], start, w.kq_scale, w.softcap, plan.window, q_tile,
                     paired != 0, WIDE_KV_BYTES, out)


@njit(cache=True, error_model="numpy", inline="always")
def _project(h, p, q8, runs, o0, o1, o2):
    """A projection's parts for rows h: h is quantized once per vec-dot type, as llama.cpp's graph
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
def _part(where, m, outs):
    """Member m of a fused projection: (the output buffer that holds it, its first column)."""
    part = where[m, 0]
    return (outs[0] if part == 0 else (outs[1] if part == 1 else outs[2])), where[m, 1]


@njit(cache=True, error_model="numpy", inline="always")
def _attention(x, cs, w, k_cache, v_cache, plan, b, online):
    """The attention half for rows x (T, D): returns its output (T, D) (a view of b.o)."""
    T, D = x.shape
    Hq, hd = w.n_head, w.head_dim
    _norm(x, w.attn_norm, w.eps, b.h, T > 1)
    _project(b.h, w.qkv, b.q8_d, b.runs, b.qkv[0], b.qkv[1], b.qkv[2])
    _attn_inputs(w, cs, k_cache, v_cache, plan, b)
    _attend(w, k_cache, v_cache, plan, b, online)
    quantize_into(b.att.reshape(T, Hq * hd), ACT_KIND[w.wo_type], b.q8_o)
    matmul_row(w.wo, w.wo_type, b.q8_o, b.runs, b.o)
    o = b.o[:, :D]
    if w.post_attn_norm.size:
        _norm(o, w.post_attn_norm, w.eps, o, T > 1)
    if w.residual_scale != 0:
        _scale(o, w.residual_scale)
    return o


@njit(cache=True, error_model="numpy", inline="always")
def _ffn(x, w, b):
    """The feed-forward half for rows x (T, D), added to x in place."""
    T, D = x.shape
    _norm(x, w.ffn_norm, w.eps, b.h, T > 1)
    _project(b.h, w.gate_up, b.q8_d, b.runs, b.gate_up[0], b.gate_up[1], b.gate_up[2])
    gb, g0 = _part(w.gate_up.where, 0, b.gate_up)       # gate and up read in place
    ub, u0 = _part(w.gate_up.where, 1, b.gate_up)
    if T > 1:
        if w.geglu:
            _geglu_tanh(gb, g0, ub, u0, b.a, w.gelu_table)
        else:
            _swiglu(gb, g0, ub, u0, b.a)
    elif w.geglu:
        _geglu_tanh_serial(gb, g0, ub, u0, b.a, w.gelu_table)
    else:
        _swiglu_serial(gb, g0, ub, u0, b.a)
    quantize_into(b.a, ACT_KIND[w.w_down_type], b.q8_f)
    matmul_row(w.w_down, w.w_down_type, b.q8_f, b.runs, b.d)
    d = b.d[:, :D]
    if w.post_ffn_norm.size:
        _norm(d, w.post_ffn_norm, w.eps, d, T > 1)
    if w.residual_scale != 0:
        _scale(d, w.residual_scale)
    _residual(x, d, T > 1)


@njit(cache=True, error_model="numpy", inline="always")
def layer(x, cs, w, k_cache, v_cache, plan, b, online):
    """One decoder layer for rows x (T, D), in place. cs: rope's cos/sin of the rows' positions;
    k_cache, v_cache: this layer's float16 cache as uint16; plan: attention.AttentionPlan for this
    layer's window; b: the rows' buffers and runs; online: softmax_choice(plan)."""
    _residual(x, _attention(x, cs, w, k_cache, v_cache, plan, b, online), x.shape[0] > 1)
    _ffn(x, w, b)


@njit(cache=True, error_model="numpy")
def layers(x, n, cs0, cs1, plan0, plan1, second, ws, k_caches, v_caches, bufs, keep, bk, online):
    """Layers 0 .. n-1 in turn, in one compiled call: a decode step of a small model otherwise spends
    a share of its time in Python, calling and typing each layer's arguments (README: measured).
    ws, k_caches, v_caches, bufs: each layer's weights, cache and buffers (stack); layer il takes
    rope table cs1 where second[il, 0], else cs0, and plan1 where second[il, 1], else plan0. Where
    keep holds rows, the last layer is last_layer (bk: the kept rows' buffers; unread otherwise).
    Returns the rows that go on: x (T, D), updated in place, or the kept rows (K, D). (keep is an
    array either way, so that one compiled loop serves both: a first start compiles it once.)"""
    for il in range(n):
        cs, plan = cs1 if second[il, 0] else cs0, plan1 if second[il, 1] else plan0
        if il == n - 1 and keep.shape[0] > 0:
            return last_layer(x, cs, ws[il], k_caches[il], v_caches[il], plan, bufs[il], keep, bk, online)
        layer(x, cs, ws[il], k_caches[il], v_caches[il], plan, bufs[il], online)
    return x


def stack(items: list):
    """The layers' items (LayerWeights, cache arrays, RowBuffers) as one numba list for `layers`, or
    None where numba cannot hold them in one list (items of different numba types). Each distinct
    object is typed once: the layers of one shape share one RowBuffers, and typing one costs about
    a millisecond, which a prompt's pass (new buffers each time) would pay per layer."""
    kinds = {typeof(item) for item in {id(item): item for item in items}.values()}
    if len(kinds) != 1:
        return None
    out = typed.List.empty_list(kinds.pop())
    for item in items:
        out.append(item)
    return out


@njit(cache=True, error_model="numpy", inline="always")
def last_layer(x, cs, w, k_cache, v_cache, plan, b, keep, bk, online):
    """layer where only the rows `keep` go on after attention (those whose logits are wanted, as
    llama.cpp's graph keeps them, so the FFN sees a batch of that size): returns them (K, D).
    bk: the kept rows' buffers and runs."""
    o = _attention(x, cs, w, k_cache, v_cache, plan, b, online)
    y = np.empty((keep.shape[0], x.shape[1]), np.float32)
    for i in range(keep.shape[0]):
        y[i] = x[keep[i]] + o[keep[i]]
    _ffn(y, w, bk)
    return y


# The shares of `layer`'s compile that share_signatures splits it into.
SHARES = ("attention", "matmuls")


def share_signatures(args: tuple, share: str) -> list:
    """One share of `layer`'s kernels as [(kernel, signature)], typed as `layer` types its calls for
    the arguments `args` (models' Decoder.layer_args): "attention" its inputs' and attention's
    kernels, "matmuls" the activation quantizers and every type's products. numba compiles on one
    core; a first start compiles the two shares in two processes at once, and the layer loop then
    links both from the cache (core.precompile)."""
    x, cs, w, k_cache, v_cache, plan, b, online = args
    sig = lambda *values: tuple(typeof(v) for v in values)          # noqa: E731
    if share == "attention":
        return [(_attn_inputs, sig(w, cs, k_cache, v_cache, plan, b)), (_attend, sig(w, k_cache, v_cache, plan, b, online))]
    if share == "matmuls":
        return [(quantize_into, sig(b.att.reshape(x.shape[0], -1), ACT_KIND[w.wo_type], b.q8_o)),
                (matmul_row, sig(w.wo, w.wo_type, b.q8_o, b.runs, b.o))]
    raise ValueError(f"unknown share {share!r}: one of {SHARES}")


@njit(cache=True, error_model="numpy", inline="always")
def _scale(a, s):
    """a (R, N) in place: each element times s, one float32 rounding (ggml_scale)."""
    for r in range(a.shape[0]):
        for i in range(a.shape[1]):
            a[r, i] *= s


@njit(cache=True, error_model="numpy")
def output_rows(x, norm, eps, layout, ggml_type, q8, runs, softcap, scale, logits):
    """The final norm and the output matrix for rows x (R, D) into logits (R, layout rows),
    times scale when it is not 0 (granite's 1 / logit_scale), soft-capped at softcap when it is
    > 0 (gemma2)."""
    h = np.empty_like(x)
    _norm(x, norm, eps, h, x.shape[0] > 1)
    quantize_into(h, ACT_KIND[ggml_type], q8)
    matmul_row(layout, ggml_type, q8, runs, logits)
    if scale != 0:
        _scale(logits, scale)
    if softcap > 0:
        soft_cap_rows(logits, softcap)
