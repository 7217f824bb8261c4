"""Quantized matrix products that round exactly as llama.cpp's AVX2 build does.

llama.cpp never multiplies a quantized weight by a float activation: it quantizes the activation
row (q8_0 for Q5_0/Q8_0 weights, q8_K for the K-quants), takes exact integer dot products, and
folds them into float32 accumulators with fused multiply-adds. Which integers are summed before
each float step depends on the kernel it picks, so we reproduce each one (read from llama.cpp
0.3.36's ggml-cpu sources; the numpy models in kernels/reference.py say the same in plain code):

- Q8_0 / Q5_0 (ggml_vec_dot_q*_q8_0 for one row, tinyBLAS_Q0_AVX for more; the same numbers):
  per output 8 float lanes; lane k of block b gets fma(d_w*d_x, sum of the 4 products at 4k..4k+3);
  at the end hsum_float_8.
- Q4_0 / IQ4_NL (weights repacked 8 rows at a time, ggml_gemv/gemm_q4_0_8x8_q8_0 and iq4_nl's; the
  same numbers): per output acc = fma(float(the block's integer dot), d_w*d_x, acc), block by block.
- Q4_K (weights repacked 8 rows at a time, ggml_gemv/gemm_q4_K_8x8_q8_K): per output
  acc += float(sum_j sc_j*dot_j) * (d_w*d_x), acc_min += float(sum_j mn_j*bsum_j) * (dmin_w*d_x),
  result acc - acc_min; gemv does one step per 256-element super-block, gemm (rows in groups of 4
  when there are more than 3) one per pair of 32-element sub-blocks.
- Q6_K: fewer than 8 rows: ggml_vec_dot_q6_K_q8_K (8 lanes per super-block, hsum_float_8);
  8 rows or more: the tiled kernel (one exact integer per super-block, d_w*float(S), then
  out = fma(that, d_x, out)).
- Q5_K (not repacked on x86 either): fewer than 8 rows: ggml_vec_dot_q5_K_q8_K (8 lanes as Q6_K,
  the minimums apart: summs = fma(-(d_x*dmin_w), float(M), summs), result hsum_float_8 + summs);
  8 rows or more: the tiled kernel (res = d_w*float(S) - dmin_w*float(M) in one fma, then
  out = fma(res, d_x, out)).
- Q2_K, Q3_K, IQ4_XS (not repacked on x86 either; one skeleton, lanes): fewer than 8 rows: their
  vec_dot (8 lanes as Q6_K; Q2_K's minimums as 8 more lanes, acc = fma(-(d_x*dmin_w), float(P), acc)
  before the scales' fma); 8 rows or more: the tiled kernel (d_w*float(S), Q2_K fnmadd of the
  minimums, then out = fma(res, d_x, out)).

Each kernel here gives every output exactly those float operations, so the results equal
llama.cpp's bit for bit while the work is organised for this machine: decode streams every
weight byte once per token, a prompt reuses each unpacked weight panel for all its rows.

One module per type family (q0: Q8_0, Q5_0, Q4_0 and IQ4_NL; q4_k, q5_k, q6_k; q2_k, q3_k, iq4_xs on lanes) and one for the activations (act);
this one holds what every family shares: the layouts' builder, the run arrays, and the dispatch
(matmul_row, which the fused layer calls inside compiled code and matmul from Python).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from kernels import types as T
from kernels.cpu.qdot.act import _quantize_q8_0, _quantize_q8_0_serial, _quantize_q8_k, _quantize_q8_k_serial, round_activation
from kernels.cpu.qdot.dense import DENSE_TYPES, TINY_MR, _dense_rows
from kernels.cpu.qdot.q0 import _q0_x8_rows, has_panel, panel_operands, panel_prompt, repack_q0_x8
from kernels.cpu.qdot.q4_k import _q4_k_rows, q4_k_prompt as _q4_k_prompt_512, repack_q4_k_x8, wide_gemm_rows
from kernels.cpu.qdot.iq4_xs import _iq4_xs_rows
from kernels.cpu.qdot.q2_k import _q2_k_rows
from kernels.cpu.qdot.q3_k import _q3_k_rows
from kernels.cpu.qdot.q5_k import _q5_k_rows
from kernels.cpu.qdot.q6_k import _q6_k_rows
from kernels.cpu.qdot import amx, tiled16
from kernels.cpu.qdot import rows16
from kernels.cpu.simd import HAS_AVX2, WIDE
from kernels.types import ACT_F16, ACT_F32, ACT_BF16, ACT_Q8_0, ACT_Q8_K, TRAITS


class Int8Rows:
    """Activation rows x (M, K) quantized (or, for the float weights, rounded) once for one vec-dot
    type (types.ACT_*), in every form the kernels read (Q8Buffers, by quantize_into: the engine's
    own path), for matmul from Python."""

    def __init__(self, x: np.ndarray, kind: int):
        if kind not in _FORMS:
            raise ValueError(f"unknown activation type {kind!r}")
        x = np.ascontiguousarray(x, np.float32)
        block = {ACT_Q8_0: 32, ACT_Q8_K: 256}.get(kind, 1)
        if x.ndim != 2 or x.shape[1] % block:          # the quantizers assume whole blocks
            raise ValueError(f"activation rows of shape {x.shape}: need (M, K) with K a multiple of {block}")
        self.kind = kind
        self.q = Q8Buffers.alloc(*x.shape)
        quantize_into(x, kind, self.q)

    @property
    def n_rows(self) -> int:
        return self.q.xf.shape[0]

    def _form(self, name: str) -> np.ndarray:
        if name not in _FORMS[self.kind]:               # Q8Buffers holds it, but not written for this kind
            raise AttributeError(f"activation rows of kind {self.kind} have no {name}")
        return getattr(self.q, {"dx": "dx0" if self.kind == ACT_Q8_0 else "dxk"}.get(name, name))

    xq = property(lambda self: self._form("xq"))
    dx = property(lambda self: self._form("dx"))
    sx = property(lambda self: self._form("sx"))
    s1 = property(lambda self: self._form("s1"))
    bs16 = property(lambda self: self._form("bs16"))
    bsp = property(lambda self: self._form("bsp"))
    xf = property(lambda self: self._form("xf"))


# The forms quantize_into writes for each activation kind.
_FORMS = {ACT_Q8_0: ("xq", "dx", "sx", "s1"), ACT_Q8_K: ("xq", "dx", "bs16", "bsp"),
          ACT_F32: ("xf",), ACT_F16: ("xf",), ACT_BF16: ("xf",)}


# The K-quants' prompt kernels of the chosen variant: on AMX tiles (kernels.cpu.qdot.amx), else the
# 512-bit 16-row kernels; the same bits either way.
AMX = amx.AMX
q4_k_prompt = amx.q4_k_prompt if AMX else _q4_k_prompt_512
# From this many activation rows on, the types with a panel kernel (q0.has_panel) go through it
# (below it the multi-row x8 kernel is faster; README: measured): the 512-bit panel's groups of 16
# rows pay off from two of them.
PANEL_MIN_ROWS = 32 if WIDE else 48
EXACT_TYPES = frozenset(t for t, tr in TRAITS.items() if tr.exact) if HAS_AVX2 else frozenset()


def has_exact_kernel(ggml_type: int, n_rows: int, n_cols: int) -> bool:
    """Does a matrix of this type and shape run on an exact kernel here (exact_layout builds one)?"""
    return (ggml_type in EXACT_TYPES and not (TRAITS[ggml_type].rows8 and n_rows % 8)
            and not (ggml_type in DENSE_TYPES and n_cols % 32))


def exact_layout(raw: np.ndarray, ggml_type: int, n_rows: int, n_cols: int) -> np.ndarray | None:
    """The weights as the exact kernels read them, 8 rows interleaved (the same bytes as GGUF): Q8_0 and
    Q5_0 padded to a multiple of 8 rows, the types llama.cpp repacks (Q4_0, IQ4_NL, Q4_K) only if they
    have one (llama.cpp does not repack such a matrix either, and its other kernel is not reproduced
    here), the other K-quants (Q2_K, Q3_K, Q5_K, Q6_K, IQ4_XS) rows in place; None where no exact kernel
    applies."""
    if not has_exact_kernel(ggml_type, n_rows, n_cols):
        return None
    if ggml_type == T.Q4_K:
        return repack_q4_k_x8(raw, n_cols)
    if not TRAITS[ggml_type].x8:
        return np.ascontiguousarray(raw).view(np.uint8).reshape(n_rows, -1)
    return repack_q0_x8(raw, ggml_type, n_cols)



def run_arrays(runs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[(start, length, batched)] -> the three arrays the drivers take. Adjacent runs whose rows all
    get the single-token arithmetic (unbatched, or a batch of one) become one run, so that they share
    one pass over W (32 decoding sequences: one pass, not 32)."""
    merged: list[list] = []
    for start, n, batched in runs:
        single = not batched or n == 1
        if merged and single and not merged[-1][2] and merged[-1][0] + merged[-1][1] == start:
            merged[-1][1] += n
        else:
            merged.append([start, n, not single])
    return (np.array([r[0] for r in merged], np.int64), np.array([r[1] for r in merged], np.int64),
            np.array([r[2] for r in merged], np.bool_))


