"""Gemma (the first: Gemma 1.x, CodeGemma), following llama.cpp's llm_build_gemma: embeddings times
sqrt(n_embd), RMSNorm weights as stored (the converter wrote 1 + w), neox rope, Q times
1/sqrt(key_length) before attention, a GeGLU (tanh gelu) MLP, the output tied to token_embd.
Gemma 2 and 3 add post-norms, soft-caps and sliding windows (models.gemma2, models.gemma3).
"""
from __future__ import annotations

from dataclasses import dataclass

from kernels.cpu.libm import inv_sqrtf, sqrtf
from models.gguf_file import GGUFFile
from models.transformer import DecoderConfig


@dataclass(frozen=True)
class GemmaConfig(DecoderConfig):
    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "GemmaConfig":
        c = cls.common_from_gguf(g)
        return cls(**c, rope_neox=True, activation="geglu_tanh", embed_scale=float(sqrtf(c["n_embd"])),
                   attn_scale=float(inv_sqrtf(c["head_dim"])), scale_q=True)
