"""A max_norm that would flip or poison every gradient is refused, everywhere a clip runs."""

import importlib
import math

import pytest
import torch

from buffers import FlatGradBuffers

pytestmark = pytest.mark.mcore

BAD = [-1.0, -1e-30, math.nan, -math.inf, torch.tensor(-0.5), torch.tensor(math.nan)]


def filled_buffers(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.zeros(40, dtype=torch.bfloat16)),
        torch.nn.Parameter(torch.zeros(7)),
    ]
    fgb = FlatGradBuffers(params)
    for p in params:
        fgb.view(p).copy_(torch.randn(p.shape, generator=gen))
    return fgb, params


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("error_if_nonfinite", [False, True])
def test_clip_grad_norm_refuses_and_leaves_gradients_alone(bad, error_if_nonfinite):
    fgb, params = filled_buffers()
    before = [fgb.view(p).clone() for p in params]
    with pytest.raises(ValueError, match="max_norm must be a number >= 0"):
        fgb.clip_grad_norm_(bad, error_if_nonfinite=error_if_nonfinite)
    for p, b in zip(params, before, strict=True):
        assert torch.equal(fgb.view(p), b)


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("fold", [False, True])
def test_clipped_step_refuses_before_stepping(bad, fold):
    fgb, params = filled_buffers()
    opt = torch.optim.SGD(params, lr=0.1)
    weights = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="max_norm must be a number >= 0"):
        fgb.clipped_step(opt, bad, fold=fold)
    for p, w in zip(params, weights, strict=True):
        assert torch.equal(p.detach(), w)


@pytest.mark.parametrize("max_norm", [0.0, math.inf, torch.tensor(0.25)])
def test_zero_inf_and_tensor_max_norm_are_accepted(max_norm):
    fgb, params = filled_buffers(seed=1)
    before = [fgb.view(p).double() for p in params]
    ref = torch.linalg.vector_norm(torch.cat(before)).item()
    coeff = min(float(max_norm) / (ref + 1e-6), 1.0)
    got = fgb.clip_grad_norm_(max_norm)
    assert got.item() == pytest.approx(ref, rel=1e-6)
    for p, b in zip(params, before, strict=True):
        torch.testing.assert_close(fgb.view(p).double(), b * coeff, rtol=2**-7, atol=0)


@pytest.mark.parametrize("bad", BAD)
def test_installed_megatron_clip_refuses(bad):
    install_module = importlib.import_module("megatron_ext.install")
    params = [torch.nn.Parameter(torch.zeros(4))]
    params[0].grad = torch.ones(4)
    with pytest.raises(ValueError, match="max_norm must be a number >= 0"):
        install_module.clip_grad_by_total_norm_fp32(params, bad, torch.tensor(2.0))
    assert torch.equal(params[0].grad, torch.ones(4))


@pytest.mark.parametrize("text", ["0.01", b"0.01", "inf"])
def test_a_max_norm_given_as_text_is_a_type_error(text):
    # float("0.01") would parse it; the docs promise a TypeError for what is not a number
    fgb, params = filled_buffers()
    before = [fgb.view(p).clone() for p in params]
    with pytest.raises(TypeError, match="max_norm must be a number"):
        fgb.clip_grad_norm_(text)
    fgb.grad_norm("inf")  # torch's norm_type takes "inf": a norm type, not a number
    for p, b in zip(params, before, strict=True):
        assert torch.equal(fgb.view(p), b)


def test_the_list_functions_refuse_text_too():
    from buffers import scale_, total_norm

    grads = [torch.randn(4), torch.randn(3, dtype=torch.bfloat16)]
    before = [g.clone() for g in grads]
    total_norm(grads, "inf")  # as torch's get_total_norm
    with pytest.raises(TypeError, match="coeff must be a number"):
        scale_(grads, "0.5")
    with pytest.raises(TypeError, match="coeff must be a number"):
        scale_(grads, [0.5])
    for g, b in zip(grads, before, strict=True):
        assert torch.equal(g, b)
