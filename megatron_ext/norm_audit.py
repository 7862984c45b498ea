"""Check on a running job that every gradient element is counted exactly once in the norm.

Opt-in, for real jobs: call :func:`audit_norm_ownership` once at start-up (or every N steps).
Each rank lists its *claims*: for every parameter of every buffer its optimizers read, the
ranges of the parameter's local tensor that this rank counts toward the norm, keyed by the
logical piece that local tensor holds (:class:`PieceKey`). One ``all_gather_object`` per norm
group brings every rank's claims to every rank, and each rank runs the same pure check
(:func:`check_claims`) on the same data, so every rank raises the same
:class:`NormOwnershipError` or none does. :func:`explain_norm` prints one rank's view.

The keys come from Megatron's flags (``tensor_model_parallel``, ``allreduce``) and the
parallel ranks, so the audit catches wrong spans, shards and exclusion verdicts, but trusts
the flags: a parameter split across tensor-parallel ranks yet not flagged looks replicated
to it (NVIDIA/Megatron-LM#5916). :mod:`megatron_ext.ownership` checks the rules themselves.

Cost: one ``all_gather_object`` per norm group of every rank's claims (O(local parameters)
small tuples), then a sort per parameter piece, on every rank: O(parameters x ranks in the
group), growing linearly with the group, so audit large distributed-optimizer groups once, at
start-up (measured costs: docs/RESULTS.md, "The norm-ownership audit's cost").
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch

from buffers.spans import Span

from . import seam
from .counted_spans import SHARED, GradRecord
from .layout import record_params
from .targets import BufferTarget

OTHER_SHARD = "other rank's shard"


class NormOwnershipError(RuntimeError):
    """A gradient element is counted zero times, or more than once, across a norm group."""


@dataclass(frozen=True)
class PieceKey:
    """The logical piece of a parameter that one local tensor holds, the same on every rank.

    ``tp_piece`` is the tensor-parallel rank (the expert one for expert-parallel parameters)
    when the parameter is split across those ranks, None when each holds a full copy;
    ``ep_rank`` is the expert-parallel rank for expert-parallel parameters (their names are
    local to it), None otherwise. ``chunk`` is the model chunk (virtual pipeline stage)
    index on the pipeline rank, since names repeat across chunks.
    """

    pp_rank: int
    chunk: int
    name: str
    tp_piece: int | None
    ep_rank: int | None

    def describe(self) -> str:
        tp = (
            "replicated over tensor-parallel ranks"
            if self.tp_piece is None
            else f"tensor-parallel piece {self.tp_piece}"
        )
        ep = "" if self.ep_rank is None else f", expert-parallel rank {self.ep_rank}"
        return f"{self.name!r} (pipeline rank {self.pp_rank}, model chunk {self.chunk}, {tp}{ep})"


@dataclass(frozen=True)
class Claim:
    """The elements of one local parameter tensor that one rank counts toward the norm."""

    key: PieceKey
    numel: int  # elements of the local tensor
    counted: tuple[Span, ...]  # in the local tensor's flat coordinates
    excluded_because: str | None  # the exclusion rule's verdict on this rank


@dataclass(frozen=True)
class ParallelRanks:
    """This rank's position in the groups that decide which piece a local tensor holds."""

    pp: int = 0
    tp: int = 0
    expert_tp: int = 0
    ep: int = 0


@dataclass(frozen=True)
class AuditResult:
    """What a passing audit checked (a failing one raises :class:`NormOwnershipError`)."""

    groups: tuple[tuple[int, ...], ...]  # global ranks of each norm group audited
    pieces: int  # logical parameter pieces checked
    elements: int  # gradient elements counted, each exactly once
    shared_pieces: int  # pieces every holder excludes as a shared copy (counted nowhere)


def piece_key(
    name: str,
    *,
    chunk: int,
    tensor_model_parallel: bool,
    is_expert: bool,
    ranks: ParallelRanks,
) -> PieceKey:
    """The :class:`PieceKey` of a local parameter, from Megatron's flags on it.

    Args:
        name: the parameter's name in its model chunk.
        chunk: the model chunk's index on this rank.
        tensor_model_parallel: Megatron's flag: the parameter is split across TP ranks.
        is_expert: Megatron's ``allreduce=False`` (expert-parallel buffers), as in
            :func:`megatron_ext.counted_spans.exclusion_reason`.
        ranks: this rank's :class:`ParallelRanks`.

    Returns:
        The :class:`PieceKey`.
    """
    tp_rank = ranks.expert_tp if is_expert else ranks.tp
    return PieceKey(
        ranks.pp,
        chunk,
        name,
        tp_rank if tensor_model_parallel else None,
        ranks.ep if is_expert else None,
    )


