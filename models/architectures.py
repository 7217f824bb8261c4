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
    "smollm3": ("models.smollm3", "SmolLM3Config"),
    "ernie4_5": ("models.ernie4_5", "Ernie45Config"),
    "granite": ("models.granite", "GraniteConfig"),
    "exaone": ("models.exaone", "ExaoneConfig"),
    "gemma": ("models.gemma", "GemmaConfig"),
    "mistral3": ("models.mistral3", "Mistral3Config"),
    "qwen3vl": ("models.qwen3vl", "Qwen3VLConfig"),
    # the mixture-of-experts variants whose config is their dense twin's (the experts are data:
    # DecoderConfig.n_expert, kernels.cpu.moe)
    "qwen3moe": ("models.qwen3", "Qwen3Config"),
    "qwen3vlmoe": ("models.qwen3vl", "Qwen3VLConfig"),
    "granitemoe": ("models.granite", "GraniteConfig"),
}

# rope.scaling.type values the engines run (llama.cpp's names): "linear" scales every angle by
# 1 / rope.scaling.factor; "yarn" mixes scaled and unscaled angles along the rotary pairs and scales
# cos and sin (kernels.cpu.rope_table, models.transformer.DecoderConfig.rope_scaling).
ROPE_SCALING_TYPES = ("none", "linear", "yarn")
# LongRoPE's factor tensors: phi3 runs them (models.phi3); llama.cpp reads them in no other
# architecture we run but llama with rope.scaling.type "longrope", which we do not.
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
LONGROPE_ARCHS = ("phi3",)
# Architectures whose Q llama.cpp scales by an attention temperature that grows with the position
# (GGUFFile.attn_temperature_floor)
ATTN_TEMPERATURE_ARCHS = ("mistral3",)
# Architectures whose layers llama.cpp runs as a mixture of experts (build_moe_ffn with softmax
# gating, the selected weights normalized, SwiGLU experts) when the file has `expert_count`: Mixtral
# (llama), Qwen3-MoE, Granite MoE, and the others' MoE files. Their layers may carry EXPERT_TENSORS.
MOE_ARCHS = ("llama", "granite", "granitemoe", "mistral3", "qwen3moe", "qwen3vlmoe")
EXPERT_TENSORS = frozenset({"ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"})
# Every tensor the engines read (a layer's as blk.N.<name>). A file with any other (biases of the
# output projection or the FFN, shared experts) would run without it
# and compute something else than llama.cpp does, so it is refused (and --backend auto hands it to
# llama.cpp).
KNOWN_TENSORS = frozenset({"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight",
                           *LONGROPE_TENSORS})
KNOWN_LAYER_TENSORS = frozenset({
    "attn_norm.weight", "attn_qkv.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q.bias",
    "attn_k.bias", "attn_v.bias", "attn_q_norm.weight", "attn_k_norm.weight", "attn_output.weight",
    "post_attention_norm.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
    "post_ffw_norm.weight"})


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
