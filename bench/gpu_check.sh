#!/usr/bin/env bash
# The one check to run on a machine with an NVIDIA GPU, from the repository
# root: the kernels compiled for the device, the tests marked `gpu` on CuPy
# arrays, then the quick CUDA benchmark (the workloads of the GPU targets).
# It uses the machine's own Python with its CUDA, CuPy, PyTorch and JAX, and
# installs nothing (the GPU machines have no network). A test failure does
# not stop the benchmark; the script still exits non-zero. Each step runs
# under `timeout`, and the steps' limits add up to under 5 minutes, so a
# rerun fits in a short GPU window; the benchmark writes its JSON after each
# workload, so a step cut short keeps what it measured.
#
#   OUT=/some/folder bash bench/gpu_check.sh
#   bash bench/gpu_check.sh --dry-run    # no GPU: the plumbing, on the CuPy stand-in
#
# Writes into $OUT (default bench/results; $TMPDIR/gpuflat-dry-run for a dry
# run): environment.txt, compile.log, host-builds.log, gpu-tests.log,
# bench.log, the benchmark's <gpu>-quick.json and .png, nvidia-smi.txt.
#
# --dry-run: every Python started here imports bench/dry_run/sitecustomize.py,
# which makes `import cupy` the contract stand-in of tests/cupy_stand_in.py
# (an sm_90 device with CUDA 13 whose kernels the host emulator runs); the
# gpu tests are collected, not run, and the benchmark runs the small trees of
# bench/dry_run/workloads.json under the GPU run's workload names. CI runs it
# (tests/test_bench.py), so the script's first run is not on the device.
#
# Settings (environment):
#   PYTHON           interpreter (default python3)
#   GPU_CHECK_FULL   1: the full benchmark instead of the quick one (default 0;
#                    the full one does not fit the 5 minutes)
#   COMPILE_TIMEOUT  seconds for the kernel build (default 100)
#   TESTS_TIMEOUT    seconds for the tests (default 60)
#   BENCH_TIMEOUT    seconds for the benchmark (default 90)
set -uo pipefail

DRY=0
case "${1:-}" in
    --dry-run) DRY=1 ;;
    "") ;;
    *) echo "usage: bash bench/gpu_check.sh [--dry-run]" >&2; exit 64 ;;
esac

PY=${PYTHON:-python3}
FULL=${GPU_CHECK_FULL:-0}
COMPILE_TIMEOUT=${COMPILE_TIMEOUT:-100}
TESTS_TIMEOUT=${TESTS_TIMEOUT:-60}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-90}
export PYTHONUNBUFFERED=1  # logs appear as they happen, and survive a kill
# JAX would otherwise take most of the GPU's memory at import, starving CuPy.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# Import gpuflat from this checkout without installing it.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
bench_args=(--device cuda)
tests_args=(-m gpu -q -rs -p no:cacheprovider)
if [ "$DRY" = 1 ]; then
    OUT=${OUT:-${TMPDIR:-/tmp}/gpuflat-dry-run}
    export PYTHONPATH="$PWD/bench/dry_run:$PWD/tests:$PYTHONPATH"
    bench_args+=(--workloads-file bench/dry_run/workloads.json)
    tests_args+=(--collect-only)
else
    OUT=${OUT:-bench/results}
fi
bench_args+=(--out "$OUT")
[ "$FULL" = 1 ] || bench_args+=(--quick)
mkdir -p "$OUT"
began=$SECONDS

# What this machine brings; a missing piece is reported, never installed.
timeout 20 "$PY" - >"$OUT/environment.txt" 2>&1 <<'PYEOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("numpy", "cupy", "torch", "jax", "ml_dtypes", "pytest", "hypothesis", "matplotlib", "tqdm",
             "cuda.pathfinder"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as exc:
        print(name, "MISSING:", exc)
from gpuflat import kernel_loader
major = kernel_loader.runtime_major()
print("cuda runtime major", major)
print("nvrtc", kernel_loader.nvrtc_version(major), kernel_loader.nvrtc_path(major))
PYEOF
cat "$OUT/environment.txt"

# Without a device every gpu test would skip and the run would look green.
if ! timeout 15 "$PY" -c 'import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0' 2>/dev/null; then
    echo "CuPy sees no CUDA device here: nothing to check" >&2
    exit 2
fi
# The emulated backend, which the GPU's bits are compared with, is built with g++.
command -v "${GPUFLAT_CXX:-g++}" >/dev/null ||
    echo "warning: no ${GPUFLAT_CXX:-g++}: the tests comparing with the emulated backend will fail" >&2

# The g++ builds (the native host backend, the kernels' emulator the GPU's
# bits are compared with, the PyTorch tensor reader), beside the cubin's
# build: the tests would otherwise spend their minute on them. A library that
# does not build is reported; gpuflat then takes its slower path.
timeout "$COMPILE_TIMEOUT" "$PY" - >"$OUT/host-builds.log" 2>&1 <<'PYEOF' &
import time
began = time.perf_counter()
from gpuflat import emulator, native, tensor_facts
emulator.kernels_library()
print("emulator built")
for name, reason in (("host backend", native.unavailable_reason()), ("tensor facts", tensor_facts.unavailable_reason())):
    print(name, "built" if reason is None else f"NOT BUILT: {reason[:2000]}")
print(f"in {time.perf_counter() - began:.1f} s")
PYEOF
host_pid=$!

# The device's cubin, built once here (NVRTC of CuPy's CUDA major) into the
# kernel cache, which the tests and the benchmark then read.
timeout "$COMPILE_TIMEOUT" "$PY" - 2>&1 <<'PYEOF' | tee "$OUT/compile.log"
import time, cupy
from gpuflat import host_compiler, kernel_loader
began = time.perf_counter()
module, lowered = kernel_loader.cupy_module(cupy.cuda.Device(0))
print(f"{len(lowered)} kernels loaded in {time.perf_counter() - began:.1f} s; cache {host_compiler.cache_root()}")
PYEOF
compile_rc=${PIPESTATUS[0]}
wait "$host_pid"
echo "host builds: exit $?" >>"$OUT/host-builds.log"
cat "$OUT/host-builds.log"

echo "compile step: exit $compile_rc in $((SECONDS - began)) s" | tee -a "$OUT/compile.log"

# The tests marked gpu (tests/test_gpu.py, and the gpu tests of the other files).
step_began=$SECONDS
timeout "$TESTS_TIMEOUT" "$PY" -m pytest "${tests_args[@]}" tests 2>&1 | tee "$OUT/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
echo "tests step: exit $tests_rc in $((SECONDS - step_began)) s" | tee -a "$OUT/gpu-tests.log"

# The benchmark, whatever the tests said: its numbers are wanted either way.
step_began=$SECONDS
timeout "$BENCH_TIMEOUT" "$PY" -m bench "${bench_args[@]}" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "benchmark step: exit $bench_rc in $((SECONDS - step_began)) s" | tee -a "$OUT/bench.log"

# What the machine was: GPU, driver, memory in use after the run.
timeout 10 nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed" >&2

echo "compile: exit $compile_rc; gpu tests: exit $tests_rc; benchmark: exit $bench_rc (124: ran out of time);" \
     "$((SECONDS - began)) s"
[ "$compile_rc" -ne 0 ] && exit 1
[ "$tests_rc" -ne 0 ] && exit 1
exit "$bench_rc"
