from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from models.gguf_file import GGUFFile
from models.llama import LlamaConfig
from models.transformer import arch_number


@dataclass(frozen=True)
class Mistral3Config(LlamaConfig):
    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Mistral3Config":
        return dataclasses.replace(
            super().from_gguf(g),
            yarn_betas=(arch_number(g, "rope.scaling.yarn_beta_fast", 32.0), arch_number(g, "rope.scaling.yarn_beta_slow", 1.0)),
            yarn_log_mul=arch_number(g, "rope.scaling.yarn_log_multiplier", 0.0))
