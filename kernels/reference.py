"""Plain numpy references for the kernels: slow, simple, obviously correct. Tests only."""
from __future__ import annotations

import numpy as np

from kernels.cpu.libm import rope_theta_scale
from kernels.types import BF16, F16, IQ4_NL, IQ4_NL_VALUES, IQ4_XS, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K


def dequantize_ref(raw: np.ndarray, ggml_type: int, n_cols: int) -> np.ndarray:
    """gguf-py's dequantizer, the spec for every block layout -> float32 (n_rows, n_cols)."""
    import gguf

    data = np.ascontiguousarray(raw).view(np.uint8)
    out = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(ggml_type))
    return np.asarray(out, dtype=np.float32).reshape(-1, n_cols)


def rms_norm_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * w).astype(np.float32)


def rope_ref(x: np.ndarray, positions: np.ndarray, theta: float, neox: bool, n_rot: int | None = None,
             freq_factors=None, freq_scale: float = 1.0, attn_factor: float = 1.0) -> np.ndarray:
    """ggml_rope_ext without YaRN (pair i's angle freq_scale * theta / freq_factors[i]; cos and sin
    times attn_factor). x (T, H, hd).
    Dims >= n_rot pass through.

    The angles are ggml's: theta_scale = powf(base, -2/n_rot) and, per position, theta = pos then
    theta *= theta_scale pair by pair, in float32 (at position 4000 they are ~1e-4 rad off the
    exact pos * base^(-2i/n_rot); llama.cpp's model runs with these). The rest is float64."""
    T, H, hd = x.shape
    n_rot = hd if n_rot is None else n_rot
    theta_scale = rope_theta_scale(theta, n_rot)
    out = x.astype(np.float64).copy()
    for t in range(T):
        ang = np.float32(positions[t])
        for i in range(n_rot // 2):
            turn = np.float64(ang) / (1.0 if freq_factors is None else np.float64(freq_factors[i])) * freq_scale
            c, s = np.cos(turn) * attn_factor, np.sin(turn) * attn_factor
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


def attention_ref(q, k, v, q_start: int, scale: float, window: int = 0, softcap: float = 0.0) -> np.ndarray:
    """Causal (optionally sliding-window) GQA attention by explicit softmax, in float64; with
    softcap > 0 the scores q.k are soft-capped (cap * tanh(s / cap), gemma2) before the scale.

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
        s = q[:, h].astype(np.float64) @ kh.T
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        s = s * scale
        s = np.where(visible, s, -np.inf)
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        out[:, h] = (s / s.sum(axis=-1, keepdims=True)) @ vh
    return out.astype(np.float32)


# types gguf-py cannot quantize: random blocks with these f16 fields (Q4_K d+dmin, Q5_K d+dmin, Q6_K d, IQ4_NL d)
_K_QUANT_F16_FIELDS = {Q4_K: (0, 4), Q5_K: (0, 4), Q6_K: (208, 210), IQ4_NL: (0, 2),
                       Q2_K: (80, 84), Q3_K: (108, 110), IQ4_XS: (0, 2)}   # Q2_K d+dmin, Q3_K d, IQ4_XS d


# --- llama.cpp's AVX2 arithmetic, float operation for float operation --------------------------
# What the exact kernels (kernels/cpu/qdot/, the attention kernels) must equal bit for bit. Each
# is written from llama.cpp 0.3.36's ggml-cpu sources (named in the docstrings) in plain numpy.

def fma32(a, b, c):
    """float32 a * b + c rounded once: the exact float64 product plus c, rounded to odd in float64
    (TwoSum tells whether the sum was exact), then to float32. Rounding to odd first makes the
    second rounding the correct one (53 >= 24 + 2 bits)."""
    a, b, c = (np.asarray(v, np.float32) for v in (a, b, c))
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + c64
        bb = s - p
        err = (p - (s - bb)) + (c64 - bb)
    inexact_even = (err != 0) & ((s.view(np.int64) & 1) == 0)
    s = np.where(inexact_even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def hsum8_ref(acc):
    """hsum_float_8 / tinyBLAS hsum over the last axis (8): ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))."""
    r = (acc[..., 4:] + acc[..., :4]).astype(np.float32)
    return ((r[..., 0] + r[..., 2]) + (r[..., 1] + r[..., 3])).astype(np.float32)


def reduce4x8_ref(s):
    """GGML_F32x8_REDUCE of ggml_vec_dot_f16's accumulators (..., 4, 8)."""
    x0 = ((s[..., 0, :] + s[..., 2, :]).astype(np.float32) + (s[..., 1, :] + s[..., 3, :]).astype(np.float32))
    x0 = x0.astype(np.float32)
    t = (x0[..., :4] + x0[..., 4:]).astype(np.float32)
    return ((t[..., 0] + t[..., 1]) + (t[..., 2] + t[..., 3])).astype(np.float32)


