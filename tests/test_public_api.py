"""The public face: five public modules, each with ``__all__``, every public
function and method annotated, and internals only under ``gpuflat._src``."""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

import gpuflat

PUBLIC = ["gpuflat", "gpuflat.torch", "gpuflat.distributed", "gpuflat.optim", "gpuflat.errors"]


def _public_callables(module):
    """(qualified name, function) of every function and public method ``module`` exports."""
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isfunction(obj):
            yield f"{module.__name__}.{name}", obj
        elif inspect.isclass(obj) and obj.__module__.startswith("gpuflat") and not issubclass(obj, BaseException):
            for attr, value in inspect.getmembers(obj, inspect.isfunction):  # inherited ones too
                if (not attr.startswith("_") or attr == "__init__") and value.__module__.startswith("gpuflat"):
                    yield f"{module.__name__}.{name}.{attr}", value


def _unannotated(qualname, fn) -> list:
    signature = inspect.signature(fn)
    missing = [f"{qualname}({p})" for p in signature.parameters if p not in ("self", "cls")
               and signature.parameters[p].annotation is inspect.Parameter.empty]
    if signature.return_annotation is inspect.Signature.empty and not qualname.endswith(".__init__"):
        missing.append(f"{qualname} -> ?")
    return missing


@pytest.mark.parametrize("name", PUBLIC)
def test_each_public_module_says_what_it_exports(name):
    module = importlib.import_module(name)
    assert isinstance(module.__all__, list) and module.__all__
    assert [n for n in module.__all__ if not hasattr(module, n)] == []


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_function_is_annotated(name):
    module = importlib.import_module(name)
    missing = [m for qualname, fn in _public_callables(module) for m in _unannotated(qualname, fn)]
    assert missing == []


def test_internals_live_under_src():
    package = Path(gpuflat.__file__).parent
    top = sorted(p.stem for p in package.glob("*.py"))
    assert top == ["__init__", "distributed", "errors", "optim", "torch"]
    assert sorted(p.name for p in package.iterdir() if p.is_dir() and p.name != "__pycache__") == ["_src"]
