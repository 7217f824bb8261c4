"""Q2_K weights (read in place) times q8_K activation rows: ggml_vec_dot_q2_K_q8_K's numbers for
fewer than 8 rows, the tiled kernel's for more, bit for bit (the arithmetic: see lanes). llama.cpp
repacks Q2_K only with AVX-512 (ggml_repack_get_optimal_repack_type), which its AVX2 build lacks."""
from __future__ import annotations

from llvmlite import ir
from numba import njit, prange

from kernels.cpu.qdot.common import TILED_MIN_ROWS, X_CHUNK_BYTES
from kernels.cpu.qdot.lanes import lane_kernel
from kernels.cpu.simd import V16B, V16S, V32B, c64, f16, f32, i32, load_as, vconst, vload

# --- Q2_K ---------------------------------------------------------------------------------------
# A 256-element super-block: scales[16] (low nibble: scale, high: minimum of each 16 elements),
# qs[64], d, dmin (f16). Element e = 128h + 32s + l: 2 bits at shift 2s of qs[32h + l];
# value d*sc[e//16]*q - dmin*mn[e//16]. Chunk c = 4h + s takes scales 2c, 2c+1; the minimums meet
# the q8_K 16-element sums (see lanes).
Q2_K_BLOCK = 84


def _decode(builder, p):
    """One Q2_K super-block at p -> (q, None, scales) per chunk, d, dmin, minimums (see lanes.lane_kernel)."""
    ms = vload(builder, p, V16B)
    sc16 = builder.zext(builder.and_(ms, vconst(V16B, 15)), V16S)
    mn16 = builder.zext(builder.lshr(ms, vconst(V16B, 4)), V16S)
    m3 = vconst(V32B, 3)
    qv, sv = [], []
    for h in range(2):
        qs = vload(builder, builder.gep(p, [c64(16 + 32 * h)]), V32B)
        for s in range(4):
            c = 4 * h + s
            q = builder.and_(builder.lshr(qs, vconst(V32B, 2 * s)) if s else qs, m3)
            qv.append(q)
            scv = builder.shuffle_vector(sc16, sc16, ir.Constant(ir.VectorType(i32, 16), [2 * c] * 8 + [2 * c + 1] * 8))
            sv.append(scv)
    dw = builder.fpext(load_as(builder, p, f16, 80), f32)
    dmin = builder.fpext(load_as(builder, p, f16, 82), f32)
    return qv, None, sv, dw, dmin, mn16


def _kernel(MR: int, tiled: bool):
    return lane_kernel("q2_k", Q2_K_BLOCK, _decode, False, True, MR, tiled)


q2_k_tiled_1, q2_k_tiled_4, q2_k_tiled_8 = _kernel(1, True), _kernel(4, True), _kernel(8, True)
# A speculative check verifies 1 to 8 rows with the one-row arithmetic: one unpack of W for up to 8.
(q2_k_vec_dot_1, q2_k_vec_dot_2, q2_k_vec_dot_3, q2_k_vec_dot_4, q2_k_vec_dot_5, q2_k_vec_dot_6, q2_k_vec_dot_7,
 q2_k_vec_dot_8) = (_kernel(m, False) for m in range(1, 9))


@njit(parallel=True, cache=True, error_model="numpy")
def _q2_k_rows(w, xq, dx, bs16, run_start, run_len, run_batched, out):
    """Q2_K rows x q8_K rows -> out (M, N): a batched run of 8 rows or more takes the tiled
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
                        q2_k_tiled_8(w, row, xq, dx, bs16, m, out)
                        m += 8
                    while m + 4 <= c1:
                        q2_k_tiled_4(w, row, xq, dx, bs16, m, out)
                        m += 4
                    while m < c1:
                        q2_k_tiled_1(w, row, xq, dx, bs16, m, out)
                        m += 1
                    continue
                while m < c1:                       # up to 8 rows per pass over the weight row
                    left = c1 - m
                    if left >= 8:
                        q2_k_vec_dot_8(w, row, xq, dx, bs16, m, out)
                    elif left == 7:
                        q2_k_vec_dot_7(w, row, xq, dx, bs16, m, out)
                    elif left == 6:
                        q2_k_vec_dot_6(w, row, xq, dx, bs16, m, out)
                    elif left == 5:
                        q2_k_vec_dot_5(w, row, xq, dx, bs16, m, out)
                    elif left == 4:
                        q2_k_vec_dot_4(w, row, xq, dx, bs16, m, out)
                    elif left == 3:
                        q2_k_vec_dot_3(w, row, xq, dx, bs16, m, out)
                    elif left == 2:
                        q2_k_vec_dot_2(w, row, xq, dx, bs16, m, out)
                    else:
                        q2_k_vec_dot_1(w, row, xq, dx, bs16, m, out)
                    m += min(8, left)
