"""The house's drawing, checked: the layer map is the README's table (under
"How the package is built", its one source); every import inside gpuflat
points down its layers, only gpuflat._src.backends imports a backend's
implementation, no internal module imports a public one but gpuflat.errors,
no module imports the package itself, and no imports form a circle.

The imports are read from the source (every ``import`` statement, including
the ones inside functions), so a lazy import that points back up fails here
as a top-level one would.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gpuflat"
README = PACKAGE.parent / "README.md"

# The modules that implement a backend: only gpuflat._src.backends may import them.
IMPLEMENTATIONS = {"_src.backends.cuda", "_src.backends.cuda_runtime", "_src.backends.host",
                   "_src.backends.numpy_backend"}


def readme_layers(text):
    """The layers of the table under "## How the package is built", lowest first.

    The table lists the highest layer first. A row names its layer, its
    modules in backticks (``gpuflat.`` optional; ``gpuflat`` itself is the
    package, ``__init__``) and what they are; a row with an empty layer cell
    belongs to the layer above it.
    """
    section = text.split("## How the package is built", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("|")]
    assert rows[0] == ["layer", "modules", "what they are"], f"expected the layer table's header, found {rows[0]}"
    layers = []
    for layer, modules, _ in rows[2:]:
        names = ["__init__" if m == "gpuflat" else m.removeprefix("gpuflat.") for m in modules.split("`")[1::2]]
        if layer:
            layers.append(names)
        else:
            assert layers, f"expected the first row to name its layer, found {modules!r} without one"
            layers[-1] += names
    return layers[::-1]


LAYERS = readme_layers(README.read_text())
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


def test_every_module_has_one_row():
    assert sorted(set(module_names()) - set(LAYER)) == []
    assert sorted(set(LAYER) - set(module_names())) == []
    named = [name for names in LAYERS for name in names]
    assert sorted({n for n in named if named.count(n) > 1}) == []


def test_the_table_is_read_lowest_layer_first():
    table = """## How the package is built

| layer | modules | what they are |
|---|---|---|
| top | `gpuflat`, `gpuflat.ops` | the package; the operations |
| middle | `tree` | the walk |
| | `backends.protocol` | the contract |
| bottom | `errors` | the exceptions |

## Next
"""
    assert readme_layers(table) == [["errors"], ["tree", "backends.protocol"], ["__init__", "ops"]]


@pytest.mark.parametrize("name", sorted(LAYER))
def test_imports_point_down(name):
    up = [(target, line) for target, line in imports_of(name)
          if target != name and LAYER[target] > LAYER[name]]
    assert up == [], f"gpuflat.{name} imports from a higher layer: {up}"


@pytest.mark.parametrize("name", sorted(n for n in LAYER if not n.startswith("_src.backends")))
def test_front_ends_reach_a_backend_through_selection_and_protocol(name):
    reached = sorted({target for target, _ in imports_of(name)} & IMPLEMENTATIONS)
    assert reached == [], (f"gpuflat.{name}: expected backends through gpuflat._src.backends.selection and "
                           f"gpuflat._src.backends.protocol, found imports of {reached}")


def is_internal(name):
    return name == "_src" or name.startswith("_src.")


# The public modules the internals may import: the exceptions, shared by every layer.
SHARED_PUBLIC = {"errors"}


@pytest.mark.parametrize("name", sorted(filter(is_internal, LAYER)))
def test_internals_import_no_public_module_but_errors(name):
    public = {n for n in LAYER if not is_internal(n)} - SHARED_PUBLIC
    reached = [(target, line) for target, line in imports_of(name) if target in public]
    assert reached == [], f"gpuflat.{name} imports a public module (only gpuflat.errors is shared): {reached}"


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
from ...errors import TreeMismatchError
from . import cuda, protocol as p
import gpuflat._src.tree
def later():
    from gpuflat import errors
    import gpuflat
"""
    assert [t for t, _ in imports_in(source, ["_src", "backends"])] == [
        "_src.ops", "errors", "_src.backends.cuda", "_src.backends.protocol", "_src.tree", "errors", "__init__"]
    assert "_src.backends.selection" in {t for t, _ in imports_of("_src.ops")}


@pytest.mark.parametrize("old", ["gpuflat.runtime", "gpuflat.backends.base"])
def test_the_aliases_removed_in_0_7_are_gone(old):
    # Renamed in 0.4.0 (to backends.cuda_runtime and backends.selection),
    # kept as warning aliases until 0.7.0: the CHANGELOG lists them as removed.
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
