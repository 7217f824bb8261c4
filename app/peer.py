"""The llama.cpp peer of `kvchat bench`: llama-cpp-python built with every SIMD extension this CPU
reports, run in a process of its own.

Why a second build: setup.sh builds llama.cpp for x86-64-v3 (AVX2), because that build is the
oracle the bit-exact tests compare with. A user's llama.cpp uses the whole CPU (AVX-512, VNNI,
BF16), so speed is measured against such a build: the peer. GGML_NATIVE and AMX stay off (the
native build crashed at its first eval on a Sapphire Rapids machine).

The peer is built once, on first use, into the user cache dir beside the oracle wheel (pip builds
the same llama-cpp-python version from source, a few minutes on 2 cores), and unpacked into a
folder of its own. The two builds never meet in one process: the peer runs in a child whose
`llama_cpp` is the peer's (app/peer_worker.py), and the bench sends it one timing request per round.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from core.paths import cache_dir
from models.errors import BadInputError

ROOT = Path(__file__).resolve().parents[1]
# ggml's CMake options for the extensions /proc/cpuinfo can report (flag -> option)
SIMD_OPTIONS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
                "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI",
                "avx512_bf16": "GGML_AVX512_BF16", "avx_vnni": "GGML_AVX_VNNI"}


def cpuinfo(key: str) -> str | None:
    """The first processor's `key` line of /proc/cpuinfo ("model name", "flags", …), or None."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return None
    m = re.search(rf"^{re.escape(key)}\s*:(.*)$", info, re.M)
    return m.group(1).strip() if m else None


def cpu_flags() -> set[str]:
    return set((cpuinfo("flags") or "").split())


def cmake_args(flags: set[str]) -> str:
    """Every SIMD extension the CPU has, native tuning and AMX off."""
    args = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    args += [f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in SIMD_OPTIONS.items()]
    return " ".join(args)


def llama_cpp_version() -> str:
    m = re.search(r'"llama-cpp-python==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    if not m:
        raise RuntimeError("pyproject.toml pins no llama-cpp-python version")
    return m.group(1)


def peer_dir() -> Path:
    """Where this CPU's peer build lives: named by the version and the build flags."""
    args = cmake_args(cpu_flags())
    key = hashlib.sha256(args.encode()).hexdigest()[:12]
    return cache_dir() / "wheels" / f"llama-cpp-python-{llama_cpp_version()}-peer-{key}"


def ensure_peer(log=print) -> Path:
    """The peer's package folder (holding llama_cpp), built on first use. Returns the folder."""
    folder = peer_dir()
    site = folder / "site"
    if (site / "llama_cpp").is_dir():
        return site
    args = cmake_args(cpu_flags())
    log(f"building the llama.cpp peer (llama-cpp-python {llama_cpp_version()} with {args}); "
        "a few minutes, once")
    wheels = folder.with_name(folder.name + ".tmp")
    env = os.environ | {"CMAKE_ARGS": args, "FORCE_CMAKE": "1"}
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-cache-dir",
                            "--no-binary", "llama-cpp-python", "-w", str(wheels / "wheel"),
                            f"llama-cpp-python=={llama_cpp_version()}"], env=env, capture_output=True, text=True)
    if build.returncode != 0:
        raise BadInputError(f"could not build the llama.cpp peer: {build.stderr.strip().splitlines()[-1:]}")
    unpack = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                             str(wheels / "site"), *map(str, (wheels / "wheel").glob("*.whl"))],
                            capture_output=True, text=True)
    if unpack.returncode != 0:
        raise BadInputError(f"could not unpack the llama.cpp peer: {unpack.stderr.strip().splitlines()[-1:]}")
    if folder.exists():
        import shutil
        shutil.rmtree(folder)
    wheels.rename(folder)
    return site


class PeerEngine:
    """The peer in a child process: the model loaded once, then one timing request per round
    (app.peer_worker): the same prompts and the same timing code as the in-process engines."""

    def __init__(self, model: str, n_ctx: int, threads: int | None, log=print):
        site = ensure_peer(log)
        env = os.environ | {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
        self._proc = subprocess.Popen([sys.executable, "-m", "app.peer_worker"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.info = self._ask({"model": model, "n_ctx": n_ctx, "threads": threads})
        self.device = "cpu"

    def _ask(self, request: dict) -> dict:
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            err = self._proc.stderr.read().strip().splitlines()
            raise RuntimeError(f"the llama.cpp peer stopped: {err[-1] if err else 'no message'}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the llama.cpp peer: {answer['error']}")
        return answer

    def time(self, prompt: list[int], n_gen: int, context: list[int] | None = None) -> tuple[float, float, float]:
        """(prompt_s, ttft_s, decode_s), as app.bench times the in-process engines."""
        a = self._ask({"prompt": prompt, "n_gen": n_gen, "context": context})
        return a["prompt_s"], a["ttft_s"], a["decode_s"]

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
