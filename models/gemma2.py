"""Gemma 2, following llama.cpp's llm_build_gemma2 (the truth for every quirk):

- embeddings scaled by sqrt(n_embd); RMSNorm weights used as stored (the converter wrote 1 + w);
- norms after attention and after the MLP; GeGLU (tanh gelu) MLP; neox rope; no Q/K norm;
- sliding-window attention on every other layer (layer il is local iff il % 2 == 0; or as
  `gemma2.attention.sliding_window_pattern` says, models.transformer.swa_layers), window
  `gemma2.attention.sliding_window` (4096 when absent), one rope base (and rope scaling) for all
  layers unless the file gives `rope.freq_base_swa`;
- Q times 1/sqrt(key_length) before attention (the 27B, 46 layers: 1/sqrt(n_embd / n_head));
- the attention scores soft-capped, s = cap * tanh(s / cap) before the softmax, cap
  `gemma2.attn_logit_softcapping` (50 when absent), and so the logits, cap
  `gemma2.final_logit_softcapping` (30 when absent);
- output tied to token_embd.
"""
from __future__ import annotations

from dataclasses import dataclass

from kernels.cpu.libm import inv_sqrtf, sqrtf
from models.gguf_file import GGUFFile
from models.transformer import DecoderConfig, swa_layers

SWA_PATTERN = 2
DEFAULT_WINDOW = 4096
DEFAULT_ATTN_SOFTCAP, DEFAULT_FINAL_SOFTCAP = 50.0, 30.0      # llama_hparams' defaults


def gemma_family(c: dict, n_layer_27b: int) -> dict:
    """What Gemma 2 and Gemma 3 share (and Gemma 1, models.gemma, without the post-norms): neox rope,
    post-norms, GeGLU, embeddings times sqrt(n_embd), and Q times 1/sqrt(key_length) before
    attention, 1/sqrt(n_embd / n_head) for the 27B (the model with n_layer_27b layers)."""
    pre_attn = c["n_embd"] // c["n_head"] if c["n_layer"] == n_layer_27b else c["head_dim"]
    return dict(rope_neox=True, post_norms=True, activation="geglu_tanh", embed_scale=float(sqrtf(c["n_embd"])),
                attn_scale=float(inv_sqrtf(pre_attn)), scale_q=True)


@dataclass(frozen=True)
class Gemma2Config(DecoderConfig):
    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Gemma2Config":
        c = cls.common_from_gguf(g)
        return cls(**c, **gemma_family(c, 46),
                   sliding_window=int(g.arch_get("attention.sliding_window") or DEFAULT_WINDOW),
                   local_layers=swa_layers(g, c["n_layer"], SWA_PATTERN),
                   rope_base_local=float(g.arch_get("rope.freq_base_swa") or c["rope_base"]),
                   attn_softcap=float(g.arch_get("attn_logit_softcapping") or DEFAULT_ATTN_SOFTCAP),
                   final_softcap=float(g.arch_get("final_logit_softcapping") or DEFAULT_FINAL_SOFTCAP))
