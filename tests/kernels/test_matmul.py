"""Quantized matrix products.

- Gathered rows (every type: the embedding lookup) against gguf-py's dequantized weights, exactly.
- The exact int8 path (Q5_0, Q8_0, Q4_0, IQ4_NL, Q4_1, Q5_1, Q4_K, Q5_K, Q6_K, Q2_K, Q3_K, IQ4_XS) against the numpy models of llama.cpp's AVX2
  kernels in kernels.reference, bit for bit, over the row counts where llama.cpp changes kernel.
"""
import numpy as np
import pytest

from kernels.cpu import qdot
from kernels.cpu.matmul import QMatrix
from kernels.cpu.qdot import Int8Rows
from kernels.cpu.qdot.dense import VEC_DOT2_K
from kernels.cpu.quant import GGML_BLOCK, SUPPORTED_TYPES
from kernels import types as T
from kernels.types import TRAITS
from kernels import reference as ref
from kernels.reference import dequantize_ref, random_quantized

TYPES = sorted(SUPPORTED_TYPES)
def _name(t):
    import gguf
    return gguf.GGMLQuantizationType(t).name


def _k_for(ggml_type, small):
    """K-quants: 1 or 6 super-blocks. 32-blocks: 5 blocks (one 4-block group plus a tail
    block, the kernels' two code paths) or 896 (Qwen2.5-0.5B hidden size, 28 blocks)."""
    blk = GGML_BLOCK[ggml_type][0]
    if blk == 256:
        return 256 if small else 1536
    return 896 if not small else 160


def _setup(ggml_type, n_rows, n_cols, seed):
    rng = np.random.default_rng(seed)
    raw = random_quantized(ggml_type, n_rows, n_cols, rng)
    w = dequantize_ref(raw, ggml_type, n_cols)
    return QMatrix(raw, ggml_type, n_rows, n_cols), w, rng


@pytest.mark.parametrize("ggml_type", TYPES, ids=_name)
def test_rows(ggml_type):
    n_cols = _k_for(ggml_type, True)
    qm, w, _ = _setup(ggml_type, 33, n_cols, ggml_type)
    ids = np.array([5, 0, 32, 5], np.int32)
    np.testing.assert_array_equal(qm.rows(ids), w[ids])


def test_nbytes_is_about_the_gguf_size():
    qm, _, _ = _setup(12, 64, 1536, 0)
    gguf_bytes = 64 * 1536 // 256 * 144
    assert gguf_bytes <= qm.nbytes <= 1.1 * gguf_bytes


def test_shape_errors():
    with pytest.raises(ValueError):
        QMatrix(np.zeros((7, 68), np.uint8), 8, 8, 64)


@pytest.mark.parametrize("ggml_type", TYPES, ids=_name)
def test_parallel_and_serial_rows_agree(ggml_type, monkeypatch):
    """Small gathers run serial twins of the kernels; force each path once per type."""
    from kernels.cpu import ops

    n_cols = _k_for(ggml_type, True)
    qm, w, rng = _setup(ggml_type, 33, n_cols, ggml_type + 5)
    ids = np.array([3, 32, 0])
    for threshold in (0, 1 << 62):  # 0: always parallel; huge: always serial
        monkeypatch.setattr(ops, "PAR_MIN", threshold)
        np.testing.assert_array_equal(qm.rows(ids), w[ids])


# --- the exact int8 path ----------------------------------------------------------------------

EXACT = sorted(t for t, tr in TRAITS.items() if tr.exact)


