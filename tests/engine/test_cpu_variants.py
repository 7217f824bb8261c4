"""The CPU is a parameter of the suite: every CPU-dependent choice, forced each way this machine can run.

The rest of the suite runs with the choices this CPU makes by itself. What a CPU decides:
- numpy's run-time SIMD dispatch (forced with NPY_DISABLE_CPU_FEATURES): an AVX-512 Zen 4/5 takes
  other float32 routines than an AVX2 Zen 3, which is how rope's theta_scale once went one ulp off;
- the instruction set numba compiles the kernels for, the exact kernels' variant (vpdpbusd with
  AVX-512 VNNI or AVX-VNNI, vpmaddubsw + vpmaddwd with AVX2), and torch's oneDNN/ATen dispatch for
  the float path's bf16 prefill GEMM (all forced with KVCHAT_ISA, see kernels/cpu/isa.py).

Each variant below reruns, in a fresh process, the tests that compare with llama.cpp bit for bit
(and within stated tolerances) through the whole model, plus the kernels' libm and op tests, which
also check that the forced choice really took effect. A variant this machine cannot execute
(AVX-512 on a Zen 3) is not listed; the variants it can execute always run.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from kernels.cpu import isa
from tests.conftest import ROOT

SUITES = ["tests/engine/test_tiny_models.py", "tests/kernels/test_matmul.py", "tests/kernels/test_libm.py",
          "tests/kernels/test_ops.py"]


def _numpy_dispatch() -> list[str]:
    """The features numpy dispatches on at run time that this CPU has."""
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    return [f for f in __cpu_dispatch__ if __cpu_features__.get(f)]


def _beyond_avx2(features: list[str]) -> list[str]:
    return [f for f in features if f.startswith(("AVX512", "X86_V4"))]


def variants() -> dict[str, dict[str, str]]:
    from llvmlite import binding as llvm
    dispatch = _numpy_dispatch()
    out = {}
    host_beyond_avx2 = isa.avx2_features(llvm.get_host_cpu_features().flatten()) != \
        llvm.get_host_cpu_features().flatten()
    if host_beyond_avx2 or _beyond_avx2(dispatch):
        # What an AVX2-only CPU (Zen 3) does: numpy's AVX2 routines, AVX2 kernels, AVX2 oneDNN.
        out["avx2"] = {"NPY_DISABLE_CPU_FEATURES": " ".join(_beyond_avx2(dispatch)), "KVCHAT_ISA": "avx2"}
    if dispatch:
        # numpy at its compiled-in baseline (no run-time dispatch at all), the kernels as this CPU picks.
        out["numpy-baseline"] = {"NPY_DISABLE_CPU_FEATURES": " ".join(dispatch), "KVCHAT_ISA": "native"}
    for variant in isa.executable()[1:-1]:
        # the kernel variants between this CPU's own pick (the rest of the suite) and avx2 (above),
        # e.g. AVX-VNNI on a CPU that also has AVX-512 VNNI
        out[variant] = {"KVCHAT_ISA": variant}
    return out


VARIANTS = variants()


def test_this_cpu_has_variants_to_run():
    """Every x86-64 CPU kvchat runs on (AVX2 at least) has numpy dispatch levels above its baseline."""
    assert "numpy-baseline" in VARIANTS, _numpy_dispatch()


@pytest.mark.real_model
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_exactness_suites_pass_under_cpu_variant(name):
    env = os.environ | VARIANTS[name]
    env.pop("NUMBA_CPU_NAME", None), env.pop("NUMBA_CPU_FEATURES", None)   # KVCHAT_ISA decides
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *SUITES],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=2400)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, f"{name} {VARIANTS[name]}:\n{tail}"
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and not re.search(r"skipped|failed|error", summary), summary
