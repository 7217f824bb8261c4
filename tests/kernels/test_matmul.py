"""Quantized gemv/gemm/rows against float64 products of gguf-py's dequantized weights."""
import numpy as np
import pytest

from kernels.cpu.matmul import INT8_ACTIVATION_TYPES, TILE16_TYPES, QMatrix
from kernels.cpu.quant import GGML_BLOCK, SUPPORTED_TYPES
from kernels.reference import dequantize_ref, matmul_ref, random_quantized

TYPES = sorted(SUPPORTED_TYPES)
# gemv sums in float32 with fastmath reassociation, blocked by 16/32 lanes then by block:
# the rounding error is a few dozen ulps of the largest partial sum, bounded by
# eps32 * depth * sum|w||x| with depth << 300, so 2e-5 * sum|w||x| is a safe bound.
GEMV_RTOL = 2e-5
# gemm rounds x and W to bf16 (2^-9 relative each) and the product to bf16 (2^-9 of |y|),
# so |error| <= ~3 * 2^-9 * sum|w||x| (~5.9e-3); 8e-3 leaves room for f32 accumulation.
GEMM_RTOL = 8e-3


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


def _q8k_bound(w, x):
    """Error bound of int8 activations (one scale per 256 = max|x|/127): each x moves by at
    most half a step, so |error| <= sum over blocks of step/2 * sum|w| in the block."""
    xb = np.atleast_2d(x).astype(np.float64).reshape(np.atleast_2d(x).shape[0], -1, 256)
    half_step = np.abs(xb).max(axis=-1) / 127 / 2  # (M, K/256)
    wb = np.abs(w.astype(np.float64)).reshape(w.shape[0], -1, 256).sum(axis=-1)  # (N, K/256)
    return (half_step @ wb.T).reshape(np.shape(x)[:-1] + (w.shape[0],))


def _assert_close(got, w, x, rtol, ggml_type=None):
    ref = matmul_ref(w, x)
    bound = rtol * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T) + 1e-30
    if ggml_type in INT8_ACTIVATION_TYPES and rtol == GEMV_RTOL:
        bound = bound + _q8k_bound(w, x)
    err = np.abs(got - ref)
    assert np.all(err <= bound), f"max err/bound {np.max(err / bound):.3g}"


@pytest.mark.parametrize("ggml_type", TYPES, ids=_name)
@pytest.mark.parametrize("n_rows, small", [(7, True), (33, False), (151, False)])
def test_gemv(ggml_type, n_rows, small):
    n_cols = _k_for(ggml_type, small)
    qm, w, rng = _setup(ggml_type, n_rows, n_cols, ggml_type * 7 + n_rows)
    x = rng.standard_normal(n_cols).astype(np.float32)
    got = qm.gemv(x)
    assert got.shape == (n_rows,) and got.dtype == np.float32
    _assert_close(got, w, x, GEMV_RTOL, ggml_type)


def test_gemv_k4864_q4_k():
    qm, w, rng = _setup(12, 33, 4864, 1)
    x = rng.standard_normal(4864).astype(np.float32)
    _assert_close(qm.gemv(x), w, x, GEMV_RTOL, 12)


@pytest.mark.parametrize("int8", [True, False], ids=["int8-x", "float-x"])
def test_gemv_q4_k_both_activation_paths(int8, monkeypatch):
    from kernels.cpu import matmul

    monkeypatch.setattr(matmul, "INT8_ACTIVATION_TYPES", frozenset({12}) if int8 else frozenset())
    qm, w, rng = _setup(12, 33, 1536, 2)
    if not int8:
        qm.tiles = None  # the tile kernel (VNNI hosts) also takes int8 activations
    x = rng.standard_normal(1536).astype(np.float32)
    x[5] = 40.0  # an outlier widens its block's int8 step; the bound accounts for it
    got = qm.gemv(x)
    ref = matmul_ref(w, x)
    bound = GEMV_RTOL * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T)
    if int8:
        bound += _q8k_bound(w, x)
    assert np.all(np.abs(got - ref) <= bound)


@pytest.mark.parametrize("ggml_type", TYPES, ids=_name)
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_gemm(ggml_type, m):
    n_cols = _k_for(ggml_type, False)
    qm, w, rng = _setup(ggml_type, 33, n_cols, ggml_type * 11 + m)
    x = rng.standard_normal((m, n_cols)).astype(np.float32)
    got = qm.gemm(x)
    assert got.shape == (m, 33) and got.dtype == np.float32
    _assert_close(got, w, x, GEMV_RTOL if m <= QMatrix.GEMV_MAX_M else GEMM_RTOL, ggml_type)