def _expected(ggml_type, raw, n_cols, rows: Int8Rows, runs):
    """The numpy model of llama.cpp's kernel for each run of rows."""
    out = np.empty((rows.n_rows, raw.shape[0]), np.float32)
    if ggml_type in (T.F32, T.F16, T.BF16):
        w = dequantize_ref(raw, ggml_type, n_cols)
        for r0, n, batched in runs:
            tiny = batched and n >= 2 and w.shape[0] % 4 == 0      # llama.cpp's sgemm
            out[r0:r0 + n] = ref.matmul_dense_ref(w, rows.xf[r0:r0 + n], ggml_type, tiny)
        return out
    if ggml_type in (T.Q5_0, T.Q8_0):
        d, w = (ref.unpack_q8_0 if ggml_type == T.Q8_0 else ref.unpack_q5_0)(raw, n_cols)
        return ref.matmul_q0_ref(d, w, rows.dx, rows.xq)
    if ggml_type in (T.Q4_1, T.Q5_1):
        d, m, w = (ref.unpack_q4_1 if ggml_type == T.Q4_1 else ref.unpack_q5_1)(raw, n_cols)
        return ref.matmul_q1_ref(d, m, w, rows.dx, rows.s1, rows.xq)
    if ggml_type in (T.Q4_0, T.IQ4_NL):
        d, w = (ref.unpack_q4_0 if ggml_type == T.Q4_0 else ref.unpack_iq4_nl)(raw, n_cols)
        return ref.matmul_q4_0_8x8_ref(d, w, rows.dx, rows.xq)
    unpack = {T.Q4_K: ref.unpack_q4_k, T.Q5_K: ref.unpack_q5_k, T.Q6_K: ref.unpack_q6_k, T.Q2_K: ref.unpack_q2_k,
              T.Q3_K: ref.unpack_q3_k, T.IQ4_XS: ref.unpack_iq4_xs}[ggml_type]
    unpacked = unpack(raw, n_cols)
    for r0, n, batched in runs:
        sl = slice(r0, r0 + n)
        if ggml_type == T.Q4_K:        # llama.cpp: gemm for the first n - n % 4 rows of a batch > 3 rows
            n_gemm = n - n % 4 if batched and n > 3 else 0
            g = slice(r0, r0 + n_gemm)
            v = slice(r0 + n_gemm, r0 + n)
            out[g] = ref.matmul_q4_k_ref(unpacked, rows.dx[g], rows.xq[g], per_pair=True)
            out[v] = ref.matmul_q4_k_ref(unpacked, rows.dx[v], rows.xq[v], per_pair=False)
        else:                      # Q5_K, Q6_K, Q2_K, Q3_K, IQ4_XS: tiled from 8 rows
            model = {T.Q5_K: ref.matmul_q5_k_ref, T.Q6_K: ref.matmul_q6_k_ref, T.Q2_K: ref.matmul_q2_k_ref,
                     T.Q3_K: ref.matmul_q3_k_ref, T.IQ4_XS: ref.matmul_iq4_xs_ref}[ggml_type]
            out[sl] = model(unpacked, rows.dx[sl], rows.xq[sl], tiled=batched and n >= 8)
    return out


