"""Naming the machine a run happened on, for file names and the JSON."""
from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from importlib import metadata


def _slug(text: str) -> str:
    text = re.sub(r"\((r|tm)\)|cpu @.*|processor", " ", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_model(cupy) -> str:
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else name


def name(device: str, cupy=None) -> str:
    """``cpu-<model>-<n>c`` or the GPU's model, e.g. ``nvidia-h200``."""
    if device == "cuda":
        return _slug(gpu_model(cupy))
    return f"cpu-{_slug(cpu_model())}-{os.cpu_count()}c"


def _version(dist: str):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def source_revision():
    """The checkout's commit (``+dirty`` with local changes), or None outside git:
    results are only comparable with the code they measured."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty=+dirty"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return rev.stdout.strip() or None


def describe(device: str, cupy=None) -> dict:
    """What the JSON records about the machine and the library versions."""
    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "revision": source_revision(),
        "versions": {d: _version(d) for d in ("gpuflat", "numpy", "ml_dtypes", "torch", "jax",
                                              "jaxlib", "optax", "cupy-cuda12x", "cupy-cuda13x", "cuda-pathfinder",
                                              "matplotlib")},
    }
    if device == "cuda":
        info["gpu"] = gpu_model(cupy)
    return info
