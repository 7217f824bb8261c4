"""Norm, rope and activations against float64 numpy references."""
import numpy as np
import pytest
from numba import njit, prange

from kernels import reference as ref
from kernels.cpu.ops import f32_bits, f32_of_bits, geglu_tanh, ggml_expf, rms_norm, rope, softmax, swiglu
from kernels.reference import geglu_tanh_ref, rms_norm_ref, rope_ref, softmax_ref, swiglu_ref

# float32 kernels vs float64 references: a few ulps per element.
RTOL, ATOL = 1e-5, 1e-5


@pytest.mark.parametrize("shape", [(1, 64), (5, 896), (3, 1152)])
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rms_norm(shape, eps):
    rng = np.random.default_rng(shape[1])
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    w = rng.standard_normal(shape[1]).astype(np.float32)
    np.testing.assert_allclose(rms_norm(x, w, eps), rms_norm_ref(x, w, eps), rtol=RTOL, atol=ATOL)


def test_rms_norm_1d():
    x = np.arange(8, dtype=np.float32)
    w = np.ones(8, np.float32)
    np.testing.assert_allclose(rms_norm(x, w, 1e-6), rms_norm_ref(x[None], w, 1e-6)[0], rtol=RTOL)


@pytest.mark.parametrize("neox", [False, True], ids=["normal", "neox"])
@pytest.mark.parametrize("hd, n_rot", [(64, None), (128, 128), (256, 64), (64, 32)])
@pytest.mark.parametrize("theta", [10000.0, 1000000.0])
def test_rope(neox, hd, n_rot, theta):
    rng = np.random.default_rng(hd)
    T, H = 9, 3
    x = rng.standard_normal((T, H, hd)).astype(np.float32)
    pos = np.array([0, 1, 2, 15, 16, 17, 100, 511, 4000])
    got = rope(x, pos, theta, neox, n_rot)
    np.testing.assert_allclose(got, rope_ref(x, pos, theta, neox, n_rot), rtol=RTOL, atol=ATOL)
    if n_rot is not None and n_rot < hd:
        np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])


def test_rope_table_is_shared_by_q_and_k():
    """The model computes the angles once per pass (rope_table) and hands them to every layer's q
    and k: the table's cos/sin are the angles rope_ref describes, and a table that does not fit
    the positions or n_rot is refused."""
    from kernels.cpu import rope_table
    rng = np.random.default_rng(5)
    pos = np.array([3, 4, 5, 900])
    table = rope_table(pos, 1e6, 64)
    assert table.shape == (4, 2, 32)
    q = rng.standard_normal((4, 14, 64)).astype(np.float32)
    k = rng.standard_normal((4, 2, 64)).astype(np.float32)
    for x in (q, k):
        np.testing.assert_array_equal(rope(x, pos, 1e6, True, 64, table), rope(x, pos, 1e6, True, 64))
        np.testing.assert_allclose(rope(x, pos, 1e6, True, 64, table), rope_ref(x, pos, 1e6, True, 64),
                                   rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError):
        rope(q, pos, 1e6, True, 32, table)
    with pytest.raises(ValueError):
        rope(q[:3], pos[:3], 1e6, True, 64, table)


@pytest.mark.parametrize("neox", [False, True], ids=["normal", "neox"])
@pytest.mark.parametrize("n_rot", [64, 32], ids=["full", "partial"])
@pytest.mark.parametrize("bias, norm", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["plain", "bias", "norm", "bias+norm"])
def test_head_rows_are_the_graphs_steps_in_one_pass(neox, n_rot, bias, norm):
    """The fused layer's q/k input (ops._head_rows: a member of a fused q/k/v output read in place,
    bias, per-head RMSNorm, rope, q's scale, float16) equals those steps one by one with the public
    kernels, bit for bit, for 19 tokens (groups of 8 and a partial one) and one token (the serial
    twin a decode step takes)."""
    from kernels.cpu.activations import round_to_f16
    from kernels.cpu.ops import _head_rows, _head_rows_serial, rope_table
    rng = np.random.default_rng(n_rot + 2 * bias + norm)
    T, H, hd, c0 = 19, 3, 64, 128
    out_all = rng.standard_normal((T, c0 + H * hd + 64)).astype(np.float32) * 4       # q at columns c0..
    b = rng.standard_normal(H * hd).astype(np.float32) if bias else np.empty(0, np.float32)
    w = rng.standard_normal(hd).astype(np.float32) if norm else np.empty(0, np.float32)
    pos = np.arange(300, 300 + T)
    cs = rope_table(pos, 1e6, n_rot)
    x = out_all[:, c0:c0 + H * hd].reshape(T, H, hd).copy()
    if bias:
        x = x + b.reshape(H, hd)
    if norm:
        x = rms_norm(x.reshape(T * H, hd), w, 1e-6).reshape(T, H, hd)
    want = round_to_f16(rope(x, pos, 1e6, neox, n_rot, cs) * np.float32(0.125))
    got = np.empty((T, H, hd), np.float32)
    _head_rows(out_all, c0, b, w, np.float32(1e-6), cs, neox, np.float32(0.125), True, got)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    one = np.empty((1, H, hd), np.float32)
    _head_rows_serial(out_all[5:6], c0, b, w, np.float32(1e-6), cs[5:6], neox, np.float32(0.125), True, one)
    np.testing.assert_array_equal(one[0].view(np.uint32), want[5].view(np.uint32))


