#!/usr/bin/env bash
# Installs kvchat and everything it needs into ./.venv, idempotently.
#   ./setup.sh          runtime install (torch CPU, llama-cpp-python built from source, kvchat)
#   ./setup.sh --test   also the test extras (pytest, snapshot testing, triton for interpreter-mode kernel tests)
# A stamp file records what was installed, so a second run only checks and returns.
set -euo pipefail
cd "$(dirname "$0")"

want_test=0
[[ "${1:-}" == "--test" ]] && want_test=1

PY="${PYTHON:-python3}"
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
  || { echo "kvchat needs Python >= 3.11 (found $("$PY" --version 2>&1))" >&2; exit 2; }

[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
VPY=.venv/bin/python

# ggml's native build (-march=native) segfaults on the first eval on some AVX-512/AMX CPUs, so we
# turn it off and enable exactly the SIMD extensions this CPU reports. AMX is never enabled.
cmake_flags() {
  local flags; flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
  local args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  has() { [[ " $flags " == *" $1 "* ]]; }
  on() { if has "$1"; then args+=" -D$2=ON"; else args+=" -D$2=OFF"; fi; }
  on avx GGML_AVX; on avx2 GGML_AVX2; on fma GGML_FMA; on f16c GGML_F16C
  on avx512f GGML_AVX512; on avx512_vnni GGML_AVX512_VNNI; on avx512_bf16 GGML_AVX512_BF16
  on avx512vbmi GGML_AVX512_VBMI; on avx_vnni GGML_AVX_VNNI
  echo "$args"
}

stamp_key=$( { cat pyproject.toml; echo "test=$want_test"; cmake_flags; } | sha256sum | cut -c1-16)
stamp=.venv/.kvchat-installed-$stamp_key
if [[ -f $stamp ]]; then exit 0; fi

"$VPY" -m pip install -q --upgrade pip
# torch first and pinned, so that nothing later pulls a CUDA build with several GB of extras.
"$VPY" -m pip install -q "torch==2.13.0"
export CMAKE_ARGS="$(cmake_flags)"
export FORCE_CMAKE=1
if ! "$VPY" -c 'import llama_cpp' 2>/dev/null; then
  echo "Building llama-cpp-python from source (about 4 minutes on 2 cores) with: $CMAKE_ARGS" >&2
fi
extra=""; [[ $want_test == 1 ]] && extra="[test]"
"$VPY" -m pip install -q -e ".$extra"
rm -f .venv/.kvchat-installed-*
touch "$stamp"
