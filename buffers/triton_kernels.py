"""Triton kernels: sum of squares and device-coefficient scaling over spans of one buffer.

One launch covers every span of a flat buffer: the spans are cut into tiles once, and a
small device table (tile start, span end) tells each program where to work. Partial sums
go to one fp32 slot per program and are added by one ``sum`` (deterministic: no atomics).
The scale kernel loads the coefficient once per program and returns at once when it is 1,
so an inactive clip leaves gradients bit-for-bit unchanged and moves no data.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

BLOCK = 2048
ITERS = 8
TILE = BLOCK * ITERS
EDGE = 16  # elements; span cores start and end on multiples of this (vectorized access)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _sumsq_kernel(
    base,
    tile_start,
    tile_end,
    out,
    n_core,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
    EDGE: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < n_core:
        # Core tiles start and end on multiples of EDGE: telling Triton so lets it use
        # vector loads (offsets loaded from memory carry no alignment information).
        start = tl.multiple_of(tl.load(tile_start + pid), EDGE)
        end = tl.multiple_of(tl.load(tile_end + pid), EDGE)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in tl.static_range(ITERS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < end, other=0.0).to(tl.float32)
            acc += x * x
        tl.store(out + pid, tl.sum(acc, axis=0))
    else:  # an unaligned edge of a span: fewer than EDGE elements
        # (names differ from the core branch's: Triton wants one type per name across branches)
        e_start = tl.load(tile_start + pid)
        e_end = tl.load(tile_end + pid)
        e_offs = e_start + tl.arange(0, EDGE)
        e_x = tl.load(base + e_offs, mask=e_offs < e_end, other=0.0).to(tl.float32)
        tl.store(out + pid, tl.sum(e_x * e_x, axis=0))


@triton.jit
def _scale_kernel(
    base,
    tile_start,
    tile_end,
    coeff,
    n_core,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
    EDGE: tl.constexpr,
):
    c = tl.load(coeff)
    if c != 1.0:
        pid = tl.program_id(0)
        if pid < n_core:
            start = tl.multiple_of(tl.load(tile_start + pid), EDGE)
            end = tl.multiple_of(tl.load(tile_end + pid), EDGE)
            for i in tl.static_range(ITERS):
                offs = start + i * BLOCK + tl.arange(0, BLOCK)
                mask = offs < end
                x = tl.load(base + offs, mask=mask)
                tl.store(base + offs, (x.to(tl.float32) * c).to(x.dtype), mask=mask)
        else:
            e_start = tl.load(tile_start + pid)
            e_end = tl.load(tile_end + pid)
            e_offs = e_start + tl.arange(0, EDGE)
            e_mask = e_offs < e_end
            e_x = tl.load(base + e_offs, mask=e_mask)
            tl.store(base + e_offs, (e_x.to(tl.float32) * c).to(e_x.dtype), mask=e_mask)


def split_span(lo: int, hi: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Cut ``[lo, hi)`` into core tiles (EDGE-aligned ends, at most TILE long) and edges."""
    a = min(-(-lo // EDGE) * EDGE, hi)
    b = max(hi // EDGE * EDGE, a)
    core = [(s, b) for s in range(a, b, TILE)]
    edges = [(x, y) for x, y in ((lo, a), (b, hi)) if y > x]
    return core, edges


class TileTable:
    """The tiles of some spans of one flat buffer, as device tensors (built once)."""

    def __init__(self, base: torch.Tensor, spans: Sequence[tuple[int, int]]) -> None:
        # Offsets only: the same table serves any buffer with these spans (``base`` at call).
        core, edges, core_span, edge_span = [], [], [], []
        for i, (lo, hi) in enumerate(spans):
            c, e = split_span(lo, hi)
            core += c
            edges += e
            core_span += [i] * len(c)
            edge_span += [i] * len(e)
        tiles = core + edges
        self.n_core = len(core)
        self.n = len(tiles)
        self.starts = torch.tensor([t[0] for t in tiles], dtype=torch.int64, device=base.device)
        self.ends = torch.tensor([t[1] for t in tiles], dtype=torch.int64, device=base.device)
        # Which span each tile belongs to: a segmented sum adds partials by span.
        self.tile_span = torch.tensor(core_span + edge_span, dtype=torch.int64, device=base.device)
        self.partials = torch.empty(max(self.n, 1), dtype=torch.float32, device=base.device)

    def sumsq(self, base: torch.Tensor) -> torch.Tensor:
        """Sum of squares over all spans (fp32, 0-dim)."""
        if self.n == 0:
            return self.partials[:1].zero_().sum()
        return self.partial_sumsq(base).sum()

    def partial_sumsq(self, base: torch.Tensor) -> torch.Tensor:
        """Sum of squares per tile (fp32, one per tile; tile ``i`` is in span
        ``tile_span[i]``). The returned tensor is rewritten by the next call."""
        if self.n == 0:
            return self.partials[:0]
        _sumsq_kernel[(self.n,)](
            base,
            self.starts,
            self.ends,
            self.partials,
            self.n_core,
            BLOCK=BLOCK,
            ITERS=ITERS,
            EDGE=EDGE,
            num_warps=8,
        )
        return self.partials[: self.n]

    def scale_(self, base: torch.Tensor, coeff: torch.Tensor) -> None:
        if self.n:
            _scale_kernel[(self.n,)](
                base,
                self.starts,
                self.ends,
                coeff,
                self.n_core,
                BLOCK=BLOCK,
                ITERS=ITERS,
                EDGE=EDGE,
                num_warps=8,
            )
