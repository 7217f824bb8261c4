"""The C library's float32 math functions, as ggml calls them, for the constants of a forward pass.

ggml computes its constants (rope's theta_scale, attention's 1/sqrt(head_dim), soft-capping's
tanh…) with libm's `powf`, `sqrtf`, `expf`, `logf`, `sinf`, `cosf` and `tanhf`. numpy's float32 ufuncs
are not those functions: numpy dispatches them at run time to SIMD routines picked by the CPU
(`np.power` takes an AVX-512 `powf` on Zen 4/5 that is one ulp off glibc's for theta = 1e4), so a
constant computed with numpy depends on the machine. These wrappers call the C library itself, the
same on every CPU: the glibc that llama.cpp links. Inside numba kernels, `math.sin`/`math.cos`/
`math.tanh` on float32 already compile to calls of these same functions.

Use these, never numpy ufuncs, for any float constant on the path from weights to logits; a
constant that needs another of ggml's libm functions (expf, logf, tanhf for YaRN or soft-capping)
gets its wrapper here, beside these.
"""
from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np

_LIBM = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")


def _f32_fn(name: str, n_args: int):
    fn = getattr(_LIBM, name)
    fn.restype = ctypes.c_float
    fn.argtypes = [ctypes.c_float] * n_args
    return fn


_powf, _sqrtf = _f32_fn("powf", 2), _f32_fn("sqrtf", 1)


def powf(x: float, y: float) -> np.float32:
    """C's powf(x, y) on x and y rounded to float32."""
    return np.float32(_powf(np.float32(x), np.float32(y)))


def sqrtf(x: float) -> np.float32:
    return np.float32(_sqrtf(np.float32(x)))


def rope_theta_scale(freq_base: float, n_dims: int) -> np.float32:
    """powf(freq_base, -2.0f/n_dims), as ggml_rope_cache_init: each rotary pair's angle step."""
    return powf(freq_base, np.float32(-2.0) / np.float32(n_dims))


def inv_sqrtf(n: float) -> np.float32:
    """1.0f/sqrtf(float(n)), as llama.cpp's graphs compute the attention scale (kq_scale). Rounded
    twice in float32: not the same number as float32(1/sqrt(n)) computed in double (head dims 96,
    112, 72… differ by an ulp)."""
    return np.float32(np.float32(1.0) / sqrtf(n))
