"""llama.cpp's activation rounding, reproduced so our logits track llama.cpp's token for token.

ggml's CPU matmul never multiplies a quantized weight by a float32 activation: it first quantizes
the activation row to the weight type's "vec_dot type" (q8_0 blocks of 32 with an f16 scale for
the 32-block types, q8_K blocks of 256 with an f32 scale for the K-quants, f16 for F16 weights),
then takes exact integer dots. dot(W, x) then equals dot(W, x~) with x~ the dequantized activation,
so rounding x to x~ here and using float weights gives llama.cpp's numbers up to summation order.
That is what makes greedy decoding fork from llama.cpp only where llama.cpp itself is unstable.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels.cpu.quant import round_f16

from kernels.types import BF16, F16, Q8_0_ACTIVATION_TYPES as Q8_0_TYPES, Q8_K_ACTIVATION_TYPES as Q8_K_TYPES


def _round_q8_0(x: np.ndarray) -> np.ndarray:
    """x (T, K), K % 32 == 0: per 32-block, d = amax/127 stored as f16, q = round(x*127/amax)."""
    T, K = x.shape
    xb = x.reshape(T, K // 32, 32)
    amax = np.abs(xb).max(axis=-1, keepdims=True)                          # (T, nb, 1)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    return (np.rint(xb * inv) * d).reshape(T, K)


def _round_q8_K(x: np.ndarray) -> np.ndarray:
    """x (T, K), K % 256 == 0: per 256-block, the signed value of largest magnitude maps to -127."""
    T, K = x.shape
    xb = x.reshape(T, K // 256, 256)
    first_max = np.abs(xb).argmax(axis=-1)[..., None]                      # (T, nb, 1)
    vmax = np.take_along_axis(xb, first_max, axis=-1)
    iscale = np.divide(np.float32(-127), vmax, out=np.zeros_like(vmax), where=vmax != 0)
    d = np.divide(np.float32(1), iscale, out=np.zeros_like(iscale), where=iscale != 0)
    return (np.minimum(np.float32(127), np.rint(xb * iscale)) * d).reshape(T, K)


def round_like_llama_cpp(x: np.ndarray, weight_type: int) -> np.ndarray:
    """x (T, K) float32 -> the activation llama.cpp's matmul effectively uses against `weight_type`."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if weight_type in Q8_0_TYPES and x.shape[1] % 32 == 0:
        return _round_q8_0(x)
    if weight_type in Q8_K_TYPES and x.shape[1] % 256 == 0:
        return _round_q8_K(x)
    if weight_type == F16:
        return x.astype(np.float16).astype(np.float32)
    if weight_type == BF16:
        return round_to_bf16(x)
    return x


@njit(parallel=True, cache=True, error_model="numpy")
def _round_to_f16(x, out):
    for i in prange(x.shape[0]):
        for j in range(x.shape[1]):
            out[i, j] = round_f16(x[i, j])


def round_to_f16(x: np.ndarray) -> np.ndarray:
    """Values as llama.cpp's f16 KV cache (and f16 query for K·Q) holds them (a compiled loop:
    numpy's float16 cast is far slower)."""
    x2 = np.ascontiguousarray(x, np.float32).reshape(-1, x.shape[-1])
    out = np.empty_like(x2)
    _round_to_f16(x2, out)
    return out.reshape(x.shape)


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even to bfloat16, kept in float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)
