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
# 1 / rope.scaling.factor. YaRN is not built yet (GGUFFile.unsupported says so).
ROPE_SCALING_TYPES = ("none", "linear")
# LongRoPE's factor tensors: phi3 runs them (models.phi3); llama.cpp reads them in no other
# architecture we run but llama with rope.scaling.type "longrope", which we do not.
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
LONGROPE_ARCHS = ("phi3",)


def load_config(g: "GGUFFile", n_ctx: int | None = None) -> "DecoderConfig":
    """The DecoderConfig of this GGUF's architecture (what every engine's decoder runs), for a
    context of n_ctx tokens when given (DecoderConfig.for_context: LongRoPE's factors depend on it)."""
    if g.arch not in ARCHITECTURES:
        raise BadInputError(f"kvchat's engines do not run architecture '{g.arch}'")
    module, name = ARCHITECTURES[g.arch]
    cfg = getattr(importlib.import_module(module), name).from_gguf(g)
    return cfg if n_ctx is None else cfg.for_context(n_ctx)


def load_model(g: "GGUFFile", progress=None, cache_dir: Path | None = None, n_ctx: int | None = None) -> "Decoder":
    """The native engine's Decoder for this GGUF's architecture (for a context of n_ctx tokens)."""
    from models.transformer import Decoder
    return Decoder(load_config(g, n_ctx), g, progress, cache_dir)
