"""The layout of one model chunk's gradient buffers: plain, frozen data, built once.

:class:`megatron_ext.DistributedDataParallel` builds one :class:`ChunkLayout` per model
chunk from megatron-core's own buffers, keyed like megatron-core's ``BufferKey`` (param
dtype, grad dtype, expert or not); the optimizer, offload and audit code read it. Which
elements count toward the norm depends on the optimizer's process groups, so the records
here say where each gradient sits, and each optimizer decides what counts
(:func:`megatron_ext.ddp.counted_records`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from buffers.spans import Span, dp_shard_spans

from .counted_spans import GradRecord


@dataclass(frozen=True)
class BufferKey:
    """Which gradient buffer: megatron-core keeps one per (param dtype, grad dtype, expert)."""

    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    is_expert: bool

    def describe(self) -> str:
        kind = "expert" if self.is_expert else "dense"
        return f"{self.grad_dtype} grads of {self.param_dtype} params ({kind})"


@dataclass(frozen=True)
class BufferLayout:
    """Where every gradient of one buffer sits, its buckets, and this rank's shard."""

    key: BufferKey
    numel: int
    buckets: tuple[Span, ...]
    records: tuple[GradRecord, ...]  # sorted by start; exclusion decided per optimizer
    dp_size: int  # ranks the distributed optimizer shards each bucket over
    dp_rank: int
    island_numel: int = 0  # elements of the fp32 local-accumulation island (0: none)

    @property
    def shard(self) -> tuple[Span, ...]:
        """This rank's part of every bucket (what a distributed optimizer owns)."""
        return dp_shard_spans(self.buckets, self.dp_size, self.dp_rank)

    def rows(self) -> list[tuple]:
        """The layout as plain tuples, for comparing ranks (buffer header first)."""
        head = (str(self.key.param_dtype), str(self.key.grad_dtype), self.numel,
                tuple((b.start, b.end) for b in self.buckets))  # fmt: skip
        return [head] + [(r.name, r.start, r.end, r.bucket) for r in self.records]


@dataclass(frozen=True)
class ChunkLayout:
    """Every gradient buffer of one model chunk: dense first, then expert-parallel."""

    buffers: tuple[BufferLayout, ...]

    def __post_init__(self) -> None:
        keys = [b.key for b in self.buffers]
        if len(set(keys)) != len(keys):
            raise ValueError(f"two buffers of one model chunk share a key: {keys}")

    def __getitem__(self, key: BufferKey) -> BufferLayout:
        for b in self.buffers:
            if b.key == key:
                return b
        raise KeyError(f"no {key.describe()} buffer in this model chunk")

    def keys(self) -> tuple[BufferKey, ...]:
        return tuple(b.key for b in self.buffers)


def buffer_key(buf) -> BufferKey:
    """The key of a megatron-core gradient buffer (expert: its parameters' ``allreduce``
    is False, megatron-core's mark of expert-parallel parameters)."""
    first = next(iter(buf.param_index_map), None)
    expert = first is not None and not getattr(first, "allreduce", True)
    return BufferKey(buf.param_dtype, buf.grad_dtype, expert)


def buffer_layout(buf, names: Mapping, island_numel: int = 0) -> BufferLayout:
    """The :class:`BufferLayout` of a megatron-core gradient buffer.

    Args:
        buf: a megatron-core ``_ParamAndGradBuffer`` (or anything with its attributes).
        names: parameter -> name, for the records.
        island_numel: elements of the buffer's fp32 local-accumulation island.
    """
    records = sorted(
        (
            GradRecord(name=names.get(p, "<unnamed>"), start=start, end=end, bucket=bucket)
            for p, (start, end, bucket) in buf.param_index_map.items()
        ),
        key=lambda r: r.start,
    )
    group = buf.data_parallel_group
    return BufferLayout(
        key=buffer_key(buf),
        numel=buf.numel,
        buckets=tuple(Span(s, e) for s, e in buf.bucket_indices),
        records=tuple(records),
        dp_size=group.size(),
        dp_rank=group.rank(),
        island_numel=island_numel,
    )


def record_params(buf, records: Sequence[GradRecord]) -> list:
    """The parameter of each of ``records``, in order: ``buf``'s layout records
    (:func:`buffer_layout`, or the same records with verdicts).

    A start alone does not name a parameter: megatron-core lays a zero-size parameter out
    at the start of the next one. Records list the buffer's parameters in start order (a
    stable sort of ``param_index_map``), so they pair with the parameters by position;
    every pair is checked against its span.

    Raises:
        ValueError: ``records`` are not ``buf``'s layout.
    """
    params = sorted(buf.param_index_map.items(), key=lambda item: item[1][0])
    spans = [(start, end) for _, (start, end, _) in params]
    if spans != [(r.start, r.end) for r in records]:
        raise ValueError(
            f"these {len(records)} gradient records are not the layout of this buffer of "
            f"{len(spans)} parameters; pass buffer_layout(buf, ...).records"
        )
    return [param for param, _ in params]
