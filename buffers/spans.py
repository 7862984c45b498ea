"""Span arithmetic: half-open element ranges of one flat buffer, and what can be done with
them (merge, intersect, subtract, shard, translate). Every module that reasons about where
elements sit uses these; nothing else re-implements them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Span:
    """A half-open element range ``[start, end)`` of one flat buffer."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"invalid span [{self.start}, {self.end})")

    @property
    def numel(self) -> int:
        return self.end - self.start


def merge_spans(spans: Iterable[Span]) -> tuple[Span, ...]:
    """Sorted, non-overlapping, non-empty spans covering the same elements."""
    out: list[Span] = []
    for s in sorted(s for s in spans if s.numel):
        if out and s.start <= out[-1].end:
            out[-1] = Span(out[-1].start, max(out[-1].end, s.end))
        else:
            out.append(s)
    return tuple(out)


def intersect_spans(a: Iterable[Span], b: Iterable[Span]) -> tuple[Span, ...]:
    """Elements in both ``a`` and ``b``, as merged spans."""
    a, b = merge_spans(a), merge_spans(b)
    out: list[Span] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i].start, b[j].start), min(a[i].end, b[j].end)
        if lo < hi:
            out.append(Span(lo, hi))
        if a[i].end < b[j].end:
            i += 1
        else:
            j += 1
    return merge_spans(out)


def subtract_spans(a: Iterable[Span], b: Iterable[Span]) -> tuple[Span, ...]:
    """Elements of ``a`` that are not in ``b``, as merged spans."""
    cuts = merge_spans(b)
    out: list[Span] = []
    for s in merge_spans(a):
        start = s.start
        for c in cuts:
            if c.end <= start or c.start >= s.end:
                continue
            if c.start > start:
                out.append(Span(start, c.start))
            start = max(start, c.end)
        if start < s.end:
            out.append(Span(start, s.end))
    return merge_spans(out)


def dp_shard_spans(buckets: Sequence[Span], dp_size: int, dp_rank: int) -> tuple[Span, ...]:
    """The part of each bucket that data-parallel rank ``dp_rank`` owns.

    Megatron's distributed optimizer pads every bucket to a multiple of ``dp_size`` and
    gives rank ``r`` the ``r``-th of ``dp_size`` equal, contiguous shards of it.
    """
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
    out = []
    for b in buckets:
        if b.numel % dp_size:
            raise ValueError(
                f"bucket [{b.start}, {b.end}) has {b.numel} elements, not a multiple of "
                f"dp_size={dp_size}; Megatron pads buckets so that it is"
            )
        shard = b.numel // dp_size
        out.append(Span(b.start + dp_rank * shard, b.start + (dp_rank + 1) * shard))
    return tuple(out)


def to_local(spans: Sequence[Span], owned: Sequence[Span]) -> tuple[Span, ...]:
    """Translate buffer coordinates into the coordinates of the owned ranges laid end to end.

    A rank's shard of a sharded buffer (one range per bucket) is copied into one contiguous
    local tensor; this maps spans inside the shard onto that tensor.
    """
    out = []
    base = 0
    for o in owned:
        for s in intersect_spans(spans, [o]):
            out.append(Span(base + s.start - o.start, base + s.end - o.start))
        base += o.numel
    return merge_spans(out)
