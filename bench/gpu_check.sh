#!/usr/bin/env bash
# The one check to run on a machine with an NVIDIA GPU, from the repository
# root: the tests marked `gpu` on CuPy arrays, then the CUDA benchmark (#3, #4).
# A test failure does not stop the benchmark; the script still exits non-zero.
#
#   OUT=/some/folder bash bench/gpu_check.sh
#
# Writes into $OUT (default bench/results): gpu-tests.log, bench.log, the
# benchmark's <gpu>.json and .png, nvidia-smi.txt.
#
# Settings (environment):
#   PYTHON           interpreter to start from (default python3)
#   GPU_CHECK_VENV   auto (default): use $PYTHON as it is when it already imports
#                    cupy, pytest, hypothesis, ml_dtypes, matplotlib and tqdm (a
#                    prepared GPU image, perhaps with no network), else make a venv;
#                    1: always make the venv; 0: never
#   GPU_CHECK_TORCH  1 (default): put torch, the benchmark's CUDA peer, in the venv
#                    (a CUDA build is a few GB); 0: leave it out
#   GPU_CHECK_QUICK  1: the benchmark's reduced set (--quick); default 0
set -uo pipefail

OUT=${OUT:-bench/results}
PYTHON=${PYTHON:-python3}
VENV_MODE=${GPU_CHECK_VENV:-auto}
WITH_TORCH=${GPU_CHECK_TORCH:-1}
QUICK=${GPU_CHECK_QUICK:-0}
export PYTHONUNBUFFERED=1  # logs appear as they happen, and survive a kill
mkdir -p "$OUT"

# The environment: a prepared one if it has everything, else a venv with the
# project's own extras (cuda12 brings CuPy and NVRTC).
deps='import cupy, pytest, hypothesis, ml_dtypes, matplotlib, tqdm'
if [ "$VENV_MODE" = 0 ] || { [ "$VENV_MODE" = auto ] && "$PYTHON" -c "$deps" 2>/dev/null; }; then
    PY=$PYTHON
else
    "$PYTHON" -m venv .venv-gpu || exit 2
    PY=.venv-gpu/bin/python
    "$PY" -m pip install -q --upgrade pip || exit 2
    if [ "$WITH_TORCH" = 1 ]; then
        "$PY" -m pip install -q torch || echo "torch did not install: the benchmark runs without it"
    fi
    "$PY" -m pip install -q -e '.[cuda12,test,bench]' || exit 2
fi
echo "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"

# Without a device every gpu test would skip and the run would look green.
if ! "$PY" -c 'import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0' 2>/dev/null; then
    echo "CuPy sees no CUDA device here: nothing to check" >&2
    exit 2
fi
# The emulated backend, which the GPU's bits are compared with, is built with g++.
command -v "${GPUFLAT_CXX:-g++}" >/dev/null ||
    echo "warning: no ${GPUFLAT_CXX:-g++}: the tests comparing with the emulated backend will fail" >&2

# The tests marked gpu (tests/test_gpu.py, and the gpu tests of the other files).
"$PY" -m pytest -m gpu -q -rs 2>&1 | tee "$OUT/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}

# The benchmark, whatever the tests said: its numbers are wanted either way.
bench_args=(--device cuda --out "$OUT")
[ "$QUICK" = 1 ] && bench_args+=(--quick)
"$PY" -m bench "${bench_args[@]}" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}

# What the machine was: GPU, driver, memory in use after the run.
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed" >&2

echo "gpu tests: exit $tests_rc; benchmark: exit $bench_rc"
[ "$tests_rc" -ne 0 ] && exit 1
exit "$bench_rc"
