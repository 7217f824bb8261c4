"""The CPU is a parameter of the suite: every CPU-dependent choice, forced each way this machine can run.

The rest of the suite runs with the choices this CPU makes by itself. What a CPU decides:
- numpy's run-time SIMD dispatch (forced with NPY_DISABLE_CPU_FEATURES): an AVX-512 Zen 4/5 takes
  other float32 routines than an AVX2 Zen 3, which is how rope's theta_scale once went one ulp off;
- the instruction set numba compiles the kernels for, the exact kernels' variant (vpdpbusd with
  AVX-512 VNNI or AVX-VNNI, vpmaddubsw + vpmaddwd with AVX2), and torch's oneDNN/ATen dispatch for
  the float path's bf16 prefill GEMM (all forced with KVCHAT_ISA, see kernels/cpu/isa.py);
- where decode's software prefetches put the weights (KVCHAT_PREFETCH: L2 on Intel, L1 elsewhere),
  which moves no value: its other choice runs the exact matmul suite once;
- how BF16 prompt tiles multiply (KVCHAT_BF16: vdpbf16ps with AVX512_BF16, fma otherwise): where
  this CPU picks vdpbf16ps, the fma tiles run the BF16 tests of the model and matmul suites.

Each variant below reruns, in a fresh process, the tests that compare with llama.cpp bit for bit
(and within stated tolerances) through the whole model, plus the kernels' libm and op tests, which
also check that the forced choice really took effect, and each kernel variant the exact matmuls.
A variant this machine cannot execute (AVX-512 on a Zen 3) is not listed; the variants it can
execute always run.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

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
    if isa.bf16_dot() == "vdpbf16ps":
        out["bf16-fma"] = {"KVCHAT_BF16": "fma"}
    return out


# a variant that changes one type's kernels reruns only that type's tests
SELECT = {"bf16-fma": ["-k", "BF16 or bf16 or forced"]}


VARIANTS = variants()


def test_this_cpu_has_variants_to_run():
    """Every x86-64 CPU kvchat runs on (AVX2 at least) has numpy dispatch levels above its baseline."""
    assert "numpy-baseline" in VARIANTS, _numpy_dispatch()


@pytest.fixture(scope="module")
def variant_runs():
    """Every variant's run, all started at once: each compiles the kernels for its ISA into a cache
    of its own, on one core, so together they take about the time of the longest one. Their
    OpenMP threads (numba's) sleep when idle instead of spinning: spinning, four runs side by side
    on two cores took three times as long as with passive waits."""
    runs = {}
    for name, extra in VARIANTS.items():
        env = os.environ | extra | {"OMP_WAIT_POLICY": "PASSIVE"}
        env.pop("NUMBA_CPU_NAME", None), env.pop("NUMBA_CPU_FEATURES", None)   # KVCHAT_ISA decides
        # numpy-baseline keeps this CPU's kernels, so the exact matmuls there would rerun the main
        # suite's code against a numpy reference computed differently: only the model, libm and ops
        # suites go through numpy in kvchat's own arithmetic
        suites = [s for s in SUITES if name != "numpy-baseline" or s != "tests/kernels/test_matmul.py"]
        runs[name] = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *suites,
                                       *SELECT.get(name, [])],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield runs
    for proc in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.real_model
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_exactness_suites_pass_under_cpu_variant(name, variant_runs):
    stdout, stderr = variant_runs[name].communicate(timeout=2400)
    tail = stdout[-3000:] + stderr[-2000:]
    assert variant_runs[name].returncode == 0, f"{name} {VARIANTS[name]}:\n{tail}"
    summary = stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and not re.search(r"skipped|failed|error", summary), summary


OTHER_PREFETCH = "l1" if isa.prefetch_target() == "l2" else "l2"
PREFETCH_ASM = {"l1": "prefetcht0", "l2": "prefetcht1"}
ASM_CHECK = """
import numpy as np
from kernels import types as T
from kernels.cpu.qdot import Int8Rows, exact_layout, run_arrays
from kernels.cpu.qdot.q4_k import _q4_k_rows
raw = np.random.default_rng(0).integers(0, 256, size=(64, 6 * 144), dtype=np.uint8)
rows = Int8Rows(np.random.default_rng(1).standard_normal((1, 1536)).astype(np.float32), T.TRAITS[T.Q4_K].vec_dot)
# the decode kernel alone: matmul would compile every type's kernels into this fresh cache
_q4_k_rows(exact_layout(raw, T.Q4_K, 64, 1536), rows.xq, rows.dx, rows.bsp, *run_arrays([(0, 1, False)]), np.empty((1, 64), np.float32))
asm = "\\n".join(_q4_k_rows.inspect_asm().values())
print({i: asm.count(i) for i in ("prefetcht0", "prefetcht1")})
"""


@pytest.mark.real_model
def test_the_other_prefetch_target_compiles_in_and_keeps_the_bits():
    """KVCHAT_PREFETCH (kernels/cpu/isa.py prefetch_target) forced to the target this CPU does not
    pick: decode's kernels carry its instruction (in a compile cache of its own), and the exact
    matmuls still equal llama.cpp's bit for bit (a prefetch moves no value)."""
    env = os.environ | {"KVCHAT_PREFETCH": OTHER_PREFETCH}
    with tempfile.TemporaryDirectory() as fresh:            # numba shows no machine code of cached functions
        check = subprocess.run([sys.executable, "-c", ASM_CHECK], cwd=ROOT, env=env | {"NUMBA_CACHE_DIR": fresh},
                               capture_output=True, text=True, timeout=1200)
    assert check.returncode == 0, check.stderr[-2000:]
    counts = eval(check.stdout.strip().splitlines()[-1])   # noqa: S307 - the dict printed just above
    want, other = PREFETCH_ASM[OTHER_PREFETCH], PREFETCH_ASM[isa.prefetch_target()]
    assert counts[want] > 0 and counts[other] == 0, counts
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                           "tests/kernels/test_matmul.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=2400)
    summary = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0 and re.search(r"\d+ passed", summary) and "skipped" not in summary, proc.stdout[-3000:]

