"""The forward pass's float constants are the C library's, bit for bit, whatever numpy dispatches.

llama.cpp computes them with glibc's powf/sqrtf (ggml_rope_cache_init, the graphs' kq_scale).
numpy's float32 ufuncs are SIMD routines picked by the CPU (an AVX-512 powf on Zen 4/5 is one ulp
off glibc's for theta = 1e4), so these tests call glibc here through ctypes, independently of
kernels.cpu.libm, and tests/engine/test_cpu_variants.py runs them again under every numpy dispatch
level this CPU has (NPY_DISABLE_CPU_FEATURES).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

import numpy as np
import pytest

from kernels.cpu import isa
from kernels.cpu.libm import inv_sqrtf, rope_theta_scale
from kernels.errors import BadInputError
from kernels.cpu.ops import rope_table
from models.transformer import DecoderConfig

LIBM = ctypes.CDLL(ctypes.util.find_library("m"))
for _name, _n in (("powf", 2), ("sqrtf", 1), ("cosf", 1), ("sinf", 1)):
    getattr(LIBM, _name).restype = ctypes.c_float
    getattr(LIBM, _name).argtypes = [ctypes.c_float] * _n

# Llama 2 / Gemma 3 local layers (1e4), Llama 3 (5e5), Qwen 2.5 / Gemma 3 global (1e6), others seen in GGUFs
BASES = [1e4, 5e5, 1e6, 1e5, 2.5e5, 8e6, 75000.0, 1e7, 10000.5]
N_ROTS = [32, 64, 80, 96, 128, 160, 256]


def bits(x) -> int:
    return int(np.float32(x).view(np.uint32))


@pytest.mark.parametrize("n_rot", N_ROTS)
def test_rope_theta_scale_is_glibc_powf(n_rot):
    for base in BASES:
        want = LIBM.powf(float(np.float32(base)), float(np.float32(-2.0) / np.float32(n_rot)))
        assert bits(rope_theta_scale(base, n_rot)) == bits(want), (base, n_rot)


@pytest.mark.parametrize("n_rot", [64, 128])
@pytest.mark.parametrize("base", [1e4, 5e5, 1e6])
def test_rope_table_angles_are_ggml_s(base, n_rot):
    """ggml: theta = pos, then theta *= theta_scale pair by pair (float32), cos/sin by libm."""
    positions = np.array([0, 1, 7, 513, 4095])
    table = rope_table(positions, base, n_rot)                          # (T, 2, n_rot/2)
    scale = np.float32(LIBM.powf(float(np.float32(base)), float(np.float32(-2.0) / np.float32(n_rot))))
    for t, pos in enumerate(positions):
        theta = np.float32(pos)
        for i in range(n_rot // 2):
            assert bits(table[t, 0, i]) == bits(LIBM.cosf(float(theta))), (pos, i)
            assert bits(table[t, 1, i]) == bits(LIBM.sinf(float(theta))), (pos, i)
            theta = np.float32(theta * scale)


def test_rope_table_with_frequency_factors_and_scale_is_ggml_s():
    """ggml_rope_ext: pair i turns by freq_scale * (theta / factor_i), each a float32 operation."""
    positions = np.array([0, 3, 511, 8191])
    factors = np.geomspace(1.0, 8.0, 32).astype(np.float32)
    table = rope_table(positions, 5e5, 64, factors, 0.25)
    scale = np.float32(LIBM.powf(float(np.float32(5e5)), float(np.float32(-2.0) / np.float32(64))))
    for t, pos in enumerate(positions):
        theta = np.float32(pos)
        for i in range(32):
            angle = np.float32(np.float32(0.25) * np.float32(theta / factors[i]))
            assert bits(table[t, 0, i]) == bits(LIBM.cosf(float(angle))), (pos, i)
            assert bits(table[t, 1, i]) == bits(LIBM.sinf(float(angle))), (pos, i)
            theta = np.float32(theta * scale)


def test_attention_scale_is_ggml_float_arithmetic():
    """llama.cpp: kq_scale = 1.0f/sqrtf(float(n_embd_head)), two float32 roundings; for head dims
    such as 96 (Phi-3) that is not float32(1/sqrt(96)) computed in double."""
    differs = 0
    for hd in range(1, 513):
        want = np.float32(np.float32(1.0) / np.float32(LIBM.sqrtf(float(hd))))
        assert bits(inv_sqrtf(hd)) == bits(want), hd
        differs += bits(want) != bits(np.float32(1.0 / np.sqrt(np.float64(hd))))
    assert differs > 0    # the double-precision formula really is a different number for some dims
    cfg = DecoderConfig(n_vocab=32, n_embd=96 * 4, n_layer=1, n_head=4, n_head_kv=4, head_dim=96, n_ff=64,
                        n_ctx_train=64, norm_eps=1e-6, rope_base=1e4, n_rot=96, rope_neox=False)
    assert bits(cfg.attn_scale) == bits(np.float32(1.0) / np.float32(LIBM.sqrtf(96.0)))


def test_forced_cpu_choices_are_in_force():
    """Under tests/engine/test_cpu_variants.py the variables it sets must really take effect."""
    from numpy._core._multiarray_umath import __cpu_features__
    for feature in os.environ.get("NPY_DISABLE_CPU_FEATURES", "").split():
        assert not __cpu_features__.get(feature), f"numpy still dispatches {feature}"
    name, features = isa.compiled_for()
    if isa.chosen() in ("avx2", "avxvnni"):      # x86-64-v3, plus AVX-VNNI's vpdpbusd for the second
        assert name == "x86-64-v3" and not any(f"+{f}" in features for f in ("avx512", "amx", "gfni", "vaes")), \
            (name, features)
        assert ("+avxvnni" in features) == (isa.chosen() == "avxvnni"), features
    else:
        assert name != "x86-64-v3"
    from kernels.cpu import simd
    assert simd.BF16DP == (isa.bf16_dot() == "vdpbf16ps")
    if os.environ.get(isa.BF16_ENV, "").strip().lower() == "fma":
        assert not simd.BF16DP
    # and the kernels load and save in the compile cache of the choice this process resolved
    from numba.core import config
    assert os.path.basename(config.CACHE_DIR) == f"{isa.variant()}-{isa.prefetch_target()}-{isa.bf16_dot()}", config.CACHE_DIR


def test_isa_variants_follow_the_cpu_flags():
    """Which kernel variants a CPU executes, the widest first, and a refusal for one it cannot."""
    zen3 = {"avx2": True, "fma": True}
    zen4 = {**zen3, "avx512f": True, "avx512vl": True, "avx512vnni": True}
    zen5 = {**zen4, "avxvnni": True}
    alder_lake = {**zen3, "avxvnni": True}
    sapphire_rapids = {**zen5, "amx-int8": True, "amx-tile": True}
    assert isa.executable(zen3) == ["avx2"]
    # AMX tiles where Linux grants their state to this process (it does on an AMX machine)
    assert isa.executable(sapphire_rapids) == ["avx512amx"] * isa.amx_permitted() + ["avx512vnni", "avxvnni", "avx2"]
    assert isa.executable(sapphire_rapids, ask_amx=False) == ["avx512vnni", "avxvnni", "avx2"]
    assert isa.executable(zen4) == ["avx512vnni", "avx2"]
    assert isa.executable(zen5) == ["avx512vnni", "avxvnni", "avx2"]
    assert isa.executable(alder_lake) == ["avxvnni", "avx2"]
    isa.check("avx512vnni", zen4)
    isa.check("native", zen3)
    for choice, host in (("avxvnni", zen4), ("avx512vnni", alder_lake), ("avx512vnni", zen3), ("avx512amx", zen5)):
        with pytest.raises(BadInputError, match="this CPU cannot run it"):
            isa.check(choice, host)
    assert isa.avx2_features("+avx2,+gfni,+avx512f,+avxvnni", keep=("avxvnni",)) == "+avx2,-gfni,-avx512f,+avxvnni"


def test_bf16_products_follow_the_cpu_flags(monkeypatch):
    """vdpbf16ps where this process's kernels are an AVX-512 variant and the CPU has AVX512_BF16,
    fma otherwise, and a refusal where it is forced on a CPU without it."""
    monkeypatch.delenv(isa.BF16_ENV, raising=False)
    wide = isa.variant() in ("avx512vnni", "avx512amx")
    assert isa.bf16_dot({"avx512bf16": True}) == ("vdpbf16ps" if wide else "fma")
    assert isa.bf16_dot({"avx512bf16": False}) == "fma"
    monkeypatch.setenv(isa.BF16_ENV, "fma")
    assert isa.bf16_dot({"avx512bf16": True}) == "fma"
    monkeypatch.setenv(isa.BF16_ENV, "vdpbf16ps")
    with pytest.raises(BadInputError, match="has no AVX512_BF16"):
        isa.bf16_dot({"avx512bf16": False})
