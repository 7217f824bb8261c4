"""Llama: pre-norm decoder, SwiGLU MLP, GQA, rotary embedding on adjacent pairs.

llama.cpp runs llama with LLAMA_ROPE_TYPE_NORM (pairs (2i, 2i+1)): the GGUF converter already
permuted the q/k weights from HF's rotate-half layout, so no neox rope here.
"""
from __future__ import annotations

from dataclasses import dataclass

from models.gguf_file import GGUFFile
from models.transformer import DecoderConfig


@dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "LlamaConfig":
        return cls(**cls.common_from_gguf(g), rope_neox=False, activation="swiglu")

