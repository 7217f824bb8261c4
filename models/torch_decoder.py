"""The torch engine's forward pass: every architecture models.transformer runs, on torch tensors.

The same `DecoderConfig` as the native engine (models.transformer) describes each architecture;
this file runs it with the Triton kernels of kernels.cuda on any torch device. On the CPU (tests,
CI, a machine without a GPU) the kernels run in Triton's interpreter, which core.torch_backend
switches on before it imports this module (and with it triton).

- Weights: a matrix whose GGUF type has Triton kernels (kernels.cuda.GEMV_TYPES) stays quantized
  (its GGUF bytes as a uint8 tensor): decode rows read it with dequant_gemv, and a prompt
  dequantizes it into one scratch buffer shared by all matrices (the largest one's size) and
  multiplies with torch.matmul (fp16 on CUDA). Only types without those kernels keep a dequantized
  copy, made once at load. So device memory is about the file's size plus the KV cache.
- KV cache: one float16 tensor per layer for K and for V, (n_blocks, block_size, Hkv, hd), paged
  by the block tables of core.kv_cache.
- Attention: the Triton kernels (flash prefill over the paged cache, split-KV flash decoding).
- Decode steps (one new token per sequence) run as one batched step on fixed-shape inputs, which
  DecodeGraphs captures in CUDA graphs per batch size on a GPU; padding rows of a captured batch
  write and read only the cache's extra pad block.

Shapes: T tokens, D = n_embd, Hq / Hkv query / kv heads, hd = head_dim.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kernels.cpu import dequantize
from kernels.cuda import GEMV_TYPES
from kernels.cuda.attention import attention_decode, attention_prefill, write_kv
from kernels.cuda.dequant import dequantize_rows
from kernels.cuda.dequant_gemv import dequant_gemv
from kernels.cuda.norm_rope import norm_rope, rms_norm, rope
from models.gguf_file import GGUFFile
from models.transformer import DecoderConfig

# Rows of a forward pass up to which quantized matrices are read by the GEMV kernel (decode, a
# speculative check, a small batch step); more rows dequantize the matrix and use torch.matmul.
GEMV_MAX_ROWS = 8
# Triton's interpreter (the CPU device) runs a kernel as numpy operations on whole tiles, so its
# kernels cost tens of numpy operations per weight: there only matrices up to this many weights
# stay quantized (all of the tests' tiny models); bigger ones keep a dense copy made at load.
INTERPRETED_GEMV_MAX_WEIGHTS = 1 << 18
# The batch sizes whose decode step is captured in a CUDA graph (a batch is padded to the next).
GRAPH_BATCHES = (1, 2, 4, 8, 16, 32)


FP16_ROW_MAX = 2.0 ** 15   # a row of activations is scaled below this before it is rounded to float16


def fp16_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float32 -> (x / scale as float16, scale (M, 1)) for a float16 matrix product.

    Why: an FFN's down projection takes gate * up, which can pass float16's 65504 (it did in the
    tests' random models on a GPU); rounded as is it becomes inf, and the KV cache fills with NaN.
    scale is a power of two per row, 1 where the row fits, so dividing is exact: rows that fit are
    rounded as before, and rows that do not keep float16's 11 bits. Nothing is read back to the
    host, so a CUDA graph can capture it."""
    amax = x.abs().amax(1, keepdim=True)                                            # (M, 1)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP16_ROW_MAX)).clamp(min=0.0))  # (M, 1), 1 if it fits
    return (x / scale).to(torch.float16), scale


