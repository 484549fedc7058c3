"""gpuflat._src.layout against the C++ that mirrors it: every constant the kernels
and the host libraries spell out again is read back from their sources here,
so a drift on either side fails."""
from __future__ import annotations

import importlib
import importlib.util
import re

import numpy as np
import pytest

from gpuflat._src import dtypes, layout
from gpuflat._src import kernel_loader as kl

SOURCES = {**kl.sources(), **{f"host/{p.name}": p.read_text() for p in (kl.kernel_dir() / "host").glob("*.[ch]*")}}


def _defines(name: str) -> dict:
    return {k: int(v) for k, v in re.findall(r"^#define (GF_\w+) (\d+)$", SOURCES[name], re.M)}


def _struct_words(name: str) -> int:
    """The int64 words of a struct of kernels/gpuflat_common.cuh, arrays counted by their length."""
    body = re.search(rf"struct {name} \{{(.*?)\n\}};", SOURCES["gpuflat_common.cuh"], re.S).group(1)
    words = 0
    for fields in re.findall(r"^\s*(?:unsigned )?long long ([^;]+);", body, re.M):
        for field in fields.split(","):
            length = re.search(r"\[(\w+)\]", field)
            words += 1 if length is None else {"GF_MAX_DIMS": layout.MAX_DIMS}[length.group(1)]
    return words


def test_the_block_constants_are_the_headers():
    defines = _defines("gpuflat_common.cuh")
    assert defines["GF_WARP"] == layout.WARP
    assert defines["GF_MAX_DIMS"] == layout.MAX_DIMS
    assert defines["GF_BLOCK_THREADS"] == layout.BLOCK_THREADS
    assert defines["GF_MIN_BLOCKS_PER_SM"] == layout.MIN_BLOCKS_PER_SM
    assert defines["GF_FINISH_THREADS"] == layout.FINISH_THREADS
    assert defines["GF_SMALL_SLOT_ITEMS"] == layout.SMALL_SLOT_ITEMS
    assert defines["GF_BLOCK_SLOT_ITEMS"] == layout.BLOCK_SLOT_ITEMS


def test_the_table_rows_are_the_kernels_structs():
    assert _struct_words("LeafRef") == layout.LEAF_ROW_WORDS
    assert _struct_words("Item") == layout.ITEM_WORDS
    row = layout.leaf_row((4, 3), (8, 64), np.float64)
    assert len(row) == layout.LEAF_ROW_WORDS - 1  # all but the address


def _listed(macro: str) -> str:
    return re.search(rf"^#define {macro}\(X\) (.*)$", SOURCES[layout.RULES_HEADER], re.M).group(1).strip()


def test_the_written_header_lists_the_dtypes():
    # The C++ reads the dtypes' tags and their list only through
    # gpuflat_rules.h, which the layout writes from its rows.
    assert _listed("GF_DTYPES") == " ".join(f"X({row.tag}, {row.c_name})" for row in layout.DTYPES)
    assert _listed("GF_OPTIM_DTYPES") == " ".join(f"X({row.tag}, {row.c_name})" for row in layout.DTYPES if row.optim)
    assert layout.OPTIM_DTYPES == tuple(row.c_name for row in layout.DTYPES if row.optim)
    # Every C++ type of the list is the kernels' own, and every switch over
    # tags expands a list: no source spells out a tag.
    for row in layout.DTYPES:
        assert row.c_name in ("float", "double") or f"struct {row.c_name} {{" in SOURCES["gpuflat_common.cuh"]
    assert "GF_DTYPES(GF_DISPATCH_CASE)" in SOURCES["gpuflat_common.cuh"]
    assert "GF_OPTIM_DTYPES(GF_OPTIM_CASE)" in SOURCES["host/host_optim.cpp"]
    for name, text in SOURCES.items():
        assert not re.search(r"case (\d+|GF_TAG_\w+):|tag \+ 1\] == \d", text), name


def test_the_host_library_reads_each_tag():
    # Python gives the library each tag's NumPy type number (gpuflat._src.native, from the dtype table).
    # The count and item sizes come from the written header, indexed by tag.
    assert [row.tag for row in layout.DTYPES] == list(range(len(layout.DTYPES)))
    source = SOURCES["host/host_backend.cpp"]
    assert "constexpr int N_TAGS = GF_N_TAGS;" in source and "sizes[] = {GF_ITEMSIZES};" in source
    assert _defines(layout.RULES_HEADER)["GF_N_TAGS"] == len(layout.DTYPES)
    sizes = re.search(r"^#define GF_ITEMSIZES ([\d, ]+)$", SOURCES[layout.RULES_HEADER], re.M).group(1)
    assert tuple(int(s) for s in sizes.split(",")) == layout.ITEMSIZES


