"""Gemma (the first: Gemma 1.x, CodeGemma), following llama.cpp's llm_build_gemma: embeddings times
sqrt(n_embd), RMSNorm weights as stored (the converter wrote 1 + w), neox rope, Q times
1/sqrt(key_length) before attention, a GeGLU (tanh gelu) MLP, the output tied to token_embd.
Gemma 2 and 3 add post-norms, soft-caps and sliding windows (models.gemma2, models.gemma3).
"""
from __future__ import annotations

from dataclasses import dataclass

from models.gemma2 import gemma_family
from models.gguf_file import GGUFFile
from models.transformer import DecoderConfig


@dataclass(frozen=True)
class GemmaConfig(DecoderConfig):
    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "GemmaConfig":
        c = cls.common_from_gguf(g)
        return cls(**c, **{**gemma_family(c, n_layer_27b=-1), "post_norms": False})     # (no 27B: Q by key_length)
