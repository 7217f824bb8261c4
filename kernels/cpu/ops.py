"""Elementwise / row-wise ops of the transformer block (numba, float32)."""
from __future__ import annotations

import math
import types as pytypes

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

# fastmath without nnan/ninf: -inf is a legal input (masked logits).
FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}
# Below this many elements a kernel runs on the calling thread: waking the thread pool costs
# more than the work, and a parallel region stalls for a scheduler tick (4-12 ms) whenever
# the other core is busy.
PAR_MIN = 1 << 16


def serial_twin(kernel):
    """`kernel` (an @njit(parallel=True) dispatcher) compiled without parallel: prange runs as
    range on the calling thread. It gets its own name so numba's cache keeps both."""
    py = kernel.py_func
    fn = pytypes.FunctionType(py.__code__, py.__globals__, py.__name__ + "_serial", py.__defaults__, py.__closure__)
    fn.__qualname__ = py.__qualname__ + "_serial"
    fn.__module__ = py.__module__
    options = {k: v for k, v in kernel.targetoptions.items() if k not in ("parallel", "nopython")}
    return njit(cache=True, **options)(fn)  # error_model is a target option: kept


def pick(kernel, twin, n_elements: int):
    """The parallel kernel for big inputs, its serial twin for small ones."""
    return kernel if n_elements >= PAR_MIN else twin


@intrinsic
def _pow2i(typingctx, n):
    """2.0f ** n for an integral float32 n in [-126, 127], by building the exponent bits."""
    sig = types.float32(n)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        e = builder.add(builder.fptosi(args[0], i32), ir.Constant(i32, 127))
        return builder.bitcast(builder.shl(e, ir.Constant(i32, 23)), ir.FloatType())

    return sig, codegen


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # few mantissa bits: n * _LN2_HI is exact
_LN2_LO = np.float32(-2.12194440e-4)


@njit(fastmath=FAST, cache=True, error_model="numpy", inline="always")
def vexp(x):
    """exp(x) for float32 x in straight-line float code that LLVM vectorizes (numba has no
    vector libm without SVML). Cody-Waite reduction + degree-7 Taylor: ~2 ulp on the range
    used; x <= -87.3 (including -inf) gives ~1e-38 rather than 0, x >= 88 saturates."""
    x = min(max(x, np.float32(-87.3)), np.float32(88.0))
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = np.float32(1.0 / 5040.0)
    p = p * r + np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    return p * _pow2i(n)


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _rms_norm(x, w, eps, out):
    T, D = x.shape
    for t in prange(T):
        ss = 0.0  # float64 sum: D up to a few thousand, keeps the norm exact to f32
        for i in range(D):
            ss += np.float64(x[t, i]) * x[t, i]
        inv = np.float32(1.0 / math.sqrt(ss / D + eps))
        for i in range(D):
            out[t, i] = x[t, i] * inv * w[i]