@pytest.mark.parametrize("ggml_type", EXACT, ids=_name)
@pytest.mark.parametrize("n_rows, n_cols", [(13, 256), (40, 4864), (33, 896)])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 8, 9, 12, 16, 37, 53])
def test_exact_matmul_equals_llama_cpp_model(ggml_type, n_rows, n_cols, m):
    """Bit for bit the numpy model of llama.cpp's kernel: Q8_0/Q5_0 through the x8 kernels (one row,
    or passes of up to 8 rows: 9, 16, 37 take several) and the panel kernel (Q5_0, and Q8_0, Q4_0
    and IQ4_NL with 512-bit registers: from 48 rows, or 32 with 512-bit registers, whose groups of
    16 leave a ragged last one at 37 and 53),
    Q4_K's gemm/gemv split, Q5_K's and Q6_K's vec_dot (< 8 rows) and tiled (>= 8) arithmetic (12: the
    K-quants' 16-row kernels on one group partly empty); 13 rows: the x8 layouts' padding."""
    # the panel kernel is covered: by 53 (ragged last tiles of 3 rows, or of a group of 16), and with
    # 512-bit registers by 37 too
    assert (m >= qdot.PANEL_MIN_ROWS) == (m == 53 or (m == 37 and qdot.WIDE))
    if GGML_BLOCK[ggml_type][0] == 256 and n_cols % 256:
        n_cols = 1536
    if TRAITS[ggml_type].rows8 and n_rows % 8:
        n_rows = 16                # llama.cpp only repacks Q4_K, Q4_0, IQ4_NL with a multiple of 8 rows
    rng = np.random.default_rng(ggml_type * 1000 + n_rows * 10 + m)
    raw = random_quantized(ggml_type, n_rows, n_cols, rng)
    qm = QMatrix(raw, ggml_type, n_rows, n_cols)
    assert qm.exact is not None
    x = rng.standard_normal((m, n_cols)).astype(np.float32)
    x[0, 3] = 25.0                 # an outlier: a block with a large scale
    rows = Int8Rows(x, TRAITS[ggml_type].vec_dot)
    got = qm.matmul_int8(rows)
    np.testing.assert_array_equal(got, _expected(ggml_type, raw, n_cols, rows, [(0, m, True)]))


@pytest.mark.parametrize("ggml_type", [T.Q6_K, T.Q5_K, T.Q3_K, T.IQ4_XS, T.Q2_K], ids=_name)
@pytest.mark.parametrize("m", [8, 13, 37])
def test_k_quant_byte_kernels_with_8_rows_to_a_register(ggml_type, m):
    """The K-quants' byte kernels as a CPU with AVX-VNNI and no AVX-512 runs them (tiled16: 8
    activation rows in a 256-bit register, tiles of 4 weight rows; 20 weight rows, so the last tile
    is not a whole 8). Such a CPU is a variant this machine may not execute, but wherever vpdpbusd
    exists the same kernels compile, and here they must give the model's numbers bit for bit.
    Without vpdpbusd (AVX2 alone) no byte kernel is picked."""
    from kernels.cpu.qdot import tiled16
    from kernels.types import ACT_Q8_K
    rng = np.random.default_rng(ggml_type * 100 + m)
    raw = random_quantized(ggml_type, 20, 1536, rng)
    x = rng.standard_normal((m, 1536)).astype(np.float32)
    x[0, 3] = 25.0
    if not tiled16.VNNI:
        assert not tiled16.takes(ggml_type, 20, *qdot.run_arrays([(0, m, True)]))
        return
    qm = QMatrix(raw, ggml_type, 20, 1536)
    q = qdot.Q8Buffers.alloc(m, 1536)
    qdot.quantize_into(x, ACT_Q8_K, q)
    rows = Int8Rows(x, TRAITS[ggml_type].vec_dot)
    np.testing.assert_array_equal(q.xq, rows.xq)
    xb, dx, bs = tiled16.operands(ggml_type, q, 8)
    assert xb.shape[2] == 8
    out = np.zeros((m, 20), np.float32)
    tiled16.prompt(ggml_type, qm.exact, xb, dx, bs, m, out)
    np.testing.assert_array_equal(out, _expected(ggml_type, raw, 1536, rows, [(0, m, True)]))


@pytest.mark.parametrize("ggml_type", [T.Q5_0, T.Q8_0, T.Q4_0, T.IQ4_NL], ids=_name)
def test_panel_rows_that_end_in_half_a_register(ggml_type):
    """Rows of 160 (K % 64 == 32): the 512-bit panel's activations, 16 dwords of 16 rows per register
    step, end in half a step (rows16.regroup_biased fills it); still bit for bit the model."""
    rng = np.random.default_rng(ggml_type)
    raw = random_quantized(ggml_type, 24, 160, rng)
    qm = QMatrix(raw, ggml_type, 24, 160)
    x = rng.standard_normal((53, 160)).astype(np.float32)
    rows = Int8Rows(x, TRAITS[ggml_type].vec_dot)
    np.testing.assert_array_equal(qm.matmul_int8(rows), _expected(ggml_type, raw, 160, rows, [(0, 53, True)]))


