"""The wheel carries the CUDA sources, where the kernel loader looks first;
the CUDA extras bring CuPy and the NVRTC of their major."""
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("hatchling")
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(ROOT)],
        check=True,
    )
    (path,) = out.glob("gpuflat-*.whl")
    return path


def test_wheel_contains_every_kernel_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.relative_to(ROOT / "kernels").as_posix()
                     for p in (ROOT / "kernels").rglob("*") if p.is_file())
    assert sources, "kernels/ holds no sources"
    missing = [s for s in sources if f"gpuflat/kernels/{s}" not in names]
    assert not missing


def test_wheel_contains_the_package_modules(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "gpuflat").rglob("*.py"))
    assert modules and not [m for m in modules if m not in names]


def _extras() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _names(requirements) -> set:
    return {re.split(r"[<>=\[ ]", r, maxsplit=1)[0] for r in requirements}


@pytest.mark.parametrize("major", [12, 13])
def test_each_cuda_extra_brings_cupy_and_the_nvrtc_of_its_major(major):
    from gpuflat._src import kernel_loader

    names = _names(_extras()[f"cuda{major}"])
    assert {f"cupy-cuda{major}x", kernel_loader.NVRTC_WHEELS[major], "cuda-pathfinder"} <= names


def _expanded(extra) -> list:
    """An extra's requirements, the package's own extras it names (``gpuflat[gates]``) expanded."""
    out = []
    for r in _extras()[extra]:
        own = re.fullmatch(r"gpuflat\[(\w+)\]", r)
        out += _expanded(own.group(1)) if own else [r]
    return out


@pytest.mark.parametrize("extra", ["test", "gates"])
def test_the_tests_and_the_gates_install_both_nvrtcs(extra):
    from gpuflat._src import kernel_loader

    requirements = _expanded(extra)
    assert set(kernel_loader.NVRTC_WHEELS.values()) | {"cuda-pathfinder", "nvidia-cuda-nvdisasm"} <= _names(
        requirements)
    # CUDA 13's wheel is named without a suffix: bound it to its major.
    assert "nvidia-cuda-nvrtc>=13,<14" in requirements


def test_every_pinned_gate_dependency_is_in_the_constraints():
    # make test, make bench, CI and the Dockerfile install from constraints.txt:
    # what the kernel gates check must be pinned there, each exactly once.
    from gpuflat._src import kernel_loader

    pins = [line.split("==")[0] for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    assert len(pins) == len(set(pins))
    assert {"torch", "cuda-pathfinder", "nvidia-cuda-nvdisasm", *kernel_loader.NVRTC_WHEELS.values()} <= set(pins)
