"""Phi-3 (and Phi-4, which GGUF files also call phi3), following llama.cpp's llm_build_phi3: a llama
layer with its q, k, v in one matrix (attn_qkv: rows q, then k, then v) and its gate and up in
another (ffn_up: 2 * n_ff rows, the gate first), neox rope, and Q times 1/sqrtf(head_dim) after rope
instead of scaling the scores. llama.cpp switches Phi-3's sliding window off, and so do we.

LongRoPE (the 128k models, Phi-3.5, Phi-4-mini): the file carries two sets of per-pair factors,
rope_factors_short and rope_factors_long, the context they were trained for
(rope.scaling.original_context_length) and a magnitude factor for cos and sin
(rope.scaling.attn_factor, sqrt(1 + ln(scale) / ln(original context)) from the converter). Which set
runs depends on the context the engine is made with (DecoderConfig.for_context)."""
from __future__ import annotations

from dataclasses import dataclass

from kernels.cpu.libm import inv_sqrtf
from models.architectures import LONGROPE_TENSORS
from models.gguf_file import GGUFFile
from models.transformer import DecoderConfig, rope_factors


@dataclass(frozen=True)
class Phi3Config(DecoderConfig):
    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Phi3Config":
        c = cls.common_from_gguf(g)
        longrope = ()
        if any(name in g.tensors for name in LONGROPE_TENSORS):
            long, short = (rope_factors(g, name, c["n_rot"]) for name in LONGROPE_TENSORS)
            n_ctx_orig = int(g.arch_get("rope.scaling.original_context_length") or c["n_ctx_train"])
            longrope = (short, long, n_ctx_orig)
        return cls(**c, rope_neox=True, activation="swiglu", attn_scale=float(inv_sqrtf(c["head_dim"])),
                   scale_q=True, longrope=longrope)
