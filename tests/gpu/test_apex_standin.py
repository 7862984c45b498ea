"""The Apex-like Adam stand-in the GPU checkpoint tests use (CPU test, runs in CI).

It must do Adam's math (checked against torch's own Adam/AdamW, run in fp64 on the same
random data) and keep state the way Apex's FusedAdam does (one ``step`` int per group, no
per-parameter ``step``), since that layout is what megatron-core's Apex code path saves.
"""

import pytest
import torch
from apex_standin import FusedAdam


def _params(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in ((7, 5), (13,), (3, 4, 2))]


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam-l2"])
def test_standin_matches_torch_adam_in_fp64(adam_w_mode):
    hyper = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    init = _params(0)
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.double()) for t in init]
    opt = FusedAdam([{"params": ours[:2]}, {"params": ours[2:]}], adam_w_mode=adam_w_mode, **hyper)
    ref_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref_opt = ref_cls(ref, **hyper)
    for step in range(1, 6):
        grads = _params(100 + step)
        for p, q, g in zip(ours, ref, grads, strict=True):
            p.grad, q.grad = g.clone(), g.double()
        opt.step()
        ref_opt.step()
        for p, q in zip(ours, ref, strict=True):
            torch.testing.assert_close(p.double(), q.detach(), rtol=1e-5, atol=1e-6)
    for p, t in zip(ours, init, strict=True):
        assert (p - t).abs().min() > 0  # every element moved
    assert [g["step"] for g in opt.param_groups] == [5, 5]
    for p, q in zip(ours, ref, strict=True):
        assert sorted(opt.state[p]) == ["exp_avg", "exp_avg_sq"]  # Apex keeps no per-param step
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key].double(), ref_opt.state[q][key])


def test_standin_refuses_what_it_does_not_implement():
    with pytest.raises(NotImplementedError, match="capturable"):
        FusedAdam([torch.nn.Parameter(torch.zeros(2))], capturable=True)
