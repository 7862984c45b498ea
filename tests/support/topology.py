"""Simulate a Megatron topology on the CPU and check that every gradient element counts once.

A model is given as an inventory of *logical* parameters (full shapes, before any
parallelism). For every rank of a topology this module builds the local parameters Megatron
would hold, lays them out in buffers with Megatron's own layout functions (on meta tensors,
so nothing is allocated), runs our span rules (:mod:`megatron_ext.counted_spans`) for every buffer,
and maps each counted element back to (logical parameter, logical element). Within each
group whose partial sums one norm all-reduce adds up, every logical element must be counted
exactly once; :func:`audit` reports the first one that is not, with the ranks involved.

Rank layout follows ``megatron/core/parallel_state.py`` (0.19.2): ``RankGenerator``
(:465-557) with the default order ``"tp-cp-ep-dp-pp"`` (:617) and
``generate_masked_orthogonal_rank_groups`` (:269-375), leftmost token fastest. The dense
generator has ep=1 (:859-868), so dense ranks decompose as tp, cp, dp, pp; the expert
generator has tp=etp, cp=1 and dp=edp = world / (etp*ep*pp) (:871-896), so expert ranks
decompose as etp, ep, edp, pp.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.param_and_grad_buffer import (
    _compute_default_per_buffer_param_layout,
    group_params_for_buffers,
)
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from buffers.spans import Span
from megatron_ext.counted_spans import GradRecord, exclusion_reason, rank_spans

Rule = Callable[..., str | None]
"""Signature of :func:`megatron_ext.counted_spans.exclusion_reason` (keyword arguments only)."""

COMBINES = ("sum", "mean")


def _check_size(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class RankCoords:
    """Where one global rank sits on the dense grid and on the expert grid."""

    rank: int
    tp: int
    cp: int
    dp: int
    pp: int
    etp: int
    ep: int
    edp: int

    def dp_cp_index(self, cp_size: int) -> int:
        """Position in the dense data-parallel-with-context-parallel group.

        ``get_ranks("dp-cp")`` masks cp and dp in the order tp-cp-ep-dp-pp, so cp varies
        fastest inside the group (parallel_state.py:963).
        """
        return self.cp + cp_size * self.dp


@dataclass(frozen=True)
class Topology:
    """Parallel sizes of one Megatron run, validated like ``initialize_model_parallel``.

    ``etp`` defaults to ``tp``; the expert data-parallel size ``edp`` is derived.
    """

    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    distributed_optimizer: bool = True
    num_optimizer_instances: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "ep", "num_optimizer_instances"):
            _check_size(name, getattr(self, name))
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        _check_size("etp", self.etp)
        if not isinstance(self.distributed_optimizer, bool):
            raise ValueError(
                f"distributed_optimizer must be a bool, got {self.distributed_optimizer!r}"
            )
        expert_mp = self.etp * self.ep * self.pp
        if self.world % expert_mp:
            raise ValueError(
                f"world size tp*pp*dp*cp = {self.world} is not divisible by etp*ep*pp = "
                f"{expert_mp} (etp={self.etp}, ep={self.ep}, pp={self.pp}), so there is no "
                "whole expert data-parallel size; change ep or etp"
            )
        n = self.num_optimizer_instances
        if n > 1 and not self.distributed_optimizer:
            raise ValueError(
                f"num_optimizer_instances={n} needs distributed_optimizer=True; without it "
                "every rank holds the whole optimizer state and there are no instances to split"
            )
        if (self.dp * self.cp) % n or self.edp % n:
            raise ValueError(
                f"num_optimizer_instances={n} must divide both dp*cp = {self.dp * self.cp} "
                f"and the expert data-parallel size edp = {self.edp}"
            )

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def edp(self) -> int:
        return self.world // (self.etp * self.ep * self.pp)

    def coords(self, rank: int) -> RankCoords:
        """Dense and expert coordinates of ``rank`` (order tp-cp-ep-dp-pp, tp fastest).

        Args:
            rank: global rank, ``0 <= rank < world``.

        Returns:
            The :class:`RankCoords`.
        """
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the world of {self.world} ranks")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        etp, rest = rank % self.etp, rank // self.etp
        ep, rest = rest % self.ep, rest // self.ep
        return RankCoords(rank, tp, cp, dp, pp, etp, ep, rest % self.edp)


@dataclass(frozen=True)
class LogicalParam:
    """One parameter of the whole model, before tensor, expert or pipeline parallelism.

    ``tp_partition_dim`` is the dimension split across tensor-parallel ranks (expert
    tensor-parallel ranks for experts), None when every such rank holds a full copy.
    ``shared`` marks the copy Megatron excludes from the norm; ``tied_to`` names the
    logical parameter a copy belongs to (the last stage's tied output layer).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.bfloat16
    tp_partition_dim: int | None = None
    is_expert: bool = False
    shared: bool = False
    stage: int = 0
    expert_index: int | None = None
    tied_to: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        if not self.shape or any(not isinstance(d, int) or d < 1 for d in self.shape):
            raise ValueError(f"parameter {self.name!r}: shape {self.shape} must be positive ints")
        d = self.tp_partition_dim
        if d is not None and not 0 <= d < len(self.shape):
            raise ValueError(
                f"parameter {self.name!r}: tp_partition_dim={d} is not a dimension of "
                f"shape {self.shape}"
            )
        if self.is_expert != (self.expert_index is not None):
            raise ValueError(
                f"parameter {self.name!r}: give expert_index exactly when is_expert=True"
            )
        if self.stage < 0 or (self.expert_index is not None and self.expert_index < 0):
            raise ValueError(f"parameter {self.name!r}: stage and expert_index must be >= 0")

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))

    @property
    def logical_name(self) -> str:
        """The logical parameter whose elements this one holds."""
        return self.tied_to or self.name


