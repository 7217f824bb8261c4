"""The machine's memory read bandwidth, measured with a streaming read of our own.

Decode is memory-bound: every token reads every weight once. `kvchat bench` reports decode's
GB/s against this number (what the memory system delivers to a plain parallel read on the
engine's threads), so a decode at 80% of it has a fifth left to find, whatever the spec sheet says.
"""
from __future__ import annotations

import time

import numpy as np
from numba import njit, prange

from kernels.cpu.ops import FAST


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _read(a):
    """The sum of a (N,) float32: every byte read once, from memory. numba splits the range among
    the threads and vectorizes each share (fastmath lets it reassociate the sum)."""
    s = np.float32(0.0)
    for i in prange(a.shape[0]):
        s += a[i]
    return s


def read_bandwidth_gb_s(n_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """The best of `repeats` timed reads of an n_bytes array (far larger than any cache), in GB/s."""
    a = np.ones(n_bytes // 4, np.float32)               # written once: every page is resident
    _read(a)                                            # compile and warm
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _read(a)
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9
