"""IQ4_XS weights (read in place) times q8_K activation rows: ggml_vec_dot_iq4_xs_q8_K's numbers for
fewer than 8 rows, the tiled kernel's for more, bit for bit (the arithmetic: see lanes)."""
from __future__ import annotations

from llvmlite import ir
from numba import njit, prange

from kernels.cpu.qdot.common import TILED_MIN_ROWS, X_CHUNK_BYTES
from kernels.cpu.qdot.lanes import lane_kernel
from kernels.cpu.simd import V16B, V16S, V32B, c32, c64, f16, f32, i8, i16, i32, load_as, pshufb, psign, vconst, vload
from kernels.types import IQ4_NL_VALUES

# --- IQ4_XS -------------------------------------------------------------------------------------
# A 256-element super-block: d (f16), scales_h (u16), scales_l[4], qs[128]. Sub-block c (32
# elements): 6-bit scale ls = ((scales_l[c/2] >> 4*(c%2)) & 15) | (((scales_h >> 2c) & 3) << 4),
# qs[16c + l] holds elements l (low nibble) and 16 + l (high), each an index into IQ4_NL's levels;
# value d * (ls - 32) * level. The levels (-127..113) go through the sign trick (see lanes).
IQ4_XS_BLOCK = 136
_LEVELS = [int(v) for v in IQ4_NL_VALUES] * 2                  # vpshufb looks up each 128-bit half


def _decode(builder, p):
    """One IQ4_XS super-block at p -> (|w|, w, scales) per chunk, d (see lanes.lane_kernel)."""
    table = ir.Constant(V32B, _LEVELS)
    m15 = vconst(V16B, 15)
    sh = builder.zext(load_as(builder, p, i16, 2), i32)
    lsr = lambda v, k: builder.lshr(v, ir.Constant(i32, k)) if k else v         # noqa: E731
    qv, wv, sv = [], [], []
    for c in range(8):
        q = vload(builder, builder.gep(p, [c64(8 + 16 * c)]), V16B)
        idx = builder.shuffle_vector(builder.and_(q, m15), builder.lshr(q, vconst(V16B, 4)),
                                     ir.Constant(ir.VectorType(i32, 32), list(range(32))))
        w = pshufb(builder, table, idx)
        qv.append(psign(builder, w, w))
        wv.append(w)
        sl = builder.zext(load_as(builder, p, i8, 4 + c // 2), i32)
        ls = builder.or_(builder.and_(lsr(sl, 4 * (c % 2)), ir.Constant(i32, 15)),
                         builder.shl(builder.and_(lsr(sh, 2 * c), ir.Constant(i32, 3)), ir.Constant(i32, 4)))
        ls = builder.trunc(builder.sub(ls, ir.Constant(i32, 32)), i16)
        scv = builder.insert_element(ir.Constant(V16S, ir.Undefined), ls, c32(0))
        scv = builder.shuffle_vector(scv, scv, ir.Constant(ir.VectorType(i32, 16), [0] * 16))
        sv.append(scv)
    return qv, wv, sv, builder.fpext(load_as(builder, p, f16, 0), f32), None, None


def _kernel(MR: int, tiled: bool):
    return lane_kernel("iq4_xs", IQ4_XS_BLOCK, _decode, True, False, MR, tiled)


iq4_xs_tiled_1, iq4_xs_tiled_4, iq4_xs_tiled_8 = _kernel(1, True), _kernel(4, True), _kernel(8, True)
# A speculative check verifies 1 to 8 rows with the one-row arithmetic: one unpack of W for up to 8.
(iq4_xs_vec_dot_1, iq4_xs_vec_dot_2, iq4_xs_vec_dot_3, iq4_xs_vec_dot_4, iq4_xs_vec_dot_5, iq4_xs_vec_dot_6,
 iq4_xs_vec_dot_7, iq4_xs_vec_dot_8) = (_kernel(m, False) for m in range(1, 9))


@njit(parallel=True, cache=True, error_model="numpy")
def _iq4_xs_rows(w, xq, dx, bs16, run_start, run_len, run_batched, out):
    """IQ4_XS rows x q8_K rows -> out (M, N): a batched run of 8 rows or more takes the tiled
    arithmetic, every other row the vec_dot arithmetic. Chunks of rows; prange over weight rows."""
    K = xq.shape[1]
    N = w.shape[0]
    chunk = max(4, X_CHUNK_BYTES // K // 4 * 4)
    for r in range(run_start.shape[0]):
        r0, n = run_start[r], run_len[r]
        tiled = run_batched[r] and n >= TILED_MIN_ROWS
        for c0 in range(r0, r0 + n, chunk):
            c1 = min(r0 + n, c0 + chunk)
            for row in prange(N):
                m = c0
                if tiled:                           # 8 rows per unpacked super-block where it can
                    while m + 8 <= c1:
                        iq4_xs_tiled_8(w, row, xq, dx, bs16, m, out)
                        m += 8
                    while m + 4 <= c1:
                        iq4_xs_tiled_4(w, row, xq, dx, bs16, m, out)
                        m += 4
                    while m < c1:
                        iq4_xs_tiled_1(w, row, xq, dx, bs16, m, out)
                        m += 1
                    continue
                while m < c1:                       # up to 8 rows per pass over the weight row
                    left = c1 - m
                    if left >= 8:
                        iq4_xs_vec_dot_8(w, row, xq, dx, bs16, m, out)
                    elif left == 7:
                        iq4_xs_vec_dot_7(w, row, xq, dx, bs16, m, out)
                    elif left == 6:
                        iq4_xs_vec_dot_6(w, row, xq, dx, bs16, m, out)
                    elif left == 5:
                        iq4_xs_vec_dot_5(w, row, xq, dx, bs16, m, out)
                    elif left == 4:
                        iq4_xs_vec_dot_4(w, row, xq, dx, bs16, m, out)
                    elif left == 3:
                        iq4_xs_vec_dot_3(w, row, xq, dx, bs16, m, out)
                    elif left == 2:
                        iq4_xs_vec_dot_2(w, row, xq, dx, bs16, m, out)
                    else:
                        iq4_xs_vec_dot_1(w, row, xq, dx, bs16, m, out)
                    m += min(8, left)
