"""Qwen3 (dense), following llama.cpp's llm_build_qwen3: llama's layer without q/k/v biases, with a
per-head RMSNorm of Q and of K (attn_q_norm, attn_k_norm, the model's RMS epsilon) before neox rope.
The head size is `qwen3.attention.key_length` (128 in every Qwen3), not n_embd / n_head.

qwen3moe (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B) is this config with a mixture of
experts in every layer (llm_build_qwen3moe: `expert_count`, `expert_used_count`; kernels.cpu.moe)."""
from __future__ import annotations

from dataclasses import dataclass

from models.gguf_file import GGUFFile
from models.transformer import DecoderConfig


@dataclass(frozen=True)
class Qwen3Config(DecoderConfig):
    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Qwen3Config":
        return cls(**cls.common_from_gguf(g), rope_neox=True, qk_norm=True, activation="swiglu")
