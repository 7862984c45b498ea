"""FlatGradBuffers' gradient hooks: rebuilding over the same parameters, close()."""

import gc
import math
import weakref

import torch

from buffers import FlatGradBuffers


def model(seed=0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32, dtype=torch.bfloat16))
    net.register_parameter("sink", torch.nn.Parameter(torch.randn(32)))
    return net


def hooks_on(p) -> int:
    return len(getattr(p, "_backward_hooks", None) or {})


def backward(net, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 16, generator=g, dtype=torch.bfloat16)
    (net(x).float() * net.sink).square().sum().backward()


def fp64_norm(net):
    return math.sqrt(sum(p.grad.double().square().sum().item() for p in net.parameters()))


def test_rebuilding_over_the_same_parameters_releases_the_old_buffers():
    # docs/guarantees.md's advice after adding a parameter: build a new FlatGradBuffers.
    net = model()
    old = FlatGradBuffers(net.named_parameters())
    gone = weakref.ref(old)
    new = FlatGradBuffers(net.named_parameters())
    del old
    gc.collect()
    assert gone() is None, "the parameters' hooks kept the old FlatGradBuffers alive"
    assert all(hooks_on(p) == 1 for p in net.parameters())
    for step in range(2):
        new.zero_()
        backward(net, step)
        assert math.isclose(float(new.grad_norm()), fp64_norm(net), rel_tol=1e-6)


def test_close_and_the_with_block_remove_the_hooks():
    net = model(1)
    with FlatGradBuffers(net.named_parameters()) as fgb:
        assert all(hooks_on(p) == 1 for p in net.parameters())
        fgb.zero_()
        backward(net, 3)
        assert math.isclose(float(fgb.grad_norm()), fp64_norm(net), rel_tol=1e-6)
    assert all(hooks_on(p) == 0 for p in net.parameters())
    fgb.close()  # idempotent
    other = FlatGradBuffers(net.named_parameters())
    assert all(hooks_on(p) == 1 for p in net.parameters())
    other.close()
    assert all(hooks_on(p) == 0 for p in net.parameters())


def test_an_open_buffer_keeps_its_hooks_after_a_rebuild_elsewhere():
    net, other = model(2), model(3)
    fgb = FlatGradBuffers(net.named_parameters())
    FlatGradBuffers(other.named_parameters()).close()
    assert all(hooks_on(p) == 1 for p in net.parameters())
    fgb.zero_()
    backward(net, 4)
    assert all(p.grad is fgb.view(p) for p in net.parameters())  # bound by the hooks
    net.sink.grad = None  # dropped: left out, as torch would
    want = math.sqrt(sum(p.grad.double().square().sum().item() for p in net[0].parameters()))
    assert math.isclose(float(fgb.grad_norm()), want, rel_tol=1e-6)


def test_buffers_built_again_over_the_same_model_name_the_real_cause():
    # The old buffers, still open, lose the gradients to the new ones: their next call
    # says so, instead of blaming zero_grad(set_to_none=True).
    net = model(5)
    first = FlatGradBuffers(net.named_parameters())
    second = FlatGradBuffers(net.named_parameters())
    for step in range(2):
        second.zero_()
        backward(net, step)
        assert math.isclose(float(second.grad_norm()), fp64_norm(net), rel_tol=1e-6)
    for call in (first.grad_norm, first.zero_, lambda: first.clip_grad_norm_(1.0)):
        try:
            call()
        except RuntimeError as e:
            assert "'0.weight'" in str(e) and "built later over the same parameters" in str(e)
            assert "set_to_none" not in str(e)
        else:
            raise AssertionError("the first buffers did not report losing the gradients")
    second.zero_()  # the first's hooks and zero_() left the second's bindings alone
    backward(net, 3)
    assert all(p.grad is second.view(p) for p in net.parameters())
