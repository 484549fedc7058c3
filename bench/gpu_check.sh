#!/usr/bin/env bash
# The one check to run on a machine with an NVIDIA GPU, from the repository
# root: the tests marked `gpu` on CuPy arrays, then the CUDA benchmark.
# It uses the machine's own Python with its CUDA, CuPy, PyTorch and JAX, and
# installs nothing (the GPU machines have no network). A test failure does
# not stop the benchmark; the script still exits non-zero. Each step runs
# under `timeout`, so the whole check ends within about 9 minutes.
#
#   OUT=/some/folder bash bench/gpu_check.sh
#
# Writes into $OUT (default bench/results): environment.txt, gpu-tests.log,
# bench.log, the benchmark's <gpu>.json and .png, nvidia-smi.txt.
#
# Settings (environment):
#   PYTHON           interpreter (default python3)
#   GPU_CHECK_FULL   1: the full benchmark instead of the quick one (default 0;
#                    the full one does not fit the 9 minutes)
#   TESTS_TIMEOUT    seconds for the tests (default 270)
#   BENCH_TIMEOUT    seconds for the benchmark (default 180)
set -uo pipefail

OUT=${OUT:-bench/results}
PY=${PYTHON:-python3}
FULL=${GPU_CHECK_FULL:-0}
TESTS_TIMEOUT=${TESTS_TIMEOUT:-270}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-180}
export PYTHONUNBUFFERED=1  # logs appear as they happen, and survive a kill
# JAX would otherwise take most of the GPU's memory at import, starving CuPy.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# Import gpuflat from this checkout without installing it.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"

# What this machine brings; a missing piece is reported, never installed.
timeout 30 "$PY" - >"$OUT/environment.txt" 2>&1 <<'PYEOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("numpy", "cupy", "torch", "jax", "ml_dtypes", "pytest", "hypothesis", "matplotlib", "tqdm"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as exc:
        print(name, "MISSING:", exc)
from gpuflat import kernel_loader
print("nvrtc", kernel_loader.nvrtc_version(), kernel_loader.nvrtc_candidates()[:3])
PYEOF
cat "$OUT/environment.txt"

# Without a device every gpu test would skip and the run would look green.
if ! timeout 30 "$PY" -c 'import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0' 2>/dev/null; then
    echo "CuPy sees no CUDA device here: nothing to check" >&2
    exit 2
fi
# The emulated backend, which the GPU's bits are compared with, is built with g++.
command -v "${GPUFLAT_CXX:-g++}" >/dev/null ||
    echo "warning: no ${GPUFLAT_CXX:-g++}: the tests comparing with the emulated backend will fail" >&2

# The tests marked gpu (tests/test_gpu.py, and the gpu tests of the other files).
timeout "$TESTS_TIMEOUT" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}

# The benchmark, whatever the tests said: its numbers are wanted either way.
bench_args=(--device cuda --out "$OUT")
[ "$FULL" = 1 ] || bench_args+=(--quick)
timeout "$BENCH_TIMEOUT" "$PY" -m bench "${bench_args[@]}" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}

# What the machine was: GPU, driver, memory in use after the run.
timeout 15 nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed" >&2

echo "gpu tests: exit $tests_rc; benchmark: exit $bench_rc (124: ran out of time)"
[ "$tests_rc" -ne 0 ] && exit 1
exit "$bench_rc"