@dataclass(frozen=True)
class LocalParam:
    """One rank's piece of a logical parameter, with the flags Megatron would set on it."""

    param: LogicalParam
    piece: int  # index along tp_partition_dim (0 when not partitioned)
    parts: int  # number of pieces along tp_partition_dim (1 when not partitioned)
    expert_parallel: bool  # Megatron's ``allreduce=False``: expert DP group, expert TP rank
    shared_embedding: bool  # forces its own bucket in the distributed-optimizer layout

    @property
    def shape(self) -> tuple[int, ...]:
        d = self.param.tp_partition_dim
        if d is None:
            return self.param.shape
        return tuple(n // self.parts if i == d else n for i, n in enumerate(self.param.shape))

    @property
    def logical_indices(self) -> np.ndarray:
        """Logical flat index of each local element, in local (row-major) order."""
        p = self.param
        return _piece_indices(p.shape, p.tp_partition_dim, self.parts, self.piece)


@lru_cache(maxsize=4096)
def _piece_indices(shape: tuple[int, ...], dim: int | None, parts: int, piece: int) -> np.ndarray:
    full = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    if dim is not None:
        size = shape[dim] // parts
        full = np.take(full, np.arange(piece * size, (piece + 1) * size), axis=dim)
    out = np.ascontiguousarray(full).ravel()
    out.flags.writeable = False
    return out


def is_expert_parallel(param: LogicalParam, topology: Topology) -> bool:
    """Whether Megatron marks ``param`` ``allreduce=False`` (expert groups) in ``topology``.

    Experts use the expert groups when EP > 1 or ETP != TP (``use_expert_pgs`` in
    extensions/transformer_engine.py:982-985); otherwise they sit in the dense buffers.
    """
    return param.is_expert and (topology.ep > 1 or topology.etp != topology.tp)


def check_inventory(topology: Topology, inventory: Sequence[LogicalParam]) -> None:
    """Raise a ``ValueError`` naming the parameter if ``inventory`` cannot run on ``topology``.

    Args:
        topology: the parallel sizes.
        inventory: the model's parameters, in ``named_parameters()`` order per stage.
    """
    by_name: dict[str, LogicalParam] = {}
    for p in inventory:
        if p.name in by_name:
            raise ValueError(f"parameter name {p.name!r} appears twice in the inventory")
        by_name[p.name] = p
    num_experts = 1 + max((p.expert_index for p in inventory if p.is_expert), default=-1)
    if num_experts % topology.ep:
        raise ValueError(
            f"{num_experts} experts cannot be split evenly over ep={topology.ep} ranks"
        )
    for p in inventory:
        if p.stage >= topology.pp:
            raise ValueError(f"parameter {p.name!r} is on stage {p.stage}, but pp={topology.pp}")
        parts = topology.etp if p.is_expert else topology.tp
        d = p.tp_partition_dim
        if d is not None and p.shape[d] % parts:
            raise ValueError(
                f"parameter {p.name!r}: dimension {d} of shape {p.shape} is not divisible by "
                f"{'etp' if p.is_expert else 'tp'}={parts}"
            )
        if p.tied_to is not None:
            target = by_name.get(p.tied_to)
            if target is None or target.tied_to is not None:
                raise ValueError(
                    f"parameter {p.name!r} is tied to {p.tied_to!r}, which is not an untied "
                    "parameter of the inventory"
                )
            if (target.shape, target.dtype, target.tp_partition_dim) != (
                p.shape,
                p.dtype,
                p.tp_partition_dim,
            ):
                raise ValueError(
                    f"parameter {p.name!r} and {p.tied_to!r} are tied but differ in shape, "
                    "dtype or tp_partition_dim"
                )


def local_params(
    topology: Topology, inventory: Sequence[LogicalParam], rank: int
) -> tuple[LocalParam, ...]:
    """The parameters ``rank`` holds, in the inventory's order.

    Args:
        topology: the parallel sizes.
        inventory: the model's parameters (see :func:`check_inventory`).
        rank: global rank.

    Returns:
        One :class:`LocalParam` per parameter on this rank's stage (experts only on the
        expert-parallel rank that owns them: expert ``e`` on ``e // (num_experts / ep)``).
    """
    c = topology.coords(rank)
    num_experts = 1 + max((p.expert_index for p in inventory if p.is_expert), default=-1)
    per_ep_rank = max(num_experts // topology.ep, 1)
    tied = {p.tied_to for p in inventory if p.tied_to is not None}
    out = []
    for p in inventory:
        if p.stage != c.pp or (p.is_expert and p.expert_index // per_ep_rank != c.ep):
            continue
        split = p.tp_partition_dim is not None
        parts = (topology.etp if p.is_expert else topology.tp) if split else 1
        piece = (c.etp if p.is_expert else c.tp) if split else 0
        embedding = p.tied_to is not None or p.name in tied
        out.append(LocalParam(p, piece, parts, is_expert_parallel(p, topology), embedding))
    return tuple(out)


@dataclass(frozen=True)
class BufferSlot:
    """Where the local parameter at ``position`` lives in its buffer."""

    position: int
    start: int
    end: int
    bucket: int


@dataclass(frozen=True)
class GradBufferLayout:
    """One Megatron gradient buffer of one rank: its key, length, buckets and slots."""

    expert_parallel: bool
    dtype: torch.dtype
    numel: int
    buckets: tuple[Span, ...]
    slots: tuple[BufferSlot, ...]


def _meta_parameter(p: LocalParam) -> torch.nn.Parameter:
    t = torch.nn.Parameter(torch.empty(p.shape, dtype=p.param.dtype, device="meta"))
    t.allreduce = not p.expert_parallel
    t.shared = p.param.shared
    t.shared_embedding = p.shared_embedding
    t.tensor_model_parallel = p.param.tp_partition_dim is not None
    return t


def shard_group(topology: Topology, coords: RankCoords, expert_parallel: bool) -> tuple[int, int]:
    """(size, index) of this rank in the group its buffer's buckets are sharded over.

    Dense buffers shard over the intra-instance part of the DP-CP group, expert buffers
    over the intra-instance part of the expert-DP group; instances are contiguous slices
    of those groups (parallel_state.py:990-1000 and :1480-1486, level 0 of
    ``create_hierarchical_groups``).
    """
    n = topology.num_optimizer_instances
    if expert_parallel:
        size = topology.edp // n
        return size, coords.edp % size
    size = topology.dp * topology.cp // n
    return size, coords.dp_cp_index(topology.cp) % size


def grad_buffer_layouts(
    topology: Topology, params: Sequence[LocalParam], pp_rank: int, bucket_size: int | None
) -> tuple[GradBufferLayout, ...]:
    """Group and lay out ``params`` with Megatron's own functions on meta tensors.

    Grouping is ``group_params_for_buffers`` (param_and_grad_buffer.py:882, with
    ``grad_reduce_in_fp32=False``); layouts are ``DistributedOptimizer.
    compute_full_param_layout`` (distrib_optimizer.py:591) with the distributed optimizer,
    else ``_compute_default_per_buffer_param_layout`` (param_and_grad_buffer.py:947).
    Stages after the first get one bucket (distributed_data_parallel.py:105).

    Args:
        topology: the parallel sizes.
        params: the rank's local parameters, in ``named_parameters()`` order.
        pp_rank: the rank's pipeline stage.
        bucket_size: DDP's bucket size in elements, None for one bucket per buffer.

    Returns:
        One :class:`GradBufferLayout` per buffer key, in Megatron's order.
    """
    metas = [_meta_parameter(p) for p in params]
    position = {id(m): i for i, m in enumerate(metas)}
    size = None if pp_rank > 0 else bucket_size
    if topology.distributed_optimizer:
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True,
            num_distributed_optimizer_instances=topology.num_optimizer_instances,
        )
        n = topology.num_optimizer_instances
        layouts = DistributedOptimizer.compute_full_param_layout(
            metas,
            size,
            topology.dp * topology.cp // n,
            ddp_config,
            expert_data_parallel_world_size=topology.edp // n,
        ).layouts
    else:
        groups = group_params_for_buffers(metas, grad_reduce_in_fp32=False)
        layouts = {
            key: _compute_default_per_buffer_param_layout(group, size)
            for key, (group, _) in groups.items()
        }
    out = []
    for key, layout in layouts.items():
        slots = tuple(
            BufferSlot(position[id(m)], start, end, bucket)
            for m, (start, end, bucket) in layout.param_index_map.items()
        )
        buckets = tuple(Span(s, e) for s, e in layout.bucket_indices)
        out.append(
            GradBufferLayout(
                key.is_expert_parallel, key.grad_dtype, buckets[-1].end, buckets, slots
            )
        )
    return tuple(out)


def norm_group_key(topology: Topology, coords: RankCoords, expert_parallel: bool) -> tuple:
    """Identify the group whose partial norms one all-reduce adds up, for one kind of buffer.

    With the distributed optimizer both kinds share the intra-instance group, made of
    whole expert tp-ep-pp groups, consecutive in expert-DP rank (parallel_state.py:1562-1575,
    optimizer/__init__.py:678). Without it, dense norms reduce over the model-parallel
    group ``tp-pp`` (:1147) and expert norms over the expert ``tp-ep-pp`` group (:1419,
    optimizer/__init__.py:681 and :1209), and the two children combine their norms.
    """
    if topology.distributed_optimizer:
        return (
            "optimizer instance",
            coords.edp // (topology.edp // topology.num_optimizer_instances),
        )
    if expert_parallel:
        return ("expert model-parallel", coords.edp)
    return ("model-parallel", coords.dp, coords.cp)


@dataclass(frozen=True)
class RankSlice:
    """Logical elements of one parameter that one rank holds or counts."""

    rank: int
    name: str  # logical name
    group: tuple  # norm group key (see norm_group_key)
    indices: np.ndarray  # logical flat indices
    excluded_because: str | None  # the rule's verdict for this rank's piece


@dataclass(frozen=True)
class CountingSimulation:
    """Every rank's held and counted slices, and the norm groups they reduce in."""

    topology: Topology
    inventory: tuple[LogicalParam, ...]
    held: tuple[RankSlice, ...]
    counted: tuple[RankSlice, ...]
    groups: dict[tuple, tuple[int, ...]]  # key -> member ranks
    rank_groups: tuple[tuple[tuple, ...], ...]  # per rank: the distinct keys it reduces in
    param_groups: dict[str, tuple[tuple, ...]]  # logical name -> keys of its kind


def simulate_counting(
    topology: Topology,
    inventory: Sequence[LogicalParam],
    rule: Rule = exclusion_reason,
    bucket_size: int | None = None,
) -> CountingSimulation:
    """Run the span rules on every rank and record which logical elements each one counts.

    Args:
        topology: the parallel sizes.
        inventory: the model's parameters (see :func:`check_inventory`).
        rule: decides why a gradient is excluded (None: counted); same keyword arguments
            as :func:`megatron_ext.counted_spans.exclusion_reason`.
        bucket_size: DDP's bucket size in elements, None for one bucket per buffer.

    Returns:
        The :class:`CountingSimulation`.
    """
    inventory = tuple(inventory)
    check_inventory(topology, inventory)
    layouts: dict[tuple[int, int], tuple[GradBufferLayout, ...]] = {}
    held, counted = [], []
    groups: dict[tuple, list[int]] = {}
    kind_keys: dict[bool, set[tuple]] = {False: set(), True: set()}
    rank_groups = []
    for rank in range(topology.world):
        c = topology.coords(rank)
        params = local_params(topology, inventory, rank)
        # Local shapes, and hence layouts, depend only on the stage and the expert rank.
        if (c.pp, c.ep) not in layouts:
            layouts[c.pp, c.ep] = grad_buffer_layouts(topology, params, c.pp, bucket_size)
        keys = {kind: norm_group_key(topology, c, kind) for kind in (False, True)}
        for kind, key in keys.items():
            kind_keys[kind].add(key)
        mine = tuple(dict.fromkeys(keys.values()))  # one key when both kinds share a group
        for key in mine:
            groups.setdefault(key, []).append(rank)
        rank_groups.append(mine)
        for buf in layouts[c.pp, c.ep]:
            h, n = _buffer_slices(topology, c, params, buf, rule, keys[buf.expert_parallel])
            held += h
            counted += n
    param_groups = {
        p.logical_name: tuple(sorted(kind_keys[is_expert_parallel(p, topology)])) for p in inventory
    }
    return CountingSimulation(
        topology,
        inventory,
        tuple(held),
        tuple(counted),
        {k: tuple(v) for k, v in groups.items()},
        tuple(rank_groups),
        param_groups,
    )


def _buffer_slices(
    topology: Topology,
    c: RankCoords,
    params: Sequence[LocalParam],
    buf: GradBufferLayout,
    rule: Rule,
    group: tuple,
) -> tuple[list[RankSlice], list[RankSlice]]:
    """What one rank holds and counts in one buffer, mapped to logical elements."""
    verdicts = {}
    records = []
    for slot in buf.slots:
        p = params[slot.position]
        verdicts[slot.position] = rule(
            shared=p.param.shared,
            tensor_model_parallel=p.param.tp_partition_dim is not None,
            is_expert=p.expert_parallel,
            tp_rank=c.tp,
            expert_tp_rank=c.etp,
        )
        records.append(
            GradRecord(p.param.name, slot.start, slot.end, slot.bucket, verdicts[slot.position])
        )
    if topology.distributed_optimizer:
        size, index = shard_group(topology, c, buf.expert_parallel)
        spans = rank_spans(records, buf.numel, buf.buckets, size, index)
    else:
        spans = rank_spans(records, buf.numel)
    held, counted = [], []
    for slot in buf.slots:
        p = params[slot.position]
        name, idx, why = p.param.logical_name, p.logical_indices, verdicts[slot.position]
        held.append(RankSlice(c.rank, name, group, idx, why))
        for s in spans.norm:
            lo, hi = max(s.start, slot.start), min(s.end, slot.end)
            if lo < hi:
                part = idx[lo - slot.start : hi - slot.start]
                counted.append(RankSlice(c.rank, name, group, part, why))
    return held, counted


@dataclass(frozen=True)
class AuditReport:
    """Whether every logical element is counted exactly once in each norm group.

    ``counts[name][i, j]`` is how many ranks of the group ``groups[name][i]`` (member
    ranks) counted logical element ``j`` (flat index) of parameter ``name``.
    """

    ok: bool
    first_error: str | None
    bad_elements: int
    counts: dict[str, np.ndarray]
    groups: dict[str, tuple[tuple[int, ...], ...]]


def audit(
    topology: Topology,
    inventory: Sequence[LogicalParam],
    rule: Rule = exclusion_reason,
    bucket_size: int | None = None,
) -> AuditReport:
    """Check that ``rule`` counts every logical gradient element exactly once per norm group.

    Args:
        topology: the parallel sizes.
        inventory: the model's parameters (see :func:`check_inventory`).
        rule: the exclusion rule under test; :func:`megatron_ext.counted_spans.exclusion_reason`
            by default.
        bucket_size: DDP's bucket size in elements, None for one bucket per buffer.

    Returns:
        The :class:`AuditReport`; ``first_error`` names the first bad element's parameter,
        index, count, and the ranks that counted and held it.
    """
    sim = simulate_counting(topology, inventory, rule, bucket_size)
    numel = {p.logical_name: p.numel for p in sim.inventory if p.tied_to is None}
    counts = {n: np.zeros((len(sim.param_groups[n]), k), np.int64) for n, k in numel.items()}
    row = {n: {key: i for i, key in enumerate(keys)} for n, keys in sim.param_groups.items()}
    for s in sim.counted:
        np.add.at(counts[s.name][row[s.name][s.group]], s.indices, 1)
    first_error, bad = None, 0
    for name, table in counts.items():
        wrong = np.argwhere(table != 1)
        bad += len(wrong)
        if first_error is None and len(wrong):
            i, j = (int(v) for v in wrong[0])
            first_error = _describe(sim, name, sim.param_groups[name][i], j, int(table[i, j]))
    groups = {n: tuple(sim.groups[k] for k in keys) for n, keys in sim.param_groups.items()}
    return AuditReport(first_error is None, first_error, bad, counts, groups)


def _describe(sim: CountingSimulation, name: str, key: tuple, element: int, count: int) -> str:
    shape = next(p.shape for p in sim.inventory if p.name == name)
    where = tuple(int(v) for v in np.unravel_index(element, shape))

    def having(slices: Sequence[RankSlice]) -> list[RankSlice]:
        return [s for s in slices if s.name == name and s.group == key and element in s.indices]

    held = having(sim.held)
    reasons: dict[str, list[int]] = {}
    for s in held:
        if s.excluded_because:
            reasons.setdefault(s.excluded_because, []).append(s.rank)
    excluded = "".join(f"; excluded on ranks {_ranks(r)}: {why}" for why, r in reasons.items())
    return (
        f"{name}: logical element {element} {where} of shape {shape} counted {count} times "
        f"(expected once) in the {key[0]} norm group of ranks {_ranks(sim.groups[key])}; "
        f"counted on ranks [{_ranks(s.rank for s in having(sim.counted))}]; "
        f"held on ranks [{_ranks(s.rank for s in held)}]{excluded}"
    )


def _ranks(ranks: Iterable[int]) -> str:
    """Ranks as sorted runs: ``0-3, 8, 10-11``."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _combined_square(partials: np.ndarray, combine: str) -> float:
    if combine == "sum":
        return float(partials.sum())
    return float(np.mean(np.sqrt(partials)) ** 2)


def rank_norms(
    topology: Topology,
    inventory: Sequence[LogicalParam],
    grads: Mapping[str, np.ndarray],
    *,
    rule: Rule = exclusion_reason,
    combine: str = "sum",
    bucket_size: int | None = None,
) -> tuple[float, ...]:
    """The L2 gradient norm each rank would report, from its counted elements, in fp64.

    Each rank sums the squares of the elements it counts; each norm group combines its
    members' partial sums (``"sum"``: all-reduce SUM, Megatron's way; ``"mean"``: the mean
    of the members' norms, as DeepSpeed's AutoEP clipping did, deepspeedai/DeepSpeed#8469);
    a rank in two groups (dense and expert children without the distributed optimizer)
    adds their squares.

    Args:
        topology: the parallel sizes.
        inventory: the model's parameters (see :func:`check_inventory`).
        grads: the gradient of each logical parameter, by logical name, full shape.
        rule: the exclusion rule; :func:`megatron_ext.counted_spans.exclusion_reason` by default.
        combine: ``"sum"`` or ``"mean"``.
        bucket_size: DDP's bucket size in elements, None for one bucket per buffer.

    Returns:
        One norm per global rank.
    """
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
    flat = _flat_grads(inventory, grads)
    sim = simulate_counting(topology, inventory, rule, bucket_size)
    partial = {key: np.zeros(topology.world) for key in sim.groups}
    for s in sim.counted:
        partial[s.group][s.rank] += np.sum(np.square(flat[s.name][s.indices]))
    return tuple(
        float(
            np.sqrt(
                sum(_combined_square(partial[key][list(sim.groups[key])], combine) for key in keys)
            )
        )
        for keys in sim.rank_groups
    )


def reference_norm(inventory: Sequence[LogicalParam], grads: Mapping[str, np.ndarray]) -> float:
    """The fp64 L2 norm of every logical parameter's gradient, each counted once.

    Args:
        inventory: the model's parameters.
        grads: the gradient of each logical parameter, by logical name, full shape.

    Returns:
        The norm.
    """
    flat = _flat_grads(inventory, grads)
    return float(np.sqrt(sum(np.sum(np.square(v)) for v in flat.values())))


def _flat_grads(
    inventory: Sequence[LogicalParam], grads: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    out = {}
    for p in inventory:
        if p.tied_to is not None:
            continue
        if p.name not in grads:
            raise KeyError(f"no gradient given for parameter {p.name!r}")
        g = np.asarray(grads[p.name], dtype=np.float64)
        if g.shape != p.shape:
            raise ValueError(f"gradient of {p.name!r} has shape {g.shape}, expected {p.shape}")
        out[p.name] = g.ravel()
    return out


def rule_dense_tp_for_experts(**flags: Any) -> str | None:
    """Published bug (b): replicated expert gradients deduplicated with the dense TP rank.

    The expert child optimizer received only the dense tensor-parallel group, so an expert
    parameter not split over ETP counted only on dense TP rank 0 (radixark/Megatron-LM#80,
    NVIDIA/Megatron-LM#6470: a DeepSeek-V4 step reported 11.5135 instead of 12.2754 under
    TP4/EP4/ETP1). Takes the keyword arguments of
    :func:`megatron_ext.counted_spans.exclusion_reason`.
    """
    return exclusion_reason(**{**flags, "is_expert": False})


def rule_experts_lost_tp_flag(**flags: Any) -> str | None:
    """Published bug (a), NVIDIA/Megatron-LM#5916: experts undercounted when EP > 1 and TP > 1.

    Our model of it, from the PR text and the fix now in 0.19.2
    (``_set_expert_parameter_attributes``, extensions/transformer_engine.py:91-122):
    grouped-GEMM expert weights (``weight0``, ``weight1``, ...) lacked
    ``tensor_model_parallel``, so expert gradients were treated as tensor-parallel
    duplicates, and the filter knew only the dense TP group: expert gradients counted only
    where the dense TP rank is 0. We have not run the pre-fix code; this reproduces the
    described effect (experts or expert slices omitted), not necessarily every detail.
    Takes the keyword arguments of :func:`megatron_ext.counted_spans.exclusion_reason`.
    """
    expert = flags["is_expert"]
    tmp = flags["tensor_model_parallel"] and not expert
    return exclusion_reason(**{**flags, "tensor_model_parallel": tmp, "is_expert": False})
