"""Triton GEMV on raw GGUF blocks: y = W @ x with W kept quantized, dequantized in registers.

W is the tensor's bytes exactly as in the GGUF file, a uint8 tensor (n_rows, row_bytes) on the
device; x (K,) or (M, K) small M; y fp32. Decode at batch 1 is memory-bound, so reading
4.5-8.5 bits per weight instead of 16 is the point.

One program per BLOCK_R rows (grid (ceil(N / BLOCK_R), M)); it walks the row in BLOCK_K-column
tiles. For each column of a tile the kernel computes the byte offsets of its quant block and
fields, loads them as uint8 (neighbouring columns share bytes, so the loads coalesce and the
repeats hit L1), rebuilds the value in fp32 and accumulates w * x. Layouts follow ggml-quants.c
(dequantize_row_*), which gguf.quants.dequantize mirrors:

  Q8_0 (32 per block, 34 B): f16 d | 32 x int8 q             -> d * q
  Q5_0 (32, 22 B):  f16 d | u32 qh | 16 B nibbles             -> d * ((nib | hbit << 4) - 16)
  Q4_K (256, 144 B): f16 d | f16 dmin | 12 B 6-bit scales/mins | 128 B nibbles
                                                              -> d * sc * nib - dmin * mn
  Q6_K (256, 210 B): 128 B ql | 64 B qh | 16 x int8 scales | f16 d
                                                              -> d * sc * (ql4 | qh2 << 4 - 32)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.cuda import GEMV_TYPES
from kernels.types import Q4_K, Q5_0, Q8_0, TRAITS

QK = {t: (TRAITS[t].block, TRAITS[t].size) for t in GEMV_TYPES}   # (elements, bytes) per block
# the same ids as compile-time constants inside the kernels (Triton reads only constexpr globals)
_Q8_0, _Q5_0, _Q4_K = tl.constexpr(Q8_0), tl.constexpr(Q5_0), tl.constexpr(Q4_K)
SUPPORTED = tuple(QK)
GEMV_FEW_ROWS = 512    # a matrix of at most this many rows is read in wider tiles (dequant_gemv)


@triton.jit
def _f16_at(ptr, mask):
    """Little-endian f16 at byte address ptr (unaligned-safe: two byte loads) -> fp32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_tile(row_ptr, cols, mask, QTYPE: tl.constexpr):
    """Values of W at the given columns; row_ptr (R, 1) byte address of each row, cols (1, K) -> (R, K) fp32."""
    if QTYPE == _Q8_0:
        blk = row_ptr + (cols // 32) * 34
        d = _f16_at(blk, mask)
        q = tl.load(blk + 2 + cols % 32, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = d * q
    elif QTYPE == _Q5_0:
        blk = row_ptr + (cols // 32) * 22
        i = cols % 32
        d = _f16_at(blk, mask)
        qh = tl.load(blk + 2 + i // 8, mask=mask, other=0).to(tl.int32)
        hbit = (qh >> (i % 8)) & 1
        qs = tl.load(blk + 6 + i % 16, mask=mask, other=0).to(tl.int32)
        nib = tl.where(i < 16, qs & 15, qs >> 4)
        w = d * ((nib | (hbit << 4)) - 16).to(tl.float32)
    elif QTYPE == _Q4_K:
        blk = row_ptr + (cols // 256) * 144
        i = cols % 256
        d = _f16_at(blk, mask)
        dmin = _f16_at(blk + 2, mask)
        sb = i // 32                                   # sub-block 0..7: its 6-bit scale and min
        a = tl.load(blk + 4 + sb, mask=mask, other=0).to(tl.int32)
        b = tl.load(blk + 8 + sb, mask=mask, other=0).to(tl.int32)            # scales[sb + 4]
        c = tl.load(blk + 4 + tl.where(sb >= 4, sb - 4, sb), mask=mask, other=0).to(tl.int32)
        sc = tl.where(sb < 4, a & 63, (b & 15) | ((c >> 6) << 4))
        mn = tl.where(sb < 4, b & 63, (b >> 4) | ((a >> 6) << 4))
        qs = tl.load(blk + 16 + (i // 64) * 32 + i % 32, mask=mask, other=0).to(tl.int32)
        nib = tl.where(sb % 2 == 0, qs & 15, qs >> 4)
        w = d * sc.to(tl.float32) * nib.to(tl.float32) - dmin * mn.to(tl.float32)
    else:               # Q6_K
        blk = row_ptr + (cols // 256) * 210
        i = cols % 256
        half = i // 128
        quad = (i % 128) // 32
        l = i % 32
        ql = tl.load(blk + half * 64 + (quad % 2) * 32 + l, mask=mask, other=0).to(tl.int32)
        qh = tl.load(blk + 128 + half * 32 + l, mask=mask, other=0).to(tl.int32)
        sc = tl.load(blk + 192 + half * 8 + l // 16 + 2 * quad, mask=mask, other=0).to(tl.int8, bitcast=True)
        d = _f16_at(blk + 208, mask)
        q = tl.where(quad < 2, ql & 15, ql >> 4) | (((qh >> (2 * quad)) & 3) << 4)
        w = d * sc.to(tl.float32) * (q - 32).to(tl.float32)
    return w


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, y_ptr, N, K, row_bytes, s_xm, s_ym,
                 QTYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    m = tl.program_id(1)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < N
    row_ptr = w_ptr + rows.to(tl.int64)[:, None] * row_bytes       # (R, 1)
    acc = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        c_ok = cols < K
        x = tl.load(x_ptr + m * s_xm + cols, mask=c_ok, other=0.0).to(tl.float32)
        mask = r_ok[:, None] & c_ok[None, :]
        w = _dequant_tile(row_ptr, cols[None, :], mask, QTYPE)
        acc += tl.where(mask, w, 0.0) * x[None, :]
    y = tl.sum(acc, 1)
    tl.store(y_ptr + m * s_ym + rows, y, mask=r_ok)


def check_blocks(kernel: str, w_raw: torch.Tensor, ggml_type: int, n_cols: int) -> None:
    """w_raw must be the uint8 (n_rows, row_bytes) GGUF blocks of n_cols-column rows of a type the
    kernels read."""
    if ggml_type not in QK:
        raise NotImplementedError(f"{kernel}: GGML type {ggml_type} not supported (have {SUPPORTED})")
    if w_raw.dtype != torch.uint8 or w_raw.dim() != 2:
        raise TypeError(f"w_raw must be uint8 (n_rows, row_bytes), got {w_raw.dtype} {tuple(w_raw.shape)}")
    per, nbytes = QK[ggml_type]
    if n_cols % per or w_raw.shape[1] != n_cols // per * nbytes:
        raise ValueError(f"{n_cols} columns of type {ggml_type} need rows of {n_cols // per * nbytes} bytes, "
                         f"got {w_raw.shape[1]}")


def dequant_gemv(w_raw: torch.Tensor, ggml_type: int, n_cols: int, x: torch.Tensor,
                 block_r: int = 0, block_k: int = 0, num_warps: int = 0) -> torch.Tensor:
    """y = W @ x in fp32. w_raw uint8 (N, row_bytes) GGUF blocks; x (K,) or (M, K) -> (N,) or (M, N).

    BLOCK_R rows x BLOCK_K columns per tile. On the GPU one row per program: the kernel is bound by
    the instructions that rebuild each weight, not by memory, so the more programs in flight the
    better; a matrix of few rows (a k or v projection) takes 512-column tiles on two warps. Chosen
    from a sweep of tile shapes on an H200 over the 1.5B registry model's decode shapes (README, "The
    GPU engine"; tests/gpu_gemv_sweep.py reruns it). Under the interpreter, which pays per operation
    and not per element: few programs with big tiles, up to 1024 x 256. Any tile gives the same
    products (BLOCK_K need not divide into whole quant blocks: every column finds its block itself).
    """
    check_blocks("dequant_gemv", w_raw, ggml_type, n_cols)
    w_raw = w_raw.contiguous()
    squeeze = x.dim() == 1
    x2 = (x.unsqueeze(0) if squeeze else x).contiguous()
    if x2.shape[1] != n_cols:
        raise ValueError(f"x has {x2.shape[1]} columns, W has {n_cols}")
    M, N = x2.shape[0], w_raw.shape[0]
    y = torch.empty((M, N), dtype=torch.float32, device=x.device)
    interp = x.device.type == "cpu"
    if interp:
        block_r, block_k, num_warps = block_r or min(1024, triton.next_power_of_2(N)), block_k or 256, num_warps or 4
    else:
        few = N <= GEMV_FEW_ROWS
        block_r, block_k, num_warps = block_r or 1, block_k or (512 if few else 256), num_warps or (2 if few else 1)
    _gemv_kernel[(triton.cdiv(N, block_r), M)](
        w_raw, x2, y, N, n_cols, w_raw.shape[1], x2.stride(0), y.stride(0),
        QTYPE=ggml_type, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=num_warps,
    )
    return y[0] if squeeze else y
