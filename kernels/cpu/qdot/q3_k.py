"""Q3_K weights (read in place) times q8_K activation rows: ggml_vec_dot_q3_K_q8_K's numbers for
fewer than 8 rows, the tiled kernel's for more, bit for bit (the arithmetic: see lanes)."""
from __future__ import annotations

from llvmlite import ir
from numba import njit, prange

from kernels.cpu.qdot.common import TILED_MIN_ROWS, X_CHUNK_BYTES
from kernels.cpu.qdot.lanes import lane_kernel
from kernels.cpu.simd import V16B, V16S, V32B, c32, c64, f16, f32, i32, load_as, psign, vconst, vload

# --- Q3_K ---------------------------------------------------------------------------------------
# A 256-element super-block: hmask[32], qs[64], 12 bytes of 6-bit scales (16 of them, stored +32),
# d (f16). Element e = 128h + 32s + l (half h, l < 32): low 2 bits at shift 2s of qs[32h + l], the
# third bit is bit 4h + s of hmask[l]; value d * (sc[e // 16] - 32) * (low + 4*bit - 4).
# Chunk c = 4h + s takes scales 2c, 2c+1; its weights -4..3 go through the sign trick (see lanes).
Q3_K_BLOCK = 110


def _decode(builder, p):
    """One Q3_K super-block at p -> (|w|, w, scales) per chunk, d (see lanes.lane_kernel)."""
    V4I = ir.VectorType(i32, 4)
    a0, a1, a2 = (load_as(builder, p, i32, 96 + 4 * k) for k in range(3))
    k1, k2 = ir.Constant(i32, 0x03030303), ir.Constant(i32, 0x0F0F0F0F)
    lsr = lambda v, k: builder.lshr(v, ir.Constant(i32, k)) if k else v          # noqa: E731
    hi2 = lambda k: builder.shl(builder.and_(lsr(a2, k), k1), ir.Constant(i32, 4))  # noqa: E731
    # the 16 scales as llama.cpp's aux words decode them: bytes 0..3, 4..7, 8..11, 12..15
    words = (builder.or_(builder.and_(a0, k2), hi2(0)), builder.or_(builder.and_(a1, k2), hi2(2)),
             builder.or_(builder.and_(lsr(a0, 4), k2), hi2(4)), builder.or_(builder.and_(lsr(a1, 4), k2), hi2(6)))
    v = ir.Constant(V4I, ir.Undefined)
    for k, t in enumerate(words):
        v = builder.insert_element(v, t, c32(k))
    sc16 = builder.sext(builder.sub(builder.bitcast(v, V16B), vconst(V16B, 32)), V16S)   # -32..31
    hm = vload(builder, p, V32B)
    qv, wv, sv = [], [], []
    m3, one, four = vconst(V32B, 3), vconst(V32B, 1), vconst(V32B, 4)
    shr = lambda v, k: builder.lshr(v, vconst(V32B, k)) if k else v             # noqa: E731
    for h in range(2):
        qs = vload(builder, builder.gep(p, [c64(32 + 32 * h)]), V32B)
        for s in range(4):
            c = 4 * h + s
            low = builder.and_(shr(qs, 2 * s), m3)
            hb = builder.shl(builder.and_(shr(hm, c), one), vconst(V32B, 2))
            w = builder.sub(builder.or_(low, hb), four)                          # -4..3
            qv.append(psign(builder, w, w))
            wv.append(w)
            scv = builder.shuffle_vector(sc16, sc16, ir.Constant(ir.VectorType(i32, 16), [2 * c] * 8 + [2 * c + 1] * 8))
            sv.append(scv)
    return qv, wv, sv, builder.fpext(load_as(builder, p, f16, 108), f32), None, None


def _kernel(MR: int, tiled: bool):
    return lane_kernel("q3_k", Q3_K_BLOCK, _decode, True, False, MR, tiled)


q3_k_tiled_1, q3_k_tiled_4, q3_k_tiled_8 = _kernel(1, True), _kernel(4, True), _kernel(8, True)
# A speculative check verifies 1 to 8 rows with the one-row arithmetic: one unpack of W for up to 8.
(q3_k_vec_dot_1, q3_k_vec_dot_2, q3_k_vec_dot_3, q3_k_vec_dot_4, q3_k_vec_dot_5, q3_k_vec_dot_6, q3_k_vec_dot_7,
 q3_k_vec_dot_8) = (_kernel(m, False) for m in range(1, 9))


@njit(parallel=True, cache=True, error_model="numpy")
def _q3_k_rows(w, xq, dx, bs16, run_start, run_len, run_batched, out):
    """Q3_K rows x q8_K rows -> out (M, N): a batched run of 8 rows or more takes the tiled
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
                        q3_k_tiled_8(w, row, xq, dx, bs16, m, out)
                        m += 8
                    while m + 4 <= c1:
                        q3_k_tiled_4(w, row, xq, dx, bs16, m, out)
                        m += 4
                    while m < c1:
                        q3_k_tiled_1(w, row, xq, dx, bs16, m, out)
                        m += 1
                    continue
                while m < c1:                       # up to 8 rows per pass over the weight row
                    left = c1 - m
                    if left >= 8:
                        q3_k_vec_dot_8(w, row, xq, dx, bs16, m, out)
                    elif left == 7:
                        q3_k_vec_dot_7(w, row, xq, dx, bs16, m, out)
                    elif left == 6:
                        q3_k_vec_dot_6(w, row, xq, dx, bs16, m, out)
                    elif left == 5:
                        q3_k_vec_dot_5(w, row, xq, dx, bs16, m, out)
                    elif left == 4:
                        q3_k_vec_dot_4(w, row, xq, dx, bs16, m, out)
                    elif left == 3:
                        q3_k_vec_dot_3(w, row, xq, dx, bs16, m, out)
                    elif left == 2:
                        q3_k_vec_dot_2(w, row, xq, dx, bs16, m, out)
                    else:
                        q3_k_vec_dot_1(w, row, xq, dx, bs16, m, out)
                    m += min(8, left)
