"""The wheel carries the CUDA sources, where the kernel loader looks first."""
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
