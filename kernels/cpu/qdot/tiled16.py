"""Prompts of the K-quants with llama.cpp's tiled arithmetic (Q6_K, Q5_K, Q3_K, IQ4_XS, Q2_K), activation
rows in the lanes: 16 to a 512-bit register (AVX-512), 8 to a 256-bit one (AVX-VNNI).

The tiled arithmetic (8 rows or more, tiled_run_microtile_avx2) needs one exact integer per
(output, super-block), S = sum_k w_k x_k with w_k the element's value v_k times its 16-element
sub-block's scale sc_j, then res = d_w * float(S) (Q2_K, Q5_K: res = fma(-dmin_w, float(P), res)
with P = sum_j mn_j * the sub-block's sum of x; Q5_K's 32-element sub-blocks count as two of 16
with the same scale and minimum) and out = fma(res, d_x, out). Any integer arithmetic
that gives S gives these numbers bit for bit, so S is taken sub-block by sub-block on bytes:
  S = sum_j sc_j A_j - C,  A_j = sum_{k in j} v_k (x_k + 128),  C = 128 sum_j sc_j sum_{k in j} v_k
v_k (Q6_K q-32, Q3_K q-4, IQ4_XS its level, Q2_K and Q5_K q) fits a signed byte, x + 128 is vpdpbusd's
unsigned operand (rows16.regroup_biased), and C depends on the weights alone. So a panel of weight
rows is unpacked once (lane_unpack_bytes: the values, the scales as int32, C, d), and per sub-block
of one weight row 4 vpdpbusd (a broadcast weight dword against the same dword of 16 or 8 rows) give
A_j for 16 or 8 outputs, one vpmulld scales it. Bounds: |A_j| <= 16 * 255 * 128, |sc_j A_j| < 2^24,
|S|, |C| < 2^29. vpdpbusd multiplies 4 byte pairs a lane where vpdpwssd (which the int16 products
value x scale would need) multiplies 2.

AMX (kernels.cpu.qdot.amx) takes its panels from lane_unpack16's int16 products (not Q5_K's: under
AMX its prompts take these kernels too). With AVX-VNNI alone (256-bit registers, 16 of them) the
same kernels put 8 rows in the lanes (LANES); with AVX2 alone (no vpdpbusd) the per-type kernels
run every prompt.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels import types as T
from kernels.cpu.qdot.iq4_xs import IQ4_XS_BLOCK, _decode as _iq4_xs_decode
from kernels.cpu.qdot.q2_k import Q2_K_BLOCK, _decode as _q2_k_decode
from kernels.cpu.qdot.q3_k import Q3_K_BLOCK, _decode as _q3_k_decode
from kernels.cpu.qdot.q5_k import Q5_K_BLOCK, decode_lanes as _q5_k_decode
from kernels.cpu.qdot.q6_k import Q6_K_BLOCK, decode_signed as _q6_k_decode
from kernels.cpu.qdot import rows16
from kernels.cpu.qdot.rows16 import V32S, store_lanes, vpdpwssd
from kernels.cpu.simd import (VNNI, WIDE, array, byte_ptr, c32, c64, call, f32, i32, load_as, not_this_variant, splat,
                              vload, vstore)

# Activation rows in a register's lanes (LANES), and the tiles' weight rows (NW) and groups of rows
# (MX): 16 on 512-bit registers (32 of them), 8 on AVX-VNNI's 256-bit ones (16 of them: 4 weight
# rows and one group, so that the accumulators, a sub-block's 4 activation vectors and the
# temporaries fit). The 8-lane kernels compile on AVX-512 too, where the tests run them.
LANES = 16 if WIDE else 8
NW16, MX16 = 8, 2
NW8 = 4
NW = NW16 if WIDE else NW8            # whole tiles of weight rows (takes())
PANEL_BYTES = 512 << 10      # the unpacked panel (rows x K bytes) stays in L2 beside the activations
# From this many activation rows on (llama.cpp's tiled arithmetic starts at 8), a batched run
# takes these kernels: with 16 lanes a group partly empty still costs less than the per-type
# kernels from 10 rows, with 8 a group is full at 8 (README: measured).
PROMPT_MIN_ROWS = 10 if WIDE else 8


def _each_block(builder, wa, r0v, nr, nb, block_bytes, decode, mins, da, dma, mna, body):
    """The unpackers' loop: for rows r < nr (GGUF row r0 + r of wa) and super-blocks b, decode the
    block, store its d at (r, b) of da (with mins also dmin into dma and the 16 minimums into mna),
    then body(r, b, rb = r*nb + b, qs, ws, ss) stores the rest."""
    with cgutils.for_range(builder, nr) as rl:
        r = rl.index
        src = builder.gep(byte_ptr(builder, wa.data), [builder.mul(builder.add(r0v, r), builder.extract_value(wa.strides, 0))])
        with cgutils.for_range(builder, nb) as bl:
            b = bl.index
            rb = builder.add(builder.mul(r, nb), b)
            qs, ws, ss, dw, dmin, mn = decode(builder, builder.gep(src, [builder.mul(b, c64(block_bytes))]))
            builder.store(dw, builder.gep(da.data, [rb]))
            if mins:
                builder.store(dmin, builder.gep(dma.data, [rb]))
                vstore(builder, mn, builder.gep(byte_ptr(builder, mna.data), [builder.mul(rb, c64(32))]))
            body(r, b, rb, qs, ws, ss)


def lane_unpack16(name: str, block_bytes: int, decode, signed: bool, mins: bool):
    """AMX's unpacker (w, r0, n_rows, wp, dwp, dmp, mnp): GGUF rows r0 .. r0+n_rows-1 of a type on
    kernels.cpu.qdot.lanes (or Q6_K, q6_k.decode_signed) -> wp (P, K) int16 and dwp (P, nb) d, from
    its decoder: per 32-element chunk the values (signed: ws, else qs)
    widened to int16 and times the chunk's two scales (ss: lanes 0-7 elements 0..15, lanes 8-15
    elements 16..31); with mins (Q2_K) also dmin into dmp (P, nb) and the 16 minimums into mnp
    (P, nb, 16) int16."""

    def kern(typingctx, w, r0, n_rows, wp, dwp, dmp, mnp):
        sig = types.void(w, r0, n_rows, wp, dwp, dmp, mnp)

        def codegen(context, builder, signature, args):
            wa, _, _, pa, da, dma, mna = (array(context, builder, signature.args[k], args[k]) if k not in (1, 2) else None
                                          for k in range(7))
            r0v, nr = args[1], args[2]
            nb = builder.extract_value(da.shape, 1)
            K = builder.extract_value(pa.shape, 1)
            halves = ir.Constant(ir.VectorType(i32, 32), [0] * 16 + [8] * 16)

            def body(r, b, rb, qs, ws, ss):
                dst = builder.gep(byte_ptr(builder, pa.data), [builder.mul(r, builder.mul(K, c64(2)))])
                for c in range(8):
                    v = builder.sext(ws[c], V32S) if signed else builder.zext(qs[c], V32S)
                    wv = builder.mul(v, builder.shuffle_vector(ss[c], ss[c], halves))
                    vstore(builder, wv, builder.gep(dst, [builder.mul(builder.add(builder.mul(b, c64(256)), c64(32 * c)), c64(2))]))

            _each_block(builder, wa, r0v, nr, nb, block_bytes, decode, mins, da, dma, mna, body)
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"{name}_unpack16"
    return intrinsic(kern)


q6_k_unpack16 = lane_unpack16("q6_k", Q6_K_BLOCK, _q6_k_decode, True, False)
q3_k_unpack16 = lane_unpack16("q3_k", Q3_K_BLOCK, _q3_k_decode, True, False)
iq4_xs_unpack16 = lane_unpack16("iq4_xs", IQ4_XS_BLOCK, _iq4_xs_decode, True, False)
q2_k_unpack16 = lane_unpack16("q2_k", Q2_K_BLOCK, _q2_k_decode, False, True)


@njit(cache=True, inline="always")
def unpack16(ggml_type, w, r0, n_rows, wp, dwp, dmp, mnp):
    """The unpacker of ggml_type (Q6_K, Q3_K, Q2_K, or IQ4_XS): see lane_unpack16."""
    if ggml_type == T.Q6_K:
        q6_k_unpack16(w, r0, n_rows, wp, dwp, dmp, mnp)
    elif ggml_type == T.Q3_K:
        q3_k_unpack16(w, r0, n_rows, wp, dwp, dmp, mnp)
    elif ggml_type == T.Q2_K:
        q2_k_unpack16(w, r0, n_rows, wp, dwp, dmp, mnp)
    else:
        iq4_xs_unpack16(w, r0, n_rows, wp, dwp, dmp, mnp)


@njit(cache=True)
def takes(ggml_type, n_out, run_start, run_len, run_batched):
    """Does a product take these kernels? Q6_K, Q5_K, Q3_K, IQ4_XS or Q2_K, one batched run (a prompt)
    of PROMPT_MIN_ROWS rows or more, where vpdpbusd is (AVX-512 or AVX-VNNI), whole tiles of weight rows."""
    return (VNNI and (ggml_type == T.Q6_K or ggml_type == T.Q5_K or ggml_type == T.Q3_K or ggml_type == T.IQ4_XS
                      or ggml_type == T.Q2_K)
            and run_start.shape[0] == 1 and run_batched[0] and run_len[0] >= PROMPT_MIN_ROWS and n_out % NW == 0)


# --- The byte kernels (the module's docstring) ----------------------------------------------------

def lane_unpack_bytes(name: str, block_bytes: int, decode, signed: bool, mins: bool):
    """An unpacker (w, r0, n_rows, wp, scp, cp, dwp, dmp, mnp): GGUF rows r0 .. r0+n_rows-1 of a
    lanes type -> wp (P, K) int8 the values v, scp (P, nb, 16) int32 the sub-block scales, cp (P, nb)
    int32 C, dwp (P, nb) d; with mins (Q2_K, Q5_K) dmin into dmp (P, nb) and the 16 minimums into mnp
    (P, nb, 16) int16."""

    def kern(typingctx, w, r0, n_rows, wp, scp, cp, dwp, dmp, mnp):
        sig = types.void(w, r0, n_rows, wp, scp, cp, dwp, dmp, mnp)

        def codegen(context, builder, signature, args):
            wa, _, _, pa, sa, ca, da, dma, mna = (array(context, builder, signature.args[k], args[k]) if k not in (1, 2) else None
                                                  for k in range(9))
            r0v, nr = args[1], args[2]
            nb = builder.extract_value(da.shape, 1)
            K = builder.extract_value(pa.shape, 1)
            V32I = ir.VectorType(i32, 32)
            halves = ir.Constant(V32I, [0] * 16 + [8] * 16)

            def body(r, b, rb, qs, ws, ss):
                dst = builder.gep(byte_ptr(builder, pa.data), [builder.mul(r, K)])
                total = ir.Constant(i32, 0)
                for c in range(8):
                    v = ws[c] if signed else qs[c]
                    vstore(builder, v, builder.gep(dst, [builder.add(builder.mul(b, c64(256)), c64(32 * c))]))
                    for h in range(2):
                        sc = builder.sext(builder.extract_element(ss[c], c32(8 * h)), i32)
                        builder.store(sc, builder.gep(sa.data, [builder.add(builder.mul(rb, c64(16)), c64(2 * c + h))]))
                    v32 = builder.sext(v, V32I) if signed else builder.zext(v, V32I)
                    wv = builder.mul(v32, builder.sext(builder.shuffle_vector(ss[c], ss[c], halves), V32I))
                    total = builder.add(total, call(builder, "llvm.vector.reduce.add.v32i32", i32, [wv]))
                builder.store(builder.mul(total, ir.Constant(i32, 128)), builder.gep(ca.data, [rb]))

            _each_block(builder, wa, r0v, nr, nb, block_bytes, decode, mins, da, dma, mna, body)
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"{name}_unpack_bytes"
    return intrinsic(kern)


q6_k_unpack_bytes = lane_unpack_bytes("q6_k", Q6_K_BLOCK, _q6_k_decode, True, False)
q3_k_unpack_bytes = lane_unpack_bytes("q3_k", Q3_K_BLOCK, _q3_k_decode, True, False)
iq4_xs_unpack_bytes = lane_unpack_bytes("iq4_xs", IQ4_XS_BLOCK, _iq4_xs_decode, True, False)
q2_k_unpack_bytes = lane_unpack_bytes("q2_k", Q2_K_BLOCK, _q2_k_decode, False, True)
q5_k_unpack_bytes = lane_unpack_bytes("q5_k", Q5_K_BLOCK, _q5_k_decode, False, True)


def _tile(NW: int, MX: int, mins: bool, L: int):
    """kern(wp, scp, cp, dwp, dmp, mnp, j0, xb, dx16, bs16, g, out, n0, M): out[L(g+x) + l, n0+j0+j]
    for j < NW, x < MX and the L lanes l (rows below M; L = 16 on 512-bit registers, 8 on 256-bit).
    wp .. mnp from lane_unpack_bytes; xb (G, K/4, L, 4) uint8 the rows + 128 (rows16.regroup_biased),
    dx16 (G, nb, L) float32 and (mins) bs16 (G, K/32, L, 2) int16 the 16-element sums of x, from
    rows16 (P: vpdpwssd on their pairs)."""
    VI, VF = ir.VectorType(i32, L), ir.VectorType(f32, L)

    def kern(typingctx, wp, scp, cp, dwp, dmp, mnp, j0, xb, dx16, bs16, g, out, n0, M):
        sig = types.void(wp, scp, cp, dwp, dmp, mnp, j0, xb, dx16, bs16, g, out, n0, M)

        def codegen(context, builder, signature, args):
            wa, sa, ca, da, dma, mna, _, xa, dxa, ba, _, oa = (array(context, builder, signature.args[k], args[k])
                                                               if k not in (6, 10) else None for k in range(12))
            j0v, gv, n0v, Mv = args[6], args[10], args[12], args[13]
            K = builder.extract_value(wa.shape, 1)
            nb = builder.extract_value(da.shape, 1)
            N = builder.extract_value(oa.shape, 1)
            rows = [builder.add(j0v, c64(j)) for j in range(NW)]
            wrow = [builder.gep(byte_ptr(builder, wa.data), [builder.mul(rows[j], K)]) for j in range(NW)]
            xg = [builder.gep(byte_ptr(builder, xa.data), [builder.mul(builder.add(gv, c64(x)), builder.mul(K, c64(L)))])
                  for x in range(MX)]
            dxg = [builder.gep(dxa.data, [builder.mul(builder.add(gv, c64(x)), builder.mul(nb, c64(L)))]) for x in range(MX)]
            bg = [builder.gep(byte_ptr(builder, ba.data), [builder.mul(builder.add(gv, c64(x)), builder.mul(nb, c64(8 * 4 * L)))])
                  for x in range(MX)] if mins else None
            zero_i = ir.Constant(VI, [0] * L)
            acc = [[cgutils.alloca_once_value(builder, ir.Constant(VF, [0.0] * L)) for _ in range(MX)] for _ in range(NW)]
            S = [[cgutils.alloca_once(builder, VI) for _ in range(MX)] for _ in range(NW)]
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                rb = [builder.add(builder.mul(rows[j], nb), b) for j in range(NW)]
                for j in range(NW):
                    minus_c = splat(builder, builder.neg(builder.load(builder.gep(ca.data, [rb[j]]))), VI)
                    for x in range(MX):
                        builder.store(minus_c, S[j][x])
                with cgutils.for_range(builder, c64(16)) as sl:                 # 16-element sub-blocks
                    s = sl.index
                    e = builder.add(builder.mul(b, c64(64)), builder.mul(s, c64(4)))   # its first dword
                    xs = [[vload(builder, builder.gep(xg[x], [builder.mul(builder.add(e, c64(t)), c64(4 * L))]), VI)
                           for t in range(4)] for x in range(MX)]
                    for j in range(NW):
                        sc = splat(builder, builder.load(builder.gep(sa.data, [builder.add(builder.mul(rb[j], c64(16)), s)])), VI)
                        wd = [splat(builder, load_as(builder, wrow[j], i32, builder.mul(builder.add(e, c64(t)), c64(4))), VI)
                              for t in range(4)]
                        for x in range(MX):
                            a = zero_i
                            for t in range(4):
                                a = call(builder, f"llvm.x86.avx512.vpdpbusd.{32 * L}", VI, [a, xs[x][t], wd[t]])
                            builder.store(builder.add(builder.load(S[j][x]), builder.mul(a, sc)), S[j][x])
                for x in range(MX):
                    dxv = vload(builder, builder.gep(dxg[x], [builder.mul(b, c64(L))]), VF)
                    if mins:                                                   # 8 pairs of 16-element sums
                        bsx = [vload(builder, builder.gep(bg[x], [builder.mul(builder.add(builder.mul(b, c64(8)), c64(q)), c64(4 * L))]), VI)
                               for q in range(8)]
                    for j in range(NW):
                        dw = splat(builder, builder.load(builder.gep(da.data, [rb[j]])), VF)
                        res = builder.fmul(dw, builder.sitofp(builder.load(S[j][x]), VF))
                        if mins:
                            at = builder.mul(rb[j], c64(32))
                            P = zero_i
                            for q in range(8):
                                mq = splat(builder, load_as(builder, byte_ptr(builder, mna.data), i32, builder.add(at, c64(4 * q))), VI)
                                P = (vpdpwssd(builder, P, bsx[q], mq) if L == 16 else
                                     call(builder, "llvm.x86.avx512.vpdpwssd.256", VI, [P, bsx[q], mq]))
                            dm = splat(builder, builder.fneg(builder.load(builder.gep(dma.data, [rb[j]]))), VF)
                            res = call(builder, f"llvm.fma.v{L}f32", VF, [dm, builder.sitofp(P, VF), res])
                        builder.store(call(builder, f"llvm.fma.v{L}f32", VF, [res, dxv, builder.load(acc[j][x])]), acc[j][x])
            for x in range(MX):
                for j in range(NW):
                    store_lanes(builder, builder.load(acc[j][x]), oa.data, N, Mv, builder.add(gv, c64(x)),
                                builder.add(n0v, rows[j]))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"tiled_bytes_{L}_{NW}x{MX}{'_mins' if mins else ''}"
    return intrinsic(kern)


if WIDE:
    tile16, tile16_1 = _tile(NW16, MX16, False, 16), _tile(NW16, 1, False, 16)
    tile16m, tile16_1m = _tile(NW16, MX16, True, 16), _tile(NW16, 1, True, 16)
else:
    tile16 = tile16_1 = tile16m = tile16_1m = not_this_variant
if VNNI:
    tile8, tile8m = _tile(NW8, 1, False, 8), _tile(NW8, 1, True, 8)
else:
    tile8 = tile8m = not_this_variant


@njit(cache=True, inline="always")
def unpack_bytes(ggml_type, w, r0, n_rows, wp, scp, cp, dwp, dmp, mnp):
    """The byte unpacker of ggml_type (Q6_K, Q5_K, Q3_K, Q2_K or IQ4_XS): see lane_unpack_bytes."""
    if ggml_type == T.Q6_K:
        q6_k_unpack_bytes(w, r0, n_rows, wp, scp, cp, dwp, dmp, mnp)
    elif ggml_type == T.Q5_K:
        q5_k_unpack_bytes(w, r0, n_rows, wp, scp, cp, dwp, dmp, mnp)
    elif ggml_type == T.Q3_K:
        q3_k_unpack_bytes(w, r0, n_rows, wp, scp, cp, dwp, dmp, mnp)
    elif ggml_type == T.Q2_K:
        q2_k_unpack_bytes(w, r0, n_rows, wp, scp, cp, dwp, dmp, mnp)
    else:
        iq4_xs_unpack_bytes(w, r0, n_rows, wp, scp, cp, dwp, dmp, mnp)


@njit(cache=True)
def operands(ggml_type, q, L):
    """A prompt's q8_K rows (qdot.Q8Buffers) as _prompt takes them, L (16 or 8) to a register: the
    rows + 128 and their scales, and for Q2_K's and Q5_K's minimums their 16-element sums as int16
    pairs."""
    xb = rows16.regroup_biased(q.xq, L)
    mins = ggml_type == T.Q2_K or ggml_type == T.Q5_K
    bs = rows16.lanes(q.bs16.view(np.int32), L) if mins else np.zeros((0, 0, L), np.int32)
    return xb, rows16.lanes(q.dxk, L), bs


@njit(parallel=True, cache=True, error_model="numpy")
def _prompt(ggml_type, w, xb, dx16, bs16, M, out):
    """GGUF rows w (N % NW == 0) of ggml_type x regrouped q8_K rows -> out (M, N) with the tiled
    arithmetic; prange over panels of weight rows, each unpacked once for every group of L
    activation rows. xb, dx16, bs16: operands(), L = xb.shape[2]."""
    N = w.shape[0]
    K = xb.shape[1] * 4
    nb = dx16.shape[1]
    G = xb.shape[0]
    P = max(NW16, min(64, PANEL_BYTES // K) // NW16 * NW16)
    mins = ggml_type == T.Q2_K or ggml_type == T.Q5_K
    wide = xb.shape[2] == 16
    for p in prange(-(-N // P)):
        r0 = p * P
        nr = min(P, N - r0)
        wp = np.empty((P, K), np.int8)
        scp = np.empty((P, nb, 16), np.int32)
        cp = np.empty((P, nb), np.int32)
        dwp = np.empty((P, nb), np.float32)
        dmp = np.empty((P, nb), np.float32)
        mnp = np.empty((P, nb, 16), np.int16)
        unpack_bytes(ggml_type, w, r0, nr, wp, scp, cp, dwp, dmp, mnp)
        if not wide:
            for g in range(G):
                for j0 in range(0, nr, NW8):
                    if mins:
                        tile8m(wp, scp, cp, dwp, dmp, mnp, j0, xb, dx16, bs16, g, out, r0, M)
                    else:
                        tile8(wp, scp, cp, dwp, dmp, mnp, j0, xb, dx16, bs16, g, out, r0, M)
            continue
        g = 0
        while g + MX16 <= G:
            for j0 in range(0, nr, NW16):
                if mins:
                    tile16m(wp, scp, cp, dwp, dmp, mnp, j0, xb, dx16, bs16, g, out, r0, M)
                else:
                    tile16(wp, scp, cp, dwp, dmp, mnp, j0, xb, dx16, bs16, g, out, r0, M)
            g += MX16
        while g < G:
            for j0 in range(0, nr, NW16):
                if mins:
                    tile16_1m(wp, scp, cp, dwp, dmp, mnp, j0, xb, dx16, bs16, g, out, r0, M)
                else:
                    tile16_1(wp, scp, cp, dwp, dmp, mnp, j0, xb, dx16, bs16, g, out, r0, M)
            g += 1


# The kernels are compiled only where vpdpbusd is; elsewhere the dispatch never calls them.
prompt = _prompt if VNNI else not_this_variant