def test_the_wide_prompt_kernels_are_the_ones_tested():
    """With 512-bit registers a prompt's Q6_K, Q5_K, Q3_K, IQ4_XS and Q2_K rows go through the 16-row kernels
    (kernels/cpu/qdot/tiled16.py, from 10 rows, whole tiles of weight rows), Q4_K's gemm rows through its 16-row kernel (from 32 of them; the last n % 4
    rows keep the gemv arithmetic) and Q5_0's, Q8_0's, Q4_0's and IQ4_NL's through the 512-bit panel: the exactness tests above
    then test them (16 and 40 weight rows; 12, 16, 37 and 53 activation rows). With AVX-VNNI alone
    the K-quants' byte kernels run with 8 rows in the lanes, from 8 rows (8, 9, 12, ... test them).
    Elsewhere none is picked, and the same tests cover the other kernels (tests/engine/test_cpu_variants.py
    runs them under each variant). The K-quants' 16-row kernels but Q5_K's are AMX tile kernels under
    avx512amx."""
    from kernels.cpu import isa
    wide = isa.variant() in ("avx512vnni", "avx512amx")   # the variants with 512-bit registers
    from kernels.cpu.qdot import tiled16
    from kernels.cpu.qdot.q4_k import wide_gemm_rows
    assert wide_gemm_rows(*qdot.run_arrays([(0, 37, True)])) == (36 if wide else 0)
    assert wide_gemm_rows(*qdot.run_arrays([(0, 53, True)])) == (52 if wide else 0)
    assert wide_gemm_rows(*qdot.run_arrays([(0, 31, True)])) == 0
    assert wide_gemm_rows(*qdot.run_arrays([(0, 53, False)])) == 0
    one_run = lambda n: qdot.run_arrays([(0, n, True)])            # noqa: E731
    vnni = isa.variant() != "avx2"                        # vpdpbusd: the byte kernels, 8 or 16 rows to a register
    assert tiled16.LANES == (16 if wide else 8) and tiled16.PROMPT_MIN_ROWS == (10 if wide else 8)
    for t in (T.Q6_K, T.Q5_K, T.Q3_K, T.IQ4_XS, T.Q2_K):
        assert tiled16.takes(t, 40, *one_run(tiled16.PROMPT_MIN_ROWS)) == vnni
        assert not tiled16.takes(t, 40, *one_run(tiled16.PROMPT_MIN_ROWS - 1))
        assert not tiled16.takes(t, 13, *one_run(53))
        assert not tiled16.takes(t, 40, *qdot.run_arrays([(0, 30, True), (30, 23, True)]))
        assert not tiled16.takes(t, 40, *qdot.run_arrays([(0, 53, False)]))
    assert not tiled16.takes(T.Q4_K, 40, *one_run(53))
    assert (qdot.panel_prompt.py_func.__name__ == "_panel_prompt_512") == wide
    assert qdot.has_panel(T.Q5_0) and all(qdot.has_panel(t) == wide for t in (T.Q8_0, T.Q4_0, T.IQ4_NL))
    assert not any(qdot.has_panel(t) for t in (T.Q4_1, T.Q5_1))
    # with AMX tiles (the avx512amx variant) the same rows go through kernels/cpu/qdot/amx.py instead
    assert qdot.AMX == (isa.variant() == "avx512amx")
    assert (qdot.q4_k_prompt.py_func.__module__ == "kernels.cpu.qdot.amx") == qdot.AMX


