"""Layout plan: where every gradient sits in its flat per-dtype buffer.

Pure data, computed once by :func:`plan_layout` and only read afterwards. No tensor is
allocated and no device or process group is touched, so every rule here is testable on the
CPU. Storage (:mod:`buffers.storage`) allocates what a plan describes; the Megatron
integration builds the same spans from Megatron's own buffer layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .spans import Span

# Every slot starts at a multiple of this many elements and every buffer's length is one.
# It is the boundary megatron-core pads each parameter's start to in its gradient buffers
# (with the distributed optimizer: ``pad_param_start`` in megatron/core/optimizer/
# param_layout.py, where it is written once too; tests/test_megatron_spans.py checks they
# agree); megatron_ext's fp32 islands space their parameters by it as well. 64 elements
# are a whole number of 128-byte lines for every dtype we hold.
ALIGN = 64

SUPPORTED_GRAD_DTYPES: tuple[torch.dtype, ...] = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
)


@dataclass(frozen=True)
class ParamEntry:
    """What the plan needs to know about one parameter: no tensor, only metadata."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    counted: bool = True

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter's gradient lives: ``buffer[offset : offset + numel]``."""

    index: int  # position of the parameter in the planned inventory
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    numel: int
    counted: bool

    @property
    def span(self) -> Span:
        return Span(self.offset, self.offset + self.numel)


@dataclass(frozen=True)
class BufferPlan:
    """One flat buffer: its dtype, padded length, slots, and the spans norms read."""

    dtype: torch.dtype
    numel: int  # padded to a multiple of the alignment
    slots: tuple[ParamSlot, ...]
    norm_spans: tuple[Span, ...]  # counted elements (and the zero padding between them)
    scale_spans: tuple[Span, ...]  # every gradient element clipping must scale

    @property
    def padding_in(self) -> dict[Span, int]:
        """Padding elements inside each norm span (they are zero, so counts subtract them)."""
        return {s: s.numel - _covered(self.slots, s) for s in self.norm_spans}

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


@dataclass(frozen=True)
class LayoutPlan:
    """Every buffer of one :class:`~buffers.FlatGradBuffers`, keyed by gradient dtype."""

    align: int
    buffers: dict[torch.dtype, BufferPlan]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _covered(slots: Sequence[ParamSlot], span: Span) -> int:
    return sum(max(0, min(s.offset + s.numel, span.end) - max(s.offset, span.start)) for s in slots)


def check_grad_dtype(dtype: torch.dtype, what: str) -> None:
    """Raise a ``TypeError`` naming ``what`` unless ``dtype`` can hold a gradient here."""
    if dtype not in SUPPORTED_GRAD_DTYPES:
        accepted = ", ".join(str(d) for d in SUPPORTED_GRAD_DTYPES)
        raise TypeError(
            f"{what} has dtype {dtype}, which is unsupported (no flat gradient buffer for "
            f"it); accepted dtypes: {accepted}. Freeze it (requires_grad=False) or cast it."
        )


def plan_layout(entries: Sequence[ParamEntry], align: int = ALIGN) -> LayoutPlan:
    """Lay out gradients in one flat buffer per dtype.

    Within a buffer, counted parameters come first (in input order), then uncounted ones,
    so the counted part of every buffer is one contiguous span. Each slot starts at a
    multiple of ``align`` elements and each buffer's length is a multiple of ``align``.

    Args:
        entries: the parameters to lay out, in order.
        align: alignment of every slot, in elements (>= 1).

    Returns:
        The :class:`LayoutPlan`.
    """
    if not isinstance(align, int) or isinstance(align, bool) or align < 1:
        raise ValueError(f"align must be a positive int (elements), got {align!r}")
    for e in entries:
        check_grad_dtype(e.dtype, f"parameter {e.name!r}")
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, e in enumerate(entries):
        by_dtype.setdefault(e.dtype, []).append(i)

    buffers: dict[torch.dtype, BufferPlan] = {}
    for dtype, idx in by_dtype.items():
        ordered = [i for i in idx if entries[i].counted] + [
            i for i in idx if not entries[i].counted
        ]
        slots: list[ParamSlot] = []
        offset = 0
        counted_end = 0
        for i in ordered:
            e = entries[i]
            slots.append(ParamSlot(i, e.name, tuple(e.shape), dtype, offset, e.numel, e.counted))
            if e.counted:
                counted_end = offset + e.numel
            offset = _round_up(offset + e.numel, align)
        used_end = slots[-1].offset + slots[-1].numel
        numel = _round_up(max(offset, 1), align)
        norm_spans = (Span(0, counted_end),) if counted_end else ()
        buffers[dtype] = BufferPlan(dtype, numel, tuple(slots), norm_spans, (Span(0, used_end),))
    return LayoutPlan(align, buffers)