def test_gemm_spans_several_tiles():
    qm, w, rng = _setup(8, 151, 896, 3)
    qm.TILE_ELEMS = 896 * 32  # 32-row tiles: 5 tiles, the last one partial
    x = rng.standard_normal((9, 896)).astype(np.float32)
    _assert_close(qm.gemm(x), w, x, GEMM_RTOL)


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
    qm, _, _ = _setup(8, 7, 64, 0)
    with pytest.raises(ValueError):
        qm.gemv(np.zeros(63, np.float32))
    with pytest.raises(ValueError):
        qm.gemm(np.zeros((2, 63), np.float32))
    with pytest.raises(ValueError):
        QMatrix(np.zeros((7, 68), np.uint8), 8, 8, 64)


@pytest.mark.parametrize("ggml_type", TYPES, ids=_name)
def test_parallel_and_serial_kernels_agree(ggml_type, monkeypatch):
    """Small weights run serial twins of the kernels; force each path once per type."""
    from kernels.cpu import matmul, ops

    n_cols = _k_for(ggml_type, True)
    qm, w, rng = _setup(ggml_type, 33, n_cols, ggml_type + 5)
    x = rng.standard_normal(n_cols).astype(np.float32)
    ids = np.array([3, 32, 0])
    for threshold in (0, 1 << 62):  # 0: always parallel; huge: always serial
        monkeypatch.setattr(matmul, "GEMV_PAR_MIN_BYTES", threshold)
        monkeypatch.setattr(ops, "PAR_MIN", threshold)
        _assert_close(qm.gemv(x), w, x, GEMV_RTOL, ggml_type)
        np.testing.assert_array_equal(qm.rows(ids), w[ids])


TILE16_CANDIDATES = (6, 8, 12, 14)   # Q5_0, Q8_0, Q4_K, Q6_K: tiled on CPUs with AVX-512 VNNI, float kernels elsewhere


@pytest.mark.parametrize("ggml_type", TILE16_CANDIDATES, ids=_name)
@pytest.mark.parametrize("n_rows, n_blocks", [(16, 1), (48, 5), (128, 28), (896, 19), (23, 2)])
@pytest.mark.parametrize("parallel", [True, False], ids=["par", "serial"])
def test_gemv_tile16(ggml_type, n_rows, n_blocks, parallel, monkeypatch):
    """16-row tile kernels (int8 activations): whole and partial tiles, both thread paths; exact
    on llama.cpp-rounded x (Q5_0/Q6_K fall back to float kernels for other x: test_gemv)."""
    from kernels.cpu import matmul

    n_cols = n_blocks * GGML_BLOCK[ggml_type][0]
    monkeypatch.setattr(matmul, "GEMV_PAR_MIN_BYTES", 0 if parallel else 1 << 62)
    qm, w, rng = _setup(ggml_type, n_rows, n_cols, n_rows + n_cols)
    tiled = ggml_type in TILE16_TYPES
    assert (qm.tiles is not None) == tiled
    from kernels.cpu.activations import round_like_llama_cpp

    x = rng.standard_normal(n_cols).astype(np.float32)
    x[3] = 30.0  # an outlier widens its block's int8 step
    x = round_like_llama_cpp(x[None], ggml_type)[0]  # on the int8 grid, as the models layer passes it
    calls = []
    if tiled:
        for table in (matmul._GEMV, matmul._GEMV_SERIAL):  # the float fallbacks must not run
            monkeypatch.setitem(table, ggml_type, lambda *a: calls.append(a))
    _assert_close(qm.gemv(x), w, x, GEMV_RTOL, ggml_type)
    assert not calls


@pytest.mark.parametrize("ggml_type", TILE16_CANDIDATES, ids=_name)
def test_gemv_tile16_is_exact_on_llama_rounded_x(ggml_type):
    """On an activation already rounded to q8_0 (as the models layer does) the int8 requantization
    is lossless: the result is the float64 product up to float32 summation error."""
    from kernels.cpu.activations import round_like_llama_cpp

    n_cols = 1536 if GGML_BLOCK[ggml_type][0] == 256 else 896
    qm, w, rng = _setup(ggml_type, 64, n_cols, 9)
    x = round_like_llama_cpp(rng.standard_normal((1, n_cols)).astype(np.float32), ggml_type)[0]
    _assert_close(qm.gemv(x), w, x, GEMV_RTOL)  # no int8 allowance


