"""Quantized weight matrices: W (N, K) in a GGML block format, kept as the file stores it.

Products go through the exact int8 kernels (kernels/cpu/qdot/; every supported type has one on AVX2
CPUs): x is quantized as llama.cpp's matmul quantizes it (q8_0 / q8_K, or rounded for the float
types) and every output gets llama.cpp's float operations, so the result equals llama.cpp's bit
for bit. W stays as the GGUF stores it (or repacked 8 rows at a time, the same bytes); one pass
over W serves all rows of x.
"""
from __future__ import annotations

import numpy as np

from kernels.cpu import qdot
from kernels.cpu.qdot import Int8Rows
from kernels.types import TRAITS
from kernels.cpu.quant import GGML_BLOCK, SUPPORTED_TYPES, TYPE_NAMES, dequantize_rows, repack


class QMatrix:
    """A GGUF weight W (n_rows=N, n_cols=K) kept in its quantized form.

    Its products run on the exact kernels' layout (matmul_int8; kernels.cpu.fused.layer reads the
    layout itself); rows() gathers dequantized rows (an embedding lookup) from per-field arrays
    (quant.repack) built on first use. Nothing is dequantized permanently.
    """

    def __init__(self, raw: np.ndarray | None, ggml_type: int, n_rows: int, n_cols: int,
                 exact: np.ndarray | None = None, build_exact: bool = True):
        ggml_type = int(ggml_type)
        if ggml_type not in SUPPORTED_TYPES:
            raise NotImplementedError(f"ggml type {TYPE_NAMES.get(ggml_type, ggml_type)} is not supported")
        self.ggml_type = ggml_type
        self.n_rows = int(n_rows)
        self.n_cols = int(n_cols)
        self.raw = raw
        # The exact kernels' layout (qdot.exact_layout): the GGUF rows themselves, or for Q4_K the
        # x8 repack, which `exact` may bring from an earlier load (the models layer caches it on
        # disk). The per-field layout of rows() is only built if it is ever asked for.
        if raw is not None:                       # the GGUF data must hold exactly n_rows rows
            blk, size = GGML_BLOCK[ggml_type]
            row_bytes = self.n_cols // blk * size
            n_bytes = np.asarray(raw).view(np.uint8).size
            if self.n_cols % blk or n_bytes != self.n_rows * row_bytes:
                raise ValueError(f"data holds {n_bytes} bytes, expected {self.n_rows} rows of {row_bytes}")
        # build_exact=False: a matrix only gathered from (the embedding); raw=None: a fused group
        # (models.transformer.Projections), which has only the exact layout.
        if exact is not None:
            self.exact = np.asarray(exact)
            held = TRAITS[ggml_type].layout_rows(self.exact)
            if not 0 <= held - self.n_rows < 8:
                raise ValueError(f"layout holds {held} rows, expected {self.n_rows}")
        else:
            self.exact = qdot.exact_layout(raw, ggml_type, self.n_rows, self.n_cols) if build_exact else None
        self._packed = None                       # rows()' per-field layout: built on first use
        self.nbytes = int(self.exact.nbytes if self.exact is not None else np.asarray(raw).nbytes)

    @property
    def packed(self) -> tuple:
        """The per-field layout rows() reads (built on first use)."""
        if self._packed is None:
            if self.raw is None:
                raise ValueError(f"{self!r} is a fused group: it has only the exact layout")
            self._packed = repack(self.raw, self.ggml_type, self.n_cols)
        return self._packed

    @property
    def shape(self) -> tuple[int, int]:
        return self.n_rows, self.n_cols

    def __repr__(self) -> str:
        return f"QMatrix({TYPE_NAMES[self.ggml_type]}, {self.n_rows}x{self.n_cols}, {self.nbytes / 2**20:.1f} MiB)"

    def matmul_int8(self, rows: Int8Rows, n_out: int | None = None, runs=None) -> np.ndarray:
        """Quantized activation rows (M, K) -> rows @ W.T (M, N) on the exact kernels (only where
        self.exact is set): llama.cpp's result bit for bit, W read once for all M rows.
        n_out: only the first n_out rows of W (a draft model's truncated vocabulary); runs: see
        qdot.matmul."""
        if self.exact is None:
            raise ValueError(f"{self!r} has no exact int8 kernel")
        return qdot.matmul(self.exact, self.ggml_type, rows, self.n_rows if n_out is None else min(n_out, self.n_rows), runs)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantized rows W[ids] (len(ids), K) float32, e.g. an embedding lookup."""
        ids = np.asarray(ids)
        if self._packed is None and self.raw.ndim == 2:        # repack just these rows of the GGUF data
            part = repack(np.ascontiguousarray(self.raw[ids]), self.ggml_type, self.n_cols)
            return dequantize_rows(part, self.ggml_type, self.n_cols, np.arange(len(ids)))
        return dequantize_rows(self.packed, self.ggml_type, self.n_cols, ids)

    def dequantize(self) -> np.ndarray:
        """The whole W as float32 (tests, small tensors)."""
        return self.rows(np.arange(self.n_rows))
