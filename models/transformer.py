"""The decoder shared by every architecture (models.architectures): weights loader, config base, block, model.

Each architecture file (llama.py, qwen2.py, qwen3.py, gemma2.py, gemma3.py, ...) fills a frozen
`DecoderConfig` from its GGUF metadata; the differences between them are data in that config
(biases, rope style and scaling, Q/K norms, post-norms, activation, embedding scale, per-layer
window and rope base, soft-capping, scales, a mixture of experts), so one forward pass serves them
all. The arithmetic of a layer is kernels.cpu.fused.layer's (kernels.cpu.moe.layer's where the FFN
is a mixture of experts), written once; here are the weights it reads and the plan of each pass.
Nothing here imports numba.

Shapes: T tokens, D = n_embd, Hq / Hkv query / kv heads, hd = head_dim.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol, Sequence

import numpy as np

from kernels.cpu import QMatrix, fused, moe, rope_table
from kernels.cpu.attention import attention_plan
from kernels.cpu.libm import inv_sqrtf, rope_yarn_corr_dims, yarn_mscale
from kernels.cpu.ops import gelu_table
from kernels.cpu.qdot import EXACT_TYPES, Q8Buffers, exact_layout, has_exact_kernel, layout_prefix, run_arrays
from kernels.types import TRAITS
from models.architectures import ROPE_SCALING_TYPES
from models.errors import BadInputError
from models.gguf_file import GGUFFile, weights_in_memory


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
    local_layers: tuple[bool, ...] = ()   # which layers attend within sliding_window (swa_layers); () = none
    rope_base_local: float = 0.0          # rope base of sliding-window layers (0 -> rope_base)
    rope_freq_scale_local: float = 0.0    # rope_freq_scale of sliding-window layers (0 -> rope_freq_scale)
    nope_layers: tuple[bool, ...] = ()    # layers whose q and k take no rope (SmolLM3's every fourth); () = none
    rope_freq_factors: tuple[float, ...] = ()   # (n_rot/2,) each pair's angle / its factor (Llama 3, LongRoPE)
    rope_freq_scale: float = 1.0          # every angle times this (linear rope scaling: 1 / factor)
    rope_attn_factor: float = 1.0         # cos and sin times this (rope.scaling.attn_factor: LongRoPE's)
    longrope: tuple = ()                  # LongRoPE: (short factors, long factors, original context); for_context picks
    rope_long: bool = False               # LongRoPE: rope_freq_factors are the long ones
    rope_yarn_ctx: int = 0                # YaRN: the original context its ramp is computed for (0: no YaRN)
    yarn_betas: tuple[float, float] = (32.0, 1.0)   # YaRN's beta_fast, beta_slow (llama.cpp's defaults; mistral3 reads the file's)
    yarn_log_mul: float = 0.0             # YaRN's rope.scaling.yarn_log_multiplier (mistral3), 0: none
    attn_softcap: float = 0.0             # attention scores soft-capped at this before the softmax (gemma2)
    final_softcap: float = 0.0            # the logits soft-capped at this (gemma2)
    residual_scale: float = 0.0           # attention's and the FFN's outputs times this before each residual add (granite)
    logit_scale: float = 0.0              # the logits divided by this, as ggml does: times float32(1 / it) (granite)
    n_expert: int = 0                     # a mixture of experts' FFN in every layer (kernels.cpu.moe): its experts,
    n_expert_used: int = 0                # ... and how many each token takes; 0: a dense FFN
    # derived in __post_init__
    layer_window: tuple[int, ...] = field(default=(), init=False)
    layer_rope: tuple[tuple[float, float], ...] = field(default=(), init=False)   # (base, freq_scale) per layer
    # (freq_scale 0 at a layer without rope: every angle 0, cos exactly 1 and sin 0, q and k as they are)
    # each layer_rope's rope_scaling, computed once here (YaRN's constants call libm): not per pass
    _rope_scalings: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self):
        if self.n_head % self.n_head_kv:
            raise BadInputError(f"{self.n_head} query heads do not split into {self.n_head_kv} kv groups")
        if self.attn_scale == 0.0:
            object.__setattr__(self, "attn_scale", float(inv_sqrtf(self.head_dim)))   # ggml's float32 rounding
        if self.n_expert and not 0 < self.n_expert_used <= self.n_expert:
            raise BadInputError(f"{self.n_expert_used} of {self.n_expert} experts per token")
        if self.local_layers and len(self.local_layers) != self.n_layer:
            raise BadInputError(f"a sliding-window pattern of {len(self.local_layers)} layers for {self.n_layer}")
        local = [self.sliding_window > 0 and bool(self.local_layers) and self.local_layers[il] for il in range(self.n_layer)]
        object.__setattr__(self, "layer_window", tuple(self.sliding_window if loc else 0 for loc in local))
        rope_local = (self.rope_base_local or self.rope_base, self.rope_freq_scale_local or self.rope_freq_scale)
        if self.nope_layers and len(self.nope_layers) != self.n_layer:
            raise BadInputError(f"{len(self.nope_layers)} layers without rope for {self.n_layer}")
        nope = self.nope_layers or (False,) * self.n_layer
        object.__setattr__(self, "layer_rope", tuple(
            (self.rope_base, 0.0) if nope[il] else rope_local if loc else (self.rope_base, self.rope_freq_scale)
            for il, loc in enumerate(local)))
        object.__setattr__(self, "_rope_scalings", {rope: self._rope_scaling(*rope) for rope in set(self.layer_rope)})

    def for_context(self, n_ctx: int) -> "DecoderConfig":
        """This config for a cache of n_ctx tokens. A LongRoPE file (phi3's 128k models) carries two
        factor sets, and llama.cpp picks one per context, not per position (llama_model::get_rope_factors):
        the long ones when its context, n_ctx rounded up to 256 as llama.cpp pads it, exceeds the file's
        original context; a set the file lacks means no factors."""
        if not self.longrope:
            return self
        short, long, n_ctx_orig = self.longrope
        use_long = -(-n_ctx // 256) * 256 > n_ctx_orig
        return dataclasses.replace(self, rope_freq_factors=long if use_long else short, rope_long=use_long)

    @property
    def logit_multiplier(self) -> np.float32:
        """What the logits are multiplied by: float32(1 / logit_scale), as ggml_scale(cur, 1.0f /
        f_logit_scale) rounds it (granite), or 0 for none."""
        return np.float32(np.float32(1.0) / np.float32(self.logit_scale)) if self.logit_scale else np.float32(0.0)

    @property
    def rope_tag(self) -> str:
        """What of the rope a cached K depends on beyond the file: LongRoPE's chosen factor set."""
        return ("/rope-long" if self.rope_long else "/rope-short") if self.longrope else ""

    def rope_scaling(self, base: float, freq_scale: float) -> dict:
        """What rope applies beyond base and positions at a layer of this (base, freq_scale) (one of
        layer_rope), as kernels.cpu.rope_table takes it: the factors, the frequency scale, the factor
        on cos and sin and, for YaRN, its ramp's pairs."""
        return self._rope_scalings[base, freq_scale]

    def _rope_scaling(self, base: float, freq_scale: float) -> dict:
        if freq_scale == 0.0:       # a layer without rope: the identity rotation, whatever the file's scaling
            return dict(freq_factors=(), freq_scale=0.0, attn_factor=1.0)
        if not self.rope_yarn_ctx:
            return dict(freq_factors=self.rope_freq_factors, freq_scale=freq_scale, attn_factor=self.rope_attn_factor)
        return dict(freq_factors=self.rope_freq_factors, freq_scale=freq_scale,
                    attn_factor=float(yarn_mscale(freq_scale, self.rope_attn_factor, self.rope_freq_scale,
                                                  self.yarn_log_mul)),
                    yarn=tuple(map(float, rope_yarn_corr_dims(self.n_rot, self.rope_yarn_ctx, base, *self.yarn_betas))))

    def rope_table(self, positions: np.ndarray, base: float, freq_scale: float) -> np.ndarray:
        """cos/sin (T, 2, n_rot/2) of these positions' rope angles at this base and frequency scale
        (a layer's layer_rope; kernels.cpu.rope_table)."""
        return rope_table(positions, base, self.n_rot, **self.rope_scaling(base, freq_scale))

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
            rope_attn_factor=float(g.arch_get("rope.scaling.attn_factor") or 1.0),
            rope_yarn_ctx=(int(g.arch_get("rope.scaling.original_context_length") or g.arch_get("context_length") or 4096)
                           if g.arch_get("rope.scaling.type") == "yarn" else 0),
            n_expert=g.n_expert,
            n_expert_used=int(arch_number(g, "expert_used_count", 0)),
        )


