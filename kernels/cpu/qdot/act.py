"""Activation rows quantized as llama.cpp's matmul quantizes them: q8_0 (for Q8_0, Q5_0, Q4_0 and
IQ4_NL weights; q8_1, for Q4_1 and Q5_1, has the same values and one more field) and q8_K (for the
K-quants), with the sums the kernels' offsets need."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from kernels.cpu.ops import f16_bits, f16_value, f32_bits, f32_of_bits, serial_twin
from kernels.cpu.simd import V16B, V16F, V16I, array, byte_ptr, c64, call, i32, splat, vconst, vload, vstore
from kernels.types import ACT_BF16, ACT_F16


def _chunks(builder, x, o, N: int):
    """The N float32 at x[o:] as 16-lane vectors."""
    xp = builder.gep(x.data, [o])
    return [vload(builder, builder.gep(xp, [c64(16 * c)]), V16F) for c in range(N // 16)]


def _group_sums(builder, vecs, G: int):
    """The sums of every G consecutive lanes of the int32 vectors vecs (16 lanes each, in order),
    as vectors in the same order: pairs of lanes added level by level (even lanes plus odd lanes of
    two vectors side by side), log2(G) shuffles and adds per vector, not a reduction per group."""
    width = 1
    while width < G:
        if len(vecs) >= 2:
            n = vecs[0].type.count
            ev, od = (ir.Constant(ir.VectorType(i32, n), list(range(k, 2 * n, 2))) for k in (0, 1))
            vecs = [builder.add(builder.shuffle_vector(a, b, ev), builder.shuffle_vector(a, b, od))
                    for a, b in zip(vecs[0::2], vecs[1::2])]
        else:
            a, n = vecs[0], vecs[0].type.count
            ev, od = (ir.Constant(ir.VectorType(i32, n // 2), list(range(k, n, 2))) for k in (0, 1))
            vecs = [builder.add(builder.shuffle_vector(a, a, ev), builder.shuffle_vector(a, a, od))]
        width *= 2
    return vecs


def _rint_scaled_kernel(N: int, G: int, CLAMP: bool, MUL: int):
    """kern(x, o, scale, q, sums, s0) -> the sum of q: q[o:o+N] = rint(x[o:o+N] * scale) as int8
    (at most 127 with CLAMP), and sums[s0 + k] = MUL times the sum of its k-th group of G values
    (in sums' integer type). The rounding is half to even for |v| < 2^22, as _mm256_round_ps /
    nearest_int do: adding and taking away 1.5 * 2^23 rounds the float32 sum (no fast-math flags,
    so both additions stay).

    Why an intrinsic: numba's LLVM pipeline unrolls a 32-element loop completely and then leaves it
    scalar (one conversion per element); as 16-lane vectors the same IEEE operations run on every
    lane, so the same integers as the scalar loop."""

    def kern(typingctx, x, o, scale, q, sums, s0):
        if any(a.layout != "C" for a in (x, q, sums)):
            return None                 # rows read and written as contiguous runs
        sig = types.int32(x, o, scale, q, sums, s0)
        sum_ty = ir.IntType(sums.dtype.bitwidth)

        def codegen(context, builder, signature, args):
            xa, qa, sa = (array(context, builder, signature.args[k], args[k]) for k in (0, 3, 4))
            qp = builder.gep(byte_ptr(builder, qa.data), [args[1]])
            sp = builder.gep(sa.data, [args[5]])
            sv = splat(builder, args[2], V16F)
            magic = vconst(V16F, 12582912.0)
            qis = []
            for c, v in enumerate(_chunks(builder, xa, args[1], N)):
                v = builder.fmul(v, sv)
                qi = builder.fptosi(builder.fsub(builder.fadd(v, magic), magic), V16I)        # (16,) int32
                if CLAMP:
                    qi = builder.select(builder.icmp_signed(">", qi, vconst(V16I, 127)), vconst(V16I, 127), qi)
                vstore(builder, builder.trunc(qi, V16B), builder.gep(qp, [c64(16 * c)]))
                qis.append(qi)
            at = 0
            total = None
            for g in _group_sums(builder, qis, G):
                n = g.type.count
                t = call(builder, f"llvm.vector.reduce.add.v{n}i32", i32, [g])
                total = t if total is None else builder.add(total, t)
                if MUL != 1:
                    g = builder.mul(g, ir.Constant(g.type, [MUL] * n))
                if sum_ty.width < 32:
                    g = builder.trunc(g, ir.VectorType(sum_ty, n))
                vstore(builder, g, builder.gep(sp, [c64(at)]))
                at += n
            return total

        return sig, codegen

    kern.__name__ = f"rint_scaled_{N}_{G}{'_clamped' if CLAMP else ''}_x{MUL}"
    return intrinsic(kern)


_rint_q8_0 = _rint_scaled_kernel(32, 4, False, 16)  # a q8_0 block and 16 x its 4-element sums
_rint_q8_k = _rint_scaled_kernel(256, 16, True, 1)  # a q8_K super-block and its 16-element sums


def _absmax_kernel(N: int):
    """kern(x, o) -> max |x[o:o+N]| (float32). The largest magnitude is the largest unsigned
    integer among the bit patterns with their signs cleared (activations hold no NaN), and integer
    max reductions lower to a few instructions, where a float one without fast-math flags checks
    for NaN at every step; numba leaves its own max loop scalar."""

    def kern(typingctx, x, o):
        if x.layout != "C":
            return None

        def codegen(context, builder, signature, args):
            xa = array(context, builder, signature.args[0], args[0])
            vs = [builder.and_(builder.bitcast(v, V16I), vconst(V16I, 0x7FFFFFFF)) for v in _chunks(builder, xa, args[1], N)]
            while len(vs) > 1:
                vs = [call(builder, "llvm.umax.v16i32", V16I, [a, b]) for a, b in zip(vs[::2], vs[1::2])]
            return builder.bitcast(call(builder, "llvm.vector.reduce.umax.v16i32", i32, [vs[0]]), ir.FloatType())

        return types.float32(x, o), codegen

    kern.__name__ = f"absmax_{N}"
    return intrinsic(kern)


def _signs_kernel(N: int):
    """kern(x, o, v) -> (1 if x[o:o+N] holds v) + (2 if it holds -v)."""

    def kern(typingctx, x, o, v):
        if x.layout != "C":
            return None

        def codegen(context, builder, signature, args):
            xa = array(context, builder, signature.args[0], args[0])
            pos, neg = splat(builder, args[2], V16F), splat(builder, builder.fneg(args[2]), V16F)
            hit_p = hit_n = None
            for v in _chunks(builder, xa, args[1], N):
                p, n = builder.fcmp_ordered("==", v, pos), builder.fcmp_ordered("==", v, neg)
                hit_p = p if hit_p is None else builder.or_(hit_p, p)
                hit_n = n if hit_n is None else builder.or_(hit_n, n)
            any_p = builder.zext(call(builder, "llvm.vector.reduce.or.v16i1", ir.IntType(1), [hit_p]), i32)
            any_n = builder.zext(call(builder, "llvm.vector.reduce.or.v16i1", ir.IntType(1), [hit_n]), i32)
            return builder.add(any_p, builder.shl(any_n, ir.Constant(i32, 1)))

        return types.int32(x, o, v), codegen

    kern.__name__ = f"signs_{N}"
    return intrinsic(kern)


_absmax_32, _absmax_256, _signs_256 = _absmax_kernel(32), _absmax_kernel(256), _signs_kernel(256)

# --- activation rows, quantized as llama.cpp's matmul quantizes them ------------------------------


@njit(parallel=True, cache=True, error_model="numpy")
def _quantize_q8_0(x, xq, dx, sx, s1):
    """quantize_row_q8_0 (AVX2): per 32 elements d = f16(amax / 127), q = round(x * (127 / amax));
    sx: 16 x the sum of every 4 q (the unsigned types' offset); s1: quantize_row_q8_1's s, f16(d x
    the block's sum of q) with d before its rounding to f16 (the Q4_1 / Q5_1 minimums)."""
    for m in prange(x.shape[0]):
        xr, qr, sr = x[m], xq[m], sx[m]
        for b in range(dx.shape[1]):
            amax = _absmax_32(xr, b * 32)
            idv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
            tot = _rint_q8_0(xr, b * 32, idv, qr, sr, b * 8)    # q, and 16 x the 4-element sums into sx
            d = amax / np.float32(127.0)
            dx[m, b] = f16_value(f16_bits(d))
            s1[m, b] = f16_value(f16_bits(d * np.float32(tot)))


@njit(cache=True, error_model="numpy")
def _first_largest(xr, lo):
    """The first of xr[lo:lo+256] of the largest magnitude, as quantize_row_q8_K_ref's scan finds it
    (a zero where all are zero). The magnitude and which signs reach it are vector reductions;
    only a super-block holding both +amax and -amax scans for the first."""
    amax = _absmax_256(xr, lo)
    signs = _signs_256(xr, lo, amax)
    if signs == 1 or signs == 2:
        return amax if signs == 1 else -amax
    for i in range(lo, lo + 256):
        if abs(xr[i]) == amax:
            return xr[i]
    return np.float32(0.0)


@njit(parallel=True, cache=True, error_model="numpy")
def _quantize_q8_k(x, xq, dx, bs16, bsp):
    """quantize_row_q8_K_ref: per 256 elements the first value of largest magnitude, vmax, maps to
    -127 (iscale = -127 / vmax, q = min(127, round(iscale * x)), d = 1 / iscale); bs16: 16-element
    sums of q. (The 4-row quantizer of the Q4_K gemm breaks +-vmax ties the other way; that flips the
    signs of q and d together and leaves every product unchanged.)"""
    for m in prange(x.shape[0]):
        xr, qr, sr = x[m], xq[m], bs16[m]
        for b in range(dx.shape[1]):
            vmax = _first_largest(xr, b * 256)
            iscale = np.float32(-127.0) / vmax if vmax != 0 else np.float32(0.0)     # all zeros: q 0, d 0
            _rint_q8_k(xr, b * 256, iscale, qr, sr, b * 16)     # q, and the 16-element sums into bs16
            dx[m, b] = np.float32(1.0) / iscale if vmax != 0 else np.float32(0.0)
            for c in range(4):                  # per 64 elements the two 32-sums as two int16 (Q4_K)
                lo = np.int32(bs16[m, b * 16 + 4 * c]) + np.int32(bs16[m, b * 16 + 4 * c + 1])
                hi = np.int32(bs16[m, b * 16 + 4 * c + 2]) + np.int32(bs16[m, b * 16 + 4 * c + 3])
                bsp[m, b * 4 + c] = (lo & 0xFFFF) | (hi << 16)


@njit(cache=True, error_model="numpy")
def round_activation(x, kind, out):
    """x (M, K) float32 -> out: the values llama.cpp's matmul converts them to for F32 (as they are),
    F16 (nearest f16, ties to even) and BF16 (nearest bf16, ties to even) weights."""
    for m in range(x.shape[0]):
        for i in range(x.shape[1]):
            v = x[m, i]
            if kind == ACT_F16:
                v = f16_value(f16_bits(v))
            elif kind == ACT_BF16:
                u = np.int64(f32_bits(v)) & 0xFFFFFFFF
                r = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
                v = f32_of_bits(np.int32(r - (r >> 31 << 32)))          # back to a signed 32-bit pattern
            out[m, i] = v


_quantize_q8_0_serial = serial_twin(_quantize_q8_0)
_quantize_q8_k_serial = serial_twin(_quantize_q8_k)
