"""FlatGradBuffers.clipped_step: clip folded into fused Adam/AdamW's grad_scale, else explicit.

References are computed in fp64 from the same random gradients: the clip coefficient, and
one Adam(W) step written out by hand.
"""

import math

import pytest
import torch

from buffers import FlatGradBuffers

SHAPES = [((64,), torch.float32), ((7, 3), torch.float32), ((33,), torch.float32)]


def make(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=g, dtype=dt).to(device)) for s, dt in SHAPES
    ]
    return params, FlatGradBuffers(params)


def fill(params, seed, scale=5.0):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad.copy_(torch.randn(p.shape, generator=g) * scale)


def adamw_reference(p0, grad, lr, wd, step, m=None, v=None, b1=0.9, b2=0.999, eps=1e-8):
    """One AdamW step in fp64 (torch's formula); returns new param, m, v."""
    m = torch.zeros_like(p0) if m is None else m
    v = torch.zeros_like(p0) if v is None else v
    p = p0 * (1 - lr * wd)
    m = b1 * m + (1 - b1) * grad
    v = b2 * v + (1 - b2) * grad * grad
    bc1, bc2 = 1 - b1**step, 1 - b2**step
    p = p - lr / bc1 * m / ((v / bc2).sqrt() + eps)
    return p, m, v


@pytest.mark.parametrize("max_norm", [0.5, 3.0, 1e9])
def test_folded_clip_matches_fp64_adamw(device, max_norm):
    params, fgb = make(device)
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    state = [(p.detach().double().clone(), None, None) for p in params]
    for step in range(1, 4):  # eager, captured, replayed on CUDA
        fill(params, seed=10 + step)
        grads = [p.grad.detach().double().clone() for p in params]
        ref_norm = math.sqrt(sum(g.square().sum().item() for g in grads))
        coeff = min(max_norm / (ref_norm + 1e-6), 1.0)
        total = fgb.clipped_step(opt, max_norm, fold=True)
        assert float(total) == pytest.approx(ref_norm, rel=1e-6)
        assert not hasattr(opt, "grad_scale")
        new_state = []
        for p, g, (p0, m, v) in zip(params, grads, state, strict=True):
            want, m, v = adamw_reference(p0, g * coeff, 1e-2, 0.1, step, m, v)
            torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=1e-6)
            # torch's fused kernel writes the divided gradients back: .grad ends up clipped,
            # as after an explicit clip
            torch.testing.assert_close(p.grad.double(), g * coeff, rtol=1e-6, atol=1e-9)
            new_state.append((p.detach().double().clone(), m, v))
        state = new_state


def test_folded_with_coefficient_one_is_bitwise_a_plain_step(device):
    params, fgb = make(device)
    twins, _ = make(device)
    opt = torch.optim.Adam(params, lr=1e-3, fused=True)
    ref = torch.optim.Adam(twins, lr=1e-3, fused=True)
    for step in range(3):
        fill(params, seed=step)
        for p, q in zip(params, twins, strict=True):
            q.grad = p.grad.detach().clone()
        fgb.clipped_step(opt, 1e9, fold=True)
        ref.step()
        for p, q in zip(params, twins, strict=True):
            assert torch.equal(p, q)


def test_other_optimizers_get_an_explicit_clip_then_step(device):
    params, fgb = make(device)
    opt = torch.optim.SGD(params, lr=0.1)
    fill(params, seed=3)
    grads = [p.grad.detach().double().clone() for p in params]
    before = [p.detach().double().clone() for p in params]
    ref_norm = math.sqrt(sum(g.square().sum().item() for g in grads))
    coeff = min(1.0 / (ref_norm + 1e-6), 1.0)
    total = fgb.clipped_step(opt, 1.0)
    assert float(total) == pytest.approx(ref_norm, rel=1e-6)
    for p, g, b in zip(params, grads, before, strict=True):
        torch.testing.assert_close(p.grad.double(), g * coeff, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(p.detach().double(), b - 0.1 * g * coeff, rtol=1e-5, atol=1e-7)


def test_non_fused_adam_is_not_folded(device):
    params, fgb = make(device)
    opt = torch.optim.Adam(params, lr=1e-3, foreach=False)
    assert not FlatGradBuffers._can_fold(opt)
    fill(params, seed=4)
    fgb.clipped_step(opt, 0.5, fold=True)  # asked for, but this optimizer cannot fold
    norm_after = math.sqrt(sum(p.grad.double().square().sum().item() for p in params))
    assert norm_after == pytest.approx(0.5, rel=1e-5)  # the explicit clip rewrote them


def test_optimizer_with_a_parameter_outside_the_buffers_is_refused(device):
    params, fgb = make(device)
    stranger = torch.nn.Parameter(torch.zeros(5, device=device))
    opt = torch.optim.AdamW([*params, stranger], lr=1e-3, fused=True)
    fill(params, seed=5)
    stranger.grad = torch.ones(5, device=device)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=r"parameter 3 of param group 0 \(shape \(5,\)"):
        fgb.clipped_step(opt, 1.0, fold=True)
    for p, b in zip(params, before, strict=True):  # refused before anything stepped
        assert torch.equal(p, b)
    assert torch.equal(stranger, torch.zeros(5, device=device))


def test_step_error_still_removes_grad_scale(device):
    params, fgb = make(device)
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    fill(params, seed=6)

    def broken_step(*args, **kwargs):
        assert opt.grad_scale is fgb._norm_clip.inverse_coeff
        raise RuntimeError("boom")

    opt.step = broken_step
    with pytest.raises(RuntimeError, match="boom"):
        fgb.clipped_step(opt, 1.0, fold=True)
    assert not hasattr(opt, "grad_scale")


def test_default_does_not_fold_even_for_fused_adamw(device):
    params, fgb = make(device)
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    fill(params, seed=7)
    grads = [p.grad.detach().double().clone() for p in params]
    ref_norm = math.sqrt(sum(g.square().sum().item() for g in grads))
    seen = {}
    real_step = opt.step

    def watching_step(*args, **kwargs):
        seen["grad_scale"] = hasattr(opt, "grad_scale")
        seen["norm"] = math.sqrt(sum(p.grad.double().square().sum().item() for p in params))
        return real_step(*args, **kwargs)

    opt.step = watching_step
    fgb.clipped_step(opt, 0.5)
    assert seen["grad_scale"] is False  # explicit: gradients already clipped before step
    assert seen["norm"] == pytest.approx(0.5 * ref_norm / (ref_norm + 1e-6), rel=1e-5)
