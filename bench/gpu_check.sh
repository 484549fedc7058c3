#!/usr/bin/env bash
# The one check to run on a machine with an NVIDIA GPU, from the repository
# root: the kernels compiled for the device, the tests marked `gpu` on CuPy
# arrays, then the quick CUDA benchmark (the workloads of the GPU targets).
# It uses the machine's own Python with its CUDA, CuPy, PyTorch and JAX, and
# installs nothing (the GPU machines have no network). A test failure does
# not stop the benchmark; the script still exits non-zero. Each step runs
# under a limit: environment 20 s (with the check that CuPy sees a device),
# compile COMPILE_TIMEOUT, tests TESTS_TIMEOUT, benchmark BENCH_TIMEOUT,
# nvidia-smi 5 s: 295 s by default, under 5 minutes, so a rerun fits in a
# short GPU window. On an H200's 16-core host: environment 11 s, the cubin
# 30 s and the g++ builds 5-16 s side by side, the gpu tests 53 s alone. It
# prints a line as each step starts and ends and as each build ends, and each
# step's log ends with its exit status and wall time. A build that outlasts
# the compile step goes on in the background and the later steps wait for it
# (see the builds below); one still running when the script ends is stopped
# and reported, and fails the run as a build that failed does. The
# benchmark starts nothing past BENCH_TIMEOUT - BENCH_MARGIN seconds (its
# --time-limit: what is left is named as not run), leaving the margin to
# finish the case under way, write its results and exit; each peer row has
# its own time budget. It writes its JSON after each workload, so a step cut
# short keeps what it measured.
#
#   OUT=/some/folder bash bench/gpu_check.sh
#   bash bench/gpu_check.sh --dry-run    # no GPU: the plumbing, on the CuPy stand-in
#
# Not one of its steps: the device-time benchmark (bench/graphs.py), each
# operation's CUDA-graph replay beside its eager wall clock, which does not
# fit the 5 minutes. Whenever a GPU is at hand, run it after this script:
#
#   bash bench/gpu_check.sh; PYTHONPATH=$PWD python3 -m bench --device-time \
#       --workloads gpt2-small,tiny-10k --quick --time-limit 480
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
#                    the full one does not fit the 5 minutes: its time limit cuts it)
#   COMPILE_TIMEOUT  seconds the compile step waits for the builds (default 60)
#   TESTS_TIMEOUT    seconds for the tests (default 100)
#   BENCH_TIMEOUT    seconds for the benchmark (default 110)
#   BENCH_MARGIN     seconds of the benchmark's limit after its --time-limit (default 15)
set -uo pipefail

DRY=0
case "${1:-}" in
    --dry-run) DRY=1 ;;
    "") ;;
    *) echo "usage: bash bench/gpu_check.sh [--dry-run]" >&2; exit 64 ;;
esac

PY=${PYTHON:-python3}
FULL=${GPU_CHECK_FULL:-0}
COMPILE_TIMEOUT=${COMPILE_TIMEOUT:-60}
TESTS_TIMEOUT=${TESTS_TIMEOUT:-100}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-110}
BENCH_MARGIN=${BENCH_MARGIN:-15}
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
bench_args+=(--out "$OUT" --time-limit "$((BENCH_TIMEOUT - BENCH_MARGIN))")
[ "$FULL" = 1 ] || bench_args+=(--quick)
mkdir -p "$OUT"
began=$SECONDS

# One line on stdout: the seconds since the start, and what happens.
progress() {
    echo "gpu_check [$((SECONDS - began)) s]: $*"
}

# What this machine brings; a missing piece is reported, never installed.
# Without a device every gpu test would skip and the run would look green:
# exit 3 says CuPy sees none.
progress "environment step (at most 20 s)"
timeout 20 "$PY" - >"$OUT/environment.txt" 2>&1 <<'PYEOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("numpy", "cupy", "torch", "jax", "ml_dtypes", "pytest", "hypothesis", "matplotlib", "tqdm",
             "cuda.pathfinder"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as exc:
        print(name, "MISSING:", exc)
