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

# llama.cpp is the oracle the tests compare to bit for bit, and its arithmetic depends on the SIMD
# level it is built for (AVX-512 sums in other orders than AVX2). So it is always built for the same
# level, x86-64-v3 (AVX, AVX2, FMA, F16C): the arithmetic kernels/cpu reproduces, the same on every
# CPU that has AVX2. ggml's native build (-march=native) is off (it segfaults on the first eval on
# some AVX-512/AMX CPUs); AVX-512 and AMX are never enabled.
cmake_flags() {
  local flags; flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
  local args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  has() { [[ " $flags " == *" $1 "* ]]; }
  on() { if has "$1"; then args+=" -D$2=ON"; else args+=" -D$2=OFF"; fi; }
  on avx GGML_AVX; on avx2 GGML_AVX2; on fma GGML_FMA; on f16c GGML_F16C
  args+=" -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX_VNNI=OFF"
  echo "$args"
}

stamp_key=$( { cat pyproject.toml; echo "test=$want_test"; cmake_flags; } | sha256sum | cut -c1-16)
stamp=.venv/.kvchat-installed-$stamp_key
if [[ -f $stamp ]]; then exit 0; fi

"$VPY" -m pip install -q --upgrade pip
# torch first and pinned, so that nothing later pulls a CUDA build with several GB of extras.
"$VPY" -m pip install -q "torch==2.13.0"
# llama-cpp-python builds from source (about 4 minutes on 2 cores). The wheel is kept in the user
# cache dir under a name made of its flags, so a fresh clone on the same machine installs it at once,
# and a wheel built with other flags (pip's own cache keys only the source) is never picked up.
llama_version=$(grep -o '"llama-cpp-python==[^"]*"' pyproject.toml | tr -d '"' | cut -d= -f3)
export CMAKE_ARGS="$(cmake_flags)"
export FORCE_CMAKE=1
wheels="${XDG_CACHE_HOME:-$HOME/.cache}/kvchat/wheels/llama-cpp-python-$llama_version-$(echo "$CMAKE_ARGS" | sha256sum | cut -c1-12)"
if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "Building llama-cpp-python $llama_version from source (about 4 minutes on 2 cores) with: $CMAKE_ARGS" >&2
  "$VPY" -m pip wheel -q --no-deps --no-cache-dir --no-binary llama-cpp-python \
    -w "$wheels.tmp" "llama-cpp-python==$llama_version"
  rm -rf "$wheels"; mv "$wheels.tmp" "$wheels"
fi
"$VPY" -m pip install -q --force-reinstall --no-deps "$wheels"/llama_cpp_python-*.whl
extra=""; [[ $want_test == 1 ]] && extra="[test]"
"$VPY" -m pip install -q -e ".$extra"
rm -f .venv/.kvchat-installed-*
touch "$stamp"
