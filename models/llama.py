"""Llama: pre-norm decoder, SwiGLU MLP, GQA, rotary embedding on adjacent pairs.

llama.cpp runs llama with LLAMA_ROPE_TYPE_NORM (pairs (2i, 2i+1)): the GGUF converter already
permuted the q/k weights from HF's rotate-half layout, so no neox rope here. Llama 3.1 and later
files carry `rope_freqs.weight` (n_rot/2 floats, their "llama3" rope scaling baked in by the
converter): pair i's angle is divided by factor i, as llama.cpp's ggml_rope_ext does with it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from models.errors import BadInputError
from models.gguf_file import GGUFFile
from models.transformer import DecoderConfig


@dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "LlamaConfig":
        c = cls.common_from_gguf(g)
        factors = ()
        if "rope_freqs.weight" in g.tensors:
            t = next(t for t in g.reader.tensors if t.name == "rope_freqs.weight")
            factors = tuple(float(f) for f in np.asarray(t.data, np.float32).reshape(-1))
            if len(factors) != c["n_rot"] // 2:
                raise BadInputError(f"{g.path.name}: rope_freqs has {len(factors)} factors for "
                                    f"{c['n_rot'] // 2} rotary pairs")
        return cls(**c, rope_neox=False, activation="swiglu", rope_freq_factors=factors)

