"""Each parameter's ``.grad`` bound to its view of a flat buffer, and what breaks a binding.

A norm over the flat buffers is the norm of the gradients only while every trained
parameter's ``.grad`` is its view. Some changes are taken as torch would take them;
others cannot be, and are reported.

[Note: gradients set to None or replaced]
As torch's ``zero_grad()`` does, :meth:`BindingWatch.zeroed` sets every ``.grad`` to None, so
a torch optimizer skips a parameter that gets no gradient before its step (no momentum, no
weight decay). A hook on each parameter points ``.grad`` at its (zero) view when autograd
is about to accumulate its next gradient, so backward still accumulates in place.
``BindingWatch.expected`` says, per parameter, what its ``.grad`` must be: its view once a
gradient went there since the last zeroing, else None. Anything else was done by someone
else, and gets torch's meaning at the next norm, clip or count (:meth:`BindingWatch.check`,
which compares every ``.grad`` with ``expected`` in one C-level pass, O(parameters)):

- ``.grad`` set to None while its view holds a gradient (``p.grad = None``, torch's
  ``zero_grad()``): the view is zeroed, so the norm and the clip leave that parameter out
  and the optimizer skips it, as torch's would. A backward before that call leaves ``.grad``
  to torch (a new tensor, as torch starts one), taken in as below.
- ``.grad`` replaced by another tensor (``p.grad = p.grad * 0.1``): it is copied into the
  view and ``.grad`` points at the view again, so the norm counts and the clip scales what
  the parameter holds. A backward before that call accumulates into that tensor, as torch's.

Until that call the view keeps what it held, so a gradient kept by reference
(``g = p.grad; p.grad = None``) is intact until the next norm, clip, count or ``zero_()``,
which reuse its memory; keep a ``clone()`` to hold it longer.

Reported instead (:class:`GradientOutsideBufferError`, naming the parameter): a gradient
with an autograd graph of its own (``backward(create_graph=True)``: a copy would cut its
graph), the model converted after the buffers were built (``model.half()``: the hook raises
in the backward that would write a gradient of the new dtype), a sparse gradient arriving
in backward (``nn.Embedding(sparse=True)`` given as a list), a parameter frozen at build
that starts training, the model re-created (the old parameters are freed: they are held
weakly here), torch DDP with ``gradient_as_bucket_view=True`` moving ``.grad`` into its
buckets, ``.grad.data`` replaced, or ``close()``. Each call also checks one parameter per
buffer for a conversion (a whole-model ``model.half()`` before any backward); what broke
and what to do is worked out only when there is something to report.
"""

from __future__ import annotations

import collections
import functools
import gc
import itertools
import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch


class GradientOutsideBufferError(RuntimeError):
    """A parameter's ``.grad`` no longer lives in its flat buffer, so a norm would miss it."""


@dataclass(frozen=True)
class Problem:
    """Why one binding broke: ``text`` has ``{names}`` where the parameter's name goes.

    Problems with the same text are one cause, reported once with all their names.
    """

    fatal: bool  # zero_() cannot repair it
    text: str

    def render(self, names: list[str]) -> str:
        """``text`` for ``names`` (display strings), the first named and the rest counted."""
        shown = names[0]
        if len(names) > 1:
            others = names[1:MAX_NAMES]
            more = len(names) - 1 - len(others)
            listed = ", ".join(others) + (f" and {more} more" if more else "")
            shown += f" (and {listed})"
        return self.text.replace("{names}", shown)


MAX_NAMES = 4  # names shown per cause in a report; the rest are counted
MAX_CAUSES = 3  # causes shown in a report; the rest are counted


@dataclass(eq=False)
class Binding:
    """One trained parameter (held weakly) and the view its ``.grad`` must be."""

    name: str
    pid: int  # id() of the parameter while it lives
    ref: weakref.ref
    dtype: torch.dtype
    shape: torch.Size
    device: torch.device
    view: torch.Tensor
    root: torch.Tensor  # the flat buffer the view is part of
    offset: int  # bytes from the buffer's start to the view's
    index: int  # in BindingWatch.refs, .views and .expected
    taken: bool = False  # a FlatGradBuffers built later over the same parameter took it

    @property
    def ptr(self) -> int:
        """Where the gradient must be now: the buffer's address plus the view's offset.

        From the buffer's current address, so a buffer whose storage is freed and
        reallocated under the same tensors (megatron-core's offload_grad_buffers /
        restore_grad_buffers) stays bound; ``.grad.data = ...`` moves the view away.
        """
        return self.root.data_ptr() + self.offset


