"""gpuflat._src.caches: every cache registered and bounded; gf.cache_clear() empties them all."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import gpuflat as gf
from gpuflat._src import caches

PACKAGE = Path(gf.__file__).parent
# Loaded builds and one-time set-ups, not caches of anything a call passes:
# dropping them would load the same build again.
NOT_CACHES = {("native.py", "host_library"), ("native.py", "optim_library"),
              ("host_compiler.py", "_compiler_identity"), ("kernel_loader.py", "nvrtc_library"),
              ("kernel_loader.py", "_device_cubin"), ("tensor_facts.py", "_load"), ("arrays.py", "_torch_from_package"),
              ("selection.py", "host_default")}


def _decorated_caches():
    """(file, function) of every function gpuflat decorates with functools' caches."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for d in node.decorator_list:
                    text = ast.unparse(d)
                    if "lru_cache" in text or text in ("functools.cache", "cache"):
                        found.add((path.name, node.name))
    return found


def test_every_functools_cache_is_a_loaded_build_and_the_rest_are_registered():
    assert _decorated_caches() == NOT_CACHES


def test_no_module_keeps_a_bounded_cache_of_its_own():
    # A cache is a caches.LRU or caches.Recent (or registers with
    # caches.register): no hand-rolled OrderedDict trimmed by popitem.
    for path in PACKAGE.rglob("*.py"):
        if path.name != "caches.py":
            assert "popitem(last=False)" not in path.read_text(), path


def _fill_caches():
    """Calls that fill the caches of trees, tensor lists, resident models and
    the flat optimizers (on the emulated CUDA backend, whose step keeps tables)."""
    torch = pytest.importorskip("torch")
    import gpuflat.torch as gft
    from gpuflat._src import tensor_table
    from gpuflat._src.backends import get_backend

    tree = {"w": np.ones((3, 2), np.float32), "b": np.arange(4.0)}
    values = [float(gf.global_norm(tree)), float(gf.global_norm(tree, backend="emulated"))]
    gf.clip_grad_norm_(tree, 1.0)
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2).t())]
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    values.append(float(gft.clip_grad_norm_(params, 100.0)))
    opt = gft.AdamW(params, lr=0.1, max_norm=1.0)
    with tensor_table.serve_with(get_backend("emulated")):
        opt.step()
    return values, [p.detach().clone() for p in params], opt  # the optimizer holds what its steps found


def test_cache_clear_empties_every_cache_and_changes_no_result():
    values, stepped, opt = _fill_caches()
    held = gf.cache_info()
    for name in ("plans", "trees seen", "tensor tables", "optimizer step tables", "per-call device tables",
                 "static device tables", "gpuflat._src.layout.leaf_row", "optimizers' parameters found"):
        assert held[name] > 0, (name, held)
    gf.cache_clear()
    assert {name: n for name, n in gf.cache_info().items() if n} == {}
    again, stepped_again, _ = _fill_caches()
    assert again == values
    assert all(bool((a == b).all()) for a, b in zip(stepped, stepped_again))


def test_device_tables_go_back_to_the_runtime_when_cleared(monkeypatch):
    from gpuflat._src.backends import get_backend

    runtime = get_backend("emulated").runtime
    released = []
    monkeypatch.setattr(runtime, "release", released.append)
    _fill_caches()
    gf.cache_clear()
    assert len(released) >= 2  # the step's tables, and the per-call tables of the tree's plan


def test_every_cache_is_bounded():
    before = caches.sizes()
    for k in range(600):
        gf.global_norm({f"w{k}": np.ones(1)})
    after = caches.sizes()
    assert after["plans"] <= 256 and after["trees seen"] <= 8, after
    assert after["plans"] > before.get("plans", 0) or before.get("plans", 0) == 256
