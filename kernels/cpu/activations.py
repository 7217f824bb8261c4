"""Float16 rounding as llama.cpp's attention does it: its KV cache holds K and V as float16, and it
multiplies K by a float16 copy of Q."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels.cpu.ops import serial_twin
from kernels.cpu.quant import round_f16


@njit(parallel=True, cache=True, error_model="numpy")
def _round_to_f16(x, out):
    for i in prange(x.shape[0]):
        for j in range(x.shape[1]):
            out[i, j] = round_f16(x[i, j])


_round_to_f16_serial = serial_twin(_round_to_f16)


def round_to_f16(x: np.ndarray) -> np.ndarray:
    """Values as llama.cpp's f16 KV cache (and f16 query for K·Q) holds them (a compiled loop:
    numpy's float16 cast is far slower)."""
    x2 = np.ascontiguousarray(x, np.float32).reshape(-1, x.shape[-1])
    out = np.empty_like(x2)
    _round_to_f16(x2, out)
    return out.reshape(x.shape)
