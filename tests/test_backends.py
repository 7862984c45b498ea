"""The transformer-engine backend's logic, exercised with a torch stand-in for its kernels.

TE itself cannot be installed on the CPU CI machines nor on the GPU test machine, so its
real kernels are not run by this suite (docs/flatgradbuffers.md says so).
"""

import math

import pytest
import torch

from buffers import ops


class FakeTEL2Norm:
    """Mimics TE: reads every tensor with the FIRST tensor's dtype; records each call."""

    def __init__(self):
        self.calls = []

    def __call__(self, chunk, overflow, lists, per_tensor):
        (tensors,) = lists
        self.calls.append([t.dtype for t in tensors])
        if len({t.dtype for t in tensors}) > 1:
            raise AssertionError("mixed-dtype list reached the multi-tensor kernel")
        flat = torch.cat([t.float().flatten() for t in tensors])
        return torch.linalg.vector_norm(flat).reshape(1), None


def applier(op, overflow, lists, per_tensor):
    return op(2048 * 32, overflow, lists, per_tensor)


def test_te_backend_gets_one_homogeneous_list_per_buffer():
    fake = FakeTEL2Norm()
    be = ops.TransformerEngineBackend(applier, fake, torch.device("cpu"))
    gen = torch.Generator().manual_seed(9)
    bf = torch.randn(300, generator=gen).bfloat16()
    f32 = torch.randn(77, generator=gen)
    groups = [[bf[:100], bf[150:300]], [f32]]
    stat = sum(be.power_sum(views, 2.0) for views in groups)
    want = torch.cat([bf[:100].double(), bf[150:].double(), f32.double()]).square().sum()
    assert stat.item() == pytest.approx(want.item(), rel=1e-5)
    assert fake.calls == [[torch.bfloat16, torch.bfloat16], [torch.float32]]


def test_te_backend_falls_back_to_torch_for_other_norms():
    fake = FakeTEL2Norm()
    be = ops.TransformerEngineBackend(applier, fake, torch.device("cpu"))
    t = torch.tensor([3.0, -4.0])
    assert be.power_sum([t], math.inf).item() == 4.0
    assert fake.calls == []


def test_cpu_uses_torch_backend():
    assert ops.backend_for(torch.device("cpu")).name == "torch"