@pytest.mark.parametrize("ggml_type", EXACT, ids=_name)
@pytest.mark.parametrize("m", [2, 6, 7, 8, 9, 17])
def test_single_row_arithmetic_for_many_rows(ggml_type, m):
    """A speculative check's rows (one run, not batched) get the one-row arithmetic whatever their
    number: Q5_K and Q6_K have a kernel for each of 1..8 rows per pass over W, Q4_K's gemv takes 4 and 2."""
    n_cols = 1536
    rng = np.random.default_rng(ggml_type * 100 + m)
    raw = random_quantized(ggml_type, 16, n_cols, rng)
    qm = QMatrix(raw, ggml_type, 16, n_cols)
    x = rng.standard_normal((m, n_cols)).astype(np.float32)
    rows = Int8Rows(x, TRAITS[ggml_type].vec_dot)
    got = qm.matmul_int8(rows, runs=[(0, m, False)])
    np.testing.assert_array_equal(got, _expected(ggml_type, raw, n_cols, rows, [(0, m, False)]))


@pytest.mark.parametrize("ggml_type", EXACT, ids=_name)
def test_one_row_runs_give_every_row_its_single_row_numbers(ggml_type):
    """Decode rows (speculative checks, batches) get each row the numbers it gets alone, while a
    batched run in the same call keeps llama.cpp's batch arithmetic."""
    n_cols = 1536
    rng = np.random.default_rng(ggml_type)
    raw = random_quantized(ggml_type, 24, n_cols, rng)
    qm = QMatrix(raw, ggml_type, 24, n_cols)
    x = rng.standard_normal((24, n_cols)).astype(np.float32)
    kind = TRAITS[ggml_type].vec_dot
    # single-row runs merge (1 + 4 + a batch of one: 6 rows in one pass), a batched run keeps its own
    # arithmetic (9 rows; 2 rows), then 7 single rows
    runs = [(0, 9, True), (9, 1, False), (10, 4, False), (14, 1, True), (15, 2, True), (17, 7, False)]
    got = qm.matmul_int8(Int8Rows(x, kind), runs=runs)
    for r0, n, batched in runs:
        if batched and n > 1:
            np.testing.assert_array_equal(got[r0:r0 + n], qm.matmul_int8(Int8Rows(x[r0:r0 + n], kind)))
        else:
            for i in range(r0, r0 + n):
                np.testing.assert_array_equal(got[i], qm.matmul_int8(Int8Rows(x[i:i + 1], kind))[0])
    rows = Int8Rows(x, kind)
    np.testing.assert_array_equal(got, _expected(ggml_type, raw, n_cols, rows, runs))


@pytest.mark.parametrize("ggml_type", EXACT, ids=_name)
@pytest.mark.parametrize("n_out", [1, 8, 13, 40])
def test_first_rows_only(ggml_type, n_out):
    """n_out (a draft model's truncated vocabulary): the first n_out outputs, the same numbers."""
    rng = np.random.default_rng(n_out)
    raw = random_quantized(ggml_type, 40, 1536, rng)
    qm = QMatrix(raw, ggml_type, 40, 1536)
    rows = Int8Rows(rng.standard_normal((3, 1536)).astype(np.float32), TRAITS[ggml_type].vec_dot)
    np.testing.assert_array_equal(qm.matmul_int8(rows, n_out), qm.matmul_int8(rows)[:, :n_out])


@pytest.mark.parametrize("ggml_type", [T.F32, T.F16, T.BF16], ids=_name)
@pytest.mark.parametrize("n_out", [4, 8, 41])
def test_first_rows_of_a_ragged_dense_matrix(ggml_type, n_out):
    """42 rows are not whole tinyBLAS tiles, so llama.cpp does not tile W at all: its first n_out
    rows (4 and 8 are whole tiles) get the untiled numbers too, as all of W does."""
    rng = np.random.default_rng(n_out)
    raw = random_quantized(ggml_type, 42, 256, rng)
    qm = QMatrix(raw, ggml_type, 42, 256)
    rows = Int8Rows(rng.standard_normal((3, 256)).astype(np.float32), TRAITS[ggml_type].vec_dot)
    got = qm.matmul_int8(rows, n_out)
    np.testing.assert_array_equal(got, _expected(ggml_type, raw, 256, rows, [(0, 3, True)])[:, :n_out])
    np.testing.assert_array_equal(got, qm.matmul_int8(rows)[:, :n_out])