def arch_number(g: GGUFFile, key: str, default: float) -> float:
    """`{arch}.{key}` as a float, or default where the file has no number there (a GGUF is
    untrusted: a value of another type counts as absent)."""
    value = g.arch_get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def rope_freq_scale(g: GGUFFile) -> float:
    """llama.cpp's rope_freq_scale_train: 1 / rope.scaling.factor (or the older key
    rope.scale_linear) under linear scaling, which is what a file with no rope.scaling.type gets,
    and YaRN; else 1."""
    kind = g.arch_get("rope.scaling.type") or "linear"
    if kind not in ROPE_SCALING_TYPES:
        raise BadInputError(f"{g.path.name}: rope scaling '{kind}' is not supported")
    factor = float(g.arch_get("rope.scaling.factor") or g.arch_get("rope.scale_linear") or 0.0)
    return float(np.float32(1.0) / np.float32(factor)) if kind in ("linear", "yarn") and factor > 0 else 1.0


def swa_layers(g: GGUFFile, n_layer: int, period: int) -> tuple[bool, ...]:
    """Which layers attend within the sliding window, as llama.cpp's load_swa_pattern reads
    `attention.sliding_window_pattern`: an array of per-layer flags, or a period n (layer il is
    local iff il % n < n - 1; 0: every layer), `period` when the file has neither."""
    value = g.arch_get("attention.sliding_window_pattern")
    if isinstance(value, (list, tuple)):
        return tuple(bool(v) for v in value)
    n = int(value) if isinstance(value, int) and value >= 0 else period
    return tuple(n == 0 or il % n < n - 1 for il in range(n_layer))


