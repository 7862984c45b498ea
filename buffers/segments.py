"""Segmented reductions: one power sum (or max) per parameter slot of a flat buffer, in one
pass over the buffer.

A :class:`SegmentTable` is built once per buffer from the plan's slots. Every slot owns the
elements from its offset up to the next slot's offset (the alignment padding after it is
zero, so it adds nothing), which cuts the buffer into contiguous segments. The torch path
reduces the buffer in sub-blocks small enough never to cross a segment boundary (every
slot offset is a multiple of the sub-block length) as rows of a ``view(-1, sub)`` (torch
sums rows pairwise, so fp32 stays accurate), then those results in blocks of
:data:`BLOCK` elements; a block inside one segment is added to it by one ``index_add_``,
and the few blocks holding a boundary add their sub-block results one by one instead.
Per-segment totals accumulate in fp64: a
parameter of 10^8 elements is 5 * 10^4 block sums, and adding those in fp32 one after the
other would lose ~1e-5 relative.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .triton_kernels import TileTable

BLOCK = 2048  # elements per block (a power of two)

# Elements upcast at a time (a multiple of BLOCK), per device type: as ops._CHUNK, one
# scratch reused while it sits in the CPU's cache; bigger chunks mean fewer launches on GPUs.
_CHUNK = {"cpu": 1 << 20}
_CHUNK_OTHER = 1 << 22


@dataclass(frozen=True, eq=False)  # compared and hashed by identity (backends cache on it)
class SegmentTable:
    """Which segment every block and boundary sub-block of one flat buffer adds to.

    Attributes:
        numel: the buffer's length.
        sub: sub-block length (a power of two dividing every slot offset and ``numel``).
        block_seg: per full block, its segment id, or ``dump`` for a block holding a
            boundary (those are read again as sub-blocks).
        sub_ids: indices (in units of ``sub``) of the sub-blocks of boundary blocks and of
            the tail after the last full block.
        sub_seg: the segment id of each of those sub-blocks.
        slots: ``(start, end, segment id)`` of each slot's own elements (padding excluded),
            for kernels that cut the spans themselves (Triton).
        dump: the id the boundary blocks are added to (a slot the caller discards).
    """

    numel: int
    sub: int
    block_seg: torch.Tensor
    sub_ids: torch.Tensor
    sub_seg: torch.Tensor
    slots: tuple[tuple[int, int, int], ...]
    dump: int

    @property
    def n_full(self) -> int:
        return self.numel // BLOCK


def build_segment_table(
    numel: int,
    slots: Sequence[tuple[int, int, int]],
    dump: int,
    device: torch.device,
) -> SegmentTable:
    """The table of one buffer of ``numel`` elements whose slots are ``(offset, numel, id)``.

    Slots must not overlap, and every element outside them must be zero (the plan's
    padding is), because it is added to the segment of the slot before it.
    """
    ordered = sorted(slots, key=lambda s: (s[0], s[1]))
    g = numel
    for off, _, _ in ordered:
        g = math.gcd(g, off)
    sub = min(g & -g, BLOCK) if g else BLOCK
    starts = torch.tensor([s[0] for s in ordered] or [0], dtype=torch.int64)
    ids = torch.tensor([s[2] for s in ordered] or [dump], dtype=torch.int64)

    def seg_of(pos: torch.Tensor) -> torch.Tensor:
        # The last slot starting at or before pos (a zero-size slot sorts before the slot
        # sharing its offset, so it owns nothing); before the first slot: dump.
        at = torch.searchsorted(starts, pos, right=True) - 1
        return torch.where(at >= 0, ids[at.clamp(min=0)], torch.full_like(pos, dump))

    n_full = numel // BLOCK
    first = torch.arange(n_full, dtype=torch.int64) * BLOCK
    # A block holds a boundary when a slot starts after its first element and within it.
    boundary = torch.searchsorted(starts, first, right=True) != torch.searchsorted(
        starts, first + BLOCK - 1, right=True
    )
    block_seg = torch.where(boundary, torch.full_like(first, dump), seg_of(first))
    per_block = BLOCK // sub
    mixed = boundary.nonzero().flatten()
    sub_ids = torch.cat(
        [
            (mixed[:, None] * per_block + torch.arange(per_block)).flatten(),
            torch.arange(n_full * per_block, numel // sub, dtype=torch.int64),
        ]
    )
    sub_seg = seg_of(sub_ids * sub)
    spans = tuple((off, off + n, i) for off, n, i in ordered)
    return SegmentTable(
        numel,
        sub,
        block_seg.to(device),
        sub_ids.to(device),
        sub_seg.to(device),
        spans,
        dump,
    )


def _power_(x: torch.Tensor, p: float) -> torch.Tensor:
    """|x|^p in place (|x| for inf)."""
    if p == 2.0:
        return x.square_()
    x.abs_()
    if p not in (1.0, math.inf):
        x.pow_(p)
    return x


def _add_to(
    out: torch.Tensor, nan: torch.Tensor, index: torch.Tensor, src: torch.Tensor, p: float
) -> None:
    """Add (p < inf) or max (inf) ``src`` into ``out`` at ``index``; NaN marked in ``nan``."""
    src = src.to(out.dtype)
    if p != math.inf:
        out.index_add_(0, index, src)
        return
    # A CUDA atomic max drops NaN: count NaN apart and restore it when finishing.
    out.scatter_reduce_(0, index, src, "amax", include_self=True)
    nan.index_add_(0, index, torch.isnan(src).to(nan.dtype))


def torch_segment_stats_(
    buf: torch.Tensor, table: SegmentTable, p: float, out: torch.Tensor, nan: torch.Tensor
) -> None:
    """Add each segment's sum of |x|^p (max |x| for inf) of ``buf`` into ``out[id]``.

    ``out`` and ``nan`` are fp64 vectors indexed by segment id (``nan`` counts NaN seen by
    the inf-norm; untouched otherwise). One read of ``buf``, chunk by chunk through a
    reused scratch: each sub-block is reduced in fp32 (fp64 for fp64 buffers) into a small
    vector of sub-block results (:func:`chunk_stats_`), which blocks then reduce further;
    only that vector (not the buffer) is read again for the sub-blocks of boundary blocks
    (:func:`add_sub_results_`).
    """
    subs = sub_results(buf, table)
    if subs.numel():
        chunk = chunk_numel(buf.device)
        scratch = torch.empty(min(chunk, table.numel), dtype=subs.dtype, device=buf.device)
        for start in range(0, table.numel, chunk):
            chunk_stats_(buf, table, p, start, start + chunk, scratch, subs)
    add_sub_results_(table, p, subs, out, nan)


def chunk_numel(device: torch.device) -> int:
    """Elements one :func:`chunk_stats_` reads at a time on ``device`` (a multiple of
    :data:`BLOCK`)."""
    return _CHUNK.get(device.type, _CHUNK_OTHER)


def sub_results(buf: torch.Tensor, table: SegmentTable) -> torch.Tensor:
    """The vector of sub-block results of ``buf`` (uninitialised), in the accumulation dtype:
    fp32, fp64 for fp64 buffers."""
    acc = torch.promote_types(buf.dtype, torch.float32)
    return torch.empty(table.numel // table.sub, dtype=acc, device=buf.device)


def chunk_stats_(
    buf: torch.Tensor,
    table: SegmentTable,
    p: float,
    start: int,
    stop: int,
    scratch: torch.Tensor,
    subs: torch.Tensor,
) -> None:
    """Each sub-block's sum of |x|^p (max |x| for inf) of ``buf[start:stop]`` into its
    entries of ``subs``, upcast through ``scratch`` (at least ``stop - start`` elements of
    ``subs``' dtype). Chunks write disjoint entries: they may run on several threads, each
    with a scratch of its own."""
    c = buf[start:stop]
    s = scratch[: c.numel()]
    s.copy_(c)
    rows = _power_(s, p).view(-1, table.sub)
    dest = subs[start // table.sub : (start + c.numel()) // table.sub]
    (torch.amax if p == math.inf else torch.sum)(rows, dim=1, out=dest)


def add_sub_results_(
    table: SegmentTable, p: float, subs: torch.Tensor, out: torch.Tensor, nan: torch.Tensor
) -> None:
    """Add the sub-block results ``subs`` to their segments in ``out``: a full block inside
    one segment as one value, the sub-blocks of boundary blocks and of the tail one by one."""
    inf = p == math.inf
    n_full = table.n_full
    if n_full:
        per_block = subs[: n_full * (BLOCK // table.sub)].view(n_full, BLOCK // table.sub)
        blocks = per_block.amax(dim=1) if inf else per_block.sum(dim=1)
        _add_to(out, nan, table.block_seg, blocks, p)
    if table.sub_ids.numel():
        _add_to(out, nan, table.sub_seg, subs.index_select(0, table.sub_ids), p)


class SpanSegments:
    """Per-segment power sums over given spans of one 1-D tensor (built once, reused).

    For layouts the plan does not describe (megatron-core's buffers, where a rank owns only
    some elements and the rest must not be read): ``spans`` are ``(lo, hi, id)``, any
    number per id, never overlapping. On CUDA with the Triton backend and p = 2 one tile
    launch covers every span and one more adds each span's tiles in fp64 (also what
    :meth:`TritonBackend.segment_stats_ <buffers.ops.TritonBackend.segment_stats_>` runs
    over a plan's slots); otherwise one ``vector_norm`` per span (the fallback: the CPU and
    other orders).
    """

    def __init__(self, base: torch.Tensor, spans: Sequence[tuple[int, int, int]]) -> None:
        if base.dim() != 1 or not base.is_contiguous():
            raise ValueError("SpanSegments needs a contiguous 1-D tensor")
        self.base = base
        self.spans = tuple((lo, hi, i) for lo, hi, i in spans if hi > lo)
        for lo, hi, _ in self.spans:
            if lo < 0 or hi > base.numel():
                raise ValueError(f"span [{lo}, {hi}) is outside a tensor of {base.numel()}")
        ids = [i for _, _, i in self.spans]
        self.ids = torch.tensor(ids, dtype=torch.int64).to(base.device)
        self.distinct = len(set(ids)) == len(ids)  # then the Triton sum adds in place
        self._tiles: TileTable | None = None

    def tiles(self) -> TileTable:
        """The Triton tile table of these spans, cut short at each span (built once)."""
        if self._tiles is None:
            from . import triton_kernels as tk

            spans = [(lo, hi) for lo, hi, _ in self.spans]
            self._tiles = tk.TileTable(self.base, spans, short=True)
        return self._tiles

    def triton_sumsq_(self, out: torch.Tensor, base: torch.Tensor | None = None) -> None:
        """Add each span's sum of squares into ``out[id]`` with the Triton kernels (the
        tile table holds offsets only: ``base``, default the tensor given at construction,
        may be another tensor of the same layout)."""
        if not self.spans:
            return
        base = self.base if base is None else base
        if self.distinct:  # one launch adds each span into its slot
            self.tiles().span_sumsq(base, into=(out, self.ids))
        else:
            out.index_add_(0, self.ids, self.tiles().span_sumsq(base))

    def add_(self, out: torch.Tensor, nan: torch.Tensor, p: float, backend) -> None:
        """Add each span's sum of |x|^p (max |x| for inf) into the fp64 ``out[id]``."""
        if not self.spans:
            return
        if p == 2.0 and backend.name == "triton" and self._triton_ok():
            self.triton_sumsq_(out)
            return
        acc = torch.promote_types(self.base.dtype, torch.float32)
        norms = torch.stack(
            [torch.linalg.vector_norm(self.base[lo:hi], p, dtype=acc) for lo, hi, _ in self.spans]
        ).double()
        _add_to(out, nan, self.ids, norms if p == math.inf else norms.pow(p), p)

    def _triton_ok(self) -> bool:
        from . import triton_kernels as tk

        return self.base.is_cuda and self.base.dtype in tk.DTYPES
