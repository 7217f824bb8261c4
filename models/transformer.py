"""The decoder shared by llama, qwen2, qwen3, gemma2 and gemma3: weights loader, config base, block, model.

Each architecture file (llama.py, qwen2.py, qwen3.py, gemma2.py, gemma3.py) fills a frozen
`DecoderConfig` from its GGUF metadata; the differences between them are data in that config
(biases, rope style and scaling, Q/K norms, post-norms, activation, embedding scale, per-layer
window and rope base, soft-capping), so one forward pass serves them all. All arithmetic goes
through kernels.cpu; nothing here imports numba.

Shapes: T tokens, D = n_embd, Hq / Hkv query / kv heads, hd = head_dim.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from kernels.cpu import fused
from kernels.cpu.attention import decode_plan, exact_head_dim
from kernels.cpu.ops import gelu_table, soft_cap_rows
from kernels.cpu.qdot import EXACT_TYPES, Int8Rows, Q8Buffers, exact_layout, run_arrays
from kernels.types import TRAITS
from kernels.cpu import (QMatrix, attention_decode, attention_decode_rows, attention_prefill, block_slots, geglu_tanh,
                         rms_norm, rope, rope_table, swiglu, write_kv, write_kv_slots)
from kernels.cpu.activations import round_like_llama_cpp, round_to_f16
from kernels.cpu.libm import inv_sqrtf
from models.architectures import ROPE_SCALING_TYPES
from models.errors import BadInputError
from models.gguf_file import GGUFFile


@dataclass(frozen=True)
class DecoderConfig:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_ctx_train: int
    norm_eps: float
    rope_base: float
    n_rot: int
    rope_neox: bool
    qk_norm: bool = False
    post_norms: bool = False
    activation: str = "swiglu"            # swiglu | geglu_tanh
    embed_scale: float = 1.0
    attn_scale: float = 0.0               # 0 -> 1/sqrt(head_dim)
    scale_q: bool = False                 # multiply Q by attn_scale before attention (gemma3), not the scores
    sliding_window: int = 0
    swa_pattern: int = 0                  # every swa_pattern-th layer is global, the rest local; 0 = none
    rope_base_local: float = 0.0          # rope base of sliding-window layers (0 -> rope_base)
    rope_freq_factors: tuple[float, ...] = ()   # (n_rot/2,) each pair's angle / its factor (Llama 3)
    rope_freq_scale: float = 1.0          # every angle times this (linear rope scaling: 1 / factor)
    attn_softcap: float = 0.0             # attention scores soft-capped at this before the softmax (gemma2)
    final_softcap: float = 0.0            # the logits soft-capped at this (gemma2)
    # derived in __post_init__
    layer_window: tuple[int, ...] = field(default=(), init=False)
    layer_rope_base: tuple[float, ...] = field(default=(), init=False)

    def __post_init__(self):
        if self.n_head % self.n_head_kv:
            raise BadInputError(f"{self.n_head} query heads do not split into {self.n_head_kv} kv groups")
        if self.attn_scale == 0.0:
            object.__setattr__(self, "attn_scale", float(inv_sqrtf(self.head_dim)))   # ggml's float32 rounding
        local = [self.swa_pattern > 0 and self.sliding_window > 0 and il % self.swa_pattern < self.swa_pattern - 1
                 for il in range(self.n_layer)]
        object.__setattr__(self, "layer_window", tuple(self.sliding_window if loc else 0 for loc in local))
        base_local = self.rope_base_local or self.rope_base
        object.__setattr__(self, "layer_rope_base", tuple(base_local if loc else self.rope_base for loc in local))

    def rope_table(self, positions: np.ndarray, base: float) -> np.ndarray:
        """cos/sin (T, n_rot/2, 2) of these positions' rope angles at this base (kernels.cpu.rope_table)."""
        return rope_table(positions, base, self.n_rot, self.rope_freq_factors, self.rope_freq_scale)

    @staticmethod
    def common_from_gguf(g: GGUFFile) -> dict:
        """The metadata keys every supported architecture shares."""
        def need(key):
            value = g.arch_get(key)
            if value is None:
                raise BadInputError(f"{g.path.name} lacks {g.arch}.{key}")
            return value
        n_embd, n_head = int(need("embedding_length")), int(need("attention.head_count"))
        head_dim = int(g.arch_get("attention.key_length") or n_embd // n_head)
        if "token_embd.weight" not in g.tensors:
            raise BadInputError(f"{g.path.name} has no token_embd.weight")
        n_vocab = int(g.tensors["token_embd.weight"].shape[1])  # (reading the whole vocab list is slow)
        return dict(
            n_vocab=n_vocab, n_embd=n_embd, n_layer=int(need("block_count")), n_head=n_head,
            n_head_kv=int(g.arch_get("attention.head_count_kv") or n_head), head_dim=head_dim,
            n_ff=int(need("feed_forward_length")), n_ctx_train=int(g.arch_get("context_length") or 4096),
            norm_eps=float(g.arch_get("attention.layer_norm_rms_epsilon") or 1e-6),
            rope_base=float(g.arch_get("rope.freq_base") or 10000.0),
            n_rot=int(g.arch_get("rope.dimension_count") or head_dim),
            rope_freq_scale=rope_freq_scale(g),
        )


def rope_freq_scale(g: GGUFFile) -> float:
    """llama.cpp's rope_freq_scale_train: 1 / rope.scaling.factor under linear scaling, else 1."""
    kind = g.arch_get("rope.scaling.type") or "none"
    if kind not in ROPE_SCALING_TYPES:
        raise BadInputError(f"{g.path.name}: rope scaling '{kind}' is not supported")
    factor = float(g.arch_get("rope.scaling.factor") or 0.0)
    return 1.0 / factor if kind == "linear" and factor > 0 else 1.0


class Weights:
    """Tensors of a memory-mapped GGUF by name: matrices as QMatrix (kept quantized), vectors as float32.

    With `cache_dir`, the exact kernels' repacked layouts (8 rows interleaved, qdot) are saved there
    on the first load and memory-mapped back on later ones; the other exact types are read in place."""

    def __init__(self, g: GGUFFile, cache_dir: Path | None = None):
        self.g = g
        self.cache_dir = cache_dir
        self._data = {t.name: t.data for t in g.reader.tensors}

    def __contains__(self, name: str) -> bool:
        return name in self.g.tensors

    def _info(self, name: str):
        info = self.g.tensors.get(name)
        if info is None:
            raise BadInputError(f"tensor {name} missing from {self.g.path.name}")
        return info, info.shape[0], int(np.prod(info.shape[1:]))    # ggml (K, N): W has N rows of K

    def _cached_layout(self, key: str, build) -> np.ndarray | None:
        """An exact layout from the cache folder (memory-mapped), built and saved on first use (None:
        build found no exact layout)."""
        if self.cache_dir is None:
            return build()
        path = self.cache_dir / f"{key}.x8.npy"
        if path.exists():
            try:
                return np.load(path, mmap_mode="r")
            except (OSError, ValueError):
                path.unlink(missing_ok=True)                 # a damaged cache entry is rebuilt
        layout = build()
        if layout is None:
            return None
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
        np.save(tmp, layout)
        os.replace(tmp, path)
        return np.load(path, mmap_mode="r")

    def matrix(self, name: str, build_exact: bool = True) -> QMatrix:
        info, k, n = self._info(name)
        if not build_exact or info.ggml_type not in REPACKED_TYPES:
            return QMatrix(self._data[name], info.ggml_type, n, k, build_exact=build_exact)
        # None where qdot has no exact kernel for this matrix (kernels.types' rows8): nothing is cached
        layout = self._cached_layout(name, lambda: exact_layout(self._data[name], info.ggml_type, n, k))
        return QMatrix(self._data[name], info.ggml_type, n, k, exact=layout)

    def fusable(self, names: Sequence[str]) -> bool:
        """Can these matrices (one input) run as one exact matmul over their concatenated rows?"""
        infos = [self._info(name) for name in names]
        t = infos[0][0].ggml_type
        return (len(names) > 1 and t in EXACT_TYPES and all(i.ggml_type == t and kk == infos[0][1] for i, kk, _ in infos)
                and (not TRAITS[t].x8 or all(nn % 8 == 0 for _, _, nn in infos)))

    def fused(self, names: Sequence[str]) -> QMatrix:
        """One QMatrix (exact layout only) whose rows are the rows of `names` in order."""
        infos = [self._info(name) for name in names]
        t, k = infos[0][0].ggml_type, infos[0][1]
        n = sum(nn for _, _, nn in infos)
        layout = self._cached_layout("+".join(names), lambda: np.concatenate(
            [exact_layout(self._data[name], t, nn, k) for name, (_, _, nn) in zip(names, infos)]))
        return QMatrix(None, t, n, k, exact=layout)

    def vector(self, name: str) -> np.ndarray:
        if name not in self.g.tensors:
            raise BadInputError(f"tensor {name} missing from {self.g.path.name}")
        return np.array(self._data[name], dtype=np.float32).reshape(-1)

    def maybe_vector(self, name: str) -> np.ndarray | None:
        return self.vector(name) if name in self else None


# The exact kernels' layouts that are repacks (worth caching on disk); the others read the GGUF rows.
REPACKED_TYPES = frozenset(t for t in EXACT_TYPES if TRAITS[t].x8)


class KVView(Protocol):
    """What forward needs of a sequence's paged cache (core.kv_cache.Sequence provides it)."""
    k_cache: Sequence[np.ndarray]     # per layer (n_blocks, block_size, Hkv, hd) float32
    v_cache: Sequence[np.ndarray]
    block_table: np.ndarray           # int32, logical block -> physical block


# Float path (weight types without exact int8 kernels): segments of at most this many rows go
# through gemv row by row (below ~64 rows that beats dequantize + GEMM), longer ones through GEMM.
SMALL_BATCH = 64


# (kv: KVView, start_pos: int, n_tokens: int[, decode_rows: bool]): one sequence's run of new tokens.
# decode_rows: give every row exactly the numbers a decode step would give it (speculative checks,
# and by default a single token); otherwise the rows are a batch as llama.cpp would evaluate that
# sequence's prompt chunk.
Segment = tuple


@dataclass(frozen=True)
class RowPlan:
    """How a forward pass's rows go through the matmuls, per segment:
    spans (row0, row1, use_gemm) for the float path, and runs (row0, n, batched) for the exact
    int8 path (qdot.matmul: a batched run gets llama.cpp's arithmetic for a batch of n rows, a
    one-row run each row's single-token arithmetic). Either way a sequence's rows get the same
    numbers whatever else shares the pass."""
    spans: tuple
    runs: tuple             # as qdot.run_arrays gives them
    attn: "AttentionRows | None" = None

    @staticmethod
    def of(segments: Sequence[Segment]) -> "RowPlan":
        spans: list[tuple[int, int, bool]] = []
        runs: list[tuple[int, int, bool]] = []
        row = 0
        for _, _, n, decode_rows in segments:
            gemm = n > SMALL_BATCH
            if spans and not gemm and not spans[-1][2]:
                spans[-1] = (spans[-1][0], row + n, False)
            else:
                spans.append((row, row + n, gemm))
            runs.append((row, n, not decode_rows))
            row += n
        return RowPlan(tuple(spans), run_arrays(runs))


@dataclass(frozen=True)
class AttentionRows:
    """Where a forward pass's rows go in attention, worked out once for all layers when every
    segment uses the same cache arrays (a batch step, a speculative check): each row's cache cell,
    and the decode rows (attention_decode_rows: all of them in one kernel call, not one call per row
    and layer) with their block tables and key counts."""
    slots: np.ndarray         # (T,) int64 cache cell of each row's K and V
    decode: np.ndarray        # (R,) int64 rows that take the one-token arithmetic
    tables: np.ndarray        # (R, max blocks) int32 their sequences' block tables, zero-padded
    n_kvs: np.ndarray         # (R,) int64 keys each sees (its position + 1)

    @staticmethod
    def of(segments: Sequence[Segment]) -> "AttentionRows | None":
        first = segments[0][0]
        if any(kv.k_cache is not first.k_cache or kv.v_cache is not first.v_cache for kv, _, _, _ in segments):
            return None
        bs = first.k_cache[0].shape[1]
        slots, decode, tables, n_kvs = [], [], [], []
        row = 0
        for kv, start, n, decode_rows in segments:
            table = kv.block_table
            slots.append(block_slots(table, start, n, bs))
            if decode_rows:
                decode.extend(range(row, row + n))
                tables.extend([table] * n)
                n_kvs.extend(range(start + 1, start + n + 1))
            row += n
        width = max((len(t) for t in tables), default=0)
        padded = np.zeros((len(tables), width), np.int32)
        for i, t in enumerate(tables):
            padded[i, :len(t)] = t
        return AttentionRows(np.concatenate(slots), np.array(decode, np.int64), padded, np.array(n_kvs, np.int64))


def _mm(w: QMatrix, x: np.ndarray, plan: RowPlan, llama_rounding: bool, shared: dict | None = None,
        n_out: int | None = None) -> np.ndarray:
    """x (T, K) -> (T, N) (or the first n_out columns).

    With llama_rounding (the default) and an exact int8 kernel for w's type, x is quantized as
    llama.cpp's matmul quantizes it (q8_0 / q8_K) and the product is llama.cpp's, bit for bit, in
    one pass over W; `shared` keeps the quantized x for the next matrix that reads the same x.
    Other types: with llama_rounding x is first rounded to what llama.cpp's matmul effectively
    uses; row-by-row spans read W once per row (gemv), GEMM spans dequantize W tile by tile."""
    if llama_rounding and w.exact is not None:
        kind = TRAITS[w.ggml_type].vec_dot
        rows = shared.get(kind) if shared is not None else None
        if rows is None:
            rows = Int8Rows(np.ascontiguousarray(x, np.float32), kind)
            if shared is not None:
                shared[kind] = rows
        return w.matmul_int8(rows, n_out, plan.runs)
    if llama_rounding:
        x = round_like_llama_cpp(x, w.ggml_type)
    out = np.empty((x.shape[0], w.n_rows), np.float32)
    for r0, r1, gemm in plan.spans:
        if gemm:
            out[r0:r1] = w.gemm(x[r0:r1])
        else:
            for r in range(r0, r1):
                out[r] = w.gemv(x[r])
    return out if n_out is None else out[:, :n_out]


class Projections:
    """Matrices that read the same input (q, k, v; gate, up). On the exact path consecutive members
    of one weight type run as one matmul over their concatenated rows: one pass over the weights,
    one parallel region, one quantized x (each row's numbers are its own, so the split is exact).
    The float path takes the members one by one. With `split`, the file already holds the members
    as one matrix (phi3's attn_qkv and ffn_up): one matmul on either path, its output split."""

    def __init__(self, w: Weights, names: Sequence[str], split: Sequence[int] | None = None):
        self.parts: list[tuple[QMatrix, list[int]]] = []       # (matrix, member indices)
        if split is not None:                                   # names[0]: the members' rows in order
            self.parts.append((w.matrix(names[0]), list(range(len(split)))))
            self.members: list[QMatrix | None] = [None] * len(split)
            sizes = list(split)
        else:
            i = 0
            while i < len(names):
                j = len(names)
                while j > i + 1 and not w.fusable(names[i:j]):
                    j -= 1
                self.parts.append((w.fused(names[i:j]) if j > i + 1 else w.matrix(names[i]), list(range(i, j))))
                i = j
            # the members themselves, for the float path (their exact layout is the group's)
            self.members = [m if len(idx) == 1 else None for m, idx in self.parts for _ in idx]
            for (m, idx) in self.parts:
                if len(idx) > 1:
                    for k in idx:
                        self.members[k] = w.matrix(names[k], build_exact=False)
            sizes = [m.n_rows for m in self.members]
        self.sizes = sizes
        # member k's output: columns col0 .. col0 + n_rows of part p's output
        self.where: list[tuple[int, int, int]] = []
        for p, (_, idx) in enumerate(self.parts):
            col0 = 0
            for k in idx:
                self.where.append((p, col0, sizes[k]))
                col0 += sizes[k]

    def __call__(self, x: np.ndarray, plan: RowPlan, llama_rounding: bool, shared: dict) -> list[np.ndarray]:
        outs = []
        for m, idx in self.parts:
            if len(idx) > 1 and not llama_rounding and self.members[idx[0]] is not None:
                outs.extend(_mm(self.members[k], x, plan, False) for k in idx)
                continue
            y = _mm(m, x, plan, llama_rounding, shared)                     # (T, sum of members' rows)
            c0 = 0
            for k in idx:
                outs.append(y[:, c0:c0 + self.sizes[k]])
                c0 += self.sizes[k]
        return outs

    def matrices(self):
        yield from (m for m, _ in self.parts)


class Block:
    """One pre-norm decoder layer (with gemma3's extra post-norms when the config asks)."""

    def __init__(self, cfg: DecoderConfig, w: Weights, il: int):
        p = f"blk.{il}."
        self.cfg, self.il = cfg, il
        self.window, self.rope_base = cfg.layer_window[il], cfg.layer_rope_base[il]
        self.attn_norm = w.vector(p + "attn_norm.weight")
        qd, kvd = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
        if p + "attn_qkv.weight" in w:                                      # phi3: one matrix
            self.qkv = Projections(w, [p + "attn_qkv.weight"], split=(qd, kvd, kvd))
        else:
            self.qkv = Projections(w, [p + f"attn_{n}.weight" for n in "qkv"])
        self.wo = w.matrix(p + "attn_output.weight")
        self.bq, self.bk, self.bv = (w.maybe_vector(p + f"attn_{n}.bias") for n in "qkv")
        self.q_norm = w.vector(p + "attn_q_norm.weight") if cfg.qk_norm else None
        self.k_norm = w.vector(p + "attn_k_norm.weight") if cfg.qk_norm else None
        self.post_attn_norm = w.vector(p + "post_attention_norm.weight") if cfg.post_norms else None
        self.ffn_norm = w.vector(p + "ffn_norm.weight")
        if p + "ffn_gate.weight" in w:
            self.gate_up = Projections(w, [p + "ffn_gate.weight", p + "ffn_up.weight"])
        else:                                                               # phi3: ffn_up holds gate, then up
            self.gate_up = Projections(w, [p + "ffn_up.weight"], split=(cfg.n_ff, cfg.n_ff))
        self.w_down = w.matrix(p + "ffn_down.weight")
        self.post_ffn_norm = w.vector(p + "post_ffw_norm.weight") if cfg.post_norms else None
        self.act = geglu_tanh if cfg.activation == "geglu_tanh" else swiglu
        self.llama_rounding = True       # round activations as llama.cpp does; False = exact float32
        self.softmax = "llama.cpp"       # attention's softmax: "llama.cpp" or "online" (flash)
        self._row_bufs: dict = {}        # row count -> fused.RowBuffers (shared with same-shaped layers)

    def attention(self, x: np.ndarray, positions: np.ndarray, segments: Sequence[Segment], plan: RowPlan,
                  rope_tables: dict) -> np.ndarray:
        cfg = self.cfg
        T, hd = x.shape[0], cfg.head_dim
        h = rms_norm(x, self.attn_norm, cfg.norm_eps)                      # (T, D)
        shared: dict = {}                                                  # h quantized once for q, k, v
        mm = lambda w, a: _mm(w, a, plan, self.llama_rounding, shared if a is h else None)  # noqa: E731
        q, k, v = self.qkv(h, plan, self.llama_rounding, shared)           # (T, Hq*hd), (T, Hkv*hd) x2
        if self.bq is not None:
            q += self.bq
            k += self.bk
            v += self.bv
        q = q.reshape(T, cfg.n_head, hd)
        k = k.reshape(T, cfg.n_head_kv, hd)
        v = v.reshape(T, cfg.n_head_kv, hd)
        if self.q_norm is not None:  # per-head RMSNorm over hd
            q = rms_norm(q.reshape(-1, hd), self.q_norm, cfg.norm_eps).reshape(T, cfg.n_head, hd)
            k = rms_norm(k.reshape(-1, hd), self.k_norm, cfg.norm_eps).reshape(T, cfg.n_head_kv, hd)
        table = rope_tables.get(self.rope_base)                            # (T, n_rot/2, 2) cos, sin
        if table is None:
            table = rope_tables[self.rope_base] = cfg.rope_table(positions, self.rope_base)
        q = rope(q, positions, self.rope_base, cfg.rope_neox, cfg.n_rot, table)   # (T, Hq, hd)
        k = rope(k, positions, self.rope_base, cfg.rope_neox, cfg.n_rot, table)   # (T, Hkv, hd)
        scale = cfg.attn_scale
        if cfg.scale_q:          # gemma3's graph scales Q (float32) before attention: its f16 copy
            q = q * np.float32(scale)   # then rounds the scaled values (small ones land in f16's subnormals)
            scale = 1.0
        if self.llama_rounding:  # llama.cpp multiplies K by an f16 copy of Q (K and V: the f16 cache)
            q = round_to_f16(q)
        o = np.empty((T, cfg.n_head, hd), np.float32)                      # (T, Hq, hd)
        rows_plan = plan.attn
        if rows_plan is not None:
            kc, vc = segments[0][0].k_cache[self.il], segments[0][0].v_cache[self.il]
            write_kv_slots(kc, vc, rows_plan.slots, k, v)
            # two decode rows or more in one call (one row keeps attention_decode's split over keys)
            together = (rows_plan.decode.shape[0] > 1 and self.softmax == "llama.cpp" and exact_head_dim(hd))
            if together:
                idx = rows_plan.decode
                o[idx] = attention_decode_rows(q[idx], kc, vc, rows_plan.tables, rows_plan.n_kvs, scale, self.window,
                                               cfg.attn_softcap)
        row = 0
        for kv, start_pos, n, decode_rows in segments:  # each sequence attends to its own paged cache
            kc, vc, table = kv.k_cache[self.il], kv.v_cache[self.il], kv.block_table
            rows = slice(row, row + n)
            if rows_plan is None:
                write_kv(kc, vc, table, start_pos, np.ascontiguousarray(k[rows]), np.ascontiguousarray(v[rows]))
            elif decode_rows and together:
                row += n
                continue
            if decode_rows:  # the one-token kernel row by row: a speculative check sees decode's numbers
                for i in range(n):
                    o[row + i] = attention_decode(q[row + i], kc, vc, table, start_pos + i + 1, scale,
                                                  self.window, softmax=self.softmax, softcap=cfg.attn_softcap)
            else:
                o[rows] = attention_prefill(np.ascontiguousarray(q[rows]), kc, vc, table, start_pos,
                                            scale, self.window, softmax=self.softmax, softcap=cfg.attn_softcap)
            row += n
        o = mm(self.wo, o.reshape(T, cfg.n_head * hd))                    # (T, D)
        if self.post_attn_norm is not None:
            o = rms_norm(o, self.post_attn_norm, cfg.norm_eps)
        return o

    def ffn(self, x: np.ndarray, plan: RowPlan) -> np.ndarray:
        h = rms_norm(x, self.ffn_norm, self.cfg.norm_eps)                  # (T, D)
        shared: dict = {}                                                  # h quantized once for gate, up
        mm = lambda w, a: _mm(w, a, plan, self.llama_rounding, shared if a is h else None)  # noqa: E731
        gate, up = self.gate_up(h, plan, self.llama_rounding, shared)
        a = self.act(gate, up)                                             # (T, n_ff)
        o = mm(self.w_down, a)                                            # (T, D)
        if self.post_ffn_norm is not None:
            o = rms_norm(o, self.post_ffn_norm, self.cfg.norm_eps)
        return o

    # --- one token, fused (see kernels.cpu.fused) ------------------------------------------------
    def can_decode_one(self) -> bool:
        if getattr(self, "_exact_all", None) is None:
            mats = [*self.qkv.matrices(), self.wo, *self.gate_up.matrices(), self.w_down]
            self._exact_all = exact_head_dim(self.cfg.head_dim) and all(m.exact is not None for m in mats)
        return self._exact_all and self.llama_rounding and self.softmax == "llama.cpp"

    def fused_weights(self) -> fused.LayerWeights:
        """The layer as kernels.cpu.fused.decode_layer reads it (built once)."""
        if getattr(self, "_fused", None) is None:
            cfg = self.cfg
            opt = lambda v: v if v is not None else fused.NONE                 # noqa: E731
            proj = lambda p: fused.Projection.of([(m.exact, m.ggml_type) for m, _ in p.parts], p.where)  # noqa: E731
            self._fused = fused.LayerWeights(
                cfg.n_head, cfg.n_head_kv, cfg.head_dim, np.float32(cfg.norm_eps),
                self.attn_norm, proj(self.qkv), opt(self.bq), opt(self.bk), opt(self.bv),
                opt(self.q_norm), opt(self.k_norm), cfg.rope_neox,
                np.float32(cfg.attn_scale if cfg.scale_q else 1.0), np.float32(1.0 if cfg.scale_q else cfg.attn_scale),
                np.float32(cfg.attn_softcap),
                self.wo.exact, self.wo.ggml_type, opt(self.post_attn_norm),
                self.ffn_norm, proj(self.gate_up), self.act is geglu_tanh, gelu_table(),
                self.w_down.exact, self.w_down.ggml_type, opt(self.post_ffn_norm))
        return self._fused

    def decode_rows(self, x: np.ndarray, kv: KVView, cs: np.ndarray, plan, pool: fused.RowBufferPool) -> np.ndarray:
        """R tokens x (R, D) of one sequence, in place, each with the numbers it gets alone (decode
        rows: a decode step, a speculative check): exactly the general path's arithmetic (and bits),
        as one compiled call (kernels.cpu.fused.decode_layer). cs: rope's cos/sin of the positions;
        plan: attention.decode_plan for this layer's window."""
        w, R = self.fused_weights(), x.shape[0]
        bufs = self._row_bufs.get(R)
        if bufs is None:                 # the pool's shape key once per row count, not per step
            bufs = self._row_bufs[R] = pool.get(w, R)
        fused.decode_layer(x, cs, w, kv.k_cache[self.il].view(np.uint16), kv.v_cache[self.il].view(np.uint16),
                           plan, bufs)
        return x

    def __call__(self, x, positions, segments, plan: RowPlan, rope_tables: dict, keep=None):
        """rope_tables: the forward pass's rope_table per rope base, filled by the first layer using it.
        keep: (row indices, their RowPlan): after attention only these rows go on (the last layer,
        as llama.cpp's graph keeps only the rows whose logits are wanted, so its FFN sees a batch
        of that size)."""
        a = self.attention(x, positions, segments, plan, rope_tables)
        if keep is not None:
            rows, plan = keep
            x, a = x[rows], a[rows]
        x = x + a
        return x + self.ffn(x, plan)


class Decoder:
    """Token embedding -> n_layer Blocks -> final norm -> output projection (tied to the embedding if absent)."""

    def __init__(self, cfg: DecoderConfig, g: GGUFFile, progress=None, cache_dir: Path | None = None):
        self.cfg = cfg
        w = Weights(g, cache_dir)
        self.tok_embd = w.matrix("token_embd.weight")
        self.blocks = []
        for il in range(cfg.n_layer):
            self.blocks.append(Block(cfg, w, il))
            if progress:
                progress("loading weights", il + 1, cfg.n_layer)
        self.output_norm = w.vector("output_norm.weight")
        self.output = w.matrix("output.weight") if "output.weight" in w else self.tok_embd
        self.nbytes = sum(m.nbytes for m in self._matrices())
        self.llama_rounding = True
        self._pool = fused.RowBufferPool()   # the fused decode layer's row buffers
        self.fast_decode = True          # decode rows through Block.decode_rows (same numbers)

    def set_llama_rounding(self, on: bool) -> None:
        """True: round activations like llama.cpp (the default); False: exact float32 activations."""
        self.llama_rounding = on
        for block in self.blocks:
            block.llama_rounding = on

    def set_attention_softmax(self, softmax: str) -> None:
        """"llama.cpp" (the default: its float16 probabilities, so greedy output tracks llama.cpp's)
        or "online" (flash attention with float32 probabilities, kernels.cpu.attention_online)."""
        if softmax not in ("llama.cpp", "online"):
            raise ValueError(f"unknown softmax {softmax!r}")
        for block in self.blocks:
            block.softmax = softmax

    def _matrices(self):
        yield self.tok_embd
        if self.output is not self.tok_embd:
            yield self.output
        for b in self.blocks:
            yield from b.qkv.matrices()
            yield b.wo
            yield from b.gate_up.matrices()
            yield b.w_down

    def forward(self, tokens: np.ndarray, start_pos: int, kv: KVView, all_logits: bool = False,
                decode_rows: bool | None = None, vocab_limit: int | None = None) -> np.ndarray:
        """tokens (T,) at positions start_pos.. whose cache slots `kv` already holds ->
        logits (n_vocab,) of the last token, or (T, n_vocab) with all_logits. decode_rows: see Segment;
        vocab_limit: logits of the first vocab_limit tokens only."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if (tokens.shape[0] == 1 or decode_rows) and self._decode_one_ok():
            logits = self._decode_rows(tokens, int(start_pos), kv, all_logits, vocab_limit)
            return logits if all_logits else logits[-1]
        x, plan = self._hidden(tokens, [(kv, int(start_pos), tokens.shape[0], decode_rows)], all_rows=all_logits)
        logits = self._logits(x, plan, vocab_limit)                       # (T or 1, n_vocab)
        return logits if all_logits else logits[0]

    def _decode_one_ok(self) -> bool:
        return (self.llama_rounding and self.output.exact is not None and self.fast_decode
                and all(block.can_decode_one() for block in self.blocks))

    def _decode_rows(self, tokens: np.ndarray, pos: int, kv: KVView, all_logits: bool,
                     vocab_limit: int | None) -> np.ndarray:
        """Tokens (R,) at positions pos.. of one sequence through Block.decode_rows, each with the
        numbers it gets alone: the logits (R or 1 (the last row), n_vocab or vocab_limit), equal to
        the general path's for decode rows."""
        R = tokens.shape[0]
        x = self.tok_embd.rows(tokens)                                    # (R, D)
        if self.cfg.embed_scale != 1.0:
            x *= np.float32(self.cfg.embed_scale)
        positions = np.arange(pos, pos + R, dtype=np.int64)
        tables = {base: self.cfg.rope_table(positions, base) for base in set(self.cfg.layer_rope_base)}
        bs, Hkv = kv.k_cache[0].shape[1], self.cfg.n_head_kv
        plans = {w: decode_plan(kv.block_table, pos, R, w, Hkv, bs) for w in set(self.cfg.layer_window)}
        for block in self.blocks:
            x = block.decode_rows(x, kv, tables[block.rope_base], plans[block.window], self._pool)
        if not all_logits:
            x = x[-1:]
        out = self.output
        n = out.n_rows if vocab_limit is None else min(int(vocab_limit), out.n_rows)
        traits = TRAITS[out.ggml_type]
        layout = traits.layout_prefix(out.exact, n)
        logits = np.empty((x.shape[0], traits.layout_rows(layout)), np.float32)
        fused.output_rows(x, self.output_norm, np.float32(self.cfg.norm_eps), layout, out.ggml_type,
                          Q8Buffers.alloc(x.shape[0], self.cfg.n_embd), run_arrays([(0, x.shape[0], False)]),
                          np.float32(self.cfg.final_softcap), logits)
        return logits[:, :n]

    def forward_batch(self, tokens: np.ndarray, segments: Sequence[Segment]) -> np.ndarray:
        """Several sequences in one pass (continuous batching): tokens (T,) in segment order, each
        segment (kv, start_pos, n_tokens) with its slots already held. Returns (len(segments), n_vocab),
        each segment's last-token logits, equal to what forward() gives for it alone."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        x, plan = self._hidden(tokens, segments, all_rows=False)
        return self._logits(x, plan)

    def _hidden(self, tokens: np.ndarray, segments: Sequence[Segment], all_rows: bool) -> tuple[np.ndarray, RowPlan]:
        """Embedding and every block: (T,) -> the hidden rows whose logits are wanted (every row, or
        each segment's last), with their RowPlan. As in llama.cpp's graph, the last layer keeps only
        those rows after its attention."""
        segments = [(seg[0], int(seg[1]), int(seg[2]),
                     bool(seg[3]) if len(seg) > 3 and seg[3] is not None else int(seg[2]) == 1)
                    for seg in segments]
        if sum(n for _, _, n, _ in segments) != tokens.shape[0] or any(n < 1 for _, _, n, _ in segments):
            raise ValueError("segments must cover the tokens, each with at least one")
        positions = np.concatenate([np.arange(s, s + n, dtype=np.int64) for _, s, n, _ in segments])
        plan = replace(RowPlan.of(segments), attn=AttentionRows.of(segments))
        ends = np.cumsum([n for _, _, n, _ in segments])
        if all_rows:
            keep = (np.arange(tokens.shape[0]), plan)
        else:
            last = [(kv, s + n - 1, 1, decode_rows) for kv, s, n, decode_rows in segments]
            keep = (ends - 1, RowPlan.of(last))
        x = self.tok_embd.rows(tokens)                                    # (T, D)
        if self.cfg.embed_scale != 1.0:
            x *= np.float32(self.cfg.embed_scale)
        rope_tables: dict = {}
        for il, block in enumerate(self.blocks):
            x = block(x, positions, segments, plan, rope_tables, keep if il == len(self.blocks) - 1 else None)
        return x, keep[1]

    def _logits(self, x: np.ndarray, plan: RowPlan, vocab_limit: int | None = None) -> np.ndarray:
        """(R, D) -> (R, n_vocab), or (R, vocab_limit): the logits of the first vocab_limit tokens
        only (a draft model; the output matrix is the largest one)."""
        x = rms_norm(x, self.output_norm, self.cfg.norm_eps)
        logits = _mm(self.output, x, plan, self.llama_rounding, n_out=vocab_limit)
        if self.cfg.final_softcap > 0:
            logits = np.ascontiguousarray(logits)
            soft_cap_rows(logits, np.float32(self.cfg.final_softcap))
        return logits
