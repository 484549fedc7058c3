"""gpuflat's native parts: the NumPy C API the C++ may use (an allow-list
that holds from the NumPy floor to the newest), a build that fails warned
once per process and remembered across processes, GPUFLAT_NATIVE=0, and
gf.native_info()."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import gpuflat as gf
from gpuflat._src import native
from gpuflat._src.kernel_loader import kernel_dir

# ---------------------------------------------------------------- the NumPy C API allow-list

# Every spelling of NumPy's C API: its types, macros, accessors, constants and set-up calls.
_NUMPY_NAME = re.compile(r"\b(?:PyArray\w*|PyDataType_\w+|PyDataMem_\w+|PyUFunc\w*|NPY_\w+|npy_\w+|"
                         r"_?import_array\w*|_?import_umath\w*)\b")
# PyArray_DESCR(argument)->field, one level of parentheses inside the argument.
_DESCR_FIELD = re.compile(r"\bPyArray_DESCR\s*\(((?:[^()]|\([^()]*\))*)\)\s*->\s*(\w+)")
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def numpy_names(source: str) -> set[str]:
    """The NumPy C API a C++ source uses (comments left out), a descriptor
    field read through PyArray_DESCR as ``PyArray_DESCR->field``."""
    code = _COMMENT.sub(" ", source)
    fields = {f"PyArray_DESCR->{m.group(2)}" for m in _DESCR_FIELD.finditer(code)}
    return fields | set(_NUMPY_NAME.findall(_DESCR_FIELD.sub(r"(\1)", code)))


def _native_sources():
    host = kernel_dir() / "host"
    return sorted([*host.glob("*.cpp"), *host.glob("*.h")])


def test_the_native_sources_use_only_the_allow_listed_numpy_api():
    used = {name: path.name for path in _native_sources() for name in numpy_names(path.read_text())}
    outside = {name: where for name, where in used.items() if name not in native.NUMPY_API}
    assert outside == {}, f"expected only gpuflat._src.native.NUMPY_API's NumPy names, found {outside}"
    assert sorted(native.NUMPY_API - set(used)) == [], "an allow-listed name no source uses: drop it from the list"


def test_the_scan_finds_what_numpy_2_5_broke():
    # The byte-order macro that NumPy 2.5 turned into a call needing
    # import_array(), a descriptor field outside the list, the item size and
    # the dims limit, each as the host library once used them.
    old = textwrap.dedent("""
        // PyArray_ITEMSIZE in a comment is no use
        if (!PyArray_ISNOTSWAPPED(a)) return -1;
        const int num = PyArray_DESCR(a)->type_num;
        long long n_s[2 * NPY_MAXDIMS];
        const npy_intp* shape = PyArray_DIMS(a);
        w = (long long)PyArray_DESCR((PyArrayObject*)items[i])->byteorder;
    """)
    assert numpy_names(old) == {"PyArray_ISNOTSWAPPED", "PyArray_DESCR->type_num", "NPY_MAXDIMS", "npy_intp",
                                "PyArray_DIMS", "PyArrayObject", "PyArray_DESCR->byteorder"}
    assert numpy_names(old) - native.NUMPY_API == {"PyArray_ISNOTSWAPPED", "PyArray_DESCR->type_num",
                                                   "NPY_MAXDIMS", "npy_intp"}


# ---------------------------------------------------------------- a build that fails

# A C++ compiler that rejects every source (exit 1, one error line) and
# writes each compile's command line to $FAKE_CXX_RUNS; --version prints $FAKE_CXX_VERSION.
_BROKEN_CXX = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "broken-c++ $FAKE_CXX_VERSION"; exit 0; fi
echo "$@" >> "$FAKE_CXX_RUNS"
echo "In file included from main.cpp:1:" >&2
echo "main.cpp:79:10: error: the compiler of this test rejects every source" >&2
exit 1
"""

# One process: the host library asked for many times, NumPy trees' norms on
# the default backend, then what it warned, which backend served and
# native_info's word on the host part, as JSON. argv[1]: a kernels folder to
# build from instead of the package's (a changed source).
_ONE_PROCESS = r"""
import json, sys, warnings
import numpy as np
import gpuflat as gf
from gpuflat._src import native
from gpuflat._src.backends.selection import host_default
if len(sys.argv) > 1:
    from pathlib import Path
    native.kernel_dir = lambda: Path(sys.argv[1])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(3):
        native.host_library()
        norm = float(gf.global_norm({"w": np.array([3.0, 4.0])}))
info = gf.native_info()["host"]
print(json.dumps({"warnings": [str(w.message) for w in caught if "native host library" in str(w.message)],
                  "default": host_default(), "norm": norm, "in_use": info.in_use, "why": info.why}))
"""