def test_the_host_libraries_work_item_is_the_layouts():
    assert "constexpr long long ITEM = GF_ITEM;" in SOURCES["host/host_backend.cpp"]
    assert _defines(layout.RULES_HEADER)["GF_ITEM"] == layout.ITEM
    # Both host libraries cut their items with the one helper, which alone spells out the cut.
    assert SOURCES["host/host_items.h"].count("+= GF_ITEM") == 1
    for name in ("host/host_backend.cpp", "host/host_optim.cpp"):
        assert '#include "host_items.h"' in SOURCES[name] and "gf_append_items(" in SOURCES[name]
        assert not re.search(r"\+= (GF_)?ITEM\b", SOURCES[name]), name
    # As the layout's work_items cuts them for the kernels: its rows are struct Item's.
    items = layout.work_items([0, 1, layout.ITEM, layout.ITEM + 1], [0, 0, 1, 1 + layout.ITEM])
    assert items.shape == (1 + 1 + 2, layout.ITEM_WORDS)
    assert items.tolist() == [[1, 0, 1, 0], [2, 0, layout.ITEM, 1], [3, 0, layout.ITEM, 1 + layout.ITEM],
                              [3, layout.ITEM, 1, 1 + 2 * layout.ITEM]]
    # Every item of a leaf starts as aligned as the leaf: 32 lanes of 16-byte vectors of 2-byte elements.
    assert layout.ITEM % (32 * 8) == 0


def test_the_written_header_lists_the_norm_kinds():
    # The C++ reads the kinds' numbers and their list only through
    # gpuflat_rules.h, which the layout writes from its records.
    kinds = layout.NORMS.values()
    defines = _defines(layout.RULES_HEADER)
    assert {k.removeprefix("GF_NORM_").lower(): v for k, v in defines.items() if k.startswith("GF_NORM_")} \
        == {kind.name: kind.number for kind in kinds} == layout.NORM_KINDS
    assert _listed("GF_NORM_KINDS") == " ".join(f"X({kind.number})" for kind in kinds)
    assert len({kind.number for kind in kinds}) == len(layout.NORMS)
    # Each kind's arithmetic and traits are its gf_norm specialization; no
    # other source spells out a kind's number or branches on one.
    for kind in kinds:
        assert f"struct gf_norm<GF_NORM_{kind.name.upper()}> : gf_norm_defaults {{" in SOURCES["gpuflat_math.cuh"]
    for name, text in SOURCES.items():
        assert name == layout.RULES_HEADER or not re.search(r"#define GF_NORM_\w+ \d", text), name
        assert not re.search(r"K [!=]= GF_NORM_|case GF_NORM_", text), name
    assert "GF_NORM_KINDS(GF_NORM_CASE)" in SOURCES["host/host_backend.cpp"]


def test_every_order_has_one_norm_kind():
    # The named orders take their kinds; every other order the one kind that names none.
    kinds = layout.NORMS.values()
    assert sum(not kind.orders for kind in kinds) == 1
    assert all(layout.norm_kind(order) == kind.name for kind in kinds for order in kind.orders)
    assert layout.norm_kind(0.5) == next(kind.name for kind in kinds if not kind.orders)


def test_the_optimizer_rows_and_rules_are_the_kernels():
    defines = _defines("gpuflat_optim.cuh")
    assert defines["GF_HYPER"] == layout.HYPER
    fields = [rule.hyper for rule in layout.RULES.values()]
    assert all(len(f) <= layout.HYPER and f[0] == "lr" and f[layout.MAXIMIZE_FIELD] == "maximize" for f in fields)
    assert defines["GF_HYPER_MAXIMIZE"] == layout.MAXIMIZE_FIELD
    assert defines["GF_HYPER_AMSGRAD"] == layout.RULES["adamw"].hyper.index("amsgrad")
    assert defines["GF_AMSGRAD_MIN_BLOCKS_PER_SM"] == layout.AMSGRAD_MIN_BLOCKS_PER_SM
    assert set(layout.OPTIM_DTYPES) <= set(layout.C_NAMES)


def test_the_written_header_holds_the_rules_and_tags():
    # The host library reads rule numbers and dtype tags only through
    # gpuflat_rules.h, which the layout writes: no literal can drift.
    defines = _defines(layout.RULES_HEADER)
    assert {k.removeprefix("GF_RULE_").lower(): v for k, v in defines.items() if k.startswith("GF_RULE_")} \
        == {name: rule.number for name, rule in layout.RULES.items()}
    assert {k.removeprefix("GF_TAG_"): v for k, v in defines.items() if k.startswith("GF_TAG_")} \
        == {row.c_name: row.tag for row in layout.DTYPES}
    assert len({rule.number for rule in layout.RULES.values()}) == len(layout.RULES)
    host = SOURCES["host/host_optim.cpp"]
    assert not re.search(r"case \d+:", host) and "GF_GENERIC_RULES(GF_RULE_CASE)" in host
    # The mixed update (rows whose precision word is not 0) takes every rule through its struct.
    assert "GF_RULES(GF_RULE_CASE)" in host
    generic = [rule for rule in layout.RULES.values() if not rule.tuned]
    assert _listed("GF_GENERIC_RULES") == " ".join(f"X({rule.number}, {rule.kernel})" for rule in generic)
    assert _listed("GF_RULES") == " ".join(f"X({rule.number}, {rule.kernel})" for rule in layout.RULES.values())
    # The precision word's fields, as layout.precision_word packs them.
    assert [defines[f"GF_KEEP_{keep.upper()}"] for keep in layout.KEEPS] == list(range(len(layout.KEEPS)))
    assert defines["GF_PRECISION_TAG_BITS"] == layout.PRECISION_TAG_BITS
    assert layout.precision_word((), "master") == defines["GF_KEEP_MASTER"] << defines["GF_KEEP_SHIFT"]
    # Every rule, tuned or not, has its element struct, in a header the written includes name.
    for rule in layout.RULES.values():
        assert rule.kernel and f"struct {rule.kernel} " in SOURCES[rule.header]
        assert f'#include "{rule.header}"' in SOURCES[layout.RULE_INCLUDES]
    # gpuflat_rules.h includes nothing (gpuflat_common.cuh includes it before any rule's code);
    # the rules' headers come through gpuflat_rule_includes.h.
    assert "#include" not in SOURCES[layout.RULES_HEADER]
    for rule in generic:
        assert len(rule.state_names) <= layout.GENERIC_STATES and not rule.flag_states


