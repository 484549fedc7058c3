"""A resident model's PyTorch parameters, followed through a training loop.

A resident model binds each trainable parameter's storage (``p.data``) and
gradient (``p.grad``) to views into its flat buffers. A training loop then
does things the buffers cannot see: ``optimizer.zero_grad()`` sets gradients
to None (PyTorch's default since 2.0) and autograd allocates new ones;
``model.to(dtype)`` gives every parameter new storage;
``load_state_dict(..., assign=True)`` replaces the parameter objects;
``requires_grad_`` unfreezes a layer; a module gains a parameter.
:meth:`Binding.sync` runs first in every per-step call of the resident model
and follows each change, or raises StaleResidentError naming the parameter:
the buffers are never computed on stale.

Per step the checks read two attributes per parameter (its storage address
and its gradient) and compare them in C; changes to the modules' parameter
tables are noticed through PyTorch's global registration hooks, which count
every ``register_parameter`` and submodule registration (``setattr`` of a
Parameter, ``load_state_dict(assign=True)``), so the tables are compared
only after one happened.
"""
from __future__ import annotations

import operator
from itertools import chain

from . import dtensor
from .errors import StaleResidentError

_grad_of = operator.attrgetter("grad")
_REBUILD = "; rebuild it with gf.resident(model)"
_registrations = [0]  # parameters and submodules registered on any module so far


def _count_registration(*args) -> None:
    _registrations[0] += 1  # returns None: the registered value is kept as it is


def _count_registrations(torch) -> None:
    """Install the counting hooks, once per process."""
    if not getattr(_count_registrations, "installed", False):
        torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
        torch.nn.modules.module.register_module_module_registration_hook(_count_registration)
        _count_registrations.installed = True


def _all_same(xs, ys) -> bool:
    xs, ys = list(xs), list(ys)
    return len(xs) == len(ys) and all(map(operator.is_, xs, ys))


