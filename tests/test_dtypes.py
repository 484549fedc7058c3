"""gpuflat._src.dtypes: every floating array is handled or refused by name, never dropped."""
from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import gpuflat as gf
from gpuflat._src.dtypes import TAGS, unsupported_float

UNSUPPORTED = [np.dtype(">f4"), np.dtype(">f8"), np.dtype(">c16"), np.dtype(">f2"), np.dtype(np.longdouble),
               np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)]


@pytest.mark.parametrize("dtype", UNSUPPORTED, ids=str)
def test_unsupported_floating_leaves_are_refused_by_path(dtype):
    tree = {"ok": np.ones(3), "bad": {"w": np.ones(2).astype(dtype)}}
    for call in (gf.global_norm, gf.trainables, gf.plan, lambda t: gf.clip_grad_norm_(t, 1.0)):
        with pytest.raises(gf.UnwalkableError, match=r"leaf \"\['bad'\]\['w'\]\": expected a native-byte-order"):
            call(tree)
    np.testing.assert_array_equal(tree["ok"], np.ones(3))  # the clip changed nothing


@pytest.mark.parametrize("dtype", [np.int8, np.int64, np.uint16, bool, ml_dtypes.int4, np.dtype("<U3")], ids=str)
def test_non_floating_arrays_stay_statics(dtype):
    tree = {"w": np.array([3.0, 4.0]), "n": np.zeros(2, dtype)}
    assert unsupported_float(np.dtype(dtype)) is None
    assert float(gf.global_norm(tree)) == 5.0
    assert gf.trainables(tree) == [tree["w"]]


def test_every_table_dtype_is_supported():
    assert all(unsupported_float(dt) is None for dt in TAGS)
    assert sorted(str(dt) for dt in TAGS) == sorted(
        ["float16", "bfloat16", "float32", "float64", "complex64", "complex128"])


def _fresh(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_import_gpuflat_leaves_ml_dtypes_for_later():
    # ml_dtypes' import is most of a second: gpuflat takes it when bfloat16 is
    # first needed, not when it is imported.
    assert _fresh("import sys, gpuflat; print('ml_dtypes' in sys.modules)") == "False"


def test_bfloat16_made_after_import_is_admitted_at_first_sight():
    code = ("import numpy as np, gpuflat as gf, ml_dtypes\n"
            "from gpuflat._src import dtypes\n"
            "x = np.array([3, 4], ml_dtypes.bfloat16)\n"
            "assert np.dtype(ml_dtypes.bfloat16) not in dtypes.TAGS\n"
            "print(float(gf.global_norm({'w': x}, backend='host')), dtypes.TAGS[x.dtype], dtypes.c_name(x.dtype))")
    assert _fresh(code) == "5.0 1 bf16"


def test_the_pytorch_dtypes_are_the_tables():
    torch = pytest.importorskip("torch")
    from gpuflat._src import dtypes, layout, param_rows, tensor_table

    for row in layout.DTYPES:
        assert dtypes.torch_dtype(row.name) is dtypes.torch_dtype(row.c_name) is getattr(torch, row.name)
        assert dtypes.torch_dtype(row.name).itemsize == row.itemsize
    with pytest.raises(ValueError, match="got 'int8'"):
        dtypes.torch_dtype("int8")
    # The tensor front ends hold every dtype of the table, and step the optimizer's.
    assert {d: n.name for d, n in tensor_table._NUMPY_DTYPES.items()} == {
        getattr(torch, row.name): row.name for row in layout.DTYPES}
    assert param_rows.STEPPED == tuple(dtypes.torch_dtype(c) for c in layout.OPTIM_DTYPES)
    assert set(param_rows.STEPPED) == {torch.float16, torch.bfloat16, torch.float32, torch.float64}


def test_the_dtype_table_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from gpuflat._src import dtypes\n"
            "try:\n    dtypes.torch_dtype('float32')\nexcept ImportError:\n    print('no torch')")
    assert _fresh(code) == "no torch"