def local_spans(record: GradRecord, spans: Sequence[Span]) -> tuple[Span, ...]:
    """The part of ``record`` inside ``spans`` (sorted, disjoint), in parameter offsets."""
    # Bisect instead of intersecting every span: a buffer has up to one span per parameter.
    i = max(bisect.bisect_right(spans, Span(record.start, record.start)) - 1, 0)
    out = []
    while i < len(spans) and spans[i].start < record.end:
        lo, hi = max(spans[i].start, record.start), min(spans[i].end, record.end)
        if lo < hi:
            out.append(Span(lo - record.start, hi - record.start))
        i += 1
    return tuple(out)


def buffer_claims(
    records: Sequence[GradRecord], norm: Sequence[Span], keys: Sequence[PieceKey]
) -> tuple[Claim, ...]:
    """One rank's claims for one buffer.

    Args:
        records: every gradient in the buffer (grad-buffer coordinates).
        norm: the spans this rank counts (``RankSpans.norm``), sorted and disjoint.
        keys: the piece each record's local tensor holds, aligned with ``records``.

    Returns:
        One :class:`Claim` per record.
    """
    return tuple(
        Claim(k, r.end - r.start, local_spans(r, norm), r.excluded_because)
        for r, k in zip(records, keys, strict=True)
    )


# A claim as plain tuples, (key fields, numel, ((start, end), ...), excluded_because): what
# crosses the wire and what the check reads. Pickling tuples is ~20x faster than dataclasses.
_Row = tuple[tuple, int, tuple[tuple[int, int], ...], str | None]


def _row(c: Claim) -> _Row:
    k = c.key
    return (
        (k.pp_rank, k.chunk, k.name, k.tp_piece, k.ep_rank),
        c.numel,
        tuple((s.start, s.end) for s in c.counted),
        c.excluded_because,
    )


def check_claims(claims_by_rank: Mapping[int, Sequence[Claim]]) -> AuditResult:
    """Check that each piece's counted ranges cover it exactly once across the ranks.

    A piece some holder excludes as ``shared`` (a copy of a parameter counted elsewhere,
    like a tied output layer) must be counted nowhere. Pieces are checked in the order of
    the lowest rank's claims, so every rank reports the same first error.

    Args:
        claims_by_rank: each global rank's claims, for the ranks of one norm group.

    Returns:
        The :class:`AuditResult`.

    Raises:
        NormOwnershipError: naming the first bad piece, its element range counted the
            wrong number of times, the ranks that counted it and why the others did not.
    """
    return _check_rows({rank: [_row(c) for c in cs] for rank, cs in claims_by_rank.items()})


def _check_rows(rows_by_rank: Mapping[int, Sequence[_Row]]) -> AuditResult:
    holders: dict[tuple, list[tuple[int, int, tuple, str | None]]] = {}
    for rank in sorted(rows_by_rank):
        for key, numel, counted, why in rows_by_rank[rank]:
            holders.setdefault(key, []).append((rank, numel, counted, why))
    elements = shared = 0
    for key, held in holders.items():
        numels = {numel for _, numel, _, _ in held}
        if len(numels) > 1:
            sizes = "; ".join(f"rank {r}: {numel}" for r, numel, _, _ in held)
            raise NormOwnershipError(
                f"ranks disagree on the size of {PieceKey(*key).describe()}: {sizes}. The "
                "ranks holding one piece must hold tensors of the same shape; check the model "
                "config."
            )
        (numel,) = numels
        expected = 0 if any(why == SHARED for _, _, _, why in held) else 1
        runs = sorted((lo, hi, r) for r, _, counted, _ in held for lo, hi in counted if lo < hi)
        if not _covered_exactly(runs, numel, expected):
            raise NormOwnershipError(_first_miscount(PieceKey(*key), held, runs, numel, expected))
        elements += expected * numel
        shared += 1 - expected
    return AuditResult((tuple(sorted(rows_by_rank)),), len(holders), elements, shared)


def _covered_exactly(runs: Sequence[tuple[int, int, int]], numel: int, expected: int) -> bool:
    if expected == 0:
        return not runs
    end = 0
    for start, stop, _ in runs:
        if start != end:
            return False
        end = stop
    return end == numel


