"""Granite 3.x (granite) and Granite MoE (granitemoe, the same layer with a mixture of experts,
kernels.cpu.moe), as llama.cpp's llm_build_granite runs them: llama's layer with four scales from
the file: the embedding's, the attention scores' (`attention.scale`), each residual branch's
(`residual_scale`) and the logits' (divided by `logit_scale`). granite's loader reads
`rope.scaling.finetuned` false as no rope at all; granitemoe's never reads it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from models.errors import BadInputError
from models.gguf_file import GGUFFile
from models.llama import LlamaConfig
from models.transformer import arch_number


@dataclass(frozen=True)
class GraniteConfig(LlamaConfig):
    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "GraniteConfig":
        logit_scale = arch_number(g, "logit_scale", 0.0)
        if not logit_scale:
            raise BadInputError(f"{g.path.name} lacks {g.arch}.logit_scale")
        c = super().from_gguf(g)
        # (granite's loader reads rope.scaling.finetuned as rope on or off; granitemoe's never does)
        roped = g.arch != "granite" or g.arch_get("rope.scaling.finetuned", True) is not False
        return dataclasses.replace(      # (a scale of 0 counts as none, as llama.cpp's graph tests it)
            c, embed_scale=arch_number(g, "embedding_scale", 0.0) or 1.0,
            attn_scale=arch_number(g, "attention.scale", 0.0) or c.attn_scale,
            residual_scale=arch_number(g, "residual_scale", 0.0), logit_scale=logit_scale,
            nope_layers=() if roped else (True,) * c.n_layer)
