"""Qwen3-VL's language model, for text, as llama.cpp's llm_build_qwen3vl runs it: qwen3's layer
(models.qwen3) with interleaved multi-section rope (ggml_rope_multi, GGML_ROPE_TYPE_IMROPE) and
"deepstack" image features added after its first layers.

- Rope: ggml's multi-section table gives rotary pair k the position of its section (pairs k % 3 ==
  1, 2, 0 below 3x the height, width and time sections' sizes: those; the rest: the extra section,
  `rope.dimension_sections`[3]) and otherwise computes what its plain table does, on neox pairs. A
  text token's time, height and width positions are its position; its extra one is 0, so the
  extra section's pairs do not turn: here a rope frequency factor of +inf (theta / inf = 0, cos 1,
  sin 0; factors of 1 on the other pairs change no bit). In Qwen3-VL's [24, 20, 20] sections of 64
  pairs, pairs 61 and 62.
- Deepstack: a text token's deepstack features are the zero padding of its embedding, so those
  adds change nothing.

Images (the mmproj file) are not kvchat's. qwen3vlmoe (Qwen3-VL-30B-A3B) is this config with a
mixture of experts in every layer (kernels.cpu.moe).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from models.errors import BadInputError
from models.gguf_file import GGUFFile
from models.qwen3 import Qwen3Config


def extra_section_pairs(sections: tuple[int, int, int, int], n_pairs: int) -> tuple[bool, ...]:
    """Which rotary pairs take the extra section's position under interleaved multi-section rope
    (ggml_mrope_cache_init with is_imrope)."""
    t, h, w, _ = sections
    total = sum(sections)
    if total <= 0:
        raise BadInputError(f"rope sections {list(sections)} cover no rotary pair")
    extra = []
    for k in range(n_pairs):
        s = k % total
        extra.append(not ((s % 3 == 1 and s < 3 * h) or (s % 3 == 2 and s < 3 * w) or (s % 3 == 0 and s < 3 * t)))
    return tuple(extra)


@dataclass(frozen=True)
class Qwen3VLConfig(Qwen3Config):
    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Qwen3VLConfig":
        base = super().from_gguf(g)
        sections = g.arch_get("rope.dimension_sections")
        if not (isinstance(sections, (list, tuple)) and len(sections) >= 4
                and all(isinstance(s, int) and s >= 0 for s in sections[:4])):
            raise BadInputError(f"{g.path.name} lacks {g.arch}.rope.dimension_sections (four sizes)")
        extra = extra_section_pairs(tuple(sections[:4]), base.n_rot // 2)
        if not any(extra):
            return base
        return dataclasses.replace(base, rope_freq_factors=tuple(float("inf") if e else 1.0 for e in extra))