def _first_miscount(key: PieceKey, held, runs, numel: int, expected: int) -> str:
    bounds = sorted({0, numel, *(b for run in runs for b in run[:2])})
    bad = None  # (start, end, ranks, expected count) of the first miscounted segments
    for lo, hi in pairwise(bounds):
        ranks = tuple(r for start, stop, r in runs if start <= lo and hi <= stop)
        want = expected if hi <= numel else 0  # nothing exists past the local tensor
        if bad is not None:
            if (ranks, want) != bad[2:]:
                break
            bad = (bad[0], hi, ranks, want)
        elif len(ranks) != want:
            bad = (lo, hi, ranks, want)
    if bad is None:
        raise AssertionError(f"{key}: called for pieces that are counted right")
    lo, hi, ranks, want = bad
    by = f"by ranks {_list(ranks)}" if ranks else "by no rank"
    if hi > numel:
        expect = "none: they lie past the end of the local tensor"
    elif want:
        expect = "once"
    else:
        expect = "zero times: a shared copy, counted with its original"
    reasons: dict[str, list[int]] = {}
    for r, _, _, why in held:
        if why is not None:
            reasons.setdefault(why, []).append(r)
    excluded = "".join(f"; excluded on ranks {_list(r)}: {why}" for why, r in reasons.items())
    return (
        f"gradient-norm ownership check failed for {key.describe()}: local elements "
        f"[{lo}, {hi}) of {numel} are counted {_times(len(ranks))} (expected {expect}), {by}; "
        f"held by ranks {_list(r for r, *_ in held)}{excluded}. "
        "Run megatron_ext.explain_norm on these ranks to see what each one counts."
    )


def _times(n: int) -> str:
    return {0: "zero times", 1: "once", 2: "twice"}.get(n, f"{n} times")


def _list(ranks) -> str:
    return "[" + ", ".join(str(r) for r in ranks) + "]"


def gather_and_check(claims: Sequence[Claim], group=None) -> AuditResult:
    """Gather every rank's claims with one ``all_gather_object`` and check them.

    Args:
        claims: this rank's claims.
        group: the norm group (None: the default group); without an initialised process
            group, this rank's claims alone are checked.

    Returns:
        The :class:`AuditResult`, the same on every rank of ``group``.

    Raises:
        NormOwnershipError: on every rank of ``group``, with the same message.
    """
    if not torch.distributed.is_initialized():
        return check_claims({0: claims})
    everyone: list = [None] * torch.distributed.get_world_size(group)
    mine = (torch.distributed.get_rank(), [_row(c) for c in claims])
    torch.distributed.all_gather_object(everyone, mine, group=group)
    return _check_rows(dict(everyone))


def audit_norm_ownership(model_chunks, optimizer, group=None) -> AuditResult:
    """Check across ranks that the flat gradient norm counts every element exactly once.

    A collective: call it on every rank. Children of a ``ChainedOptimizer`` whose norms
    reduce over one group are audited together, with one ``all_gather_object``; children
    with different groups (dense and expert without the distributed optimizer) each over
    their own, as their norms are.

    Args:
        model_chunks: the :class:`megatron_ext.DistributedDataParallel` chunks the
            optimizer was built from, in order.
        optimizer: what :func:`megatron_ext.get_megatron_optimizer` returned.
        group: audit every child over this process group instead.

    Returns:
        The :class:`AuditResult`.

    Raises:
        NormOwnershipError: on every rank, naming the first miscounted parameter.
    """
    children = _children(optimizer)
    ranks = parallel_ranks()
    claims: list[list[Claim]] = [[] for _ in children]
    for i, chunk, buf, target in _placed_targets(model_chunks, children):
        claims[i].extend(_target_claims(chunk, buf, target, ranks))
    if group is not None or len(children) == 1 or optimizer.grads_states_parallel_group_is_shared():
        if group is None:
            group = children[0].get_grad_stats_parallel_group()
        return gather_and_check([c for cs in claims for c in cs], group)
    results = [
        gather_and_check(cs, child.get_grad_stats_parallel_group())
        for child, cs in zip(children, claims, strict=True)
    ]
    return AuditResult(
        tuple(g for r in results for g in r.groups),
        sum(r.pieces for r in results),
        sum(r.elements for r in results),
        sum(r.shared_pieces for r in results),
    )


