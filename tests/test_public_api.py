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


# What each public module showed in 0.7.0 beside its __all__ (gpuflat's own
# objects, which it had imported or defined), and where each object lives now.
DEPRECATED = {
    "gpuflat.torch": {
        "NonFiniteError": "gpuflat.errors.NonFiniteError",
        "check_ord": "gpuflat._src.checks.check_ord",
        "clip_arguments": "gpuflat._src.checks.clip_arguments",
        "clipping": "gpuflat._src.clipping",
        "dtensor": "gpuflat._src.dtensor",
        "tensor_facts": "gpuflat._src.tensor_facts",
        "tensor_table": "gpuflat._src.tensor_table",
        "torch_ops": "gpuflat._src.torch_ops",
    },
    "gpuflat.distributed": {
        "Call": "gpuflat._src.binding.Call",
        "adopt": "gpuflat._src.arrays.adopt",
        "caches": "gpuflat._src.caches",
        "checks": "gpuflat._src.checks",
        "clipping": "gpuflat._src.clipping",
        "device_scope": "gpuflat._src.arrays.device_scope",
        "dtensor": "gpuflat._src.dtensor",
        "get_backend": "gpuflat._src.backends.selection.get_backend",
        "is_bfloat16": "gpuflat._src.dtypes.is_bfloat16",
        "is_module": "gpuflat._src.arrays.is_module",
        "module_parameters": "gpuflat._src.arrays.module_parameters",
    },
    "gpuflat.optim": {
        "CLIP_EPS": "gpuflat.optim._CLIP_EPS",
        "FlatStep": "gpuflat.optim._FlatStep",
        "HYPER": "gpuflat._src.layout.HYPER",
        "RULES": "gpuflat._src.layout.RULES",
        "Rule": "gpuflat._src.layout.Rule",
        "checks": "gpuflat._src.checks",
    },
}


def _object_at(dotted):
    """The object at a dotted path: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def _public_module(name):
    if name == "gpuflat.torch":
        pytest.importorskip("torch")
    return importlib.import_module(name)


@pytest.mark.parametrize("name", PUBLIC)
def test_dir_lists_all_and_nothing_else(name):
    module = _public_module(name)
    assert dir(module) == sorted(module.__all__)


@pytest.mark.parametrize("name", PUBLIC)
def test_star_import_gives_all(name):
    module = _public_module(name)
    namespace: dict = {}
    exec(f"from {name} import *", namespace)
    assert sorted(set(namespace) - {"__builtins__"}) == sorted(module.__all__)


@pytest.mark.parametrize(("name", "attr"), [(m, a) for m, names in DEPRECATED.items() for a in names])
def test_a_name_that_left_dir_still_resolves_with_a_warning(name, attr):
    module = _public_module(name)
    with pytest.warns(DeprecationWarning, match=rf"^{name}\.{attr} is deprecated .* 0\.9\.0") as caught:
        obj = getattr(module, attr)
    assert obj is _object_at(DEPRECATED[name][attr])
    assert len(caught) == 1 and caught[0].filename == __file__  # it points at the caller's line


def test_a_deprecation_names_the_public_replacement_or_says_there_is_none():
    import gpuflat.optim
    pytest.importorskip("torch")
    import gpuflat.torch
    with pytest.warns(DeprecationWarning, match=r"; use gpuflat\.errors\.NonFiniteError$"):
        gpuflat.torch.NonFiniteError
    with pytest.warns(DeprecationWarning, match=r"; it is internal, with no public replacement$"):
        gpuflat.optim.FlatStep


@pytest.mark.parametrize("name", PUBLIC)
def test_an_unknown_name_raises_attribute_error(name):
    module = _public_module(name)
    with pytest.raises(AttributeError, match=rf"^module '{name}' has no attribute 'no_such_name'$"):
        module.no_such_name
    assert not hasattr(module, "no_such_name")


@pytest.mark.parametrize("name", PUBLIC)
def test_no_other_public_looking_name_holds_an_object_of_gpuflat(name):
    """Outside ``__all__`` and the deprecated names, a public-looking global of
    a public module may only be another library's (``np``, ``Any``): a
    gpuflat object there would be reachable, unlisted and undeprecated."""
    module = _public_module(name)
    others = [attr for attr, value in vars(module).items()
              if not attr.startswith("_") and attr not in module.__all__ and attr not in DEPRECATED.get(name, {})
              and not (getattr(value, "__name__", None) in PUBLIC)  # the package's public submodules
              and (getattr(value, "__module__", None) or getattr(value, "__name__", "")).startswith("gpuflat")]
    assert others == []