def test_rope_position_zero_is_identity():
    x = np.random.default_rng(0).standard_normal((1, 2, 64)).astype(np.float32)
    np.testing.assert_array_equal(rope(x, np.array([0]), 10000.0, True), x)


@pytest.mark.parametrize("fn, ref", [(swiglu, swiglu_ref), (geglu_tanh, geglu_tanh_ref)], ids=["swiglu", "geglu_tanh"])
@pytest.mark.parametrize("shape", [(4864,), (3, 1152), (2, 5, 7)])
def test_glu(fn, ref, shape):
    rng = np.random.default_rng(len(shape))
    g = (rng.standard_normal(shape) * 4).astype(np.float32)
    u = rng.standard_normal(shape).astype(np.float32)
    got = fn(g, u)
    assert got.shape == shape and got.dtype == np.float32
    if fn is geglu_tanh:
        # a float16 table, as ggml's: its float32 gelu (1 + tanh cancels for gate < -4) vs the
        # float64 reference can land on the neighbouring float16 (one f16 ulp, < 1e-3), or differ
        # in the f16 subnormals (|gelu| < 6e-5); elsewhere the two agree to the bit
        want = ref(g, u)
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=ATOL)
        normal = np.abs(want / np.where(u == 0, 1, u)) > 1e-4
        assert (got == want)[normal].mean() > 0.99
    else:
        np.testing.assert_allclose(got, ref(g, u), rtol=RTOL, atol=ATOL)



