"""Activation rows quantized as llama.cpp's matmul quantizes them: q8_0 (for Q8_0, Q5_0, Q4_0 and
IQ4_NL weights; q8_1, for Q4_1 and Q5_1, has the same values and one more field) and q8_K (for the
K-quants), with the sums the kernels' offsets need."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels.cpu.ops import f16_bits, f16_value, f32_bits, f32_of_bits, serial_twin
from kernels.types import ACT_BF16, ACT_F16

# --- activation rows, quantized as llama.cpp's matmul quantizes them ------------------------------

@njit(cache=True, error_model="numpy", inline="always")
def _rint_small(v):
    """Round half to even for |v| < 2**22, as _mm256_round_ps / nearest_int do (adding and taking
    away 1.5 * 2**23 rounds the float32 sum; no libm call, so the loops vectorize). Callers are
    compiled without fastmath, so the two additions stay."""
    return (v + np.float32(12582912.0)) - np.float32(12582912.0)


@njit(fastmath=True, cache=True, error_model="numpy")
def _absmax(x, m, lo, n):
    """max |x[m, lo:lo+n]|: the same in any order (activations hold no NaN)."""
    a = np.float32(0.0)
    for i in range(lo, lo + n):
        a = max(a, abs(x[m, i]))
    return a


@njit(parallel=True, cache=True, error_model="numpy")
def _quantize_q8_0(x, xq, dx, sx, s1):
    """quantize_row_q8_0 (AVX2): per 32 elements d = f16(amax / 127), q = round(x * (127 / amax));
    sx: 16 x the sum of every 4 q (the unsigned types' offset); s1: quantize_row_q8_1's s, f16(d x
    the block's sum of q) with d before its rounding to f16 (the Q4_1 / Q5_1 minimums)."""
    for m in prange(x.shape[0]):
        for b in range(dx.shape[1]):
            amax = _absmax(x, m, b * 32, 32)
            idv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
            for i in range(32):
                xq[m, b * 32 + i] = np.int32(_rint_small(x[m, b * 32 + i] * idv))
            d = amax / np.float32(127.0)
            dx[m, b] = f16_value(f16_bits(d))
            tot = np.int32(0)
            for k in range(8):
                i = b * 32 + 4 * k
                g = np.int32(xq[m, i]) + np.int32(xq[m, i + 1]) + np.int32(xq[m, i + 2]) + np.int32(xq[m, i + 3])
                sx[m, b * 8 + k] = 16 * g
                tot += g
            s1[m, b] = f16_value(f16_bits(d * np.float32(tot)))


@njit(parallel=True, cache=True, error_model="numpy")
def _quantize_q8_k(x, xq, dx, bs16, bsp):
    """quantize_row_q8_K_ref: per 256 elements the first value of largest magnitude, vmax, maps to
    -127 (iscale = -127 / vmax, q = min(127, round(iscale * x)), d = 1 / iscale); bs16: 16-element
    sums of q. (The 4-row quantizer of the Q4_K gemm breaks +-vmax ties the other way; that flips the
    signs of q and d together and leaves every product unchanged.)"""
    for m in prange(x.shape[0]):
        for b in range(dx.shape[1]):
            amax = np.float32(0.0)
            vmax = np.float32(0.0)
            for i in range(256):
                v = x[m, b * 256 + i]
                if abs(v) > amax:
                    amax = abs(v)
                    vmax = v
            if amax == 0:
                dx[m, b] = 0.0
                for i in range(256):
                    xq[m, b * 256 + i] = 0
            else:
                iscale = np.float32(-127.0) / vmax
                for i in range(256):
                    xq[m, b * 256 + i] = min(127, np.int32(_rint_small(iscale * x[m, b * 256 + i])))
                dx[m, b] = np.float32(1.0) / iscale
            for j in range(16):
                s = np.int32(0)
                for i in range(16):
                    s += np.int32(xq[m, b * 256 + 16 * j + i])
                bs16[m, b * 16 + j] = s
            for c in range(4):                  # per 64 elements the two 32-sums as two int16 (Q4_K)
                lo = np.int32(bs16[m, b * 16 + 4 * c]) + np.int32(bs16[m, b * 16 + 4 * c + 1])
                hi = np.int32(bs16[m, b * 16 + 4 * c + 2]) + np.int32(bs16[m, b * 16 + 4 * c + 3])
                bsp[m, b * 4 + c] = (lo & 0xFFFF) | (hi << 16)


@njit(cache=True, error_model="numpy")
def round_activation(x, kind, out):
    """x (M, K) float32 -> out: the values llama.cpp's matmul converts them to for F32 (as they are),
    F16 (nearest f16, ties to even) and BF16 (nearest bf16, ties to even) weights."""
    for m in range(x.shape[0]):
        for i in range(x.shape[1]):
            v = x[m, i]
            if kind == ACT_F16:
                v = f16_value(f16_bits(v))
            elif kind == ACT_BF16:
                u = np.int64(f32_bits(v)) & 0xFFFFFFFF
                r = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
                v = f32_of_bits(np.int32(r - (r >> 31 << 32)))          # back to a signed 32-bit pattern
            out[m, i] = v


_quantize_q8_0_serial = serial_twin(_quantize_q8_0)
_quantize_q8_k_serial = serial_twin(_quantize_q8_k)