def bucket_view_ddps() -> list:
    """Live torch ``DistributedDataParallel`` modules with ``gradient_as_bucket_view=True``.

    DDP keeps no registry of its instances and marks no parameter, so this walks the
    objects the garbage collector tracks (tens to hundreds of milliseconds in a large
    program): called only at construction while a process group exists (DDP needs one),
    and on the error path.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return []
    from torch.nn.parallel import DistributedDataParallel

    kinds: dict[type, bool] = {}
    found = []
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: some lazy objects resolve __class__ on access
        is_ddp = kinds.get(kind)
        if is_ddp is None:
            is_ddp = kinds[kind] = issubclass(kind, DistributedDataParallel)
        if is_ddp and getattr(obj, "gradient_as_bucket_view", False):
            found.append(obj)
    return found


SPARSE_FIX = (
    "build the module with sparse=False, or leave its parameters out of FlatGradBuffers and "
    "step them with their own optimizer (their gradients are then in neither the norm nor "
    "the clip)"
)

BUCKET_VIEW_FIX = (
    "wrap the model with gradient_as_bucket_view=False (DDP's default; DDP then copies the "
    "reduced gradients back into these buffers)"
)


def bucket_view_param_ids() -> set[int]:
    """ids of the parameters of :func:`bucket_view_ddps`' modules."""
    return {id(p) for ddp in bucket_view_ddps() for p in ddp.parameters()}


def refuse_bucket_view_ddp(named: list[tuple[str, torch.Tensor]]) -> None:
    """``ValueError`` if a DDP module with bucket-view gradients holds one of ``named``."""
    wrapped = bucket_view_param_ids()
    for name, p in named:
        if id(p) in wrapped:
            raise ValueError(
                f"parameter {name!r} belongs to a model wrapped in torch "
                "DistributedDataParallel with gradient_as_bucket_view=True, which points .grad "
                f"into DDP's own buckets where these buffers cannot see it: {BUCKET_VIEW_FIX}"
            )


# id(parameter) -> (weak parameter, weak BindingWatch): which open buffers hold each
# parameter's gradient, so that buffers built later over the same parameter can tell the
# earlier ones that it was taken (checked by identity: ids of freed objects are reused).
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _remove_hooks(hooks: list) -> None:
    for handle in hooks:
        handle.remove()
    hooks.clear()


def _hook_on_frozen(p: torch.Tensor, hook: Callable) -> object:
    """Register a post-accumulate hook on a frozen leaf: it fires if ``p`` is unfrozen.

    torch refuses hooks on tensors that do not require grad, but keeps one registered while
    they did: requires_grad is switched on for the registration only.
    """
    p.requires_grad_(True)
    try:
        return p.register_post_accumulate_grad_hook(hook)
    finally:
        p.requires_grad_(False)