def rope_factors(g: GGUFFile, name: str, n_rot: int) -> tuple[float, ...]:
    """A rope factor tensor (rope_freqs, rope_factors_long / _short): n_rot/2 floats, one per
    rotary pair; () when the file has none."""
    if name not in g.tensors:
        return ()
    t = next(t for t in g.reader.tensors if t.name == name)
    factors = tuple(float(f) for f in np.asarray(t.data, np.float32).reshape(-1))
    if len(factors) != n_rot // 2:
        raise BadInputError(f"{g.path.name}: {name} has {len(factors)} factors for {n_rot // 2} rotary pairs")
    return factors


class Weights:
    """Tensors of a memory-mapped GGUF by name: matrices as QMatrix (kept quantized), vectors as float32.

    With `cache_dir`, the exact kernels' repacked layouts (8 rows interleaved, qdot) and fused groups
    (q/k/v, gate/up) are saved there on the first load and read back on later ones; a lone matrix of
    the other exact types is the GGUF rows themselves. All of them are read into memory or stay
    mappings of their files, as models.gguf_file.weights_in_memory says for this file."""

    def __init__(self, g: GGUFFile, cache_dir: Path | None = None):
        self.g = g
        self.cache_dir = cache_dir
        self.in_memory = weights_in_memory(g.file_size)
        self._data = {t.name: t.data for t in g.reader.tensors}

    def __contains__(self, name: str) -> bool:
        return name in self.g.tensors

    def _info(self, name: str):
        info = self.g.tensors.get(name)
        if info is None:
            raise BadInputError(f"tensor {name} missing from {self.g.path.name}")
        return info, info.shape[0], int(np.prod(info.shape[1:]))    # ggml (K, N): W has N rows of K

    def _cached_layout(self, key: str, build) -> np.ndarray | None:
        """An exact layout from the cache folder (read into memory or mapped), built and saved on
        first use (None: build found no exact layout)."""
        if self.cache_dir is None:
            return build()
        path = self.cache_dir / f"{key}.x8.npy"
        mode = None if self.in_memory else "r"
        if path.exists():
            try:
                return np.load(path, mmap_mode=mode)
            except (OSError, ValueError):
                path.unlink(missing_ok=True)                 # a damaged cache entry is rebuilt
        layout = build()
        if layout is None:
            return None
        tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            np.save(tmp, layout)
            os.replace(tmp, path)
            return layout if self.in_memory else np.load(path, mmap_mode=mode)
        except OSError:           # the folder went (a newer version of this file, loaded meanwhile): run uncached
            tmp.unlink(missing_ok=True)
            return layout

    def matrix(self, name: str, exact: bool = True) -> QMatrix:
        """The matrix `name`, with its exact kernels' layout (every matrix a layer reads has one; the
        embedding only gathers rows)."""
        info, k, n = self._info(name)
        if not exact:
            return QMatrix(self._data[name], info.ggml_type, n, k, build_exact=False)
        if info.ggml_type in REPACKED_TYPES:            # a repack is cached
            layout = self._cached_layout(name, lambda: exact_layout(self._data[name], info.ggml_type, n, k))
        elif has_exact_kernel(info.ggml_type, n, k):    # the GGUF rows
            layout = exact_layout(self.g.resident(name) if self.in_memory else self._data[name], info.ggml_type, n, k)
        else:
            layout = None
        # None where qdot has no exact kernel for this matrix (kernels.types' rows8)
        if layout is None:
            self._no_kernel(name, info.ggml_type, n, k)
        return QMatrix(self._data[name], info.ggml_type, n, k, exact=layout)

    def experts(self, name: str, n_expert: int) -> tuple[np.ndarray, int]:
        """A layer's experts' matrices, one 3D tensor (E matrices of N rows of K), as E exact layouts
        stacked (E, ...), the repacks cached as matrix's are, the others the GGUF rows in place; and
        the tensor's type."""
        info = self._info(name)[0]
        if len(info.shape) != 3 or info.shape[2] != n_expert:
            raise BadInputError(f"{self.g.path.name}: {name} of shape {tuple(info.shape)} does not hold {n_expert} experts")
        k, n, t = info.shape[0], info.shape[1], info.ggml_type
        if not has_exact_kernel(t, n, k):
            self._no_kernel(name, t, n, k)
        data = self._data[name]                                           # (E, N, row bytes or K)
        if t in REPACKED_TYPES:
            return self._cached_layout(name, lambda: np.stack([exact_layout(data[e], t, n, k) for e in range(n_expert)])), t
        raw = self.g.resident(name) if self.in_memory else data
        return exact_layout(raw.reshape(n_expert * n, -1), t, n_expert * n, k).reshape(n_expert, n, -1), t

    @staticmethod
    def _no_kernel(name: str, ggml_type: int, n: int, k: int):
        raise BadInputError(f"kvchat's engine has no exact kernel for {name} ({TRAITS[ggml_type].name}, "
                            f"{n} rows of {k}) on this CPU; --backend llama.cpp (or auto) runs it")

    def n_rows(self, name: str) -> int:
        return self._info(name)[2]

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


