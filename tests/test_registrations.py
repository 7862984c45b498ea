"""A parameter added to the model after FlatGradBuffers was built is never silently left out.

Built from a module or its ``named_parameters()`` / ``parameters()``, the buffers watch the
model: a parameter registered later raises at the first norm, clip or count after it gets a
gradient, naming it; a new FlatGradBuffers over the model as it is then agrees with torch.
"""

import gc
import weakref

import pytest
import torch

from buffers import FlatGradBuffers, GradientOutsideBufferError
from buffers.registrations import ModelRoot, model_root
from tests.support.refusing_calls import assert_every_call_raises

LATE = r"parameter '{}' was registered on the model after .*build a new FlatGradBuffers"


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def loss(net, seed):
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
    out = net(x).square().sum()
    for p in net.parameters(recurse=False):  # the root's own late parameters, if any
        out = out + (p * p.detach().sin()).sum()
    return out


def assert_like_torch(fgb, net, seed, max_norm=0.5):
    """Norm and clip against an fp64 reference over every real ``.grad`` of the model."""
    fgb.zero_()
    loss(net, seed).backward()
    params = [p for p in net.parameters() if p.grad is not None]
    grads = [p.grad.double().clone() for p in params]
    want = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item()
    assert fgb.clip_grad_norm_(max_norm).item() == pytest.approx(want, rel=1e-5)
    coeff = min(1.0, max_norm / (want + 1e-6))
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(p.grad.double(), g * coeff, rtol=1e-5, atol=1e-12)


BUILDS = {
    "module": lambda net: net,
    "named_parameters": lambda net: net.named_parameters(),
    "parameters": lambda net: net.parameters(),
}


@pytest.mark.parametrize("build", BUILDS)
def test_a_parameter_registered_after_build_raises_naming_it(build):
    net = make_model()
    fgb = FlatGradBuffers(BUILDS[build](net))
    assert_like_torch(fgb, net, seed=1)

    net.register_parameter("extra", torch.nn.Parameter(torch.randn(8)))
    fgb.zero_()
    loss(net, 2).backward()
    extra = net.extra.grad.clone()
    with pytest.raises(GradientOutsideBufferError, match=LATE.format("extra")):
        fgb.clip_grad_norm_(1e-3)  # would scale every gradient but the new one
    assert torch.equal(net.extra.grad, extra)
    assert_every_call_raises(fgb, LATE.format("extra"))

    assert_like_torch(FlatGradBuffers(net), net, seed=3)  # what the error says to do


def test_a_parameter_set_as_an_attribute_of_a_submodule_is_named_by_its_path():
    net = make_model()
    fgb = FlatGradBuffers(net.named_parameters())
    net[2].scale = torch.nn.Parameter(torch.rand(4) + 0.5)
    net[2].register_forward_hook(lambda mod, args, out: out * mod.scale)
    fgb.zero_()
    loss(net, 1).backward()
    assert_every_call_raises(fgb, LATE.format(r"2\.scale"))


def test_a_submodule_attached_after_build_raises_naming_its_parameters():
    net = make_model()
    fgb = FlatGradBuffers(net)
    net.append(torch.nn.Linear(4, 3))
    fgb.zero_()
    loss(net, 1).backward()
    assert_every_call_raises(fgb, r"parameter '3\.weight' \(and '3\.bias'\) was registered")
    assert_like_torch(FlatGradBuffers(net), net, seed=2)


def test_a_replaced_parameter_kept_alive_by_the_optimizer_is_found():
    # the old weight lives on in the optimizer, so nothing is freed; the new one is outside
    net = make_model()
    fgb = FlatGradBuffers(net.named_parameters())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net[0].weight = torch.nn.Parameter(torch.randn(16, 8))
    fgb.zero_()
    loss(net, 1).backward()
    with pytest.raises(GradientOutsideBufferError, match=LATE.format(r"0\.weight")):
        fgb.clipped_step(opt, 1.0)


