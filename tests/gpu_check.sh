#!/usr/bin/env bash
# The checks only a GPU can run, in one go, for a CUDA machine that may have no network and no
# registry model: the GPU tests, then `kvchat bench --device cuda` on shape twins of the registry
# models (tests/shape_twin.py: their real headers, random weights of the same types and shapes).
#
#   here:  for m in qwen2.5-coder-0.5b-instruct gemma-3-270m qwen2.5-coder-1.5b-instruct; do
#            .venv/bin/python -m tests.shape_twin head "$(.venv/bin/kvchat models path $m)" HEADS; done
#   there: bash tests/gpu_check.sh HEADS OUT
#
# The device image of this workplace (torch, Triton, numba, pytest, transformers) lacked these
# pure-Python packages on 2026-11-28; fetched here as Python 3.12 wheels into .whl, carried with
# HEADS, installed there with `pip install --no-index --no-deps --target /tmp/site .whl/*.whl` and
# PYTHONPATH=/tmp/site:$PWD (kvchat's CLI imports all of them: the serve command's parser too):
#   gguf platformdirs textual mdit-py-plugins pytest-asyncio pytest-textual-snapshot syrupy
#   starlette sse-starlette uvicorn sniffio
# and numpy 2.3.5 (`pip download ... numpy==2.3.5`, 16 MB): the image's Triton 3.6 interpreter, which
# runs the CPU half of test_cuda_engine_matches_its_cpu_run, calls int() on one-element arrays
# (program ids), an error from numpy 2.4 on (the image has 2.5.2; kvchat's pin, Triton 3.9, squeezes
# first). The fifth GPU session lost all 18 cases to it; this script says so first where it applies.
# The device call of the fifth GPU session (carry .whl and .gpu, both in .git/info/exclude; 495 s):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
#   PROFILE=qwen2.5-coder-1.5b-instruct ENGINE_N=6 KERNEL_S=100 SWEEP_S=120 BENCH_S=85 BENCH_R=2 \
#     TEST_S=280 timeout 585 bash tests/gpu_check.sh .gpu $OUT
# (a machine's start and the transfers took about 30 s more; a session has 900 s of device time)
#
# HEADS holds what `shape_twin head` wrote (NAME.head and NAME.size). It writes, in this order (the
# quick and the most telling first, as a device lease is short), OUT/pytest-kernels.log,
# OUT/gemv-sweep.txt (tests/gpu_gemv_sweep.py), OUT/pytest.log (the engine's GPU tests, then the
# out-of-memory test's log), OUT/profile.txt (tests/gpu_profile.py, on the twin named $PROFILE) and
# OUT/bench-NAME.txt. The out-of-memory test (numba compiling the native engine on one host core)
# and the engine's tests start first, in the background, the latter niced on ENGINE_N workers
# beside the kernels' tests and the sweep; the profile and the bench wait for the engine's tests.
# Each step's time limit in seconds: KERNEL_S, SWEEP_S, TEST_S, OOM_S, BENCH_S (each twin; BENCH_R
# repeats); a limit of 0 skips the step (a second call that reruns part of it). A pytest step at its
# limit gets SIGINT first, so it still prints why its failed tests failed.
#
# python3 is the Python that has kvchat's dependencies (put a venv's bin first on PATH). Where
# kvchat is not installed (a bare image with torch and Triton), PYTHONPATH must reach this tree and
# its other dependencies; a `kvchat` script is then written beside python3 for the tests.
set -uo pipefail
heads=${1:?heads folder}; out=${2:?output folder}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
if ! command -v kvchat >/dev/null; then
  bin=$(dirname "$(python3 -c 'import sys; print(sys.executable)')")
  printf '#!%s\nimport sys\nfrom app.cli import main\nsys.exit(main())\n' "$bin/python3" > "$bin/kvchat"
  chmod +x "$bin/kvchat"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  lscpu | grep -m1 'Model name'
  python3 -c "import torch, triton, numpy, numba; print('torch', torch.__version__, 'triton', triton.__version__,
                                                       'numpy', numpy.__version__, 'numba', numba.__version__)"
  python3 -c "import triton, numpy
