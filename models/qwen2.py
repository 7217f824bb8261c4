"""Qwen2: llama plus q/k/v biases, with neox rope (pairs (i, i + n_rot/2)) as llama.cpp runs it."""
from __future__ import annotations

from dataclasses import dataclass

from models.gguf_file import GGUFFile
from models.transformer import DecoderConfig


@dataclass(frozen=True)
class Qwen2Config(DecoderConfig):
    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Qwen2Config":
        return cls(**cls.common_from_gguf(g), rope_neox=True, activation="swiglu")

