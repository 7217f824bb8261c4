"""SmolLM3, following llama.cpp's llm_build_smollm3: llama's layer (models.llama: SwiGLU, GQA, rope on
adjacent pairs), except that every fourth layer (il + 1 divisible by 4, a constant of llama.cpp's,
not a key of the file) attends without rope: its q and k go to attention as projected ("NoPE" layers).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from models.gguf_file import GGUFFile
from models.llama import LlamaConfig

NO_ROPE_LAYER_STEP = 4      # llama.cpp's hparams.n_no_rope_layer_step for smollm3


@dataclass(frozen=True)
class SmolLM3Config(LlamaConfig):
    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "SmolLM3Config":
        c = super().from_gguf(g)
        return dataclasses.replace(c, nope_layers=tuple((il + 1) % NO_ROPE_LAYER_STEP == 0 for il in range(c.n_layer)))
