"""Triton dequantization of GGUF-quantized weight rows into a dense fp16/bf16/fp32 matrix.

Why: the torch engine keeps every weight as its GGUF blocks (uint8) in device memory, which
dequant_gemv reads in place for decode. Prefill multiplies many tokens at once, where
torch.matmul on a dense matrix wins; instead of keeping a dense copy of every matrix beside
its blocks (2-4x the quantized size again), prefill dequantizes one matrix at a time into a
scratch buffer sized for the largest one and multiplies that. Embedding lookups gather only
the rows of the prompt's tokens (`rows`), so the token table needs no dense copy either.

The values are rebuilt by dequant_gemv's `_dequant_tile` (same GGUF layouts, Q8_0, Q5_0, Q4_K,
Q6_K) with the float operations in gguf-py's order and FMA contraction off, so fp32 output is
bit-identical to kernels.cpu.dequantize and narrower outputs are that value rounded once (RNE).

One program per (BLOCK_R rows, BLOCK_K columns) tile, grid (ceil(M / BLOCK_R), ceil(K / BLOCK_K)).
The launcher never reads device values (no .item(), no bounds check of `rows`), so a launch can
be captured in a CUDA graph with `rows` and `out` at fixed addresses.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.cuda.dequant_gemv import _dequant_tile, check_blocks

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _dequant_kernel(w_ptr, rows_ptr, out_ptr, M, K, row_bytes, s_om,
                    QTYPE: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)            # (R,) output rows
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)         # (K,)
    r_ok = r < M
    if HAS_ROWS:
        src = tl.load(rows_ptr + r, mask=r_ok, other=0).to(tl.int64)  # (R,) rows of W to gather
    else:
        src = r.to(tl.int64)
    mask = r_ok[:, None] & (cols < K)[None, :]                        # (R, K)
    w = _dequant_tile(w_ptr + src[:, None] * row_bytes, cols[None, :], mask, QTYPE)   # (R, K) fp32
    dst = out_ptr + r.to(tl.int64)[:, None] * s_om + cols[None, :]
    tl.store(dst, w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_rows(w_raw: torch.Tensor, ggml_type: int, n_cols: int, rows: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, dtype=torch.float16) -> torch.Tensor:
    """Dense rows of a GGUF-quantized matrix: out[i] = W[rows[i]] (or W[i] when rows is None).

    w_raw   uint8 (N, row_bytes) GGUF blocks on the device, as dequant_gemv takes it
    rows    optional int32/int64 (M,) row indices on the same device (an embedding lookup;
            repeats and any order allowed, each must lie in [0, N): not checked, that would
            need a host sync); None -> all N rows, M = N
    out     optional (M, n_cols) of `dtype` with unit column stride (e.g. the first rows of a
            larger scratch buffer); allocated when None
    dtype   float16 (default), bfloat16 or float32
    -> out (M, n_cols)

    BLOCK_R x BLOCK_K = 16 x 256 on the GPU (a whole Q4_K/Q6_K block per row per program);
    under the interpreter (CPU tensors) few programs with big tiles, as it pays per operation.
    """
    check_blocks("dequantize_rows", w_raw, ggml_type, n_cols)
    if dtype not in OUT_DTYPES:
        raise TypeError(f"dequantize_rows: output dtype must be one of {OUT_DTYPES}, got {dtype}")
    if rows is not None:
        if rows.dtype not in (torch.int32, torch.int64) or rows.dim() != 1:
            raise TypeError(f"rows must be int32/int64 (M,), got {rows.dtype} {tuple(rows.shape)}")
        if rows.device != w_raw.device:
            raise ValueError(f"rows on {rows.device}, w_raw on {w_raw.device}")
        rows = rows.contiguous()
    M = w_raw.shape[0] if rows is None else rows.shape[0]
    if out is None:
        out = torch.empty((M, n_cols), dtype=dtype, device=w_raw.device)
    else:
        if out.dtype != dtype:
            raise TypeError(f"out is {out.dtype}, dtype is {dtype}")
        if tuple(out.shape) != (M, n_cols) or out.stride(1) != 1:
            raise ValueError(f"out must be ({M}, {n_cols}) with unit column stride, "
                             f"got {tuple(out.shape)} strides {out.stride()}")
        if out.device != w_raw.device:
            raise ValueError(f"out on {out.device}, w_raw on {w_raw.device}")
    if M == 0:
        return out
    w_raw = w_raw.contiguous()
    if w_raw.device.type == "cpu":
        # the interpreter pays per operation, not per element: few programs with big tiles
        block_k = min(triton.next_power_of_2(n_cols), 4096)
        block_r = min(triton.next_power_of_2(M), max(1, (1 << 18) // block_k))
    else:
        block_r, block_k = 16, 256
    _dequant_kernel[(triton.cdiv(M, block_r), triton.cdiv(n_cols, block_k))](
        w_raw, w_raw if rows is None else rows, out, M, n_cols, w_raw.shape[1], out.stride(0),
        QTYPE=ggml_type, HAS_ROWS=rows is not None, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4,
        enable_fp_fusion=False,     # d * sc * q - dmin * m stays two roundings, as on the CPU
    )
    return out
