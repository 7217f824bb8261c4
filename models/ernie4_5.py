"""ERNIE 4.5 (the dense models: ERNIE-4.5-0.3B), following llama.cpp's llm_build_ernie4_5: llama's
layer (RMSNorm, SwiGLU, GQA, rope on adjacent pairs) without rope frequency factors. Its MoE
sibling is another architecture (ernie4_5-moe), which kvchat's engines do not run.
"""
from __future__ import annotations

from dataclasses import dataclass

from models.gguf_file import GGUFFile
from models.transformer import DecoderConfig


@dataclass(frozen=True)
class Ernie45Config(DecoderConfig):
    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Ernie45Config":
        return cls(**cls.common_from_gguf(g), rope_neox=False, activation="swiglu")