def _run_arrays(runs, M: int):
    if isinstance(runs, tuple) and len(runs) == 3 and isinstance(runs[0], np.ndarray):
        return runs                                       # prebuilt
    if runs is None:
        runs = [(0, M, True)]
    starts, lens, batched = run_arrays(runs)
    if lens.sum() != M:
        raise ValueError(f"runs cover {lens.sum()} rows, the activation has {M}")
    return starts, lens, batched


def layout_prefix(layout: np.ndarray, ggml_type: int, n_out: int) -> np.ndarray:
    """The part of an exact layout the first n_out output rows need (a draft model's truncated
    vocabulary): its rows or 8-row groups; for the dense types whole tinyBLAS tiles, or all of a
    matrix that has a ragged tile (its rows decide whether llama.cpp tiles it at all)."""
    if ggml_type in DENSE_TYPES:   # whole tinyBLAS tiles, or all of W: llama.cpp tiles by W's rows
        return layout[:-(-n_out // TINY_MR) * TINY_MR] if layout.shape[0] % TINY_MR == 0 else layout
    return TRAITS[ggml_type].layout_prefix(layout, n_out)


def matmul(layout: np.ndarray, ggml_type: int, rows: Int8Rows, n_out: int, runs=None) -> np.ndarray:
    """rows (M, K) @ W.T -> (M, n_out) float32 for the first n_out rows of W, llama.cpp's numbers bit
    for bit, through matmul_row (the engine's dispatch). W is read once per call for all M rows.
    runs: [(start, length, batched)] covering the rows (default: one batched run); llama.cpp picks its
    K-quants' (and IQ4_XS's) arithmetic by the size of the batch it is given, so a batched run gets
    the arithmetic of a llama.cpp batch of its length and a one-row run (decode, speculative checks)
    gives each row the arithmetic of a single token."""
    w = layout_prefix(layout, ggml_type, n_out)
    out = np.empty((rows.n_rows, TRAITS[ggml_type].layout_rows(w)), np.float32)
    matmul_row(w, ggml_type, rows.q, _run_arrays(runs, rows.n_rows), out)
    return out if out.shape[1] == n_out else out[:, :n_out]


# --- rows into preallocated buffers (the fused decode layer, kernels.cpu.fused) -----------------

class Q8Buffers(NamedTuple):
    """R activation rows' forms for every vec-dot type, allocated once and reused by every decode
    step (a typed bundle for compiled code)."""
    xq: np.ndarray       # (R, K) int8
    dx0: np.ndarray      # (R, K/32) float32: q8_0 scales
    sx: np.ndarray       # (R, K/4) int32: q8_0 4-group sums x 16
    s1: np.ndarray       # (R, K/32) float32: q8_1's s (f16 values)
    dxk: np.ndarray      # (R, max(1, K/256)) float32: q8_K scales
    bs16: np.ndarray     # (R, K/16) int16: q8_K 16-element sums
    bsp: np.ndarray      # (R, max(1, K/64)) int32: q8_K paired 32-element sums
    xf: np.ndarray       # (R, K) float32: the rows rounded for F32 / F16 / BF16 weights

    @staticmethod
    def alloc(R: int, K: int) -> "Q8Buffers":
        return Q8Buffers(np.empty((R, K), np.int8), np.empty((R, K // 32), np.float32),
                         np.empty((R, K // 4), np.int32), np.empty((R, K // 32), np.float32),
                         np.empty((R, max(1, K // 256)), np.float32),
                         np.empty((R, K // 16), np.int16), np.empty((R, max(1, K // 64)), np.int32),
                         np.empty((R, K), np.float32))


@njit(cache=True, error_model="numpy")
def quantize_into(h, kind, q):
    """Quantize (round) rows h (R, K) for a vec-dot type (kind: types.ACT_*) into q (Q8Buffers):
    one row on the calling thread, more split across threads (the same numbers)."""
    if kind == ACT_Q8_0:
        if h.shape[0] > 1:
            _quantize_q8_0(h, q.xq, q.dx0, q.sx, q.s1)
        else:
            _quantize_q8_0_serial(h, q.xq, q.dx0, q.sx, q.s1)
    elif kind == ACT_Q8_K:
        if h.shape[0] > 1:
            _quantize_q8_k(h, q.xq, q.dxk, q.bs16, q.bsp)
        else:
            _quantize_q8_k_serial(h, q.xq, q.dxk, q.bs16, q.bsp)
    else:
        round_activation(h, kind, q.xf)


@njit(cache=True, error_model="numpy")
def matmul_row(layout, ggml_type, q, runs, out):
    """Quantized activation rows q (Q8Buffers) times an exact layout into out (R, rows of the
    layout), inside compiled code: the dispatch over the exact types, written once. runs: the three
    arrays of run_arrays. A dense layout must be whole tinyBLAS tiles or all of W (layout_prefix),
    since whether llama.cpp tiles it is read from its rows here."""
    run_start, run_len, run_batched = runs
    if ggml_type == T.F32 or ggml_type == T.F16 or ggml_type == T.BF16:
        _dense_rows(ggml_type, layout, q.xf, run_start, run_len, run_batched, out, layout.shape[0] % TINY_MR == 0)
    elif tiled16.takes(ggml_type, layout.shape[0], run_start, run_len, run_batched):
        if AMX and ggml_type != T.Q5_K:
            amx.tiled_prompt(ggml_type, layout, rows16.regroup_bytes(q.xq), rows16.lanes(q.dxk), q.xq.shape[0], out)
        else:
            xb, dx, bs = tiled16.operands(ggml_type, q, tiled16.LANES)
            tiled16.prompt(ggml_type, layout, xb, dx, bs, q.xq.shape[0], out)
    elif ggml_type == T.Q6_K:
        _q6_k_rows(layout, q.xq, q.dxk, q.bs16, run_start, run_len, run_batched, out)
    elif ggml_type == T.Q5_K:
        _q5_k_rows(layout, q.xq, q.dxk, q.bsp, run_start, run_len, run_batched, out)
    elif ggml_type == T.Q3_K:
        _q3_k_rows(layout, q.xq, q.dxk, q.bs16, run_start, run_len, run_batched, out)
    elif ggml_type == T.Q2_K:
        _q2_k_rows(layout, q.xq, q.dxk, q.bs16, run_start, run_len, run_batched, out)
    elif ggml_type == T.IQ4_XS:
        _iq4_xs_rows(layout, q.xq, q.dxk, q.bs16, run_start, run_len, run_batched, out)
    elif ggml_type == T.Q4_K:
        n = wide_gemm_rows(run_start, run_len, run_batched)
        if n:                          # the gemm rows on the 16-row kernel, the rest with the gemv arithmetic
            M = q.xq.shape[0]
            q4_k_prompt(layout, rows16.regroup_bytes(q.xq[:n]), rows16.lanes(q.bsp[:n]), rows16.lanes(q.dxk[:n]), n, out)
            if n < M:
                _q4_k_rows(layout, q.xq, q.dxk, q.bsp, np.array([n]), np.array([M - n]), np.array([False]), out)
        else:
            _q4_k_rows(layout, q.xq, q.dxk, q.bsp, run_start, run_len, run_batched, out)
    elif has_panel(ggml_type) and q.xq.shape[0] >= PANEL_MIN_ROWS:
        xb, dxb = panel_operands(q.xq, q.dx0)
        panel_prompt(ggml_type, layout, xb, dxb, q.xq.shape[0], out)
    else:
        _q0_x8_rows(ggml_type, layout, q.xq, q.dx0, q.sx, q.s1, out)
