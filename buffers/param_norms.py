"""Per-parameter gradient norms from one segmented pass per flat buffer, with the total.

:meth:`FlatGradBuffers.grad_norm(..., per_param=True) <buffers.FlatGradBuffers.grad_norm>`
returns a :class:`ParamNorms`: the total norm (what ``grad_norm`` returns) and every
parameter's own norm, as device tensors, from the same read of the gradients. Nothing here
copies to the host until a value is read (:class:`LazyNorms`); :class:`GroupIndex` folds
the per-parameter norms into groups (layers, module types) on the device.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from . import ops
from .options import DEFAULT, BufferOptions
from .plan import LayoutPlan
from .segments import build_segment_table

INF = math.inf


class LazyNorms(Mapping):
    """``{name: norm}`` over a device tensor, copied to the host once, when a value is read.

    Names, ``len`` and ``in`` need no copy; the first value read copies the whole vector
    (one transfer, one sync), later reads use that copy. ``tensor`` stays on the device.
    """

    def __init__(self, names: Sequence[str], tensor: torch.Tensor) -> None:
        self.names = tuple(names)
        self.tensor = tensor
        self._index = {n: i for i, n in enumerate(self.names)}
        self._host: list[float] | None = None

    @property
    def copied(self) -> bool:
        """Whether the values have been copied to the host."""
        return self._host is not None

    def _values(self) -> list[float]:
        if self._host is None:
            self._host = self.tensor.tolist()
        return self._host

    def __getitem__(self, name: str) -> float:
        return self._values()[self._index[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __repr__(self) -> str:
        if not self.copied:
            return f"LazyNorms(<{len(self)} norms on {self.tensor.device}, not copied>)"
        shown = dict(self.items())
        return f"LazyNorms({shown})"


class _Refuse:
    """:class:`GroupIndex`'s default ``unmatched``: a name the pattern misses is an error."""

    def __repr__(self) -> str:
        return "REFUSE"


REFUSE = _Refuse()


class GroupIndex:
    """Which group (layer, module type, ...) each parameter name belongs to; built once.

    Args:
        names: the parameter names, in the order of the norms to aggregate
            (:attr:`ParamNorms.names`).
        rule: a regular expression (its first group, or the whole match when it has none,
            names the group), or a function from a name to its group name (``None``: the
            function puts that name in no group).
        unmatched: keyword-only: what becomes of a name the rule gives no group. By
            default a name a regular expression does not match is a ``ValueError`` naming
            it (a pattern that silently leaves parameters out of every group hides them),
            and one a function maps to None is in no group. A string: such names form one
            group of that name. None: they are left out of every group.

    Groups are listed in the order their first member appears.
    """

    def __init__(
        self,
        names: Sequence[str],
        rule: str | re.Pattern | Callable[[str], str | None],
        *,
        unmatched: str | None | _Refuse = REFUSE,
    ) -> None:
        if not (unmatched is None or unmatched is REFUSE or isinstance(unmatched, str)):
            raise TypeError(
                f"unmatched must be a group name (str) or None, got {type(unmatched).__name__}"
            )
        self.names = tuple(names)
        pattern = None
        if isinstance(rule, str | re.Pattern):
            pattern = re.compile(rule)

            def rule(name: str, pattern=pattern) -> str | None:
                m = pattern.search(name)
                if m is None:
                    return None
                return m.group(1) if pattern.groups else m.group(0)

        found = [rule(name) for name in self.names]
        missed = [name for name, g in zip(self.names, found, strict=True) if g is None]
        if missed and pattern is not None and unmatched is REFUSE:
            shown = repr(missed[0])
            if len(missed) > 1:
                more = len(missed) - 4
                shown += f" (and {', '.join(map(repr, missed[1:4]))}"
                shown += f" and {more} more)" if more > 0 else ")"
            raise ValueError(
                f"GroupIndex: the pattern {pattern.pattern!r} does not match {len(missed)} of "
                f"the {len(self.names)} names, {shown}, so their norms would be in no group: "
                "pass unmatched='<group name>' to gather them in one group, or "
                "unmatched=None to leave them out"
            )
        if isinstance(unmatched, str):
            found = [unmatched if g is None else g for g in found]
        ids: dict[str, int] = {}
        member = [-1 if g is None else ids.setdefault(g, len(ids)) for g in found]
        self.groups = tuple(ids)
        dump = len(self.groups)  # the slot of names in no group
        self._member = torch.tensor([dump if m < 0 else m for m in member], dtype=torch.int64)
        self._on: dict[torch.device, torch.Tensor] = {}

    def member(self, device: torch.device) -> torch.Tensor:
        """Group id of every name (``len(groups)`` for none), on ``device`` (cached)."""
        if device not in self._on:
            self._on[device] = self._member.to(device)
        return self._on[device]

    def aggregate(self, norms: torch.Tensor, norm_type: float = 2.0) -> torch.Tensor:
        """The p-norm of each group from its members' p-norms, on the device.

        (sum of member norm^p)^(1/p), accumulated in fp64; max for inf (NaN propagates).
        Returns one norm per group, in ``norms``'s dtype.
        """
        p = ops.check_norm_type(norm_type)
        member = self.member(norms.device)
        stats = torch.zeros(len(self.groups) + 1, dtype=torch.float64, device=norms.device)
        src = norms.to(torch.float64)
        if p == INF:
            nan = torch.zeros_like(stats).index_add_(0, member, torch.isnan(src).double())
            stats.scatter_reduce_(0, member, src, "amax", include_self=True)
            stats = torch.where(nan > 0, torch.full_like(stats, math.nan), stats)
        else:
            stats.index_add_(0, member, src.pow(p))
        return ops.finish_norm(stats[:-1], p).to(norms.dtype)


