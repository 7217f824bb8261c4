"""Q8_0, Q5_0, Q4_0, IQ4_NL, Q4_1 and Q5_1 weights times q8_0 (q8_1) activation rows, llama.cpp's numbers bit for bit:
the x8 layout (8 weight rows in the lanes; decode and short batches) and, for prompt-sized batches
of Q5_0 (and of Q8_0 with 512-bit registers), the unpacked panel kernel."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels import types as T
from kernels.cpu.qdot import rows16
from kernels.cpu.qdot.common import NB_PAD, PREFETCH
from kernels.cpu.simd import (
    V8F, Chains, prefetch, V8I, V32B, V8H, array, byte_ptr, c32, c64, call, fma, hsum8, i32, load_as,
    V16F, V16I, VNNI, WIDE, dot4, psign, pshufb, splat, transpose, vconst, vload, vstore,
)

Q8_0_BLOCK, Q5_0_BLOCK = 34, 22   # bytes per 32-element GGUF block

# --- Q8_0 / Q5_0 --------------------------------------------------------------------------------

# Prompt-sized batches of Q5_0 rows: a panel of PANEL weight rows is unpacked once into int8 (q - 16,
# at most 16 in magnitude) with each block's correction 128 * (sum of each 4-group of w), and the
# activations are stored biased, x + 128 as uint8. Then vpmaddubsw(x + 128, w) cannot saturate
# (2 * 255 * 16 < 32767) and its 4-sums minus the correction are the exact dots: no sign
# instructions, which on Zen 3 share ports with the conversions and the FMAs (1.9 against 2.3 cycles
# per (row, row, block)). d_w * d_x for the tile is computed once per call, 8 blocks per multiply.
# With AVX-512 the panel's tile puts 16 activation rows in the lanes instead (_q0_tile16_kernel), and
# Q8_0 takes the panel too: the same per-lane float recipe (llama.cpp's vec_dot and tinyBLAS_Q0_AVX
# for both), its values as they are: vpdpbusd sums the byte products in int32 exactly. On 256-bit
# registers Q8_0 keeps the x8 kernel: without VNNI the panel's vpmaddubsw would saturate on its values
# (up to 128 in magnitude, against x + 128), and with AVX-VNNI alone the panel was not measured for it.
PANEL = 16
# the 256-bit tile: NR weight rows x MR activation rows of accumulators, as many as 16 registers hold
PANEL_NR, PANEL_MR = 2, 3


def _q5_0_panel_kernel(NR: int, MR: int):
    """kern(wp, cp, dwp, j0, xb, dxb, g, D, out, n0, m0, m_valid): out[m0+i, n0+j0+j] for j < NR and
    i < min(MR, m_valid). wp (P, nb, 32) int8 values, cp (P, nb, 8) int32 corrections, dwp (P, nbp)
    float32 scales of the panel; xb (G, nb, MR, 32) uint8 biased activations, dxb (G, MR, nbp) their
    scales; D (NR*MR, nbp) float32 scratch."""

    def kern(typingctx, wp, cp, dwp, j0, xb, dxb, g, D, out, n0, m0, m_valid):
        sig = types.void(wp, cp, dwp, j0, xb, dxb, g, D, out, n0, m0, m_valid)

        def codegen(context, builder, signature, args):
            wa, ca, dwa, _, xa, dxa, _, Da, oa = (array(context, builder, signature.args[k], args[k])
                                                  if k not in (3, 6) else None for k in range(9))
            j0v, gv, n0v, m0v, m_valid = args[3], args[6], args[9], args[10], args[11]
            nb = builder.extract_value(wa.shape, 1)
            nbp = builder.extract_value(dwa.shape, 1)
            N = builder.extract_value(oa.shape, 1)
            wbase = byte_ptr(builder, wa.data)
            cbase = byte_ptr(builder, ca.data)
            # D[j*MR + i, b] = d_w[j0+j, b] * d_x[i, b], 8 blocks per step (the arrays are padded)
            dw_rows = [builder.gep(dwa.data, [builder.mul(builder.add(j0v, c64(j)), nbp)]) for j in range(NR)]
            dx_rows = [builder.gep(dxa.data, [builder.mul(builder.add(builder.mul(gv, c64(MR)), c64(i)), nbp)])
                       for i in range(MR)]
            with cgutils.for_range_slice(builder, c64(0), nbp, c64(8)) as (b, _):
                dwv = [vload(builder, builder.gep(r, [b]), V8F) for r in dw_rows]
                for j in range(NR):
                    for i in range(MR):
                        dst = builder.gep(Da.data, [builder.add(builder.mul(c64(j * MR + i), nbp), b)])
                        vstore(builder, builder.fmul(dwv[j], vload(builder, builder.gep(dx_rows[i], [b]), V8F)), dst)
            row_w = builder.mul(nb, c64(32))
            wrow = [builder.gep(wbase, [builder.mul(builder.add(j0v, c64(j)), row_w)]) for j in range(NR)]
            crow = [builder.gep(cbase, [builder.mul(builder.add(j0v, c64(j)), row_w)]) for j in range(NR)]
            xg = builder.gep(byte_ptr(builder, xa.data), [builder.mul(gv, builder.mul(nb, c64(MR * 32)))])
            zero = ir.Constant(V8F, [0.0] * 8)
            accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(NR)] for _ in range(MR)]
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                off = builder.mul(b, c64(32))
                ws = [vload(builder, builder.gep(wrow[j], [off]), V32B) for j in range(NR)]
                cs = [vload(builder, builder.gep(crow[j], [off]), V8I) for j in range(NR)]
                xb_b = builder.gep(xg, [builder.mul(b, c64(MR * 32))])
                for i in range(MR):
                    x = vload(builder, builder.gep(xb_b, [c64(32 * i)]), V32B)
                    for j in range(NR):
                        # VNNI: the negated correction is vpdpbusd's accumulator, one instruction
                        isum = dot4(builder, x, ws[j], cs[j]) if VNNI else builder.sub(dot4(builder, x, ws[j]), cs[j])
                        dp = builder.gep(Da.data, [builder.add(builder.mul(c64(j * MR + i), nbp), b)])
                        scale = splat(builder, builder.load(dp), V8F)
                        acc = accs[i][j]
                        builder.store(fma(builder, scale, builder.sitofp(isum, V8F), builder.load(acc)), acc)
            for i in range(MR):
                with builder.if_then(builder.icmp_signed("<", c64(i), m_valid)):
                    for j in range(NR):
                        row = builder.add(m0v, c64(i))
                        col = builder.add(n0v, builder.add(j0v, c64(j)))
                        idx = builder.add(builder.mul(row, N), col)
                        builder.store(hsum8(builder, builder.load(accs[i][j])), builder.gep(oa.data, [idx]))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"q5_0_panel_{NR}x{MR}"
    return intrinsic(kern)


# The 512-bit tile: 16 activation rows in the lanes (biased x + 128, rows16.regroup_biased). One
# vpdpbusd takes a weight dword, broadcast, against the same dword of the 16 rows, starting from that
# dword's correction -128 * (its 4-group sum), broadcast too: each lane is then llama.cpp's exact
# integer for one (activation row, weight row, block, float lane k). Every output keeps its 8 float
# lanes as 8 registers of 16 rows, fma(d_w * d_x, float(that integer), acc) block by block, and
# hsum_float_8's tree becomes 7 vertical adds. Per product step that is vpdpbusd, vcvtdq2ps and
# vfmadd with both broadcasts folded into loads; a tile with two rows per register (lanes 2k + h)
# also needed a copy of the correction register per step and a 64-bit broadcast of the scale pair,
# which took the vector pipes the products need (README: measured).
TILE16_NW = 2                   # weight rows per tile: 8 accumulators each, with the scales in registers


# Q4_0 and IQ4_NL (llama.cpp's repacked gemm: one fma per block, on the block's whole integer dot)
# take the same panel with a tile of their own: per weight row and block one int32 register of 16
# rows carries the block's 8 vpdpbusd from the block's correction, then one vcvtdq2ps and vfmadd.
# The float work is an eighth of Q5_0's, so 8 weight rows per tile keep 8 dot chains in flight.
BLOCK16_NW = 8


def _q0_tile16_kernel(NW: int, per_block: bool):
    """kern(wp, cp, dwp, j0, xg, dx16, g, out): out[j0 + j, l] = the output of panel row j0 + j (j < NW)
    and activation row 16g + l, for the 16 lanes l (out: (PANEL, 16) float32, rows16.store_block
    writes it to the product). wp (P, nb, 32) int8 values, cp (P, nb, 8) int32 corrections (the
    dots' starting values: per group, or per_block the block's in slot 0, for the per-block recipe
    fma(float(the block's dot), d_w * d_x, acc)) and dwp (P, nbp) float32 scales of the panel
    (_x8_panel_unpacker); xg (G, K4, 16, 4) uint8 x + 128 (rows16.regroup_biased), dx16 (G, nb, 16)
    float32 their scales (rows16.lanes)."""

    def kern(typingctx, wp, cp, dwp, j0, xg, dx16, g, out):
        sig = types.void(wp, cp, dwp, j0, xg, dx16, g, out)

        def codegen(context, builder, signature, args):
            wa, ca, da, _, xa, dxa, _, oa = (array(context, builder, signature.args[k], args[k])
                                             if k not in (3, 6) else None for k in range(8))
            j0v, gv = args[3], args[6]
            nb = builder.extract_value(wa.shape, 1)
            nbp = builder.extract_value(da.shape, 1)
            rows = [builder.add(j0v, c64(j)) for j in range(NW)]
            wrow = [builder.gep(byte_ptr(builder, wa.data), [builder.mul(r, builder.mul(nb, c64(32)))]) for r in rows]
            crow = [builder.gep(ca.data, [builder.mul(r, builder.mul(nb, c64(8)))]) for r in rows]
            drow = [builder.gep(da.data, [builder.mul(r, nbp)]) for r in rows]
            xgroup = builder.gep(byte_ptr(builder, xa.data), [builder.mul(gv, builder.mul(builder.extract_value(xa.shape, 1), c64(64)))])
            dxgroup = builder.gep(dxa.data, [builder.mul(gv, builder.mul(nb, c64(16)))])
            zero = ir.Constant(V16F, [0.0] * 16)
            accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(1 if per_block else 8)] for _ in range(NW)]
            fma16 = lambda a, b, acc: builder.store(call(builder, "llvm.fma.v16f32", V16F, [a, b, builder.load(acc)]), acc)  # noqa: E731
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                dx = vload(builder, builder.gep(dxgroup, [builder.mul(b, c64(16))]), V16F)
                scale = [builder.fmul(splat(builder, builder.load(builder.gep(drow[j], [b])), V16F), dx) for j in range(NW)]
                dots = [splat(builder, builder.load(builder.gep(crow[j], [builder.mul(b, c64(8))])), V16I) for j in range(NW)] if per_block else None
                for k in range(8):
                    d = builder.add(builder.mul(b, c64(8)), c64(k))                  # the dword's index in a row
                    x = vload(builder, builder.gep(xgroup, [builder.mul(d, c64(64))]), V16I)
                    for j in range(NW):
                        w = splat(builder, load_as(builder, wrow[j], i32, builder.mul(d, c64(4))), V16I)
                        if per_block:                                # the block's dot, group after group
                            dots[j] = call(builder, "llvm.x86.avx512.vpdpbusd.512", V16I, [dots[j], x, w])
                        else:                                        # float lane k: its group's dot
                            c = splat(builder, builder.load(builder.gep(crow[j], [d])), V16I)
                            isum = call(builder, "llvm.x86.avx512.vpdpbusd.512", V16I, [c, x, w])
                            fma16(scale[j], builder.sitofp(isum, V16F), accs[j][k])
                if per_block:
                    for j in range(NW):
                        fma16(builder.sitofp(dots[j], V16F), scale[j], accs[j][0])
            for j in range(NW):
                a = [builder.load(acc) for acc in accs[j]]
                if per_block:
                    total = a[0]
                else:                                   # hsum_float_8: ((x0+x4)+(x2+x6)) + ((x1+x5)+(x3+x7))
                    pair = lambda u, v: builder.fadd(a[u], a[v])                               # noqa: E731
                    total = builder.fadd(builder.fadd(pair(0, 4), pair(2, 6)), builder.fadd(pair(1, 5), pair(3, 7)))
                vstore(builder, total, builder.bitcast(builder.gep(oa.data, [builder.mul(rows[j], c64(16))]), V16F.as_pointer()))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"q0_{'block' if per_block else 'tile'}16_{NW}"
    return intrinsic(kern)


@njit(inline="always")
def has_panel(ggml_type):
    """Does this type's prompt take the panel kernel (Q5_0 and, with 512-bit registers, Q8_0, Q4_0
    and IQ4_NL)?"""
    return ggml_type == T.Q5_0 or (WIDE and (ggml_type == T.Q8_0 or ggml_type in PER_BLOCK))


@njit(parallel=True, cache=True, error_model="numpy")
def _bias_groups(xq, dx, MR, xb, dxb):
    """q8_0 rows -> groups of MR rows: xb (G, nb, MR, 32) uint8 = x + 128 (zero rows pad the last
    group), dxb (G, MR, nbp) scales (zero padding)."""
    M, K = xq.shape
    nb = K // 32
    for g in prange(xb.shape[0]):
        for i in range(MR):
            m = g * MR + i
            for b in range(nb):
                for e in range(32):
                    xb[g, b, i, e] = np.uint8(np.int32(xq[m, b * 32 + e]) + 128) if m < M else np.uint8(128)
            for b in range(dxb.shape[2]):
                dxb[g, i, b] = dx[m, b] if (m < M and b < nb) else np.float32(0.0)


@njit(parallel=True, cache=True, error_model="numpy")
def _panel_prompt_256(ggml_type, wx8, xb, dxb, M, out):
    """Q5_0 (x8 layout; the one type has_panel takes here) x biased activation groups (_bias_groups)
    -> out (M, N); prange over panels of PANEL rows, each unpacked once and used by every activation group."""
    n_groups = wx8.shape[0]
    nb = xb.shape[1]
    nbp = dxb.shape[2]
    per_panel = PANEL // 8
    for p in prange((n_groups + per_panel - 1) // per_panel):
        wp = np.zeros((PANEL, nb, 32), np.int8)
        cp = np.zeros((PANEL, nb, 8), np.int32)
        dwp = np.zeros((PANEL, nbp), np.float32)
        D = np.empty((PANEL_NR * PANEL_MR, nbp), np.float32)
        g0 = p * per_panel
        ng = min(per_panel, n_groups - g0)
        _unpack_q5_0_x8_panel(wx8, g0, ng, wp, cp, dwp)
        for g in range(xb.shape[0]):
            for j0 in range(0, ng * 8, PANEL_NR):
                q5_0_panel_256(wp, cp, dwp, j0, xb, dxb, g, D, out, g0 * 8, g * PANEL_MR, M - g * PANEL_MR)


@njit(parallel=True, cache=True, error_model="numpy")
def _panel_prompt_512(ggml_type, wx8, xg, dx16, M, out):
    """Q5_0, Q8_0, Q4_0 or IQ4_NL (x8 layout) x activation rows 16 to a register (_groups_512) ->
    out (M, N); prange over panels of PANEL rows, each unpacked once and used by every group of 16
    rows: the per-lane tile, or for Q4_0 and IQ4_NL the per-block one."""
    n_groups = wx8.shape[0]
    nb = dx16.shape[1]
    per_panel = PANEL // 8
    per_block = ggml_type in PER_BLOCK
    for p in prange((n_groups + per_panel - 1) // per_panel):
        wp = np.empty((PANEL, nb, 32), np.int8)
        cp = np.empty((PANEL, nb, 8), np.int32)
        dwp = np.empty((PANEL, nb), np.float32)
        g0 = p * per_panel
        ng = min(per_panel, n_groups - g0)
        _unpack_x8_panel(ggml_type, wx8, g0, ng, wp, cp, dwp)
        block = np.empty((PANEL, 16), np.float32)
        for g in range(xg.shape[0]):
            if per_block:
                for j0 in range(0, ng * 8, BLOCK16_NW):
                    q0_block16(wp, cp, dwp, j0, xg, dx16, g, block)
            else:
                for j0 in range(0, ng * 8, TILE16_NW):
                    q0_tile16(wp, cp, dwp, j0, xg, dx16, g, block)
            rows16.store_block(block, ng * 8, out, 16 * g, g0 * 8, M)


@njit(cache=True, error_model="numpy")
def _groups_256(xq, dx):
    M, K = xq.shape
    nbp = -(-(K // 32) // NB_PAD) * NB_PAD
    xb = np.empty((-(-M // PANEL_MR), K // 32, PANEL_MR, 32), np.uint8)
    dxb = np.empty((xb.shape[0], PANEL_MR, nbp), np.float32)
    _bias_groups(xq, dx, PANEL_MR, xb, dxb)
    return xb, dxb


@njit(cache=True, error_model="numpy")
def _groups_512(xq, dx):
    return rows16.regroup_biased(xq), rows16.lanes(dx)


# The panel kernel for this ISA: panel_operands(xq, dx) (q8_0 rows) -> the activation operands,
# panel_prompt(ggml_type, wx8, *operands, M, out) for the types has_panel takes. The 512-bit one is
# compiled only where it runs.
if WIDE:
    q0_tile16, q0_block16 = _q0_tile16_kernel(TILE16_NW, False), _q0_tile16_kernel(BLOCK16_NW, True)
    panel_prompt, panel_operands = _panel_prompt_512, _groups_512
else:
    q5_0_panel_256 = _q5_0_panel_kernel(PANEL_NR, PANEL_MR)
    panel_prompt, panel_operands = _panel_prompt_256, _groups_256


# --- the 32-element types with 8 weight rows in the lanes (decode, short batches) -----------------
# Lane r holds weight row r, so a block costs one vector step per 4-element group for 8 rows, and
# the scale is a vector of the 8 rows' d_w * d_x. Two float recipes, as llama.cpp has two kernels:
# - Q8_0 / Q5_0 (ggml_vec_dot_q*_q8_0, tinyBLAS_Q0_AVX), Q4_1 / Q5_1 (ggml_vec_dot_q*_1_q8_1, for
#   every row count: tinyBLAS does not take them): each of the 8 groups of a block has its own
#   accumulator (acc_k[r] is llama.cpp's lane k of row r), and hsum_float_8 becomes the same tree
#   across the 8 accumulators at the end. Q4_1 / Q5_1 add their minimums apart, in one float per
#   row: summs = fma(m_w, s_x, summs) block by block (GCC contracts the C `summs += m * s`), and
#   the result is hsum + summs.
# - Q4_0 / IQ4_NL (repacked by llama.cpp, ggml_gemv/gemm_q4_0_8x8_q8_0 and iq4_nl's): the block's
#   whole integer dot, then acc = fma(float(dot), d_w * d_x, acc); gemv and gemm alike.
# The x8 layouts keep GGUF's bytes per block (the 5th bits of Q5_0 permuted):
#   Q8_0:   q [group k 8][row 8][4 bytes], then d [row] f16                      (272 bytes)
#   Q5_0:   qs [j 4][row 8][4 bytes] (GGUF qs bytes 4j..4j+3: low nibbles group j, high group j+4),
#           qh [row 8] 32 bits, bit 8e + k = 5th bit of element 4k + e, then d [row] f16   (176 bytes)
#   Q4_0, IQ4_NL: qs as Q5_0's, then d [row] f16                                 (144 bytes)
#   Q4_1:   qs as Q5_0's, d [row] f16, m [row] f16                               (160 bytes)
#   Q5_1:   qs and qh as Q5_0's, d [row] f16, m [row] f16                        (192 bytes)
# Q5_0 and Q4_0 take the unsigned values q and x as is: sum (q - o) x = sum q x - o sum x, with the
# group sums of x computed once per activation row (no sign instructions). IQ4_NL's levels (one
# vpshufb from the nibbles) are signed: |w| times x with w's sign, as llama.cpp does.
X8_BLOCK = {T.Q8_0: 272, T.Q5_0: 176, T.Q4_0: 144, T.IQ4_NL: 144, T.Q4_1: 160, T.Q5_1: 192}
_GGUF_BLOCK = {T.Q8_0: Q8_0_BLOCK, T.Q5_0: Q5_0_BLOCK, T.Q4_0: 18, T.IQ4_NL: 18, T.Q4_1: 20, T.Q5_1: 24}
PER_BLOCK = (T.Q4_0, T.IQ4_NL)      # the repacked kernels' recipe: one fma per block
SIGNED = (T.Q8_0, T.IQ4_NL)         # |w| times x with w's sign; the others' values are unsigned
OFFSET = (T.Q5_0, T.Q4_0)           # the types whose offset (16, 8) comes from the group sums of x
MINS = (T.Q4_1, T.Q5_1)             # the types with a minimum per block (q8_1's s)
FIVE_BIT = (T.Q5_0, T.Q5_1)


def repack_q0_x8(raw: np.ndarray, ggml_type: int, n_cols: int) -> np.ndarray:
    """GGUF rows of the 32-element types -> (ceil(N/8), nb * X8_BLOCK) uint8, layout above."""
    block = _GGUF_BLOCK[ggml_type]
    nb = n_cols // 32
    rows = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, nb * block)
    if rows.shape[0] % 8:           # zero rows (scale 0) pad the last group; their outputs are dropped
        rows = np.concatenate([rows, np.zeros((-rows.shape[0] % 8, rows.shape[1]), np.uint8)])
    G = rows.shape[0] // 8
    k = rows.reshape(G, 8, nb, block)
    rows8 = lambda lo, hi: k[..., lo:hi].transpose(0, 2, 1, 3).reshape(G, nb, 8 * (hi - lo))   # noqa: E731
    if ggml_type == T.Q8_0:
        q = k[..., 2:34].reshape(G, 8, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(G, nb, 256)
        return np.ascontiguousarray(np.concatenate([q, rows8(0, 2)], axis=-1).reshape(G, -1))
    mins = ggml_type in MINS
    q0 = block - 16                                     # the nibbles, after d (m) (qh)
    parts = [k[..., q0:].reshape(G, 8, nb, 4, 4).transpose(0, 2, 3, 1, 4).reshape(G, nb, 128)]
    if ggml_type in FIVE_BIT:
        qh = np.ascontiguousarray(k[..., q0 - 4:q0]).view("<u4")[..., 0]               # (G, 8, nb)
        w = np.zeros_like(qh)
        for grp in range(8):
            for e in range(4):
                w |= ((qh >> np.uint32(4 * grp + e)) & np.uint32(1)) << np.uint32(8 * e + grp)
        parts.append(w.transpose(0, 2, 1).copy().view(np.uint8).reshape(G, nb, 32))
    parts += [rows8(0, 2), rows8(2, 4)] if mins else [rows8(0, 2)]
    return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(G, nb * X8_BLOCK[ggml_type]))


class _X8Block:
    """IR that reads one x8 block at byte pointer p: the weight vectors of its 8 groups, for 8 rows."""

    def __init__(self, builder, ggml_type: int, p):
        self.b, self.t, self.p = builder, ggml_type, p
        if ggml_type != T.Q8_0:
            self.qs = [vload(builder, builder.gep(p, [c64(32 * j)]), V32B) for j in range(4)]
        if ggml_type in FIVE_BIT:
            self.qh = vload(builder, builder.gep(p, [c64(128)]), V8I)

    def _f16s(self, at: int):
        return self.b.fpext(vload(self.b, self.b.gep(self.p, [c64(at)]), V8H), V8F)

    def scales(self):
        """The 8 rows' d_w (V8F)."""
        return self._f16s(X8_BLOCK[self.t] - (32 if self.t in MINS else 16))

    def mins(self):
        """The 8 rows' m_w (V8F) of Q4_1 / Q5_1."""
        return self._f16s(X8_BLOCK[self.t] - 16)

    def group(self, k: int):
        """Group k's 4 values of each row (V32B): Q8_0 its int8 values, the 4- and 5-bit types their
        unsigned values, IQ4_NL the signed levels."""
        b = self.b
        if self.t == T.Q8_0:
            return vload(b, b.gep(self.p, [c64(32 * k)]), V32B)
        v = self.qs[k % 4]
        nib = b.and_(v, vconst(V32B, 0x0F)) if k < 4 else b.and_(b.lshr(v, vconst(V32B, 4)), vconst(V32B, 0x0F))
        if self.t in FIVE_BIT:        # bit 8e + k -> bit 4 of byte e: one shift and one mask
            sh = b.shl(self.qh, vconst(V8I, 4 - k)) if k <= 4 else b.lshr(self.qh, vconst(V8I, k - 4))
            return b.or_(nib, b.bitcast(b.and_(sh, vconst(V8I, 0x10101010)), V32B))
        if self.t == T.IQ4_NL:
            return pshufb(b, ir.Constant(V32B, [int(v) for v in T.IQ4_NL_VALUES] * 2), nib)
        return nib

    def magnitude(self, w):
        """What vpmaddubsw's unsigned operand takes of a group: |w| for the signed types."""
        return psign(self.b, w, w) if self.t in SIGNED else w


def _group_dot(builder, ggml_type: int, wmag, w, x4, acc=None):
    """Each row's 4-element dot of one group (V8I) before the offset (plus acc), with x taking w's
    sign for the signed types."""
    if ggml_type in SIGNED:
        x4 = psign(builder, x4, w)
    return dot4(builder, wmag, x4, acc)


def _new_dots(builder, ggml_type: int):
    """A block's dots as _add_dot fills them: a list (one per group), or for PER_BLOCK types the
    block's one running sum, in simd.Chains (exact in any order)."""
    return Chains(builder, ir.Constant(V8I, [0] * 8)) if ggml_type in PER_BLOCK else []


def _add_dot(builder, ggml_type: int, dots, wmag, w, x4) -> None:
    """Group k's dot into dots (_new_dots)."""
    if ggml_type in PER_BLOCK:
        dots.add(_group_dot, ggml_type, wmag, w, x4)
    else:
        dots.append(_group_dot(builder, ggml_type, wmag, w, x4))


def _block_step(builder, ggml_type: int, dots, sums, scale, accs, mins=None):
    """One block's float steps for one activation row: dots (_new_dots) of the groups, sums (8 i32): 16 x
    the row's group sums, scale (V8F) d_w * d_x, accs: the row's accumulator pointers (8; 1 for
    PER_BLOCK types; 8 and summs for MINS types), mins (V8F): m_w * s_x's factors (m_w, s_x)."""
    if ggml_type in PER_BLOCK:                    # dots: the block's running sum (_new_dots)
        tot = dots.total()
        if ggml_type == T.Q4_0:                  # 8 x the block's sum of x = (16 x its group sums) / 2
            s = sums[0]
            for v in sums[1:]:
                s = builder.add(s, v)
            tot = builder.sub(tot, splat(builder, builder.ashr(s, ir.Constant(i32, 1)), V8I))
        builder.store(fma(builder, builder.sitofp(tot, V8F), scale, builder.load(accs[0])), accs[0])
        return
    for k in range(8):
        isum = builder.sub(dots[k], splat(builder, sums[k], V8I)) if ggml_type in OFFSET else dots[k]
        builder.store(fma(builder, scale, builder.sitofp(isum, V8F), builder.load(accs[k])), accs[k])
    if ggml_type in MINS:
        builder.store(fma(builder, *mins, builder.load(accs[8])), accs[8])


def _finish(builder, ggml_type: int, accs):
    """The 8 rows' outputs (V8F) from one activation row's accumulators."""
    if ggml_type in PER_BLOCK:
        return builder.load(accs[0])
    a = [builder.load(p) for p in accs]
    r = [builder.fadd(a[4 + k], a[k]) for k in range(4)]
    res = builder.fadd(builder.fadd(r[0], r[2]), builder.fadd(r[1], r[3]))      # hsum_float_8, 8 rows at once
    return builder.fadd(res, a[8]) if ggml_type in MINS else res


def _n_accs(ggml_type: int) -> int:
    return 1 if ggml_type in PER_BLOCK else (9 if ggml_type in MINS else 8)


def _q0_x8_kernel(ggml_type: int):
    """kern(wx8, g, xq, dx, sx, s1, m, out): out[m, 8g .. 8g+8] for activation row m, accumulators in
    registers. sx (M, nb*8) int32: 16 x the 4-element group sums of xq (OFFSET types), s1 (M, nb):
    q8_1's s (MINS types)."""
    block = X8_BLOCK[ggml_type]

    def kern(typingctx, wx8, g, xq, dx, sx, s1, m, out):
        sig = types.void(wx8, g, xq, dx, sx, s1, m, out)

        def codegen(context, builder, signature, args):
            wa, _, xa, da, sa, s1a, _, oa = (array(context, builder, signature.args[k], args[k]) if k not in (1, 6) else None
                                             for k in range(8))
            gv, mv = args[1], args[6]
            nb = builder.extract_value(da.shape, 1)
            K = builder.extract_value(xa.shape, 1)
            N = builder.extract_value(oa.shape, 1)
            group = builder.gep(byte_ptr(builder, wa.data), [builder.mul(gv, builder.mul(nb, c64(block)))])
            xrow = builder.gep(byte_ptr(builder, xa.data), [builder.mul(mv, K)])
            drow = builder.gep(da.data, [builder.mul(mv, nb)])
            srow = builder.gep(sa.data, [builder.mul(mv, builder.mul(nb, c64(8)))])
            acc = [cgutils.alloca_once_value(builder, ir.Constant(V8F, [0.0] * 8)) for _ in range(_n_accs(ggml_type))]
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                p = builder.gep(group, [builder.mul(b, c64(block))])
                for line in range(0, block, 64):              # the stream PREFETCH bytes ahead
                    prefetch(builder, builder.gep(p, [c64(PREFETCH + line)]))
                blk = _X8Block(builder, ggml_type, p)
                scale = builder.fmul(blk.scales(), splat(builder, builder.load(builder.gep(drow, [b])), V8F))
                xb = builder.gep(xrow, [builder.mul(b, c64(32))])
                dots, sums = _new_dots(builder, ggml_type), []
                for k in range(8):
                    x4 = builder.bitcast(splat(builder, load_as(builder, xb, i32, 4 * k), V8I), V32B)
                    w = blk.group(k)
                    _add_dot(builder, ggml_type, dots, blk.magnitude(w), w, x4)
                    if ggml_type in OFFSET:
                        sums.append(builder.load(builder.gep(srow, [builder.add(builder.mul(b, c64(8)), c64(k))])))
                mins = (blk.mins(), splat(builder, builder.load(builder.gep(s1a.data, [builder.add(builder.mul(mv, nb), b)])), V8F)) \
                    if ggml_type in MINS else None
                _block_step(builder, ggml_type, dots, sums, scale, acc, mins)
            vstore(builder, _finish(builder, ggml_type, acc),
                   builder.gep(oa.data, [builder.add(builder.mul(mv, N), builder.mul(gv, c64(8)))]))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"{T.TRAITS[ggml_type].name.lower()}_x8"
    return intrinsic(kern)


X8_ROWS = 8     # activation rows per pass of the multi-row kernels


def _q0_x8_multi_kernel(ggml_type: int):
    """kern(wx8, g, xq, dx, sx, s1, m0, n, out): out[m0+i, 8g .. 8g+8] for i < n <= X8_ROWS, the one-row
    kernel's float steps for every row. Per block the 8 weight vectors are decoded once into a stack
    buffer (their magnitudes, and for the signed types the values too) and read back for each row,
    whose accumulators live on the stack, in an IR loop over the rows (unrolled, n x 8 accumulators
    do not fit the 16 registers)."""
    block = X8_BLOCK[ggml_type]
    n_acc = _n_accs(ggml_type)
    signed = ggml_type in SIGNED

    def kern(typingctx, wx8, g, xq, dx, sx, s1, m0, n, out):
        sig = types.void(wx8, g, xq, dx, sx, s1, m0, n, out)

        def codegen(context, builder, signature, args):
            wa, _, xa, da, sa, s1a, _, _, oa = (array(context, builder, signature.args[k], args[k])
                                                if k not in (1, 6, 7) else None for k in range(9))
            gv, m0v, nv = args[1], args[6], args[7]
            nb = builder.extract_value(da.shape, 1)
            K = builder.extract_value(xa.shape, 1)
            N = builder.extract_value(oa.shape, 1)
            group = builder.gep(byte_ptr(builder, wa.data), [builder.mul(gv, builder.mul(nb, c64(block)))])
            mbuf = cgutils.alloca_once(builder, ir.ArrayType(V32B, 8))          # vpmaddubsw's operand
            wbuf = cgutils.alloca_once(builder, ir.ArrayType(V32B, 8))          # the signed values
            accs = cgutils.alloca_once(builder, ir.ArrayType(V8F, n_acc * X8_ROWS))
            acc_at = lambda r, k: builder.gep(accs, [c32(0), builder.add(builder.mul(r, c64(n_acc)), c64(k))])  # noqa: E731
            zero = ir.Constant(V8F, [0.0] * 8)
            with cgutils.for_range(builder, nv) as rl:
                for k in range(n_acc):
                    builder.store(zero, acc_at(rl.index, k))
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                p = builder.gep(group, [builder.mul(b, c64(block))])
                for line in range(0, block, 64):
                    prefetch(builder, builder.gep(p, [c64(PREFETCH + line)]))
                blk = _X8Block(builder, ggml_type, p)
                d8 = blk.scales()
                m8 = blk.mins() if ggml_type in MINS else None
                for k in range(8):
                    w = blk.group(k)
                    builder.store(blk.magnitude(w), builder.gep(mbuf, [c32(0), c32(k)]))
                    if signed:
                        builder.store(w, builder.gep(wbuf, [c32(0), c32(k)]))
                with cgutils.for_range(builder, nv) as rl:
                    r = rl.index
                    m = builder.add(m0v, r)
                    xb = builder.gep(byte_ptr(builder, xa.data), [builder.add(builder.mul(m, K), builder.mul(b, c64(32)))])
                    dxm = builder.load(builder.gep(da.data, [builder.add(builder.mul(m, nb), b)]))
                    scale = builder.fmul(d8, splat(builder, dxm, V8F))                 # d_w * d_x per weight row
                    srow = builder.gep(sa.data, [builder.add(builder.mul(m, builder.mul(nb, c64(8))), builder.mul(b, c64(8)))])
                    dots, sums = _new_dots(builder, ggml_type), []
                    for k in range(8):
                        x4 = builder.bitcast(splat(builder, load_as(builder, xb, i32, 4 * k), V8I), V32B)
                        wmag = builder.load(builder.gep(mbuf, [c32(0), c32(k)]))
                        w = builder.load(builder.gep(wbuf, [c32(0), c32(k)])) if signed else wmag
                        _add_dot(builder, ggml_type, dots, wmag, w, x4)
                        if ggml_type in OFFSET:
                            sums.append(builder.load(builder.gep(srow, [c64(k)])))
                    mins = (m8, splat(builder, builder.load(builder.gep(s1a.data, [builder.add(builder.mul(m, nb), b)])), V8F)) \
                        if ggml_type in MINS else None
                    _block_step(builder, ggml_type, dots, sums, scale, [acc_at(r, k) for k in range(n_acc)], mins)
            with cgutils.for_range(builder, nv) as rl:
                r = rl.index
                res = _finish(builder, ggml_type, [acc_at(r, k) for k in range(n_acc)])
                idx = builder.add(builder.mul(builder.add(m0v, r), N), builder.mul(gv, c64(8)))
                vstore(builder, res, builder.gep(oa.data, [idx]))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"{T.TRAITS[ggml_type].name.lower()}_x8_multi"
    return intrinsic(kern)


X8_TYPES = (T.Q8_0, T.Q5_0, T.Q4_0, T.IQ4_NL, T.Q4_1, T.Q5_1)
q8_0_x8, q5_0_x8, q4_0_x8, iq4_nl_x8, q4_1_x8, q5_1_x8 = (_q0_x8_kernel(t) for t in X8_TYPES)
q8_0_x8_multi, q5_0_x8_multi, q4_0_x8_multi, iq4_nl_x8_multi, q4_1_x8_multi, q5_1_x8_multi = (
    _q0_x8_multi_kernel(t) for t in X8_TYPES)


@njit(inline="always")
def _q0_x8_one(ggml_type, wx8, g, xq, dx, sx, s1, out):
    if ggml_type == T.Q8_0:
        q8_0_x8(wx8, g, xq, dx, sx, s1, 0, out)
    elif ggml_type == T.Q5_0:
        q5_0_x8(wx8, g, xq, dx, sx, s1, 0, out)
    elif ggml_type == T.Q4_0:
        q4_0_x8(wx8, g, xq, dx, sx, s1, 0, out)
    elif ggml_type == T.IQ4_NL:
        iq4_nl_x8(wx8, g, xq, dx, sx, s1, 0, out)
    elif ggml_type == T.Q4_1:
        q4_1_x8(wx8, g, xq, dx, sx, s1, 0, out)
    else:
        q5_1_x8(wx8, g, xq, dx, sx, s1, 0, out)


@njit(inline="always")
def _q0_x8_some(ggml_type, wx8, g, xq, dx, sx, s1, m0, n, out):
    if ggml_type == T.Q8_0:
        q8_0_x8_multi(wx8, g, xq, dx, sx, s1, m0, n, out)
    elif ggml_type == T.Q5_0:
        q5_0_x8_multi(wx8, g, xq, dx, sx, s1, m0, n, out)
    elif ggml_type == T.Q4_0:
        q4_0_x8_multi(wx8, g, xq, dx, sx, s1, m0, n, out)
    elif ggml_type == T.IQ4_NL:
        iq4_nl_x8_multi(wx8, g, xq, dx, sx, s1, m0, n, out)
    elif ggml_type == T.Q4_1:
        q4_1_x8_multi(wx8, g, xq, dx, sx, s1, m0, n, out)
    else:
        q5_1_x8_multi(wx8, g, xq, dx, sx, s1, m0, n, out)


@njit(parallel=True, cache=True, error_model="numpy")
def _q0_x8_rows(ggml_type, wx8, xq, dx, sx, s1, out):
    """The 32-element types' x8 layout x q8_0 rows -> out (M, N); prange over 8-row groups, each
    group's bytes stay in L1 while every activation row reads them: one row (decode) with the
    accumulators in registers, more in passes of up to X8_ROWS rows that decode each block once."""
    M = xq.shape[0]
    for g in prange(wx8.shape[0]):
        if M == 1:
            _q0_x8_one(ggml_type, wx8, g, xq, dx, sx, s1, out)
        else:
            for m0 in range(0, M, X8_ROWS):
                _q0_x8_some(ggml_type, wx8, g, xq, dx, sx, s1, m0, min(X8_ROWS, M - m0), out)


def _x8_panel_unpacker(ggml_type: int):
    """unpack(wx8, g0, n_groups, wp, cp, dwp): groups g0 .. g0+n_groups-1 of an x8 matrix of a
    has_panel type -> panel rows 0 .. 8*n_groups-1: wp (P, nb, 32) int8 values (Q5_0's q - 16,
    Q4_0's q - 8, IQ4_NL's levels), cp (P, nb, 8) int32 = 128 * each 4-group sum (negated with VNNI:
    the dot's starting value; for PER_BLOCK types, whose tile starts the block's one dot from it,
    their total in slot 0), dwp (P, nbp) float32 scales."""
    offset = {T.Q5_0: 16, T.Q4_0: 8}.get(ggml_type, 0)

    def unpack(typingctx, wx8, g0, n_groups, wp, cp, dwp):
        return types.void(wx8, g0, n_groups, wp, cp, dwp), codegen

    def codegen(context, builder, signature, args):
        wa, _, _, pa, ca, da = (array(context, builder, signature.args[k], args[k]) if k not in (1, 2) else None
                                for k in range(6))
        g0v, n_groups = args[1], args[2]
        nb = builder.extract_value(pa.shape, 1)
        nbp = builder.extract_value(da.shape, 1)
        block = X8_BLOCK[ggml_type]
        wbase, pbase, cbase = byte_ptr(builder, wa.data), byte_ptr(builder, pa.data), byte_ptr(builder, ca.data)
        ones8 = vconst(V32B, 1)
        with cgutils.for_range(builder, n_groups) as gl:
            grp = gl.index
            src = builder.gep(wbase, [builder.mul(builder.add(g0v, grp), builder.mul(nb, c64(block)))])
            with cgutils.for_range(builder, nb) as bl:
                b = bl.index
                p = builder.gep(src, [builder.mul(b, c64(block))])
                blk = _X8Block(builder, ggml_type, p)
                groups = [builder.bitcast(builder.sub(blk.group(k), vconst(V32B, offset)), V8I) for k in range(8)]
                rows = transpose(builder, groups)                # row r: its 32 values
                d8 = blk.scales()
                for r in range(8):
                    row = builder.add(builder.mul(grp, c64(8)), c64(r))
                    off = builder.add(builder.mul(row, builder.mul(nb, c64(32))), builder.mul(b, c64(32)))
                    w = builder.bitcast(rows[r], V32B)
                    vstore(builder, w, builder.gep(pbase, [off]))
                    sums = dot4(builder, ones8, w)
                    corr = builder.shl(sums, vconst(V8I, 7))
                    corr = builder.neg(corr) if VNNI else corr
                    if ggml_type in PER_BLOCK:
                        total = call(builder, "llvm.vector.reduce.add.v8i32", i32, [corr])
                        builder.store(total, builder.bitcast(builder.gep(cbase, [off]), i32.as_pointer()))
                    else:
                        vstore(builder, corr, builder.gep(cbase, [off]))
                    builder.store(builder.extract_element(d8, ir.Constant(i32, r)),
                                  builder.gep(da.data, [builder.add(builder.mul(row, nbp), b)]))
        return context.get_dummy_value()

    unpack.__name__ = f"unpack_{T.TRAITS[ggml_type].name.lower()}_x8_panel"
    return intrinsic(unpack)


_unpack_q5_0_x8_panel, _unpack_q8_0_x8_panel, _unpack_q4_0_x8_panel, _unpack_iq4_nl_x8_panel = (
    _x8_panel_unpacker(t) for t in (T.Q5_0, T.Q8_0, T.Q4_0, T.IQ4_NL))


@njit(inline="always")
def _unpack_x8_panel(ggml_type, wx8, g0, n_groups, wp, cp, dwp):
    """The panel unpacker of ggml_type (has_panel's types)."""
    if ggml_type == T.Q8_0:
        _unpack_q8_0_x8_panel(wx8, g0, n_groups, wp, cp, dwp)
    elif ggml_type == T.Q4_0:
        _unpack_q4_0_x8_panel(wx8, g0, n_groups, wp, cp, dwp)
    elif ggml_type == T.IQ4_NL:
        _unpack_iq4_nl_x8_panel(wx8, g0, n_groups, wp, cp, dwp)
    else:
        _unpack_q5_0_x8_panel(wx8, g0, n_groups, wp, cp, dwp)
