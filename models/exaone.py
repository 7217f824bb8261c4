"""EXAONE 3.0 / 3.5 (LG AI), following llama.cpp's llm_build_exaone: llama's layer (RMSNorm, SwiGLU,
GQA, Llama 3 frequency factors when the file has them) with neox rope (pairs (i, i + n_rot/2)).
EXAONE 4 is another architecture (exaone4), which kvchat's engines do not run.
"""
from __future__ import annotations

from dataclasses import dataclass

from models.gguf_file import GGUFFile
from models.transformer import DecoderConfig, rope_factors


@dataclass(frozen=True)
class ExaoneConfig(DecoderConfig):
    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "ExaoneConfig":
        c = cls.common_from_gguf(g)
        return cls(**c, rope_neox=True, activation="swiglu",
                   rope_freq_factors=rope_factors(g, "rope_freqs.weight", c["n_rot"]))
