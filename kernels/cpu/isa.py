"""The instruction set the CPU kernels are compiled for, chosen once, before numba compiles anything.

numba's LLVM compiles for the CPU it runs on (AVX-512 on Zen 4/5, AVX2 on Zen 3), and torch's
oneDNN/ATen (the torch engine on the CPU) dispatches on it too. The exact kernels'
integer dot products take the widest unit the choice allows: vpdpbusd (VNNI) where it has one,
vpmaddubsw + vpmaddwd otherwise, and the K-quants' scaled sums one vpdpwssd in place of vpmaddwd +
vpaddd. Both give the same integers (the kernels' operands never saturate vpmaddubsw's int16 pairs,
and the int32 sums wrap alike), so every variant computes the same bits. `KVCHAT_ISA` forces the choice,
so that tests can run every variant a machine can execute and a comparison can pin one:

- `native` (the default): every extension this CPU reports; its variant is the best of the four;
- `avx512amx`: AVX-512 VNNI, and the K-quants' prompts on AMX tiles (Sapphire Rapids and later;
  kernels/cpu/qdot/amx.py), where the CPU has AMX-INT8 and Linux grants the tile state;
- `avx512vnni`: the same without the tiles, and the CPU must have AVX-512 VNNI (vpdpbusd, EVEX);
- `avxvnni`: AVX2 plus AVX-VNNI (vpdpbusd, VEX: Alder Lake and later, Zen 5), nothing of AVX-512;
- `avx2`: this CPU's features less everything beyond x86-64-v3, as an AVX2-only CPU (Zen 3) has.

tests/engine/test_cpu_variants.py runs the exactness suites under every variant this CPU executes.

`KVCHAT_PREFETCH=l1|l2` forces another CPU-dependent choice made here, where decode's software
prefetches put the weights (prefetch_target), and `KVCHAT_BF16=vdpbf16ps|fma` the third, how BF16
weights' prompt tiles multiply (bf16_dot).
"""
from __future__ import annotations

import os
import platform
import sys

from kernels.errors import BadInputError, env_choice

ISA_ENV = "KVCHAT_ISA"
CHOICES = ("native", "avx2", "avxvnni", "avx512vnni", "avx512amx")
# x86-64-v3 is AVX2, FMA, F16C, BMI: what an AVX2-only CPU has. Beyond it: the AVX-512 family, the VEX
# VNNI/IFMA extensions, AMX, and GFNI / VAES / VPCLMULQDQ (which LLVM uses for byte shuffles and
# shifts; Zen 3 has no GFNI, Haswell none of the three)
_BEYOND_AVX2 = ("avx512", "avxvnni", "avxifma", "avxneconvert", "amx", "gfni", "vaes", "vpclmulqdq")


PREFETCH_ENV = "KVCHAT_PREFETCH"
PREFETCH_CHOICES = ("auto", "l1", "l2")


def _vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def prefetch_target() -> str:
    """Where the decode kernels' software prefetches bring the weights they read next: "l1"
    (prefetcht0) or "l2" (prefetcht1). Why it depends on the CPU: decode streams every weight from
    memory once per token, and on the Intel Xeon of the README a stream of prefetcht0 read memory
    about a quarter slower than prefetcht1 (each one holds a line-fill buffer until the line reaches
    L1), while AMD Zen reached 80% of its bandwidth with prefetcht0. "auto": l2 on Intel, l1 elsewhere.
    The results are the same bits either way."""
    choice = env_choice(PREFETCH_ENV, PREFETCH_CHOICES, "auto")
    if choice != "auto":
        return choice
    return "l2" if _vendor() == "GenuineIntel" else "l1"


BF16_ENV = "KVCHAT_BF16"
BF16_CHOICES = ("auto", "vdpbf16ps", "fma")


def bf16_dot(host: dict[str, bool] | None = None) -> str:
    """How BF16 weights' prompt tiles multiply: "vdpbf16ps" (AVX512_BF16: two bf16 products a lane,
    Zen 4/5, Cooper Lake, Sapphire Rapids) or "fma" (one fp32 fma a product, as llama.cpp's AVX2
    build). Both give the same bits (kernels/cpu/qdot/dense.py says why and when), so "auto" takes
    vdpbf16ps wherever the variant is an AVX-512 one and the CPU has it."""
    choice = env_choice(BF16_ENV, BF16_CHOICES, "auto")
    host = _host_features() if host is None else host
    can = variant() in ("avx512vnni", "avx512amx") and bool(host.get("avx512bf16"))
    if choice == "vdpbf16ps" and not can:
        raise BadInputError(f"{BF16_ENV}=vdpbf16ps: the kernels' variant {variant()} on this CPU has no AVX512_BF16")
    return choice if choice != "auto" else ("vdpbf16ps" if can else "fma")