@pytest.mark.parametrize("kind, blk", [("q8_0", 32), ("q8_K", 256)])
def test_int8_quantizers_are_llama_cpp_rounding(kind, blk):
    """The tile kernels quantize activations themselves; dequantized, that must be bit-for-bit
    the activation llama.cpp's matmul uses (activations.round_like_llama_cpp), including a block
    whose largest value is negative, an outlier, and an all-zero block."""
    from kernels.cpu.activations import round_like_llama_cpp
    from kernels.cpu.matmul import Int8Rows

    rng = np.random.default_rng(blk)
    x = rng.standard_normal((5, 4 * blk)).astype(np.float32)
    x[0, 3] = -50.0
    x[1, blk + 7] = 1e4
    x[2, 2 * blk:3 * blk] = 0.0
    rows = Int8Rows(x, kind)
    deq = rows.xq.astype(np.float32) * np.repeat(rows.dx, blk, axis=1)
    np.testing.assert_array_equal(deq, round_like_llama_cpp(x, 8 if kind == "q8_0" else 12))
    assert rows.xq.min() >= -127 and rows.xq.max() <= 127


@pytest.mark.parametrize("ggml_type", TILE16_CANDIDATES, ids=_name)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 9, 21])
@pytest.mark.parametrize("n_rows", [16, 23])
@pytest.mark.parametrize("parallel", [True, False], ids=["par", "serial"])
def test_matmul_int8_rows(ggml_type, m, n_rows, parallel, monkeypatch):
    """Several activation rows through one pass over W (multi-row tile kernels, full groups plus
    a remainder; 21 rows take Q5_0's decode-once path): each row equals its own one-row result
    bit for bit (a batch or a speculative check gives decode's numbers) and the float64 product on
    llama.cpp-rounded x."""
    from kernels.cpu import matmul
    from kernels.cpu.activations import round_like_llama_cpp
    from kernels.cpu.matmul import VEC_DOT_KIND, Int8Rows

    assert m < 16 or m >= matmul.Q5_0_DECODE_ONCE_ROWS
    n_cols = 2 * GGML_BLOCK[ggml_type][0] * (4 if GGML_BLOCK[ggml_type][0] == 32 else 1)
    qm, w, rng = _setup(ggml_type, n_rows, n_cols, m * 100 + n_rows + ggml_type)
    assert (qm.tiles is not None) == (ggml_type in TILE16_TYPES)
    x = rng.standard_normal((m, n_cols)).astype(np.float32)
    xr = round_like_llama_cpp(x, ggml_type)
    if qm.tiles is None:  # no AVX-512 VNNI: the models layer takes round + gemv instead
        _assert_close(np.stack([qm.gemv(r) for r in xr]), w, xr, GEMV_RTOL, ggml_type)
        return
    monkeypatch.setattr(matmul, "GEMV_PAR_MIN_BYTES", 0 if parallel else 1 << 62)
    kind = VEC_DOT_KIND[ggml_type]
    got = qm.matmul_int8(Int8Rows(x, kind))
    assert got.shape == (m, n_rows) and got.dtype == np.float32
    for i in range(m):
        np.testing.assert_array_equal(got[i], qm.matmul_int8(Int8Rows(x[i:i + 1], kind))[0])
    _assert_close(got, w, xr, GEMV_RTOL)


@pytest.mark.parametrize("n_out", [1, 16, 17, 40])
def test_matmul_int8_first_rows_only(n_out):
    """A draft model scores a truncated vocabulary: the first n_out rows of W, exactly the full
    product's first n_out columns."""
    from kernels.cpu.matmul import Int8Rows

    qm, w, rng = _setup(8, 45, 256, n_out)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    if qm.tiles is None:   # no AVX-512 VNNI: no tile kernels, the models layer slices the full product
        assert 8 not in TILE16_TYPES
        return
    rows = Int8Rows(x, "q8_0")
    part = qm.matmul_int8(rows, n_out)
    assert part.shape == (3, n_out)
    np.testing.assert_array_equal(part, qm.matmul_int8(rows)[:, :n_out])
