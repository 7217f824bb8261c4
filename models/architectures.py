"""The architecture table: a GGUF's `general.architecture` -> the config class that reads it. One file
per architecture holds its config (what differs from the shared transformer); models.transformer
runs them all and imports none of them. The table names each config by module, so that reading a
GGUF (models.gguf_file) can consult it without loading the engine."""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from models.errors import BadInputError

if TYPE_CHECKING:
    from models.gguf_file import GGUFFile
    from models.transformer import Decoder, DecoderConfig

ARCHITECTURES: dict[str, tuple[str, str]] = {     # name -> (module, config class)
    "llama": ("models.llama", "LlamaConfig"),
    "qwen2": ("models.qwen2", "Qwen2Config"),
    "qwen3": ("models.qwen3", "Qwen3Config"),
    "phi3": ("models.phi3", "Phi3Config"),
    "gemma2": ("models.gemma2", "Gemma2Config"),
    "gemma3": ("models.gemma3", "Gemma3Config"),
}

# rope.scaling.type values the engines run (llama.cpp's names): "linear" scales every angle by
# 1 / rope.scaling.factor. YaRN and LongRoPE are not built yet (GGUFFile.unsupported says so).
ROPE_SCALING_TYPES = ("none", "linear")
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def load_config(g: "GGUFFile") -> "DecoderConfig":
    """The DecoderConfig of this GGUF's architecture (what every engine's decoder runs)."""
    if g.arch not in ARCHITECTURES:
        raise BadInputError(f"kvchat's engines do not run architecture '{g.arch}'")
    module, name = ARCHITECTURES[g.arch]
    return getattr(importlib.import_module(module), name).from_gguf(g)


def load_model(g: "GGUFFile", progress=None, cache_dir: Path | None = None) -> "Decoder":
    """The native engine's Decoder for this GGUF's architecture."""
    from models.transformer import Decoder
    return Decoder(load_config(g), g, progress, cache_dir)
