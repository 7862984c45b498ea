import math

import pytest
import torch

from buffers import scale_, total_norm


@pytest.mark.parametrize("order", [0, 1])
def test_mixed_list_norm_is_exact(device, order):
    ts = [
        torch.full((128,), 1 / 64, dtype=torch.bfloat16, device=device),
        torch.full((128,), 1 / 64, dtype=torch.float32, device=device),
    ]
    if order:
        ts.reverse()
    assert total_norm(ts).item() == 0.25


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_random_mixed_list_vs_fp64(device, norm_type):
    gen = torch.Generator().manual_seed(7)
    ts = [
        torch.randn(n, generator=gen).to(dt).to(device)
        for n, dt in [
            (100, torch.bfloat16),
            (33, torch.float32),
            (7, torch.float16),
            (250, torch.bfloat16),
            (1, torch.float64),
        ]
    ]
    want = torch.linalg.vector_norm(torch.cat([t.double().cpu() for t in ts]), norm_type).item()
    assert total_norm(ts, norm_type).item() == pytest.approx(want, rel=1e-5)


def test_scale_mixed_list_with_device_coefficient(device):
    gen = torch.Generator().manual_seed(8)
    ts = [
        torch.randn(50, generator=gen).to(dt).to(device)
        for dt in (torch.bfloat16, torch.float32, torch.bfloat16)
    ]
    before = [t.double().cpu() for t in ts]
    scale_(ts, torch.tensor(0.5, device=device))  # a power of two: exact in every dtype
    for t, b in zip(ts, before, strict=True):
        assert torch.equal(t.double().cpu(), b * 0.5)
    scale_(ts, 1.0)
    for t, b in zip(ts, before, strict=True):
        assert torch.equal(t.double().cpu(), b * 0.5)


def test_empty_and_bad_dtype():
    assert total_norm([]).item() == 0.0
    with pytest.raises(TypeError, match="tensors\\[1\\].*int64"):
        total_norm([torch.zeros(2), torch.zeros(2, dtype=torch.int64)])
