"""Activation rows 16 to a 512-bit register, for the prompt kernels that put the rows in the lanes
(on AVX-512: q4_k, the tiled16 K-quants, q0's Q5_0 and Q8_0 panel): one weight dword broadcast
against the same dword of 16 rows is one vpdpbusd / vpdpwssd for 16 outputs, with no shuffles in
the loop. The tiled16 K-quants also run on AVX-VNNI's 256-bit registers, 8 rows to one (the *8
forms)."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.cpu.simd import V8F, V16F, V16I, V32B, V64B, array, byte_ptr, c32, c64, i32, transpose, vload

V32S = ir.VectorType(ir.IntType(16), 32)


def vpdpwssd(builder, acc, a, b):
    """acc + vpdpwssd(a, b) (V16I) as inline assembly: LLVM's machine combiner splits the intrinsic
    into vpmaddwd + vpaddd to shorten the accumulator's dependency chain, twice the instructions on
    loops whose chains are many and independent."""
    fty = ir.FunctionType(V16I, [V16I, V16I, V16I])
    return builder.asm(fty, "vpdpwssd $2, $1, $0", "=v,v,v,0", [a, b, acc], side_effect=False)


def store_lanes(builder, vec, out_ptr, N, M, group, col):
    """out[L group + l, col] = vec[l] for the L lanes l of vec whose row is below M (out: (rows, N) float32)."""
    L = vec.type.count
    for lane in range(L):
        row = builder.add(builder.mul(group, c64(L)), c64(lane))
        with builder.if_then(builder.icmp_signed("<", row, M)):
            builder.store(builder.extract_element(vec, c32(lane)), builder.gep(out_ptr, [builder.add(builder.mul(row, N), col)]))


@intrinsic
def store_block(typingctx, block, n, out, row0, col0, M):
    """out[row0 + l, col0 + c] = block[c, l] for c < n (8 or 16) and the lanes l whose row is below M:
    a (16, 16) float32 block of 16-lane results, one per output column, written as rows of out
    (each a whole run of n floats, not 16 scattered ones) after one transpose in registers."""
    sig = types.void(block, n, out, row0, col0, M)

    def codegen(context, builder, signature, args):
        ba, _, oa = (array(context, builder, signature.args[k], args[k]) if k != 1 else None for k in range(3))
        nv, row0v, col0v, Mv = args[1], args[3], args[4], args[5]
        N = builder.extract_value(oa.shape, 1)
        rows = transpose(builder, [vload(builder, builder.gep(ba.data, [c64(16 * c)]), V16F) for c in range(16)])
        for lane in range(16):
            row = builder.add(row0v, c64(lane))
            with builder.if_then(builder.icmp_signed("<", row, Mv)):
                at = builder.gep(oa.data, [builder.add(builder.mul(row, N), col0v)])
                with builder.if_else(builder.icmp_signed("==", nv, c64(16))) as (whole, half):
                    with whole:
                        builder.store(rows[lane], builder.bitcast(at, V16F.as_pointer()), align=4)
                    with half:
                        low = builder.shuffle_vector(rows[lane], rows[lane], ir.Constant(ir.VectorType(i32, 8), list(range(8))))
                        builder.store(low, builder.bitcast(at, V8F.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


def _regroup_kernel(biased: bool, L: int = 16):
    """kern(xq, g, xg): rows Lg .. Lg+L-1 of xq (M, K) int8 (those below M) into xg[g], the bytes as
    (K4, L, 4) with K4 >= K/4 dwords, as x + 128 when biased (the unsigned operand of vpdpbusd); L =
    16 (512-bit registers) or 8 (256-bit). A block of L dwords of every row at a time, so its lines
    stay in L1; with L = 16 a last 32 bytes of a row (K % 64 == 32) fill half a block."""
    unit = 4                                       # elements per dword
    VB = ir.VectorType(ir.IntType(8), 4 * L)       # a row's bytes of one block
    VL = ir.VectorType(i32, L)

    def kern(typingctx, xq, g, xg):
        sig = types.void(xq, g, xg)

        def codegen(context, builder, signature, args):
            xa, _, ya = (array(context, builder, signature.args[k], args[k]) if k != 1 else None for k in range(3))
            gv = args[1]
            M = builder.extract_value(xa.shape, 0)
            K = builder.extract_value(xa.shape, 1)
            base = builder.gep(byte_ptr(builder, ya.data), [builder.mul(gv, builder.mul(builder.extract_value(ya.shape, 1), c64(4 * L)))])
            n = builder.sub(M, builder.mul(gv, c64(L)))
            n = builder.select(builder.icmp_signed("<", n, c64(L)), n, c64(L))
            step = L * unit                            # elements per block of L dwords
            with cgutils.for_range_slice(builder, c64(0), K, c64(step)) as (k, _):
                full = builder.icmp_signed("<=", builder.add(k, c64(step)), K)
                with cgutils.for_range(builder, n) as rl:
                    r = rl.index
                    src = builder.gep(byte_ptr(builder, xa.data), [builder.mul(builder.add(builder.mul(gv, c64(L)), r), K)])
                    dst = builder.gep(base, [builder.mul(r, c64(4))])
                    if L == 8:                         # K % 32 == 0: every block whole
                        v = vload(builder, builder.gep(src, [k]), VB)
                    else:
                        with builder.if_else(full) as (whole, half):
                            with whole:
                                v64 = vload(builder, builder.gep(src, [k]), V64B)
                                at_whole = builder.block
                            with half:                     # the row's last 32 bytes, the rest zero
                                v32 = vload(builder, builder.gep(src, [k]), V32B)
                                v32 = builder.shuffle_vector(v32, ir.Constant(V32B, [0] * 32), ir.Constant(ir.VectorType(i32, 64), list(range(64))))
                                at_half = builder.block
                        v = builder.phi(V64B)
                        v.add_incoming(v64, at_whole)
                        v.add_incoming(v32, at_half)
                    if biased:
                        v = builder.xor(v, ir.Constant(VB, [0x80] * (4 * L)))
                    v = builder.bitcast(v, VL)
                    for e in range(L):                     # dword k/unit + e -> 4L (k/unit + e) + 4r
                        at = builder.mul(builder.add(builder.sdiv(k, c64(unit)), c64(e)), c64(4 * L))
                        builder.store(builder.extract_element(v, c32(e)),
                                      builder.bitcast(builder.gep(dst, [at]), i32.as_pointer()), align=1)
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"regroup{L}_bytes{'_biased' if biased else ''}"
    return intrinsic(kern)


_regroup_bytes, _regroup_biased, _regroup8_biased = _regroup_kernel(False), _regroup_kernel(True), _regroup_kernel(True, 8)


@njit(parallel=True, cache=True, error_model="numpy")
def regroup_bytes(xq):
    """q8_K rows (M, K) -> (G, K/4, 16, 4) int8: rows 16g .. 16g+15 in the lanes, zero padding (K % 64 == 0)."""
    M, K = xq.shape
    G = -(-M // 16)
    xg = np.empty((G, K // 4, 16, 4), np.int8)
    for g in prange(G):
        if M - 16 * g < 16:
            xg[g] = 0
        _regroup_bytes(xq, g, xg)
    return xg


@njit(parallel=True, cache=True, error_model="numpy")
def regroup_biased(xq, L=16):
    """q8_0 or q8_K rows (M, K), K % 32 == 0 -> (G, K4, L, 4) uint8 x + 128: rows Lg .. Lg+L-1 in the
    lanes (L = 16, or 8 with K % 32 == 0 whole blocks), K4 = K/4 rounded up to whole L-dword blocks
    (the padding, and rows past M, 128: zero; the regroup writes a half block's padding itself)."""
    M, K = xq.shape
    G = -(-M // L)
    xg = np.empty((G, -(-K // (4 * L)) * L, L, 4), np.uint8)
    for g in prange(G):
        if M - L * g < L:
            xg[g] = 128
        if L == 16:
            _regroup_biased(xq, g, xg)
        else:
            _regroup8_biased(xq, g, xg)
    return xg


@njit(cache=True, error_model="numpy")
def lanes(a, L=16):
    """(M, n) -> (G, n, L): a per-row array (scales, sums) with L rows in the lanes, zero padding."""
    M, n = a.shape
    G = -(-M // L)
    out = np.zeros((G, n, L), a.dtype)
    for m in range(M):
        for b in range(n):
            out[m // L, b, m % L] = a[m, b]
    return out
