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
    SHORT: tl.constexpr,
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
            if SHORT:  # many tiles shorter than TILE (cut at every parameter): skip the
                # iterations past the end instead of running them fully masked
                if start + i * BLOCK < end:
                    x = tl.load(base + offs, mask=offs < end, other=0.0).to(tl.float32)
                    acc += x * x
            else:
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


@triton.jit
def _span_sum_kernel(
    partials,
    core_lo,
    core_hi,
    edge_lo,
    edge_hi,
    out,
    ids,
    N_ITER: tl.constexpr,
    ROWS: tl.constexpr,
    INTO: tl.constexpr,
):
    # One program per span: its tiles' fp32 partials (a contiguous run of core tiles and
    # at most two edge tiles) added in fp64. A parameter of 10^9 elements has ~6 * 10^4
    # tiles: this loop reads them in order instead of 6 * 10^4 atomics on one address.
    # ``N_ITER`` (from the host: the longest run / ROWS, rounded up to a power of two, so
    # few variants compile) bounds the loop: loop bounds never come from tensors, which
    # Triton 3.6's interpreter cannot range over.
    s = tl.program_id(0)
    acc = tl.zeros((ROWS,), dtype=tl.float64)
    lo = tl.load(core_lo + s)
    hi = tl.load(core_hi + s)
    for it in range(0, N_ITER):
        offs = lo + it * ROWS + tl.arange(0, ROWS)
        acc += tl.load(partials + offs, mask=offs < hi, other=0.0).to(tl.float64)
    e_lo = tl.load(edge_lo + s)
    e_hi = tl.load(edge_hi + s)
    e_offs = e_lo + tl.arange(0, ROWS)
    acc += tl.load(partials + e_offs, mask=e_offs < e_hi, other=0.0).to(tl.float64)
    if INTO:  # add into out[ids[s]]: ids are distinct within a launch, so no two programs
        # touch one slot (a plain read and write, deterministic; no index_add_ after)
        slot = tl.load(ids + s)
        tl.store(out + slot, tl.load(out + slot) + tl.sum(acc, axis=0))
    else:
        tl.store(out + s, tl.sum(acc, axis=0))


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def split_span(lo: int, hi: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Cut ``[lo, hi)`` into core tiles (EDGE-aligned ends, at most TILE long) and edges."""
    a = min(-(-lo // EDGE) * EDGE, hi)
    b = max(hi // EDGE * EDGE, a)
    core = [(s, b) for s in range(a, b, TILE)]
    edges = [(x, y) for x, y in ((lo, a), (b, hi)) if y > x]
    return core, edges


class TileTable:
    """The tiles of some spans of one flat buffer, as device tensors (built once)."""

    def __init__(
        self, base: torch.Tensor, spans: Sequence[tuple[int, int]], short: bool = False
    ) -> None:
        # short: many spans are shorter than a tile (one per parameter): the sum-of-squares
        # kernel then skips a tile's iterations past its end (a variant compiled apart, so
        # the merged spans of the plain norm keep the kernel as measured).
        self.short = short
        # Offsets only: the same table serves any buffer with these spans (``base`` at call).
        core: list[tuple[int, int]] = []
        edges: list[tuple[int, int]] = []
        core_run, edge_run = [], []  # per span: its tiles' index range
        for lo, hi in spans:
            c, e = split_span(lo, hi)
            core_run.append((len(core), len(core) + len(c)))
            edge_run.append((len(edges), len(edges) + len(e)))
            core += c
            edges += e
        tiles = core + edges
        self.n_core = len(core)
        self.n = len(tiles)
        self.n_spans = len(spans)

        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=base.device)

        self.longest_run = max((b - a for a, b in core_run), default=0)
        self.core_lo = column([a for a, _ in core_run])
        self.core_hi = column([b for _, b in core_run])
        self.edge_lo = column([a + self.n_core for a, _ in edge_run])
        self.edge_hi = column([b + self.n_core for _, b in edge_run])
        self.span_sums = torch.empty(len(spans), dtype=torch.float64, device=base.device)
        self.starts = torch.tensor([t[0] for t in tiles], dtype=torch.int64, device=base.device)
        self.ends = torch.tensor([t[1] for t in tiles], dtype=torch.int64, device=base.device)
        self.partials = torch.empty(max(self.n, 1), dtype=torch.float32, device=base.device)

    def sumsq(self, base: torch.Tensor) -> torch.Tensor:
        """Sum of squares over all spans (fp32, 0-dim)."""
        if self.n == 0:
            return self.partials[:1].zero_().sum()
        return self.partial_sumsq(base).sum()

    def partial_sumsq(self, base: torch.Tensor) -> torch.Tensor:
        """Sum of squares per tile (fp32, one per tile: the core tiles of every span in
        span order, then the edge tiles). Rewritten by the next call."""
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
            SHORT=self.short,
            num_warps=8,
        )
        return self.partials[: self.n]

    def span_sumsq(
        self,
        base: torch.Tensor,
        rows: int | None = None,
        into: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Sum of squares per span (fp64, one per span, in ``spans`` order): the tile
        kernel, then one program per span adding its tiles' partials. Rewritten by the
        next call. ``rows``: partials read at a time per program (a power of two >= 2);
        default: the longest span's tile count rounded up, at most 1024, so spans of a few
        tiles (10,000 small parameters) do not each reduce 1024 lanes in fp64.

        ``into``: ``(out, ids)``, an fp64 vector and one distinct index per span: each
        span's sum is added into ``out[ids[span]]`` by the same launch instead (returns
        ``out``)."""
        if rows is None:
            rows = min(_pow2_at_least(max(self.longest_run, 2)), 1024)
        # Without ``into`` the kernel stores by span and never reads ``ids`` (any int64
        # tensor fills the argument).
        target, ids = into if into is not None else (self.span_sums, self.core_lo)
        if self.n_spans == 0:
            return target
        partials = self.partial_sumsq(base)
        if self.n == 0:
            return target if into is not None else self.span_sums.zero_()
        _span_sum_kernel[(self.n_spans,)](
            partials,
            self.core_lo,
            self.core_hi,
            self.edge_lo,
            self.edge_hi,
            target,
            ids,
            N_ITER=_pow2_at_least(-(-self.longest_run // rows)),
            ROWS=rows,
            INTO=into is not None,
        )
        return target

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
