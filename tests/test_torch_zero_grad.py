"""``FlatGradBuffers.zero_()`` gives a torch optimizer what ``opt.zero_grad()`` gives it.

torch's default (``set_to_none=True``) leaves ``.grad`` None for a parameter that got no
gradient since the last zeroing, and torch's optimizers skip such a parameter: no
momentum, no weight decay. Each test trains two copies of a model side by side, one with
torch's own loop and one with the flat buffers, and compares every parameter.
"""

import copy

import pytest
import torch

from buffers import FlatGradBuffers, GradientOutsideBufferError


def assert_same_params(ours, ref, dtype):
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        if dtype == torch.float32:
            assert torch.equal(p, q), name
        else:  # within bf16 rounding: one unit in the last place of bf16
            torch.testing.assert_close(p, q, rtol=2**-7, atol=0, msg=name)


def side_by_side(model, dtype, steps, x_of, freeze_at=None, micro=1):
    """Train ``model`` and a copy, torch's loop and ours; return (ours, torch's)."""
    ours, ref = model, copy.deepcopy(model)
    opt = torch.optim.AdamW(ours.parameters(), lr=0.1, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1)
    fgb = FlatGradBuffers(ours.named_parameters())
    gen = torch.Generator().manual_seed(11)
    for step in range(steps):
        if step == freeze_at:
            ours[0].requires_grad_(False)
            ref[0].requires_grad_(False)
        fgb.zero_()
        ref_opt.zero_grad()
        for _ in range(micro):
            x = x_of(gen)
            ours_loss, ref_loss = x_of.loss(ours, x), x_of.loss(ref, x)
            ours_loss.backward()
            ref_loss.backward()
        for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None)
        opt.step()
        ref_opt.step()
    return ours, ref, fgb


class Inputs:
    def __init__(self, dtype, loss):
        self.dtype, self.loss = dtype, loss

    def __call__(self, gen):
        return torch.randn(4, 8, generator=gen).to(self.dtype)


def sequential_loss(m, x):
    return m(x).float().square().mean()


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_frozen_mid_training_is_not_stepped_like_torch(dtype, micro):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)).to(dtype)
    frozen_before = copy.deepcopy(model[0])
    ours, ref, _ = side_by_side(
        model, dtype, 4, Inputs(dtype, sequential_loss), freeze_at=1, micro=micro
    )
    assert_same_params(ours, ref, dtype)
    # the frozen layer moved once (step 0) and then never again, as in torch
    assert not torch.equal(ours[0].weight, frozen_before.weight)
    assert all(p.grad is None for p in ours[0].parameters())


def used_loss(m, x):
    return m["used"](x).float().square().mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_module_that_gets_no_gradient_is_not_stepped_like_torch(dtype):
    torch.manual_seed(1)
    # an expert that gets no tokens
    experts = {"used": torch.nn.Linear(8, 8), "unused": torch.nn.Linear(8, 8)}
    model = torch.nn.ModuleDict(experts).to(dtype)
    unused_before = copy.deepcopy(model["unused"])
    ours, ref, fgb = side_by_side(model, dtype, 3, Inputs(dtype, used_loss))
    assert_same_params(ours, ref, dtype)
    for p, q in zip(ours["unused"].parameters(), unused_before.parameters(), strict=True):
        assert torch.equal(p, q)  # no weight decay either
        assert p.grad is None
        assert fgb.view(p).eq(0).all()


def test_norm_and_clip_count_exactly_what_the_optimizer_applies():
    torch.manual_seed(2)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(8, 8), "unused": torch.nn.Linear(8, 8)})
    fgb = FlatGradBuffers(model.named_parameters())
    for step in range(3):
        fgb.zero_()
        x = torch.randn(4, 8)
        model["used" if step != 1 else "unused"](x).square().mean().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert len(grads) == 2
        want = torch.cat([g.double().flatten() for g in grads]).norm().item()
        assert fgb.grad_norm().item() == pytest.approx(want, rel=1e-6)
        norm = fgb.clip_grad_norm_(want / 4)
        assert norm.item() == pytest.approx(want, rel=1e-6)
        clipped = torch.cat([g.double().flatten() for g in grads]).norm().item()
        assert clipped == pytest.approx(want / 4, rel=1e-5)


def test_retain_graph_accumulates_twice_in_the_buffer():
    torch.manual_seed(3)
    lin = torch.nn.Linear(8, 2)
    ref = copy.deepcopy(lin)
    fgb = FlatGradBuffers(lin.named_parameters())
    fgb.zero_()
    x = torch.randn(3, 8)
    loss, ref_loss = lin(x).square().sum(), ref(x).square().sum()
    for _ in range(2):
        loss.backward(retain_graph=True)
        ref_loss.backward(retain_graph=True)
    for p, q in zip(lin.parameters(), ref.parameters(), strict=True):
        assert p.grad.data_ptr() == fgb.view(p).data_ptr()
        assert torch.equal(p.grad, q.grad)