_EXP = {k: np.float32(float.fromhex(h)) for k, h in dict(
    R="0x1.8p23", L2E="0x1.715476p+0", LN2HI="0x1.62e4p-1", LN2LO="0x1.7f7d1cp-20", C5="0x1.0e4020p-7",
    C4="0x1.573e2ep-5", C3="0x1.555e66p-3", C2="0x1.fffdb6p-2", C1="0x1.ffffecp-1").items()}


def ggml_expf_ref(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf of the AVX2 build (vec.h): k = 2^n from the exponent bits, fma(k, j, k); for
    126 < |n| <= 192 (s2*j + s2)*s1, beyond s1*s1."""
    E = _EXP
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        z = fma32(x, E["L2E"], E["R"])
        n = (z - E["R"]).astype(np.float32)
        b = fma32(-n, E["LN2LO"], fma32(-n, E["LN2HI"], x))
        e = (z.view(np.uint32).astype(np.uint64) << np.uint64(23)) & np.uint64(0xFFFFFFFF)
        k = ((e + np.uint64(0x3F800000)) & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.float32)
        u = (b * b).astype(np.float32)
        j = fma32(fma32(fma32(E["C5"], b, E["C4"]), u, fma32(E["C3"], b, E["C2"])), u, (E["C1"] * b).astype(np.float32))
        g = np.where(n <= 0, np.uint64(0x82000000), np.uint64(0))
        s1 = ((g + np.uint64(0x7F000000)) & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.float32)
        s2 = ((e - g) & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.float32)
        big = np.where(np.abs(n) > 192, (s1 * s1).astype(np.float32), (fma32(s2, j, s2) * s1).astype(np.float32))
        return np.where(np.abs(n) > 126, big, fma32(k, j, k)).astype(np.float32)


def softmax_llama_ref(s: np.ndarray, scale: float, visible: np.ndarray) -> np.ndarray:
    """ggml_compute_forward_soft_max_f32 (AVX2) over rows of cells 0..N-1 (N % 8 == 0), then the
    float16 rounding of the product that follows: x = s * scale (-inf where not visible),
    e = ggml_v_expf(x - max), sum in float64 of each 8-cell chunk's hsum_float_8, e * float32(1/sum)."""
    x = np.where(visible, (np.asarray(s, np.float32) * np.float32(scale)).astype(np.float32), np.float32(-np.inf))
    e = ggml_expf_ref(x - x.max(axis=-1, keepdims=True))
    N = s.shape[-1]
    tot = hsum8_ref(e.reshape(e.shape[:-1] + (N // 8, 8))).astype(np.float64).sum(axis=-1)
    inv = (1.0 / tot).astype(np.float32)
    return (e * inv[..., None]).astype(np.float32).astype(np.float16).astype(np.float32)


def dot_f16_tinyblas_ref(a, b):
    """tinyBLAS<8, __m256> float16 product of rows a (..., L) and b (..., L) (float32 holding
    float16 values): element l to lane l % 8, fma chains in order, hsum at the end; L % 8 == 0."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    acc = np.zeros(np.broadcast_shapes(a.shape, b.shape)[:-1] + (8,), np.float32)
    for i in range(0, a.shape[-1], 8):
        acc = fma32(a[..., i:i + 8], b[..., i:i + 8], acc)
    return hsum8_ref(acc)


def dot_f16_vec_ref(a, b):
    """ggml_vec_dot_f16 (AVX2): element e to accumulator (e // 8) % 4, lane e % 8, chains in steps of
    32, GGML_F32x8_REDUCE; L % 32 == 0."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    acc = np.zeros(np.broadcast_shapes(a.shape, b.shape)[:-1] + (4, 8), np.float32)
    for i in range(0, a.shape[-1], 32):
        acc = fma32(a[..., i:i + 32].reshape(a.shape[:-1] + (4, 8)), b[..., i:i + 32].reshape(b.shape[:-1] + (4, 8)), acc)
    return reduce4x8_ref(acc)


def attention_llama_ref(q, k, v, q_start: int, scale: float, window: int = 0, batched: bool = True) -> np.ndarray:
    """llama.cpp's attention without flash attention (AVX2 build). q (T, Hq, hd) float16 values, k, v
    (N, Hkv, hd) the float16 cache (cells 0..N-1 = positions). Scores and output are float16
    products over the cells (padded with zeros to a multiple of 32), tinyBLAS for a batch of
    tokens, ggml_vec_dot_f16 for one (batched=False)."""
    T, Hq, hd = q.shape
    N, Hkv, _ = k.shape
    Np = -(-N // 32) * 32
    kp, vp = np.zeros((Np, Hkv, hd), np.float32), np.zeros((Np, Hkv, hd), np.float32)
    kp[:N], vp[:N] = k, v
    p = q_start + np.arange(T)[:, None]
    j = np.arange(Np)[None, :]
    visible = (j <= p) & (j < N)
    if window > 0:
        visible &= (p - j) < window
    dot = dot_f16_tinyblas_ref if batched else dot_f16_vec_ref
    out = np.empty((T, Hq, hd), np.float32)
    for h in range(Hq):
        kh, vh = kp[:, h // (Hq // Hkv)], vp[:, h // (Hq // Hkv)]
        s = dot(np.asarray(q, np.float32)[:, h, None, :], kh[None])                   # (T, Np)
        prob = softmax_llama_ref(s, scale, visible)
        out[:, h] = dot(prob[:, None, :], vh.T[None])                                 # (T, hd)
    return out


def quantize_q8_0_ref(x):
    """quantize_row_q8_0 (AVX2): per 32 d = f16(amax / 127), q = rint(x * float32(127 / amax));
    and quantize_row_q8_1's s = f16(d * float(sum q)) with d before its f16 rounding."""
    x = np.asarray(x, np.float32)
    xb = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        idv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint((xb * idv).astype(np.float32)).astype(np.int8)
    d32 = (amax[..., 0] / np.float32(127)).astype(np.float32)
    with np.errstate(over="ignore"):                  # beyond f16: inf, as llama.cpp's conversion gives
        s = (d32 * q.astype(np.int32).sum(-1).astype(np.float32)).astype(np.float16).astype(np.float32)
    return q.reshape(x.shape), d32.astype(np.float16).astype(np.float32), s


def quantize_q8_k_ref(x):
    """quantize_row_q8_K_ref: per 256 the first value of largest magnitude maps to -127."""
    x = np.asarray(x, np.float32)
    xb = x.reshape(x.shape[0], -1, 256)
    vmax = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)
    with np.errstate(divide="ignore"):
        iscale = np.where(vmax != 0, np.float32(-127) / vmax, np.float32(0)).astype(np.float32)
        d = np.where(iscale != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)[..., 0]
    q = np.minimum(127, np.rint((iscale * xb).astype(np.float32))).astype(np.int8)
    return q.reshape(x.shape), d


def _f16(raw):
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def unpack_q8_0(raw, K):
    """GGUF Q8_0 rows -> (d (N, nb), values (N, K) int)."""
    k = np.asarray(raw).view(np.uint8).reshape(-1, K // 32, 34)
    return _f16(k[..., :2]), k[..., 2:].view(np.int8).reshape(-1, K).astype(np.int32)


def unpack_q5_0(raw, K):
    """GGUF Q5_0 rows -> (d (N, nb), values q - 16 (N, K) int)."""
    k = np.asarray(raw).view(np.uint8).reshape(-1, K // 32, 22)
    qh = np.ascontiguousarray(k[..., 2:6]).view("<u4")[..., 0]
    q = np.concatenate([(k[..., 6:22] & 15), (k[..., 6:22] >> 4)], -1).astype(np.int32)
    bits = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int32)
    return _f16(k[..., :2]), ((q | (bits << 4)) - 16).reshape(-1, K)


def unpack_q4_0(raw, K):
    """GGUF Q4_0 rows -> (d (N, nb), values q - 8 (N, K) int)."""
    k = np.asarray(raw).view(np.uint8).reshape(-1, K // 32, 18)
    q = np.concatenate([(k[..., 2:18] & 15), (k[..., 2:18] >> 4)], -1).astype(np.int32)
    return _f16(k[..., :2]), (q - 8).reshape(-1, K)


def unpack_q4_1(raw, K):
    """GGUF Q4_1 rows -> (d, m (N, nb), values q (N, K) int, unsigned)."""
    k = np.asarray(raw).view(np.uint8).reshape(-1, K // 32, 20)
    q = np.concatenate([(k[..., 4:20] & 15), (k[..., 4:20] >> 4)], -1).astype(np.int32)
    return _f16(k[..., 0:2]), _f16(k[..., 2:4]), q.reshape(-1, K)


def unpack_q5_1(raw, K):
    """GGUF Q5_1 rows -> (d, m (N, nb), values q (N, K) int, unsigned)."""
    k = np.asarray(raw).view(np.uint8).reshape(-1, K // 32, 24)
    qh = np.ascontiguousarray(k[..., 4:8]).view("<u4")[..., 0]
    q = np.concatenate([(k[..., 8:24] & 15), (k[..., 8:24] >> 4)], -1).astype(np.int32)
    bits = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int32)
    return _f16(k[..., 0:2]), _f16(k[..., 2:4]), (q | (bits << 4)).reshape(-1, K)


def unpack_iq4_nl(raw, K):
    """GGUF IQ4_NL rows -> (d (N, nb), levels (N, K) int)."""
    k = np.asarray(raw).view(np.uint8).reshape(-1, K // 32, 18)
    q = np.concatenate([(k[..., 2:18] & 15), (k[..., 2:18] >> 4)], -1)
    return _f16(k[..., :2]), IQ4_NL_VALUES.astype(np.int32)[q].reshape(-1, K)


def unpack_q4_k(raw, K):
    """GGUF Q4_K rows -> d, dmin (N, nb), q (N, nb, 256) 0..15, sc, mn (N, nb, 8)."""
    k = np.asarray(raw).view(np.uint8).reshape(-1, K // 256, 144)
    s = k[..., 4:16].astype(np.int32)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    qs = k[..., 16:144].reshape(k.shape[0], K // 256, 4, 32).astype(np.int32)
    q = np.stack([qs & 15, qs >> 4], axis=-2).reshape(k.shape[0], K // 256, 256)
    return _f16(k[..., 0:2]), _f16(k[..., 2:4]), q, sc, mn


def unpack_q5_k(raw, K):
    """GGUF Q5_K rows -> d, dmin (N, nb), q (N, nb, 256) 0..31, sc, mn (N, nb, 8)."""
    k = np.asarray(raw).view(np.uint8).reshape(-1, K // 256, 176)
    s = k[..., 4:16].astype(np.int32)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    qs = k[..., 48:176].reshape(k.shape[0], K // 256, 4, 32).astype(np.int32)
    qh = k[..., 16:48].astype(np.int32)                                              # (N, nb, 32)
    hi = (qh[..., None, :] >> np.arange(8)[:, None]) & 1                              # (N, nb, 8, 32)
    q = np.stack([qs & 15, qs >> 4], axis=-2).reshape(k.shape[0], K // 256, 8, 32) | (hi << 4)
    return _f16(k[..., 0:2]), _f16(k[..., 2:4]), q.reshape(k.shape[0], K // 256, 256), sc, mn


def unpack_q6_k(raw, K):
    """GGUF Q6_K rows -> d (N, nb), q (N, nb, 256) unsigned 0..63, sc (N, nb, 16)."""
    k = np.asarray(raw).view(np.uint8).reshape(-1, K // 256, 210)
    q = np.empty(k.shape[:2] + (256,), np.int32)
    for h in range(2):
        a = k[..., 64 * h:64 * h + 32].astype(np.int32)
        b = k[..., 64 * h + 32:64 * h + 64].astype(np.int32)
        hb = k[..., 128 + 32 * h:128 + 32 * h + 32].astype(np.int32)
        q[..., 128 * h:128 * h + 32] = (a & 15) | ((hb & 3) << 4)
        q[..., 128 * h + 32:128 * h + 64] = (b & 15) | (((hb >> 2) & 3) << 4)
        q[..., 128 * h + 64:128 * h + 96] = (a >> 4) | (((hb >> 4) & 3) << 4)
        q[..., 128 * h + 96:128 * h + 128] = (b >> 4) | (((hb >> 6) & 3) << 4)
    return _f16(k[..., 208:210]), q, k[..., 192:208].view(np.int8).astype(np.int32)


def matmul_q0_ref(d_w, w, d_x, xq):
    """Q8_0 / Q5_0 against q8_0 rows: ggml_vec_dot_q*_q8_0 (one row) = tinyBLAS_Q0_AVX (several):
    per output 8 lanes, lane k of block b += (d_w * d_x) * (sum of the 4 products at 4k..4k+3)
    (one fma), hsum_float_8 at the end. (M, K) x (N, K) -> (M, N)."""
    M, K = xq.shape
    N, nb = w.shape[0], K // 32
    isum = (np.asarray(xq, np.int64)[:, None, :] * np.asarray(w, np.int64)[None]).reshape(M, N, nb, 8, 4).sum(-1)
    d = (d_x[:, None, :] * d_w[None]).astype(np.float32)
    acc = np.zeros((M, N, 8), np.float32)
    for b in range(nb):
        acc = fma32(d[:, :, b, None], isum[:, :, b].astype(np.float32), acc)
    return hsum8_ref(acc)


def round_activation_ref(x, ggml_type: int):
    """The activation llama.cpp's matmul converts x to for F32 (as is), F16 and BF16 weights (nearest,
    ties to even)."""
    x = np.asarray(x, np.float32)
    if ggml_type == F16:
        return x.astype(np.float16).astype(np.float32)
    if ggml_type == BF16:
        u = x.view(np.uint32).astype(np.uint64)
        return (((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)).view(np.float32)
    return x


def matmul_dense_ref(w, x, ggml_type: int, tiny: bool):
    """F32 / F16 / BF16 weights w (N, K) (float32 values) against rounded rows x (M, K). tiny
    (tinyBLAS): per output one 8-lane fma chain, hsum. Otherwise ggml_vec_dot_f32/_f16/_bf16: four
    accumulators over 32-element steps; F32/F16 GGML_F32x8_REDUCE, BF16 (c0+c2)+(c1+c3) and hsum."""
    M, K = x.shape
    N = w.shape[0]
    wb = np.broadcast_to(w[None], (M, N, K))
    xb = np.broadcast_to(x[:, None], (M, N, K))
    if tiny:
        acc = np.zeros((M, N, 8), np.float32)
        for l in range(0, K, 8):
            acc = fma32(wb[..., l:l + 8], xb[..., l:l + 8], acc)
        return hsum8_ref(acc)
    acc = np.zeros((M, N, 4, 8), np.float32)
    for i in range(0, K, 32):
        for j in range(4):
            sl = slice(i + 8 * j, i + 8 * j + 8)
            acc[..., j, :] = fma32(wb[..., sl], xb[..., sl], acc[..., j, :])
    if ggml_type == BF16:
        return hsum8_ref(((acc[..., 0, :] + acc[..., 2, :]).astype(np.float32)
                          + (acc[..., 1, :] + acc[..., 3, :]).astype(np.float32)).astype(np.float32))
    return reduce4x8_ref(acc)


def matmul_q1_ref(d_w, m_w, w, d_x, s_x, xq):
    """Q4_1 / Q5_1 against q8_1 rows (ggml_vec_dot_q*_1_q8_1, AVX2, for every row count): per output
    8 lanes as matmul_q0_ref with the unsigned values, and summs = fma(m_w, s_x, summs) per block;
    result hsum_float_8 + summs. (M, K) x (N, K) -> (M, N)."""
    M, K = xq.shape
    N, nb = w.shape[0], K // 32
    summs = np.zeros((M, N), np.float32)
    for b in range(nb):
        summs = fma32(np.broadcast_to(m_w[None, :, b], (M, N)), np.broadcast_to(s_x[:, None, b], (M, N)), summs)
    return (matmul_q0_ref(d_w, w, d_x, xq) + summs).astype(np.float32)


def matmul_q4_0_8x8_ref(d_w, w, d_x, xq):
    """Q4_0 / IQ4_NL against q8_0 rows, llama.cpp's repacked kernels (ggml_gemv/gemm_q4_0_8x8_q8_0,
    iq4_nl's; the same numbers): per output acc = fma(float(the block's integer dot), d_w * d_x, acc),
    block by block. (M, K) x (N, K) -> (M, N)."""
    M, K = xq.shape
    N, nb = w.shape[0], K // 32
    isum = (np.asarray(xq, np.int64)[:, None, :] * np.asarray(w, np.int64)[None]).reshape(M, N, nb, 32).sum(-1)
    d = (d_w[None] * d_x[:, None, :]).astype(np.float32)
    acc = np.zeros((M, N), np.float32)
    for b in range(nb):
        acc = fma32(isum[:, :, b].astype(np.float32), d[:, :, b], acc)
    return acc


def matmul_q4_k_ref(unpacked, d_x, xq, per_pair: bool):
    """Q4_K against q8_K rows, llama.cpp's repacked 8x8 kernels: ints I = sum sc_j dot_j and
    Mn = sum mn_j bsum32_j, acc += float(I) * (d_w d_x), acc_min += float(Mn) * (dmin_w d_x), result
    acc - acc_min; one step per super-block (gemv) or per sub-block pair (gemm: per_pair)."""
    d_w, dmin_w, q, sc, mn = unpacked
    M, K = xq.shape
    N, nb = q.shape[0], K // 256
    x = np.asarray(xq, np.int64).reshape(M, nb, 256)
    acc, accm = np.zeros((M, N), np.float32), np.zeros((M, N), np.float32)
    for b in range(nb):
        dot = (q[None, :, b, :].astype(np.int64) * x[:, None, b, :]).reshape(M, N, 8, 32).sum(-1)
        bs = x[:, b, :].reshape(M, 8, 32).sum(-1)
        I, Mn = dot * sc[None, :, b, :], bs[:, None, :] * mn[None, :, b, :]
        dd = (d_w[None, :, b] * d_x[:, None, b]).astype(np.float32)
        dm = (dmin_w[None, :, b] * d_x[:, None, b]).astype(np.float32)
        for j0, j1 in ([(0, 2), (2, 4), (4, 6), (6, 8)] if per_pair else [(0, 8)]):
            acc = fma32(I[..., j0:j1].sum(-1).astype(np.int32).astype(np.float32), dd, acc)
            accm = fma32(Mn[..., j0:j1].sum(-1).astype(np.int32).astype(np.float32), dm, accm)
    return (acc - accm).astype(np.float32)


def matmul_q6_k_ref(unpacked, d_x, xq, tiled: bool):
    """Q6_K against q8_K rows. vec_dot (ggml_vec_dot_q6_K_q8_K, AVX2): per super-block 8 int lanes,
    lane l = offsets 4l..4l+3 of every 32-chunk times the chunk half's scale, minus 32 *
    (sc bsum16) of 16-groups 2l and 2l+1; fma(d_x d_w, lane, acc); hsum at the end. tiled
    (tiled_run_microtile_avx2<16, false, 32, true>): S = sum_s sc_s sum (q - 32) x per super-block,
    out = fma(d_w * float(S), d_x, out)."""
    d_w, q, sc = unpacked
    M, K = xq.shape
    N, nb = q.shape[0], K // 256
    x = np.asarray(xq, np.int64).reshape(M, nb, 256)
    acc = np.zeros((M, N) if tiled else (M, N, 8), np.float32)
    for b in range(nb):
        if tiled:
            prod = (q[None, :, b, :].astype(np.int64) - 32) * x[:, None, b, :]
            S = (prod.reshape(M, N, 16, 16).sum(-1) * sc[None, :, b, :]).sum(-1)
            res = (d_w[None, :, b] * S.astype(np.float32)).astype(np.float32)
            acc = fma32(res, np.broadcast_to(d_x[:, None, b], res.shape), acc)
        else:
            prod = q[None, :, b, :].astype(np.int64) * x[:, None, b, :] * np.repeat(sc[:, b, :], 16, -1)[None]
            lane = prod.reshape(M, N, 8, 8, 4).sum(-1).sum(2)
            bs16 = x[:, b, :].reshape(M, 16, 16).sum(-1)
            sub = 32 * (sc[None, :, b, :] * bs16[:, None, :]).reshape(M, N, 8, 2).sum(-1)
            d = (d_x[:, None, b] * d_w[None, :, b]).astype(np.float32)
            acc = fma32(d[..., None], (lane - sub).astype(np.int32).astype(np.float32), acc)
    return acc if tiled else hsum8_ref(acc)


def matmul_q5_k_ref(unpacked, d_x, xq, tiled: bool):
    """Q5_K against q8_K rows. Both kernels take the ints lane l = sum_s sc_s (offsets 4l..4l+3 of
    sub-block s) and M = sum_s mn_s bsum32_s. vec_dot (ggml_vec_dot_q5_K_q8_K, AVX2): acc =
    fma(d_x d_w, float(lane), acc), summs = fma(-(d_x dmin_w), float(M), summs) (as the compiler fuses
    `summs += dmin * M`), result hsum_float_8(acc) + summs. tiled
    (tiled_run_microtile_avx2<32, true, 0, false>): S = sum of the lanes, res = d_w * float(S), then
    fnmadd: res = fma(-dmin_w, float(M), res), out = fma(res, d_x, out)."""
    d_w, dmin_w, q, sc, mn = unpacked
    M, K = xq.shape
    N, nb = q.shape[0], K // 256
    x = np.asarray(xq, np.int64).reshape(M, nb, 256)
    acc = np.zeros((M, N) if tiled else (M, N, 8), np.float32)
    summs = np.zeros((M, N), np.float32)
    for b in range(nb):
        prod = q[None, :, b, :].astype(np.int64) * x[:, None, b, :] * np.repeat(sc[:, b, :], 32, -1)[None]
        lane = prod.reshape(M, N, 8, 8, 4).sum(-1).sum(2)                                # (M, N, 8)
        Mn = (x[:, b, :].reshape(M, 8, 32).sum(-1)[:, None, :] * mn[None, :, b, :]).sum(-1)
        Mf = Mn.astype(np.int32).astype(np.float32)
        if tiled:
            res = (d_w[None, :, b] * lane.sum(-1).astype(np.int32).astype(np.float32)).astype(np.float32)
            res = fma32(np.broadcast_to(-dmin_w[None, :, b], res.shape), Mf, res)
            acc = fma32(res, np.broadcast_to(d_x[:, None, b], res.shape), acc)
        else:
            d = (d_x[:, None, b] * d_w[None, :, b]).astype(np.float32)
            acc = fma32(d[..., None], lane.astype(np.int32).astype(np.float32), acc)
            dm = -(d_x[:, None, b] * dmin_w[None, :, b]).astype(np.float32)
            summs = fma32(dm, Mf, summs)
    return acc if tiled else (hsum8_ref(acc) + summs).astype(np.float32)


def unpack_q2_k(raw, K):
    """GGUF Q2_K rows -> d, dmin (N, nb), q (N, nb, 256) 0..3, sc, mn (N, nb, 16)."""
    k = np.asarray(raw).view(np.uint8).reshape(-1, K // 256, 84)
    qs = k[..., 16:80].reshape(k.shape[0], K // 256, 2, 1, 32).astype(np.int32)
    q = ((qs >> np.array([0, 2, 4, 6]).reshape(4, 1)) & 3).reshape(k.shape[0], K // 256, 256)
    s = k[..., 0:16].astype(np.int32)
    return _f16(k[..., 80:82]), _f16(k[..., 82:84]), q, s & 15, s >> 4


def unpack_q3_k(raw, K):
    """GGUF Q3_K rows -> d (N, nb), q (N, nb, 256) -4..3, sc (N, nb, 16) -32..31."""
    k = np.asarray(raw).view(np.uint8).reshape(-1, K // 256, 110)
    N, nb = k.shape[0], K // 256
    qs = k[..., 32:96].reshape(N, nb, 2, 1, 32).astype(np.int32)
    low = ((qs >> np.array([0, 2, 4, 6]).reshape(4, 1)) & 3).reshape(N, nb, 256)
    hi = ((k[..., None, 0:32].astype(np.int32) >> np.arange(8)[:, None]) & 1).reshape(N, nb, 256)
    s = k[..., 96:108].astype(np.int32)
    lo4 = np.concatenate([s[..., 0:8] & 15, s[..., 0:8] >> 4], -1)                        # (N, nb, 16)
    hi2 = ((s[..., None, 8:12] >> (2 * np.arange(4))[:, None]) & 3).reshape(N, nb, 16)
    return _f16(k[..., 108:110]), low + 4 * hi - 4, (lo4 | (hi2 << 4)) - 32


def unpack_iq4_xs(raw, K):
    """GGUF IQ4_XS rows -> d (N, nb), q (N, nb, 256) the levels, sc (N, nb, 8) -32..31."""
    k = np.asarray(raw).view(np.uint8).reshape(-1, K // 256, 136)
    N, nb = k.shape[0], K // 256
    sh = k[..., 2].astype(np.int32) | (k[..., 3].astype(np.int32) << 8)
    sl = k[..., 4:8].astype(np.int32)
    c = np.arange(8)
    ls = ((sl[..., c // 2] >> (4 * (c % 2))) & 15) | (((sh[..., None] >> (2 * c)) & 3) << 4)
    qs = k[..., 8:136].reshape(N, nb, 8, 16).astype(np.int32)
    q = IQ4_NL_VALUES.astype(np.int32)[np.concatenate([qs & 15, qs >> 4], -1)].reshape(N, nb, 256)
    return _f16(k[..., 0:2]), q, ls - 32


def _matmul_lanes_ref(d_w, dmin_w, w, sc16, mn16, d_x, xq, tiled: bool):
    """The 8-lane K-quant kernels (kernels.cpu.qdot.lanes: Q2_K, Q3_K, IQ4_XS) against q8_K rows.
    lane l = sum over the 8 chunks of sc16 * w * x at offsets 4l..4l+3; with minimums (mn16, Q2_K)
    P lane l = mn[2l] bsum16[2l] + mn[2l+1] bsum16[2l+1]. vec_dot: acc = fma(-(d_x dmin_w), float(P),
    acc), then acc = fma(d_x d_w, float(lane), acc), result hsum_float_8. tiled: res = d_w *
    float(sum lanes), res = fma(-dmin_w, float(sum P), res), out = fma(res, d_x, out).
    (M, K) x (N, K) -> (M, N)."""
    M, K = xq.shape
    N, nb = w.shape[0], K // 256
    x = np.asarray(xq, np.int64).reshape(M, nb, 256)
    acc = np.zeros((M, N) if tiled else (M, N, 8), np.float32)
    for b in range(nb):
        prod = w[None, :, b, :].astype(np.int64) * x[:, None, b, :] * np.repeat(sc16[:, b, :], 16, -1)[None]
        lane = prod.reshape(M, N, 8, 8, 4).sum(-1).sum(2).astype(np.int32)               # (M, N, 8)
        if mn16 is not None:
            bs = x[:, b, :].reshape(M, 16, 16).sum(-1)                                   # (M, 16)
            P = (bs[:, None, :] * mn16[None, :, b, :]).reshape(M, N, 8, 2).sum(-1).astype(np.int32)
        if tiled:
            res = (d_w[None, :, b] * lane.sum(-1).astype(np.int32).astype(np.float32)).astype(np.float32)
            if mn16 is not None:
                res = fma32(np.broadcast_to(-dmin_w[None, :, b], res.shape), P.sum(-1).astype(np.float32), res)
            acc = fma32(res, np.broadcast_to(d_x[:, None, b], res.shape), acc)
        else:
            if mn16 is not None:
                dm = -(d_x[:, None, b] * dmin_w[None, :, b]).astype(np.float32)
                acc = fma32(dm[..., None], P.astype(np.float32), acc)
            d = (d_x[:, None, b] * d_w[None, :, b]).astype(np.float32)
            acc = fma32(d[..., None], lane.astype(np.float32), acc)
    return acc if tiled else hsum8_ref(acc)


def matmul_q2_k_ref(unpacked, d_x, xq, tiled: bool):
    """Q2_K (ggml_vec_dot_q2_K_q8_K below 8 rows, tiled_run_microtile_avx2<16, true, 0, false> from 8)."""
    d_w, dmin_w, q, sc, mn = unpacked
    return _matmul_lanes_ref(d_w, dmin_w, q, sc, mn, d_x, xq, tiled)


def matmul_q3_k_ref(unpacked, d_x, xq, tiled: bool):
    """Q3_K (ggml_vec_dot_q3_K_q8_K below 8 rows, tiled_run_microtile_avx2<16, false, 4, true> from 8)."""
    d_w, q, sc = unpacked
    return _matmul_lanes_ref(d_w, None, q, sc, None, d_x, xq, tiled)


def matmul_iq4_xs_ref(unpacked, d_x, xq, tiled: bool):
    """IQ4_XS (ggml_vec_dot_iq4_xs_q8_K below 8 rows, tiled_run_microtile_avx2<32, false, 128, false> from 8)."""
    d_w, q, sc = unpacked
    return _matmul_lanes_ref(d_w, None, q, np.repeat(sc, 2, -1), None, d_x, xq, tiled)


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


def moe_route_ref(logits: np.ndarray, n_used: int, norm_weights: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's softmax gating of rows of router logits (T, E): ggml_soft_max (ggml_v_expf on 8
    lanes, each hsum_float_8 added in float64; the E % 8 tail with libm's expf, here float64's
    exp rounded, which equals expf for these inputs), ggml_argsort descending (equal values: the
    lower index first), the first n_used and their probabilities, divided by their float64 sum
    rounded to float32. -> (selected (T, k) int64, weights (T, k) float32)."""
    x = np.asarray(logits, np.float32)
    z = (x - x.max(axis=-1, keepdims=True)).astype(np.float32)
    n8 = x.shape[-1] // 8 * 8
    e = np.concatenate([ggml_expf_ref(z[:, :n8]), np.exp(z[:, n8:].astype(np.float64)).astype(np.float32)], axis=1)
    tot = hsum8_ref(e[:, :n8].reshape(len(x), -1, 8)).astype(np.float64).sum(axis=-1) + e[:, n8:].astype(np.float64).sum(axis=-1)
    p = (e * (1.0 / tot).astype(np.float32)[:, None]).astype(np.float32)
    sel = np.argsort(-p, axis=-1, kind="stable")[:, :n_used]
    w = np.take_along_axis(p, sel, axis=-1)
    if norm_weights:
        s = np.maximum(w.astype(np.float64).sum(axis=-1).astype(np.float32), np.float32(6.103515625e-5))
        w = (w / s[:, None]).astype(np.float32)
    return sel.astype(np.int64), w
