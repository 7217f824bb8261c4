"""The decoder of llama, qwen2 and gemma3 on torch tensors: the torch engine's forward pass.

The same `DecoderConfig` as the native engine (models.transformer) describes each architecture;
this file runs it with the Triton kernels of kernels.cuda on any torch device. On the CPU (tests,
CI, a machine without a GPU) the kernels run in Triton's interpreter, which core.torch_backend
switches on before it imports this module (and with it triton).

- Weights: a matrix whose GGUF type has a Triton dequant-GEMV kernel stays quantized (its GGUF
  bytes as a uint8 tensor), and decode rows read it with dequant_gemv. Prompts (and every matrix
  of a type without a kernel) multiply a dequantized copy with torch.matmul (fp16 on CUDA, fp32 on
  the CPU), made once at load.
- KV cache: one float16 tensor per layer for K and for V, (n_blocks, block_size, Hkv, hd), paged
  by the block tables of core.kv_cache.
- Attention: the Triton kernels (flash prefill over the paged cache, split-KV flash decoding).

Shapes: T tokens, D = n_embd, Hq / Hkv query / kv heads, hd = head_dim.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kernels.cpu import dequantize
from kernels.cuda import GEMV_TYPES
from kernels.cuda.attention import attention_decode, attention_prefill, write_kv
from kernels.cuda.dequant_gemv import dequant_gemv
from kernels.cuda.norm_rope import norm_rope, rms_norm, rope
from models.gguf_file import GGUFFile
from models.transformer import DecoderConfig

# Rows of a forward pass up to which matrices with a GEMV kernel are read quantized (decode, a
# speculative check, a small batch step); more rows multiply the dequantized copy.
GEMV_MAX_ROWS = 8
# Triton's interpreter (the CPU device) runs a kernel as numpy operations on whole tiles, so the
# GEMV costs tens of numpy operations per weight: there only matrices up to this many weights take
# it (all of the tests' tiny models), the rest multiply the dequantized copy.
INTERPRETED_GEMV_MAX_WEIGHTS = 1 << 18


class TorchMatrix:
    """One weight matrix (N rows of K) on the device: its GGUF blocks for dequant_gemv (where that
    kernel takes the type) and a dequantized copy for torch.matmul."""

    def __init__(self, raw: np.ndarray, ggml_type: int, n_rows: int, n_cols: int, device: torch.device,
                 dtype: torch.dtype):
        self.ggml_type, self.n_rows, self.n_cols = int(ggml_type), int(n_rows), int(n_cols)
        self.quantized = None
        small = n_rows * n_cols <= INTERPRETED_GEMV_MAX_WEIGHTS
        if self.ggml_type in GEMV_TYPES and (device.type == "cuda" or small):
            blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(n_rows, -1)
            self.quantized = torch.from_numpy(blocks.copy()).to(device)          # (N, row bytes) uint8
        self.dense = torch.from_numpy(dequantize(raw, self.ggml_type, n_cols)).to(device, dtype)   # (N, K)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, K) -> x @ W.T (M, N) float32."""
        if self.quantized is not None and x.shape[0] <= GEMV_MAX_ROWS:
            return dequant_gemv(self.quantized, self.ggml_type, self.n_cols, x.float())
        return (x.to(self.dense.dtype) @ self.dense.T).float()

    @property
    def nbytes(self) -> int:
        return self.dense.nbytes + (self.quantized.nbytes if self.quantized is not None else 0)


@dataclass
class TorchLayer:
    attn_norm: torch.Tensor
    wq: TorchMatrix
    wk: TorchMatrix
    wv: TorchMatrix
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    wo: TorchMatrix
    post_attn_norm: torch.Tensor | None
    ffn_norm: torch.Tensor
    w_gate: TorchMatrix
    w_up: TorchMatrix
    w_down: TorchMatrix
    post_ffn_norm: torch.Tensor | None
    window: int
    rope_base: float


