"""Phi-3 (and Phi-4, which GGUF files also call phi3), following llama.cpp's llm_build_phi3: a llama
layer with its q, k, v in one matrix (attn_qkv: rows q, then k, then v) and its gate and up in
another (ffn_up: 2 * n_ff rows, the gate first), neox rope, and Q times 1/sqrtf(head_dim) after rope
instead of scaling the scores. llama.cpp switches Phi-3's sliding window off, and so do we.
Files with LongRoPE factors (rope_factors_long / _short: the 128k models, Phi-3.5, Phi-4-mini) are
not run yet (GGUFFile.unsupported sends them to llama.cpp)."""
from __future__ import annotations

from dataclasses import dataclass

from kernels.cpu.libm import inv_sqrtf
from models.gguf_file import GGUFFile
from models.transformer import DecoderConfig


@dataclass(frozen=True)
class Phi3Config(DecoderConfig):
    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Phi3Config":
        c = cls.common_from_gguf(g)
        return cls(**c, rope_neox=True, activation="swiglu", attn_scale=float(inv_sqrtf(c["head_dim"])),
                   scale_q=True)