def chosen() -> str:
    return env_choice(ISA_ENV, CHOICES, "native")


def _host_features() -> dict[str, bool]:
    from llvmlite import binding as llvm
    return {k: bool(v) for k, v in llvm.get_host_cpu_features().items()}


def executable(host: dict[str, bool] | None = None, ask_amx: bool = True) -> list[str]:
    """The variants this CPU can run, the widest first. avx512amx needs Linux's grant of the tile
    state too, which is asked for only here, where the CPU has the tiles and `ask_amx`: a process
    that runs another variant keeps its signal frames small."""
    host = _host_features() if host is None else host
    out = []
    if host.get("avx512vnni") and host.get("avx512vl"):
        if ask_amx and host.get("amx-int8") and host.get("amx-tile") and amx_permitted():
            out.append("avx512amx")
        out.append("avx512vnni")
    if host.get("avxvnni"):
        out.append("avxvnni")
    return out + ["avx2"]


_AMX_GRANTED: list[bool] = []


def amx_permitted() -> bool:
    """Ask Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), once per
    process: without it the first tile instruction is a SIGILL. Every thread of the process has it
    once granted. False off x86-64 Linux, or where the kernel (or a VM) refuses."""
    if not _AMX_GRANTED:
        granted = False
        if sys.platform == "linux" and platform.machine() == "x86_64":
            import ctypes
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA (syscall is variadic: longs)
                granted = libc.syscall(ctypes.c_long(158), ctypes.c_long(0x1023), ctypes.c_long(18)) == 0
            except (OSError, AttributeError):
                granted = False
        _AMX_GRANTED.append(granted)
    return _AMX_GRANTED[0]


def check(isa: str, host: dict[str, bool] | None = None) -> None:
    """A variant the CPU cannot execute is refused (one line), not left to crash on an illegal instruction."""
    runs = executable(host, ask_amx=isa in ("native", "avx512amx"))
    if isa != "native" and isa not in runs:
        raise BadInputError(f"{ISA_ENV}={isa}: this CPU cannot run it (it runs {', '.join(runs)})")


def variant() -> str:
    """The kernels' variant in this process: avx512amx, avx512vnni, avxvnni or avx2 (what bench and
    the X-ray show)."""
    isa = chosen()
    return executable()[0] if isa == "native" else isa


def avx2_features(host_features: str, keep: tuple[str, ...] = ()) -> str:
    """LLVM's feature string of this CPU with every extension beyond AVX2 turned off (but `keep`)."""
    out = []
    for f in filter(None, host_features.split(",")):
        name = f[1:]
        out.append(("-" + name) if name.startswith(_BEYOND_AVX2) and name not in keep else f)
    return ",".join(out)


def apply() -> str:
    """Set numba's (and torch's) target from KVCHAT_ISA, unless the caller set theirs explicitly.
    Returns the choice. numba reads its target at import; where it is imported already, its
    configuration is read again (nothing is compiled before the kernels' modules load)."""
    isa = chosen()
    check(isa)
    prefetch_target()                    # a bad KVCHAT_PREFETCH or KVCHAT_BF16 is refused before anything compiles
    bf16_dot()
    if isa in ("avx2", "avxvnni") and "NUMBA_CPU_FEATURES" not in os.environ:
        from llvmlite import binding as llvm
        os.environ["NUMBA_CPU_NAME"] = "x86-64-v3"
        keep = ("avxvnni",) if isa == "avxvnni" else ()
        os.environ["NUMBA_CPU_FEATURES"] = avx2_features(llvm.get_host_cpu_features().flatten(), keep)
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2_VNNI" if isa == "avxvnni" else "AVX2")
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
        if "numba" in sys.modules:
            from numba.core import config
            config.reload_config()
    _cache_folder_of_the_choice()
    return isa


def _cache_folder_of_the_choice() -> None:
    """numba's cache index tells compiled code apart by the CPU's name and features, not by what is
    compiled in from here (the tile kernels or not, the prefetch instruction, the BF16 products), and `native` resolves
    per process (to avx512amx only where Linux grants the tile state): so each resolved choice loads
    and saves its kernels in a subfolder of numba's cache dir of its own, and a process is never
    handed code its choice cannot run."""
    from numba.core import config
    if config.CACHE_DIR:
        config.CACHE_DIR = os.path.join(config.CACHE_DIR, f"{variant()}-{prefetch_target()}-{bf16_dot()}")


def compiled_for() -> tuple[str, str]:
    """(cpu name, feature string) numba's code generator targets in this process."""
    from numba.core.registry import cpu_target
    codegen = cpu_target.target_context.codegen()
    return codegen._get_host_cpu_name(), codegen._tm_features