@pytest.mark.parametrize("ggml_type", [T.F32, T.F16, T.BF16], ids=_name)
def test_one_row_products_of_long_float_rows(ggml_type):
    """Rows of VEC_DOT2_K elements or more take two weight rows per pass over x (an odd last row
    alone): every output is still ggml_vec_dot's, for single rows and rows decoded side by side."""
    rng = np.random.default_rng(ggml_type + 77)
    n_rows, n_cols = 7, VEC_DOT2_K + 256
    raw = random_quantized(ggml_type, n_rows, n_cols, rng)
    qm = QMatrix(raw, ggml_type, n_rows, n_cols)
    rows = Int8Rows(rng.standard_normal((3, n_cols)).astype(np.float32), TRAITS[ggml_type].vec_dot)
    runs = [(0, 1, False), (1, 2, False)]
    np.testing.assert_array_equal(qm.matmul_int8(rows, runs=runs), _expected(ggml_type, raw, n_cols, rows, runs))


@pytest.mark.parametrize("tiny_in", ["weights", "activations", "neither"])
def test_bf16_prompt_tiles_keep_the_bits_beside_subnormal_products(tiny_in):
    """Where the CPU has AVX512_BF16, BF16 prompt tiles run on vdpbf16ps, which treats subnormal
    inputs and results as zero where llama.cpp's fma keeps them (kernels/cpu/qdot/dense.py): a
    weight row of 2^-130s, or an activation row of them, makes outputs that are sums of subnormal
    products. The tile (or the group of activation rows) holding one takes the fma kernels, so those
    outputs are llama.cpp's nonzero numbers and every other output is unchanged. Without the check
    they come out 0. 22 rows: groups of 4 pairs and single pairs, the tiny row in the second group."""
    rng = np.random.default_rng(11)
    N, K, M = 16, 256, 22
    w = ref.round_activation_ref(rng.standard_normal((N, K)).astype(np.float32), T.BF16)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w[2, ::3] = 0.0                                   # zeros are not small: they never leave the tiles
    if tiny_in == "weights":
        w[5] = np.float32(2.0 ** -130) * np.sign(rng.standard_normal(K)).astype(np.float32)
    elif tiny_in == "activations":
        x[11] = np.float32(2.0 ** -130) * np.sign(rng.standard_normal(K)).astype(np.float32)
    raw = np.ascontiguousarray((w.view(np.uint32) >> 16).astype("<u2")).view(np.uint8).reshape(N, 2 * K)
    qm = QMatrix(raw, T.BF16, N, K)
    rows = Int8Rows(x, TRAITS[T.BF16].vec_dot)
    got = qm.matmul_int8(rows)
    np.testing.assert_array_equal(got.view(np.uint32), _expected(T.BF16, raw, K, rows, [(0, M, True)]).view(np.uint32))
    tiny_outputs = {"weights": got[:, 5], "activations": got[11], "neither": got[:, 0]}[tiny_in]
    assert np.all(tiny_outputs != 0) and (tiny_in == "neither" or np.all(np.abs(tiny_outputs) < 2.0 ** -110))


def test_activation_rows_refuse_what_they_cannot_hold():
    """Int8Rows quantizes whole blocks only (a partial one would be read past its end), and has only
    the forms of its kind."""
    with pytest.raises(ValueError, match="multiple of 256"):
        Int8Rows(np.ones((2, 100), np.float32), T.ACT_Q8_K)
    with pytest.raises(ValueError, match="multiple of 32"):
        Int8Rows(np.ones((2, 48), np.float32), T.ACT_Q8_0)
    with pytest.raises(AttributeError, match="no xf"):
        Int8Rows(np.ones((2, 256), np.float32), T.ACT_Q8_K).xf
    with pytest.raises(AttributeError, match="no bsp"):
        Int8Rows(np.ones((2, 256), np.float32), T.ACT_F16).bsp