@dataclass(frozen=True)
class ParamNorms:
    """The total norm and every parameter's own norm, from one pass.

    Attributes:
        total: the norm of the counted gradients, as ``grad_norm`` returns it (same dtype;
            summed in another order, so equal up to rounding, not bit for bit).
        norms: one norm per name (1-D device tensor; fp64 when a buffer here is fp64,
            else fp32). An uncounted parameter has its own norm here too.
        names: the parameter names, in the order of ``norms``.
        counted: per name, whether it counts toward ``total``. ``total`` is the p-norm of
            the counted entries of ``norms``.
        norm_type: p.
    """

    total: torch.Tensor
    norms: torch.Tensor
    names: tuple[str, ...]
    counted: tuple[bool, ...]
    norm_type: float

    def as_dict(self) -> LazyNorms:
        """``{name: norm}``, copied to the host only when a value is read."""
        return LazyNorms(self.names, self.norms)

    def by_group(self, index: GroupIndex) -> LazyNorms:
        """``{group: norm}`` of ``index``'s groups, aggregated on the device (lazy)."""
        if index.names is not self.names and index.names != self.names:
            raise ValueError(
                "this GroupIndex was built for other parameter names; build it from these "
                "norms' names: GroupIndex(norms.names, rule)"
            )
        return LazyNorms(index.groups, index.aggregate(self.norms, self.norm_type))


@dataclass(frozen=True)
class _Union:
    """Where this rank's per-parameter stats go in a vector shared by every rank of a group."""

    names: tuple[str, ...]
    counted: tuple[bool, ...]
    local_index: torch.Tensor  # local stat positions sent (contributing params, then total)
    wire_index: torch.Tensor  # their positions in the wire vector (total last)
    identity: bool = False  # the local vector is already the wire vector (same names, all sent)


def gather_union(
    names: Sequence[str], counted: Sequence[bool], group, device: torch.device
) -> _Union:
    """The names of every rank of ``group`` and this rank's place among them.

    One ``all_gather_object`` (call it once per group and keep the result). A name counted
    on some rank is reported from the counted copies only (uncounted copies are
    duplicates); a name counted nowhere sums every rank's copy. Names must be unique on a
    rank: parameters are matched across ranks by name.
    """
    import torch.distributed as dist

    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:
            raise ValueError(
                f"parameter name {name!r} is used twice (parameters {seen[name]} and {i}); "
                "per-parameter norms over a process group match parameters by name, so "
                "pass unique names (named_parameters())"
            )
        seen[name] = i
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (tuple(names), tuple(counted)), group=group)
    order: dict[str, int] = {}
    counted_any: list[bool] = []
    for rank_names, rank_counted in gathered:
        for name, c in zip(rank_names, rank_counted, strict=True):
            if name not in order:
                order[name] = len(order)
                counted_any.append(False)
            counted_any[order[name]] |= c
    sent = [i for i, name in enumerate(names) if counted[i] or not counted_any[order[name]]]
    wire = [order[names[i]] for i in sent]
    identity = len(order) == len(names) and wire == list(range(len(names)))
    return _Union(
        tuple(order),
        tuple(counted_any),
        torch.tensor([*sent, len(names)], dtype=torch.int64, device=device),
        torch.tensor(wire + [len(order)], dtype=torch.int64, device=device),
        identity,
    )