class BindingWatch:
    """The bindings of one FlatGradBuffers, the hooks that watch them, and what broke."""

    def __init__(self) -> None:
        self.bindings: dict[int, Binding] = {}
        self.samples: list[Binding] = []  # one per buffer, checked on every call
        # Parameters watched by a hook for ever getting a gradient: frozen at build,
        # registered on a tracked module after it, or stepped by an optimizer without
        # being in these buffers. Each: (weak ref, display name, Problem text).
        self.outsiders: dict[int, tuple[weakref.ref, str, str]] = {}
        self.broken: dict[int, None] = {}  # ids of parameters to diagnose, in order found
        self.closed = False
        self.hooks: list = []
        self._finalizer = weakref.finalize(self, _remove_hooks, self.hooks)
        # [Note: gradients set to None or replaced]. Per binding, in binding order: its weak
        # parameter, its view, and what its .grad must be (the view or None), so that the
        # per-call check and zeroed() walk them without a Python loop.
        self.refs: list[weakref.ref] = []
        self.views: list[torch.Tensor] = []
        self.expected: list[torch.Tensor | None] = []

    # --- building -------------------------------------------------------------------------

    def bind(self, name: str, p: torch.Tensor, view: torch.Tensor) -> None:
        """Point ``p.grad`` at ``view`` (copying an existing gradient) and hook it.

        The hooks keep backward accumulating into ``view`` after :meth:`zeroed` sets
        ``.grad`` to None.
        """
        pid = id(p)
        mine = weakref.ref(self)
        root = view._base if view._base is not None else view
        offset = view.data_ptr() - root.data_ptr()
        index = len(self.refs)

        def attach(grad: torch.Tensor) -> None:
            # Runs just before autograd accumulates into .grad (one hook per parameter and
            # backward; the usual paths cost an identity test or two): a .grad that is None
            # since zeroed() becomes the (zero) view, so the accumulation lands in the
            # buffer. One that someone else set to None or replaced is left to torch, and
            # taken in at the next call.
            watch = mine()
            if watch is None:
                return
            q = ref()
            if q is None or binding.taken:  # gone (its hook with it), or another's now
                return
            if grad.layout is not _STRIDED:
                raise GradientOutsideBufferError(
                    f"parameter {name!r} received a {grad.layout} gradient "
                    "(nn.Embedding(sparse=True)?), which its flat buffer would make dense "
                    f"(torch.optim.SparseAdam then refuses it): {SPARSE_FIX}"
                )
            now = q.grad
            if now is None and watch.expected[index] is None:
                try:
                    q.grad = view
                except RuntimeError:  # torch refuses the view of a converted parameter
                    watch.refuse_converted(binding, q)
                    raise
                watch.expected[index] = view
            elif now is not view or view.data_ptr() != root.data_ptr() + offset:
                # set to None or replaced (torch's to handle), or .grad.data replaced
                watch.refuse_converted(binding, q)
                if now is view:
                    watch.broken[pid] = None

        def freed(_ref, pid=pid) -> None:
            watch = mine()
            if watch is not None:
                watch.broken[pid] = None
            owner = _OWNERS.get(pid)
            if owner is not None and owner[0] is _ref:
                del _OWNERS[pid]

        self.hooks.append(p.register_hook(attach))
        ref = weakref.ref(p, freed)
        binding = Binding(name, pid, ref, p.dtype, p.shape, p.device, view, root, offset, index)
        self.refs.append(ref)
        self.views.append(view)
        if p.grad is not None:
            view.copy_(p.grad)
        p.grad = view
        self.expected.append(view)
        self.bindings[pid] = binding

    def claim(self) -> int:
        """Register these bindings as the owners of their parameters' gradients.

        Bindings of other open buffers over the same parameters are marked taken (their
        next call raises, naming this cause). Returns how many were taken.
        """
        mine = weakref.ref(self)
        taken = 0
        for pid, b in self.bindings.items():
            owner = _OWNERS.get(pid)
            other = None if owner is None or owner[0]() is not b.ref() else owner[1]()
            if other is not None and other is not self and not other.closed:
                theirs = other.bindings.get(pid)
                if theirs is not None and not theirs.taken:
                    theirs.taken = True
                    other.broken[pid] = None
                    taken += 1
            _OWNERS[pid] = (b.ref, mine)
        return taken

    def watch_outsider(self, p: torch.Tensor, name: str, reason: str) -> None:
        """Report ``reason`` (with ``{names}`` for ``name``) if ``p`` ever receives a gradient.

        ``p`` may be frozen (a hook fires if it is unfrozen and trained) or trainable.
        """
        pid = id(p)
        if pid in self.outsiders or pid in self.bindings:
            return
        mine = weakref.ref(self)

        def received(q: torch.Tensor) -> None:
            watch = mine()
            if watch is not None and q.grad is not None:
                watch.broken[pid] = None

        if p.requires_grad:
            self.hooks.append(p.register_post_accumulate_grad_hook(received))
        else:
            self.hooks.append(_hook_on_frozen(p, received))
        self.outsiders[pid] = (weakref.ref(p), name, reason)

    def refuse_converted(self, b: Binding, p: torch.Tensor) -> None:
        """``GradientOutsideBufferError`` if ``p``'s dtype, device or shape changed since
        ``b`` was bound (named, with both), before torch refuses a gradient without a name."""
        if p.dtype is not b.dtype or p.shape != b.shape or p.device != b.device:
            self.broken[b.pid] = None
            raise GradientOutsideBufferError(self.message(b.pid))

    def message(self, pid: int) -> str:
        """The report for one broken binding or watched outsider, on its own."""
        name, problem = self.diagnose(pid, bucket_view_param_ids)
        return "" if problem is None else problem.render([name])

    def undo(self, grads: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """Put back ``(parameter, .grad)`` pairs and remove every hook (a failed build)."""
        for p, grad in grads:
            p.grad = grad
        _remove_hooks(self.hooks)

    def zeroed(self, set_to_none: bool) -> None:
        """After the buffers were zeroed: every ``.grad`` None, or its (zero) view.

        One C-level pass (``map``), no Python loop over the parameters. Raises for what
        setting ``.grad`` cannot repair (a conversion, a freed parameter, ...); a ``.grad``
        set to None or replaced needs nothing: it is set like every other.
        """
        if self.broken or self.closed or not self._samples_bound():
            self.scan()
            self._raise_problems(fatal_only=True)
        params = map(operator.call, self.refs)  # all alive: a freed one raised above
        grads = itertools.repeat(None) if set_to_none else self.views
        try:
            collections.deque(map(setattr, params, itertools.repeat("grad"), grads), maxlen=0)
        except RuntimeError:  # torch refuses the view of a converted parameter: name it
            self.scan()
            self._raise_problems(fatal_only=True)
            raise
        self.expected = [None] * len(self.views) if set_to_none else list(self.views)

    def pick_samples(self) -> None:
        """Check one parameter per buffer on every call: the first of each dtype."""
        firsts: dict[torch.dtype, Binding] = {}
        for b in self.bindings.values():
            if b.view.numel():
                firsts.setdefault(b.dtype, b)
        self.samples = list(firsts.values())

    # --- checking -------------------------------------------------------------------------

    def check(self) -> None:
        """The per-call check: every ``.grad`` as expected, or taken in as torch would.

        One C-level pass over the ``.grad`` of every parameter (identity with
        ``expected``), plus one parameter per buffer for a conversion. Otherwise: what
        :meth:`settle` does.
        """
        if (
            self.broken
            or self.closed
            or not all(map(operator.is_, map(_GRAD, map(operator.call, self.refs)), self.expected))
            or not self._samples_bound()
        ):
            self.settle()

    def _samples_bound(self) -> bool:
        for b in self.samples:
            if self._escaped(b):
                self.broken[b.pid] = None
                return False
        return True

    def _escaped(self, b: Binding) -> bool:
        """Whether ``b``'s ``.grad`` is not what :attr:`expected` says (its view or None)."""
        p = b.ref()
        if p is None or b.taken:
            return True
        if p.dtype is not b.dtype or p.shape != b.shape or p.device != b.device:
            return True
        # None: no gradient since zeroed() unless its view took one; the view where None
        # was expected: put back by hand, taken in as bound
        return p.grad is not self.expected[b.index] or (
            p.grad is not None and p.grad.data_ptr() != b.ptr
        )

    def settle(self) -> None:
        """Take every ``.grad`` set to None or replaced in as torch would, or raise.

        One pass over the parameters. Raises ``GradientOutsideBufferError`` (touching
        nothing) if any binding broke in a way that cannot be taken in; otherwise each
        ``.grad`` set to None has its view zeroed, and each replaced one is copied into its
        view, which ``.grad`` is again ([Note: gradients set to None or replaced]).
        """
        self.scan()
        self._raise_problems(fatal_only=False)
        with torch.no_grad():
            for pid in self.broken:
                self._take_in(self.bindings[pid])
        self.broken.clear()

    def _take_in(self, b: Binding) -> None:
        p = b.ref()
        if p is None:  # freed: raised before, as a problem
            return
        grad = p.grad
        if grad is None:
            b.view.zero_()  # left out of the norm and the clip, and skipped by the step
            self.expected[b.index] = None
            return
        if grad is not b.view:
            b.view.copy_(grad)
            p.grad = b.view
        self.expected[b.index] = b.view

    def scan(self) -> None:
        """Mark every broken binding, one pass over the parameters."""
        for pid, b in self.bindings.items():
            if self._escaped(b):
                self.broken[pid] = None
        for pid, (ref, _, _) in self.outsiders.items():
            p = ref()
            if p is not None and p.requires_grad and p.grad is not None:
                self.broken[pid] = None

    def close(self) -> None:
        self._finalizer()
        self.closed = True

    # --- reporting ------------------------------------------------------------------------

    def diagnose(self, pid: int, wrapped: Callable[[], set[int]]) -> tuple[str, Problem | None]:
        """``(name, problem)`` for a broken binding, the name as a report shows it.

        ``problem`` is None for a ``.grad`` set to None or replaced, which :meth:`settle`
        takes in. ``wrapped``: :func:`bucket_view_param_ids`, memoised by the caller (one
        walk of the garbage collector's objects per report, not per parameter).
        """
        if pid in self.outsiders:
            _, name, reason = self.outsiders[pid]
            return name, Problem(True, reason)
        b = self.bindings[pid]
        name = repr(b.name)
        p = b.ref()
        if b.taken:
            return name, Problem(
                True,
                "parameter {names} was taken by a FlatGradBuffers built later over the same "
                "parameters, so its gradient now accumulates in that one's buffers, not in "
                "these: use the newest FlatGradBuffers only (close() this one, or let it go)",
            )
        if p is None:
            return name, Problem(
                True,
                "parameter {names} was freed after these FlatGradBuffers were built (was "
                "the model re-created, or its parameters replaced, e.g. by "
                "load_state_dict(..., assign=True)?), so they no longer hold the gradients "
                "being trained: build a new FlatGradBuffers over the current parameters",
            )
        was, now = (b.dtype, b.device, b.shape), (p.dtype, p.device, p.shape)
        if was != now:
            return name, Problem(
                True,
                f"parameter {{names}} changed from {_describe(was, now)} to "
                f"{_describe(now, was)} after these FlatGradBuffers were built (model.half(), "
                ".double(), .to(...)?), so its gradient can no longer live in their buffers: "
                "convert the model first, then build a new FlatGradBuffers",
            )
        if b.view.data_ptr() != b.ptr:
            return name, Problem(
                True,
                "the storage of the gradient of parameter {names} was replaced (.grad.data "
                "assigned, e.g. by module.to(memory_format=...)?): build a new FlatGradBuffers "
                "after changing the model",
            )
        grad = p.grad
        if grad is None or grad is b.view:
            return name, None
        if grad._base is not None and id(p) in wrapped():
            return name, Problem(
                True,
                "the gradient of {names} was moved into a bucket of torch "
                "DistributedDataParallel (gradient_as_bucket_view=True), where these buffers "
                f"cannot see it: {BUCKET_VIEW_FIX}",
            )
        if grad.requires_grad:
            return name, Problem(
                False,
                "the gradient of {names} has an autograd graph of its own (backward with "
                "create_graph=True, where autograd adds out of place, or a .grad assigned "
                "from a tensor that requires grad), which a copy into the flat buffer would "
                "cut: take higher-order gradients with torch.autograd.grad(..., "
                "create_graph=True) instead, or assign a detached tensor; zero_() re-binds it",
            )
        return name, None

    def _raise_problems(self, fatal_only: bool) -> None:
        """Raise for the broken bindings (after :meth:`scan`) that cannot be taken in, or
        with ``fatal_only`` for those ``zero_()`` cannot repair (and then forget the rest)."""
        if self.closed:
            raise GradientOutsideBufferError(
                "these FlatGradBuffers were closed (close(), or the end of their with block): "
                "their hooks are gone, so a gradient set to None or replaced since would be "
                "missed without a word: build a new FlatGradBuffers"
            )
        wrapped = functools.cache(bucket_view_param_ids)
        causes: dict[Problem, list[str]] = {}
        # names in the order the parameters were given, then as outsiders were found
        order = {pid: i for i, pid in enumerate([*self.bindings, *self.outsiders])}
        for pid in sorted(self.broken, key=order.__getitem__):
            name, problem = self.diagnose(pid, wrapped)
            if problem is not None:
                causes.setdefault(problem, []).append(name)
        if any(problem.fatal or not fatal_only for problem in causes):
            raise GradientOutsideBufferError(_report(causes))
        if fatal_only:
            self.broken.clear()


def _report(causes: dict[Problem, list[str]]) -> str:
    """What broke, one line per cause (those ``zero_()`` cannot repair first)."""
    ordered = sorted(causes.items(), key=lambda c: not c[0].fatal)
    lines = [problem.render(names) for problem, names in ordered[:MAX_CAUSES]]
    if len(ordered) > MAX_CAUSES:
        rest = sum(len(names) for _, names in ordered[MAX_CAUSES:])
        others = len(ordered) - MAX_CAUSES
        lines.append(
            f"and {rest} more parameter{'s' * (rest > 1)} with "
            f"{'another cause' if others == 1 else f'{others} other causes'}: "
            "fgb.check_bindings() reports them once these are fixed"
        )
    return "\n".join(lines)


_GRAD = operator.attrgetter("grad")
_STRIDED = torch.strided


def _describe(this: tuple, other: tuple) -> str:
    """``(dtype, device, shape)`` as text; the shape only where it differs from ``other``."""
    dtype, device, shape = this
    return f"{dtype} {tuple(shape)} on {device}" if shape != other[2] else f"{dtype} on {device}"
