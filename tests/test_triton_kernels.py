"""The Triton kernels' logic on the CPU, under Triton's interpreter (TRITON_INTERPRET=1).

The interpreter must be switched on before Triton compiles anything, so the checks run in a
fresh interpreter process. On the GPU the same kernels run compiled (tests/test_storage.py
with the cuda device, and the Megatron GPU tests).
"""

import textwrap

import pytest

from tests.support.triton_interpreter import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import math, torch
    from buffers import triton_kernels as tk
    gen = torch.Generator().manual_seed(11)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        buf = torch.zeros(3 * tk.TILE + 500, dtype=dtype)
        # spans crossing tile boundaries, a one-element span, and a gap that must stay put
        spans = [(0, tk.TILE + 7), (tk.TILE + 100, tk.TILE + 101), (tk.TILE + 203, tk.TILE + 260),
                 (2 * tk.TILE + 5, buf.numel())]
        buf.copy_(torch.randn(buf.numel(), generator=gen))
        table = tk.TileTable(buf, spans)
        want = sum(buf[a:b].double().square().sum().item() for a, b in spans)
        got = table.sumsq(buf).item()
        assert math.isclose(got, want, rel_tol=1e-5), (dtype, got, want)
        # the variant for tiles cut at every parameter (skips iterations past a tile's end)
        short = tk.TileTable(buf, spans, short=True)
        parts = short.partial_sumsq(buf).double()
        assert math.isclose(parts.sum().item(), want, rel_tol=1e-5), (dtype, "short")
        per_span = short.span_sumsq(buf)
        for i, (a, b) in enumerate(spans):
            one = buf[a:b].double().square().sum().item()
            assert math.isclose(per_span[i].item(), one, rel_tol=1e-5), (dtype, i)
        # added into given slots by the same launch (distinct ids; what was there stays)
        out = torch.arange(6, dtype=torch.float64)
        ids = torch.tensor([4, 0, 5, 2])
        got_into = short.span_sumsq(buf, into=(out, ids))
        assert got_into is out
        want_into = torch.arange(6, dtype=torch.float64)
        want_into[ids] += per_span
        assert torch.equal(out, want_into), (dtype, out, want_into)
        before = buf.clone()
        table.scale_(buf, torch.tensor(1.0))
        assert torch.equal(buf, before), "coefficient 1 must leave every bit unchanged"
        table.scale_(buf, torch.tensor(0.37))
        inside = torch.zeros(buf.numel(), dtype=torch.bool)
        for a, b in spans:
            inside[a:b] = True
        want_scaled = (before.float() * 0.37).to(dtype)
        if dtype == torch.bfloat16:
            # The interpreter converts fp32 -> bf16 by truncation (compiled Triton rounds to
            # nearest), so allow one bf16 ulp here; fp16 and fp32 must match exactly.
            torch.testing.assert_close(buf[inside], want_scaled[inside], rtol=2**-7, atol=0)
        else:
            assert torch.equal(buf[inside], want_scaled[inside]), dtype
        assert torch.equal(buf[~inside], before[~inside]), "outside the spans must not change"
        buf[5] = math.nan
        assert math.isnan(table.sumsq(buf).item())
    assert tk.split_span(5, 70) == ([(16, 64)], [(5, 16), (64, 70)])
    assert tk.split_span(3, 9) == ([], [(3, 9)])
    assert tk.split_span(0, 2 * tk.TILE) == ([(0, 2 * tk.TILE), (tk.TILE, 2 * tk.TILE)], [])
    print("kernels ok")
    """
)


def test_kernels_under_triton_interpreter():
    res = run_interpreted(SCRIPT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "kernels ok" in res.stdout