def to_wire(local: torch.Tensor, union: _Union) -> torch.Tensor:
    """This rank's part of the shared vector ``[stat per union name..., total]`` from its
    local ``[stat per name..., total]`` (zeros where it sends nothing); ``local`` itself
    when every rank has these names in this order and sends every one."""
    if union.identity:
        return local
    out = torch.zeros(len(union.names) + 1, dtype=local.dtype, device=local.device)
    return out.index_copy_(0, union.wire_index, local.index_select(0, union.local_index))


class ParamStats:
    """Per-parameter stats on this rank, their reduction over a group, and the norms.

    Subclasses say how one pass adds each parameter's stat (:meth:`add_stats`);
    :meth:`norms` does the rest the same way for every layout: the counted total, one
    all-reduce carrying the vector and the total, the finished norms, replayed as CUDA
    graphs by the caller's replayer.

    Args:
        names: parameter names, one per stat (unique).
        counted: per name, whether it counts toward the total.
        device: where results live.
        options: backend choice.
        norm_dtype: dtype of the per-parameter norms.
        total_dtype: dtype of the total.
    """

    def __init__(
        self,
        names: Sequence[str],
        counted: Sequence[bool],
        device: torch.device,
        options: BufferOptions = DEFAULT,
        norm_dtype: torch.dtype = torch.float32,
        total_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.n = len(names)
        self.names = tuple(names)
        self.counted = tuple(counted)
        self.device = device
        self.options = options
        self.norm_dtype = norm_dtype
        self.total_dtype = total_dtype
        self._mask = torch.tensor(self.counted, dtype=torch.bool, device=device)
        self._all_counted = all(self.counted)
        self._unions: dict[object, _Union] = {}

    def add_stats(self, out: torch.Tensor, nan: torch.Tensor, p: float) -> None:
        """Add each parameter's sum of |x|^p (max |x| for inf) into the fp64 ``out[i]``;
        ``nan`` counts NaN for inf (it is ``out`` itself otherwise)."""
        raise NotImplementedError

    def local(self, p: float) -> torch.Tensor:
        """fp64 ``[stat of each parameter..., stat of the counted total]`` on this rank.

        stat = sum of |x|^p (max |x| for inf). No host sync.
        """
        out = torch.zeros(self.n + 1, dtype=torch.float64, device=self.device)
        nan = torch.zeros_like(out) if p == INF else out
        self.add_stats(out, nan, p)
        if p == INF:
            out = torch.where(nan > 0, torch.full_like(out, math.nan), out)
        stats = out[: self.n]
        # Whatever a pass left in the last slot, it is the total now (written by the
        # reduction itself: one launch when every parameter counts, two otherwise).
        counted = stats if self._all_counted else torch.where(self._mask, stats, 0.0)
        if p == INF:
            out[self.n] = counted.amax() if self.n else 0.0
        else:
            torch.sum(counted, dim=0, out=out[self.n])
        return out

    def union(self, group, key: object) -> _Union:
        """The names of every rank of ``group`` and this rank's place among them
        (:func:`gather_union`, once per group, kept under ``key``)."""
        if key not in self._unions:
            self._unions[key] = gather_union(self.names, self.counted, group, self.device)
        return self._unions[key]

    def wire(self, local: torch.Tensor, union: _Union) -> torch.Tensor:
        """This rank's part of the shared vector ``[stat per union name..., total]``."""
        return to_wire(local, union)

    def finished(self, stats: torch.Tensor, p: float) -> torch.Tensor:
        """``[norm per name..., total norm]`` from ``[stat per name..., total stat]``, as
        one vector (one output, one copy when replayed as a graph): in the norms' dtype,
        or fp64 when only the norms are fp64 (:meth:`split` casts the total)."""
        wide = torch.float64 in (self.norm_dtype, self.total_dtype)
        dtype = torch.float64 if wide else torch.float32
        if p == 2.0:  # the root and the cast in one launch
            return torch.sqrt(stats, out=torch.empty(stats.shape, dtype=dtype, device=stats.device))
        return ops.finish_norm(stats, p).to(dtype)

    def split(
        self, vec: torch.Tensor, p: float, names: tuple[str, ...], counted: tuple[bool, ...]
    ) -> ParamNorms:
        """The :class:`ParamNorms` of a :meth:`finished` vector (views where dtypes allow)."""
        total = vec[-1]
        if total.dtype != self.total_dtype:
            total = total.to(self.total_dtype)
        return ParamNorms(total, vec[:-1], names, counted, p)

    def norms(
        self,
        p: float,
        replay: Callable[[object, Callable[[], torch.Tensor]], torch.Tensor],
        group=None,
        reducer: tuple | None = None,
    ) -> ParamNorms:
        """Every parameter's norm and the total: one pass, with ``group`` one all-reduce.

        ``replay``: a :class:`~buffers.graphs.GraphReplayer` (everything up to the
        finished norms is one replay, one copy out). ``reducer``: ``GroupReducer.args()``
        for ``group``; an NCCL all-reduce is captured in the graph, others run between
        replays.
        """
        if ops.exact_norm(p):
            raise ValueError(
                f"per_param=True takes norm_type > 0 or inf, got {p}: per-parameter 0- and "
                "negative norms are not supported; call grad_norm(norm_type) without it"
            )
        if group is None:
            vec = replay(("per_param", p), lambda: self.finished(self.local(p), p)).clone()
            return self.split(vec, p, self.names, self.counted)
        # The reducer's group and whether a graph may hold its all-reduce; the vector goes
        # over the wire in fp64 as it is (every rank's local() is fp64), not cast to fp32
        # and back as a total norm's stat is.
        if reducer is None:
            raise ValueError("norms() over a group takes that group's GroupReducer.args()")
        _, capture_reduce, reduce_key = reducer

        def reduce(vec: torch.Tensor) -> torch.Tensor:
            return ops.all_reduce_stat(vec, p, group, wire_dtype=vec.dtype)

        union = self.union(group, reduce_key)
        if capture_reduce:  # the all-reduce inside the graph, as NormClip.norm_reduced
            key = ("per_param_reduced", p, reduce_key)
            vec = replay(
                key, lambda: self.finished(reduce(self.wire(self.local(p), union)), p)
            ).clone()
        else:
            local = replay(("per_param_stats", p), lambda: self.local(p))
            vec = self.finished(reduce(self.wire(local, union)), p)
        return self.split(vec, p, union.names, union.counted)


class ParamNormPass(ParamStats):
    """Per-parameter stats of every flat buffer in one segmented pass each (built once).

    Args:
        plan: the layout (slots of every buffer).
        buffers: the flat buffers, by dtype.
        names: parameter names by plan index.
        device: where results live.
        options: backend choice.
    """

    def __init__(
        self,
        plan: LayoutPlan,
        buffers: Mapping[torch.dtype, torch.Tensor],
        names: Sequence[str],
        device: torch.device,
        options: BufferOptions = DEFAULT,
    ) -> None:
        n = len(names)
        counted = [True] * n
        for b in plan.buffers.values():
            for s in b.slots:
                counted[s.index] = s.counted
        any64 = torch.float64 in plan.buffers
        counted64 = any(
            dt == torch.float64 and any(s.counted for s in b.slots)
            for dt, b in plan.buffers.items()
        )
        super().__init__(
            names,
            counted,
            device,
            options,
            norm_dtype=torch.float64 if any64 else torch.float32,
            total_dtype=torch.float64 if counted64 else torch.float32,
        )
        self._tables = []
        for dt, b in plan.buffers.items():
            slots = [(s.offset, s.numel, s.index) for s in b.slots]
            table = build_segment_table(b.numel, slots, n, device)
            backend = ops.backend_for(buffers[dt].device, options)
            backend.prepare_segments(buffers[dt], table)
            self._tables.append((buffers[dt], table))

    def add_stats(self, out: torch.Tensor, nan: torch.Tensor, p: float) -> None:
        # Boundary blocks go to slot n (the table's dump); local() overwrites it.
        for buf, table in self._tables:
            ops.backend_for(buf.device, self.options).segment_stats_(buf, table, p, out, nan)