@pytest.mark.parametrize("serial", [False, True], ids=["parallel", "serial"])
def test_geglu_is_the_float16_table_formula_for_every_pattern(serial):
    """The kernel (its gathered groups of lanes and the scalar rest of each chunk) against ggml's
    formula written in numpy: table[f16(g)] * u, g * u from 10 up, 0 from -10 down. Every float16
    pattern, the values halfway between neighbours (ties to even), ±10 and its neighbours, ±inf
    and NaN, read in place from a fused gate/up buffer at odd column offsets, rows of a length that
    is no multiple of the lanes or of the 4,096-element chunks."""
    from kernels.cpu.ops import _geglu_tanh, _geglu_tanh_serial, gelu_table

    table = gelu_table()
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(invalid="ignore"):
        mid = ((h[:-1].astype(np.float64) + h[1:]) / 2).astype(np.float32)
    edge = np.array([10, -10, np.nextafter(np.float32(10), 0), np.nextafter(np.float32(-10), 0),
                     np.nextafter(np.float32(10), 20), np.nextafter(np.float32(-10), -20), np.inf, -np.inf, np.nan], np.float32)
    g = np.concatenate([h, mid[np.isfinite(mid)], edge])
    n = 4096 * 3 + 29                                   # per row: three whole chunks and a ragged one
    rows = -(-g.size // n)
    g = np.resize(g, rows * n).reshape(rows, n)
    u = np.random.default_rng(3).standard_normal((rows, n)).astype(np.float32)
    fused = np.full((rows, 5 + 2 * n + 3), np.float32(7.0))
    fused[:, 5:5 + n], fused[:, 5 + n + 3:] = g, u
    out = np.empty((rows, n), np.float32)
    (_geglu_tanh_serial if serial else _geglu_tanh)(fused, 5, fused, 5 + n + 3, out, table)
    with np.errstate(invalid="ignore", over="ignore"):
        want = table[g.astype(np.float16).view(np.uint16)] * u
        want = np.where(g >= 10, g * u, want)
        want = np.where(g <= -10, np.float32(0), want)
    same = (out.view(np.uint32) == want.view(np.uint32)) | (np.isnan(out) & np.isnan(want))
    assert same.all(), f"{(~same).sum()} elements differ, first at {np.argwhere(~same)[0]}"

def test_glu_extremes_are_finite():
    g = np.array([-100.0, -20.0, 0.0, 20.0, 100.0], np.float32)
    u = np.ones_like(g)
    np.testing.assert_allclose(swiglu(g, u), swiglu_ref(g, u), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(geglu_tanh(g, u), geglu_tanh_ref(g, u), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("axis", [-1, 0])
def test_softmax(axis):
    x = np.random.default_rng(1).standard_normal((6, 37)).astype(np.float32) * 10
    x[2, 5] = -np.inf
    np.testing.assert_allclose(softmax(x, axis), softmax_ref(x, axis), rtol=RTOL, atol=1e-7)


@pytest.mark.parametrize("threshold", [0, 1 << 62], ids=["parallel", "serial"])
def test_parallel_and_serial_kernels(threshold, monkeypatch):
    from kernels.cpu import ops

    monkeypatch.setattr(ops, "PAR_MIN", threshold)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 256)).astype(np.float32)
    w = rng.standard_normal(256).astype(np.float32)
    np.testing.assert_allclose(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), rtol=RTOL, atol=ATOL)
    r = x.reshape(6, 4, 64)
    pos = np.arange(6) * 7
    np.testing.assert_allclose(rope(r, pos, 1e4, True), rope_ref(r, pos, 1e4, True), rtol=RTOL, atol=ATOL)
    g = (x * 4).reshape(-1)[:5000]  # > one 4096 chunk
    u = x.reshape(-1)[:5000]
    np.testing.assert_allclose(swiglu(g, u), swiglu_ref(g, u), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(geglu_tanh(g, u), geglu_tanh_ref(g, u), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(softmax(x), softmax_ref(x), rtol=RTOL, atol=1e-7)


def test_vexp_accuracy():
    from numba import njit

    from kernels.cpu.ops import FAST, vexp

    @njit(fastmath=FAST, error_model="numpy")
    def apply(x, out):
        for i in range(x.shape[0]):
            out[i] = vexp(x[i])

    x = np.linspace(-87, 88, 100001).astype(np.float32)
    out = np.empty_like(x)
    apply(x, out)
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(out - ref) / ref) < 5e-7  # a few float32 ulps
    apply(np.array([-np.inf, 0.0], np.float32), out[:2])
    assert out[0] < 1e-37 and out[1] == 1.0


@njit(parallel=True, cache=True)
def _expf_bits(start, step, count, out):
    for i in prange(count):
        out[i] = f32_bits(ggml_expf(f32_of_bits(np.int32(np.uint32(start + i * step)))))


def test_ggml_expf_matches_the_model_on_every_exponent():
    """ggml_expf (compiled, branch-free, with the s1 = s2 = 1 stand-ins for the lanes that do not
    scale) against the numpy model of ggml_v_expf, bit for bit, on 2^24 float32 patterns spread
    over every exponent and sign (every 256th pattern, plus every pattern within about 0.5 of
    x = 126.5 ln 2 and 192.5 ln 2, either sign, where the scaling starts); NaN gives NaN (numpy's
    payloads differ from the compiled code's)."""
    stride = np.arange(0, 1 << 32, 256, dtype=np.uint64).astype(np.uint32)
    edges = np.concatenate([np.arange(lo, lo + (1 << 17), dtype=np.uint32) for v in (87.68, 133.43, -87.68, -133.43)
                            for lo in [np.array([v], np.float32).view(np.uint32)[0] - np.uint32(1 << 16)]])
    for bits in (stride, edges):
        got = np.empty(bits.size, np.int32)
        if bits is stride:
            _expf_bits(0, 256, bits.size, got)
        else:
            for k in range(0, bits.size, 1 << 16):
                _expf_bits(int(bits[k]), 1, 1 << 16, got[k:k + (1 << 16)])
        want = ref.ggml_expf_ref(bits.view(np.float32)).view(np.int32)
        nan = np.isnan(want.view(np.float32))
        assert np.isnan(got.view(np.float32)[nan]).all()
        np.testing.assert_array_equal(got[~nan], want[~nan])
        assert (~nan).sum() > 0.99 * bits.size