_rms_norm_serial = serial_twin(_rms_norm)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x (T, D) or (D,), w (D,) -> x / rms(x) * w. Gemma callers pass (1 + w)."""
    x2 = np.ascontiguousarray(x, np.float32).reshape(-1, x.shape[-1])
    out = np.empty_like(x2)
    pick(_rms_norm, _rms_norm_serial, x2.size)(x2, np.ascontiguousarray(w, np.float32), float(eps), out)
    return out.reshape(x.shape)


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _rope(x, positions, inv_freq, neox, n_rot, out):
    T, H, hd = x.shape
    half = n_rot // 2
    for t in prange(T):
        pos = np.float64(positions[t])
        for i in range(half):
            ang = pos * inv_freq[i]  # float64 angle: positions up to 32k keep ~1e-12 accuracy
            c = np.float32(math.cos(ang))
            s = np.float32(math.sin(ang))
            a = i if neox else 2 * i
            b = i + half if neox else 2 * i + 1
            for h in range(H):
                x0 = x[t, h, a]
                x1 = x[t, h, b]
                out[t, h, a] = x0 * c - x1 * s
                out[t, h, b] = x0 * s + x1 * c
        for h in range(H):
            for i in range(n_rot, hd):
                out[t, h, i] = x[t, h, i]


_rope_serial = serial_twin(_rope)


def rope(x: np.ndarray, positions: np.ndarray, theta: float, neox: bool, n_rot: int | None = None) -> np.ndarray:
    """Rotary embedding as ggml_rope (freq_scale 1, no YaRN). x (T, H, hd) -> (T, H, hd).

    neox=False rotates adjacent pairs (2i, 2i+1) (llama); neox=True rotates (i, i + n_rot/2)
    (qwen2, gemma3). Pair i turns by pos * theta^(-2i/n_rot); dims >= n_rot pass through.
    """
    x = np.ascontiguousarray(x, np.float32)
    hd = x.shape[2]
    n_rot = hd if n_rot is None else int(n_rot)
    if n_rot % 2 or n_rot > hd:
        raise ValueError(f"n_rot={n_rot} must be even and <= head_dim={hd}")
    inv_freq = float(theta) ** (-2.0 * np.arange(n_rot // 2, dtype=np.float64) / n_rot)
    out = np.empty_like(x)
    kernel = pick(_rope, _rope_serial, x.size)
    kernel(x, np.ascontiguousarray(positions, np.int64), inv_freq, bool(neox), n_rot, out)
    return out


# Elementwise kernels run over 4096-element chunks (threads take whole chunks); the inner
# loop indexes chunk slices from 0 so numba emits no negative-index fixups and LLVM vectorizes.
CHUNK = 4096


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _swiglu(g, u, out):
    n = g.shape[0]
    for c in prange((n + CHUNK - 1) // CHUNK):
        gc, uc, oc = g[c * CHUNK:(c + 1) * CHUNK], u[c * CHUNK:(c + 1) * CHUNK], out[c * CHUNK:(c + 1) * CHUNK]
        for i in range(gc.shape[0]):
            x = gc[i]
            oc[i] = x / (np.float32(1.0) + vexp(-x)) * uc[i]


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _geglu_tanh(g, u, out):
    k = np.float32(math.sqrt(2.0 / math.pi))
    n = g.shape[0]
    for c in prange((n + CHUNK - 1) // CHUNK):
        gc, uc, oc = g[c * CHUNK:(c + 1) * CHUNK], u[c * CHUNK:(c + 1) * CHUNK], out[c * CHUNK:(c + 1) * CHUNK]
        for i in range(gc.shape[0]):
            x = gc[i]
            y = k * (x + np.float32(0.044715) * x * x * x)
            th = np.float32(1.0) - np.float32(2.0) / (vexp(np.float32(2.0) * y) + np.float32(1.0))  # tanh(y)
            oc[i] = np.float32(0.5) * x * (np.float32(1.0) + th) * uc[i]


_swiglu_serial = serial_twin(_swiglu)
_geglu_tanh_serial = serial_twin(_geglu_tanh)


def _glu(kernel, twin, gate, up):
    g = np.ascontiguousarray(gate, np.float32)
    u = np.ascontiguousarray(up, np.float32)
    if g.shape != u.shape:
        raise ValueError(f"gate {g.shape} and up {u.shape} differ")
    out = np.empty_like(g)
    pick(kernel, twin, g.size)(g.reshape(-1), u.reshape(-1), out.reshape(-1))
    return out


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up."""
    return _glu(_swiglu, _swiglu_serial, gate, up)


def geglu_tanh(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gelu(gate) * up with ggml's tanh approximation of gelu."""
    return _glu(_geglu_tanh, _geglu_tanh_serial, gate, up)


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _softmax_rows(x, out):
    for r in prange(x.shape[0]):
        m = -np.inf
        for i in range(x.shape[1]):
            m = max(m, x[r, i])
        s = 0.0
        for i in range(x.shape[1]):
            e = np.exp(x[r, i] - m)
            out[r, i] = e
            s += e
        inv = np.float32(1.0 / s)
        for i in range(x.shape[1]):
            out[r, i] *= inv


_softmax_rows_serial = serial_twin(_softmax_rows)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax along `axis` (float32)."""
    x = np.asarray(x, np.float32)
    moved = np.ascontiguousarray(np.moveaxis(x, axis, -1))
    flat = moved.reshape(-1, moved.shape[-1])
    out = np.empty_like(flat)
    pick(_softmax_rows, _softmax_rows_serial, flat.size)(flat, out)
    return np.moveaxis(out.reshape(moved.shape), -1, axis)
