"""Gemma 3, following llama.cpp's llm_build_gemma3 (the truth for every quirk):

- embeddings scaled by sqrt(n_embd);
- RMSNorm weights are used as stored: the GGUF converter already wrote (1 + w);
- per-head RMSNorm of Q and K before rope, norms after attention and after the MLP;
- GeGLU (tanh gelu) MLP; neox rope;
- sliding-window attention on 5 of every 6 layers (hparams.set_swa_pattern(6): layer il is local
  iff il % 6 < 5; or as `gemma3.attention.sliding_window_pattern` says, models.transformer.swa_layers),
  window `gemma3.attention.sliding_window` (none when absent: every layer global); local layers use rope base 10000
  (rope_freq_base_train_swa), global ones `gemma3.rope.freq_base`; the 4B, 12B and 27B files'
  linear rope scaling (factor 8) applies to the global layers only (the local layers'
  rope_freq_scale_train_swa stays 1);
- attention scale 1/sqrt(key_length) (query_pre_attn_scalar = head_dim), except the 27B
  (62 layers) which uses 1/sqrt(n_embd / n_head), applied to Q before attention (ggml_scale),
  not to the scores;
- the logits soft-capped as gemma2's when the file gives `gemma3.final_logit_softcapping` (none do
  but fine-tunes may);
- output tied to token_embd when the GGUF has no output.weight.
"""
from __future__ import annotations

from dataclasses import dataclass

from models.gemma2 import gemma_family
from models.gguf_file import GGUFFile
from models.transformer import DecoderConfig, swa_layers

SWA_PATTERN = 6
ROPE_BASE_LOCAL = 10000.0


@dataclass(frozen=True)
class Gemma3Config(DecoderConfig):
    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Gemma3Config":
        c = cls.common_from_gguf(g)
        return cls(**c, **gemma_family(c, 62), qk_norm=True,
                   sliding_window=int(g.arch_get("attention.sliding_window") or 0),
                   local_layers=swa_layers(g, c["n_layer"], SWA_PATTERN),
                   final_softcap=float(g.arch_get("final_logit_softcapping") or 0.0),
                   rope_base_local=float(g.arch_get("rope.freq_base_swa") or ROPE_BASE_LOCAL),
                   rope_freq_scale_local=1.0)