class Binding:
    """The trainable parameters of a resident model, bound to their views.

    ``pairs`` are (path, parameter) in plan order; ``modules`` the
    ``torch.nn.Module`` objects of the tree, whose parameter tables are
    watched; ``data`` and ``grads`` each parameter's views (``grads`` None
    for a model made with ``grads=False``).
    """

    def __init__(self, pairs, modules, data, grads):
        import torch

        _count_registrations(torch)
        self._data_ptr = torch.Tensor.data_ptr
        self.paths = [path for path, _ in pairs]
        self.params = [param for _, param in pairs]
        self.data, self.grads = list(data), None if grads is None else list(grads)
        self._expected = [None] * len(self.params)  # each p.grad as last adopted: its view, or None
        self._gradless: set = set()  # the k whose _expected is None, kept as they change (read every step)
        named = [(prefix, sub) for m in modules for prefix, sub in m.named_modules()]
        self._modules = [sub for _, sub in named]
        self._tables = [table for _, sub in named for table in (sub._parameters, sub._modules)]
        self._prefixes = [prefix for prefix, _ in named for _ in range(2)]
        self._bind_all()
        self._snapshot()

    # ------------------------------------------------------------ binding

    def _bind_all(self):
        for k, param in enumerate(self.params):
            self._bind(k, param)

    def _bind(self, k, param):
        """Point ``param`` at its views; a gradient it already holds is kept, copied in."""
        self.data[k].copy_(param.detach())
        param.data = self.data[k]
        if self.grads is not None:
            self._adopt_grad(k, param, keep_none=False)
        self.params[k] = param

    def _adopt_grad(self, k, param, keep_none=True):
        """Copy ``param``'s gradient into its view and point ``param.grad`` at the
        view. A gradient the training loop set to None stays None: it counts
        as zero (as in PyTorch's clip), and PyTorch's optimizers, and so the
        flat ones, skip its parameter. A parameter bound without one gets
        its zeroed view (``keep_none=False``)."""
        grad = param.grad
        if grad is None:
            self.grads[k].zero_()
        elif grad is not self.grads[k]:
            self.grads[k].copy_(grad)
        if grad is not None or not keep_none:
            param.grad = self.grads[k]
        self._expected[k] = param.grad
        (self._gradless.add if param.grad is None else self._gradless.discard)(k)

    def gradless(self) -> frozenset:
        """The parameters (by index) whose gradient is None."""
        return frozenset(self._gradless)

    def _snapshot(self):
        """What the per-step checks compare against."""
        self._registrations_seen = _registrations[0]
        self._classes = list(map(type, self._modules))
        self._table_values = self._table_contents()
        self._data_ptrs = list(map(self._data_ptr, self.params))
        places: dict = {}
        for table in self._tables:
            for name, p in table.items():
                places.setdefault(id(p), (table, name))
        self._places = [places.get(id(p)) for p in self.params]  # None: in no watched module
        resident = set(map(id, self.params))
        self._others = [(name, p) for name, p in self._named_in_tables() if id(p) not in resident]
        self._other_params = [p for _, p in self._others]
        self._other_grads = list(map(_grad_of, self._other_params))

    def _table_contents(self):
        return list(chain.from_iterable(map(dict.values, self._tables)))

    def _named_in_tables(self):
        """(name, parameter) of every parameter in the watched modules, each once."""
        seen, named = set(), []
        for prefix, table in zip(self._prefixes, self._tables):
            for name, p in table.items():
                if p is not None and hasattr(p, "requires_grad") and id(p) not in seen:
                    seen.add(id(p))
                    named.append((f"{prefix}.{name}" if prefix else name, p))
        return named

    # ------------------------------------------------------------ per step

    def sync(self) -> None:
        """Follow what the training loop did since the last call, or raise StaleResidentError."""
        # FSDP2's fully_shard swaps the parameters into the tables without
        # registering them, but gives each module it wraps a new class.
        if _registrations[0] != self._registrations_seen or not _all_same(map(type, self._modules), self._classes):
            self._follow_replaced()
        if list(map(self._data_ptr, self.params)) != self._data_ptrs:
            self._follow_moved_storage()
        if not all(map(operator.is_, map(_grad_of, self._other_params), self._other_grads)):
            self._raise_left_out()
        if self.grads is not None and not all(map(operator.is_, map(_grad_of, self.params), self._expected)):
            for k, param in enumerate(self.params):
                if param.grad is not self._expected[k]:
                    self._adopt_grad(k, param)

    def _follow_replaced(self):
        """Parameters replaced in their modules (``load_state_dict(assign=True)``)
        take their old places if they fit; anything else raises."""
        if _all_same(self._table_contents(), self._table_values):
            self._registrations_seen = _registrations[0]  # registered on other modules
            self._classes = list(map(type, self._modules))
            return
        replaced = []
        for k, place in enumerate(self._places):
            new = None if place is None else place[0].get(place[1], None)
            if place is None or new is self.params[k]:
                continue
            if new is None:
                raise StaleResidentError(f"parameter {self.paths[k]!r} was removed from its module{_REBUILD}")
            self._check_fits(k, new, "was replaced by one with")
            replaced.append((k, new))
        for k, new in replaced:  # every one checked before the first is rebound
            self._bind(k, new)
        known = set(map(id, self._other_params))
        self._snapshot()
        # A parameter added since counts as one without a gradient: any it has is new.
        self._other_grads = [g if id(p) in known else None for p, g in zip(self._other_params, self._other_grads)]

    def _follow_moved_storage(self):
        """New storage of the same dtype and shape is copied in and rebound; else raise."""
        moved = [k for k, param in enumerate(self.params) if param.data_ptr() != self._data_ptrs[k]]
        for k in moved:  # every one checked before the first is rebound
            self._check_fits(k, self.params[k], "now has")
        for k in moved:
            self._bind(k, self.params[k])
        self._data_ptrs = list(map(self._data_ptr, self.params))

    def _check_fits(self, k, param, verb):
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

    def _raise_left_out(self):
        for (name, p), grad in zip(self._others, self._other_grads):
            if p.grad is not grad:
                raise StaleResidentError(
                    f"parameter {name!r} is not part of the resident model (it was frozen when "
                    f"gf.resident was called, or added or untied since) and has a new gradient, which "
                    f"the resident model would leave out{_REBUILD}")
