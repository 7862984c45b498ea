"""Each parameter's ``.grad`` bound to its view of a flat buffer, and what breaks a binding.

A norm over the flat buffers is the norm of the gradients only while every trained
parameter's ``.grad`` is its view. That breaks when ``.grad`` is set to None or reassigned,
when the model is converted after the buffers were built (``model.half()`` replaces each
``.grad``'s storage), when a parameter frozen at build starts training, when the model is
re-created (the old parameters are freed: they are held weakly here), when torch DDP with
``gradient_as_bucket_view=True`` moves ``.grad`` into its buckets, or after ``close()``.

As torch's ``zero_grad()`` does, :meth:`BindingWatch.zeroed` sets every ``.grad`` to None, so
a torch optimizer skips a parameter that gets no gradient before its step (no momentum, no
weight decay). A hook on each parameter points ``.grad`` at its (zero) view when autograd
is about to accumulate its next gradient, so backward still accumulates in place. Which
None is ours and which is someone else's is told by a generation count: ``zeroed()``
advances it, and a parameter whose ``.grad`` was pointed at its view in the current
generation and is None again was cleared by someone else (``zero_grad(set_to_none=True)``,
``.grad = None``) while its view still holds that gradient: reported, never re-bound.
[Note: gradients set to None between steps]

None of that is checked per parameter per step. The same hooks notice a broken binding
during the backward that would write the gradient elsewhere; a weak reference notices
a freed parameter; each call checks one parameter per buffer (O(buffers), which catches a
whole-model conversion or ``zero_grad(set_to_none=True)`` before any backward); and
:meth:`BindingWatch.check_all` walks every parameter where the caller asks for it. What
broke and what to do is worked out only when there is something to report.
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
    index: int  # in BindingWatch.bound_in
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
        # [Note: gradients set to None between steps]. Per binding, in binding order: the
        # generation in which its .grad was last pointed at its view; its weak parameter
        # and its view, so that zeroed() sets every .grad without a Python loop.
        self.generation = 0
        self.bound_in: list[int] = []
        self.refs: list[weakref.ref] = []
        self.views: list[torch.Tensor] = []

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
            # backward, which also checks the binding): a None .grad becomes the view (zero
            # since zeroed()), so the accumulation lands in the buffer.
            watch = mine()
            if watch is None:
                return
            q = ref()
            if q is None:  # the parameter is gone; its hook with it
                return
            now = q.grad
            if now is None:
                if binding.taken:
                    return
                if watch.bound_in[index] == watch.generation:
                    watch.broken[pid] = None  # cleared by someone else: the view is stale
                    return
                q.grad = view
                watch.bound_in[index] = watch.generation
            elif now.data_ptr() != root.data_ptr() + offset:
                watch.broken[pid] = None
            if torch.is_grad_enabled():  # create_graph=True: autograd adds out of place
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
        self.bound_in.append(self.generation)
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

    def outsider_message(self, pid: int) -> str:
        """The report for one watched outsider, on its own."""
        _, name, reason = self.outsiders[pid]
        return Problem(True, reason).render([name])

    def undo(self, grads: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """Put back ``(parameter, .grad)`` pairs and remove every hook (a failed build)."""
        for p, grad in grads:
            p.grad = grad
        _remove_hooks(self.hooks)

    def zeroed(self, set_to_none: bool) -> None:
        """After the buffers were zeroed: every ``.grad`` None, or its (zero) view.

        One C-level pass (``map``), no Python loop over the parameters; raises what
        :meth:`rebind` raises for a binding that cannot be repaired.
        """
        if not self.intact():  # usually intact: no per-parameter work per step
            self.scan()  # find every escaped gradient, not only the sampled one
            self.rebind()
        self.generation += 1
        params = map(operator.call, self.refs)  # all alive: a freed one raised above
        grads = itertools.repeat(None) if set_to_none else self.views
        collections.deque(map(setattr, params, itertools.repeat("grad"), grads), maxlen=0)
        if not set_to_none:
            self.bound_in = [self.generation] * len(self.bound_in)

    def pick_samples(self) -> None:
        """Check one parameter per buffer on every call: the first of each dtype."""
        firsts: dict[torch.dtype, Binding] = {}
        for b in self.bindings.values():
            if b.view.numel():
                firsts.setdefault(b.dtype, b)
        self.samples = list(firsts.values())

    # --- checking -------------------------------------------------------------------------

    def intact(self) -> bool:
        """The per-call check: nothing reported broken, and each sample still bound."""
        if self.broken or self.closed:
            return False
        for b in self.samples:
            if self._escaped(b):
                self.broken[b.pid] = None
                return False
        return True

    def _escaped(self, b: Binding) -> bool:
        """Whether ``b``'s gradient is not where the norm reads it (its view)."""
        p = b.ref()
        if p is None or b.taken:
            return True
        grad = p.grad
        if grad is None:  # no gradient yet unless one was accumulated since zeroed()
            return self.bound_in[b.index] == self.generation
        return grad.data_ptr() != b.ptr or p.dtype != b.dtype

    def check_all(self) -> None:
        """Every parameter, once (``check_bindings``); raises what :meth:`raise_broken` does."""
        self.scan()
        if not self.intact():
            self.raise_broken()

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

    def diagnose(self, pid: int, wrapped: Callable[[], set[int]]) -> tuple[str, Problem]:
        """``(name, problem)`` for a broken binding, the name as a report shows it.

        ``wrapped``: :func:`bucket_view_param_ids`, memoised by the caller (one walk of
        the garbage collector's objects per report, not per parameter).
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
                ".double(), .to(...)?), so its gradient is no longer in their buffers: convert "
                "the model first, then build a new FlatGradBuffers",
            )
        if b.view.data_ptr() != b.ptr:
            return name, Problem(
                True,
                "the storage of the gradient of parameter {names} was replaced (.grad.data "
                "assigned, e.g. by module.to(memory_format=...)?): build a new FlatGradBuffers "
                "after changing the model",
            )
        grad = p.grad
        if grad is not None and grad._base is not None and id(p) in wrapped():
            return name, Problem(
                True,
                "the gradient of {names} was moved into a bucket of torch "
                "DistributedDataParallel (gradient_as_bucket_view=True), where these buffers "
                f"cannot see it: {BUCKET_VIEW_FIX}",
            )
        return name, Problem(
            False,
            "the gradient of {names} no longer lives in its flat buffer (was .grad set to "
            "None, e.g. by zero_grad(set_to_none=True), or reassigned?), so the norm would "
            "miss it. Zero gradients with FlatGradBuffers.zero_() (or "
            "zero_grad(set_to_none=False)) instead; zero_() also re-binds them",
        )

    def report(self) -> str:
        """What broke, one line per cause (those ``zero_()`` cannot repair first)."""
        wrapped = functools.cache(bucket_view_param_ids)
        causes: dict[Problem, list[str]] = {}
        # names in the order the parameters were given, then as outsiders were found
        order = {pid: i for i, pid in enumerate([*self.bindings, *self.outsiders])}
        for pid in sorted(self.broken, key=order.__getitem__):
            name, problem = self.diagnose(pid, wrapped)
            causes.setdefault(problem, []).append(name)
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

    def raise_broken(self) -> None:
        if self.closed:
            raise GradientOutsideBufferError(
                "these FlatGradBuffers were closed (close(), or the end of their with block): "
                "their hooks are gone, so a gradient set to None or replaced since would be "
                "missed without a word: build a new FlatGradBuffers"
            )
        raise GradientOutsideBufferError(self.report())

    def rebind(self) -> None:
        """Forget repairable breaks (:meth:`zeroed` sets every ``.grad``), or raise."""
        wrapped = functools.cache(bucket_view_param_ids)
        if self.closed or any(self.diagnose(pid, wrapped)[1].fatal for pid in self.broken):
            self.raise_broken()
        self.broken.clear()


def _describe(this: tuple, other: tuple) -> str:
    """``(dtype, device, shape)`` as text; the shape only where it differs from ``other``."""
    dtype, device, shape = this
    return f"{dtype} {tuple(shape)} on {device}" if shape != other[2] else f"{dtype} on {device}"
