"""Triton RMSNorm and RoPE, fusable into one pass (per-head q/k norm + RoPE, as gemma3 needs).

One program per BLOCK_R rows of D elements (a token's hidden vector, or one head of q/k; one row on
a GPU), the whole row in registers (BLOCK_D = next_pow2(D); fine up to ~16k). In fp32 whatever the
storage dtype:

  RMSNorm: y = x / sqrt(mean(x^2) + eps) * w         (the GGUF stores w as applied, gemma included)
  RoPE (ggml_rope_ext without YaRN): pair (a, b) of dims rotated by
      theta_i = freq_scale * pos * base^(-2i / n_rot) / factor_i, i < n_rot / 2
      (factor_i: Llama 3's rope_freqs or LongRoPE's factors, else 1; freq_scale: linear rope
      scaling, else 1; m: LongRoPE's attn_factor or YaRN's, else 1; with YaRN, theta_i is a mix of
      the scaled and unscaled angle that ramps along the pairs)
      neox:   (a, b) = (i, i + n_rot/2)       normal: (a, b) = (2i, 2i + 1)
      y_a = x_a m cos - x_b m sin,  y_b = x_a m sin + x_b m cos;  dims >= n_rot pass through.

Each output element loads its rotation partner directly (a second, cached gather of the same
row) and, when fused, normalises it with the same row statistic, so no shuffles are needed.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

INTERPRETED_TILE = 1 << 14    # elements a program takes under the interpreter (_launch)


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, pos_ptr, ff_ptr, y_ptr, R, D, H, s_x, s_y, eps, log2_base, freq_scale, mscale,
                      corr_lo, corr_hi, N_ROT: tl.constexpr, NEOX: tl.constexpr, HAS_NORM: tl.constexpr,
                      HAS_ROPE: tl.constexpr, HAS_FF: tl.constexpr, HAS_YARN: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)    # (BLOCK_R,) row = t * H + h
    offs = tl.arange(0, BLOCK_D)                                  # (BLOCK_D,)
    d_ok = offs < D
    ok = (rows < R)[:, None] & d_ok[None, :]                      # (BLOCK_R, BLOCK_D)
    x = tl.load(x_ptr + rows[:, None] * s_x + offs[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)                                      # (BLOCK_R,)
        x = x * rstd[:, None] * tl.load(w_ptr + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_ROPE:
        HALF: tl.constexpr = N_ROT // 2
        if NEOX:
            i = offs % HALF
            first = offs < HALF
            partner = tl.where(first, offs + HALF, offs - HALF)
        else:
            i = offs // 2
            first = offs % 2 == 0
            partner = tl.where(first, offs + 1, offs - 1)
        rot = offs < N_ROT
        pmask = ok & rot[None, :]
        xp = tl.load(x_ptr + rows[:, None] * s_x + partner[None, :], mask=pmask, other=0.0).to(tl.float32)
        if HAS_NORM:
            xp = xp * rstd[:, None] * tl.load(w_ptr + partner, mask=d_ok & rot, other=0.0).to(tl.float32)[None, :]
        pos = tl.load(pos_ptr + rows // H, mask=rows < R, other=0).to(tl.float32)             # (BLOCK_R,)
        ang = pos[:, None] * tl.exp2(i.to(tl.float32) * (-2.0 / N_ROT) * log2_base)[None, :]
        if HAS_FF:
            ang = ang / tl.load(ff_ptr + i, mask=d_ok & rot, other=1.0)[None, :]
        extrap = ang
        ang = ang * freq_scale
        if HAS_YARN:        # ramp from interpolated to extrapolated angles between pairs corr_lo and corr_hi
            y = (i.to(tl.float32) - corr_lo) / tl.maximum(corr_hi - corr_lo, 0.001)
            ramp = 1.0 - tl.minimum(tl.maximum(y, 0.0), 1.0)
            ang = ang * (1.0 - ramp)[None, :] + extrap * ramp[None, :]
        c = tl.cos(ang) * mscale
        s = tl.sin(ang) * mscale
        y_rot = tl.where(first[None, :], x * c - xp * s, xp * s + x * c)
        x = tl.where(rot[None, :], y_rot, x)
    tl.store(y_ptr + rows[:, None] * s_y + offs[None, :], x.to(y_ptr.dtype.element_ty), mask=ok)


def _launch(x2, w, positions, H, eps, theta, n_rot, neox, has_norm, has_rope, out2, factors=None, freq_scale=1.0,
            attn_factor=1.0, yarn=None):
    R, D = x2.shape
    if R == 0:
        return
    BLOCK_D = triton.next_power_of_2(D)
    num_warps = 1 if BLOCK_D <= 256 else (4 if BLOCK_D <= 2048 else 8)
    # one row per program on a GPU; the interpreter pays per program and per operation, not per
    # element, so there a program takes up to INTERPRETED_TILE elements' worth of rows
    BLOCK_R = min(triton.next_power_of_2(R), max(1, INTERPRETED_TILE // BLOCK_D)) if x2.device.type == "cpu" else 1
    dummy = x2
    _norm_rope_kernel[(triton.cdiv(R, BLOCK_R),)](
        x2, w if has_norm else dummy, positions if has_rope else dummy, dummy if factors is None else factors, out2,
        R, D, H, x2.stride(0), out2.stride(0), float(eps), math.log2(theta) if has_rope else 0.0, float(freq_scale),
        float(attn_factor), *(map(float, yarn) if yarn else (0.0, 0.0)),
        N_ROT=n_rot if has_rope else 2, NEOX=bool(neox), HAS_NORM=has_norm, HAS_ROPE=has_rope,
        HAS_FF=factors is not None, HAS_YARN=yarn is not None, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, num_warps=num_warps,
    )


def _positions(positions, T, device):
    if not torch.is_tensor(positions):
        positions = torch.tensor(positions, device=device)
    positions = positions.reshape(-1).to(device=device, dtype=torch.int32)
    if positions.shape[0] != T:
        raise ValueError(f"{positions.shape[0]} positions for {T} tokens")
    return positions


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x (..., D) with weight w (D,)."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty_like(x) if out is None else out
    _launch(x2, w.contiguous(), None, 1, eps, 1.0, 2, True, True, False, out.view(-1, D))
    return out


def rope(x: torch.Tensor, positions, theta: float, neox: bool, n_rot: int | None = None,
         out: torch.Tensor | None = None, freq_factors: torch.Tensor | None = None,
         freq_scale: float = 1.0, attn_factor: float = 1.0, yarn: tuple[float, float] | None = None) -> torch.Tensor:
    """ggml RoPE of x (T, H, hd) at positions (T,): T*H rows. out must not alias x (partners are re-read)."""
    return norm_rope(x, None, 0.0, positions, theta, neox, n_rot, out, freq_factors, freq_scale, attn_factor, yarn)


def norm_rope(x: torch.Tensor, w: torch.Tensor | None, eps: float, positions, theta: float, neox: bool,
              n_rot: int | None = None, out: torch.Tensor | None = None, freq_factors: torch.Tensor | None = None,
              freq_scale: float = 1.0, attn_factor: float = 1.0, yarn: tuple[float, float] | None = None) -> torch.Tensor:
    """Per-head RMSNorm (w (hd,), skipped when None) then RoPE, one pass: x (T, H, hd) -> same shape.
    freq_factors (n_rot/2,) float32 on the device: each pair's angle divided by its factor;
    attn_factor: cos and sin times it; yarn: YaRN's ramp, the pairs it runs between."""
    T, H, hd = x.shape
    n_rot = hd if n_rot is None else n_rot
    if n_rot % 2 or n_rot > hd:
        raise ValueError(f"n_rot {n_rot} must be even and <= head_dim {hd}")
    x2 = x.reshape(T * H, hd)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty_like(x) if out is None else out
    if out.data_ptr() == x.data_ptr():
        raise ValueError("norm_rope/rope cannot run in place: each element re-reads its rotation partner from x")
    if T:
        if freq_factors is not None and tuple(freq_factors.shape) != (n_rot // 2,):
            raise ValueError(f"{tuple(freq_factors.shape)} rope frequency factors for {n_rot // 2} rotary pairs")
        _launch(x2, None if w is None else w.contiguous(), _positions(positions, T, x.device), H, eps, theta,
                n_rot, neox, w is not None, True, out.view(T * H, hd), freq_factors, freq_scale, attn_factor, yarn)
    return out
