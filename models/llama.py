"""Llama: pre-norm decoder, SwiGLU MLP, GQA, rotary embedding on adjacent pairs.

llama.cpp runs llama with LLAMA_ROPE_TYPE_NORM (pairs (2i, 2i+1)): the GGUF converter already
permuted the q/k weights from HF's rotate-half layout, so no neox rope here. Llama 3.1 and later
files carry `rope_freqs.weight` (n_rot/2 floats, their "llama3" rope scaling baked in by the
converter): pair i's angle is divided by factor i, as llama.cpp's ggml_rope_ext does with it.
Mistral's files (this architecture) may carry `llama.attention.sliding_window`: llama.cpp's llama
graph never reads it and attends to the whole context, and so do we. Mixtral's files are llama
files with a mixture of experts in every layer (`llama.expert_count`; kernels.cpu.moe).
"""
from __future__ import annotations

from dataclasses import dataclass

from models.gguf_file import GGUFFile
from models.transformer import DecoderConfig, rope_factors


@dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "LlamaConfig":
        c = cls.common_from_gguf(g)
        return cls(**c, rope_neox=False, activation="swiglu",
                   rope_freq_factors=rope_factors(g, "rope_freqs.weight", c["n_rot"]))

