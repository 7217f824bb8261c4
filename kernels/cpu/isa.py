"""The instruction set the CPU kernels are compiled for, chosen once, before numba compiles anything.

numba's LLVM compiles for the CPU it runs on (AVX-512 on Zen 4/5, AVX2 on Zen 3), and torch's
oneDNN/ATen (the bf16 prefill GEMM of the float types) dispatches on it too. `KVCHAT_ISA` forces
the choice, so that tests can run every variant a machine can execute and a comparison can pin one:

- `native` (the default): every extension this CPU reports;
- `avx2`: this CPU's features less AVX-512, AVX-VNNI and AMX, as an AVX2-only CPU (x86-64-v3) has.

The exact kernels compute the same bits under either (tests/engine/test_cpu_variants.py runs both).
"""
from __future__ import annotations

import os
import sys

ISA_ENV = "KVCHAT_ISA"
CHOICES = ("native", "avx2")
# x86-64-v3 is AVX2, FMA, F16C, BMI: what an AVX2-only CPU has. Beyond it: the AVX-512 family, the VEX
# VNNI/IFMA extensions, AMX, and GFNI / VAES / VPCLMULQDQ (which LLVM uses for byte shuffles and
# shifts; Zen 3 has no GFNI, Haswell none of the three)
_BEYOND_AVX2 = ("avx512", "avxvnni", "avxifma", "avxneconvert", "amx", "gfni", "vaes", "vpclmulqdq")


def chosen() -> str:
    isa = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if isa not in CHOICES:
        raise ValueError(f"{ISA_ENV}={isa!r} is not one of {', '.join(CHOICES)}")
    return isa


def avx2_features(host_features: str) -> str:
    """LLVM's feature string of this CPU with every extension beyond AVX2 turned off."""
    out = []
    for f in filter(None, host_features.split(",")):
        name = f[1:]
        out.append(("-" + name) if name.startswith(_BEYOND_AVX2) else f)
    return ",".join(out)


def apply() -> str:
    """Set numba's (and torch's) target from KVCHAT_ISA, unless the caller set theirs explicitly.
    Returns the choice. numba reads its target at import; where it is imported already, its
    configuration is read again (nothing is compiled before the kernels' modules load)."""
    isa = chosen()
    if isa == "avx2" and "NUMBA_CPU_FEATURES" not in os.environ:
        from llvmlite import binding as llvm
        os.environ["NUMBA_CPU_NAME"] = "x86-64-v3"
        os.environ["NUMBA_CPU_FEATURES"] = avx2_features(llvm.get_host_cpu_features().flatten())
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
        if "numba" in sys.modules:
            from numba.core import config
            config.reload_config()
    return isa


def compiled_for() -> tuple[str, str]:
    """(cpu name, feature string) numba's code generator targets in this process."""
    from numba.core.registry import cpu_target
    codegen = cpu_target.target_context.codegen()
    return codegen._get_host_cpu_name(), codegen._tm_features
