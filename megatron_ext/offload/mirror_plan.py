"""CPU offload through host mirrors, the plan: which blocks move, laid out where, when.

Pure data, computable and testable on the CPU (:mod:`megatron_ext.offload.hybrid` uses it).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from buffers.spans import Span, intersect_spans, merge_spans, subtract_spans


def offload_blocks(
    owned: Sequence[Span], offloaded: Sequence[Span], resident: Sequence[Span]
) -> tuple[Span, ...]:
    """The contiguous blocks one buffer's offloaded gradients and parameters move in.

    A block is the hull of the offloaded elements inside one run of ``owned`` that holds no
    ``resident`` element: between offloaded parameters it holds only padding, so copying
    it whole moves no byte that a GPU-side update owns.

    Args:
        owned: this rank's ranges of the buffer (buffer coordinates).
        offloaded: the ranges of the parameters the CPU optimizer updates.
        resident: the ranges of the parameters the GPU optimizer updates.

    Returns:
        The blocks, sorted, in buffer coordinates.
    """
    owned, offloaded = merge_spans(owned), merge_spans(offloaded)
    outside = subtract_spans(offloaded, owned)
    if outside:
        raise ValueError(f"offloaded elements {outside[0]} lie outside this rank's shard")
    both = intersect_spans(offloaded, resident)
    if both:
        raise ValueError(f"elements {both[0]} are both offloaded and GPU-resident")
    blocks = []
    for run in subtract_spans(owned, resident):
        inside = intersect_spans(offloaded, [run])
        if inside:
            blocks.append(Span(inside[0].start, inside[-1].end))
    return tuple(blocks)


@dataclass(frozen=True)
class MirrorLayout:
    """One buffer's blocks (buffer coordinates), laid end to end in its host mirror."""

    blocks: tuple[Span, ...]

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.blocks)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each block starts in the mirror, in elements."""
        out, base = [], 0
        for b in self.blocks:
            out.append(base)
            base += b.numel
        return tuple(out)

    def block_of(self, span: Span) -> int:
        """Index of the block that holds ``span`` (buffer coordinates)."""
        i = bisect.bisect_right([b.start for b in self.blocks], span.start) - 1
        if i < 0 or not (self.blocks[i].start <= span.start and span.end <= self.blocks[i].end):
            raise ValueError(f"{span} lies in no block of {self.blocks}")
        return i

    def local(self, span: Span) -> Span:
        """Mirror coordinates of ``span`` (buffer coordinates, inside one block)."""
        b = self.block_of(span)
        base = self.offsets[b] - self.blocks[b].start
        return Span(base + span.start, base + span.end)

    def staging_nbytes(self, grad_dtype: torch.dtype, param_dtype: torch.dtype) -> int:
        """Bytes of the staging tensor: every block holds its gradients, later its params."""
        return self.numel * max(itemsize(grad_dtype), itemsize(param_dtype))


def mirror_layout(
    owned: Sequence[Span], offloaded: Sequence[Span], resident: Sequence[Span]
) -> MirrorLayout:
    """The :class:`MirrorLayout` of :func:`offload_blocks` (same arguments)."""
    return MirrorLayout(offload_blocks(owned, offloaded, resident))


@dataclass(frozen=True)
class CopySchedule:
    """When each block moves, for CPU optimizers stepped in order (block indices global).

    Attributes:
        d2h_order: blocks in the order their device-to-host copies are issued (by first
            reader), on one stream, so waiting for one block waits for those before it.
        wait_for: per CPU optimizer, the block whose copy completes its inputs.
        convert_before: per CPU optimizer, the blocks it reads first: their gradients are
            converted on the host just before its step.
        copy_back_after: per CPU optimizer, the blocks it reads last: their parameters go
            back to the device just after its step.
    """

    d2h_order: tuple[int, ...]
    wait_for: tuple[int, ...]
    convert_before: tuple[tuple[int, ...], ...]
    copy_back_after: tuple[tuple[int, ...], ...]


def copy_schedule(reads: Sequence[Iterable[int]], num_blocks: int) -> CopySchedule:
    """The :class:`CopySchedule` for CPU optimizers that read the given blocks.

    Args:
        reads: per CPU optimizer (in step order), the blocks its parameters lie in.
        num_blocks: how many blocks there are; each must be read by some optimizer.

    Returns:
        The schedule.
    """
    reads = [sorted(set(r)) for r in reads]
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for k, blocks in enumerate(reads):
        if not blocks:
            raise ValueError(f"CPU optimizer {k} reads no block")
        for b in blocks:
            if not 0 <= b < num_blocks:
                raise ValueError(f"CPU optimizer {k} reads block {b} of {num_blocks}")
            first.setdefault(b, k)
            last[b] = k
    unread = sorted(set(range(num_blocks)) - first.keys())
    if unread:
        raise ValueError(f"blocks {unread} are read by no CPU optimizer")
    order = tuple(sorted(range(num_blocks), key=lambda b: (first[b], b)))
    position = {b: i for i, b in enumerate(order)}
    convert: list[list[int]] = [[] for _ in reads]
    copy_back: list[list[int]] = [[] for _ in reads]
    for b in order:
        convert[first[b]].append(b)
        copy_back[last[b]].append(b)
    return CopySchedule(
        d2h_order=order,
        wait_for=tuple(max(r, key=position.__getitem__) for r in reads),
        convert_before=tuple(map(tuple, convert)),
        copy_back_after=tuple(map(tuple, copy_back)),
    )


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
