"""EXAONE 3.0 / 3.5 (LG AI), following llama.cpp's llm_build_exaone: llama's layer (RMSNorm, SwiGLU,
GQA, Llama 3 frequency factors when the file has them: models.llama) with neox rope (pairs
(i, i + n_rot/2)). EXAONE 4 is another architecture (exaone4), which kvchat's engines do not run.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from models.gguf_file import GGUFFile
from models.llama import LlamaConfig


@dataclass(frozen=True)
class ExaoneConfig(LlamaConfig):
    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "ExaoneConfig":
        return dataclasses.replace(super().from_gguf(g), rope_neox=True)