# The exact kernels' layouts that are repacks (worth caching on disk); the others read the GGUF rows.
REPACKED_TYPES = frozenset(t for t in EXACT_TYPES if TRAITS[t].x8)


class KVView(Protocol):
    """What forward needs of a sequence's paged cache (core.kv_cache.Sequence provides it)."""
    k_cache: Sequence[np.ndarray]     # per layer (n_blocks, block_size, Hkv, hd) float16
    v_cache: Sequence[np.ndarray]
    block_table: np.ndarray           # int32, logical block -> physical block


# (kv: KVView, start_pos: int, n_tokens: int[, decode_rows: bool]): one sequence's run of new tokens.
# decode_rows: give every row exactly the numbers a decode step would give it (speculative checks,
# and by default a single token); otherwise the rows are a batch as llama.cpp would evaluate that
# sequence's prompt chunk.
Segment = tuple

# Row counts up to this keep their buffers between passes (decode steps, speculative checks, batch
# steps of up to 16 sequences), at most POOL_SIZE sets of them; a prompt chunk's are allocated for
# its pass.
POOLED_ROWS, POOL_SIZE = 16, 16
# fused.layers' `keep` where every row goes on through the last layer (an array all the same: one
# compiled loop for both kinds of pass).
NO_ROWS = np.empty(0, np.int64)


class Projections:
    """Matrices that read the same input (q, k, v; gate, up) as up to three exact layouts (parts):
    consecutive members of one weight type run as one matmul over their concatenated rows (one pass
    over the weights, one parallel region, one quantized x; each row's numbers are its own, so the
    split is exact). With `split`, the file already holds the members as one matrix (phi3's
    attn_qkv and ffn_up): one matmul, its output split."""

    def __init__(self, w: Weights, names: Sequence[str], split: Sequence[int] | None = None):
        self.parts: list[tuple[QMatrix, list[int]]] = []       # (matrix, member indices)
        if split is not None:                                   # names[0]: the members' rows in order
            self.parts.append((w.matrix(names[0]), list(range(len(split)))))
            sizes = list(split)
        else:
            i = 0
            while i < len(names):
                j = len(names)
                while j > i + 1 and not w.fusable(names[i:j]):
                    j -= 1
                self.parts.append((w.fused(names[i:j]) if j > i + 1 else w.matrix(names[i]), list(range(i, j))))
                i = j
            sizes = [w.n_rows(name) for name in names]
        # member k's output: columns col0 .. col0 + sizes[k] of part p's output
        self.where: list[tuple[int, int, int]] = []
        for p, (_, idx) in enumerate(self.parts):
            col0 = 0
            for k in idx:
                self.where.append((p, col0, sizes[k]))
                col0 += sizes[k]

    def matrices(self):
        yield from (m for m, _ in self.parts)


