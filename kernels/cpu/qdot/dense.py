"""F32, F16 and BF16 weights times float activation rows, llama.cpp's numbers bit for bit.

llama.cpp's matmul first converts the activation row to the weight type's vec-dot type (F16 and
BF16 weights: the activations rounded to f16 / bf16; F32: as they are), then:
- a llama.cpp batch of 2 rows or more, with a multiple of 4 weight rows (tinyBLAS, llamafile's
  sgemm; AVX2: 8 float lanes): per output one 8-lane chain acc = fma(w[l..l+8], x[l..l+8], acc) over
  K in steps of 8, then tinyBLAS's hsum: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7));
- one row (or a weight matrix tinyBLAS refuses): ggml_vec_dot_f32 / _f16 / _bf16: four 8-lane
  accumulators, accumulator j taking elements 32i+8j .. 32i+8j+7 (one fma each; the BF16 kernel's
  `c += a * b` is contracted into one by the compiler, as its disassembly shows), then F32 / F16:
  GGML_F32x8_REDUCE, (s0+s2)+(s1+s3) and (t0+t1)+(t2+t3) of t_k = e_k+e_{k+4}; BF16:
  (c0+c2)+(c1+c3) and hsum_float_8.
Both need K % 32 == 0 here (vec_dot's scalar tail is not reproduced; every model dimension is a
multiple of 32): kernels.cpu.qdot.exact_layout gives no exact layout otherwise.

The activations come as float32 rows already holding the rounded values (act.round_activation);
the weights are the GGUF rows in place, widened to float32 in registers (vcvtph2ps for F16, a
16-bit shift for BF16).

BF16 tiles with AVX512_BF16 (kernels.cpu.isa.bf16_dot): `vdpbf16ps` adds two bf16 products to a
float lane, the dword's upper one first, each add rounded once (what Intel's manual specifies; the
BF16 tests of tests/kernels/test_matmul.py, against a numpy model of tinyBLAS's chain, fail on a
CPU that adds them in the other order or rounds once). A product of two bf16 numbers is exact
in float32 (8 by 8 significant bits), so one step is the same number as tinyBLAS's
fma(w, x, acc), and a lane given elements l+e (upper half) and l+8+e (lower) takes two links of
tinyBLAS's 8-lane chain at once: twice the products per instruction, the same bits. But
vdpbf16ps treats subnormal inputs and results as zero, which fma does not. They never meet one
where every nonzero weight and activation is at least 2^-56 in magnitude: each is then a multiple
of 2^-63, each product a multiple of 2^-126 and at least 2^-112, and so is every sum of them, which
is 0 or a normal float. So the kernel checks: the weights of a tile in its first pass over K, the
activations as they are packed; where any is smaller (a gate far below zero gives SiLU products
near 2^-60), that tile, or that group of activation rows, takes the fma kernels.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels import types as T
from kernels.cpu.qdot.common import PREFETCH
from kernels.cpu.simd import (
    BF16DP, V8F, V8H, V8I, V16F, V16I, V16S, WIDE, array, byte_ptr, c32, c64, call, dpbf16, fma, hsum8, hsum8_pairs, i16, i32, not_this_variant,
    prefetch, reduce4x8, vload,
)

_ELEM_BYTES = {T.F32: 4, T.F16: 2, T.BF16: 2}
TINY_MR = 4          # weight rows per tinyBLAS tile (it needs a multiple of 4 weight rows)
TINY_NR = 4          # activation rows per tile
# A prompt's activation rows per pass over W (as float32; the tiles read their pairs from L3). Each
# pass streams all of W, from memory once W outgrows the L3 cache (the 1.5B's F16 and BF16 FFN
# matrices: 27.5 MB), so the passes are few, not L2-sized (README: measured).
DENSE_X_BYTES = 8 << 20
# One-row products with rows this long or longer take two weight rows per pass over x: their x (as
# float32, 16 KB or more) shares L1 with the weights' stream, and read once per row it slowed the
# stream (README: measured); shorter rows stream faster one at a time (two streams a thread).
VEC_DOT2_K = 4096


def _load_w8(builder, ggml_type: int, p):
    """8 weights at byte pointer p, as float32 (V8F)."""
    if ggml_type == T.F32:
        return vload(builder, p, V8F)
    if ggml_type == T.F16:
        return builder.fpext(vload(builder, p, V8H), V8F)
    raw = builder.zext(vload(builder, p, ir.VectorType(i16, 8)), V8I)
    return builder.bitcast(builder.shl(raw, ir.Constant(V8I, [16] * 8)), V8F)


def _dense_vec_dot_kernel(ggml_type: int, RN: int):
    """kern(w, n, x, m, out): out[m, n + r] = ggml_vec_dot_<type>(W row n + r, x row m) for r < RN;
    w (N, K*bytes) uint8, x (M, K) float32, out (M, N) float32. Each x vector loaded serves the RN
    rows (RN = 2: VEC_DOT2_K)."""
    eb = _ELEM_BYTES[ggml_type]

    def kern(typingctx, w, n, x, m, out):
        sig = types.void(w, n, x, m, out)

        def codegen(context, builder, signature, args):
            wa, _, xa, _, oa = (array(context, builder, signature.args[k], args[k]) if k in (0, 2, 4) else None
                                for k in range(5))
            nv, mv = args[1], args[3]
            K = builder.extract_value(xa.shape, 1)
            N = builder.extract_value(oa.shape, 1)
            wrow = [builder.gep(byte_ptr(builder, wa.data), [builder.mul(builder.add(nv, c64(r)), builder.extract_value(wa.strides, 0))])
                    for r in range(RN)]
            xrow = builder.gep(xa.data, [builder.mul(mv, K)])
            acc = [[cgutils.alloca_once_value(builder, ir.Constant(V8F, [0.0] * 8)) for _ in range(4)] for _ in range(RN)]
            with cgutils.for_range(builder, builder.udiv(K, c64(32))) as loop:
                i = builder.mul(loop.index, c64(32))
                wp = [builder.gep(wrow[r], [builder.mul(i, c64(eb))]) for r in range(RN)]
                for r in range(RN):
                    prefetch(builder, builder.gep(wp[r], [c64(PREFETCH)]))
                for j in range(4):
                    xv = vload(builder, builder.gep(xrow, [builder.add(i, c64(8 * j))]), V8F)
                    for r in range(RN):
                        wv = _load_w8(builder, ggml_type, builder.gep(wp[r], [c64(8 * j * eb)]))
                        builder.store(fma(builder, wv, xv, builder.load(acc[r][j])), acc[r][j])
            for r in range(RN):
                s = [builder.load(a) for a in acc[r]]
                if ggml_type == T.BF16:
                    res = hsum8(builder, builder.fadd(builder.fadd(s[0], s[2]), builder.fadd(s[1], s[3])))
                else:
                    res = reduce4x8(builder, s)
                builder.store(res, builder.gep(oa.data, [builder.add(builder.mul(mv, N), builder.add(nv, c64(r)))]))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"{T.TRAITS[ggml_type].name.lower()}_vec_dot_{RN}"
    return intrinsic(kern)


def _dense_tiny_kernel(ggml_type: int, MR: int, NR: int):
    """kern(w, n0, x, m0, out): out[m0+j, n0+i] for i < MR, j < NR, tinyBLAS's numbers: one 8-lane
    fma chain per output over K, then hsum. Each step widens MR weight vectors once for NR rows."""
    eb = _ELEM_BYTES[ggml_type]

    def kern(typingctx, w, n0, x, m0, out):
        sig = types.void(w, n0, x, m0, out)

        def codegen(context, builder, signature, args):
            wa, _, xa, _, oa = (array(context, builder, signature.args[k], args[k]) if k in (0, 2, 4) else None
                                for k in range(5))
            n0v, m0v = args[1], args[3]
            K = builder.extract_value(xa.shape, 1)
            N = builder.extract_value(oa.shape, 1)
            stride = builder.extract_value(wa.strides, 0)
            wrows = [builder.gep(byte_ptr(builder, wa.data), [builder.mul(builder.add(n0v, c64(i)), stride)])
                     for i in range(MR)]
            xrows = [builder.gep(xa.data, [builder.mul(builder.add(m0v, c64(j)), K)]) for j in range(NR)]
            acc = [[cgutils.alloca_once_value(builder, ir.Constant(V8F, [0.0] * 8)) for _ in range(MR)]
                   for _ in range(NR)]
            with cgutils.for_range(builder, builder.udiv(K, c64(8))) as loop:
                l = builder.mul(loop.index, c64(8))
                wv = [_load_w8(builder, ggml_type, builder.gep(r, [builder.mul(l, c64(eb))])) for r in wrows]
                for j in range(NR):
                    xv = vload(builder, builder.gep(xrows[j], [l]), V8F)
                    for i in range(MR):
                        builder.store(fma(builder, wv[i], xv, builder.load(acc[j][i])), acc[j][i])
            for j in range(NR):
                for i in range(MR):
                    idx = builder.add(builder.mul(builder.add(m0v, c64(j)), N), builder.add(n0v, c64(i)))
                    builder.store(hsum8(builder, builder.load(acc[j][i])), builder.gep(oa.data, [idx]))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"{T.TRAITS[ggml_type].name.lower()}_tiny_{MR}x{NR}"
    return intrinsic(kern)


def _load_w8_twice(builder, ggml_type: int, p):
    """8 weights at byte pointer p as float32, in both halves of a 512-bit register (V16F)."""
    both = ir.Constant(ir.VectorType(i32, 16), list(range(8)) * 2)
    if ggml_type == T.F32:
        v = vload(builder, p, V8F)
        return builder.shuffle_vector(v, v, both)                  # vbroadcastf32x8 from memory
    v = vload(builder, p, ir.VectorType(i16, 8))
    v = builder.shuffle_vector(v, v, both)                         # vbroadcasti32x4, then widen 16
    if ggml_type == T.F16:
        return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), 16)), V16F)
    return builder.bitcast(builder.shl(builder.zext(v, V16I), ir.Constant(V16I, [16] * 16)), V16F)


TINY_BF16 = 0x2380   # bf16 bits of 2^-56 (sign cleared): a nonzero value below it may meet a subnormal
# 16 weights w[l..l+16) -> per dword lane e of both 256-bit halves (w[l+8+e], w[l+e]): vdpbf16ps adds
# the upper one, w[l+e], first
_LINK_PAIRS = ir.Constant(ir.VectorType(i32, 32), [k for e in range(8) for k in (8 + e, e)] * 2)


def _dense_tiny512_kernel(ggml_type: int, MR: int, NP: int, dp: bool = False, check: bool = False):
    """kern(w, n0, xp, p0, out, m0, m_end): out[m0 + 2(p0+q) + h, n0+i] for i < MR, q < NP, h < 2
    (rows below m_end), tinyBLAS's numbers on 512-bit registers: two activation rows per register
    (lanes 0-7 row 2q, 8-15 row 2q+1), per output the same 8-lane chain over K and the same hsum,
    both halves at once. Each step:
    - fma (xp (M/2, K/8, 16) float32 from _pair_rows): 8 elements of K, each weight vector widened
      once into both halves;
    - dp (BF16 on vdpbf16ps; xp (M/2, K/16, 16) uint32 from _pair_rows_bf16): 16 elements, two
      links of each lane's chain per instruction (the module's docstring). With `check` it returns
      False, having written outputs that do not count, where a weight of rows n0 .. n0+MR-1 is
      nonzero and below 2^-56."""
    eb = _ELEM_BYTES[ggml_type]
    assert ggml_type == T.BF16 or not dp

    def kern(typingctx, w, n0, xp, p0, out, m0, m_end):
        sig = (types.boolean if check else types.void)(w, n0, xp, p0, out, m0, m_end)

        def codegen(context, builder, signature, args):
            wa, _, xa, _, oa, _, _ = (array(context, builder, signature.args[k], args[k]) if k in (0, 2, 4) else None
                                      for k in range(7))
            n0v, p0v, m0v, Mv = args[1], args[3], args[5], args[6]
            steps = builder.extract_value(xa.shape, 1)                # each step 16 lanes of 4 bytes
            N = builder.extract_value(oa.shape, 1)
            stride = builder.extract_value(wa.strides, 0)
            wrows = [builder.gep(byte_ptr(builder, wa.data), [builder.mul(builder.add(n0v, c64(i)), stride)])
                     for i in range(MR)]
            xrows = [builder.gep(byte_ptr(builder, xa.data), [builder.mul(builder.add(p0v, c64(q)), builder.mul(steps, c64(64)))])
                     for q in range(NP)]
            acc = [[cgutils.alloca_once_value(builder, ir.Constant(V16F, [0.0] * 16)) for _ in range(MR)]
                   for _ in range(NP)]
            tiny = cgutils.alloca_once_value(builder, ir.Constant(V16S, [0] * 16)) if check else None
            with cgutils.for_range(builder, steps) as loop:
                l = loop.index
                wv = []
                for r in wrows:
                    if not dp:
                        wv.append(_load_w8_twice(builder, ggml_type, builder.gep(r, [builder.mul(l, c64(8 * eb))])))
                        continue
                    raw = vload(builder, builder.gep(r, [builder.mul(l, c64(32))]), V16S)
                    wv.append(builder.bitcast(builder.shuffle_vector(raw, raw, _LINK_PAIRS), V16I))
                    if check:            # 0 < |w| < 2^-56: (bits & 0x7fff) - 1 below TINY_BF16 - 1, unsigned
                        m = builder.sub(builder.and_(raw, ir.Constant(V16S, [0x7FFF] * 16)), ir.Constant(V16S, [1] * 16))
                        low = builder.icmp_unsigned("<", m, ir.Constant(V16S, [TINY_BF16 - 1] * 16))
                        builder.store(builder.or_(builder.load(tiny), builder.sext(low, V16S)), tiny)
                for q in range(NP):
                    xv = vload(builder, builder.gep(xrows[q], [builder.mul(l, c64(64))]), V16I if dp else V16F)
                    for i in range(MR):
                        a = builder.load(acc[q][i])
                        a = dpbf16(builder, a, wv[i], xv) if dp else call(builder, "llvm.fma.v16f32", V16F, [wv[i], xv, a])
                        builder.store(a, acc[q][i])

            for q in range(NP):
                for i in range(MR):
                    t = hsum8_pairs(builder, builder.load(acc[q][i]))
                    for h in range(2):
                        row = builder.add(m0v, builder.add(builder.mul(builder.add(p0v, c64(q)), c64(2)), c64(h)))
                        with builder.if_then(builder.icmp_signed("<", row, Mv)):
                            idx = builder.add(builder.mul(row, N), builder.add(n0v, c64(i)))
                            builder.store(builder.extract_element(t, c32(8 * h)), builder.gep(oa.data, [idx]))
            if check:
                flags = builder.bitcast(builder.load(tiny), ir.IntType(256))
                return builder.icmp_unsigned("==", flags, ir.Constant(ir.IntType(256), 0))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = (f"{T.TRAITS[ggml_type].name.lower()}_{'dp' if dp else 'tiny'}512_{MR}x{NP}"
                     + ("_check" if check else ""))
    return intrinsic(kern)


@njit(parallel=True, cache=True, error_model="numpy")
def _pair_rows(x, m0, n):
    """Rows m0 .. m0+n-1 of x (M, K) two to a register: (ceil(n/2), K/8, 16), the 8 floats of row
    m0+2q then of row m0+2q+1 (zeros past the last row)."""
    K = x.shape[1]
    xp = np.empty(((n + 1) // 2, K // 8, 16), np.float32)
    for q in prange(xp.shape[0]):
        for h in range(2):
            r = 2 * q + h
            for k in range(K // 8):
                for e in range(8):
                    xp[q, k, 8 * h + e] = x[m0 + r, 8 * k + e] if r < n else np.float32(0.0)
    return xp


@njit(parallel=True, cache=True, error_model="numpy")
def _pair_rows_bf16(x, m0, n):
    """Rows m0 .. m0+n-1 of x (M, K; float32 holding bf16 values) as vdpbf16ps operands, two rows to
    a register: (ceil(n/2), K/16, 16) uint32, lane 8h+e of step t the bf16 pair (x[r, 16t+e] upper,
    x[r, 16t+8+e] lower) of row r = m0+2q+h (zeros past the last row). Also, per pair, whether every
    nonzero value is at least 2^-56 in magnitude (the module's docstring)."""
    K = x.shape[1]
    bits = x.view(np.uint32)
    xb = np.empty(((n + 1) // 2, K // 16, 16), np.uint32)
    ok = np.ones(xb.shape[0], np.bool_)
    for q in prange(xb.shape[0]):
        for h in range(2):
            r = 2 * q + h
            for t in range(K // 16):
                for e in range(8):
                    hi = bits[m0 + r, 16 * t + e] >> 16 if r < n else np.uint32(0)
                    lo = bits[m0 + r, 16 * t + 8 + e] >> 16 if r < n else np.uint32(0)
                    xb[q, t, 8 * h + e] = (hi << 16) | lo
                    if (0 < (hi & 0x7FFF) < TINY_BF16) or (0 < (lo & 0x7FFF) < TINY_BF16):
                        ok[q] = False
    return xb, ok


DENSE_TYPES = (T.F32, T.F16, T.BF16)
f32_vec_dot, f16_vec_dot, bf16_vec_dot = (_dense_vec_dot_kernel(t, 1) for t in DENSE_TYPES)
f32_vec_dot2, f16_vec_dot2, bf16_vec_dot2 = (_dense_vec_dot_kernel(t, 2) for t in DENSE_TYPES)
f32_tiny, f16_tiny, bf16_tiny = (_dense_tiny_kernel(t, TINY_MR, TINY_NR) for t in DENSE_TYPES)
f32_tiny_1, f16_tiny_1, bf16_tiny_1 = (_dense_tiny_kernel(t, TINY_MR, 1) for t in DENSE_TYPES)
# With AVX-512 the tiles take two activation rows per register (TINY512_NP pairs per tile).
TINY512_NP = 4
if WIDE:
    f32_tiny512, f16_tiny512, bf16_tiny512 = (_dense_tiny512_kernel(t, TINY_MR, TINY512_NP) for t in DENSE_TYPES)
    f32_tiny512_1, f16_tiny512_1, bf16_tiny512_1 = (_dense_tiny512_kernel(t, TINY_MR, 1) for t in DENSE_TYPES)
else:
    f32_tiny512 = f16_tiny512 = bf16_tiny512 = f32_tiny512_1 = f16_tiny512_1 = bf16_tiny512_1 = not_this_variant
if BF16DP:
    bf16_dp512, bf16_dp512_1 = (_dense_tiny512_kernel(T.BF16, TINY_MR, np_, dp=True) for np_ in (TINY512_NP, 1))
    bf16_dp512_check, bf16_dp512_1_check = (_dense_tiny512_kernel(T.BF16, TINY_MR, np_, dp=True, check=True)
                                            for np_ in (TINY512_NP, 1))
else:
    bf16_dp512 = bf16_dp512_1 = bf16_dp512_check = bf16_dp512_1_check = not_this_variant


@njit(inline="always")
def _bf16_dp_tiles(w, n0, xb, x_ok, x, out, m0, m_end):
    """Weight rows n0 .. n0+TINY_MR-1 times every row pair of xb (rows m0 .. m_end-1 of x) on the
    vdpbf16ps tiles, a group of pairs holding an activation too small for them (x_ok: per pair) on
    the fma tiles; False (the outputs not final) where the first vdpbf16ps pass found one of the
    weight rows too small for them."""
    pairs = xb.shape[0]
    checked = False
    q = 0
    while q < pairs:
        n_p = TINY512_NP if q + TINY512_NP <= pairs else 1
        if not x_ok[q:q + n_p].all():
            _tiny(T.BF16, w, n0, x, m0 + 2 * q, min(m_end, m0 + 2 * (q + n_p)) - m0 - 2 * q, out)
        elif not checked:                                   # the weights' check rides on the first pass
            checked = True
            if n_p == TINY512_NP:
                ok = bf16_dp512_check(w, n0, xb, q, out, m0, m_end)
            else:
                ok = bf16_dp512_1_check(w, n0, xb, q, out, m0, m_end)
            if not ok:
                return False
        elif n_p == TINY512_NP:
            bf16_dp512(w, n0, xb, q, out, m0, m_end)
        else:
            bf16_dp512_1(w, n0, xb, q, out, m0, m_end)
        q += n_p
    return True


@njit(inline="always")
def _tiny512(ggml_type, w, n0, xp, out, m0, m_end):
    """512-bit tinyBLAS tiles for weight rows n0 .. n0+TINY_MR-1 and every row pair of xp (rows
    m0 .. m_end-1)."""
    pairs = xp.shape[0]
    q = 0
    while q + TINY512_NP <= pairs:
        if ggml_type == T.F32:
            f32_tiny512(w, n0, xp, q, out, m0, m_end)
        elif ggml_type == T.F16:
            f16_tiny512(w, n0, xp, q, out, m0, m_end)
        else:
            bf16_tiny512(w, n0, xp, q, out, m0, m_end)
        q += TINY512_NP
    while q < pairs:
        if ggml_type == T.F32:
            f32_tiny512_1(w, n0, xp, q, out, m0, m_end)
        elif ggml_type == T.F16:
            f16_tiny512_1(w, n0, xp, q, out, m0, m_end)
        else:
            bf16_tiny512_1(w, n0, xp, q, out, m0, m_end)
        q += 1


@njit(inline="always")
def _vec_dot(ggml_type, w, n, x, m, out):
    if ggml_type == T.F32:
        f32_vec_dot(w, n, x, m, out)
    elif ggml_type == T.F16:
        f16_vec_dot(w, n, x, m, out)
    else:
        bf16_vec_dot(w, n, x, m, out)


@njit(inline="always")
def _vec_dot2(ggml_type, w, n, x, m, out):
    """_vec_dot of weight rows n and n + 1."""
    if ggml_type == T.F32:
        f32_vec_dot2(w, n, x, m, out)
    elif ggml_type == T.F16:
        f16_vec_dot2(w, n, x, m, out)
    else:
        bf16_vec_dot2(w, n, x, m, out)


@njit(inline="always")
def _tiny(ggml_type, w, n0, x, m0, rows, out):
    """tinyBLAS tiles for weight rows n0 .. n0+TINY_MR-1 and `rows` activation rows from m0."""
    m = m0
    while m + TINY_NR <= m0 + rows:
        if ggml_type == T.F32:
            f32_tiny(w, n0, x, m, out)
        elif ggml_type == T.F16:
            f16_tiny(w, n0, x, m, out)
        else:
            bf16_tiny(w, n0, x, m, out)
        m += TINY_NR
    while m < m0 + rows:
        if ggml_type == T.F32:
            f32_tiny_1(w, n0, x, m, out)
        elif ggml_type == T.F16:
            f16_tiny_1(w, n0, x, m, out)
        else:
            bf16_tiny_1(w, n0, x, m, out)
        m += 1


@njit(parallel=True, cache=True, error_model="numpy")
def _dense_rows(ggml_type, w, x, run_start, run_len, run_batched, out, tiny_ok):
    """F32 / F16 / BF16 rows w (N, K*bytes) x float rows x (M, K) -> out (M, N): a batched run of 2
    rows or more takes tinyBLAS's arithmetic if tiny_ok (the whole matrix has a multiple of 4 rows:
    llama.cpp's sgemm takes it; then N is one too), every other row vec_dot's. Activation rows in
    chunks of up to DENSE_X_BYTES (as float32), each a pass over all of W; prange over weight rows."""
    M, K = x.shape
    N = w.shape[0]
    chunk = max(TINY_NR, DENSE_X_BYTES // (4 * K) // TINY_NR * TINY_NR)
    for r in range(run_start.shape[0]):
        r0, n = run_start[r], run_len[r]
        if run_batched[r] and n >= 2 and tiny_ok:
            for c0 in range(r0, r0 + n, chunk):
                rows = min(r0 + n, c0 + chunk) - c0
                if BF16DP and ggml_type == T.BF16:
                    xb, x_ok = _pair_rows_bf16(x, c0, rows)
                    for t in prange(N // TINY_MR):
                        if not _bf16_dp_tiles(w, t * TINY_MR, xb, x_ok, x, out, c0, c0 + rows):
                            _tiny(ggml_type, w, t * TINY_MR, x, c0, rows, out)
                    continue
                if WIDE:
                    xp = _pair_rows(x, c0, rows)
                    for t in prange(N // TINY_MR):
                        _tiny512(ggml_type, w, t * TINY_MR, xp, out, c0, c0 + rows)
                else:
                    for t in prange(N // TINY_MR):
                        _tiny(ggml_type, w, t * TINY_MR, x, c0, rows, out)
        elif K >= VEC_DOT2_K:                   # long rows two at a time (and the last alone)
            for pair in prange((N + 1) // 2):
                row = 2 * pair
                for m in range(r0, r0 + n):
                    if row + 1 < N:
                        _vec_dot2(ggml_type, w, row, x, m, out)
                    else:
                        _vec_dot(ggml_type, w, row, x, m, out)
        else:
            for row in prange(N):
                for m in range(r0, r0 + n):
                    _vec_dot(ggml_type, w, row, x, m, out)