def parallel_ranks() -> ParallelRanks:
    """This rank's pipeline, tensor, expert-tensor and expert-parallel ranks (0 if unset)."""
    ps = seam.target("parallel state")
    if not ps.model_parallel_is_initialized():
        return ParallelRanks()
    return ParallelRanks(
        ps.get_pipeline_model_parallel_rank(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_expert_tensor_parallel_rank(),
        ps.get_expert_model_parallel_rank(),
    )


def _children(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _placed_targets(model_chunks, children) -> list[tuple[int, int, Any, BufferTarget]]:
    """(child index, model chunk index, buffer, target) for every target of every child."""
    where = {}
    for chunk, m in enumerate(model_chunks):
        if getattr(m, "per_dtype_grad_buffers", False):  # other chunks have no flat state
            for buf in m.all_grad_buffers():
                where[id(buf)] = (chunk, buf)
    out = []
    for i, child in enumerate(children):
        flat = getattr(child, "_flat", None)
        if flat is None:
            raise ValueError(
                f"optimizer {i} ({type(child).__name__}) has no flat norm state; build it with "
                "megatron_ext.get_megatron_optimizer from chunks with per_dtype_grad_buffers=True"
            )
        for t in flat.targets:
            if id(t.buffer) not in where:
                raise ValueError(
                    f"the buffer {t.name!r} of optimizer {i} is in none of the model chunks "
                    "given; pass the chunks the optimizer was built from"
                )
            out.append((i, *where[id(t.buffer)], t))
    return out


def _target_claims(chunk: int, buf, target: BufferTarget, ranks: ParallelRanks):
    keys = [
        piece_key(
            r.name,
            chunk=chunk,
            tensor_model_parallel=bool(getattr(p, "tensor_model_parallel", False)),
            is_expert=not getattr(p, "allreduce", True),
            ranks=ranks,
        )
        for r, p in zip(target.records, record_params(buf, target.records), strict=True)
    ]
    return buffer_claims(target.records, target.spans.norm, keys)


def explain_norm(model_chunks, optimizer) -> str:
    """A table of what this rank counts toward the gradient norm, buffer by buffer.

    For each parameter: its local shape and size, where it sits in its buffer, how many
    elements this rank counts and which (local offsets), and why the rest is not counted
    here: ``shared``, ``tensor-parallel duplicate (...)`` or ``other rank's shard``.

    Args:
        model_chunks: the chunks the optimizer was built from, in order.
        optimizer: what :func:`megatron_ext.get_megatron_optimizer` returned.

    Returns:
        Plain text, one aligned table per buffer with its totals.
    """
    children = _children(optimizer)
    r = parallel_ranks()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    lines = [
        f"Gradient-norm ownership on rank {rank} (pipeline rank {r.pp}, tensor-parallel rank "
        f"{r.tp}, expert tensor-parallel rank {r.expert_tp}, expert-parallel rank {r.ep})"
    ]
    for i, chunk, buf, target in _placed_targets(model_chunks, children):
        owned = target.spans.owned
        lines += [
            "",
            f"{target.name}: optimizer {i} ({type(children[i]).__name__}), model chunk "
            f"{chunk}; this rank owns {sum(s.numel for s in owned)} of {buf.numel} elements",
            *_buffer_table(target, record_params(buf, target.records)),
        ]
    return "\n".join(lines)


def _buffer_table(target: BufferTarget, params: Sequence[torch.Tensor]) -> list[str]:
    rows = []
    totals: dict[str, int] = {}
    numel_sum = counted_sum = 0
    for rec, param in zip(target.records, params, strict=True):
        numel = rec.end - rec.start
        counted = local_spans(rec, target.spans.norm)
        n_counted = sum(s.numel for s in counted)
        reasons: list[tuple[str, int, tuple[Span, ...]]]
        if rec.excluded_because is not None:
            reasons = [(rec.excluded_because, numel - n_counted, ())]
        else:
            owned = local_spans(rec, target.spans.owned)
            n_owned = sum(s.numel for s in owned)
            reasons = [
                (OTHER_SHARD, numel - n_owned, _complement(owned, numel)),
                ("owned but outside the norm spans", n_owned - n_counted, ()),
            ]
        reasons = [w for w in reasons if w[1]]
        for reason, n, _ in reasons:
            category = reason.split(" (")[0]
            totals[category] = totals.get(category, 0) + n
        numel_sum += numel
        counted_sum += n_counted
        rows.append(
            (
                rec.name,
                str(tuple(param.shape)),
                str(numel),
                _spans_text([Span(rec.start, rec.end)]),
                str(n_counted),
                _spans_text(counted) or "-",
                "; ".join(f"{w}: {_spans_text(s)}" if s else w for w, _, s in reasons) or "-",
            )
        )
    rest = "; ".join(f"{why}: {n}" for why, n in totals.items()) or "-"
    total = ("total", f"{len(rows)} params", str(numel_sum), "", str(counted_sum), "", rest)
    header = (
        "parameter",
        "local shape",
        "numel",
        "buffer range",
        "counted",
        "counted (local)",
        "not counted here because",
    )
    return _aligned([header, *rows, total], right={2, 4})


def _complement(spans: Sequence[Span], numel: int) -> tuple[Span, ...]:
    edges = [0, *(b for s in spans for b in (s.start, s.end)), numel]
    return tuple(Span(a, b) for a, b in zip(edges[::2], edges[1::2], strict=True) if a < b)


def _spans_text(spans: Sequence[Span]) -> str:
    return ", ".join(f"[{s.start}, {s.end})" for s in spans)


def _aligned(rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(row[j]) for row in rows) for j in range(len(rows[0]))]
    return [
        "  "
        + "  ".join(
            cell.rjust(w) if j in right else cell.ljust(w)
            for j, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