def _run(env, *args):
    proc = subprocess.run([sys.executable, "-c", _ONE_PROCESS, *args], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def _runs(path, library="gpuflat-host"):
    """How many times the compiler was run to build ``library``."""
    built = re.compile(rf" -o \S*/{library}-[0-9a-f]+\.")
    return sum(map(bool, map(built.search, path.read_text().splitlines()))) if path.exists() else 0


@pytest.fixture
def broken_compiler(tmp_path):
    cxx = tmp_path / "broken-c++"
    cxx.write_text(_BROKEN_CXX)
    cxx.chmod(0o755)
    runs = tmp_path / "runs"
    env = {**os.environ, "GPUFLAT_CXX": str(cxx), "GPUFLAT_CACHE_DIR": str(tmp_path / "cache"),
           "FAKE_CXX_RUNS": str(runs), "FAKE_CXX_VERSION": "1"}
    env.pop("GPUFLAT_NATIVE", None)
    return env, runs


@pytest.mark.slow
def test_a_failed_build_warns_once_with_its_cause_and_the_slower_path(broken_compiler):
    env, runs = broken_compiler
    out, log = _run(env)
    assert _runs(runs) == 1
    assert len(out["warnings"]) == 1, out
    said = out["warnings"][0]
    assert "main.cpp:79:10: error: the compiler of this test rejects every source" in said
    assert 'NumPy arrays take backend="numpy"' in said and "gpuflat.native_info()" in said
    assert out["default"] == "numpy" and out["norm"] == 5.0
    assert not out["in_use"] and "broken-c++ failed to build gpuflat-host (exit 1)" in out["why"]
    assert re.search(r"gpuflat: could not build gpuflat-host \(\d+\.\d s\): main\.cpp:79:10: error: ", log), log


@pytest.mark.slow
def test_a_failed_build_is_not_tried_again_until_a_source_or_tool_changes(broken_compiler, tmp_path):
    env, runs = broken_compiler
    _run(env)
    assert _runs(runs) == 1
    # Another process (a rank) on the same cache: the remembered failure, warned, not built again.
    out, _ = _run(env)
    assert _runs(runs) == 1
    assert len(out["warnings"]) == 1 and "main.cpp:79:10: error:" in out["warnings"][0]
    assert "remembered from an earlier build with the same sources and tools" in out["why"]
    # A changed source builds again.
    changed = tmp_path / "kernels"
    shutil.copytree(kernel_dir(), changed)
    with open(changed / "host" / "host_backend.cpp", "a") as f:
        f.write("\n// changed\n")
    _run(env, str(changed))
    assert _runs(runs) == 2
    # So does a changed compiler.
    _run({**env, "FAKE_CXX_VERSION": "2"})
    assert _runs(runs) == 3


# ---------------------------------------------------------------- GPUFLAT_NATIVE=0

# NumPy's and (where PyTorch is installed) PyTorch's norms with the native
# parts off, then what native_info says of each part.
_SWITCHED_OFF = r"""
import importlib.util, warnings
import numpy as np
import gpuflat as gf
from gpuflat._src.backends.selection import host_default
warnings.simplefilter("error")  # nothing warns: the parts are off, not broken
print(host_default(), float(gf.global_norm({"w": np.array([3.0, 4.0])})))
if importlib.util.find_spec("torch"):
    import torch, gpuflat.torch
    from gpuflat._src import tensor_facts
    w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([3.0, 4.0])
    assert float(gpuflat.torch.clip_grad_norm_([w], 1.0)) == 5.0 and not tensor_facts.available()
for name, part in sorted(gf.native_info().items()):
    print(name, part.in_use, part.why)
"""
_NO_TORCH = native.NativePart(False, "PyTorch is not installed")


@pytest.mark.slow
def test_gpuflat_native_0_turns_every_native_part_off_without_building(broken_compiler):
    env, runs = broken_compiler
    proc = subprocess.run([sys.executable, "-c", _SWITCHED_OFF], env={**env, "GPUFLAT_NATIVE": "0"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    off = "False disabled by GPUFLAT_NATIVE=0"
    facts = off if _has_torch() else f"False {_NO_TORCH.why}"
    assert proc.stdout.splitlines() == ["numpy 5.0", f"host {off}", f"host optimizer {off}", f"tensor facts {facts}"]
    assert not runs.exists()


# ---------------------------------------------------------------- native_info in this process

def _has_torch():
    return importlib.util.find_spec("torch") is not None


def test_native_info_says_each_part_in_use_was_built_or_loaded_from_the_cache():
    info = gf.native_info()
    assert sorted(info) == ["host", "host optimizer", "tensor facts"]
    if not _has_torch():
        assert info.pop("tensor facts") == _NO_TORCH
    for name, part in info.items():
        assert part.in_use, f"expected the native {name} part to build here, found: {part.why}"
        assert re.match(r"(built in \d+\.\d s|built by another process|loaded from the cache) ", part.why), part.why


def test_native_info_says_pytorch_is_missing_where_it_is(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    assert native.native_info()["tensor facts"] == _NO_TORCH


def test_the_type_numbers_are_the_dtype_tags():
    import ml_dtypes

    nums = list(native._type_numbers())
    assert nums == [np.dtype(t).num for t in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64,
                                              np.complex64, np.complex128)]


def test_a_leaf_set_byte_swapped_in_place_is_refused_on_the_next_call():
    # The C++ reads type numbers only; the walk judges byte order, and a
    # recorded tree's facts see the in-place change, so the tree is walked again.
    tree = {"w": np.array([3.0, 4.0], np.float32)}
    assert float(gf.global_norm(tree, backend="host")) == 5.0
    assert float(gf.global_norm(tree, backend="host")) == 5.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # setting .dtype in place, deprecated in newer NumPy
        tree["w"].dtype = np.dtype(">f4")
    with pytest.raises(gf.UnwalkableError, match=r"leaf \"\['w'\]\".*byte-swapped"):
        gf.global_norm(tree, backend="host")


def test_a_native_order_leaf_with_a_descriptor_of_its_own_is_read():
    # Unpickled arrays and dtypes with metadata have descriptors of their own,
    # not NumPy's shared one: the type number still tells their dtype.
    import pickle

    a = pickle.loads(pickle.dumps(np.array([3.0, 4.0], np.float32)))
    b = np.array([12.0], np.dtype(np.float64, metadata={"unit": "m"}))
    assert a.dtype is not np.dtype(np.float32) and b.dtype is not np.dtype(np.float64)
    assert float(gf.global_norm({"a": a, "b": b}, backend="host")) == 13.0


# ---------------------------------------------------------------- a CuPy record's compare


class _Shaped:
    """An array's stand-in whose every ``shape`` read is counted (CuPy's is a property)."""

    reads = 0

    def __init__(self, shape):
        self._shape = shape

    @property
    def shape(self):
        _Shaped.reads += 1
        return self._shape


@pytest.fixture
def shaped():
    if not native.available():
        pytest.skip("the host library is not built here")
    _Shaped.reads = 0
    return _Shaped


def test_same_shapes_reads_the_shapes_of_the_very_arrays_recorded_only(shaped):
    a, b = shaped((2,)), shaped((1, 3))
    ids, shapes = [id(a), id(b)], [(2,), (1, 3)]
    assert native.same_shapes([a, b], ids, [True], shapes) is True and shaped.reads == 2
    shaped.reads = 0
    # Another object, or the same ones while one of the recorded died: no shape is read.
    assert native.same_shapes([a, shaped((1, 3))], ids, [True], shapes) is False
    assert native.same_shapes([b, a], ids, [True], shapes) is False
    assert native.same_shapes([a, b], ids, [False], shapes) is False
    assert native.same_shapes([a], ids, [True], shapes) is False
    assert shaped.reads == 0


def test_same_shapes_sees_a_shape_set_in_place_and_raises_what_a_read_raises(shaped):
    a, b = shaped((2,)), shaped((1, 3))
    ids, shapes = [id(a), id(b)], [(2,), (1, 3)]
    b._shape = (3, 1)
    assert native.same_shapes([a, b], ids, [True], shapes) is False
    del b._shape
    with pytest.raises(AttributeError, match="_shape"):
        native.same_shapes([a, b], ids, [True], shapes)
