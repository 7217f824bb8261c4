"""dequantize must be bit-identical to gguf-py's dequantizer (the spec of every block layout)."""
import numpy as np
import pytest

from kernels.cpu.quant import GGML_BLOCK, SUPPORTED_TYPES, dequantize, repack
from kernels.reference import dequantize_ref, random_quantized

TYPES = sorted(SUPPORTED_TYPES)


def _name(t):
    import gguf
    return gguf.GGMLQuantizationType(t).name


@pytest.mark.parametrize("ggml_type", TYPES, ids=_name)
@pytest.mark.parametrize("n_rows", [1, 7])
def test_dequantize_matches_gguf(ggml_type, n_rows):
    rng = np.random.default_rng(ggml_type * 100 + n_rows)
    blk = GGML_BLOCK[ggml_type][0]
    n_cols = 3 * max(blk, 256)
    raw = random_quantized(ggml_type, n_rows, n_cols, rng)
    got = dequantize(raw, ggml_type, n_cols)
    assert got.dtype == np.float32 and got.shape == (n_rows, n_cols)
    # exact: the kernels keep gguf-py's float operation order (no FMA contraction)
    np.testing.assert_array_equal(got, dequantize_ref(raw, ggml_type, n_cols))


@pytest.mark.parametrize("dtype, ggml_type", [(np.float32, 0), (np.float16, 1)])
def test_dequantize_accepts_typed_reader_arrays(dtype, ggml_type):
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(dtype)
    np.testing.assert_array_equal(dequantize(x, ggml_type, 64), x.astype(np.float32))


def test_f16_specials_roundtrip():
    bits = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x3C00], np.uint16)
    got = dequantize(bits.reshape(1, -1).view(np.uint8), 1, bits.size)
    np.testing.assert_array_equal(got[0], bits.view(np.float16).astype(np.float32))


def test_block_table_matches_gguf():
    import gguf
    for t in TYPES:
        assert GGML_BLOCK[t] == tuple(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t)])


def test_rejects_bad_row_length_and_unsupported_type():
    with pytest.raises(ValueError):
        repack(np.zeros((1, 18), np.uint8), 2, 48)  # Q4_0 row of 48 is not whole blocks
    with pytest.raises(NotImplementedError):
        dequantize(np.zeros((1, 66), np.uint8), 35, 256)  # TQ2_0