class Block:
    """One pre-norm decoder layer's weights (with gemma3's extra post-norms when the config asks),
    as kernels.cpu.fused.layer reads them."""

    def __init__(self, cfg: DecoderConfig, w: Weights, il: int):
        p = f"blk.{il}."
        self.cfg, self.il = cfg, il
        self.window, self.rope = cfg.layer_window[il], cfg.layer_rope[il]       # rope: (base, freq_scale)
        self.attn_norm = w.vector(p + "attn_norm.weight")
        qd, kvd = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
        if p + "attn_qkv.weight" in w:                                      # phi3: one matrix
            self.qkv = Projections(w, [p + "attn_qkv.weight"], split=(qd, kvd, kvd))
        else:
            self.qkv = Projections(w, [p + f"attn_{n}.weight" for n in "qkv"])
        self.wo = w.matrix(p + "attn_output.weight")
        self.ffn_norm = w.vector(p + "ffn_norm.weight")
        self.experts = None
        if cfg.n_expert:                         # the router as the FFN's one projection, the experts beside
            self.gate_up = Projections(w, [p + "ffn_gate_inp.weight"])
            self.w_down = self.gate_up.parts[0][0]      # (unread: LayerWeights holds a matrix there)
            (gate, gt), (up, ut), (down, dt) = (w.experts(p + f"ffn_{n}_exps.weight", cfg.n_expert)
                                                for n in ("gate", "up", "down"))
            n_ff = w.g.tensors[p + "ffn_gate_exps.weight"].shape[1]
            if w.g.tensors[p + "ffn_up_exps.weight"].shape[:2] != (cfg.n_embd, n_ff) or \
                    w.g.tensors[p + "ffn_down_exps.weight"].shape[:2] != (n_ff, cfg.n_embd):
                raise BadInputError(f"{w.g.path.name}: layer {il}'s experts' shapes do not match")
            self.experts = moe.Experts(cfg.n_expert_used, int(n_ff), True, gate, up, down, gt, ut, dt)
        elif p + "ffn_gate.weight" in w:
            self.gate_up = Projections(w, [p + "ffn_gate.weight", p + "ffn_up.weight"])
        else:                                                               # phi3: ffn_up holds gate, then up
            self.gate_up = Projections(w, [p + "ffn_up.weight"], split=(cfg.n_ff, cfg.n_ff))
        if self.experts is None:
            self.w_down = w.matrix(p + "ffn_down.weight")
        bias = lambda n: w.vector(p + f"attn_{n}.bias") if p + f"attn_{n}.bias" in w else fused.NONE   # noqa: E731
        need = lambda name, on: w.vector(p + name) if on else fused.NONE                             # noqa: E731
        proj = lambda pr: fused.Projection.of([(m.exact, m.ggml_type) for m, _ in pr.parts], pr.where)  # noqa: E731
        self.weights = fused.LayerWeights(
            cfg.n_head, cfg.n_head_kv, cfg.head_dim, np.float32(cfg.norm_eps), self.attn_norm, proj(self.qkv),
            bias("q"), bias("k"), bias("v"),
            need("attn_q_norm.weight", cfg.qk_norm), need("attn_k_norm.weight", cfg.qk_norm), cfg.rope_neox,
            np.float32(cfg.attn_scale if cfg.scale_q else 1.0), np.float32(1.0 if cfg.scale_q else cfg.attn_scale),
            np.float32(cfg.attn_softcap), self.wo.exact, self.wo.ggml_type,
            need("post_attention_norm.weight", cfg.post_norms), self.ffn_norm, proj(self.gate_up),
            cfg.activation == "geglu_tanh", gelu_table(), self.w_down.exact, self.w_down.ggml_type,
            need("post_ffw_norm.weight", cfg.post_norms), np.float32(cfg.residual_scale))
        self.shape = fused.buffer_shape(self.weights)     # what its row buffers' shapes depend on
        # ... and its experts' buffers
        self.expert_shape = None if self.experts is None else (self.experts.n_used, self.experts.n_ff, *(
            (int(t), a.shape[1:]) for t, a in ((gt, gate), (ut, up), (dt, down))))