def test_zero_grad_instead_of_zero_trains_as_torch():
    # a loop written for torch, zero_() never called: each step's gradients are set to
    # None by torch, so the views still hold the last step's until the next call takes in
    # the new tensors backward made
    torch.manual_seed(5)
    lin = torch.nn.Linear(8, 2)
    ref = copy.deepcopy(lin)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=0.1) for m in (lin, ref))
    fgb = FlatGradBuffers(lin.named_parameters())
    for _ in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        x = torch.randn(3, 8)
        lin(x).square().sum().backward()
        ref(x).square().sum().backward()
        norm = fgb.clip_grad_norm_(1.0)
        assert norm.item() == pytest.approx(
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item(), rel=1e-6
        )
        opt.step()
        ref_opt.step()
    for (name, p), q in zip(lin.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


def test_gradients_set_to_none_after_backward_are_left_out_as_in_torch():
    lin = torch.nn.Linear(8, 2)
    fgb = FlatGradBuffers(lin.named_parameters())
    fgb.zero_()
    lin(torch.randn(3, 8)).sum().backward()
    torch.optim.SGD(lin.parameters(), lr=0.1).zero_grad()
    assert fgb.grad_norm().item() == 0.0  # torch's norm over no gradient
    assert fgb.count_zeros().item() == lin.weight.numel() + lin.bias.numel()


def test_zero_grad_beside_zero_is_harmless():
    torch.manual_seed(4)
    lin = torch.nn.Linear(8, 2)
    ref = copy.deepcopy(lin)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=0.1) for m in (lin, ref))
    fgb = FlatGradBuffers(lin.named_parameters())
    for _ in range(3):
        fgb.zero_()
        opt.zero_grad()  # a loop written for torch, with ours added: nothing to report
        ref_opt.zero_grad()
        x = torch.randn(3, 8)
        lin(x).sum().backward()
        ref(x).sum().backward()
        fgb.clip_grad_norm_(1e9)
        opt.step()
        ref_opt.step()
    assert_same_params(lin, ref, torch.float32)


def test_set_to_none_false_keeps_every_gradient_a_zero_view():
    lin = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
    fgb = FlatGradBuffers(lin.named_parameters())
    fgb.zero_(set_to_none=False)
    lin["a"](torch.randn(3, 2)).sum().backward()
    for p in lin.parameters():
        assert p.grad is fgb.view(p)
    assert lin["b"].weight.grad.eq(0).all() and lin["a"].weight.grad.ne(0).any()
    fgb.grad_norm()
    with pytest.raises(TypeError, match="set_to_none"):
        fgb.zero_(set_to_none="no")


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_a_backward_with_create_graph_is_reported_not_missed():
    # autograd then adds out of place, into a tensor with a graph a copy would cut
    lin = torch.nn.Linear(8, 2)
    fgb = FlatGradBuffers(lin.named_parameters())
    for _ in range(2):  # .grad None (bound by the hook), then .grad the view
        fgb.zero_()
        if _:
            lin(torch.randn(3, 8)).sum().backward()
        lin(torch.randn(3, 8)).square().sum().backward(create_graph=True)
        with pytest.raises(GradientOutsideBufferError, match="'weight'.*autograd graph"):
            fgb.grad_norm()
        fgb.zero_()  # re-binds them (and breaks the reference cycle create_graph makes)
        lin(x := torch.randn(3, 8)).square().sum().backward()
        assert all(p.grad is fgb.view(p) for p in lin.parameters())
        ref = [p.detach().requires_grad_() for p in lin.parameters()]
        torch.nn.functional.linear(x, *ref).square().sum().backward()
        want = torch.nn.utils.get_total_norm([r.grad.double() for r in ref]).item()
        assert fgb.grad_norm().item() == pytest.approx(want, rel=1e-6)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_a_backward_with_create_graph_and_no_graph_in_the_gradient_is_torchs():
    # a loss linear in the parameters: the gradient has no graph, so it is taken in
    torch.manual_seed(6)
    lin = torch.nn.Linear(8, 2)
    fgb = FlatGradBuffers(lin.named_parameters())
    fgb.zero_()
    x = torch.randn(3, 8)
    lin(x).sum().backward(create_graph=True)
    want = torch.cat([lin.weight.grad.flatten(), lin.bias.grad]).double().norm().item()
    assert fgb.grad_norm().item() == pytest.approx(want, rel=1e-6)
    assert all(p.grad is fgb.view(p) for p in lin.parameters())