def test_the_numpy_dtypes_follow_the_rows():
    for row in layout.DTYPES:
        dtype = dtypes.dtype_of_tag(row.tag)
        assert (dtype.name, dtype.itemsize, dtypes.TAGS[dtype], dtypes.c_name(dtype)) \
            == (row.name, row.itemsize, row.tag, row.c_name)
        assert dtypes.wider(dtype) == (None if row.wider is None else np.dtype(row.wider))
        assert dtypes.is_imported(dtype) == (row.module is not None)


def test_fast_division_is_exact_for_every_index_below_two_to_the_63():
    # The kernels divide strided indices by each dim's length with these
    # magic numbers; check the edges of the range and random indices.
    rng = np.random.default_rng(12)
    top = 2**63 - 1
    divisors = [2, 3, 5, 7, 10, 641, 2**31, 2**32 - 1, 2**32 + 1, 2**62, top]
    divisors += [int(d) for d in rng.integers(2, 2**62, 200)] + [int(d) for d in rng.integers(2, 5000, 200)]
    for d in divisors:
        m, s = layout.fast_division(d)
        assert 0 < m < 2**64 and 0 <= s < 63
        for i in [0, 1, d - 1, d, d + 1, top - 1, top, top - top % d, top - top % d - 1] + [
                int(x) for x in rng.integers(0, top, 50, dtype=np.int64)]:
            assert (i * m >> 64) >> s == i // d, (i, d)
    with pytest.raises(ValueError, match=r"expected 2 <= d < 2\*\*63, got 1"):
        layout.fast_division(1)


def test_the_tensor_list_row_is_the_kernels():
    header = SOURCES["gpuflat_optim.cuh"]
    body = re.search(r"struct ParamRow \{(.*?)\n\};", header, re.S).group(1)
    fields = [name.strip() for line in re.findall(r"^\s*long long ([^;]+);", body, re.M) for name in line.split(",")]
    assert tuple(fields) == layout.PARAM_ROW_FIELDS


def test_the_kernels_comments_name_modules_that_exist():
    # The C++ names the Python it mirrors by module path; a path from before a
    # move would send a reader to nothing.
    from pathlib import Path

    root = Path(layout.__file__).parents[2]
    named = {m for p in kl.kernel_dir().rglob("*") if p.suffix in (".cu", ".cuh", ".h", ".cpp")
             for m in re.findall(r"gpuflat(?:[./]\w+)+", p.read_text())}
    assert named
    for name in named:
        if "/" in name:
            assert (root / name).is_file(), name
            continue
        parts = name.split(".")
        for k in range(len(parts), 0, -1):
            module = ".".join(parts[:k])
            try:
                if importlib.util.find_spec(module) is None:
                    continue
            except ModuleNotFoundError:  # a name inside a module, not a module
                continue
            try:
                found = importlib.import_module(module)
            except ImportError:  # it exists, but needs what this environment lacks (PyTorch)
                break
            for attr in parts[k:]:
                found = getattr(found, attr)  # AttributeError names the stale one
            break


def test_every_clip_takes_the_one_eps():
    import inspect

    import gpuflat
    import gpuflat.distributed
    import gpuflat.optim
    from gpuflat._src import ops, ranks, residency

    assert layout.CLIP_EPS == 1e-6  # PyTorch's clip_grad_norm_: max_norm / (total_norm + 1e-6)
    clips = [gpuflat.clip_grad_norm_, gpuflat.clip_by_global_norm, ops.clip_grad_norm_, ops.clip_by_global_norm,
             ranks.clip_grad_norm_, gpuflat.distributed.clip_grad_norm_, residency.Resident.clip_grad_norm_]
    for clip in clips:
        assert inspect.signature(clip).parameters["eps"].default is layout.CLIP_EPS, clip
    assert gpuflat.optim._CLIP_EPS is layout.CLIP_EPS
    if importlib.util.find_spec("torch") is not None:
        import gpuflat.torch
        from gpuflat._src import torch_optim_ops

        assert gpuflat.torch._EPS is layout.CLIP_EPS and torch_optim_ops.CLIP_EPS is layout.CLIP_EPS
