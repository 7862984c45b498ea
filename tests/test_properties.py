"""Random inventories (lengths, dtypes, orders, alignments, counted subsets) vs fp64."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from buffers import FlatGradBuffers

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]

inventories = st.lists(
    st.tuples(st.integers(1, 700), st.sampled_from(DTYPES), st.booleans()),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(
    inv=inventories,
    align=st.sampled_from([1, 2, 8, 64, 128]),
    norm_type=st.sampled_from([2.0, 1.0, 2.5, math.inf]),
    seed=st.integers(0, 2**31 - 1),
)
def test_norm_matches_fp64_reference(inv, align, norm_type, seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dt)) for n, dt, _ in inv]
    counted_ids = {id(p) for p, (_, _, c) in zip(params, inv, strict=True) if c}
    fgb = FlatGradBuffers(params, counted=lambda p: id(p) in counted_ids, align=align)
    ref = []
    for p, (_, _, c) in zip(params, inv, strict=True):
        g = fgb.view(p)
        g.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
        if c:
            ref.append(g.double())  # the stored (rounded) values are the truth
    want = torch.linalg.vector_norm(torch.cat(ref), norm_type).item() if ref else 0.0
    got = fgb.grad_norm(norm_type).item()
    assert math.isclose(got, want, rel_tol=1e-5, abs_tol=0.0)
    for dt, b in fgb.plan.buffers.items():
        assert b.numel % align == 0
        assert all(s.offset % align == 0 for s in b.slots)
        assert fgb.buffers[dt].dtype == dt