from gpuflat._src import kernel_loader
major = kernel_loader.runtime_major()
print("cuda runtime major", major)
print("nvrtc", kernel_loader.nvrtc_version(major), kernel_loader.nvrtc_path(major))
import cupy
devices = cupy.cuda.runtime.getDeviceCount()
print("cuda devices", devices)
sys.exit(0 if devices > 0 else 3)
PYEOF
environment_rc=$?
echo "environment step: exit $environment_rc in $((SECONDS - began)) s" >>"$OUT/environment.txt"
cat "$OUT/environment.txt"
if [ "$environment_rc" = 3 ]; then
    echo "CuPy sees no CUDA device here: nothing to check" >&2
    exit 2
fi
# The emulated backend, which the GPU's bits are compared with, is built with g++.
command -v "${GPUFLAT_CXX:-g++}" >/dev/null ||
    echo "warning: no ${GPUFLAT_CXX:-g++}: the tests comparing with the emulated backend will fail" >&2

# The builds: the device's cubin (NVRTC of CuPy's CUDA major) and the g++
# libraries (the native host backend, the kernels' emulator the GPU's bits
# are compared with, the PyTorch tensor reader), each in a process of its
# own started now, so each takes its build lock at once and the builds run
# side by side. The compile step waits for them for at most its limit and
# kills none: a build still running then goes on, and the tests and the
# benchmark, which need it, wait on its lock and load it instead of starting
# over (a build killed by a step's timeout would leave nothing in the cache,
# and every later step would build it again and run out of time too). Each
# build stops at the latest when the script's time is up, and is reported
# then. A g++ library that does not build is reported; gpuflat then takes
# its slower path.
build_py='
import sys, time
began, what = time.perf_counter(), sys.argv[1]
if what == "cubin":
    import cupy
    from gpuflat._src import host_compiler, kernel_loader
    module, lowered = kernel_loader.cupy_module(cupy.cuda.Device(0))
    line = f"{len(lowered)} kernels loaded in {time.perf_counter() - began:.1f} s; cache {host_compiler.cache_root()}"
elif what == "emulator":
    from gpuflat._src import emulator
    emulator.kernels_library()
    line = f"emulator built in {time.perf_counter() - began:.1f} s"
else:
    from gpuflat._src import native, tensor_facts
    reason = {"host backend": native, "tensor facts": tensor_facts}[what].unavailable_reason()
    status = "built" if reason is None else "NOT BUILT: " + reason[:2000]
    line = f"{what} {status} in {time.perf_counter() - began:.1f} s"
# One write per line: the g++ builds share a log, unbuffered, and print
# writes each argument apart, so the lines of two builds could interleave.
sys.stdout.write(line + "\n")
'
builds=("cubin" "emulator" "host backend" "tensor facts")
declare -A build_pid build_rc build_s build_log reported
: >"$OUT/compile.log"
: >"$OUT/host-builds.log"
builds_began=$SECONDS
for name in "${builds[@]}"; do
    if [ "$name" = cubin ]; then build_log[$name]=$OUT/compile.log; else build_log[$name]=$OUT/host-builds.log; fi
    # `timeout` holds each build and the compilers it starts in a process
    # group of its own, which stopping the build ends whole; its limit, the
    # rest of the script's, ends it even if the script itself is killed.
    timeout "$((COMPILE_TIMEOUT + TESTS_TIMEOUT + BENCH_TIMEOUT))" "$PY" -c "$build_py" "$name" \
        >>"${build_log[$name]}" 2>&1 &
    build_pid[$name]=$!
done

# Collects the builds that have ended (exit status; seconds since they
# started, as of the collection), waiting until all have or until $SECONDS
# reaches $1.
wait_builds() {
    local name running
    while :; do
        running=0
        for name in "${builds[@]}"; do
            [ -n "${build_rc[$name]:-}" ] && continue
            if kill -0 "${build_pid[$name]}" 2>/dev/null; then
                running=1
            else
                wait "${build_pid[$name]}"
                build_rc[$name]=$?
                build_s[$name]=$((SECONDS - builds_began))
                progress "$name build ended: exit ${build_rc[$name]}"
            fi
        done
        if [ "$running" = 0 ] || [ "$SECONDS" -ge "$1" ]; then
            return
        fi
        sleep 0.5
    done
}