def test_a_late_parameter_without_a_gradient_changes_nothing():
    # registered but unused: torch's norm would not count it either, so no error
    net = make_model()
    fgb = FlatGradBuffers(net.named_parameters())
    net[0].unused = torch.nn.Parameter(torch.randn(3))
    net.frozen = torch.nn.Parameter(torch.randn(8), requires_grad=False)
    assert_like_torch(fgb, net, seed=1)
    fgb.check_bindings()

    net.frozen.requires_grad_(True)  # ...until it is unfrozen and trained
    fgb.zero_()
    loss(net, 2).backward()
    assert_every_call_raises(fgb, LATE.format("frozen"))


def test_with_recurse_false_only_the_modules_own_parameters_are_watched():
    net = make_model()
    net.register_parameter("gain", torch.nn.Parameter(torch.randn(8)))
    fgb = FlatGradBuffers(net.named_parameters(recurse=False))
    net[0].extra = torch.nn.Parameter(torch.randn(16))  # not a parameter it was given
    net[0].register_forward_hook(lambda mod, args, out: out + mod.extra)
    fgb.zero_()
    loss(net, 1).backward()
    want = net.gain.grad.double().norm().item()
    assert fgb.grad_norm().item() == pytest.approx(want, rel=1e-6)
    fgb.check_bindings()  # net[0].extra has a gradient but was never asked for

    net.register_parameter("late", torch.nn.Parameter(torch.randn(8)))
    fgb.zero_()
    loss(net, 2).backward()
    assert_every_call_raises(fgb, LATE.format("late"))


def test_check_bindings_finds_what_bypasses_torchs_registration_hooks():
    net = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    fgb = FlatGradBuffers(net)
    net.insert(0, torch.nn.Linear(4, 4))  # writes net._modules directly: no hook runs
    x = torch.randn(2, 4)
    for layer in net:
        x = layer(x)
    x.sum().backward()
    with pytest.raises(GradientOutsideBufferError, match=r"'0\.weight' \(and '0\.bias'\) was reg"):
        fgb.check_bindings()
    assert_every_call_raises(fgb, r"'0\.weight' \(and '0\.bias'\) was registered")


def test_only_the_models_of_live_open_buffers_are_watched():
    net, other = make_model(), make_model(seed=1)
    fgb = FlatGradBuffers(net)
    other.extra = torch.nn.Parameter(torch.randn(8))  # another model: none of its business
    torch.nn.Linear(3, 3)  # nor a module built anywhere else
    loss(other, 0).backward()  # other.extra gets a gradient
    assert_like_torch(fgb, net, seed=1)

    fgb.close()
    net.extra = torch.nn.Parameter(torch.randn(8))
    with pytest.raises(GradientOutsideBufferError, match="were closed"):
        fgb.grad_norm()

    del fgb
    gc.collect()
    net.extra2 = torch.nn.Parameter(torch.randn(8))  # no watch left: nothing to report
    assert_like_torch(FlatGradBuffers(net), net, seed=2)


def test_the_model_is_known_from_a_module_or_a_fresh_generator_only():
    net = make_model()
    assert model_root(net) == ModelRoot(net)
    assert model_root(net.parameters()) == ModelRoot(net)
    assert model_root(net[0].named_parameters("first", recurse=False)) == ModelRoot(
        net[0], "first", False
    )
    started = net.named_parameters()
    next(started)
    assert model_root(started) is None  # what is left of it is not the whole model
    assert model_root(list(net.parameters())) is None
    assert model_root(p for p in net.parameters()) is None


def test_buffers_built_from_a_module_do_not_keep_it_alive():
    net = make_model()
    fgb = FlatGradBuffers(net)
    gone = weakref.ref(net)
    del net
    gc.collect()
    assert gone() is None
    with pytest.raises(GradientOutsideBufferError, match=r"'0\.weight' .*was freed"):
        fgb.check_bindings()
