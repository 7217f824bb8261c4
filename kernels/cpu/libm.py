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


_powf, _sqrtf, _logf, _fmaf = _f32_fn("powf", 2), _f32_fn("sqrtf", 1), _f32_fn("logf", 1), _f32_fn("fmaf", 3)


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


def logf(x: float) -> np.float32:
    return np.float32(_logf(np.float32(x)))


def rope_yarn_corr_dims(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float = 32.0,
                        beta_slow: float = 1.0) -> tuple[np.float32, np.float32]:
    """ggml_rope_yarn_corr_dims, in float32 as ggml.c computes it: the rotary pairs between which
    YaRN ramps from interpolated to extrapolated angles (llama.cpp's default betas 32 and 1; mistral3
    files may give theirs)."""
    f = np.float32

    def corr_dim(beta):
        return f(f(n_dims) * logf(f(n_ctx_orig) / (f(beta) * f(2) * f(np.pi)))) / (f(2) * logf(freq_base))
    start, end = np.floor(corr_dim(beta_fast)), np.ceil(corr_dim(beta_slow))
    return f(max(f(0), start)), f(min(f(n_dims - 1), end))


def yarn_mscale(freq_scale: float, attn_factor: float = 1.0, context_freq_scale: float | None = None,
                log_mul: float = 0.0) -> np.float32:
    """The factor on cos and sin of a YaRN file (ext_factor 1) at a layer of this freq_scale, as
    llama.cpp makes it: llama_context's yarn_attn_factor, get_mscale(1/context_freq_scale) (over
    get_mscale with mscale log_mul when the file gives rope.scaling.yarn_log_multiplier, which
    llama.cpp reads for mistral3) cancelled by 1/(1 + 0.1 ln) and times the file's
    rope.scaling.attn_factor (libllama, no fma), then ggml's rope_yarn multiplies in
    1 + 0.1 logf(1/freq_scale) (ggml-cpu, built with FMA: one fused multiply-add).
    context_freq_scale: the model's (default freq_scale), where a layer has its own."""
    f = np.float32
    factor = f(f(1) / f(freq_scale if context_freq_scale is None else context_freq_scale))

    def get_mscale(mscale):         # llama_context's: scale <= 1 ? 1 : 0.1f * mscale * logf(scale) + 1.0f
        return f(f(f(0.1) * f(mscale)) * logf(factor)) + f(1) if factor > 1 else f(1)
    m = f(get_mscale(1.0) / get_mscale(log_mul)) if log_mul else get_mscale(1.0)
    m = f(m * f(f(1) / f(f(1) + f(f(0.1) * logf(factor)))))
    m = f(m * f(attn_factor))
    return f(m * np.float32(_fmaf(f(0.1), logf(f(1) / f(freq_scale)), f(1))))
