"""The clip, composed once: a bound call's norm, its non-finite check, its scale.

Every front end binds its gradients into a :class:`Bound` (a tree's walk in
``gpuflat._src.binding``, a tensor list's table in ``gpuflat._src.tensor_table``,
a resident model's dtype buffers, one rank's share of a model spread over
ranks in ``gpuflat._src.ranks``), and :func:`clip_` and :func:`total_norm`
here do the rest, as PyTorch composes ``clip_grad_norm_`` from
``get_total_norm`` and ``clip_grads_with_norm_``. So every front end checks
before it writes, reads the norm on the host only when asked to check it,
names a leaf only when the norm is not finite, and raises the same error.

The bits: every front end hands its backend the leaves of one device as one
plan, in the order a tree of them has, so each norm is one fused pass in
the one summation order kernels/norms.cu writes down (the host, CUDA and
emulated backends follow it; NumPy's own order likewise depends on nothing
but the leaves): a tree, a tensor list, a resident model (its leaves'
places in its buffers) and ``gpuflat._src.ranks`` on one rank give the
same bits on the same arrays, and the pass's first non-finite slot names
the same leaf. Only parts on several devices or ranks are combined after
their passes (``Bound.combine``, ``gpuflat._src.ranks``).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from . import arrays as _arrays
from ..errors import NonFiniteError


class Part(NamedTuple):
    """One backend call's share of a bound call: ``leaves`` (arrays, or
    LeafRows) of ``plan`` on ``backend``, their work placed by ``like`` (one
    of the caller's objects, or None; see ``arrays.device_scope``), read
    from ``flat`` where they lie in one (a resident model's buffer).

    ``path(slot)`` names a slot's leaf in errors; ``positions``, where the
    parts split one list of the caller's, each slot's place in it, so that
    the first leaf named is the caller's first (else the parts' order).
    """

    plan: Any
    leaves: Any
    backend: Any
    like: Any = None
    flat: Any = None
    path: Callable[[int], str] | None = None
    positions: Sequence[int] | None = None

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        """Where this part's work runs (``arrays.device_scope``)."""
        return _arrays.device_scope(self.backend, self.like)

    def result(self, x: Any) -> Any:
        """``x`` (the backend's) in the kind of the caller's objects."""
        return x if self.like is None else _arrays.to_caller(x, self.like)


_NOWHERE = contextlib.nullcontext()  # reusable: it holds nothing


class Norm(NamedTuple):
    """A bound call's norm: ``total`` in the caller's kind (what is
    returned); ``on_backend``, the same as the backend's own 0-d array where
    every scaled part reads it as it is (one place), else None; ``results``,
    each norm part's ``NormResult``."""

    total: Any
    on_backend: Any
    results: list[Any]


class Bound:
    """A call's gradients bound once: the parts whose norms make the total
    (``norm_parts``), the parts scaled (``scale_parts``, the same by
    default), how the parts' totals ``combine`` (called with the bound, the
    results and p, in the call's place, giving the total in the caller's
    kind and on the backend, or None; None for one part: its own),
    ``ranks`` where the norm spans ranks, and ``total_for(part, total)``,
    a total given in the caller's kind as ``part``'s backend reads it.

    Where every part works in one place (one backend, one ``like``),
    :meth:`place` enters it once for the whole call.

    >>> import numpy as np, gpuflat as gf
    >>> from gpuflat._src.backends import get_backend
    >>> g = [np.array([3.0, 4.0])]
    >>> bound = Bound([Part(gf.plan(g), g, get_backend("numpy"))])
    >>> float(clip_(bound, 1.0, 2.0, 0.0, False)), g[0]
    (5.0, array([0.6, 0.8]))
    """

    ranks: int | None = None

    def __init__(self, norm_parts: list[Part], scale_parts: list[Part] | None = None,
                 combine: Callable[[Bound, list[Any], float], tuple[Any, Any]] | None = None,
                 total_for: Callable[[Part, Any], Any] | None = None) -> None:
        self.norm_parts = norm_parts
        self.scale_parts = norm_parts if scale_parts is None else scale_parts
        self.combine, self.total_for = combine, total_for
        first = norm_parts[0]
        self.one_place = True
        for part in norm_parts + self.scale_parts:  # a plain loop: a tree binds on every clip
            if part.backend is not first.backend or part.like is not first.like:
                self.one_place = False

    def place(self) -> contextlib.AbstractContextManager[Any]:
        """The call's one place, entered once; nothing where parts differ."""
        first = self.norm_parts[0]
        return _arrays.device_scope(first.backend, first.like) if self.one_place else _NOWHERE

    def within(self, part: Part) -> contextlib.AbstractContextManager[Any]:
        """Where ``part``'s work runs, inside :meth:`place`."""
        return _NOWHERE if self.one_place else part.scope()

    def norm(self, p: float, per_leaf: bool = False) -> Norm:
        """The float64 norm of order ``p`` of every norm part as one vector:
        one fused pass per part, then the combine (none for one part); with
        ``per_leaf``, each part's result holds its leaves' norms too."""
        results: list[Any] = []
        for part in self.norm_parts:
            with self.within(part):
                results.append(part.backend.norms(part.plan, part.leaves, p, per_leaf))
        if self.combine is None:
            total, like = results[0].total, self.norm_parts[0].like
            return Norm(total if like is None else _arrays.to_caller(total, like), total, results)
        total, on_backend = self.combine(self, results, p)
        return Norm(total, on_backend, results)

    def finite(self, norm: Norm) -> bool:
        """Whether the norm is finite: a host read of it (a synchronisation)."""
        if norm.on_backend is None:
            return math.isfinite(float(norm.total))
        return math.isfinite(float(self.norm_parts[0].backend.to_host(norm.on_backend)))

    def culprit(self, norm: Norm, p: float, name_of: Callable[[int], str] | None = None) -> str | None:
        """``"leaf 'path'"`` for the first leaf holding NaN or inf, or None;
        ``name_of(i)`` names the caller's i-th leaf where a part has no
        ``path`` but ``positions`` (a tensor list's)."""
        found: list[tuple[Any, str]] = []
        for k, (part, result) in enumerate(zip(self.norm_parts, norm.results)):
            with self.within(part):
                bad = int(part.backend.to_host(result.first_nonfinite))
            if bad >= 0:
                at = (k, bad) if part.positions is None else part.positions[bad]
                if part.path is not None:
                    name = part.path(bad)
                else:
                    # A part without paths is a share of the caller's list: it has
                    # positions, and the caller names them.
                    assert part.positions is not None and name_of is not None
                    name = name_of(part.positions[bad])
                found.append((at, name))
        return f"leaf {min(found)[1]!r}" if found else None

    def scale_(self, norm: Norm, max_norm: Any, eps: float) -> None:
        """Scale every scale part in place by min(1, max_norm / (norm + eps))."""
        converted_for = given = None
        for part in self.scale_parts:
            with self.within(part):
                if norm.on_backend is not None:
                    total = norm.on_backend
                else:
                    # A total given in the caller's kind: the bounds that take one say how.
                    assert self.total_for is not None
                    total = self.total_for(part, norm.total)
                if part.backend is not converted_for:  # parts of one backend take one conversion
                    converted_for, given = part.backend, max_norm_for(part.backend, max_norm)
                part.backend.clip_(part.plan, part.leaves, total, given, eps, flat=part.flat)


def total_norm(bound: Bound, p: float, error_if_nonfinite: bool = False, kind: type = NonFiniteError,
               name_of: Callable[[int], str] | None = None) -> Norm:
    """``bound``'s norm; with ``error_if_nonfinite``, ``kind`` raised naming
    the first leaf holding NaN or inf where it is not finite (``name_of``:
    see :meth:`Bound.culprit`).

    >>> import numpy as np, gpuflat as gf
    >>> from gpuflat._src.backends import get_backend
    >>> g = [np.ones(1), np.array([np.inf])]
    >>> total_norm(Bound([Part(gf.plan(g), g, get_backend("numpy"), path=str)]), 2.0, True)
    Traceback (most recent call last):
    ...
    gpuflat.errors.NonFiniteError: leaf '1' holds NaN or inf; the total 2-norm is non-finite (error_if_nonfinite=True; set it to False to return the non-finite norm)
    """
    with bound.place():
        norm = bound.norm(p)
        if error_if_nonfinite:
            _check_finite(bound, norm, p, False, kind, name_of)
    return norm


def clip_(bound: Bound, max_norm: Any, p: float, eps: float, error_if_nonfinite: bool,
          kind: type = NonFiniteError, name_of: Callable[[int], str] | None = None) -> Any:
    """Scale ``bound``'s scale parts in place by min(1, max_norm / (norm + eps));
    return the norm in the caller's kind.

    PyTorch's semantics: the factor is always applied, with no branch on a
    device value, so no host synchronisation; a NaN norm makes the
    gradients NaN. With ``error_if_nonfinite`` the norm is read first, and
    a non-finite one raises ``kind`` naming the first leaf holding NaN or
    inf (``name_of``: see :meth:`Bound.culprit`), with nothing scaled.

    >>> import numpy as np, gpuflat as gf
    >>> from gpuflat._src.backends import get_backend
    >>> g = [np.array([np.nan, 1.0])]
    >>> clip_(Bound([Part(gf.plan(g), g, get_backend("numpy"), path=str)]), 1.0, 2.0, 1e-6, True)
    Traceback (most recent call last):
    ...
    gpuflat.errors.NonFiniteError: leaf '0' holds NaN or inf; the total 2-norm is non-finite, so no gradient was scaled (error_if_nonfinite=True; set it to False to scale by the non-finite norm anyway)
    >>> g
    [array([nan,  1.])]
    """
    with bound.place():
        norm = bound.norm(p)
        if error_if_nonfinite:
            _check_finite(bound, norm, p, True, kind, name_of)
        bound.scale_(norm, max_norm, eps)
    return norm.total


def step_(norm: Callable[[], tuple[Any, Any]], update: Callable[[Any, Any], None], *, reads_norm: bool,
          unscale: Callable[[Any], Any] | None = None) -> tuple[Any, Any]:
    """One optimizer step, composed once for every front end
    (``gpuflat.torch``'s eager and compiled steps, ``gpuflat.optim``'s), as
    :func:`clip_` composes a clip: where the step reads the norm (it clips,
    or a loss scaler leaves its NaN and inf check to the norm pass),
    ``norm()`` gives the gradients' norm and their non-finite flag from one
    pass, plain or over ranks as the front end bound them; the norm is then
    unscaled (``unscale(total)``, a loss scaler's 1 / scale: the norm
    returned is that of the gradients ``GradScaler.unscale_`` would give);
    then ``update(total, flag)`` runs the fused update, which clips by the
    total, unscales each gradient and skips on the device where the flag
    (or the scaler's own) says so. Returns (the norm or None, the flag or
    None).

    >>> calls = []
    >>> step_(lambda: (4.0, 0.0), lambda t, f: calls.append((t, f)), reads_norm=True, unscale=lambda t: t / 2)
    (2.0, 0.0)
    >>> step_(lambda: (4.0, 0.0), lambda t, f: calls.append((t, f)), reads_norm=False)
    (None, None)
    >>> calls
    [(2.0, 0.0), (None, None)]
    """
    total = flag = None
    if reads_norm:
        total, flag = norm()
        if unscale is not None:
            total = unscale(total)
    update(total, flag)
    return total, flag


def scale_by(bound: Bound, total: Any, max_norm: Any, eps: float) -> None:
    """Scale ``bound``'s scale parts in place by min(1, max_norm / (total + eps)),
    ``total`` a norm given in the caller's kind (reduced elsewhere, say).

    >>> import torch
    >>> from gpuflat._src import tensor_table
    >>> ts = [torch.tensor([3.0, 4.0])]
    >>> scale_by(tensor_table.read(ts, str, in_place=True).bound, torch.tensor(5.0), 1.0, 0.0)
    >>> ts[0]
    tensor([0.6000, 0.8000])
    """
    with bound.place():
        bound.scale_(Norm(total, None, []), max_norm, eps)


def _check_finite(bound: Bound, norm: Norm, p: float, scaled: bool, kind: type,
                  name_of: Callable[[int], str] | None) -> None:
    # The norm itself is read: finite leaves whose sum overflows float64 give
    # an inf norm too, and PyTorch raises on that. Only a non-finite norm costs
    # a second read, to name the leaf.
    if not bound.finite(norm):
        raise nonfinite_error(p, bound.culprit(norm, p, name_of), ranks=bound.ranks, scaled=scaled, kind=kind)


def max_norm_for(backend: Any, max_norm: Any) -> Any:
    """``max_norm`` as ``backend.clip_`` takes it: a float, or, when it is a
    0-d device tensor and the backend runs on that device, a 0-d float64
    array of the backend's that the kernel reads, so that no value crosses
    to the host and a captured CUDA graph reads its current value at every
    replay. Called inside the call's device scope: the cast runs on its
    stream.

    >>> import numpy as np
    >>> from gpuflat._src.backends import get_backend
    >>> max_norm_for(get_backend("numpy"), np.float32(0.5))
    0.5
    """
    if isinstance(max_norm, float):
        return max_norm
    if backend.name != "cuda":
        return float(max_norm)  # host memory, or a device value for a host backend: one read
    found, expected = _device_index(max_norm), backend.runtime.device.id
    if found != expected:
        raise ValueError(f"max_norm: expected a number or a 0-d tensor on CUDA device {expected}, the "
                         f"gradients' device, got one on CUDA device {found}")
    if _arrays.kind(max_norm) == "torch":
        import torch

        return _arrays.adopt(max_norm.detach().to(torch.float64))
    return max_norm.astype(np.float64, copy=False)


def _device_index(x: Any) -> int:
    """The CUDA device of a CuPy array or a PyTorch CUDA tensor."""
    return x.device.index if _arrays.kind(x) == "torch" else x.device.id


def nonfinite_error(p: float, culprit: str | None, *, ranks: int | None = None, scaled: bool = True,
                    kind: type = NonFiniteError) -> NonFiniteError:
    """The one error a norm or clip with ``error_if_nonfinite`` raises, in
    every front end: ``culprit`` names the first leaf holding NaN or inf
    (and its rank, over many), None where none does and the sum overflowed
    float64; ``ranks``, the ranks a global norm spans; ``scaled``, whether
    the call would have scaled; ``kind``, the class (``NonFiniteNormError``
    for PyTorch's drop-ins, a RuntimeError as PyTorch raises).

    >>> print(nonfinite_error(2.0, "leaf '[1]'"))
    leaf '[1]' holds NaN or inf; the total 2-norm is non-finite, so no gradient was scaled (error_if_nonfinite=True; set it to False to scale by the non-finite norm anyway)
    >>> print(nonfinite_error(1.0, None, ranks=4, scaled=False))
    no leaf holds NaN or inf, but the sum overflowed float64; the global 1-norm over 4 ranks is non-finite (error_if_nonfinite=True; set it to False to return the non-finite norm)
    """
    what = f"{culprit} holds NaN or inf" if culprit else "no leaf holds NaN or inf, but the sum overflowed float64"
    norm = f"the total {p:g}-norm" if ranks is None else f"the global {p:g}-norm over {ranks} ranks"
    then = "" if not scaled else ", so no gradient was scaled" + ("" if ranks is None else " on any rank")
    instead = "scale by the non-finite norm anyway" if scaled else "return the non-finite norm"
    return kind(f"{what}; {norm} is non-finite{then} (error_if_nonfinite=True; set it to False to {instead})")
