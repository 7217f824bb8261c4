"""A mixture-of-experts decoder layer as one compiled call: attention as kernels.cpu.fused computes
it, then llama.cpp's build_moe_ffn with softmax gating (Mixtral, Qwen3-MoE, Granite MoE), bit for bit.

The FFN half, in the order and roundings of llama.cpp's graph and ggml-cpu's ops:
- the router: the normed rows times ffn_gate_inp (fused.LayerWeights.gate_up holds it as a
  one-member projection, so it runs through the dense layer's matmul with the rows' own runs);
- ggml_soft_max of each row's logits (ggml_v_expf on 8 lanes, each 8-lane sum added in float64,
  the tail with libm's expf; then the row times float32(1 / sum));
- ggml_argsort (descending) and its first n_used: the selected experts, in order of probability
  (equal probabilities keep the lower index first, as std::sort's insertion sort does for the
  at most 16 experts that reach it; a tie among more is ordered however libstdc++'s introsort leaves it);
- their probabilities, divided by their float64 sum rounded to float32 and clamped to at least 2^-14;
- each selected expert's SwiGLU FFN on the rows routed to it (ggml_mul_mat_id);
- each output times its weight, then the n_used outputs added in selection order; granite's
  residual scale; the residual add.

mul_mat_id groups the rows by expert, and per expert the arithmetic is a batch of that expert's
rows: the types of ggml-cpu's tiled kernel (types.TypeTraits.tiled) take it from 8 rows on, the
repacked types take each row's gemv, the others their vec_dot. So each expert's rows form runs
(qdot.run_arrays) as the layer's own runs split them: a prompt segment's rows routed to one expert
are one batched run for a tiled type and single rows otherwise; decode rows stay single rows.

Shapes: T rows, D = n_embd, E experts, k = n_used, F = an expert's FFN width.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import get_num_threads, njit, prange

from kernels.cpu.fused import _attention, _norm, _part, _project, _scale
from kernels.cpu import qdot
from kernels.cpu.ops import _swiglu, _swiglu_serial, ggml_expf, serial_twin
from kernels.cpu.qdot import Q8Buffers, matmul_row, quantize_into
from kernels.types import ACT_KIND, TILED, TRAITS, X8

# matmul_row on the calling thread, for the single-token rows of _single_rows (which spreads its
# work over the threads itself): the kernels a single unbatched row reaches, as serial twins
_SINGLE_ROW_KERNELS = ("_dense_rows", "_q6_k_rows", "_q5_k_rows", "_q3_k_rows", "_q2_k_rows", "_iq4_xs_rows",
                       "_q4_k_rows", "_q0_x8_rows")
matmul_row_serial = serial_twin(matmul_row, {name: serial_twin(getattr(qdot, name)) for name in _SINGLE_ROW_KERNELS})

# ggml_clamp(weights_sum, 6.103515625e-5, INFINITY): the smallest normal float16
MIN_WEIGHT_SUM = np.float32(6.103515625e-5)


class Experts(NamedTuple):
    """A layer's experts as `layer` reads them: every expert's exact layout, stacked (E, ...)."""
    n_used: int
    n_ff: int                 # F
    norm_weights: bool        # the selected probabilities divided by their sum (every softmax MoE we run)
    gate: np.ndarray          # (E, layout of F rows of D)
    up: np.ndarray
    down: np.ndarray          # (E, layout of D rows of F)
    gate_type: int
    up_type: int
    down_type: int


class ExpertBuffers(NamedTuple):
    """T rows' routing and the experts' work buffers: P = T * k rows, for one expert's rows (at
    most T) or every (row, selection) pair."""
    sel: np.ndarray           # (T, k) int64 the selected experts
    wts: np.ndarray           # (T, k) float32 their weights
    rows: np.ndarray          # (T,) int64 the rows routed to the expert at hand
    slots: np.ndarray         # (T,) int64 ... and which of their k selections it is
    hx: np.ndarray            # (T, D) those rows' normed inputs
    q8x: Q8Buffers            # (T, D) ... quantized for the gate
    q8u: Q8Buffers            # (T, D) ... for the up matrices, where their type quantizes otherwise
    g: np.ndarray             # (P, gate layout rows)
    u: np.ndarray             # (P, up layout rows)
    a: np.ndarray             # (P, F) silu(g) * u
    q8a: Q8Buffers            # (P, F)
    d: np.ndarray             # (P, down layout rows)
    out: np.ndarray           # (T, k, D) each selection's weighted output


def threads() -> int:
    """The threads numba runs a parallel region on now (layer's n_threads)."""
    return get_num_threads()


def expert_buffers(m: Experts, T: int, D: int) -> ExpertBuffers:
    """The buffers of a pass of T rows (of D) through these experts (pooled by models.transformer
    for few rows, as fused.row_buffers are)."""
    rows = lambda t, layouts: TRAITS[t].layout_rows(layouts[0])         # noqa: E731
    P = T * m.n_used
    f32 = lambda n, *shape: np.empty((n, *shape), np.float32)           # noqa: E731
    return ExpertBuffers(np.empty((T, m.n_used), np.int64), f32(T, m.n_used), np.empty(T, np.int64),
                         np.empty(T, np.int64), f32(T, D), Q8Buffers.alloc(T, D), Q8Buffers.alloc(T, D),
                         f32(P, rows(m.gate_type, m.gate)), f32(P, rows(m.up_type, m.up)), f32(P, m.n_ff),
                         Q8Buffers.alloc(P, m.n_ff), f32(P, rows(m.down_type, m.down)), f32(T, m.n_used, D))


@njit(cache=True, error_model="numpy")
def route(logits, n_used, norm_weights, sel, wts):
    """One row's gating: logits (E,) -> the selected experts sel (k,) and their weights wts (k,),
    as ggml_soft_max, ggml_argsort_top_k, ggml_get_rows, and (norm_weights) ggml_sum_rows, ggml_clamp
    and ggml_div compute them."""
    E = logits.shape[0]
    m = np.float32(-np.inf)
    for i in range(E):
        m = max(m, logits[i])
    p = np.empty(E, np.float32)
    n8 = E // 8 * 8
    tot = 0.0
    for c in range(0, n8, 8):
        for i in range(c, c + 8):
            p[i] = ggml_expf(logits[i] - m)
        tot += np.float64(((p[c + 4] + p[c]) + (p[c + 6] + p[c + 2])) + ((p[c + 5] + p[c + 1]) + (p[c + 7] + p[c + 3])))
    for i in range(n8, E):
        p[i] = math.exp(logits[i] - m)          # libm's expf: ggml_vec_soft_max_f32's scalar tail
        tot += np.float64(p[i])
    inv = np.float32(1.0 / tot)
    for i in range(E):
        p[i] *= inv
    taken = np.zeros(E, np.bool_)
    for j in range(n_used):                     # the largest first; among equals the lowest index
        best = -1
        for i in range(E):
            if not taken[i] and (best < 0 or p[i] > p[best]):
                best = i
        taken[best] = True
        sel[j] = best
        wts[j] = p[best]
    if norm_weights:
        s = 0.0
        for j in range(n_used):
            s += np.float64(wts[j])
        s32 = max(np.float32(s), MIN_WEIGHT_SUM)
        for j in range(n_used):
            wts[j] = wts[j] / s32


@njit(cache=True, error_model="numpy")
def _expert_runs(sel, e, runs, rows, slots, sub_start, sub_len, sub_batched):
    """The rows routed to expert e, in row order, into rows / slots; their runs: the part of each of
    the layer's runs (start, length, batched) that went to e, batched as that run is, into
    sub_start / sub_len / sub_batched. Returns how many rows and runs it wrote."""
    run_start, run_len, run_batched = runs
    n, ns = 0, 0
    for ri in range(run_start.shape[0]):
        n0 = n
        for t in range(run_start[ri], run_start[ri] + run_len[ri]):
            for j in range(sel.shape[1]):
                if sel[t, j] == e:
                    rows[n] = t
                    slots[n] = j
                    n += 1
        if n > n0:
            sub_start[ns] = n0
            sub_len[ns] = n - n0
            sub_batched[ns] = run_batched[ri]
            ns += 1
    return n, ns


@njit(cache=True, error_model="numpy", inline="always")
def _rows(q, a, b):
    """Rows a .. b-1 of Q8Buffers q."""
    return Q8Buffers(q.xq[a:b], q.dx0[a:b], q.sx[a:b], q.s1[a:b], q.dxk[a:b], q.bs16[a:b], q.bsp[a:b], q.xf[a:b])


@njit(parallel=True, cache=True, error_model="numpy")
def _single_rows(h, m, eb, n_threads):
    """Every (row, selection) pair of rows that each take a single token's arithmetic (decode steps,
    speculative checks, sequences decoding side by side) through its expert, pair p = r * k + j into
    eb.out[r, j]: the gate and up products of every pair in one parallel region, the down products
    in another, each matrix cut into row ranges (as mul_mat_id splits an expert's rows) so that every
    thread streams a part of every used expert, each part a serial matmul on its thread. The same
    numbers as _by_expert gives these rows. n_threads: threads()."""
    T, k = eb.sel.shape
    quantize_into(h, ACT_KIND[m.gate_type], eb.q8x)              # each row once, for every expert it goes to
    split = ACT_KIND[m.up_type] != ACT_KIND[m.gate_type]
    if split:
        quantize_into(h, ACT_KIND[m.up_type], eb.q8u)
    # (a parallel loop's body takes arrays and scalars, not named tuples: they go in as their fields)
    gate, up, down, gt, ut, dt = m.gate, m.up, m.down, m.gate_type, m.up_type, m.down_type
    sel, wts, g, u, a, d, out = eb.sel, eb.wts, eb.g, eb.u, eb.a, eb.d, eb.out
    x0, x1, x2, x3, x4, x5, x6, x7 = eb.q8x
    y0, y1, y2, y3, y4, y5, y6, y7 = eb.q8u if split else eb.q8x
    z0, z1, z2, z3, z4, z5, z6, z7 = eb.q8a
    P = T * k
    S = max(1, -(-2 * n_threads // P))              # each matrix in S row ranges: every thread streams
    for it in prange(P * S):
        p, s = it // S, it % S
        r, j = p // k, p % k
        e = sel[r, j]
        _part_rows(gate[e], gt, _rows(Q8Buffers(x0, x1, x2, x3, x4, x5, x6, x7), r, r + 1), s, S, g[p])
        _part_rows(up[e], ut, _rows(Q8Buffers(y0, y1, y2, y3, y4, y5, y6, y7), r, r + 1), s, S, u[p])
    for p in range(P):
        _swiglu_serial(g[p:p + 1], 0, u[p:p + 1], 0, a[p:p + 1])
    quantize_into(a[:P], ACT_KIND[dt], _rows(eb.q8a, 0, P))
    for it in prange(P * S):
        p, s = it // S, it % S
        e = sel[p // k, p % k]
        _part_rows(down[e], dt, _rows(Q8Buffers(z0, z1, z2, z3, z4, z5, z6, z7), p, p + 1), s, S, d[p])
    for p in range(P):
        r, j = p // k, p % k
        for c in range(out.shape[2]):
            out[r, j, c] = d[p, c] * wts[r, j]


@njit(cache=True, error_model="numpy")
def _part_rows(layout, t, x, s, S, y):
    """Part s of S of one row's product with a matrix (a single token's arithmetic, on the calling
    thread) into y (the matrix's rows)."""
    n = layout.shape[0]
    a, b = n * s // S, n * (s + 1) // S
    if a == b:
        return
    per = 8 if X8[t] else 1
    tmp = np.empty((1, (b - a) * per), np.float32)
    matmul_row_serial(layout[a:b], t, x, (np.zeros(1, np.int64), np.ones(1, np.int64), np.zeros(1, np.bool_)), tmp)
    y[a * per:b * per] = tmp[0]


@njit(cache=True, error_model="numpy", inline="always")
def _runs_for(ggml_type, sub_start, sub_len, sub_batched):
    """An expert's runs for a matrix of this type: batched where ggml-cpu's tiled kernel takes the
    type's batches in mul_mat_id, single rows (gemv, vec_dot) otherwise."""
    batched = sub_batched & TILED[ggml_type]
    return sub_start, sub_len, batched


@njit(cache=True, error_model="numpy")
def _moe_ffn(x, w, m, b, eb, n_threads):
    """The mixture-of-experts half for rows x (T, D), added to x in place (b: the layer's row
    buffers, whose gate_up part 0 holds the router logits; eb: the experts' buffers)."""
    T, D = x.shape
    k = m.n_used
    E = m.gate.shape[0]
    _norm(x, w.ffn_norm, w.eps, b.h, T > 1)
    _project(b.h, w.gate_up, b.q8_d, b.runs, b.gate_up[0], b.gate_up[1], b.gate_up[2])
    logits, l0 = _part(w.gate_up.where, 0, b.gate_up)
    for r in range(T):
        route(logits[r, l0:l0 + E], k, m.norm_weights, eb.sel[r], eb.wts[r])
    if not b.runs[2].any():                     # single-token rows only
        _single_rows(b.h, m, eb, n_threads)
    else:
        _by_expert(b.h, m, b.runs, eb)
    moe = eb.out[:, 0, :]                       # the selections' outputs added in order (in place in slot 0)
    for j in range(1, k):
        for r in range(T):
            for c in range(D):
                moe[r, c] += eb.out[r, j, c]
    if w.residual_scale != 0:
        _scale(moe, w.residual_scale)
    x += moe


@njit(cache=True, error_model="numpy")
def _by_expert(h, m, runs, eb):
    """Every expert's rows (h's rows routed to it) through it, expert by expert: its rows of each of
    the layer's runs one run, as mul_mat_id's batch for that expert; into eb.out[r, j]."""
    E = m.gate.shape[0]
    n_runs = runs[0].shape[0]
    sub_start = np.empty(n_runs, np.int64)
    sub_len = np.empty(n_runs, np.int64)
    sub_batched = np.empty(n_runs, np.bool_)
    for e in range(E):
        n, ns = _expert_runs(eb.sel, e, runs, eb.rows, eb.slots, sub_start, sub_len, sub_batched)
        if n == 0:
            continue
        hx = eb.hx[:n]
        for i in range(n):
            hx[i] = h[eb.rows[i]]
        q8x, q8a = _rows(eb.q8x, 0, n), _rows(eb.q8a, 0, n)
        g, u, a, d = eb.g[:n], eb.u[:n], eb.a[:n], eb.d[:n]
        quantize_into(hx, ACT_KIND[m.gate_type], q8x)
        matmul_row(m.gate[e], m.gate_type, q8x, _runs_for(m.gate_type, sub_start[:ns], sub_len[:ns], sub_batched[:ns]), g)
        if ACT_KIND[m.up_type] != ACT_KIND[m.gate_type]:
            quantize_into(hx, ACT_KIND[m.up_type], q8x)
        matmul_row(m.up[e], m.up_type, q8x, _runs_for(m.up_type, sub_start[:ns], sub_len[:ns], sub_batched[:ns]), u)
        if n > 1:
            _swiglu(g, 0, u, 0, a)
        else:
            _swiglu_serial(g, 0, u, 0, a)
        quantize_into(a, ACT_KIND[m.down_type], q8a)
        matmul_row(m.down[e], m.down_type, q8a, _runs_for(m.down_type, sub_start[:ns], sub_len[:ns], sub_batched[:ns]), d)
        for i in range(n):                      # ggml_mul(experts, weights)
            r, j = eb.rows[i], eb.slots[i]
            wt = eb.wts[r, j]
            for c in range(h.shape[1]):
                eb.out[r, j, c] = d[i, c] * wt


@njit(cache=True, error_model="numpy")
def layer(x, cs, w, m, k_cache, v_cache, plan, b, eb, n_threads, online):
    """fused.layer with the experts m (and their buffers eb) as the FFN; n_threads: numba's threads
    (threads(): compiled code that asks numba for them cannot be cached)."""
    x += _attention(x, cs, w, k_cache, v_cache, plan, b, online)
    _moe_ffn(x, w, m, b, eb, n_threads)


@njit(cache=True, error_model="numpy")
def last_layer(x, cs, w, m, k_cache, v_cache, plan, b, keep, bk, ebk, n_threads, online):
    """fused.last_layer with the experts as the FFN: only the rows `keep` go on after attention
    (llama.cpp routes the kept rows alone). bk, ebk: the kept rows' buffers."""
    o = _attention(x, cs, w, k_cache, v_cache, plan, b, online)
    y = np.empty((keep.shape[0], x.shape[1]), np.float32)
    for i in range(keep.shape[0]):
        y[i] = x[keep[i]] + o[keep[i]]
    _moe_ffn(y, w, m, bk, ebk, n_threads)
    return y