@pytest.mark.parametrize("ggml_type", EXACT, ids=_name)
def test_exact_parallel_and_serial_agree(ggml_type):
    import numba
    rng = np.random.default_rng(7)
    raw = random_quantized(ggml_type, 64, 1536, rng)
    qm = QMatrix(raw, ggml_type, 64, 1536)
    rows = Int8Rows(rng.standard_normal((20, 1536)).astype(np.float32), TRAITS[ggml_type].vec_dot)
    got2 = qm.matmul_int8(rows)
    n = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        np.testing.assert_array_equal(qm.matmul_int8(rows), got2)
    finally:
        numba.set_num_threads(n)


@pytest.mark.parametrize("x_scale", [1.0, 1e-6, 1e4])
def test_activation_quantizers_equal_llama_cpp_model(x_scale):
    """q8_0 (and q8_1) / q8_K rows as quantize_row_q8_0/1 (AVX2) and quantize_row_q8_K_ref make them, with the
    sums the kernels take, including an all-zero block and ties of |max| with both signs."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 512)) * x_scale).astype(np.float32)
    x[1, :256] = 0.0
    x[2, 10], x[2, 20] = -3 * x_scale, 3 * x_scale                 # +-max tie: the first one sets the sign
    q8 = Int8Rows(x, T.ACT_Q8_0)
    xq, dx, sx, s1 = q8.xq, q8.dx, q8.sx, q8.s1
    want_q, want_d, want_s = ref.quantize_q8_0_ref(x)
    np.testing.assert_array_equal(xq, want_q)
    np.testing.assert_array_equal(dx, want_d)
    np.testing.assert_array_equal(s1, want_s)
    np.testing.assert_array_equal(sx, 16 * xq.reshape(5, -1, 4).astype(np.int32).sum(-1))
    qk = Int8Rows(x, T.ACT_Q8_K)
    kq, kd, bs16, bsp = qk.xq, qk.dx, qk.bs16, qk.bsp
    want_q, want_d = ref.quantize_q8_k_ref(x)
    np.testing.assert_array_equal(kq, want_q)
    np.testing.assert_array_equal(kd, want_d)
    s16 = kq.reshape(5, -1, 16).astype(np.int32).sum(-1)
    np.testing.assert_array_equal(bs16, s16)
    s32 = s16.reshape(5, -1, 2).sum(-1)
    np.testing.assert_array_equal(bsp, (s32[:, 0::2] & 0xFFFF) | (s32[:, 1::2] << 16))
    for i in range(5):                 # one row (decode) is quantized on the calling thread: the same
        for kind, many in ((T.ACT_Q8_0, q8), (T.ACT_Q8_K, qk)):
            one = Int8Rows(x[i:i + 1], kind)
            for form in ("xq", "dx", "sx", "s1") if kind == T.ACT_Q8_0 else ("xq", "dx", "bs16", "bsp"):
                np.testing.assert_array_equal(getattr(one, form)[0], getattr(many, form)[i])
    for t in (T.F32, T.F16, T.BF16):             # the float weights' activations: rounded to their type
        np.testing.assert_array_equal(Int8Rows(x, TRAITS[t].vec_dot).xf, ref.round_activation_ref(x, t))


def test_exact_kernels_exist_on_this_cpu():
    """kvchat's exactness rests on these kernels (AVX2, FMA, F16C: any x86-64 of the last decade);
    without them the engine falls back to the float kernels and no longer follows llama.cpp."""
    from kernels.cpu import qdot
    assert qdot.EXACT_TYPES == set(EXACT) and {T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K} <= qdot.EXACT_TYPES
