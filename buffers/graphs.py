"""Norm and clip over fixed flat-buffer spans, replayed as CUDA graphs on CUDA.

The spans of a flat buffer never move, so the launches of a norm or a clip (one fused
kernel per buffer plus a few scalar ops) are the same every step. :class:`NormClip` runs
them eagerly the first time (Triton compiles, caches fill), captures them as a CUDA graph
the second time, and from then on replays the graph: one host call instead of one per
launch. The result is the same launches on the same data, so the same bits.

Replay is skipped (plain eager launches) on the CPU, while a CUDA graph is being captured
by the caller (the caller's capture then records the launches themselves), with
``cuda_graphs=False`` (:class:`buffers.options.BufferOptions`, or ``BUFFERS_CUDA_GRAPHS=0``),
and for a sequence whose capture failed once (a warning says why). Results are returned as
fresh tensors: a graph's output tensor is rewritten by the next replay, so it is never
handed out.

A norm or clip reduced over a process group (:meth:`NormClip.clip_reduced_`,
:meth:`NormClip.norm_reduced`) captures the all-reduce in the same graph when the group is
NCCL's (:func:`reduce_capturable`; ``graph_collectives=False`` keeps it outside): the
whole sequence is then one replay. Every rank captures at the same call (the second) and
runs the reduction once per call, eagerly or replayed, so the ranks' collectives still
match one for one.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import torch
from torch.profiler import record_function

from . import ops
from .options import DEFAULT, BufferOptions

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

# Profiler ranges (as FSDP2's "FSDP::..."), around the launches only: entering one is a
# host-side record, no device work and no sync. The norm's (the local statistic, the
# reduction when it runs between replays, the root), and the clip's (norm and scale, or the
# scale by a given norm, or the fold's coefficient).
NORM_RANGE = "buffers::grad_norm"
CLIP_RANGE = "buffers::clip"
_NO_RANGE = contextlib.nullcontext()


def profiler_range(name: str) -> contextlib.AbstractContextManager:
    """A profiler range named ``name`` while a profiler records; otherwise nothing.

    Entering a ``record_function`` runs a dispatcher op even when no profiler listens,
    which on the hot path costs about as much as the small launches it would wrap; the
    check whether a profiler is on is one flag read.
    """
    return record_function(name) if torch.autograd._profiler_enabled() else _NO_RANGE


_EAGER = object()  # marks a key whose capture failed: always run eagerly


def graphs_enabled(device: torch.device, options: BufferOptions = DEFAULT) -> bool:
    """Whether norm/clip on ``device`` may be replayed as CUDA graphs right now."""
    if device.type != "cuda" or not options.effective_cuda_graphs:
        return False
    return not torch.cuda.is_current_stream_capturing()


def reduce_capturable(group, device: torch.device, options: BufferOptions = DEFAULT) -> bool:
    """Whether an all-reduce over ``group`` may be captured inside a norm/clip graph.

    True for NCCL groups on CUDA while graphs are enabled, unless ``graph_collectives=False``
    (or ``BUFFERS_GRAPH_COLLECTIVES=0``). NCCL collectives can be captured in CUDA graphs (as
    megatron-core's full-iteration graphs do); a replay then launches the all-reduce with
    the rest, one host call in all. Other backends (gloo) run the reduction between replays.
    """
    return _capture_allowed(device, options) and _is_nccl(group)


def _capture_allowed(device: torch.device, options: BufferOptions) -> bool:
    """The part of :func:`reduce_capturable` that may change between calls."""
    return graphs_enabled(device, options) and options.effective_graph_collectives


def _is_nccl(group) -> bool:
    """The part of :func:`reduce_capturable` fixed for a group once it exists."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return False
    try:
        backend = str(dist.get_backend(group))
    except (RuntimeError, ValueError):  # not a member, or an unknown group object
        return False
    return "nccl" in backend.lower()


class GroupReducer:
    """The one all-reduce of a p-stat over ``group``, for :meth:`NormClip.norm_reduced`
    and :meth:`NormClip.clip_reduced_`: ``norm_reduced(p, *reducer.args())``.

    Built once per group and kept by the caller: the group's backend is looked up here,
    not on every call; whether a graph may hold the all-reduce (:func:`reduce_capturable`)
    is still re-read per call for what can change (graphs on or off, the environment).
    """

    def __init__(
        self, p: float, group, device: torch.device, options: BufferOptions = DEFAULT
    ) -> None:
        self.p = p
        self.group = group
        self.device = device
        self.options = options
        self._nccl = _is_nccl(group)
        self.key = group_key(group)

    def reduce(self, stat: torch.Tensor) -> torch.Tensor:
        return ops.all_reduce_stat(stat, self.p, self.group)

    def args(self) -> tuple[Callable[[torch.Tensor], torch.Tensor], bool, object]:
        """``(reduce, capture_reduce, reduce_key)``."""
        return self.reduce, self._nccl and _capture_allowed(self.device, self.options), self.key


def group_key(group) -> object:
    """What tells one process group from another in a graph key, holding no reference.

    A captured all-reduce is bound to its group: a norm over another group must be another
    graph. The group's name is unique among live groups; its ``id`` is added for group
    objects without one (the name alone would be ``None``).
    """
    if group is None:
        return None
    try:
        name = group.group_name
    except (AttributeError, RuntimeError):
        name = None
    return (name, id(group))


class GraphReplayer:
    """Runs ``fn`` eagerly once per key, captures it the next time, then replays it.

    ``fn`` must launch work on fixed tensors only and return one tensor (the graph's
    output); callers copy that output before handing it out.

    A graph holds raw device addresses. ``sources`` are tensors whose storage the captured
    work reads or writes (the flat buffers): when any of them has moved or been resized
    since the capture (megatron-core's ``offload_grad_buffers`` / ``restore_grad_buffers``
    free and reallocate the gradient storage under the same tensors), every graph is
    dropped and re-captured, so a replay never touches freed memory.
    """

    def __init__(
        self,
        device: torch.device,
        sources: Sequence[torch.Tensor] = (),
        options: BufferOptions = DEFAULT,
    ) -> None:
        self.device = device
        self.options = options
        self._graphs: dict[object, object] = {}
        self._pool: _POOL_HANDLE | None = None
        self.captures = 0  # how many graphs were captured (tests and benchmarks read it)
        self.invalidations = 0  # how many times moved storage dropped the graphs
        reps: dict[int, torch.Tensor] = {}
        for t in sources:  # one tensor per distinct storage
            reps.setdefault(t.untyped_storage().data_ptr(), t)
        self._sources = list(reps.values())
        self._captured_at: tuple | None = None

    def _storage_signature(self) -> tuple:
        out = []
        for t in self._sources:
            storage = t.untyped_storage()
            out.append((storage.data_ptr(), storage.nbytes()))
        return tuple(out)

    def __call__(self, key, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        if not graphs_enabled(self.device, self.options):
            self._graphs.setdefault(key, "warm")
            return fn()
        if self._captured_at is not None and self._storage_signature() != self._captured_at:
            self._graphs.clear()  # storage moved: the graphs' addresses are stale
            # The dropped graphs were the pool's only users, so torch has released it;
            # capturing into its old handle trips an allocator assert: start a new pool.
            self._pool = None
            self._captured_at = None
            self.invalidations += 1
        entry = self._graphs.get(key)
        if entry is None or entry is _EAGER:
            if entry is None:
                self._graphs[key] = "warm"
            return fn()
        if entry == "warm":
            signature = self._storage_signature()
            entry = self._capture(key, fn)
            if entry is _EAGER:
                return fn()
            self._captured_at = signature
        graph, out = cast(tuple[torch.cuda.CUDAGraph, torch.Tensor], entry)
        graph.replay()
        return out

    def _capture(self, key, fn):
        try:
            graph, out = self._record(fn)
        except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager
            warnings.warn(
                f"buffers: could not capture {key!r} as a CUDA graph ({type(e).__name__}: "
                f"{e}); running it with plain launches from now on",
                RuntimeWarning,
                stacklevel=3,
            )
            self._graphs[key] = _EAGER
            return _EAGER
        self._graphs[key] = (graph, out)
        self.captures += 1
        return graph, out

    def _record(self, fn):
        """Capture ``fn``'s launches on a side stream: ``(graph, output tensor)``."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    out = fn()
                finally:
                    graph.capture_end()
        finally:
            current.wait_stream(side)
        return graph, out


class NormClip:
    """p-norm, clip and scale over fixed groups of views (one group per flat buffer).

    Args:
        norm_groups: per buffer, the views whose elements the norm counts (they may run
            over the zero padding between parameters).
        scale_groups: per buffer, the views a clip scales.
        device: where results live.
        options: backend and graph switches (:class:`buffers.options.BufferOptions`).
        exact_groups: per buffer, one view per counted tensor and nothing else: what the
            norms that padding or tensor boundaries change read (p <= 0,
            :func:`buffers.ops.exact_norm`). Default: ``norm_groups``.
    """

    def __init__(
        self,
        norm_groups: Sequence[Sequence[torch.Tensor]],
        scale_groups: Sequence[Sequence[torch.Tensor]],
        device: torch.device,
        options: BufferOptions = DEFAULT,
        exact_groups: Sequence[Sequence[torch.Tensor]] | None = None,
    ) -> None:
        self.norm_groups = [list(g) for g in norm_groups]
        self.scale_groups = [list(g) for g in scale_groups]
        self.exact_groups = (
            self.norm_groups if exact_groups is None else [list(g) for g in exact_groups]
        )
        self.device = device
        self.options = options
        sources = [v for g in self.norm_groups + self.scale_groups for v in g]
        self.replay = GraphReplayer(device, sources, options)
        # Fixed inputs of the captured sequences: values are written before each replay.
        # In the stat's dtype: fp64 when any norm view is fp64 (ops.local_power_stat), so a
        # given or reduced norm keeps fp64's range and max_norm its precision.
        stat = (
            torch.float64
            if any(v.dtype == torch.float64 for g in norm_groups for v in g)
            else torch.float32
        )
        self._norm_in = torch.zeros((), dtype=stat, device=device)
        self._stat_in = torch.zeros((), dtype=stat, device=device)
        self._max_in = torch.zeros((), dtype=stat, device=device)
        self.inverse_coeff = torch.ones((), dtype=torch.float32, device=device)
        self._max_value: float | None = None
        ops.prepare_groups(self.norm_groups + self.scale_groups, options)

    def _stat(self, p: float) -> torch.Tensor:
        groups = self.exact_groups if ops.exact_norm(p) else self.norm_groups
        return ops.local_power_stat(groups, p, self.device, self.options)

    def _set_max(self, max_norm: float) -> None:
        # Inside a caller's capture a fill is only recorded, not run: fill, and forget the
        # cached value. Otherwise one fill per change of max_norm, not one per step.
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing or max_norm != self._max_value:
            # A max_norm beyond the statistic dtype's range is inf there, as in torch's
            # fp32 coefficient (fill_ would refuse it as an overflow).
            limit = torch.finfo(self._max_in.dtype).max
            self._max_in.fill_(max_norm if max_norm <= limit else math.inf)
        self._max_value = None if capturing else max_norm

    def _clip_to_max(self, total: torch.Tensor) -> torch.Tensor:
        """Scale every scale view by the clip coefficient of ``total``; returns ``total``."""
        ops.scale_groups_(
            self.scale_groups, ops.clip_coefficient(total, self._max_in), self.options
        )
        return total

    def local_stat(self, p: float) -> torch.Tensor:
        """This rank's sum of |x|^p (:func:`buffers.ops.local_power_stat`): 0-dim, fresh."""
        with profiler_range(NORM_RANGE):
            return self.replay(("stat", p), lambda: self._stat(p)).clone()

    def norm(self, p: float) -> torch.Tensor:
        """The local p-norm (no reduction across ranks): a fresh tensor."""
        with profiler_range(NORM_RANGE):
            return self.replay(("norm", p), lambda: ops.finish_norm(self._stat(p), p)).clone()

    def clip_(self, max_norm: float, p: float) -> torch.Tensor:
        """Local norm, then every scale view times ``min(max_norm / (norm + 1e-6), 1)``.

        Returns the pre-clip norm (a fresh tensor).
        """
        self._set_max(max_norm)

        def run() -> torch.Tensor:
            return self._clip_to_max(ops.finish_norm(self._stat(p), p))

        with profiler_range(CLIP_RANGE):
            return self.replay(("clip", p), run).clone()

    def fold_(self, max_norm: float, p: float, total_norm: torch.Tensor | None = None):
        """Write ``1 / clip coefficient`` into :attr:`inverse_coeff`; return the norm.

        For optimizers that divide gradients by a device scalar as they read them (torch's
        fused Adam/AdamW ``grad_scale``): clipping without a pass of its own. With
        ``total_norm`` given (e.g. all-reduced) it is used; else the local norm is computed.
        Returns the pre-clip norm (a fresh tensor).
        """
        with profiler_range(CLIP_RANGE):
            return self._fold(max_norm, p, total_norm)

    def _fold(self, max_norm: float, p: float, total_norm: torch.Tensor | None) -> torch.Tensor:
        self._set_max(max_norm)

        def inverse(total: torch.Tensor) -> None:
            # 1 / min(max / (norm + 1e-6), 1) = max((norm + 1e-6) / max, 1)
            self.inverse_coeff.copy_(torch.clamp((total + 1e-6) / self._max_in, min=1.0))

        if total_norm is not None:
            self._norm_in.copy_(total_norm)

            def run_given() -> torch.Tensor:
                inverse(self._norm_in)
                return self.inverse_coeff

            self.replay(("fold_given",), run_given)
            return total_norm

        def run() -> torch.Tensor:
            total = ops.finish_norm(self._stat(p), p)
            inverse(total)
            return total

        return self.replay(("fold", p), run).clone()

    def norm_reduced(
        self,
        p: float,
        reduce: Callable[[torch.Tensor], torch.Tensor],
        capture_reduce: bool = False,
        reduce_key: object = None,
    ) -> torch.Tensor:
        """The norm of ``reduce`` (e.g. an all-reduce) applied to the local stat.

        With ``capture_reduce`` the reduction is captured in the same graph (one replay per
        call; see :func:`reduce_capturable`); otherwise it runs between replays.
        ``reduce_key`` names the reduction (:func:`group_key`): a captured graph is replayed
        only for the same key, so a call over another group never replays this one's
        all-reduce. Returns a fresh tensor.
        """
        with profiler_range(NORM_RANGE):
            if capture_reduce:
                key = ("norm_reduced", p, reduce_key)
                return self.replay(key, lambda: ops.finish_norm(reduce(self._stat(p)), p)).clone()
            stat = self.replay(("stat", p), lambda: self._stat(p)).clone()
            return ops.finish_norm(reduce(stat), p)

    def clip_reduced_(
        self,
        max_norm: float,
        p: float,
        reduce: Callable[[torch.Tensor], torch.Tensor],
        capture_reduce: bool = False,
        reduce_key: object = None,
    ) -> torch.Tensor:
        """Like :meth:`clip_` with ``reduce`` (e.g. an all-reduce) applied to the local stat.

        With ``capture_reduce`` one graph holds the local stat, the reduction, the norm, the
        coefficient and the scale: one replay per call. Otherwise two replays around the
        reduction: the local stat (into a fixed tensor), then norm, coefficient and scale.
        Either way every call runs ``reduce``'s work exactly once (a collective stays one
        collective per call on every rank). ``reduce_key``: as in :meth:`norm_reduced`.
        Returns the pre-clip norm (a fresh tensor).
        """
        with profiler_range(CLIP_RANGE):
            return self._clip_reduced(max_norm, p, reduce, capture_reduce, reduce_key)

    def _clip_reduced(
        self,
        max_norm: float,
        p: float,
        reduce: Callable[[torch.Tensor], torch.Tensor],
        capture_reduce: bool,
        reduce_key: object,
    ) -> torch.Tensor:
        self._set_max(max_norm)
        if capture_reduce:

            def run_all() -> torch.Tensor:
                return self._clip_to_max(ops.finish_norm(reduce(self._stat(p)), p))

            return self.replay(("clip_reduced", p, reduce_key), run_all).clone()
        self.replay(("stat_in", p), lambda: self._stat_in.copy_(self._stat(p)))
        reduced = reduce(self._stat_in)
        if reduced is not self._stat_in:  # an out-of-place reduction (the inf-norm's)
            self._stat_in.copy_(reduced)

        def run() -> torch.Tensor:
            return self._clip_to_max(ops.finish_norm(self._stat_in, p))

        return self.replay(("finish_scale", p), run).clone()

    def scale_by_norm_(self, total_norm: torch.Tensor, max_norm: float) -> None:
        """Scale by the clip coefficient of a given (e.g. all-reduced) norm tensor."""
        with profiler_range(CLIP_RANGE):
            self._set_max(max_norm)
            self._norm_in.copy_(total_norm)
            self.replay(("scale",), lambda: self._clip_to_max(self._norm_in))
