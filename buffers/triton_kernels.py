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
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _sumsq_kernel(base, tile_start, tile_end, out, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    start = tl.load(tile_start + pid)
    end = tl.load(tile_end + pid)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.static_range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < end, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(out + pid, tl.sum(acc, axis=0))


@triton.jit
def _scale_kernel(base, tile_start, tile_end, coeff, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    c = tl.load(coeff)
    if c != 1.0:
        pid = tl.program_id(0)
        start = tl.load(tile_start + pid)
        end = tl.load(tile_end + pid)
        for i in tl.static_range(ITERS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < end
            x = tl.load(base + offs, mask=mask)
            tl.store(base + offs, (x.to(tl.float32) * c).to(x.dtype), mask=mask)


class TileTable:
    """The tiles of some spans of one flat buffer, as device tensors (built once)."""

    def __init__(self, base: torch.Tensor, spans: Sequence[tuple[int, int]]) -> None:
        # Offsets only: the same table serves any buffer with these spans (``base`` at call).
        starts, ends = [], []
        for lo, hi in spans:
            for s in range(lo, hi, TILE):
                starts.append(s)
                ends.append(hi)
        self.n = len(starts)
        self.starts = torch.tensor(starts, dtype=torch.int64, device=base.device)
        self.ends = torch.tensor(ends, dtype=torch.int64, device=base.device)
        self.partials = torch.empty(max(self.n, 1), dtype=torch.float32, device=base.device)

    def sumsq(self, base: torch.Tensor) -> torch.Tensor:
        if self.n == 0:
            return self.partials[:1].zero_().sum()
        _sumsq_kernel[(self.n,)](
            base, self.starts, self.ends, self.partials, BLOCK=BLOCK, ITERS=ITERS, num_warps=8
        )
        return self.partials[: self.n].sum()

    def scale_(self, base: torch.Tensor, coeff: torch.Tensor) -> None:
        if self.n:
            _scale_kernel[(self.n,)](
                base, self.starts, self.ends, coeff, BLOCK=BLOCK, ITERS=ITERS, num_warps=8
            )
