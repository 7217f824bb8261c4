"""Elementwise / row-wise ops of the transformer block (numba, float32)."""
from __future__ import annotations

import math
import types as pytypes
from contextlib import contextmanager
from typing import Sequence

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.cpu.libm import rope_theta_scale
from kernels.cpu.simd import WIDE

# fastmath without nnan/ninf: -inf is a legal input (masked logits).
FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}
# Below this many elements a kernel runs on the calling thread: waking the thread pool costs
# more than the work, and a parallel region stalls for a scheduler tick (4-12 ms) whenever
# the other core is busy.
PAR_MIN = 1 << 16


def serial_twin(kernel, twins: dict | None = None):
    """`kernel` (an @njit(parallel=True) dispatcher) compiled without parallel: prange runs as
    range on the calling thread. It gets its own name so numba's cache keeps both. twins: the
    serial twins of the parallel kernels it calls, by their names in its module (a dispatch
    whose kernels must stay on the calling thread)."""
    py = kernel.py_func
    glob = py.__globals__ if twins is None else {**py.__globals__, **twins}
    fn = pytypes.FunctionType(py.__code__, glob, py.__name__ + "_serial", py.__defaults__, py.__closure__)
    fn.__qualname__ = py.__qualname__ + "_serial"
    fn.__module__ = py.__module__
    options = {k: v for k, v in kernel.targetoptions.items() if k not in ("parallel", "nopython")}
    return njit(cache=True, **options)(fn)  # error_model is a target option: kept


def pick(kernel, twin, n_elements: int):
    """The parallel kernel for big inputs, its serial twin for small ones."""
    return kernel if n_elements >= PAR_MIN else twin


@contextmanager
def all_parallel():
    """Within it every kernel picked by size takes its multi-threaded variant: a warm-up step then
    loads (on the very first start: compiles) the variants a long prompt will use."""
    global PAR_MIN
    saved, PAR_MIN = PAR_MIN, 0
    try:
        yield
    finally:
        PAR_MIN = saved


@intrinsic
def _pow2i(typingctx, n):
    """2.0f ** n for an integral float32 n in [-126, 127], by building the exponent bits."""
    sig = types.float32(n)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        e = builder.add(builder.fptosi(args[0], i32), ir.Constant(i32, 127))
        return builder.bitcast(builder.shl(e, ir.Constant(i32, 23)), ir.FloatType())

    return sig, codegen


@intrinsic
def fma32(typingctx, a, b, c):
    """a * b + c with one rounding (llvm.fma.f32): for code that must round as C intrinsics do."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, f32, f32]), "llvm.fma.f32")
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def f16_bits(typingctx, x):
    """float32 x rounded to the nearest float16 (ties to even), as its uint16 bits."""
    sig = types.uint16(x)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


@intrinsic
def f16_value(typingctx, bits):
    """The float16 with these uint16 bits, as float32 (exact)."""
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


def _hexf(s: str) -> np.float32:
    return np.float32(float.fromhex(s))


_E_R, _E_LOG2E, _E_LN2_HI, _E_LN2_LO = _hexf("0x1.8p23"), _hexf("0x1.715476p+0"), _hexf("0x1.62e4p-1"), _hexf("0x1.7f7d1cp-20")
_E_C5, _E_C4, _E_C3, _E_C2, _E_C1 = (_hexf("0x1.0e4020p-7"), _hexf("0x1.573e2ep-5"), _hexf("0x1.555e66p-3"),
                                     _hexf("0x1.fffdb6p-2"), _hexf("0x1.ffffecp-1"))


@intrinsic
def f32_bits(typingctx, x):
    """The bits of float32 x as int32."""
    sig = types.int32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def f32_of_bits(typingctx, i):
    """The float32 with bits i (int32)."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


_ONE_BITS = np.int32(0x3F800000)


