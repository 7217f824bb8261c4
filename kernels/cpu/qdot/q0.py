"""Q8_0 and Q5_0 weights times q8_0 activation rows, llama.cpp's numbers bit for bit: the x8
layout (8 weight rows in the lanes; decode and short batches) and, for prompt-sized batches of
Q5_0, the unpacked panel kernel."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels import types as T
from kernels.cpu.qdot.common import PREFETCH
from kernels.cpu.simd import (
    V8F, prefetch, V8I, V16S, V32B, V8H, array, byte_ptr, c32, c64, fma, hsum8, i32, load_as, madd16,
    maddubs, psign, splat, vconst, vload, vstore,
)

Q8_0_BLOCK, Q5_0_BLOCK = 34, 22   # bytes per 32-element GGUF block

# --- Q8_0 / Q5_0 --------------------------------------------------------------------------------

# Prompt-sized batches of Q5_0 rows: a panel of PANEL weight rows is unpacked once into int8 (q - 16,
# at most 16 in magnitude) with each block's correction 128 * (sum of each 4-group of w), and the
# activations are stored biased, x + 128 as uint8. Then vpmaddubsw(x + 128, w) cannot saturate
# (2 * 255 * 16 < 32767) and its 4-sums minus the correction are the exact dots: no sign
# instructions, which on Zen 3 share ports with the conversions and the FMAs (1.9 against 2.3 cycles
# per (row, row, block)). d_w * d_x for the tile is computed once per call, 8 blocks per multiply.
PANEL = 16
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
            ones = vconst(V16S, 1)
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                off = builder.mul(b, c64(32))
                ws = [vload(builder, builder.gep(wrow[j], [off]), V32B) for j in range(NR)]
                cs = [vload(builder, builder.gep(crow[j], [off]), V8I) for j in range(NR)]
                xb_b = builder.gep(xg, [builder.mul(b, c64(MR * 32))])
                for i in range(MR):
                    x = vload(builder, builder.gep(xb_b, [c64(32 * i)]), V32B)
                    for j in range(NR):
                        isum = builder.sub(madd16(builder, maddubs(builder, x, ws[j]), ones), cs[j])
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


q5_0_panel = _q5_0_panel_kernel(PANEL_NR, PANEL_MR)


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
def _q5_0_prompt(wx8, xb, dxb, M, out):
    """Q5_0 (x8 layout) x biased activation groups -> out (M, N); prange over panels of PANEL rows,
    each unpacked once and used by every activation group."""
    n_groups = wx8.shape[0]
    N = n_groups * 8
    nb = xb.shape[1]
    nbp = dxb.shape[2]
    G = xb.shape[0]
    per_panel = PANEL // 8
    for p in prange((n_groups + per_panel - 1) // per_panel):
        wp = np.zeros((PANEL, nb, 32), np.int8)
        cp = np.zeros((PANEL, nb, 8), np.int32)
        dwp = np.zeros((PANEL, nbp), np.float32)
        D = np.empty((PANEL_NR * PANEL_MR, nbp), np.float32)
        g0 = p * per_panel
        ng = min(per_panel, n_groups - g0)
        _unpack_q5_0_x8_panel(wx8, g0, ng, wp, cp, dwp)
        r0 = g0 * 8
        for g in range(G):
            for j0 in range(0, ng * 8, PANEL_NR):
                q5_0_panel(wp, cp, dwp, j0, xb, dxb, g, D, out, r0, g * PANEL_MR, M - g * PANEL_MR)


Q8_0_KIND, Q5_0_KIND = 0, 1         # which weight format a q8_0-activation kernel reads


def q0_kind(ggml_type: int) -> int:
    return Q8_0_KIND if ggml_type == T.Q8_0 else Q5_0_KIND


# --- Q8_0 / Q5_0 with 8 weight rows in the lanes (decode, short batches) ------------------------
# The same float steps as above, vectorized the other way: lane r holds weight row r, and each of
# the 8 four-element groups of a block has its own accumulator (acc_k[r] is llama.cpp's lane k of
# row r), so a block costs one vector step per group for 8 rows instead of per row, the scale is a
# vector of the 8 rows' d_w * d_x, and hsum_float_8 becomes the same tree across the 8
# accumulators. The x8 layouts keep GGUF's bytes per block (the 5th bits of Q5_0 permuted):
#   Q8_0: q [group k 8][row 8][4 bytes], then d [row] f16                    (272 bytes)
#   Q5_0: qs [j 4][row 8][4 bytes] (GGUF qs bytes 4j..4j+3: low nibbles group j, high group j+4),
#         qh [row 8] 32 bits, bit 8e + k = 5th bit of element 4k + e, then d [row] f16   (176 bytes)
# Q5_0 takes the unsigned 5-bit values q and x as is: sum (q - 16) x = sum q x - 16 sum x, with the
# group sums of x computed once per activation row (no sign instructions).
X8_BLOCK = {T.Q8_0: 272, T.Q5_0: 176}


def repack_q0_x8(raw: np.ndarray, ggml_type: int, n_cols: int) -> np.ndarray:
    """GGUF Q8_0 / Q5_0 rows -> (ceil(N/8), nb * X8_BLOCK) uint8, layout above."""
    block = Q8_0_BLOCK if ggml_type == T.Q8_0 else Q5_0_BLOCK
    nb = n_cols // 32
    rows = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, nb * block)
    if rows.shape[0] % 8:           # zero rows (scale 0) pad the last group; their outputs are dropped
        rows = np.concatenate([rows, np.zeros((-rows.shape[0] % 8, rows.shape[1]), np.uint8)])
    G = rows.shape[0] // 8
    k = rows.reshape(G, 8, nb, block)
    d = k[..., 0:2].transpose(0, 2, 1, 3).reshape(G, nb, 16)
    if ggml_type == T.Q8_0:
        q = k[..., 2:34].reshape(G, 8, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(G, nb, 256)
        parts = [q, d]
    else:
        qs = k[..., 6:22].reshape(G, 8, nb, 4, 4).transpose(0, 2, 3, 1, 4).reshape(G, nb, 128)
        qh = np.ascontiguousarray(k[..., 2:6]).view("<u4")[..., 0]                     # (G, 8, nb)
        w = np.zeros_like(qh)
        for grp in range(8):
            for e in range(4):
                w |= ((qh >> np.uint32(4 * grp + e)) & np.uint32(1)) << np.uint32(8 * e + grp)
        qh_t = w.transpose(0, 2, 1).copy().view(np.uint8).reshape(G, nb, 32)
        parts = [qs, qh_t, d]
    return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(G, nb * X8_BLOCK[ggml_type]))


def _q0_x8_kernel(ggml_type: int):
    """kern(wx8, g, xq, dx, sx, m, out): out[m, 8g .. 8g+8] for activation row m. sx (M, nb*8) int32:
    16 x the 4-element group sums of xq (Q5_0's offset); unused for Q8_0."""
    is_q8 = ggml_type == T.Q8_0
    block = X8_BLOCK[ggml_type]

    def kern(typingctx, wx8, g, xq, dx, sx, m, out):
        sig = types.void(wx8, g, xq, dx, sx, m, out)

        def codegen(context, builder, signature, args):
            wa, _, xa, da, sa, _, oa = (array(context, builder, signature.args[k], args[k]) if k not in (1, 5) else None
                                        for k in range(7))
            gv, mv = args[1], args[5]
            nb = builder.extract_value(da.shape, 1)
            K = builder.extract_value(xa.shape, 1)
            N = builder.extract_value(oa.shape, 1)
            group = builder.gep(byte_ptr(builder, wa.data), [builder.mul(gv, builder.mul(nb, c64(block)))])
            xrow = builder.gep(byte_ptr(builder, xa.data), [builder.mul(mv, K)])
            drow = builder.gep(da.data, [builder.mul(mv, nb)])
            srow = builder.gep(sa.data, [builder.mul(mv, builder.mul(nb, c64(8)))])
            zero = ir.Constant(V8F, [0.0] * 8)
            acc = [cgutils.alloca_once_value(builder, zero) for _ in range(8)]
            ones, m0f, bit4 = vconst(V16S, 1), vconst(V32B, 0x0F), vconst(V8I, 0x10101010)
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                p = builder.gep(group, [builder.mul(b, c64(block))])
                for line in range(0, block, 64):              # the stream PREFETCH bytes ahead
                    prefetch(builder, builder.gep(p, [c64(PREFETCH + line)]))
                d8 = builder.fpext(vload(builder, builder.gep(p, [c64(block - 16)]), V8H), V8F)
                scale = builder.fmul(d8, splat(builder, builder.load(builder.gep(drow, [b])), V8F))   # d_w * d_x per row
                xb = builder.gep(xrow, [builder.mul(b, c64(32))])
                if not is_q8:
                    qh = vload(builder, builder.gep(p, [c64(128)]), V8I)
                    qsv = [vload(builder, builder.gep(p, [c64(32 * j)]), V32B) for j in range(4)]
                for k in range(8):
                    x4 = builder.bitcast(splat(builder, load_as(builder, xb, i32, 4 * k), V8I), V32B)
                    if is_q8:
                        w = vload(builder, builder.gep(p, [c64(32 * k)]), V32B)
                        isum = madd16(builder, maddubs(builder, psign(builder, w, w), psign(builder, x4, w)), ones)
                    else:
                        v = qsv[k % 4]
                        nib = builder.and_(v, m0f) if k < 4 else builder.and_(builder.lshr(v, vconst(V32B, 4)), m0f)
                        # bit 8e + k -> bit 4 of byte e: one shift and one mask
                        sh = builder.shl(qh, vconst(V8I, 4 - k)) if k <= 4 else builder.lshr(qh, vconst(V8I, k - 4))
                        q5 = builder.or_(nib, builder.bitcast(builder.and_(sh, bit4), V32B))
                        s16 = builder.load(builder.gep(srow, [builder.add(builder.mul(b, c64(8)), c64(k))]))
                        isum = builder.sub(madd16(builder, maddubs(builder, q5, x4), ones), splat(builder, s16, V8I))
                    builder.store(fma(builder, scale, builder.sitofp(isum, V8F), builder.load(acc[k])), acc[k])
            accs = [builder.load(a) for a in acc]
            r = [builder.fadd(accs[4 + k], accs[k]) for k in range(4)]
            res = builder.fadd(builder.fadd(r[0], r[2]), builder.fadd(r[1], r[3]))      # hsum_float_8, 8 rows at once
            vstore(builder, res, builder.gep(oa.data, [builder.add(builder.mul(mv, N), builder.mul(gv, c64(8)))]))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"{'q8_0' if is_q8 else 'q5_0'}_x8"
    return intrinsic(kern)


q8_0_x8, q5_0_x8 = _q0_x8_kernel(8), _q0_x8_kernel(6)

X8_ROWS = 8     # activation rows per pass of the multi-row kernels


def _q0_x8_multi_kernel(ggml_type: int):
    """kern(wx8, g, xq, dx, sx, m0, n, out): out[m0+i, 8g .. 8g+8] for i < n <= X8_ROWS, the one-row
    kernel's float steps for every row. Per block the 8 weight vectors are decoded once into a stack
    buffer (Q5_0: the 5-bit values, Q8_0: their magnitudes) and read back for each row, whose 8
    accumulators live on the stack, in an IR loop over the rows (unrolled, n x 8 accumulators do not
    fit the 16 registers). Before, each row decoded every block again: 2 rows cost 2 one-row passes."""
    is_q8 = ggml_type == T.Q8_0
    block = X8_BLOCK[ggml_type]

    def kern(typingctx, wx8, g, xq, dx, sx, m0, n, out):
        sig = types.void(wx8, g, xq, dx, sx, m0, n, out)

        def codegen(context, builder, signature, args):
            wa, _, xa, da, sa, _, _, oa = (array(context, builder, signature.args[k], args[k]) if k not in (1, 5, 6) else None
                                           for k in range(8))
            gv, m0v, nv = args[1], args[5], args[6]
            nb = builder.extract_value(da.shape, 1)
            K = builder.extract_value(xa.shape, 1)
            N = builder.extract_value(oa.shape, 1)
            group = builder.gep(byte_ptr(builder, wa.data), [builder.mul(gv, builder.mul(nb, c64(block)))])
            wbuf = cgutils.alloca_once(builder, ir.ArrayType(V32B, 8))
            accs = cgutils.alloca_once(builder, ir.ArrayType(V8F, 8 * X8_ROWS))
            acc_at = lambda r, k: builder.gep(accs, [c32(0), builder.add(builder.mul(r, c64(8)), c64(k))])   # noqa: E731
            w_at = lambda k: builder.gep(wbuf, [c32(0), c32(k)])                                                # noqa: E731
            zero = ir.Constant(V8F, [0.0] * 8)
            with cgutils.for_range(builder, nv) as rl:
                for k in range(8):
                    builder.store(zero, acc_at(rl.index, k))
            ones, m0f, bit4 = vconst(V16S, 1), vconst(V32B, 0x0F), vconst(V8I, 0x10101010)
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                p = builder.gep(group, [builder.mul(b, c64(block))])
                for line in range(0, block, 64):
                    prefetch(builder, builder.gep(p, [c64(PREFETCH + line)]))
                d8 = builder.fpext(vload(builder, builder.gep(p, [c64(block - 16)]), V8H), V8F)
                if is_q8:
                    for k in range(8):
                        w = vload(builder, builder.gep(p, [c64(32 * k)]), V32B)
                        builder.store(psign(builder, w, w), w_at(k))
                else:
                    qh = vload(builder, builder.gep(p, [c64(128)]), V8I)
                    qsv = [vload(builder, builder.gep(p, [c64(32 * j)]), V32B) for j in range(4)]
                    for k in range(8):
                        v = qsv[k % 4]
                        nib = builder.and_(v, m0f) if k < 4 else builder.and_(builder.lshr(v, vconst(V32B, 4)), m0f)
                        sh = builder.shl(qh, vconst(V8I, 4 - k)) if k <= 4 else builder.lshr(qh, vconst(V8I, k - 4))
                        builder.store(builder.or_(nib, builder.bitcast(builder.and_(sh, bit4), V32B)), w_at(k))
                with cgutils.for_range(builder, nv) as rl:
                    r = rl.index
                    m = builder.add(m0v, r)
                    xb = builder.gep(byte_ptr(builder, xa.data), [builder.add(builder.mul(m, K), builder.mul(b, c64(32)))])
                    dxm = builder.load(builder.gep(da.data, [builder.add(builder.mul(m, nb), b)]))
                    scale = builder.fmul(d8, splat(builder, dxm, V8F))                 # d_w * d_x per weight row
                    srow = builder.gep(sa.data, [builder.add(builder.mul(m, builder.mul(nb, c64(8))), builder.mul(b, c64(8)))])
                    for k in range(8):
                        x4 = builder.bitcast(splat(builder, load_as(builder, xb, i32, 4 * k), V8I), V32B)
                        wk = builder.load(w_at(k))
                        if is_q8:
                            w = vload(builder, builder.gep(p, [c64(32 * k)]), V32B)
                            isum = madd16(builder, maddubs(builder, wk, psign(builder, x4, w)), ones)
                        else:
                            s16 = builder.load(builder.gep(srow, [c64(k)]))
                            isum = builder.sub(madd16(builder, maddubs(builder, wk, x4), ones), splat(builder, s16, V8I))
                        ap = acc_at(r, k)
                        builder.store(fma(builder, scale, builder.sitofp(isum, V8F), builder.load(ap)), ap)
            with cgutils.for_range(builder, nv) as rl:
                r = rl.index
                a = [builder.load(acc_at(r, k)) for k in range(8)]
                t = [builder.fadd(a[4 + k], a[k]) for k in range(4)]
                res = builder.fadd(builder.fadd(t[0], t[2]), builder.fadd(t[1], t[3]))     # hsum_float_8 per row, 8 rows at once
                idx = builder.add(builder.mul(builder.add(m0v, r), N), builder.mul(gv, c64(8)))
                vstore(builder, res, builder.gep(oa.data, [idx]))
            return context.get_dummy_value()

        return sig, codegen

    kern.__name__ = f"{'q8_0' if is_q8 else 'q5_0'}_x8_multi"
    return intrinsic(kern)


q8_0_x8_multi, q5_0_x8_multi = _q0_x8_multi_kernel(8), _q0_x8_multi_kernel(6)


@njit(parallel=True, cache=True, error_model="numpy")
def _q0_x8_rows(kind, wx8, xq, dx, sx, out):
    """Q8_0 (kind 0) / Q5_0 (kind 1) x8 layout x q8_0 rows -> out (M, N); prange over 8-row groups,
    each group's bytes stay in L1 while every activation row reads them: one row (decode) with the
    accumulators in registers, more in passes of up to X8_ROWS rows that decode each block once."""
    M = xq.shape[0]
    for g in prange(wx8.shape[0]):
        if M == 1:
            if kind == Q8_0_KIND:
                q8_0_x8(wx8, g, xq, dx, sx, 0, out)
            else:
                q5_0_x8(wx8, g, xq, dx, sx, 0, out)
        else:
            for m0 in range(0, M, X8_ROWS):
                n = min(X8_ROWS, M - m0)
                if kind == Q8_0_KIND:
                    q8_0_x8_multi(wx8, g, xq, dx, sx, m0, n, out)
                else:
                    q5_0_x8_multi(wx8, g, xq, dx, sx, m0, n, out)


def _transpose8x8(builder, vs):
    """8 vectors of 8 int32 -> their transpose (vector r holds lane r of every input)."""
    V = ir.VectorType(i32, 8)
    sh = lambda a, b, idx: builder.shuffle_vector(a, b, ir.Constant(V, idx))   # noqa: E731
    t = []
    for a, b in zip(vs[0::2], vs[1::2]):                       # unpack lo / hi epi32
        t += [sh(a, b, [0, 8, 1, 9, 4, 12, 5, 13]), sh(a, b, [2, 10, 3, 11, 6, 14, 7, 15])]
    u = []
    for a, b in ((t[0], t[2]), (t[1], t[3]), (t[4], t[6]), (t[5], t[7])):   # unpack lo / hi epi64
        u += [sh(a, b, [0, 1, 8, 9, 4, 5, 12, 13]), sh(a, b, [2, 3, 10, 11, 6, 7, 14, 15])]
    # u: [r0|r4 low halves...]: combine 128-bit halves
    out = [None] * 8
    for r, (a, b) in enumerate(((u[0], u[4]), (u[1], u[5]), (u[2], u[6]), (u[3], u[7]))):
        out[r] = sh(a, b, [0, 1, 2, 3, 8, 9, 10, 11])
        out[r + 4] = sh(a, b, [4, 5, 6, 7, 12, 13, 14, 15])
    return out


@intrinsic
def _unpack_q5_0_x8_panel(typingctx, wx8, g0, n_groups, wp, cp, dwp):
    """Groups g0 .. g0+n_groups-1 of a Q5_0 x8 matrix -> panel rows 0 .. 8*n_groups-1: wp (P, nb, 32)
    int8 values q - 16, cp (P, nb, 8) int32 = 128 * each 4-group sum, dwp (P, nbp) float32 scales."""
    sig = types.void(wx8, g0, n_groups, wp, cp, dwp)

    def codegen(context, builder, signature, args):
        wa, _, _, pa, ca, da = (array(context, builder, signature.args[k], args[k]) if k not in (1, 2) else None
                                for k in range(6))
        g0v, n_groups = args[1], args[2]
        nb = builder.extract_value(pa.shape, 1)
        nbp = builder.extract_value(da.shape, 1)
        block = X8_BLOCK[6]
        wbase, pbase, cbase = byte_ptr(builder, wa.data), byte_ptr(builder, pa.data), byte_ptr(builder, ca.data)
        m0f, bit4, ones8, ones16 = vconst(V32B, 0x0F), vconst(V8I, 0x10101010), vconst(V32B, 1), vconst(V16S, 1)
        with cgutils.for_range(builder, n_groups) as gl:
            grp = gl.index
            src = builder.gep(wbase, [builder.mul(builder.add(g0v, grp), builder.mul(nb, c64(block)))])
            with cgutils.for_range(builder, nb) as bl:
                b = bl.index
                p = builder.gep(src, [builder.mul(b, c64(block))])
                qh = vload(builder, builder.gep(p, [c64(128)]), V8I)
                qsv = [vload(builder, builder.gep(p, [c64(32 * j)]), V32B) for j in range(4)]
                groups = []
                for k in range(8):
                    v = qsv[k % 4]
                    nib = builder.and_(v, m0f) if k < 4 else builder.and_(builder.lshr(v, vconst(V32B, 4)), m0f)
                    sh = builder.shl(qh, vconst(V8I, 4 - k)) if k <= 4 else builder.lshr(qh, vconst(V8I, k - 4))
                    q5 = builder.or_(nib, builder.bitcast(builder.and_(sh, bit4), V32B))
                    groups.append(builder.bitcast(builder.sub(q5, vconst(V32B, 16)), V8I))
                rows = _transpose8x8(builder, groups)                # row r: its 32 values
                d8 = builder.fpext(vload(builder, builder.gep(p, [c64(block - 16)]), V8H), V8F)
                for r in range(8):
                    row = builder.add(builder.mul(grp, c64(8)), c64(r))
                    off = builder.add(builder.mul(row, builder.mul(nb, c64(32))), builder.mul(b, c64(32)))
                    w = builder.bitcast(rows[r], V32B)
                    vstore(builder, w, builder.gep(pbase, [off]))
                    sums = madd16(builder, maddubs(builder, ones8, w), ones16)
                    vstore(builder, builder.shl(sums, vconst(V8I, 7)), builder.gep(cbase, [off]))
                    builder.store(builder.extract_element(d8, ir.Constant(i32, r)),
                                  builder.gep(da.data, [builder.add(builder.mul(row, nbp), b)]))
        return context.get_dummy_value()

    return sig, codegen