class _Pass(NamedTuple):
    """One forward pass's rows and what its layers share (Decoder._setup)."""
    x: np.ndarray             # (T, D) the rows, updated layer by layer
    T: int
    runs: tuple               # qdot.run_arrays of the rows
    keep: np.ndarray | None   # the rows the last layer keeps (None: all)
    keep_runs: tuple          # ... and their runs
    tables: dict              # rope key -> cos/sin (T, 2, n_rot/2)
    plans: dict               # window -> attention.AttentionPlan
    k_cache: Sequence[np.ndarray]
    v_cache: Sequence[np.ndarray]
    online: bool | None       # fused.softmax_choice


class Decoder:
    """Token embedding -> n_layer Blocks -> final norm -> output projection (tied to the embedding if absent).

    Every pass (decode step, speculative check, prompt chunk, batch step) runs each layer as one
    compiled call, kernels.cpu.fused.layer; this class plans the rows and owns their buffers."""

    def __init__(self, cfg: DecoderConfig, g: GGUFFile, progress=None, cache_dir: Path | None = None):
        self.cfg = cfg
        w = Weights(g, cache_dir)
        tied = "output.weight" not in w
        self.tok_embd = w.matrix("token_embd.weight", exact=tied)
        self.blocks = []
        for il in range(cfg.n_layer):
            self.blocks.append(Block(cfg, w, il))
            if progress:
                progress("loading weights", il + 1, cfg.n_layer)
        self.output_norm = w.vector("output_norm.weight")
        self.output = self.tok_embd if tied else w.matrix("output.weight")
        self.nbytes = sum(m.nbytes for m in self._matrices()) + sum(
            a.nbytes for b in self.blocks if b.experts is not None for a in (b.experts.gate, b.experts.up, b.experts.down))
        self.softmax = "llama.cpp"
        self._pool: dict = {}            # (block shape, runs' bytes) -> fused.RowBuffers of at most POOLED_ROWS rows
        self._loop = self._compiled_loop()
        self._caches: tuple = ()         # (k_cache, v_cache, their per-layer lists for fused.layers)

    def _compiled_loop(self):
        """What fused.layers needs that does not change from pass to pass: the distinct rope tables'
        and windows' keys (at most two of each), which of them each layer takes, and the layers'
        weights as one list; None where a layer is a mixture of experts or they do not fit (the
        layers are then called one by one from Python)."""
        cfg = self.cfg
        ropes, windows = sorted(set(cfg.layer_rope)), sorted(set(cfg.layer_window))
        if any(b.experts is not None for b in self.blocks) or len(ropes) > 2 or len(windows) > 2:
            return None
        weights = fused.stack([b.weights for b in self.blocks])
        if weights is None:
            return None
        second = np.array([(ropes.index(r) == 1, windows.index(w) == 1)
                           for r, w in zip(cfg.layer_rope, cfg.layer_window)], np.bool_).reshape(-1, 2)
        return ropes, windows, second, weights

    def _cache_lists(self, k_cache: list, v_cache: list):
        """A cache's per-layer arrays (as uint16) as fused.layers' lists, made once per cache."""
        if not self._caches or self._caches[0] is not k_cache or self._caches[1] is not v_cache:
            lists = [fused.stack([c.view(np.uint16) for c in cache]) for cache in (k_cache, v_cache)]
            self._caches = (k_cache, v_cache, *lists)
        return self._caches[2], self._caches[3]

    def set_attention_softmax(self, softmax: str) -> None:
        """"llama.cpp" (the default: its float16 probabilities, so greedy output tracks llama.cpp's)
        or "online" (flash attention with float32 probabilities, kernels.cpu.attention_online)."""
        if softmax not in ("llama.cpp", "online"):
            raise ValueError(f"unknown softmax {softmax!r}")
        self.softmax = softmax

    def _matrices(self):
        yield self.tok_embd
        if self.output is not self.tok_embd:
            yield self.output
        for b in self.blocks:
            yield from b.qkv.matrices()
            yield b.wo
            yield from b.gate_up.matrices()
            if b.experts is None:
                yield b.w_down

    def forward(self, tokens: np.ndarray, start_pos: int, kv: KVView, all_logits: bool = False,
                decode_rows: bool | None = None, vocab_limit: int | None = None) -> np.ndarray:
        """tokens (T,) at positions start_pos.. whose cache slots `kv` already holds ->
        logits (n_vocab,) of the last token, or (T, n_vocab) with all_logits. decode_rows: see Segment;
        vocab_limit: logits of the first vocab_limit tokens only."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        logits = self._pass(tokens, [(kv, int(start_pos), tokens.shape[0], decode_rows)], all_logits, vocab_limit)
        return logits if all_logits else logits[0]

    def forward_batch(self, tokens: np.ndarray, segments: Sequence[Segment]) -> np.ndarray:
        """Several sequences in one pass (continuous batching): tokens (T,) in segment order, each
        segment (kv, start_pos, n_tokens) with its slots already held. Returns (len(segments), n_vocab),
        each segment's last-token logits, equal to what forward() gives for it alone."""
        return self._pass(np.asarray(tokens, dtype=np.int64).reshape(-1), segments, False)

    def _pooled(self, T: int, key: tuple, make):
        """Buffers of T rows, make()'s: pooled under key for few rows, new for a prompt chunk's pass."""
        if T > POOLED_ROWS:
            return make()
        bufs = self._pool.get(key)
        if bufs is None:
            if len(self._pool) >= POOL_SIZE:
                self._pool.clear()
            bufs = self._pool[key] = make()
        return bufs

    def _buffers(self, block: Block, runs: tuple, T: int) -> fused.RowBuffers:
        """The row buffers of T rows for this block's shape and these runs."""
        return self._pooled(T, (block.shape, b"".join(a.tobytes() for a in runs)),
                            lambda: fused.row_buffers(block.weights, T, runs))

    def _expert_buffers(self, block: Block, T: int) -> moe.ExpertBuffers:
        """The experts' buffers of T rows for this block's experts."""
        return self._pooled(T, ("experts", block.expert_shape, T),
                            lambda: moe.expert_buffers(block.experts, T, self.cfg.n_embd))

    def _setup(self, tokens: np.ndarray, segments: Sequence[Segment], all_rows: bool) -> "_Pass":
        """What every layer of a pass reads: the embedded rows, their runs, rope tables and
        attention plans, and which rows the last layer keeps (every row, or each segment's last)."""
        cfg = self.cfg
        segments = [(seg[0], int(seg[1]), int(seg[2]),
                     bool(seg[3]) if len(seg) > 3 and seg[3] is not None else int(seg[2]) == 1)
                    for seg in segments]
        T = tokens.shape[0]
        if sum(n for _, _, n, _ in segments) != T or any(n < 1 for _, _, n, _ in segments):
            raise ValueError("segments must cover the tokens, each with at least one")
        kv = segments[0][0]
        if any(s[0].k_cache is not kv.k_cache or s[0].v_cache is not kv.v_cache for s in segments):
            raise ValueError("the sequences of one pass must share one cache")
        # a batched run gets llama.cpp's arithmetic for a batch of its rows, decode rows a single token's
        starts = np.cumsum([0] + [n for _, _, n, _ in segments])
        runs = run_arrays([(r0, n, not dec) for r0, (_, _, n, dec) in zip(starts, segments)])
        keep = None if all_rows or len(segments) == T else starts[1:] - 1
        keep_runs = runs if keep is None else run_arrays([(i, 1, False) for i in range(len(keep))])
        positions = np.concatenate([np.arange(s, s + n, dtype=np.int64) for _, s, n, _ in segments])
        x = self.tok_embd.rows(tokens)                                    # (T, D)
        if cfg.embed_scale != 1.0:
            x *= np.float32(cfg.embed_scale)
        tables = {rope: cfg.rope_table(positions, *rope) for rope in set(cfg.layer_rope)}
        rows = [(kv_.block_table, s, n, dec) for kv_, s, n, dec in segments]
        bs = kv.k_cache[0].shape[1]
        plans = {w: attention_plan(rows, w, cfg.n_head, cfg.n_head_kv, cfg.head_dim, bs, self.softmax)
                 for w in set(cfg.layer_window)}
        online = fused.softmax_choice(next(iter(plans.values())))     # (one softmax for every layer)
        return _Pass(x, T, runs, keep, keep_runs, tables, plans, kv.k_cache, kv.v_cache, online)

    def _layer_args(self, p: "_Pass", il: int, bufs: dict) -> tuple:
        """fused.layer's arguments after the rows for layer il of pass p (bufs: the pass's buffers by
        block shape)."""
        block = self.blocks[il]
        return (p.tables[block.rope], block.weights, p.k_cache[il].view(np.uint16),
                p.v_cache[il].view(np.uint16), p.plans[block.window], self._shape_buffers(block, p.runs, p.T, bufs))

    def layer_args(self, tokens: np.ndarray, start_pos: int, kv: KVView) -> tuple:
        """fused.layer's arguments for the first layer of a pass of these tokens (their slots held in
        kv), without running it: what kernels.cpu.fused.share_signatures types a first start's shares by."""
        p = self._setup(np.asarray(tokens, np.int64).reshape(-1), [(kv, int(start_pos), len(tokens))], False)
        return (p.x, *self._layer_args(p, 0, {}), p.online)

    def _pass(self, tokens: np.ndarray, segments: Sequence[Segment], all_rows: bool,
              vocab_limit: int | None = None) -> np.ndarray:
        """Embedding, every layer and the logits of the rows wanted (every row, or each segment's
        last): (T,) -> (rows wanted, n_vocab or vocab_limit). As in llama.cpp's graph, the last layer
        keeps only those rows after its attention."""
        p = self._setup(tokens, segments, all_rows)
        x, keep, online = p.x, p.keep, p.online
        bufs: dict = {}                     # block shape -> its buffers for this pass
        threads = moe.threads()             # (the experts' layers split their work by it)
        last = len(self.blocks) - 1
        first, x = self._run_compiled(p, bufs)
        for il, block in enumerate(self.blocks[first:], first):
            args = (x, *self._layer_args(p, il, bufs))
            if block.experts is not None:           # the same, with the experts as the FFN
                m = block.experts
                if il == last and keep is not None:
                    x = moe.last_layer(x, *args[1:3], m, *args[3:], keep, self._buffers(block, p.keep_runs, len(keep)),
                                       self._expert_buffers(block, len(keep)), threads, online)
                else:
                    moe.layer(x, *args[1:3], m, *args[3:], self._expert_buffers(block, p.T), threads, online)
            elif il == last and keep is not None:
                x = fused.last_layer(*args, keep, self._buffers(block, p.keep_runs, len(keep)), online)
            else:
                fused.layer(*args, online)
        return self._logits(x, p.keep_runs, vocab_limit)

    def _run_compiled(self, p: "_Pass", bufs: dict) -> tuple[int, np.ndarray]:
        """Every layer of pass p through fused.layers, where the model allows it (_compiled_loop):
        returns how many layers it ran (all, or none) and the rows that go on (bufs: the pass's
        buffers by block shape, filled here for it)."""
        if self._loop is None:
            return 0, p.x
        ropes, windows, second, weights = self._loop
        per_layer, last_bufs = self._pooled(p.T, ("layers", b"".join(a.tobytes() for a in p.runs)),
                                       lambda: self._buffer_list(p.runs, p.T, bufs))
        kcs, vcs = self._cache_lists(p.k_cache, p.v_cache)
        if per_layer is None or kcs is None or vcs is None:
            return 0, p.x
        n = len(self.blocks)
        if p.keep is None:
            keep, bk = NO_ROWS, last_bufs
        else:
            keep, bk = p.keep, self._buffers(self.blocks[-1], p.keep_runs, len(p.keep))
        x = fused.layers(p.x, n, p.tables[ropes[0]], p.tables[ropes[-1]], p.plans[windows[0]], p.plans[windows[-1]],
                         second, weights, kcs, vcs, per_layer, keep, bk, p.online)
        return n, x

    def _shape_buffers(self, block: Block, runs: tuple, T: int, by_shape: dict) -> fused.RowBuffers:
        """This pass's buffers for the block, shared by the layers of its shape (by_shape: the pass's)."""
        b = by_shape.get(block.shape)
        if b is None:
            b = by_shape[block.shape] = self._buffers(block, runs, T)
        return b

    def _buffer_list(self, runs: tuple, T: int, by_shape: dict) -> tuple:
        """Each layer's buffers for these runs as one list (_shape_buffers; None where they do not
        stack), and the last layer's."""
        each = [self._shape_buffers(block, runs, T, by_shape) for block in self.blocks]
        return fused.stack(each), each[-1]

    def _logits(self, x: np.ndarray, runs: tuple, vocab_limit: int | None = None) -> np.ndarray:
        """(R, D) -> (R, n_vocab), or (R, vocab_limit): the logits of the first vocab_limit tokens
        only (a draft model; the output matrix is the largest one)."""
        out = self.output
        n = out.n_rows if vocab_limit is None else min(int(vocab_limit), out.n_rows)
        layout = layout_prefix(out.exact, out.ggml_type, n)
        logits = np.empty((x.shape[0], TRAITS[out.ggml_type].layout_rows(layout)), np.float32)
        fused.output_rows(x, self.output_norm, np.float32(self.cfg.norm_eps), layout, out.ggml_type,
                          Q8Buffers.alloc(x.shape[0], self.cfg.n_embd), runs, np.float32(self.cfg.final_softcap),
                          self.cfg.logit_multiplier, logits)
        return logits[:, :n]