@njit(cache=True, error_model="numpy", inline="always")
def ggml_expf(x):
    """ggml_v_expf of llama.cpp's AVX2 build (ggml-cpu/vec.h, the ARM-derived routine) lane for lane:
    the same fused multiply-adds, k = 2^n built in the exponent bits, fma(k, j, k); beyond |n| > 126
    the two-factor scaling (s2 * j + s2) * s1, beyond 192 s1 * s1 (0 or inf). Branch-free selects,
    so loops over it vectorize; the lanes that do not take the scaling compute it with s1 = s2 = 1,
    because its factors would make denormals there (llama.cpp skips that path when no lane needs it),
    and a denormal costs a microcode assist (about 10 times slower on the Intel Xeon of the README).
    exp(-inf) = 0, as the masked softmax needs."""
    z = fma32(x, _E_LOG2E, _E_R)
    n = z - _E_R
    b = fma32(-n, _E_LN2_LO, fma32(-n, _E_LN2_HI, x))
    e = np.int32(f32_bits(z) << 23)                 # 32-bit wraparound, as vpslld
    k = f32_of_bits(np.int32(e + _ONE_BITS))
    u = b * b
    j = fma32(fma32(fma32(_E_C5, b, _E_C4), u, fma32(_E_C3, b, _E_C2)), u, _E_C1 * b)
    g = np.int32(-2113929216) if n <= np.float32(0.0) else np.int32(0)          # 0x82000000 where n <= 0
    an = abs(n)
    scaled = an > np.float32(126.0)
    s1 = f32_of_bits(np.int32(g + np.int32(0x7F000000))) if scaled else np.float32(1.0)
    s2 = f32_of_bits(np.int32(e - g)) if scaled else np.float32(1.0)
    big = s1 * s1 if an > np.float32(192.0) else fma32(s2, j, s2) * s1
    return big if scaled else fma32(k, j, k)


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # few mantissa bits: n * _LN2_HI is exact
_LN2_LO = np.float32(-2.12194440e-4)


@njit(fastmath=FAST, cache=True, error_model="numpy", inline="always")
def vexp(x):
    """exp(x) for float32 x in straight-line float code that LLVM vectorizes (numba has no
    vector libm without SVML). Cody-Waite reduction + degree-7 Taylor: ~2 ulp on the range
    used; x <= -87.3 (including -inf) gives ~1e-38 rather than 0, x >= 88 saturates."""
    x = min(max(x, np.float32(-87.3)), np.float32(88.0))
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = np.float32(1.0 / 5040.0)
    p = p * r + np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    return p * _pow2i(n)


@njit(cache=True, error_model="numpy", inline="always")
def _rms_scale_row(x, w, eps, ss, t, out):
    D = x.shape[1]
    mean = np.float32(ss / D)
    scale = np.float32(1.0) / np.float32(math.sqrt(mean + eps))
    xr, orow = x[t], out[t]                 # 1D views: the loop vectorizes
    for i in range(D):
        orow[i] = xr[i] * scale * w[i]


@njit(cache=True, error_model="numpy", inline="always")  # no fastmath: the sums keep ggml's order
def _rms_rows(x, w, eps, out, t0, t1):
    """Rows t0 .. t1-1 of x RMS-normed into out (_rms_norm). Each row's sum is a chain of dependent
    adds in its own order, so four rows go side by side (four chains in flight)."""
    D = x.shape[1]
    t = t0
    while t + 4 <= t1:
        r0, r1, r2, r3 = x[t], x[t + 1], x[t + 2], x[t + 3]
        s0 = s1 = s2 = s3 = 0.0
        for i in range(D):
            a0, a1, a2, a3 = r0[i], r1[i], r2[i], r3[i]
            s0 += np.float64(a0 * a0)
            s1 += np.float64(a1 * a1)
            s2 += np.float64(a2 * a2)
            s3 += np.float64(a3 * a3)
        _rms_scale_row(x, w, eps, s0, t, out)
        _rms_scale_row(x, w, eps, s1, t + 1, out)
        _rms_scale_row(x, w, eps, s2, t + 2, out)
        _rms_scale_row(x, w, eps, s3, t + 3, out)
        t += 4
    while t < t1:
        xr = x[t]
        ss = 0.0
        for i in range(D):
            ss += np.float64(xr[i] * xr[i])
        _rms_scale_row(x, w, eps, ss, t, out)
        t += 1