# Writes a line into its log for each build that has ended and was not
# reported yet ("exit 0 in 40 s"; $1 and $2 replace "in" and add to the
# line), and lists those still running in `late`.
report_builds() {
    local name
    late=""
    for name in "${builds[@]}"; do
        if [ -z "${build_rc[$name]:-}" ]; then
            late+="${late:+, }$name"
        elif [ -z "${reported[$name]:-}" ]; then
            echo "$name build: exit ${build_rc[$name]} $1 ${build_s[$name]} s$2" | tee -a "${build_log[$name]}"
            reported[$name]=1
        fi
    done
}

# Whatever ends the script, no build outlives it.
stop_builds() {
    local name
    for name in "${builds[@]}"; do
        if [ -z "${build_rc[$name]:-}" ]; then
            kill -TERM "${build_pid[$name]}" 2>/dev/null
            wait "${build_pid[$name]}"
            build_rc[$name]=$?
        fi
    done
}
trap stop_builds EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The compile step: the builds' wait, at most COMPILE_TIMEOUT seconds.
step_began=$SECONDS
progress "compile step: waiting at most $COMPILE_TIMEOUT s for the builds (${builds[*]})"
wait_builds "$((step_began + COMPILE_TIMEOUT))"
cat "$OUT/compile.log" "$OUT/host-builds.log"
report_builds in ""
compile_rc=0
for name in "${builds[@]}"; do
    [ "$compile_rc" = 0 ] && compile_rc=${build_rc[$name]:-124}
done
[ -n "$late" ] && late=" (out of time; still building: $late; the steps after wait for them)"
echo "compile step: exit $compile_rc in $((SECONDS - step_began)) s$late" | tee -a "$OUT/compile.log"

# The tests marked gpu (tests/test_gpu.py, and the gpu tests of the other files).
step_began=$SECONDS
progress "tests step (at most $TESTS_TIMEOUT s)"
timeout "$TESTS_TIMEOUT" "$PY" -m pytest "${tests_args[@]}" tests 2>&1 | tee "$OUT/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
echo "tests step: exit $tests_rc in $((SECONDS - step_began)) s" | tee -a "$OUT/gpu-tests.log"
wait_builds "$SECONDS"  # builds that ended during the tests step are timed to its end

# The benchmark, whatever the tests said: its numbers are wanted either way.
step_began=$SECONDS
progress "benchmark step (at most $BENCH_TIMEOUT s; nothing started past $((BENCH_TIMEOUT - BENCH_MARGIN)) s)"
timeout "$BENCH_TIMEOUT" "$PY" -m bench "${bench_args[@]}" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "benchmark step: exit $bench_rc in $((SECONDS - step_began)) s" | tee -a "$OUT/bench.log"

# What the machine was: GPU, driver, memory in use after the run.
step_began=$SECONDS
progress "nvidia-smi step (at most 5 s)"
timeout 5 nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
smi_rc=$?
[ "$smi_rc" = 0 ] || echo "nvidia-smi failed" >&2
echo "nvidia-smi step: exit $smi_rc in $((SECONDS - step_began)) s" >>"$OUT/nvidia-smi.txt"

# The builds that ended after the compile step (timed to the step they
# ended in), and those that never did.
wait_builds "$SECONDS"
report_builds by ", after the compile step"
builds_rc=0 builds_said="all built"
for name in "${builds[@]}"; do
    if [ -z "${build_rc[$name]:-}" ]; then
        echo "$name build: did not finish in the script's time; stopped after $((SECONDS - builds_began)) s" |
            tee -a "${build_log[$name]}"
        builds_rc=1 builds_said="NOT all built"
    elif [ "${build_rc[$name]}" != 0 ]; then
        builds_rc=1 builds_said="NOT all built"
    fi
done
stop_builds

echo "compile: exit $compile_rc; gpu tests: exit $tests_rc; benchmark: exit $bench_rc (124: ran out of time);" \
     "builds: $builds_said;" \
     "$((SECONDS - began)) s"
[ "$builds_rc" -ne 0 ] && exit 1
[ "$tests_rc" -ne 0 ] && exit 1
exit "$bench_rc"
