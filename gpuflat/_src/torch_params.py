"""A resident model's PyTorch parameters, followed through a training loop.

A resident model binds each trainable parameter's storage (``p.data``) and
gradient (``p.grad``) to views into its flat buffers. A training loop then
does things the buffers cannot see: ``optimizer.zero_grad()`` sets gradients
to None (PyTorch's default since 2.0) and autograd allocates new ones;
``p.data = t`` gives a parameter new storage; ``model.to(dtype)`` gives every
parameter new storage of another dtype; ``load_state_dict(...,
assign=True)`` puts new parameter objects in the modules; ``requires_grad_``
unfreezes a layer; a module gains a parameter or a submodule (an adapter).
:meth:`Binding.sync` runs first in every per-step call of the resident model
and follows what it can follow for certain, the parameters' gradients and
their new storage of the same dtype, shape and device, and refuses the rest
with StaleResidentError naming the parameter, before it writes anything: the
buffers are never computed on stale.

Per step the checks read two facts per parameter, its storage address and
its gradient, in one native pass each where ``gpuflat._src.tensor_facts`` builds
(Python reads them elsewhere), and compare them in C. Changes to the
modules' tables (a parameter or submodule set, replaced or added) are
noticed through PyTorch's global registration hooks, which count every
``register_parameter`` and submodule registration (``setattr`` of a
Parameter or Module, ``load_state_dict(assign=True)``), so the modules are
walked again only after one happened.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from . import dtensor
from ..errors import StaleResidentError

if TYPE_CHECKING:
    from typing import NoReturn

    import torch

_grad_of = operator.attrgetter("grad")
_REBUILD = "; rebuild it with gf.resident(model)"
_registrations = [0]  # parameters and submodules registered on any module so far
_hooks_installed = False  # whether _count_registrations has installed its hooks


def _count_registration(*args: object) -> None:
    _registrations[0] += 1  # returns None: the registered value is kept as it is


def _count_registrations(torch: ModuleType) -> None:
    """Install the counting hooks, once per process."""
    global _hooks_installed
    if not _hooks_installed:
        torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
        torch.nn.modules.module.register_module_module_registration_hook(_count_registration)
        _hooks_installed = True


def _all_same(xs: Iterable[object], ys: Iterable[object]) -> bool:
    xs, ys = list(xs), list(ys)
    return len(xs) == len(ys) and all(map(operator.is_, xs, ys))


class Binding:
    """The trainable parameters of a resident model, bound to their views.

    ``pairs`` are (path, parameter) in plan order; ``roots`` the
    ``torch.nn.Module`` objects of the tree, whose modules' parameter and
    submodule tables are watched; ``data`` and ``grads`` each parameter's
    views (``grads`` None for a model made with ``grads=False``).
    """

    def __init__(self, pairs: Sequence[tuple[str, torch.nn.Parameter]], roots: Iterable[torch.nn.Module],
                 data: Iterable[torch.Tensor], grads: Iterable[torch.Tensor] | None) -> None:
        import torch

        from . import tensor_facts

        _count_registrations(torch)
        self._data_ptr = torch.Tensor.data_ptr
        # The native pass reads each fact at about 40 ns, Python at 60-100.
        self._facts = tensor_facts if tensor_facts.available() else None
        self.paths = [path for path, _ in pairs]
        self.params = [param for _, param in pairs]
        self.data, self.grads = list(data), None if grads is None else list(grads)
        self._index = {id(p): k for k, p in enumerate(self.params)}
        # Each p.grad as last adopted: its view, or None.
        self._expected: list[torch.Tensor | None] = [None] * len(self.params)
        self._gradless: set = set()  # the k whose _expected is None, kept as they change (read every step)
        self._roots = list({id(m): m for m in roots}.values())
        self._prefixes = [self._prefix_of(root) for root in self._roots]
        for k, param in enumerate(self.params):
            self._bind(k, param)
        self._watch({id(p): p.grad for root in self._roots for p in root.parameters()})
        self._data_key = self._read_data()

    # ------------------------------------------------------------ binding

    def _bind(self, k: int, param: torch.nn.Parameter) -> None:
        """Point ``param`` at its views; a gradient it already holds is kept, copied in."""
        self.data[k].copy_(param.detach())
        param.data = self.data[k]
        if self.grads is not None:
            self._adopt_grad(k, param)

    def _adopt_grad(self, k: int, param: torch.nn.Parameter) -> None:
        """Copy ``param``'s gradient into its view and point ``param.grad`` at the
        view. A gradient that is None stays None and its view is zeroed: it
        counts as zero (as in PyTorch's clip), and PyTorch's optimizers, and
        so the flat ones, skip its parameter."""
        grads = cast("list[torch.Tensor]", self.grads)  # called only where there are gradient views
        grad = param.grad
        if grad is None:
            grads[k].zero_()
            self._gradless.add(k)
        else:
            if grad is not grads[k]:
                grads[k].copy_(grad)
                param.grad = grads[k]
            self._gradless.discard(k)
        self._expected[k] = param.grad

    def gradless(self) -> frozenset[int]:
        """The parameters (by index) whose gradient is None.

        >>> import torch, gpuflat as gf
        >>> net = torch.nn.Linear(2, 1)
        >>> net.bias.grad = torch.ones(1)
        >>> sorted(gf.resident(net)._binding.gradless())  # the weight has none
        [0]
        """
        return frozenset(self._gradless)

    def give_grads(self, ks: Iterable[int]) -> None:
        """Bind each gradless parameter ``k`` of ``ks`` to its view as its gradient:
        the view holds one now (a gradient all-reduce wrote it).

        >>> import torch, gpuflat as gf
        >>> net = torch.nn.Linear(2, 1)
        >>> binding = gf.resident(net)._binding
        >>> binding.give_grads([1]); net.bias.grad is binding.grads[1], sorted(binding.gradless())
        (True, [0])
        """
        grads = cast("list[torch.Tensor]", self.grads)  # only gradient views make a parameter gradless
        for k in ks:
            self.params[k].grad = self._expected[k] = grads[k]
            self._gradless.discard(k)
        self._expect_grads()

    # ------------------------------------------------------------ what is watched

    def _prefix_of(self, root: torch.nn.Module) -> str:
        """How the plan's paths name ``root``'s parameters before their qualified name."""
        for name, p in root.named_parameters():
            k = self._index.get(id(p))
            if k is not None and self.paths[k].endswith(name):
                return self.paths[k][: len(self.paths[k]) - len(name)]
        return ""

    def _named_modules(self) -> list[tuple[str, torch.nn.Module]]:
        """(qualified name, module) of every module of the roots now, each once."""
        seen, named = set(), []
        for prefix, root in zip(self._prefixes, self._roots):
            for name, sub in root.named_modules():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    named.append((prefix + name, sub))
        return named

    @staticmethod
    def _named_parameters(
            named_modules: Iterable[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.nn.Parameter]]:
        """(qualified name, parameter) of every parameter of ``named_modules``,
        under each of its names (a tied one several times)."""
        return [(f"{prefix}.{name}" if prefix else name, p)
                for prefix, sub in named_modules for name, p in sub._parameters.items() if p is not None]

    @staticmethod
    def _first_names(named: Iterable[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, torch.nn.Parameter]]:
        """``named`` with each parameter once, under its first name."""
        seen, first = set(), []
        for name, p in named:
            if id(p) not in seen:
                seen.add(id(p))
                first.append((name, p))
        return first

    def _watch(self, other_grads: dict[int, torch.Tensor | None]) -> None:
        """Snapshot what the per-step checks compare the module tables against;
        ``other_grads`` maps each parameter left out of the buffers (by id) to
        the gradient it is expected to hold (absent: None)."""
        named = self._named_modules()
        self._registrations_seen = _registrations[0]
        self._modules = [sub for _, sub in named]
        self._classes = list(map(type, self._modules))
        self._tables: list[dict[str, Any]] = [table for _, sub in named
                                              for table in (sub._parameters, sub._modules)]
        self._table_values = self._table_contents()
        params = self._first_names(self._named_parameters(named))
        self._homes = {self._index[id(p)]: name for name, p in params if id(p) in self._index}
        self._others = [(name, p) for name, p in params if id(p) not in self._index]
        self._other_params = [p for _, p in self._others]
        self._other_grads = [other_grads.get(id(p)) for p in self._other_params]
        self._watched = (self.params if self.grads is not None else []) + self._other_params
        self._expect_grads()

    def _expect_grads(self) -> None:
        """What the gradient check compares against: every watched parameter's
        expected gradient, and those that are not None in order."""
        self._expected_all = (self._expected if self.grads is not None else []) + self._other_grads
        self._present = [g for g in self._expected_all if g is not None]

    def _table_contents(self) -> list[Any]:
        return list(chain.from_iterable(map(dict.values, self._tables)))

    def _read_data(self) -> np.ndarray:
        """Each parameter's storage address, as an int64 array."""
        if self._facts is not None:
            facts = self._facts.of_tensors(self.params)
            if facts is not None:
                return facts[:, 0].copy()
        return np.fromiter(map(self._data_ptr, self.params), np.int64, len(self.params))

    def _grads_unchanged(self) -> bool:
        watched, expected = self._watched, self._expected_all
        if self._facts is not None:
            present = self._facts.gradients(watched)[0]
            return len(present) == len(self._present) and all(map(operator.is_, present, self._present))
        return all(map(operator.is_, map(_grad_of, watched), expected))

    # ------------------------------------------------------------ per step

    def sync(self, before_writing: Callable[[str], object] | None = None) -> None:
        """Follow what the training loop did since the last call, or raise
        StaleResidentError having changed nothing. ``before_writing(what)``,
        if given, is called once every check has passed and before the first
        write, naming the first parameter to follow; it may raise to refuse.

        >>> import torch, gpuflat as gf
        >>> net = torch.nn.Linear(2, 1)
        >>> binding = gf.resident(net)._binding
        >>> net.bias.grad = torch.full((1,), 3.0)  # as autograd allocates one after zero_grad()
        >>> binding.sync(); net.bias.grad is binding.grads[1], net.weight.grad
        (True, None)
        >>> net.bias = torch.nn.Parameter(torch.zeros(1))
        >>> binding.sync()
        Traceback (most recent call last):
        ...
        gpuflat.errors.StaleResidentError: parameter 'bias' was replaced by another Parameter object ...
        """
        # FSDP2's fully_shard swaps the parameters into the tables without
        # registering them, but gives each module it wraps a new class.
        if _registrations[0] != self._registrations_seen or not _all_same(map(type, self._modules), self._classes):
            self._check_tables()
        moved = []
        if not np.array_equal(self._read_data(), self._data_key):
            moved = [k for k, param in enumerate(self.params) if param.data_ptr() != self._data_key[k]]
            for k in moved:
                self._check_fits(k, self.params[k], "now has")
        rebound = []
        if not self._grads_unchanged():
            self._raise_if_left_out()
            if self.grads is not None:
                rebound = [k for k, param in enumerate(self.params) if param.grad is not self._expected[k]]
        if not (moved or rebound):
            return
        if before_writing is not None:
            before_writing(f"parameter {self.paths[(moved or rebound)[0]]!r}")
        # Every check has passed: from here on the changes are followed.
        for k in moved:
            self._bind(k, self.params[k])
        if moved:
            self._data_key = self._read_data()
        for k in rebound:
            self._adopt_grad(k, self.params[k])
        self._expect_grads()

    def _check_tables(self) -> None:
        """A registration happened, or a module's class changed: raise if a
        parameter of the buffers left its module or was replaced there, or if
        a parameter that requires grad was added; else watch the modules as
        they are now."""
        if _all_same(map(type, self._modules), self._classes) and _all_same(self._table_contents(),
                                                                           self._table_values):
            self._registrations_seen = _registrations[0]  # registered on other modules
            return
        named = self._named_parameters(self._named_modules())
        held = {id(p) for _, p in named}
        by_name = dict(named)
        for k, home in self._homes.items():
            # Held under another name only (its module moved, a tie was cut): still counted.
            new = by_name.get(home)
            if new is not self.params[k] and (new is not None or id(self.params[k]) not in held):
                self._raise_replaced(k, new)
        known = set(map(id, self._other_params))
        for name, p in self._first_names(named):
            if id(p) not in self._index and id(p) not in known and p.requires_grad:
                raise StaleResidentError(
                    f"parameter {name!r} was added to the model after gf.resident (a new parameter or "
                    f"submodule, such as an adapter) and requires grad: the resident model would leave it "
                    f"out of every norm and clip{_REBUILD}")
        # Parameters added frozen are watched from now on: a gradient they get is new.
        self._watch(dict(zip(map(id, self._other_params), self._other_grads)))

    def _raise_replaced(self, k: int, new: torch.nn.Parameter | None) -> NoReturn:
        path = self.paths[k]
        if new is None:
            raise StaleResidentError(f"parameter {path!r} was removed from its module{_REBUILD}")
        if dtensor.is_dtensor(new):
            self._check_fits(k, new, "was replaced by one with")
        view = self.data[k]
        differs = [f"{what} {b} where the resident model holds {a}" for what, a, b in
                   (("dtype", view.dtype, new.dtype), ("shape", tuple(view.shape), tuple(new.shape)),
                    ("device", view.device, new.device)) if a != b]
        raise StaleResidentError(
            f"parameter {path!r} was replaced by another Parameter object"
            f" ({', '.join(differs) or 'of the same dtype, shape and device'}), as "
            f"load_state_dict(..., assign=True) and resize_token_embeddings do: a resident model follows "
            f"its parameters' .data and .grad, not a new object in their place, and an optimizer made "
            f"before still updates the old one{_REBUILD}, and any optimizer over the old parameters")

    def _check_fits(self, k: int, param: torch.Tensor, verb: str) -> None:
        if dtensor.is_dtensor(param):
            raise StaleResidentError(f"parameter {self.paths[k]!r} {verb} a DTensor {tuple(param.placements)} "
                                     f"(fully_shard or tensor parallelism sharded it): FSDP2 and tensor "
                                     f"parallelism own their parameters' storage, so they cannot be resident; "
                                     f"clip with gpuflat.torch.clip_grad_norm_(model.parameters(), max_norm)")
        view = self.data[k]
        for what, old, new in (("dtype", view.dtype, param.dtype), ("shape", tuple(view.shape), tuple(param.shape)),
                               ("device", view.device, param.device)):
            if old != new:
                raise StaleResidentError(f"parameter {self.paths[k]!r} {verb} {what} {new} where the "
                                         f"resident model holds {old}{_REBUILD}")
        if not param.requires_grad:
            raise StaleResidentError(f"parameter {self.paths[k]!r} {verb} requires_grad=False where the "
                                     f"resident model holds a trainable parameter{_REBUILD}")

    def _raise_if_left_out(self) -> None:
        for (name, p), grad in zip(self._others, self._other_grads):
            if p.grad is not grad:
                raise StaleResidentError(
                    f"parameter {name!r} is not part of the resident model (it was frozen when "
                    f"gf.resident was called, or added frozen or untied since) and has a new gradient, "
                    f"which the resident model would leave out{_REBUILD}")