@njit(parallel=True, cache=True, error_model="numpy")
def _rms_norm(x, w, eps, out):
    """ggml_compute_forward_rms_norm_f32 to the bit: float32 squares summed in float64 in order,
    mean and 1/sqrt(mean + eps) in float32, then x * scale * w; threads take groups of 4 rows."""
    T = x.shape[0]
    for g in prange((T + 3) // 4):
        _rms_rows(x, w, eps, out, 4 * g, min(T, 4 * g + 4))


_rms_norm_serial = serial_twin(_rms_norm)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x (T, D) or (D,), w (D,) -> x / rms(x) * w. Gemma callers pass (1 + w)."""
    x2 = np.ascontiguousarray(x, np.float32).reshape(-1, x.shape[-1])
    out = np.empty_like(x2)
    pick(_rms_norm, _rms_norm_serial, x2.size)(x2, np.ascontiguousarray(w, np.float32), np.float32(eps), out)
    return out.reshape(x.shape)


@njit(parallel=True, cache=True, error_model="numpy")
def _rope_table(positions, theta_scale, factors, freq_scale, mscale, ext_factor, corr_lo, corr_hi, cs):
    """ggml's angles (ggml_rope_cache_init, rope_yarn): theta = pos, then theta *= theta_scale per
    pair, in float32; pair i's extrapolated angle is theta / factors[i], its interpolated one
    freq_scale times that, and it turns by the interpolated one, or with YaRN (ext_factor != 0) by
    a mix of both that ramps between the pairs corr_lo and corr_hi (one fused multiply-add, as the
    FMA build of ggml-cpu compiles it); cosf/sinf, each times mscale. (Factors of 1 and scales of 1
    change no bit.) cs (T, 2, n_rot/2): cos (cs[t, 0, i]) and sin (cs[t, 1, i]) of pair i at token
    t, each a contiguous row, so rope runs as vectors over the pairs."""
    one = np.float32(1.0)
    for t in prange(positions.shape[0]):
        theta = np.float32(positions[t])
        for i in range(cs.shape[2]):
            extrap = theta / factors[i]
            angle = freq_scale * extrap
            if ext_factor != 0:
                y = (np.float32(i) - corr_lo) / max(np.float32(0.001), corr_hi - corr_lo)
                ramp = (one - min(one, max(np.float32(0.0), y))) * ext_factor
                angle = fma32(angle, one - ramp, extrap * ramp)
            cs[t, 0, i] = math.cos(angle) * mscale
            cs[t, 1, i] = math.sin(angle) * mscale
            theta = theta * theta_scale


@njit(cache=True, error_model="numpy", inline="always")
def _scaled(v, scale, to_f16):
    """v times scale, rounded to float16 (as float32) where to_f16."""
    v = v * scale
    return f16_value(f16_bits(v)) if to_f16 else v


@njit(cache=True, error_model="numpy", inline="always")
def _rope_row(x, cv, sv, neox, scale, to_f16, out):
    """One head's row x (hd,) turned by pairs (cv, sv: the token's cos and sin rows of
    rope_table) into out: ggml_rope's x0*cos - x1*sin and x0*sin + x1*cos, each a multiply-add as
    ggml-cpu's FMA build contracts them; dims past n_rot pass through. Each result then times
    scale and rounded to float16 where to_f16 (_scaled: a scale of 1 changes no bit)."""
    half = cv.shape[0]
    if neox:
        for i in range(half):
            x0, x1 = x[i], x[i + half]
            out[i] = _scaled(fma32(x0, cv[i], -(x1 * sv[i])), scale, to_f16)
            out[i + half] = _scaled(fma32(x0, sv[i], x1 * cv[i]), scale, to_f16)
    else:
        for i in range(half):
            x0, x1 = x[2 * i], x[2 * i + 1]
            out[2 * i] = _scaled(fma32(x0, cv[i], -(x1 * sv[i])), scale, to_f16)
            out[2 * i + 1] = _scaled(fma32(x0, sv[i], x1 * cv[i]), scale, to_f16)
    tail, tail_out = x[2 * half:], out[2 * half:]
    for i in range(tail.shape[0]):
        tail_out[i] = _scaled(tail[i], scale, to_f16)


@njit(cache=True, error_model="numpy", inline="always")
def _add_row(x, b, out):
    """out = x + b (one float32 rounding each: a projection's bias)."""
    for i in range(out.shape[0]):
        out[i] = x[i] + b[i]


@njit(parallel=True, cache=True, error_model="numpy")
def _add_rows(x, y):
    """x += y for rows (T, D) (the residual adds; y may be a view of a wider buffer), rows across
    threads: one float32 rounding each, as ggml_add."""
    for t in prange(x.shape[0]):
        _add_row(x[t], y[t], x[t])


@njit(parallel=True, cache=True, error_model="numpy")
def _rope(x, cs, neox, out):
    """x (T, H, hd) -> out, rope (_rope_row) with token t's cos/sin cs[t]; heads inner, so each
    token's table is read once."""
    T, H, hd = x.shape
    for t in prange(T):
        for h in range(H):
            _rope_row(x[t, h], cs[t, 0], cs[t, 1], neox, np.float32(1.0), False, out[t, h])


HEAD_ROWS_TOKENS = 8    # tokens per group of _head_rows: the group's head rows are normed side by side


@njit(parallel=True, cache=True, error_model="numpy")
def _head_rows(x, c0, bias, norm_w, eps, cs, neox, scale, to_f16, out):
    """Attention's heads from a projection's output, in the order of llama.cpp's graph:
    x[t, c0 : c0 + H*hd] (a member of a fused output, read in place), plus bias (H*hd,) where it
    has one, RMSNorm per head with norm_w (hd,) where it has one (_rms_rows), rope (cs
    (T, 2, n_rot/2); n_rot 0: none), times scale (1: no change), rounded to float16 where to_f16
    -> out (T, H, hd). Threads take groups of HEAD_ROWS_TOKENS tokens."""
    T, H, hd = out.shape
    G = HEAD_ROWS_TOKENS
    for g in prange((T + G - 1) // G):
        t0, t1 = g * G, min(T, g * G + G)
        if not bias.size and not norm_w.size:           # rope reads the projection's output in place
            for t in range(t0, t1):
                for h in range(H):
                    _rope_row(x[t, c0 + h * hd:c0 + (h + 1) * hd], cs[t, 0], cs[t, 1], neox, scale, to_f16, out[t, h])
            continue
        rows = np.empty(((t1 - t0) * H, hd), np.float32)        # (token, head) rows of the group
        for t in range(t0, t1):
            for h in range(H):
                src, row = x[t, c0 + h * hd:c0 + (h + 1) * hd], rows[(t - t0) * H + h]
                if bias.size:
                    _add_row(src, bias[h * hd:(h + 1) * hd], row)
                else:
                    row[:] = src
        if norm_w.size:
            _rms_rows(rows, norm_w, eps, rows, 0, rows.shape[0])
        for t in range(t0, t1):
            for h in range(H):
                _rope_row(rows[(t - t0) * H + h], cs[t, 0], cs[t, 1], neox, scale, to_f16, out[t, h])


_rope_serial = serial_twin(_rope)
_add_rows_serial = serial_twin(_add_rows)
_head_rows_serial = serial_twin(_head_rows)
_rope_table_serial = serial_twin(_rope_table)


def rope_table(positions: np.ndarray, theta: float, n_rot: int, freq_factors: Sequence[float] = (),
               freq_scale: float = 1.0, attn_factor: float = 1.0,
               yarn: tuple[float, float] | None = None) -> np.ndarray:
    """cos/sin (T, 2, n_rot/2) of ggml_rope's angles for these positions: computed once per forward
    pass and base, and shared by every layer's q and k (the trig was most of rope's time).
    freq_factors (n_rot/2,): each pair's angle divided by its factor (Llama 3's rope_freqs, LongRoPE's
    factor sets; none: all 1); freq_scale: every angle times it (linear rope scaling: 1 / factor);
    attn_factor: cos and sin times it (ggml's mscale: LongRoPE's rope.scaling.attn_factor, YaRN's
    libm.yarn_mscale); yarn: YaRN's ramp, the pairs (libm.rope_yarn_corr_dims) it runs between."""
    if n_rot % 2:
        raise ValueError(f"n_rot={n_rot} must be even")
    factors = np.asarray(freq_factors if len(freq_factors) else np.ones(n_rot // 2), np.float32)
    if factors.shape != (n_rot // 2,):
        raise ValueError(f"{factors.shape[0]} rope frequency factors for {n_rot // 2} rotary pairs")
    theta_scale = rope_theta_scale(theta, n_rot)   # libm's powf: numpy's is CPU-dependent
    positions = np.ascontiguousarray(positions, np.int64).reshape(-1)
    cs = np.empty((positions.shape[0], 2, n_rot // 2), np.float32)
    ext_factor, (corr_lo, corr_hi) = (0.0, (0.0, 0.0)) if yarn is None else (1.0, yarn)
    pick(_rope_table, _rope_table_serial, cs.size)(positions, np.float32(theta_scale), factors,
                                                   np.float32(freq_scale), np.float32(attn_factor),
                                                   np.float32(ext_factor), np.float32(corr_lo), np.float32(corr_hi), cs)
    return cs


@njit(cache=True, error_model="numpy", inline="always")
def soft_cap(x, lo, hi, cap):
    """x[lo:hi] in place: cap * tanhf(x * (1/cap)), llama.cpp's soft-capping (ggml_scale, ggml_tanh,
    ggml_scale: three float32 roundings; numba's float32 math.tanh is libm's tanhf, numpy's np.tanh
    is not). Called from a fastmath kernel it takes that kernel's flags."""
    inv = np.float32(1.0) / cap
    for i in range(lo, hi):
        x[i] = cap * math.tanh(x[i] * inv)


@njit(cache=True, error_model="numpy")   # no fastmath: ggml's roundings
def soft_cap_rows(x, cap):
    """x (R, N) in place: each row soft_cap'ed (gemma2's logits)."""
    for r in range(x.shape[0]):
        soft_cap(x[r], 0, x.shape[1], cap)


def rope(x: np.ndarray, positions: np.ndarray, theta: float, neox: bool, n_rot: int | None = None,
         table: np.ndarray | None = None) -> np.ndarray:
    """Rotary embedding as ggml_rope (freq_scale 1, no YaRN). x (T, H, hd) -> (T, H, hd).

    neox=False rotates adjacent pairs (2i, 2i+1) (llama); neox=True rotates (i, i + n_rot/2)
    (qwen2, gemma3). Pair i turns by pos * theta^(-2i/n_rot); dims >= n_rot pass through.
    table: rope_table(positions, theta, n_rot), when the caller has it already.
    """
    x = np.ascontiguousarray(x, np.float32)
    hd = x.shape[2]
    n_rot = hd if n_rot is None else int(n_rot)
    if n_rot % 2 or n_rot > hd:
        raise ValueError(f"n_rot={n_rot} must be even and <= head_dim={hd}")
    if table is None:
        table = rope_table(positions, theta, n_rot)
    if table.shape != (x.shape[0], 2, n_rot // 2):
        raise ValueError(f"rope table {table.shape} does not fit x {x.shape} with n_rot={n_rot}")
    out = np.empty_like(x)
    pick(_rope, _rope_serial, x.size)(x, table, bool(neox), out)
    return out


# Elementwise kernels run over 4096-element chunks (threads take whole chunks); the inner
# loop indexes chunk slices from 0 so numba emits no negative-index fixups and LLVM vectorizes.
CHUNK = 4096


@njit(cache=True, error_model="numpy", inline="always")
def _glu_chunk(gb, g0, ub, u0, out, t, nc):
    """Chunk t of a GLU's (row, chunk) pairs: the gate, up and out slices (see _swiglu)."""
    r, a = t // nc, t % nc * CHUNK
    e = min(out.shape[1], a + CHUNK)
    return gb[r, g0 + a:g0 + e], ub[r, u0 + a:u0 + e], out[r, a:e]


@njit(parallel=True, cache=True, error_model="numpy")  # no fastmath: ggml_v_silu's exact rounding
def _swiglu(gb, g0, ub, u0, out):
    """silu(g) * u as ggml_vec_swiglu_f32 (AVX2): x / (1 + ggml_expf(0 - x)) * u, IEEE division.
    out (T, n); g = gb[:, g0:g0+n] and u = ub[:, u0:u0+n] are read in place (the columns of a fused
    gate/up product: no copies). Threads take (row, chunk) pairs."""
    nc = (out.shape[1] + CHUNK - 1) // CHUNK
    for t in prange(out.shape[0] * nc):
        gc, uc, oc = _glu_chunk(gb, g0, ub, u0, out, t, nc)
        for i in range(gc.shape[0]):
            x = gc[i]
            oc[i] = x / (np.float32(1.0) + ggml_expf(np.float32(0.0) - x)) * uc[i]


@njit(cache=True, error_model="numpy")  # no fastmath: ggml_gelu_f32's rounding
def _gelu_f16_table():
    """ggml's GGML_GELU_FP16 table: for every float16 bit pattern f, f16(gelu(f)) widened to float32,
    with gelu(x) = 0.5*x*(1 + tanhf(sqrt(2/pi)*x*(1 + 0.044715*x*x))) in float32 (the inner
    1 + a*x*x fused, as GCC compiles ggml-cpu.c)."""
    table = np.empty(65536, np.float32)
    a = np.float32(0.044715)
    k = np.float32(0.79788456080286535587989211986876)
    for i in range(65536):
        x = f16_value(np.uint16(i))
        inner = fma32(a * x, x, np.float32(1.0))
        y = np.float32(0.5) * x * (np.float32(1.0) + np.float32(math.tanh(k * x * inner)))
        table[i] = f16_value(f16_bits(y))
    return table


GELU_LANES = 16 if WIDE else 8


@intrinsic
def _gelu_lanes(typingctx, g, u, out, table):
    """_geglu_tanh's elements i < n - n % GELU_LANES of the contiguous 1-D g, u, out (n = out's
    length), GELU_LANES at a time, each group's table entries in one gather (llvm.masked.gather:
    vgatherdps). The table (256 KB) lives in L2, and the scalar loop's lookups, one load per
    element, waited there. Returns how many elements it did; the caller does the rest."""
    if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == types.float32
               for a in (g, u, out, table)):
        return None          # no signature: the loads below address the arrays as contiguous float32
    sig = types.intp(g, u, out, table)

    def codegen(context, builder, signature, args):
        ga, ua, oa, ta = (context.make_array(signature.args[k])(context, builder, args[k]) for k in range(4))
        L, f32, i64 = GELU_LANES, ir.FloatType(), ir.IntType(64)
        VF, VI = ir.VectorType(f32, L), ir.VectorType(i64, L)
        n = builder.extract_value(oa.shape, 0)
        done = builder.sub(n, builder.srem(n, ir.Constant(i64, L)))
        base = builder.insert_element(ir.Constant(VI, ir.Undefined), builder.ptrtoint(ta.data, i64), ir.Constant(ir.IntType(32), 0))
        base = builder.shuffle_vector(base, ir.Constant(VI, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), L), [0] * L))
        ptrs_ty = ir.VectorType(f32.as_pointer(), L)
        gather = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(VF, [ptrs_ty, ir.IntType(32), ir.VectorType(ir.IntType(1), L), VF]),
            f"llvm.masked.gather.v{L}f32.v{L}p0f32")
        at = lambda a, i: builder.bitcast(builder.gep(a.data, [i]), VF.as_pointer())   # noqa: E731
        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), done, ir.Constant(i64, L)) as (i, _):
            x = builder.load(at(ga, i), align=4)
            up = builder.load(at(ua, i), align=4)
            bits = builder.bitcast(builder.fptrunc(x, ir.VectorType(ir.HalfType(), L)), ir.VectorType(ir.IntType(16), L))
            ptrs = builder.inttoptr(builder.add(base, builder.shl(builder.zext(bits, VI), ir.Constant(VI, [2] * L))), ptrs_ty)
            y = builder.fmul(builder.call(gather, [ptrs, ir.Constant(ir.IntType(32), 4), ir.Constant(ir.VectorType(ir.IntType(1), L), [1] * L),
                                                   ir.Constant(VF, ir.Undefined)]), up)
            y = builder.select(builder.fcmp_ordered(">=", x, ir.Constant(VF, [10.0] * L)), builder.fmul(x, up), y)
            y = builder.select(builder.fcmp_ordered("<=", x, ir.Constant(VF, [-10.0] * L)), ir.Constant(VF, [0.0] * L), y)
            builder.store(y, at(oa, i), align=4)
        return done

    return sig, codegen


@njit(parallel=True, cache=True, error_model="numpy")
def _geglu_tanh(gb, g0, ub, u0, out, table):
    """gelu(g) * u as ggml_vec_geglu_f32 with GGML_GELU_FP16: 0 below -10, g * u above 10, else the
    table entry of f16(g), times u. g, u and out as _swiglu's. Selects, not branches: every f16
    pattern has a table entry, and the loop runs without a mispredicted branch per element. Whole
    groups of lanes in _gelu_lanes, the rest here."""
    nc = (out.shape[1] + CHUNK - 1) // CHUNK
    for t in prange(out.shape[0] * nc):
        gc, uc, oc = _glu_chunk(gb, g0, ub, u0, out, t, nc)
        for i in range(_gelu_lanes(gc, uc, oc, table), gc.shape[0]):
            x, u = gc[i], uc[i]
            y = table[f16_bits(x)] * u
            y = x * u if x >= np.float32(10.0) else y
            oc[i] = np.float32(0.0) if x <= np.float32(-10.0) else y


_swiglu_serial = serial_twin(_swiglu)
_geglu_tanh_serial = serial_twin(_geglu_tanh)


def _glu(kernel, twin, gate, up, *extra):
    g = np.ascontiguousarray(gate, np.float32)
    u = np.ascontiguousarray(up, np.float32)
    if g.shape != u.shape:
        raise ValueError(f"gate {g.shape} and up {u.shape} differ")
    g2, u2 = g.reshape(-1, g.shape[-1] if g.ndim else 1), u.reshape(-1, u.shape[-1] if u.ndim else 1)
    out = np.empty_like(g2)
    pick(kernel, twin, g.size)(g2, 0, u2, 0, out, *extra)
    return out.reshape(g.shape)


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up."""
    return _glu(_swiglu, _swiglu_serial, gate, up)


_GELU_TABLE: np.ndarray | None = None


def gelu_table() -> np.ndarray:
    """ggml's float16 GELU table (built on first use)."""
    global _GELU_TABLE
    if _GELU_TABLE is None:
        _GELU_TABLE = _gelu_f16_table()
    return _GELU_TABLE


def geglu_tanh(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gelu(gate) * up with ggml's tanh approximation of gelu, through its float16 table."""
    return _glu(_geglu_tanh, _geglu_tanh_serial, gate, up, gelu_table())


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def _softmax_rows(x, out):
    for r in prange(x.shape[0]):
        m = -np.inf
        for i in range(x.shape[1]):
            m = max(m, x[r, i])
        s = 0.0
        for i in range(x.shape[1]):
            e = np.exp(x[r, i] - m)
            out[r, i] = e
            s += e
        inv = np.float32(1.0 / s)
        for i in range(x.shape[1]):
            out[r, i] *= inv


_softmax_rows_serial = serial_twin(_softmax_rows)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax along `axis` (float32)."""
    x = np.asarray(x, np.float32)
    moved = np.ascontiguousarray(np.moveaxis(x, axis, -1))
    flat = moved.reshape(-1, moved.shape[-1])
    out = np.empty_like(flat)
    pick(_softmax_rows, _softmax_rows_serial, flat.size)(flat, out)
    return np.moveaxis(out.reshape(moved.shape), -1, axis)