class Scratch:
    """One device buffer that prompts dequantize quantized matrices into, one matrix at a time."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None

    def matrix(self, n_rows: int, n_cols: int) -> torch.Tensor:
        return self.buffer[:n_rows * n_cols].view(n_rows, n_cols)


class TorchMatrix:
    """One weight matrix (N rows of K) on the device: its GGUF blocks where the Triton kernels read
    the type (quantized), else a dequantized copy (dense)."""

    def __init__(self, raw: np.ndarray, ggml_type: int, n_rows: int, n_cols: int, device: torch.device,
                 dtype: torch.dtype, scratch: Scratch, interpreted_gemv: bool = True, dense: bool = False):
        """interpreted_gemv: whether a small matrix on the CPU device stays quantized (the Triton
        kernels in the interpreter); an expert does not: a layer calls three per routed expert.
        dense: a dequantized copy whatever the type (a router, in float32: llama.cpp routes in
        float32, and a float16 router's rounding can swap two experts of near probability)."""
        self.ggml_type, self.n_rows, self.n_cols = int(ggml_type), int(n_rows), int(n_cols)
        self.dtype, self.scratch = dtype, scratch
        self.quantized = self.dense = None
        small = interpreted_gemv and n_rows * n_cols <= INTERPRETED_GEMV_MAX_WEIGHTS
        if self.ggml_type in GEMV_TYPES and (device.type == "cuda" or small) and not dense:
            blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(n_rows, -1)
            self.quantized = torch.from_numpy(blocks.copy()).to(device)          # (N, row bytes) uint8
        else:
            self.dense = torch.from_numpy(dequantize(raw, self.ggml_type, n_cols)).to(device, dtype)   # (N, K)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, K) -> x @ W.T (M, N) float32."""
        if self.quantized is None:
            w = self.dense
        elif x.shape[0] <= GEMV_MAX_ROWS:
            return dequant_gemv(self.quantized, self.ggml_type, self.n_cols, x.float())
        else:
            w = dequantize_rows(self.quantized, self.ggml_type, self.n_cols, dtype=self.dtype,
                                out=self.scratch.matrix(self.n_rows, self.n_cols))
        if w.dtype == torch.float16:     # float32 out: a float16 product overflows past 65504
            x16, scale = fp16_rows(x)
            if w.is_cuda:
                return torch.mm(x16, w.T, out_dtype=torch.float32) * scale
            # the CPU has no float16 mm with float32 out: the same exact products of float16
            # values, summed in float32 (cuBLAS sums them in another order)
            return (x16.float() @ w.float().T) * scale
        return (x.to(w.dtype) @ w.T).float()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ids (T,) as float32 (T, K): an embedding lookup."""
        if self.quantized is None:
            return self.dense[ids].float()
        return dequantize_rows(self.quantized, self.ggml_type, self.n_cols, rows=ids, dtype=torch.float32)

    @property
    def nbytes(self) -> int:
        return (self.dense if self.quantized is None else self.quantized).nbytes

    def split(self, sizes: Sequence[int]) -> list["TorchMatrix"]:
        """Consecutive row blocks of these sizes as matrices of their own, sharing this one's storage
        (a file's fused matrix: phi3's attn_qkv, ffn_up). Quantized rows are whole blocks: a row
        range of the uint8 tensor is a matrix of its own."""
        parts, r0 = [], 0
        for n in sizes:
            part = copy.copy(self)
            part.n_rows = int(n)
            if self.quantized is None:
                part.dense = self.dense[r0:r0 + n]
            else:
                part.quantized = self.quantized[r0:r0 + n]
            parts.append(part)
            r0 += n
        return parts


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
    w_gate: TorchMatrix | None                # (None in a mixture of experts' layer)
    w_up: TorchMatrix | None
    w_down: TorchMatrix | None
    post_ffn_norm: torch.Tensor | None
    window: int
    rope: tuple[float, float]                 # (base, freq_scale)
    router: TorchMatrix | None = None         # a mixture of experts: the router (E rows) and each expert's
    experts: tuple = ()                       # gate, up and down matrices: three lists of E


class TorchDecoder:
    """Token embedding -> n_layer layers -> final norm -> output projection, on one torch device."""

    def __init__(self, cfg: DecoderConfig, g: GGUFFile, device: torch.device, progress=None,
                 float16: bool | None = None):
        """float16: dense and dequantized weights in float16, and prompts' products on float16
        rows, as on CUDA (None: on CUDA only). On the CPU it gives a GPU run's roundings, the
        reference a GPU test compares with."""
        self.cfg, self.device = cfg, device
        self.dtype = torch.float16 if (device.type == "cuda" if float16 is None else float16) else torch.float32
        data = {t.name: t.data for t in g.reader.tensors}
        self.scratch = Scratch()

        def matrix(name: str, dtype: torch.dtype | None = None) -> TorchMatrix:
            """dtype: a dense copy of this dtype (the router's float32), else the engine's choice."""
            info = g.tensors[name]
            return TorchMatrix(data[name], info.ggml_type, int(np.prod(info.shape[1:])), info.shape[0], device,
                               dtype or self.dtype, self.scratch, dense=dtype is not None)

        def experts(name: str) -> list[TorchMatrix]:
            info = g.tensors[name]                        # ggml (K, N, E): E matrices of N rows of K
            return [TorchMatrix(data[name][e], info.ggml_type, info.shape[1], info.shape[0], device, self.dtype,
                                self.scratch, interpreted_gemv=False) for e in range(info.shape[2])]

        def vector(name: str) -> torch.Tensor | None:
            if name not in g.tensors:
                return None
            return torch.from_numpy(np.array(data[name], np.float32).reshape(-1)).to(device)

        self.tok_embd = matrix("token_embd.weight")
        self.layers: list[TorchLayer] = []
        for il in range(cfg.n_layer):
            p = f"blk.{il}."
            qd, kvd = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
            qkv = (matrix(p + "attn_qkv.weight").split((qd, kvd, kvd)) if p + "attn_qkv.weight" in g.tensors
                   else [matrix(p + f"attn_{n}.weight") for n in "qkv"])          # (phi3: one matrix)
            moe = cfg.n_expert > 0
            gate_up = ([None, None] if moe else
                       [matrix(p + "ffn_gate.weight"), matrix(p + "ffn_up.weight")] if p + "ffn_gate.weight" in g.tensors
                       else matrix(p + "ffn_up.weight").split((cfg.n_ff, cfg.n_ff)))   # (phi3: gate, then up)
            self.layers.append(TorchLayer(
                vector(p + "attn_norm.weight"), *qkv,
                *(vector(p + f"attn_{n}.bias") for n in "qkv"),
                vector(p + "attn_q_norm.weight") if cfg.qk_norm else None,
                vector(p + "attn_k_norm.weight") if cfg.qk_norm else None,
                matrix(p + "attn_output.weight"),
                vector(p + "post_attention_norm.weight") if cfg.post_norms else None,
                vector(p + "ffn_norm.weight"), *gate_up,
                None if moe else matrix(p + "ffn_down.weight"),
                vector(p + "post_ffw_norm.weight") if cfg.post_norms else None,
                cfg.layer_window[il], cfg.layer_rope[il],
                matrix(p + "ffn_gate_inp.weight", torch.float32) if moe else None,
                tuple(experts(p + f"ffn_{n}_exps.weight") for n in ("gate", "up", "down")) if moe else ()))
            if progress:
                progress("loading weights", il + 1, cfg.n_layer)
        self.rope_factors = (torch.tensor(cfg.rope_freq_factors, dtype=torch.float32, device=device)
                             if cfg.rope_freq_factors else None)                     # (n_rot/2,) Llama 3, LongRoPE
        self.output_norm = vector("output_norm.weight")
        self.output = matrix("output.weight") if "output.weight" in g.tensors else self.tok_embd
        biggest = max((m.n_rows * m.n_cols for m in self.matrices() if m.quantized is not None), default=0)
        self.scratch.buffer = torch.empty(biggest, dtype=self.dtype, device=device)

    def matrices(self):
        yield self.tok_embd
        if self.output is not self.tok_embd:
            yield self.output
        for layer in self.layers:
            yield from (layer.wq, layer.wk, layer.wv, layer.wo)
            if layer.router is None:
                yield from (layer.w_gate, layer.w_up, layer.w_down)
            else:
                yield layer.router
                for matrices in layer.experts:
                    yield from matrices

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.matrices())

    def new_cache(self, n_blocks: int, block_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K and V, per layer (n_blocks + 1, block_size, Hkv, hd) float16 on the device. The extra
        last block, which the cache's pool never hands out, is where padding rows of a decode
        step write and read (see decode_inputs)."""
        cfg = self.cfg
        shape = (n_blocks + 1, block_size, cfg.n_head_kv, cfg.head_dim)
        new = lambda: [torch.zeros(shape, dtype=torch.float16, device=self.device) for _ in range(cfg.n_layer)]  # noqa: E731
        return new(), new()

    def _layer(self, layer: TorchLayer, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """One decoder layer on x (T, D) at positions (T,); attend(q (T, Hq, hd) fp16, k, v (T, Hkv, hd))
        stores k and v in the cache and returns attention's output (T, Hq, hd)."""
        cfg = self.cfg
        T, Hq, Hkv, hd = x.shape[0], cfg.n_head, cfg.n_head_kv, cfg.head_dim
        h = rms_norm(x, layer.attn_norm, cfg.norm_eps)
        q, k, v = layer.wq(h), layer.wk(h), layer.wv(h)                            # (T, Hq*hd), (T, Hkv*hd) x2
        if layer.bq is not None:
            q, k, v = q + layer.bq, k + layer.bk, v + layer.bv
        rope_args = (positions, layer.rope[0], cfg.rope_neox, cfg.n_rot)
        rope_scaling = {**cfg.rope_scaling(*layer.rope), "freq_factors": self.rope_factors}   # (factors on the device)
        q = norm_rope(q.view(T, Hq, hd), layer.q_norm, cfg.norm_eps, *rope_args, **rope_scaling)   # (no q_norm: rope)
        k = norm_rope(k.view(T, Hkv, hd), layer.k_norm, cfg.norm_eps, *rope_args, **rope_scaling)
        if cfg.scale_q:
            q = q * cfg.attn_scale
        q = q.to(torch.float16)   # tl.dot takes q in the cache's dtype (llama.cpp too rounds q to f16)
        o = attend(q, k, v.view(T, Hkv, hd))                                       # (T, Hq, hd)
        o = layer.wo(o.reshape(T, Hq * hd))
        if layer.post_attn_norm is not None:
            o = rms_norm(o, layer.post_attn_norm, cfg.norm_eps)
        if cfg.residual_scale:
            o = o * cfg.residual_scale
        x = x + o
        h = rms_norm(x, layer.ffn_norm, cfg.norm_eps)
        if layer.router is not None:
            d = self._experts(layer, h)
        else:
            gate, up = layer.w_gate(h), layer.w_up(h)                              # (T, F) x2
            act = (torch.nn.functional.gelu(gate, approximate="tanh") if cfg.activation == "geglu_tanh"
                   else torch.nn.functional.silu(gate))
            d = layer.w_down(act * up)
        if layer.post_ffn_norm is not None:
            d = rms_norm(d, layer.post_ffn_norm, cfg.norm_eps)
        if cfg.residual_scale:
            d = d * cfg.residual_scale
        return x + d

    def _experts(self, layer: TorchLayer, h: torch.Tensor) -> torch.Tensor:
        """A mixture of experts' FFN on h (T, D), as llama.cpp's build_moe_ffn (kernels.cpu.moe):
        softmax over the router's logits, the n_used most probable experts, their probabilities
        divided by their sum (clamped as ggml does), each expert's SwiGLU on the rows routed to it,
        the weighted outputs added in order of probability. The host reads which experts run (one
        sync per layer), so these decode steps run eagerly, not from CUDA graphs."""
        k = self.cfg.n_expert_used
        probs = torch.softmax(layer.router(h), dim=-1)                             # (T, E)
        wts, sel = probs.topk(k, dim=-1)                                           # (T, k) most probable first
        wts = wts / wts.sum(-1, keepdim=True).clamp(min=6.103515625e-5)
        out = torch.zeros((h.shape[0], k, h.shape[1]), dtype=torch.float32, device=h.device)   # (T, k, D)
        gate, up, down = layer.experts
        for e in torch.unique(sel).tolist():
            rows, slots = (sel == e).nonzero(as_tuple=True)                        # (n,) each
            x = h[rows]
            out[rows, slots] = down[e](torch.nn.functional.silu(gate[e](x)) * up[e](x)) * wts[rows, slots, None]
        moe = out[:, 0]
        for j in range(1, k):
            moe = moe + out[:, j]
        return moe                                                                 # (T, D)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embd.rows(ids)                                                # (T, D)
        return x * self.cfg.embed_scale if self.cfg.embed_scale != 1.0 else x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and output matrix: (R, D) -> (R, n_vocab) float32, soft-capped (gemma2)."""
        logits = self.output(rms_norm(x, self.output_norm, self.cfg.norm_eps))
        if self.cfg.logit_scale:
            logits = logits * float(self.cfg.logit_multiplier)
        cap = self.cfg.final_softcap
        return cap * torch.tanh(logits * (1.0 / cap)) if cap > 0 else logits

    def _kq_scale(self) -> float:
        return 1.0 if self.cfg.scale_q else self.cfg.attn_scale

    def forward(self, tokens: Sequence[int], segments: Sequence[tuple], all_rows: bool = False) -> torch.Tensor:
        """tokens (T,) in segment order; segments (kv, start_pos, n_tokens): a sequence of
        core.kv_cache whose cache slots for these tokens are held (kv.k_cache[il] are this model's
        tensors). Returns float32 logits: every row (T, n_vocab) with all_rows, else each
        segment's last row (len(segments), n_vocab). A step of one token per sequence is a
        decode_step."""
        if all(n == 1 for _, _, n in segments):
            kv = segments[0][0]
            return self.decode_step(*self.decode_inputs(tokens, segments), kv.k_cache, kv.v_cache)
        dev = self.device
        ids = torch.as_tensor(np.asarray(tokens, np.int64), device=dev)
        positions = torch.cat([torch.arange(s, s + n, device=dev) for _, s, n in segments])
        tables = [torch.as_tensor(kv.block_table, device=dev) for kv, _, _ in segments]
        x = self._embed(ids)
        for il, layer in enumerate(self.layers):
            def attend(q, k, v):
                o = torch.empty(q.shape, dtype=torch.float32, device=dev)
                row = 0
                for (kv, start, n), table in zip(segments, tables):   # each sequence its own paged cache
                    kc, vc, rows = kv.k_cache[il], kv.v_cache[il], slice(row, row + n)
                    write_kv(kc, vc, table, start, k[rows], v[rows])
                    o[rows] = attention_prefill(q[rows].contiguous(), kc, vc, table, start, self._kq_scale(),
                                                layer.window, softcap=self.cfg.attn_softcap)
                    row += n
                return o
            x = self._layer(layer, x, positions, attend)
        if not all_rows:
            ends = torch.as_tensor(np.cumsum([n for _, _, n in segments]) - 1, device=dev)
            x = x[ends]
        return self._logits(x)                                                     # (rows, n_vocab)

    def decode_inputs(self, tokens: Sequence[int], segments: Sequence[tuple], batch: int | None = None,
                      width: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode step's inputs on the device: ids (B,) int64, positions (B,) int64 and block
        tables (B, width) int32, padded to `batch` rows (and `width` blocks) with rows at position
        0 of the cache's pad block (its last: new_cache), which no sequence owns."""
        kv = segments[0][0]
        pad = kv.k_cache[0].shape[0] - 1
        B = batch or len(segments)
        width = width or max(len(s[0].block_table) for s in segments)
        tables = np.full((B, width), pad, np.int32)
        positions = np.zeros(B, np.int64)
        ids = np.zeros(B, np.int64)
        for i, (seq, start, _) in enumerate(segments):
            tables[i, :len(seq.block_table)] = seq.block_table
            positions[i], ids[i] = start, tokens[i]
        dev = self.device
        return (torch.from_numpy(ids).to(dev), torch.from_numpy(positions).to(dev),
                torch.from_numpy(tables).to(dev))

    def decode_step(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                    k_cache: Sequence[torch.Tensor], v_cache: Sequence[torch.Tensor]) -> torch.Tensor:
        """One new token per sequence: ids, positions (B,), tables (B, W) -> logits (B, n_vocab).
        Every shape is fixed by (B, W) and nothing reads a value back to the host, so a CUDA graph
        can capture it: K and V go to their cells by an index on the device, and attention's split
        count comes from the table width, not from the sequences' lengths."""
        bs = k_cache[0].shape[1]
        seq_lens = (positions + 1).to(torch.int32)                                 # (B,)
        cells = tables.gather(1, (positions // bs).view(-1, 1)).view(-1).long() * bs + positions % bs   # (B,)
        max_kv = tables.shape[1] * bs
        x = self._embed(ids)                                                       # (B, D)
        for il, layer in enumerate(self.layers):
            kc, vc = k_cache[il], v_cache[il]

            def attend(q, k, v):
                kc.view(-1, *kc.shape[2:])[cells] = k.to(kc.dtype)
                vc.view(-1, *vc.shape[2:])[cells] = v.to(vc.dtype)
                return attention_decode(q, kc, vc, tables, seq_lens, self._kq_scale(), layer.window,
                                        max_kv=max_kv, softcap=self.cfg.attn_softcap).float()
            x = self._layer(layer, x, positions, attend)
        return self._logits(x)                                                     # (B, n_vocab)


class DecodeGraphs:
    """Decode steps replayed from CUDA graphs: one graph per batch size of GRAPH_BATCHES (captured
    on first use), on static input buffers of the cache's full table width, so a step launches
    one graph instead of some ten kernels per layer from Python. A batch is padded to the next
    captured size with pad rows (TorchDecoder.decode_inputs). Only on CUDA; bound to one cache's
    tensors (a new cache needs a new DecodeGraphs)."""

    def __init__(self, model: TorchDecoder, k_cache: Sequence[torch.Tensor], v_cache: Sequence[torch.Tensor],
                 n_ctx: int):
        self.model, self.k_cache, self.v_cache = model, k_cache, v_cache
        self.width = -(-n_ctx // k_cache[0].shape[1]) + 1
        self.graphs: dict[int, tuple] = {}          # batch -> (graph, (ids, positions, tables), logits)
        self.pool = torch.cuda.graph_pool_handle()

    def _capture(self, B: int) -> tuple:
        pad = self.k_cache[0].shape[0] - 1
        static = (torch.zeros(B, dtype=torch.int64, device=self.model.device),
                  torch.zeros(B, dtype=torch.int64, device=self.model.device),
                  torch.full((B, self.width), pad, dtype=torch.int32, device=self.model.device))
        step = lambda: self.model.decode_step(*static, self.k_cache, self.v_cache)   # noqa: E731
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                # warm-up: Triton compiles, allocator settles
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = step()
        return graph, static, logits

    def __call__(self, tokens: Sequence[int], segments: Sequence[tuple]) -> torch.Tensor:
        """The logits (len(segments), n_vocab) of a decode step, from a replayed graph."""
        B = next(b for b in GRAPH_BATCHES if b >= len(segments))
        if B not in self.graphs:
            self.graphs[B] = self._capture(B)
        graph, static, logits = self.graphs[B]
        for buf, value in zip(static, self.model.decode_inputs(tokens, segments, B, self.width)):
            buf.copy_(value)
        graph.replay()
        return logits[:len(segments)]