old = lambda v: tuple(int(p) for p in v.split('.')[:2])
if old(triton.__version__) < (3, 9) and old(numpy.__version__) >= (2, 4):
    print('WARNING: Triton', triton.__version__, 'interprets nothing with numpy', numpy.__version__,
          '(int() of one-element arrays): carry numpy 2.3.5 (the header says how)')"; } | tee "$out/env.txt"
twins=()
for head in "$heads"/*.head; do twins+=("/tmp/$(basename "$head" .head).gguf"); done
( for head in "$heads"/*.head; do python3 -m tests.shape_twin fill "$head" "/tmp/$(basename "$head" .head).gguf"; done ) \
  > /tmp/twins.log 2>&1 &
fill=$!
per_test=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 300")   # where pytest-timeout is there
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")                       # where pytest-xdist is there
engine_workers=${workers:+-n ${ENGINE_N:-4}}
# running out of GPU memory falls back to the native engine, which numba compiles on one core from
# an empty cache (over 240 s on the fifth session's machine, 260 s on a Zen 4): it starts first, alone
[ "${OOM_S:-420}" != 0 ] && ( timeout -s INT -k 30 "${OOM_S:-420}" python3 -m pytest -p no:cacheprovider -v -rfE -W ignore \
  tests/engine/test_torch_backend.py::test_out_of_gpu_memory_is_one_line_and_auto_falls_back_to_the_cpu > /tmp/oom.log 2>&1
  echo "pytest exit $?" >> /tmp/oom.log ) &
oom=$!
# the engine's tests, in the background: on the GPU against the native engine, CUDA graphs against
# eager steps, running out of GPU memory, no CUDA, and bench on the GPU
[ "${TEST_S:-300}" != 0 ] && ( nice -n 19 timeout -s INT -k 30 "${TEST_S:-300}" python3 -m pytest -p no:cacheprovider -v -rfE -W ignore $per_test $engine_workers \
  tests/cli/test_bench_gpu.py \
  tests/engine/test_torch_backend.py::test_cuda_engine_matches_its_cpu_run \
  tests/engine/test_torch_backend.py::test_cuda_graph_decode_equals_eager \
  tests/engine/test_torch_backend.py::test_cuda_without_cuda_is_one_clear_line > "$out/pytest.log" 2>&1
  echo "pytest exit $?" >> "$out/pytest.log" ) &
engine=$!
# the kernels' tests first: the Triton kernels compiled for this GPU, against their references
if [ "${KERNEL_S:-150}" != 0 ]; then
  timeout -s INT -k 30 "${KERNEL_S:-150}" python3 -m pytest -p no:cacheprovider -v -rfE -W ignore $per_test $workers \
    tests/kernels/test_cuda_kernels.py > "$out/pytest-kernels.log" 2>&1
  echo "pytest exit $?" >> "$out/pytest-kernels.log"
  grep -E "FAILED|ERROR|passed|failed|pytest exit" "$out/pytest-kernels.log" | tail -30
fi
[ "${SWEEP_S:-150}" != 0 ] && timeout "${SWEEP_S:-150}" python3 -m tests.gpu_gemv_sweep 2>&1 | tee "$out/gemv-sweep.txt"
wait $fill || tail -5 /tmp/twins.log
wait $engine
[ -f "$out/pytest.log" ] && grep -E "FAILED|ERROR|passed|failed|pytest exit" "$out/pytest.log" | tail -30
profile=/tmp/${PROFILE:-qwen2.5-coder-1.5b-instruct}.gguf
[ -f "$profile" ] && timeout 120 python3 -m tests.gpu_profile "$profile" 2>&1 | tee "$out/profile.txt"
for twin in "${twins[@]}"; do
  timeout "${BENCH_S:-150}" kvchat bench -m "$twin" --backend torch --device cuda -r "${BENCH_R:-3}" 2>&1 \
    | grep -v "de-quantizing\|Loading weights" | tee "$out/bench-$(basename "$twin" .gguf).txt"
done
[ "${OOM_S:-420}" != 0 ] && { wait $oom; grep -E "FAILED|ERROR|passed|failed|pytest exit" /tmp/oom.log | tail -5
                             cat /tmp/oom.log >> "$out/pytest.log"; }
