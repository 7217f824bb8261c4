"""Tiny random-weight GGUFs (llama, qwen2, qwen3, phi3, gemma2, gemma3) written with gguf.GGUFWriter, loadable by both
llama.cpp and the native engine.

Dimensions are the smallest the K-quants allow (every matrix's row length is a multiple of 256).
The vocabulary is a small SentencePiece one (<unk>, <s>, </s>, the 256 byte pieces llama.cpp
requires, a few words), so llama.cpp's vocab loader accepts it.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from core.tokenizer import Tokenizer
from kernels.reference import dequantize_ref
from models.gguf_file import open_model
from tests.shape_twin import F16_FIELDS

N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, N_FF = 256, 4, 2, 64, 512
WORDS = ["▁the", "▁a", "▁cat", "▁dog", "▁sat", "▁on", "▁mat", "▁code", "▁def", "▁return",
         "▁и", "▁кот", "▁сидел", "▁print", "▁(", "▁)", "▁:", "▁=", "▁+", "▁1"]
N_VOCAB = 320
GEMMA_WINDOW = 8
ARCH_LAYERS = {"llama": 2, "qwen2": 2, "qwen3": 2, "phi3": 2, "gemma2": 4, "gemma3": 6,   # gemma3: layers 0-4 local, 5 global
               "smollm3": 4, "ernie4_5": 2, "granite": 2, "exaone": 2, "gemma": 2, "mistral3": 2,
               "qwen3vl": 2, "qwen3moe": 2, "qwen3vlmoe": 2, "granitemoe": 2}             # smollm3: layer 3 without rope
# The mixture-of-experts architectures: their dense twin's layer with N_EXPERT experts of N_FF_EXP
# (a multiple of 256, as the K-quants' rows need), N_EXPERT_USED per token, and an F32 router.
MOE_TWIN = {"qwen3moe": "qwen3", "qwen3vlmoe": "qwen3vl", "granitemoe": "granite"}
N_EXPERT, N_EXPERT_USED, N_FF_EXP = 8, 2, 256
# The float keys a tiny model of these architectures always carries: Granite 3's constants (a logit
# scale whose reciprocal rounds; an attention scale not 1/sqrt(64)); Ministral 3's YaRN log multiplier
# and attention temperature, and YaRN betas not llama.cpp's defaults.
ARCH_FLOAT_KEYS = {
    "granite": (("embedding_scale", 12.0), ("residual_scale", 0.22), ("logit_scale", 6.0), ("attention.scale", 0.0078125)),
    "mistral3": (("rope.scaling.yarn_beta_fast", 16.0), ("rope.scaling.yarn_beta_slow", 2.0),
                 ("rope.scaling.yarn_log_multiplier", 1.0), ("attention.temperature_scale", 0.1)),
}
# gemma2's soft-caps, small enough that these random models' scores and logits bend under them
GEMMA2_ATTN_SOFTCAP, GEMMA2_FINAL_SOFTCAP = 4.0, 30.0

# the f16 scales drawn into random blocks of the types gguf-py cannot quantize (their byte ranges:
# tests.shape_twin.F16_FIELDS)
_K_SCALE = {"Q4_K": (2e-3, 6e-3), "Q5_K": (1e-3, 3e-3), "Q6_K": (1e-3, 4e-3), "IQ4_NL": (1e-3, 3e-3),
            "Q3_K": (3e-3, 9e-3), "Q2_K": (1e-2, 3e-2), "IQ4_XS": (1e-4, 4e-4)}   # weights' std about 0.25


def vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + WORDS
    tokens += [f"▁w{i}" for i in range(N_VOCAB - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    return tokens, scores, types


def byte_level_bpe(corpus: list[str], n_merges: int) -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary learned from corpus without any pre-tokenization, so its merges
    cross the boundaries a pre-tokenizer draws: a pre-tokenizer that splits elsewhere than
    llama.cpp's gives other ids. -> (tokens, merges)"""
    from core.tokenizer import _bytes_to_unicode
    table = _bytes_to_unicode()
    seqs = [[table[b] for b in text.encode()] for text in corpus]
    tokens, merges = [table[b] for b in range(256)], []
    for _ in range(n_merges):
        counts: dict[tuple[str, str], int] = {}
        for seq in seqs:
            for pair in zip(seq, seq[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        best = max(counts, key=lambda p: (counts[p], p))
        merged = best[0] + best[1]
        merges.append(f"{best[0]} {best[1]}")
        tokens.append(merged)
        for j, seq in enumerate(seqs):
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and (seq[i], seq[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            seqs[j] = out
    return tokens, merges


def quantized(data: np.ndarray, qtype: str, rng: np.random.Generator) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """(N, K) float32 -> what GGUFWriter.add_tensor takes for that type."""
    t = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        return data.astype(np.float32), t
    if qtype == "F16":
        return data.astype(np.float16), t
    if qtype in _K_SCALE:  # gguf-py cannot quantize these: random valid blocks, sane scales
        blk, size = gguf.GGML_QUANT_SIZES[t]
        n, k = data.shape
        raw = rng.integers(0, 256, size=(n, k // blk, size), dtype=np.uint8)
        a, b = F16_FIELDS[qtype]
        lo, hi = _K_SCALE[qtype]
        scales = rng.uniform(lo, hi, size=(n, k // blk, (b - a) // 2)).astype(np.float16)
        raw[..., a:b] = scales.view(np.uint8).reshape(n, k // blk, b - a)
        return raw.reshape(n, -1), t
    return gguf.quants.quantize(data, t), t


def write_tiny_model(path: Path, arch: str, qtype: str, seed: int = 0, rope_base: float | None = None,
                     rope_scaling: str | None = None,
                     softcaps: tuple[float, float] = (GEMMA2_ATTN_SOFTCAP, GEMMA2_FINAL_SOFTCAP),
                     f32_twin: bool = False, sliding_window: int = 0, extra: dict | None = None,
                     meta: tuple = (), bpe_pre: str | None = None, experts: bool = False, drop: tuple = ()) -> Path:
    """rope_base: llama's, qwen2's and qwen3's (default 1e4, Llama 2's); gemma3 keeps 1e6 global, 1e4 local.
    rope_scaling: "llama3" (a rope_freqs.weight tensor of per-pair factors, as Llama 3.1+ files carry)
    or "linear" / "yarn" (rope.scaling.type, factor 4; YaRN's original context is the file's 256), or phi3's
    LongRoPE: "longrope" (original context 128, so a 256-token context takes the long factors) or
    "longrope-short" (original context 256: the short ones).
    softcaps: gemma2's attention and final logit soft-caps. f32_twin: the same model with every
    quantized matrix stored as its exact dequantization (F32), so that a float32 engine can be
    compared with the native engine's float32 arithmetic on it. sliding_window: the key Mistral's files
    carry (llama); the gemmas always have theirs. extra: more tensors by name (float32 arrays).
    meta: more `{arch}.` keys, ((suffix, value), ...): a bool, a float, an int (uint32), a string or a list
    of bools. granite: always its embedding, residual, logit and attention scales; mistral3: its YaRN betas
    and log multiplier and its attention temperature.
    bpe_pre: a byte-level BPE vocabulary instead (tokenizer.ggml.model "gpt2", as Llama 3's files
    carry) with this pre-tokenizer name; its last token, <|endoftext|>, is its BOS and EOS.
    experts: a mixture of experts' FFN (Mixtral's, in a llama file); the MOE_TWIN architectures always.
    drop: tensors not to write."""
    rng = np.random.default_rng(seed)
    n_layer = ARCH_LAYERS[arch]
    experts = experts or arch in MOE_TWIN
    arch_name, arch = arch, MOE_TWIN.get(arch, arch)       # the file's name; the layer's (dense twin's) shape
    w = gguf.GGUFWriter(str(path), arch_name)
    if experts:
        w.add_expert_count(N_EXPERT)
        if "expert_used_count" not in dict(meta):
            w.add_expert_used_count(N_EXPERT_USED)
        w.add_expert_feed_forward_length(N_FF_EXP)
    w.add_block_count(n_layer)
    w.add_context_length(256)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF_EXP if experts else N_FF)     # (llama and granite read the experts' width there)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(rope_base or (1e4 if arch != "gemma3" else 1e6))
    if arch == "gemma2":
        w.add_attn_logit_softcapping(softcaps[0])
        w.add_final_logit_softcapping(softcaps[1])
    w.add_file_type(0)
    if arch in ("gemma", "gemma2", "gemma3", "qwen3", "qwen3vl"):
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
    if arch in ("gemma2", "gemma3") or sliding_window:
        w.add_sliding_window(sliding_window or GEMMA_WINDOW)
    if arch not in ("gemma2", "gemma3"):
        w.add_rope_dimension_count(HEAD_DIM)
    if rope_scaling in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling))
        w.add_rope_scaling_factor(4.0)
    if rope_scaling in ("longrope", "longrope-short"):   # as phi3's converter writes them
        w.add_rope_scaling_orig_ctx_len(128 if rope_scaling == "longrope" else 256)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(32) / math.log(4096)))   # a 128k model's
    for suffix, value in ARCH_FLOAT_KEYS.get(arch, ()):
        w.add_float32(f"{arch_name}.{suffix}", value)
    if arch == "qwen3vl":           # the rotary pairs' sections (time, height, width, extra): pair 31 is the extra one's
        w.add_array(f"{arch_name}.rope.dimension_sections", [12, 10, 10, 0])
        w.add_uint32(f"{arch_name}.n_deepstack_layers", 1)     # (a text token's deepstack features: zeros)
    for suffix, value in meta:
        if isinstance(value, bool):
            w.add_bool(f"{arch_name}.{suffix}", value)
        elif isinstance(value, list):
            w.add_array(f"{arch_name}.{suffix}", value)
        elif isinstance(value, str):
            w.add_string(f"{arch_name}.{suffix}", value)
        elif isinstance(value, float):
            w.add_float32(f"{arch_name}.{suffix}", value)
        else:
            w.add_uint32(f"{arch_name}.{suffix}", value)
    if bpe_pre is None:
        tokens, scores, types = vocab()
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_space_prefix(True)
    else:
        tokens, merges = byte_level_bpe([" ".join(WORDS).replace("▁", "")] * 2, N_VOCAB - 257)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(bpe_pre)
        w.add_token_list(tokens + ["<|endoftext|>"])
        w.add_token_types([1] * len(tokens) + [3])
        w.add_token_merges(merges)
        w.add_bos_token_id(len(tokens))
        w.add_eos_token_id(len(tokens))
    w.add_add_bos_token(True)

    def add(name, data, **kw):
        if name not in drop:
            w.add_tensor(name, data, **kw)

    def mat(name, n, k, std):
        data, t = quantized(rng.normal(0, std, size=(n, k)).astype(np.float32), qtype, rng)
        if f32_twin and t != gguf.GGMLQuantizationType.F32:
            data, t = dequantize_ref(np.asarray(data), int(t), k), gguf.GGMLQuantizationType.F32
        add(name, data, raw_dtype=t)

    def experts_of(name, n, k, std):         # N_EXPERT matrices of n rows of k, one 3D tensor
        parts = [quantized(rng.normal(0, std, size=(n, k)).astype(np.float32), qtype, rng) for _ in range(N_EXPERT)]
        data, t = np.stack([np.asarray(d) for d, _ in parts]), parts[0][1]
        if f32_twin and t != gguf.GGMLQuantizationType.F32:
            data, t = np.stack([dequantize_ref(np.asarray(d), int(t), k) for d in data]), gguf.GGMLQuantizationType.F32
        add(name, data, raw_dtype=t)

    def vec(name, n, center=1.0, spread=0.2):
        add(name, (center + spread * rng.standard_normal(n)).astype(np.float32))

    if rope_scaling == "llama3":     # factors 1 (high frequencies) .. 8 (low), as Llama 3's scaling makes them
        add("rope_freqs.weight", np.geomspace(1.0, 8.0, HEAD_DIM // 2).astype(np.float32))
    if rope_scaling in ("longrope", "longrope-short"):   # phi3's 128k models: two factor sets
        for kind, top in (("long", 40.0), ("short", 1.5)):
            add(f"rope_factors_{kind}.weight", np.geomspace(1.0, top, HEAD_DIM // 2).astype(np.float32))
    mat("token_embd.weight", N_VOCAB, N_EMBD, 1.0)
    if arch not in ("gemma", "gemma2", "gemma3"):  # the gemmas tie the output to token_embd
        mat("output.weight", N_VOCAB, N_EMBD, 0.5)
    vec("output_norm.weight", N_EMBD)
    qd, kvd = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    for il in range(n_layer):
        p = f"blk.{il}."
        vec(p + "attn_norm.weight", N_EMBD)
        if arch == "phi3":          # q, k and v in one matrix
            mat(p + "attn_qkv.weight", qd + 2 * kvd, N_EMBD, 0.15)
        else:
            mat(p + "attn_q.weight", qd, N_EMBD, 0.15)
            mat(p + "attn_k.weight", kvd, N_EMBD, 0.15)
            mat(p + "attn_v.weight", kvd, N_EMBD, 0.1)
        mat(p + "attn_output.weight", N_EMBD, qd, 0.06)
        if arch == "qwen2":
            for n, d in (("q", qd), ("k", kvd), ("v", kvd)):
                vec(p + f"attn_{n}.bias", d, 0.0, 0.3)
        if arch in ("gemma3", "qwen3", "qwen3vl"):
            vec(p + "attn_q_norm.weight", HEAD_DIM)
            vec(p + "attn_k_norm.weight", HEAD_DIM)
        if arch in ("gemma2", "gemma3"):
            vec(p + "post_attention_norm.weight", N_EMBD)
            vec(p + "post_ffw_norm.weight", N_EMBD)
        vec(p + "ffn_norm.weight", N_EMBD)
        if experts:                 # the router stays F32, as llama.cpp's quantize leaves it (logits of std ~1.3:
                                    # the used experts share a token, so their weights matter)
            add(p + "ffn_gate_inp.weight", rng.normal(0, 0.08, size=(N_EXPERT, N_EMBD)).astype(np.float32))
            experts_of(p + "ffn_gate_exps.weight", N_FF_EXP, N_EMBD, 0.1)
            experts_of(p + "ffn_up_exps.weight", N_FF_EXP, N_EMBD, 0.1)
            experts_of(p + "ffn_down_exps.weight", N_EMBD, N_FF_EXP, 0.05)
        elif arch == "phi3":        # gate and up in one matrix, the gate first
            mat(p + "ffn_up.weight", 2 * N_FF, N_EMBD, 0.1)
        else:
            mat(p + "ffn_gate.weight", N_FF, N_EMBD, 0.1)
            mat(p + "ffn_up.weight", N_FF, N_EMBD, 0.1)
        if not experts:
            mat(p + "ffn_down.weight", N_EMBD, N_FF, 0.05)
    for name, data in (extra or {}).items():
        add(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_gguf")


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    """tiny_model(arch, qtype, rope_base=None, rope_scaling=None, f32_twin=False, sliding_window=0, meta=(),
    experts=False) -> (GGUFFile, Tokenizer), written once per session."""
    made = {}

    def make(arch: str, qtype: str, rope_base: float | None = None, rope_scaling: str | None = None,
             f32_twin: bool = False, sliding_window: int = 0, meta: tuple = (), experts: bool = False):
        key = arch, qtype, rope_base, rope_scaling, f32_twin, sliding_window, repr(meta), experts
        if key not in made:
            name = f"{arch}-{qtype}" + (f"-rope{rope_base:g}" if rope_base else "") + (f"-{rope_scaling}" if rope_scaling else "")
            name += (f"-swa{sliding_window}" if sliding_window else "") + (f"-meta{len(made)}" if meta else "")
            name += "-moe" if experts else ""
            path = write_tiny_model(tiny_model_dir / f"{name}{'-twin' if f32_twin else ''}.gguf", arch, qtype,
                                    rope_base=rope_base, rope_scaling=rope_scaling, f32_twin=f32_twin,
                                    sliding_window=sliding_window, meta=meta, experts=experts)
            g = open_model(path)
            made[key] = (g, Tokenizer.from_gguf(g))
        return made[key]

    return make


def requantize(src: Path, dst: Path, ftype: int, allow_requantize: bool = False) -> Path:
    """llama.cpp's own quantizer (llama_model_quantize): types gguf-py cannot write, on a tiny model,
    or another type for a registry model (allow_requantize: its weights are quantized already)."""
    import ctypes

    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread, params.allow_requantize = ftype, 2, allow_requantize
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize failed for {src} -> {dst}")
    os.replace(tmp, dst)
    return dst


def requantized(src: Path, ftype_name: str) -> Path:
    """A registry model requantized to LLAMA_FTYPE_MOSTLY_<ftype_name>, made once into the user cache dir."""
    import llama_cpp

    from core.paths import cache_dir
    dst = cache_dir() / "requant" / f"{src.stem}-{ftype_name}.gguf"
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        requantize(src, dst, getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}"), allow_requantize=True)
    return dst
