"""Plain numpy references for the kernels: slow, simple, obviously correct. Tests only."""
from __future__ import annotations

import numpy as np


def dequantize_ref(raw: np.ndarray, ggml_type: int, n_cols: int) -> np.ndarray:
    """gguf-py's dequantizer, the spec for every block layout -> float32 (n_rows, n_cols)."""
    import gguf

    data = np.ascontiguousarray(raw).view(np.uint8)
    out = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(ggml_type))
    return np.asarray(out, dtype=np.float32).reshape(-1, n_cols)


def matmul_ref(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y = x @ W.T in float64; w (N, K), x (K,) or (M, K)."""
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T


def rms_norm_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * w).astype(np.float32)


def rope_ref(x: np.ndarray, positions: np.ndarray, theta: float, neox: bool, n_rot: int | None = None) -> np.ndarray:
    """ggml_rope (freq_scale 1, no YaRN). x (T, H, hd). Dims >= n_rot pass through.

    The angles are ggml's: theta_scale = powf(base, -2/n_rot) and, per position, theta = pos then
    theta *= theta_scale pair by pair, in float32 (at position 4000 they are ~1e-4 rad off the
    exact pos * base^(-2i/n_rot); llama.cpp's model runs with these). The rest is float64."""
    T, H, hd = x.shape
    n_rot = hd if n_rot is None else n_rot
    theta_scale = np.power(np.float32(theta), np.float32(-2.0) / np.float32(n_rot), dtype=np.float32)
    out = x.astype(np.float64).copy()
    for t in range(T):
        ang = np.float32(positions[t])
        for i in range(n_rot // 2):
            c, s = np.cos(np.float64(ang)), np.sin(np.float64(ang))
            ang = np.float32(ang * theta_scale)
            a, b = (i, i + n_rot // 2) if neox else (2 * i, 2 * i + 1)
            x0, x1 = x[t, :, a].astype(np.float64), x[t, :, b].astype(np.float64)
            out[t, :, a] = x0 * c - x1 * s
            out[t, :, b] = x0 * s + x1 * c
    return out.astype(np.float32)


def silu_ref(x):
    x = np.asarray(x, np.float64)
    return x / (1.0 + np.exp(-x))


def gelu_tanh_ref(x):
    x = np.asarray(x, np.float64)
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def swiglu_ref(gate, up):
    return (silu_ref(gate) * up).astype(np.float32)


def geglu_tanh_ref(gate, up):
    """ggml's GELU (GGML_GELU_FP16): gelu of the float16-rounded gate, rounded to float16, for
    -10 < gate < 10; 0 below, gate itself above; times up."""
    g = np.asarray(gate, np.float32)
    table_value = gelu_tanh_ref(g.astype(np.float16)).astype(np.float16).astype(np.float64)
    gelu = np.where(g <= -10, 0.0, np.where(g >= 10, g.astype(np.float64), table_value))
    return (gelu * np.asarray(up, np.float64)).astype(np.float32)


def softmax_ref(x, axis=-1):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True)).astype(np.float32)


def gather_kv_ref(cache: np.ndarray, block_table: np.ndarray, n: int) -> np.ndarray:
    """Paged cache (n_blocks, bs, Hkv, hd) -> contiguous first n tokens (n, Hkv, hd)."""
    bs = cache.shape[1]
    return np.stack([cache[block_table[p // bs], p % bs] for p in range(n)]) if n else cache[:0, 0]


def attention_ref(q, k, v, q_start: int, scale: float, window: int = 0) -> np.ndarray:
    """Causal (optionally sliding-window) GQA attention by explicit softmax, in float64.

    q (T, Hq, hd) at positions q_start.., k/v (N, Hkv, hd) at positions 0..N-1.
    Key j is visible to the query at position p iff j <= p and (window == 0 or p - j < window),
    which is llama.cpp's is_masked_swa (masked when p - j >= n_swa).
    """
    T, Hq, hd = q.shape
    N, Hkv, _ = k.shape
    group = Hq // Hkv
    p = q_start + np.arange(T)[:, None]
    j = np.arange(N)[None, :]
    visible = j <= p
    if window > 0:
        visible &= (p - j) < window
    out = np.empty((T, Hq, hd), np.float64)
    for h in range(Hq):
        kh, vh = k[:, h // group].astype(np.float64), v[:, h // group].astype(np.float64)
        s = q[:, h].astype(np.float64) @ kh.T * scale
        s = np.where(visible, s, -np.inf)
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        out[:, h] = (s / s.sum(axis=-1, keepdims=True)) @ vh
    return out.astype(np.float32)


_K_QUANT_F16_FIELDS = {12: (0, 4), 13: (0, 4), 14: (208, 210)}  # Q4_K d+dmin, Q5_K d+dmin, Q6_K d


def _fma32(a, b, c):
    """float32 a*b + c with one rounding, through float64 (exact product; the double rounding of
    the sum differs from a true fma in about one case in 2**29)."""
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(np.float32)


def ggml_expf_ref(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf (llama.cpp's vec.h, AVX-512) in numpy: 2^n * poly(b) with n = round(x*log2 e)."""
    x = np.asarray(x, np.float32)
    f = lambda h: np.float32(float.fromhex(h))  # noqa: E731
    r = f("0x1.8p23")
    n = _fma32(x, f("0x1.715476p+0"), r) - r
    b = _fma32(-n, f("0x1.7f7d1cp-20"), _fma32(-n, f("0x1.62e4p-1"), x))
    u = b * b
    j = _fma32(_fma32(_fma32(f("0x1.0e4020p-7"), b, f("0x1.573e2ep-5")), u, _fma32(f("0x1.555e66p-3"), b, f("0x1.fffdb6p-2"))),
               u, _fma32(f("0x1.ffffecp-1"), b, np.float32(1.0)))
    with np.errstate(over="ignore", invalid="ignore"):
        res = (np.ldexp(j.astype(np.float64), np.clip(n, -300, 300).astype(np.int64))).astype(np.float32)
    return np.where(np.abs(n) > 192, np.where(n > 0, np.float32(np.inf), np.float32(0.0)), res)


def attention_f16p_ref(q, k, v, q_start: int, scale: float, window: int = 0) -> np.ndarray:
    """attention_ref with llama.cpp's (no flash attention) softmax, which the CPU kernels follow:
    scores s = (q.k) * scale in float32 (the dot as a chain of fused multiply-adds along head_dim);
    e = ggml_v_expf(s - max); the row sum in float64 of the float32 sums of 16-key chunks (keys
    16c..16c+15, added as _mm512_reduce_add_ps adds them); the probabilities e * float32(1/sum)
    rounded to float16 before they weight V."""
    T, Hq, hd = q.shape
    N, Hkv, _ = k.shape
    group = Hq // Hkv
    p = q_start + np.arange(T)[:, None]
    j = np.arange(N)[None, :]
    visible = j <= p
    if window > 0:
        visible &= (p - j) < window
    n_chunks = -(-N // 16)
    out = np.empty((T, Hq, hd), np.float64)
    for h in range(Hq):
        kh, vh = k[:, h // group], v[:, h // group].astype(np.float64)
        qh = q[:, h].astype(np.float32)
        s = np.zeros((T, N), np.float32)
        for e in range(hd):
            s = _fma32(qh[:, e:e + 1], kh[None, :, e], s)
        s = np.where(visible, s * np.float32(scale), np.float32(-np.inf))
        m = s.max(axis=-1, keepdims=True)
        e = np.where(visible, ggml_expf_ref(np.where(visible, s - m, 0)), np.float32(0.0))
        lanes = np.zeros((T, n_chunks * 16), np.float32)
        lanes[:, :N] = e
        lanes = lanes.reshape(T, n_chunks, 16)
        t = lanes[..., :8] + lanes[..., 8:]                      # (T, n_chunks, 8)
        u = t[..., :4] + t[..., 4:]
        chunk = (u[..., 0] + u[..., 2]) + (u[..., 1] + u[..., 3])  # float32 per chunk
        inv = (1.0 / chunk.astype(np.float64).sum(axis=-1)).astype(np.float32)[:, None]
        probs = (e * inv).astype(np.float16).astype(np.float64)
        out[:, h] = probs @ vh
    return out.astype(np.float32)


def random_quantized(ggml_type: int, n_rows: int, n_cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid GGUF blocks (n_rows, row_bytes) uint8 for tests.

    Types gguf-py can quantize are quantized from N(0, 1) data; for the K-quants (gguf-py has
    no quantizer) the blocks are random bytes with the f16 scale fields overwritten by sane
    finite values, which exercises every bit of the quant and 6-bit scale fields.
    """
    import gguf

    qtype = gguf.GGMLQuantizationType(ggml_type)
    blk, size = gguf.GGML_QUANT_SIZES[qtype]
    if ggml_type in _K_QUANT_F16_FIELDS:
        raw = rng.integers(0, 256, size=(n_rows, n_cols // blk, size), dtype=np.uint8)
        a, b = _K_QUANT_F16_FIELDS[ggml_type]
        scales = rng.uniform(1e-3, 2e-2, size=(n_rows, n_cols // blk, (b - a) // 2)).astype(np.float16)
        raw[..., a:b] = scales.view(np.uint8).reshape(n_rows, n_cols // blk, b - a)
        return raw.reshape(n_rows, -1)
    data = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
    q = gguf.quants.quantize(data, qtype)
    return np.ascontiguousarray(q).view(np.uint8).reshape(n_rows, -1)