class TorchDecoder:
    """Token embedding -> n_layer layers -> final norm -> output projection, on one torch device."""

    def __init__(self, cfg: DecoderConfig, g: GGUFFile, device: torch.device, progress=None):
        self.cfg, self.device = cfg, device
        self.dtype = torch.float16 if device.type == "cuda" else torch.float32
        data = {t.name: t.data for t in g.reader.tensors}

        def matrix(name: str) -> TorchMatrix:
            info = g.tensors[name]
            return TorchMatrix(data[name], info.ggml_type, int(np.prod(info.shape[1:])), info.shape[0], device,
                               self.dtype)

        def vector(name: str) -> torch.Tensor | None:
            if name not in g.tensors:
                return None
            return torch.from_numpy(np.array(data[name], np.float32).reshape(-1)).to(device)

        self.tok_embd = matrix("token_embd.weight")
        self.layers: list[TorchLayer] = []
        for il in range(cfg.n_layer):
            p = f"blk.{il}."
            self.layers.append(TorchLayer(
                vector(p + "attn_norm.weight"), *(matrix(p + f"attn_{n}.weight") for n in "qkv"),
                *(vector(p + f"attn_{n}.bias") for n in "qkv"),
                vector(p + "attn_q_norm.weight") if cfg.qk_norm else None,
                vector(p + "attn_k_norm.weight") if cfg.qk_norm else None,
                matrix(p + "attn_output.weight"),
                vector(p + "post_attention_norm.weight") if cfg.post_norms else None,
                vector(p + "ffn_norm.weight"), matrix(p + "ffn_gate.weight"), matrix(p + "ffn_up.weight"),
                matrix(p + "ffn_down.weight"),
                vector(p + "post_ffw_norm.weight") if cfg.post_norms else None,
                cfg.layer_window[il], cfg.layer_rope_base[il]))
            if progress:
                progress("loading weights", il + 1, cfg.n_layer)
        self.output_norm = vector("output_norm.weight")
        self.output = matrix("output.weight") if "output.weight" in g.tensors else self.tok_embd

    @property
    def nbytes(self) -> int:
        mats = [self.tok_embd] + ([self.output] if self.output is not self.tok_embd else [])
        mats += [m for layer in self.layers for m in (layer.wq, layer.wk, layer.wv, layer.wo, layer.w_gate,
                                                      layer.w_up, layer.w_down)]
        return sum(m.nbytes for m in mats)

    def new_cache(self, n_blocks: int, block_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K and V, per layer (n_blocks, block_size, Hkv, hd) float16 on the device."""
        cfg = self.cfg
        shape = (n_blocks, block_size, cfg.n_head_kv, cfg.head_dim)
        new = lambda: [torch.zeros(shape, dtype=torch.float16, device=self.device) for _ in range(cfg.n_layer)]  # noqa: E731
        return new(), new()

    def forward(self, tokens: Sequence[int], segments: Sequence[tuple], all_rows: bool = False) -> torch.Tensor:
        """tokens (T,) in segment order; segments (kv, start_pos, n_tokens): a sequence of
        core.kv_cache whose cache slots for these tokens are held (kv.k_cache[il] are this model's
        tensors). Returns float32 logits: every row (T, n_vocab) with all_rows, else each
        segment's last row (len(segments), n_vocab)."""
        cfg, dev = self.cfg, self.device
        T, Hq, Hkv, hd = len(tokens), cfg.n_head, cfg.n_head_kv, cfg.head_dim
        ids = torch.as_tensor(np.asarray(tokens, np.int64), device=dev)
        x = self.tok_embd.dense[ids].float()                                      # (T, D)
        if cfg.embed_scale != 1.0:
            x = x * cfg.embed_scale
        positions = torch.cat([torch.arange(s, s + n, device=dev) for _, s, n in segments])
        tables = [torch.as_tensor(kv.block_table, device=dev) for kv, _, _ in segments]
        q_scale, kq_scale = (cfg.attn_scale, 1.0) if cfg.scale_q else (1.0, cfg.attn_scale)
        for il, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, cfg.norm_eps)
            q, k, v = layer.wq(h), layer.wk(h), layer.wv(h)                        # (T, Hq*hd), (T, Hkv*hd) x2
            if layer.bq is not None:
                q, k, v = q + layer.bq, k + layer.bk, v + layer.bv
            q = norm_rope(q.view(T, Hq, hd), layer.q_norm, cfg.norm_eps, positions, layer.rope_base,
                          cfg.rope_neox, cfg.n_rot) if layer.q_norm is not None else \
                rope(q.view(T, Hq, hd), positions, layer.rope_base, cfg.rope_neox, cfg.n_rot)
            k = norm_rope(k.view(T, Hkv, hd), layer.k_norm, cfg.norm_eps, positions, layer.rope_base,
                          cfg.rope_neox, cfg.n_rot) if layer.k_norm is not None else \
                rope(k.view(T, Hkv, hd), positions, layer.rope_base, cfg.rope_neox, cfg.n_rot)
            if q_scale != 1.0:
                q = q * q_scale
            q = q.to(torch.float16)   # tl.dot takes q in the cache's dtype (llama.cpp too rounds q to f16)
            v = v.view(T, Hkv, hd)
            o = torch.empty(T, Hq, hd, dtype=torch.float32, device=dev)
            row = 0
            for (kv, start, n), table in zip(segments, tables):
                kc, vc = kv.k_cache[il], kv.v_cache[il]
                rows = slice(row, row + n)
                write_kv(kc, vc, table, start, k[rows], v[rows])
                if n == 1:
                    seq_len = torch.tensor([start + 1], dtype=torch.int32, device=dev)
                    o[rows] = attention_decode(q[rows], kc, vc, table.view(1, -1), seq_len, kq_scale, layer.window)
                else:
                    o[rows] = attention_prefill(q[rows].contiguous(), kc, vc, table, start, kq_scale, layer.window)
                row += n
            o = layer.wo(o.reshape(T, Hq * hd))
            if layer.post_attn_norm is not None:
                o = rms_norm(o, layer.post_attn_norm, cfg.norm_eps)
            x = x + o
            h = rms_norm(x, layer.ffn_norm, cfg.norm_eps)
            gate, up = layer.w_gate(h), layer.w_up(h)                              # (T, F) x2
            act = (torch.nn.functional.gelu(gate, approximate="tanh") if cfg.activation == "geglu_tanh"
                   else torch.nn.functional.silu(gate))
            d = layer.w_down(act * up)
            if layer.post_ffn_norm is not None:
                d = rms_norm(d, layer.post_ffn_norm, cfg.norm_eps)
            x = x + d
        if not all_rows:
            ends = torch.as_tensor(np.cumsum([n for _, _, n in segments]) - 1, device=dev)
            x = x[ends]
        return self.output(rms_norm(x, self.output_norm, cfg.norm_eps))          # (rows, n_vocab)

