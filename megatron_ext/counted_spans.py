"""Which spans of a Megatron gradient buffer count toward the norm on one rank.

Pure data and pure functions: computed once at start-up from a buffer's layout (offsets,
buckets) and each parameter's flags, testable on the CPU with no process group. The rules
are Megatron's ``get_grads_for_grad_norm``: a gradient counts unless its parameter is
``shared`` or a tensor-parallel duplicate (counted on tensor-parallel rank 0 only; the
expert tensor-parallel rank for expert parameters), and with the distributed optimizer only
this data-parallel rank's shard of each bucket counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from buffers.spans import Span, dp_shard_spans, intersect_spans, merge_spans

SHARED = "shared"
TP_DUPLICATE = "tensor-parallel duplicate"
GTP_DUPLICATE = "GTP-remat duplicate"


@dataclass(frozen=True)
class GradRecord:
    """One parameter's gradient inside a Megatron buffer, and whether it counts."""

    name: str
    start: int
    end: int
    bucket: int
    excluded_because: str | None = None  # None: counts toward the norm

    @property
    def span(self) -> Span:
        return Span(self.start, self.end)


@dataclass(frozen=True)
class RankSpans:
    """What one rank reads and writes in one buffer, in that buffer's element coordinates."""

    owned: tuple[Span, ...]  # this rank's shard (the whole buffer without sharding)
    norm: tuple[Span, ...]  # counted elements this rank owns (plus zero padding between)
    padding_in_norm: int  # padding elements inside ``norm`` (zero; subtracted by counts)

    @property
    def owned_numel(self) -> int:
        return sum(s.numel for s in self.owned)


def exclusion_reason(
    *,
    shared: bool,
    tensor_model_parallel: bool,
    is_expert: bool,
    tp_rank: int,
    expert_tp_rank: int | None,
    gtp_duplicate: bool = False,
) -> str | None:
    """Why a parameter's gradient does not count toward the norm, or None if it does.

    Mirrors Megatron's ``param_is_not_shared`` and ``param_is_not_tensor_parallel_duplicate``:
    a parameter that is not split across tensor-parallel ranks is counted on rank 0 of its
    tensor-parallel group: the expert one for expert parameters. ``is_expert`` means
    Megatron's ``allreduce=False`` (expert-parallel buffers), not "belongs to an MoE layer":
    with EP = 1 and ETP = TP, experts live in dense buffers and use the dense rank.
    ``gtp_duplicate`` is megatron-core 0.19's ``not param_is_not_gtp_duplicate(param)``: a
    replicated parameter on a nonzero rank of the GTP-remat axis (counted on its rank 0).
    """
    # Duplicates first: a shared parameter's copy on a nonzero rank is a replica of rank 0's,
    # which the per-parameter report must not add again (megatron_ext.global_param_norms).
    if gtp_duplicate:
        return GTP_DUPLICATE
    if not tensor_model_parallel:
        if is_expert and expert_tp_rank is None:
            # Falling back to the dense TP rank here is the published ETP != TP undercount.
            raise ValueError("an expert-parallel parameter needs its expert tensor-parallel rank")
        rank = expert_tp_rank if is_expert else tp_rank
        if rank != 0:
            return f"{TP_DUPLICATE} (counted on rank 0, this is rank {rank})"
    return SHARED if shared else None


def counted_runs(records: Sequence[GradRecord]) -> tuple[Span, ...]:
    """Counted gradients as few spans as possible.

    A gap between two counted gradients holds only padding (zero) unless an excluded
    gradient lies in it, so runs are bridged across such gaps: fewer, longer spans.
    """
    runs: list[Span] = []
    open_run: Span | None = None
    for r in sorted(records, key=lambda r: r.start):
        if r.excluded_because is not None:
            if open_run is not None:
                runs.append(open_run)
                open_run = None
        elif open_run is None:
            open_run = r.span
        else:
            open_run = Span(open_run.start, max(open_run.end, r.end))
    if open_run is not None:
        runs.append(open_run)
    return merge_spans(runs)


def rank_spans(
    records: Sequence[GradRecord],
    numel: int,
    buckets: Sequence[Span] | None = None,
    dp_size: int = 1,
    dp_rank: int = 0,
) -> RankSpans:
    """The spans one rank owns and counts in one buffer.

    Args:
        records: every gradient in the buffer, with its exclusion reason.
        numel: the buffer's length (padding included).
        buckets: bucket ranges when the buffer is sharded by the distributed optimizer;
            None when every rank holds the whole buffer.
        dp_size: ranks the buckets are sharded over.
        dp_rank: this rank's index among them.

    Returns:
        The :class:`RankSpans`.
    """
    owned = (Span(0, numel),) if buckets is None else dp_shard_spans(buckets, dp_size, dp_rank)
    norm = intersect_spans(counted_runs(records), owned)
    covered = sum(s.numel for s in intersect_spans(merge_spans(r.span for r in records), norm))
    return RankSpans(
        owned=merge_spans(owned), norm=norm, padding_in_norm=sum(s.numel for s in norm) - covered
    )
