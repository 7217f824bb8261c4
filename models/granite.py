"""IBM Granite 3.x (dense), following llama.cpp's llm_build_granite: llama's layer (rope on adjacent
pairs, Llama 3 frequency factors when the file has them) with four constants of the file:

- the token embeddings times `granite.embedding_scale`;
- the attention scores times `granite.attention.scale` instead of 1/sqrt(head_dim);
- attention's and the FFN's outputs times `granite.residual_scale` before each residual add;
- the logits divided by `granite.logit_scale` (times its float32 reciprocal, as ggml_scale does).

`granite.rope.scaling.finetuned` false means no rope at any layer (llama.cpp's rope_pattern).
Its MoE and hybrid siblings (granitemoe, granitehybrid) are other architectures.
"""
from __future__ import annotations

from dataclasses import dataclass

from models.errors import BadInputError
from models.gguf_file import GGUFFile
from models.transformer import DecoderConfig, rope_factors


@dataclass(frozen=True)
class GraniteConfig(DecoderConfig):
    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "GraniteConfig":
        c = cls.common_from_gguf(g)
        logit_scale = g.arch_get("logit_scale")
        if not isinstance(logit_scale, (int, float)) or isinstance(logit_scale, bool) or not logit_scale:
            raise BadInputError(f"{g.path.name} lacks {g.arch}.logit_scale")

        def scale(key: str, default: float) -> float:
            value = g.arch_get(key)
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value else default

        roped = g.arch_get("rope.scaling.finetuned", True) is not False
        return cls(**c, rope_neox=False, activation="swiglu",
                   rope_freq_factors=rope_factors(g, "rope_freqs.weight", c["n_rot"]),
                   embed_scale=scale("embedding_scale", 1.0), attn_scale=scale("attention.scale", 0.0),
                   residual_scale=scale("residual_scale", 0.0), logit_scale=float(logit_scale),
                   nope_layers=() if roped else (True,) * c["n_layer"])
