"""Mistral 3 (Ministral 3, Mistral Small 3.x files converted as mistral3), following llama.cpp's
llm_build_mistral3: llama's layer (rope on adjacent pairs, Llama 3 frequency factors when the file
has them) with YaRN's betas and its log multiplier (`rope.scaling.yarn_beta_fast`, `_beta_slow`,
`rope.scaling.yarn_log_multiplier`) read from the file, as llama.cpp reads them for this
architecture only.

Its attention temperature (`attention.temperature_scale`, Llama 4's) multiplies Q at position p by
1 + scale * ln(floor(p / F) + 1), F the YaRN original context: exactly 1 below F, so the engines run
such a file with a context of at most F tokens and leave longer ones to llama.cpp
(GGUFFile.attn_temperature_floor). The MoE files (experts) are refused by tensor name.
"""
from __future__ import annotations

from dataclasses import dataclass

from models.gguf_file import GGUFFile
from models.transformer import DecoderConfig, rope_factors


@dataclass(frozen=True)
class Mistral3Config(DecoderConfig):
    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Mistral3Config":
        c = cls.common_from_gguf(g)

        def number(key: str, default: float) -> float:
            value = g.arch_get(key)
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default
        return cls(**c, rope_neox=False, activation="swiglu",
                   rope_freq_factors=rope_factors(g, "rope_freqs.weight", c["n_rot"]),
                   yarn_betas=(number("rope.scaling.yarn_beta_fast", 32.0), number("rope.scaling.yarn_beta_slow", 1.0)),
                   yarn_log_mul=number("rope.scaling.yarn_log_multiplier", 0.0))
