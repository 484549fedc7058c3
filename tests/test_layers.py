"""The house's drawing, checked: every import inside gpuflat points down its
layers, no module imports the package itself, and no imports form a circle.

The imports are read from the source (every ``import`` statement, including
the ones inside functions), so a lazy import that points back up fails here
as a top-level one would.
"""
from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gpuflat"

# Lowest first. A module may import modules of its own layer or below.
LAYERS = [
    # Facts with no gpuflat imports.
    ["errors", "layout", "identity", "overlap", "host_compiler", "memory_order"],
    ["dtypes"],
    # Arrays of every kind, the kernel sources, the backend contract, PyTorch tensors' facts.
    ["arrays", "dtensor", "kernel_loader", "backends.protocol", "tensor_facts"],
    # The tree walk, the emulator, the NumPy reference.
    ["tree", "emulator", "backends.numpy_backend"],
    # Plans, trees walked before; the devices and the backends that launch on them.
    ["flatplan", "seen", "backends.cuda_runtime", "backends.host", "backends.cuda"],
    ["backends.selection", "backends", "checks"],
    # The binding layer every front end goes through.
    ["binding", "torch_params", "tensor_table"],
    # Reductions over ranks, which the operations use for DTensors.
    ["distributed"],
    ["ops"],
    # Front ends.
    ["residency", "optim"],
    ["torch_optim"],
    ["torch"],
    # The package and the deprecated aliases of moved modules.
    ["__init__", "runtime", "backends.base"],
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def module_names():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        yield ".".join(parts[:-1]) if parts[-1] == "__init__" and len(parts) > 1 else ".".join(parts)


def imports_of(name):
    """(imported gpuflat module, line) for every import statement in module ``name``."""
    parts = [] if name == "__init__" else name.split(".")
    path = PACKAGE.joinpath(*parts, "__init__.py")
    if not path.exists():
        path = PACKAGE.joinpath(*parts).with_suffix(".py")
    package = parts if path.name == "__init__.py" else parts[:-1]
    return imports_in(path.read_text(), package)


def imports_in(source, package):
    """The gpuflat modules ``source`` imports, for a module inside ``package`` (a list of names)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(_target(alias.name.split(".")[1:]), node.lineno) for alias in node.names
                      if alias.name.split(".")[0] == "gpuflat"]
        elif isinstance(node, ast.ImportFrom):
            named = (node.module or "").split(".") if node.module else []
            if node.level:
                module = package[: len(package) - node.level + 1] + named
            elif named[:1] == ["gpuflat"]:
                module = named[1:]
            else:
                continue
            found += [(_target(module + [alias.name]), node.lineno) for alias in node.names]
    return found


def _target(parts):
    """The module an import names: ``from pkg import mod`` names ``pkg.mod``, ``from mod import f`` names ``mod``."""
    name = ".".join(parts)
    return name if name in LAYER else ".".join(parts[:-1]) or "__init__"


def test_every_module_has_a_layer():
    assert sorted(set(module_names()) - set(LAYER)) == []
    assert sorted(set(LAYER) - set(module_names())) == []


@pytest.mark.parametrize("name", sorted(LAYER))
def test_imports_point_down(name):
    up = [(target, line) for target, line in imports_of(name)
          if target != name and LAYER[target] > LAYER[name]]
    assert up == [], f"gpuflat.{name} imports from a higher layer: {up}"


@pytest.mark.parametrize("name", sorted(set(LAYER) - {"__init__"}))
def test_nothing_imports_the_package_itself(name):
    assert [line for target, line in imports_of(name) if target == "__init__"] == []


def test_no_circles():
    graph = {name: {t for t, _ in imports_of(name) if t != name} for name in LAYER}
    done, path = set(), []

    def visit(name):
        if name in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(name):] + [name]))
        if name in done:
            return
        path.append(name)
        for target in sorted(graph[name]):
            visit(target)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_the_reader_resolves_imports():
    """Relative, absolute, nested and package imports all name the module they import."""
    source = """
from ..ops import flatten
from . import cuda, protocol as p
import gpuflat.tree
def later():
    from gpuflat import errors
    import gpuflat
"""
    assert [t for t, _ in imports_in(source, ["backends"])] == [
        "ops", "backends.cuda", "backends.protocol", "tree", "errors", "__init__"]
    assert "backends.selection" in {t for t, _ in imports_of("ops")}


@pytest.mark.parametrize("old, new, name", [
    ("gpuflat.runtime", "gpuflat.backends.cuda_runtime", "EmulatedRuntime"),
    ("gpuflat.backends.base", "gpuflat.backends.selection", "select"),
])
def test_moved_modules_keep_a_deprecated_alias(old, new, name):
    import sys

    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alias = importlib.import_module(old)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught)
    assert getattr(alias, name) is getattr(importlib.import_module(new), name)


def test_the_readme_map_names_every_module():
    readme = (PACKAGE.parent / "README.md").read_text()
    section = readme.split("## How the package is built", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[2] for line in section.splitlines() if line.startswith("| ") and "`" in line]
    mapped = {name.removeprefix("gpuflat.") for row in rows for name in row.split("`")[1::2]}
    modules = set(LAYER) - {"__init__", "backends", "runtime", "backends.base"}
    assert mapped == modules
