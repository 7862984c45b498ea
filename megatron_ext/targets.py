"""Per optimizer: which views of which flat buffers its norm reads and its clip scales.

Built once when the optimizer is built (:func:`build_targets`); the per-step code only walks
the resulting lists, one entry per flat buffer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from buffers.spans import Span, intersect_spans, subtract_spans, to_local

from .counted_spans import GradRecord, RankSpans, rank_spans
from .layout import BufferLayout


@dataclass
class BufferTarget:
    """One flat gradient buffer as one optimizer sees it on this rank."""

    name: str  # e.g. "bf16 grads of bf16 params (dense)"
    records: tuple[GradRecord, ...]  # every gradient in the buffer (grad-buffer coordinates)
    spans: RankSpans  # in grad-buffer coordinates
    norm_views: list[torch.Tensor]  # views of the grad buffer that count toward the norm
    scale_views: list[torch.Tensor]  # views of what the optimizer reads (grad buffer or mirror)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (dst, src)
    # fp32 copy of this rank's shard, when one is needed; its storage is allocated for a
    # step only ([Note: the mirror lives for one step]).
    mirror: torch.Tensor | None = None
    buffer: Any = None  # the megatron-core buffer itself (megatron-core ships no types)
    norm_reads_mirror: bool = False  # norm_views are views of ``mirror``, not the buffer
    # The fp32 local-accumulation island, when the optimizer reads its parameters' gradients
    # there (no mirror): megatron-core unscales those in place, not their buffer slices.
    island: torch.Tensor | None = None
    # (record start, owned piece in buffer coordinates, the same piece in island coordinates)
    # of every island parameter this rank owns, when ``island`` is set.
    island_pieces: tuple[tuple[int, Span, Span], ...] = ()
    island_norm_views: list[torch.Tensor] = field(default_factory=list)  # counted pieces
    island_scale_views: list[torch.Tensor] = field(default_factory=list)  # the whole island


@dataclass
class FlatOptimizerState:
    """Everything a flat norm/clip needs for one optimizer, built once."""

    targets: list[BufferTarget]
    # (tensor, attribute, view): the optimizer's main gradients, bound to flat views;
    # None when megatron-core's own copy step already binds views without copying.
    bindings: list[tuple[torch.Tensor, str, torch.Tensor]] | None

    @property
    def norm_groups(self) -> list[list[torch.Tensor]]:
        """Per buffer its views, then its island's when the norm reads one (one group per
        storage, so each is one fused launch)."""
        return [g for t in self.targets for g in (t.norm_views, t.island_norm_views) if g]

    @property
    def scale_groups(self) -> list[list[torch.Tensor]]:
        return [g for t in self.targets for g in (t.scale_views, t.island_scale_views) if g]

    @property
    def padding(self) -> int:
        return sum(t.spans.padding_in_norm for t in self.targets)

    def fill_mirrors(self) -> None:
        """Copy every owned range into its target's mirror, allocating the mirror's storage
        first where :meth:`release_mirrors` freed it (the copies overwrite all of it)."""
        for t in self.targets:
            if t.mirror is None:
                continue
            storage = t.mirror.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(t.mirror.numel() * t.mirror.element_size())
            for dst, src in t.copies:
                dst.copy_(src)  # one copy (and cast) per owned range

    def check_mirrors_filled(self, scaling: bool) -> None:
        """Raise unless every mirror about to be read holds memory: reading one that
        :meth:`release_mirrors` freed would read through a null address (a crash, not an
        error, on either device).

        Args:
            scaling: a clip is about to scale (every mirror is read), else only a norm or a
                zero count (only the mirrors the norm reads).

        Raises:
            RuntimeError: such a mirror was freed by ``zero_grad()`` and not filled since.
        """
        for t in self.targets:
            m = t.mirror
            if m is None or not (scaling or t.norm_reads_mirror):
                continue
            if m.numel() and not m.untyped_storage().nbytes():
                raise RuntimeError(
                    f"the optimizer's fp32 copies of the {t.name} were freed by zero_grad() "
                    "and not made since, and this reads them; call "
                    "optimizer.prepare_grads() (step() does) after backward, before reading them"
                )

    def release_mirrors(self) -> None:
        """Free every mirror's storage until the next :meth:`fill_mirrors` ([Note: the
        mirror lives for one step])."""
        for t in self.targets:
            if t.mirror is not None:
                t.mirror.untyped_storage().resize_(0)


# [Note: the mirror lives for one step]
# Without the precision-aware optimizer, megatron-core's optimizers read fp32 copies of bf16
# gradients. Stock allocates them in the copy step (``shard_model_grad.float()`` per
# parameter) and frees them in ``zero_grad(set_to_none=True)``, which Megatron's training
# loop calls before forward: they never coexist with the activations. Our copy is one mirror
# per buffer, and everything built once reads it through views (the optimizer's ``.grad``
# bindings, norm and scale views, host-mirror copy sources). A permanent mirror would hold
# 4 bytes per owned element through forward and backward, where activations peak. So the
# mirror's *storage* is freed where stock frees its copies and regrown by the next copy
# step: every view stays a view of the same storage object and reads the new memory.
# Nothing may read a mirror in between (its views then point at no memory, which torch does
# not check): the flat norm, clip and zero count call check_mirrors_filled first. A
# CUDA graph that captured the old address notices that the storage moved
# (buffers.graphs.GraphReplayer's sources) and is captured again. A reader on another
# stream that outlives the step (an overlapped host step) must ``record_stream`` the mirror,
# so that the allocator keeps the freed block until that stream is done with it.


def _views(t: torch.Tensor, spans) -> list[torch.Tensor]:
    return [t[s.start : s.end] for s in spans]


def buffer_target(
    buf,
    layout: BufferLayout,
    records,
    *,
    sharded: bool,
    needs_mirror: bool,
    island=None,
    norm_reads_mirror: bool = False,
) -> BufferTarget:
    """The target for one buffer.

    Args:
        buf: a megatron-core ``_ParamAndGradBuffer``.
        layout: its :class:`~megatron_ext.layout.BufferLayout`.
        records: its records with this optimizer's exclusion verdicts
            (:func:`megatron_ext.ddp.counted_records`).
        sharded: the distributed optimizer owns only this rank's shard of each bucket.
        needs_mirror: the optimizer reads fp32 copies of these (lower-precision) gradients;
            they get one flat fp32 mirror of the owned ranges, filled by one copy per range.
        island: the buffer's fp32 local-accumulation island, if any: scaled too, and without
            a mirror what the norm reads for its parameters. megatron-core's optimizer then
            reads (and unscales in place) their fp32 ``main_grad`` in the island, not their
            slices of the gradient buffer, which keep the loss-scaled values.
        norm_reads_mirror: the norm reads the mirror instead of the gradient buffer. With a
            loss scaler megatron-core unscales only the copies the optimizer reads (the
            mirror), so the buffer still holds the scaled gradients.
    """
    if sharded:
        spans = rank_spans(records, layout.numel, layout.buckets, layout.dp_size, layout.dp_rank)
    else:
        spans = rank_spans(records, layout.numel)
    grad = buf.grad_data
    target = BufferTarget(
        layout.key.describe(), tuple(records), spans, _views(grad, spans.norm), [], buffer=buf
    )
    if island is not None and not needs_mirror:
        _read_island(target, buf, island)
    if norm_reads_mirror and not needs_mirror:
        raise ValueError("norm_reads_mirror needs a mirror (needs_mirror=True)")
    if needs_mirror:
        mirror = torch.zeros(spans.owned_numel, dtype=torch.float32, device=grad.device)
        target.mirror = mirror
        # One copy per owned range, into the owned ranges laid end to end in the mirror.
        ends = list(itertools.accumulate(s.numel for s in spans.owned))
        target.copies = [
            (mirror[end - s.numel : end], grad[s.start : s.end])
            for s, end in zip(spans.owned, ends, strict=True)
        ]
        target.scale_views = [mirror]
        if norm_reads_mirror:
            target.norm_views = _views(mirror, to_local(spans.norm, spans.owned))
            target.norm_reads_mirror = True
    else:
        target.scale_views = _views(grad, spans.owned)
    if island is not None:
        target.island_scale_views = [island]
    return target


def island_offsets(buf, island: torch.Tensor) -> dict[int, int]:
    """``{buffer start: island offset}`` of every parameter whose ``main_grad`` is in
    ``island`` (:meth:`megatron_ext.DistributedDataParallel._carve_fp32_island`)."""
    out = {}
    for b in buf.buckets:
        for p in b.params_with_extra_main_grads:
            g = p.main_grad
            if g.numel() == 0:  # shares its start with the next parameter: nothing to read
                continue
            if g.untyped_storage().data_ptr() != island.untyped_storage().data_ptr():
                raise RuntimeError(
                    "a parameter's fp32 main_grad is not in its buffer's fp32 island; was "
                    "main_grad replaced after megatron_ext.DistributedDataParallel was built?"
                )
            out[buf.param_index_map[p][0]] = g.storage_offset() - island.storage_offset()
    return out


def _read_island(target: BufferTarget, buf, island: torch.Tensor) -> None:
    """Make the norm read the island's parameters in the island, not in the buffer."""
    offsets = island_offsets(buf, island)
    pieces, counted, holes = [], [], []
    for r in target.records:
        if r.start not in offsets:
            continue
        holes.append(r.span)
        for s in intersect_spans([r.span], target.spans.owned):
            at = offsets[r.start] + s.start - r.start
            piece = (r.start, s, Span(at, at + s.numel))
            pieces.append(piece)
            if r.excluded_because is None:
                counted.append(piece[2])
    target.island = island
    target.island_pieces = tuple(pieces)
    target.island_norm_views = _views(island, counted)
    # The buffer's norm spans less these parameters (their padding stays, and still counts
    # as padding: count_zeros subtracts it).
    target.norm_views = _views(buf.grad_data, subtract_spans(target.spans.norm, holes))


def mirror_view(target: BufferTarget, start: int, end: int) -> torch.Tensor:
    """The mirror's view of buffer elements ``[start, end)`` (which this rank must own)."""
    (local,) = to_local([Span(start, end)], target.spans.owned)
    if local.numel != end - start:
        raise AssertionError(f"[{start}, {end}) is not inside this rank's shard")
    if target.mirror is None:
        raise AssertionError(f"{target.name} has no mirror")
    return target.mirror[local.start : local.end]
