"""Triton GEMV on raw GGUF blocks: y = W @ x with W kept quantized, dequantized in registers.

W is the tensor's bytes exactly as in the GGUF file, a uint8 tensor (n_rows, row_bytes) on the
device; x (K,) or (M, K) small M; y fp32. Decode at batch 1 is memory-bound, so reading
4.5-8.5 bits per weight instead of 16 is the point.

Two kernels, each one program per BLOCK_R rows (grid (ceil(N / BLOCK_R), M)) walking the rows in
BLOCK_K-column steps:
  * _gemv_kernel, per column (every type): each column computes the byte offsets of its quant
    block and fields, loads them as uint8 (neighbouring columns share bytes, so the loads coalesce
    and the repeats hit L1), rebuilds its weight in fp32 and accumulates w * x. dequant.py
    shares its tile function.
  * _gemv_blocks_kernel, per block (the K-quants): a step is whole quant blocks; the quants are
    loaded as 32- or 16-bit words (Q6_K's 210-byte blocks are only 2-byte aligned), and each
    sub-block's sum of products takes its scale (and min) once, as llama.cpp's CUDA GEMV does.
    A GPU runs the per-column kernel on the instructions that rebuild each weight, not on memory:
    per block, that work is done once per word and once per sub-block.
Layouts follow ggml-quants.c (dequantize_row_*), which gguf.quants.dequantize mirrors:

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
from kernels.types import Q4_K, Q5_0, Q6_K, Q8_0, TRAITS

QK = {t: (TRAITS[t].block, TRAITS[t].size) for t in GEMV_TYPES}   # (elements, bytes) per block
# the same ids as compile-time constants inside the kernels (Triton reads only constexpr globals)
_Q8_0, _Q5_0, _Q4_K, _Q6_K = tl.constexpr(Q8_0), tl.constexpr(Q5_0), tl.constexpr(Q4_K), tl.constexpr(Q6_K)
SUPPORTED = tuple(QK)
BLOCKWISE = (Q4_K, Q6_K)    # the types _gemv_blocks_kernel reads; Q8_0 and Q5_0 take the per-column kernel
GEMV_FEW_ROWS = 512    # a matrix of at most this many rows is read in wider tiles (both kernels)
GEMV_TALL_Q4_K = 4096  # a Q4_K matrix of at least this many rows: two rows a program (block-wise)


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


# ---- block-wise GEMV: whole quant blocks per step, words loaded, one scale per sub-block

@triton.jit
def _words(ptr, mask, WORD: tl.constexpr):
    """Little-endian words of WORD bits (32 or 16) at byte addresses ptr, as int32 (16-bit ones zero-extended)."""
    if WORD == 32:
        return tl.load(ptr.to(tl.pointer_type(tl.int32)), mask=mask, other=0)
    else:
        return tl.load(ptr.to(tl.pointer_type(tl.uint16)), mask=mask, other=0).to(tl.int32)


@triton.jit
def _q4_k_dots(blk, xb, ok, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
    """sum over a Q4_K block of w * x, per (row, block): blk (R, B) byte address of each block,
    xb (B,) address of its first x, ok (R, B) -> (R, B) fp32.

    Bytes 16..143 are four chunks j of 32 bytes; byte l of chunk j holds column 64j + l in its low
    nibble (sub-block 2j) and 64j + 32 + l in its high nibble (sub-block 2j + 1). Read as 32 words:
    word w = 8j + v holds bytes 4v..4v+3 of chunk j."""
    w = tl.arange(0, 32)
    t = tl.arange(0, 4)
    col = (w // 8 * 64 + w % 8 * 4)[:, None] + t[None, :]                          # (32, 4) low-nibble columns
    q = _words(blk[:, :, None] + 16 + 4 * w[None, None, :], ok[:, :, None], 32)    # (R, B, 32)
    q = q[:, :, :, None] >> (8 * t)[None, None, None, :]                           # (R, B, 32, 4)
    x_lo = tl.load(xb[:, None, None] + col[None, :, :]).to(tl.float32)             # (B, 32, 4)
    x_hi = tl.load(xb[:, None, None] + col[None, :, :] + 32).to(tl.float32)
    p_lo = tl.sum((q & 15).to(tl.float32) * x_lo[None], 3)                         # (R, B, 32)
    p_hi = tl.sum(((q >> 4) & 15).to(tl.float32) * x_hi[None], 3)
    dot_lo = tl.sum(tl.reshape(p_lo, (BLOCK_R, BLOCK_B, 4, 8)), 3)                 # (R, B, 4): sub-block 2j
    dot_hi = tl.sum(tl.reshape(p_hi, (BLOCK_R, BLOCK_B, 4, 8)), 3)                 # sub-block 2j + 1
    sx_lo = tl.sum(tl.reshape(tl.sum(x_lo, 2), (BLOCK_B, 4, 8)), 2)                # (B, 4) sum of x per sub-block
    sx_hi = tl.sum(tl.reshape(tl.sum(x_hi, 2), (BLOCK_B, 4, 8)), 2)
    j = tl.arange(0, 4)
    d = _f16_at(blk, ok)
    dmin = _f16_at(blk + 2, ok)
    # 6-bit scale and min of sub-block sb (get_scale_min_k4): sb < 4 from bytes sb and sb + 4 alone,
    # sb >= 4 from byte sb + 4 and the top bits of bytes sb - 4 and sb
    m3 = ok[:, :, None]
    sb = blk[:, :, None] + 4
    a_e = tl.load(sb + 2 * j[None, None, :], mask=m3, other=0).to(tl.int32)        # (R, B, 4) sub-block 2j
    b_e = tl.load(sb + 4 + 2 * j[None, None, :], mask=m3, other=0).to(tl.int32)
    a_o = tl.load(sb + 2 * j[None, None, :] + 1, mask=m3, other=0).to(tl.int32)    # sub-block 2j + 1
    b_o = tl.load(sb + 4 + 2 * j[None, None, :] + 1, mask=m3, other=0).to(tl.int32)
    c_e = tl.load(sb + tl.where(j >= 2, 2 * j - 4, 2 * j)[None, None, :], mask=m3, other=0).to(tl.int32)
    c_o = tl.load(sb + tl.where(j >= 2, 2 * j - 3, 2 * j + 1)[None, None, :], mask=m3, other=0).to(tl.int32)
    low = (j < 2)[None, None, :]
    sc_e = tl.where(low, a_e & 63, (b_e & 15) | ((c_e >> 6) << 4)).to(tl.float32)
    mn_e = tl.where(low, b_e & 63, (b_e >> 4) | ((a_e >> 6) << 4)).to(tl.float32)
    sc_o = tl.where(low, a_o & 63, (b_o & 15) | ((c_o >> 6) << 4)).to(tl.float32)
    mn_o = tl.where(low, b_o & 63, (b_o >> 4) | ((a_o >> 6) << 4)).to(tl.float32)
    dots = tl.sum(sc_e * dot_lo + sc_o * dot_hi, 2)                                # (R, B)
    mins = tl.sum(mn_e * sx_lo[None] + mn_o * sx_hi[None], 2)
    return d * dots - dmin * mins


@triton.jit
def _q6_k_dots(blk, xb, ok, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
    """sum over a Q6_K block of w * x, per (row, block), as _q4_k_dots.

    Column 128h + 32quad + l (h < 2, quad < 4, l < 32) takes its low 4 bits from byte
    64h + 32(quad % 2) + l of ql (low nibble for quad < 2, high for quad >= 2), its top 2 bits from
    bits 2quad.. of byte 128 + 32h + l, and scale 8h + 2quad + l // 16. Blocks are 210 bytes, so only
    2-byte aligned: read as 16-bit words, word hp = 16h + p holding l = 2p and 2p + 1."""
    hp = tl.arange(0, 32)
    s = tl.arange(0, 2)
    col = (hp // 16 * 128 + hp % 16 * 2)[:, None] + s[None, :]                   # (32, 2) columns of quad 0
    at = blk[:, :, None] + (hp // 16 * 64 + hp % 16 * 2)[None, None, :]          # (R, B, 32)
    m3 = ok[:, :, None]
    sh = (8 * s)[None, None, None, :]
    a = (_words(at, m3, 16)[:, :, :, None] >> sh) & 255                         # (R, B, 32, 2) ql, quads 0 and 2
    b = (_words(at + 32, m3, 16)[:, :, :, None] >> sh) & 255                    # ql, quads 1 and 3
    hb = (_words(blk[:, :, None] + 128 + (hp // 16 * 32 + hp % 16 * 2)[None, None, :], m3, 16)[:, :, :, None]
          >> sh) & 255                                                           # qh
    g = tl.arange(0, 4)                                                          # 16-column group: (h, l // 16)
    dots = tl.zeros([BLOCK_R, BLOCK_B], tl.float32)
    for quad in tl.static_range(4):
        src = a if quad % 2 == 0 else b
        lo = src & 15 if quad < 2 else src >> 4
        q = (lo | (((hb >> (2 * quad)) & 3) << 4)) - 32
        x = tl.load(xb[:, None, None] + col[None, :, :] + 32 * quad).to(tl.float32)   # (B, 32, 2)
        p = tl.sum(q.to(tl.float32) * x[None], 3)                                # (R, B, 32)
        dot = tl.sum(tl.reshape(p, (BLOCK_R, BLOCK_B, 4, 8)), 3)                 # (R, B, 4)
        sc = tl.load(blk[:, :, None] + 192 + (g // 2 * 8 + g % 2 + 2 * quad)[None, None, :], mask=m3, other=0)
        dots += tl.sum(sc.to(tl.int8, bitcast=True).to(tl.float32) * dot, 2)
    return _f16_at(blk + 208, ok) * dots


@triton.jit
def _gemv_blocks_kernel(w_ptr, x_ptr, y_ptr, N, NB, row_bytes, s_xm, s_ym, QTYPE: tl.constexpr,
                        PER: tl.constexpr, BYTES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
    """y[m, rows] = W[rows] @ x[m]: BLOCK_R rows per program, BLOCK_B whole quant blocks per step."""
    pid = tl.program_id(0)
    m = tl.program_id(1)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < N
    row_ptr = w_ptr + rows.to(tl.int64) * row_bytes                             # (R,)
    acc = tl.zeros([BLOCK_R, BLOCK_B], tl.float32)
    for b0 in range(0, NB, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)                                          # (B,) block index in the row
        ok = r_ok[:, None] & (b < NB)[None, :]                                  # (R, B)
        blk = row_ptr[:, None] + b[None, :] * BYTES                             # (R, B) block addresses
        xb = x_ptr + m * s_xm + tl.minimum(b, NB - 1) * PER                     # (B,) in bounds; masked blocks read 0
        if QTYPE == _Q4_K:
            part = _q4_k_dots(blk, xb, ok, BLOCK_R, BLOCK_B)
        else:
            part = _q6_k_dots(blk, xb, ok, BLOCK_R, BLOCK_B)
        acc += tl.where(ok, part, 0.0)
    tl.store(y_ptr + m * s_ym + rows, tl.sum(acc, 1), mask=r_ok)


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
                 block_r: int = 0, block_k: int = 0, num_warps: int = 0, per_column: bool = False) -> torch.Tensor:
    """y = W @ x in fp32. w_raw uint8 (N, row_bytes) GGUF blocks; x (K,) or (M, K) -> (N,) or (M, N).

    Q4_K and Q6_K take the per-block kernel (BLOCK_K a power-of-two number of whole blocks), Q8_0
    and Q5_0 (or per_column=True) the per-column one. The GPU's tiles come from sweeps of tile
    shapes on an H200 over the 1.5B registry model's decode shapes (README, "The GPU engine";
    tests/gpu_gemv_sweep.py reruns it): one row per program, on one warp, two K-quant blocks a step
    (two rows for a tall Q4_K matrix, GEMV_TALL_Q4_K: an FFN's gate and up; eight blocks on two
    warps for a matrix of few rows, GEMV_FEW_ROWS: k and v, where 256 programs leave most of the
    card idle and a step's latency is what counts); Q8_0 per column 512 columns a step on two warps. The interpreter, which pays per operation and
    not per element, takes few programs with big tiles. Any tile gives the same products up to the
    order of the fp32 sums.
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
    per, nbytes = QK[ggml_type]
    if ggml_type in BLOCKWISE and not per_column:
        # the word loads' alignment (Q4_K: 32-bit, Q6_K: 16-bit). Whole rows keep it from an aligned
        # start (Q4_K rows are 144-byte multiples), so the engine's matrices and their row ranges
        # never take this copy
        if w_raw.data_ptr() % (4 if ggml_type == Q4_K else 2):
            w_raw = w_raw.clone()
        if interp:
            block_r, block_k, num_warps = (block_r or min(64, triton.next_power_of_2(N)),
                                           block_k or min(2048, triton.next_power_of_2(n_cols)), num_warps or 4)
        else:
            tall, few = ggml_type == Q4_K and N >= GEMV_TALL_Q4_K, N <= GEMV_FEW_ROWS
            block_r, block_k, num_warps = (block_r or (2 if tall else 1), block_k or (8 if few else 2) * per,
                                           num_warps or (2 if few else 1))
        if block_k % per or (block_k // per) & (block_k // per - 1):
            raise ValueError(f"block_k {block_k} must be a power-of-two number of {per}-column blocks")
        _gemv_blocks_kernel[(triton.cdiv(N, block_r), M)](
            w_raw, x2, y, N, n_cols // per, w_raw.shape[1], x2.stride(0), y.stride(0), QTYPE=ggml_type, PER=per,
            BYTES=nbytes, BLOCK_R=block_r, BLOCK_B=block_k // per, num_warps=num_warps,
        )
    else:
        if interp:
            block_r, block_k, num_warps = (block_r or min(1024, triton.next_power_of_2(N)), block_k or 256,
                                           num_warps or 4)
        else:
            wide = N <= GEMV_FEW_ROWS or ggml_type == Q8_0
            block_r, block_k, num_warps = (block_r or 1, block_k or (512 if wide else 256),
                                           num_warps or (2 if wide else 1))
        _gemv_kernel[(triton.cdiv(N, block_r), M)](
            w_raw, x2, y, N, n_cols, w_raw.shape[1], x2.stride(0), y.stride(0),
            QTYPE=ggml_type, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=num_warps,
        )
    return y[0] if squeeze else y
