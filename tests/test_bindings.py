"""The model changes after FlatGradBuffers is built: torch's numbers, or an error that says why.

Each case either gives the norm, clip and zero count torch.nn.utils gives over the real
``.grad`` tensors, or raises at the first call that can see the change, naming the
parameter and what to do. Never a silent 0.
"""

import copy
import gc
import math

import pytest
import torch

from buffers import FlatGradBuffers, GradientOutsideBufferError
from tests.support.refusing_calls import assert_every_call_raises, every_call

BF16 = torch.bfloat16
TOL = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-6, torch.float64: 1e-12}


def model(seed=0, dtype=BF16):
    """A bf16 Linear (weight and bias) and an fp32 "sink": two buffers."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32, dtype=dtype))
    net.register_parameter("sink", torch.nn.Parameter(torch.randn(32)))
    return net


def backward(net, seed):
    dtype = net[0].weight.dtype
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed)).to(dtype)
    (net(x).float() * net.sink.float()).square().sum().backward()


def assert_like_torch(fgb, net, max_norm=1.0, norm_type=2.0):
    """Norm, zero count and clip against torch.nn.utils over the real .grad tensors."""
    params = [p for p in net.parameters() if p.grad is not None]
    grads = [p.grad.clone() for p in params]
    want = torch.nn.utils.get_total_norm([g.double() for g in grads], norm_type).item()
    zeros = sum(int((g == 0).sum()) for g in grads)
    assert fgb.count_zeros().item() == zeros
    assert fgb.grad_norm(norm_type).item() == pytest.approx(want, rel=1e-5)
    # torch's clip over fp64 copies: its own bf16 per-tensor norms are off by ~1e-3, ours
    # accumulate in fp32, so the exact coefficient is the reference
    twins = [torch.nn.Parameter(g.double()) for g in grads]
    for t, g in zip(twins, grads, strict=True):
        t.grad = g.double()
    torch.nn.utils.clip_grad_norm_(twins, max_norm, norm_type)
    got = fgb.clip_grad_norm_(max_norm, norm_type)
    assert got.item() == pytest.approx(want, rel=1e-5)
    for p, t in zip(params, twins, strict=True):
        tol = TOL[p.dtype]
        torch.testing.assert_close(p.grad.double(), t.grad, rtol=tol, atol=1e-30)


def assert_a_new_one_works(net, seed):
    """What every error tells the user to do: a new FlatGradBuffers over the model as it
    is now, which then agrees with torch."""
    rebuilt = FlatGradBuffers(net.named_parameters())
    rebuilt.zero_()
    backward(net, seed)
    assert_like_torch(rebuilt, net)


# --- a parameter frozen at build, unfrozen later -------------------------------------------


def test_frozen_at_build_then_unfrozen_raises_at_the_first_call_after_its_gradient():
    net = model()
    net[0].bias.requires_grad_(False)
    fgb = FlatGradBuffers(net.named_parameters())
    assert not net[0].bias.requires_grad  # the hook's registration left it frozen
    fgb.zero_()
    backward(net, 1)
    assert_like_torch(fgb, net)  # frozen: no gradient, counted by neither

    net[0].bias.requires_grad_(True)
    fgb.zero_()
    backward(net, 2)
    assert net[0].bias.grad is not None  # torch would count it
    assert_every_call_raises(fgb, r"'0\.bias' was frozen .*build a new FlatGradBuffers")

    assert_a_new_one_works(net, seed=3)


def test_clipped_step_refuses_an_unfrozen_parameter_before_stepping_it():
    net = model()
    net.sink.requires_grad_(False)
    fgb = FlatGradBuffers(net.named_parameters())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    backward(net, 1)
    fgb.clipped_step(opt, 1.0)
    net.sink.requires_grad_(True)
    fgb.zero_()
    backward(net, 2)
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(GradientOutsideBufferError, match=r"'sink' was frozen"):
        fgb.clipped_step(opt, 1.0)
    for p, b in zip(net.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)


# --- clipped_step's optimizer check ------------------------------------------------------------


def test_clipped_step_rechecks_when_a_parameter_is_replaced_or_added():
    net = model()
    fgb = FlatGradBuffers(net.named_parameters())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    backward(net, 1)
    fgb.clipped_step(opt, 1.0)
    group = opt.param_groups[0]["params"]
    stranger = torch.nn.Parameter(torch.zeros(3))
    mine, group[0] = group[0], stranger  # same count of parameters
    with pytest.raises(ValueError, match=r"parameter 0 of param group 0 \(shape \(3,\)"):
        fgb.clipped_step(opt, 1.0)
    group[0] = mine
    fgb.clipped_step(opt, 1.0)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(5))]})
    with pytest.raises(ValueError, match=r"parameter 0 of param group 1 \(shape \(5,\)"):
        fgb.clipped_step(opt, 1.0)


def test_a_frozen_optimizer_parameter_outside_the_buffers_is_watched():
    net = model()
    net.sink.requires_grad_(False)
    fgb = FlatGradBuffers(net[0].named_parameters())  # the sink is not given at all
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    backward(net, 1)
    fgb.clipped_step(opt, 1.0)  # frozen: accepted, and watched from now on
    assert not net.sink.requires_grad
    net.sink.requires_grad_(True)
    fgb.zero_()
    backward(net, 2)
    sink = net.sink.detach().clone()
    with pytest.raises(GradientOutsideBufferError, match=r"group 0 \(shape \(32,\).*frozen when"):
        fgb.clipped_step(opt, 1.0)
    assert torch.equal(net.sink.detach(), sink)


# --- the model converted after build --------------------------------------------------------

CONVERSIONS = {
    "half": lambda m: m.half(),
    "to_float16": lambda m: m.to(torch.float16),
    "double": lambda m: m.double(),
    "to_bfloat16": lambda m: m.to(torch.bfloat16),  # only the fp32 sink changes
}


CONVERTED = r"parameter '[\w.]+'.* changed from torch\.\w+ on cpu to torch\.\w+ on cpu after .*"
REBUILD = "convert the model first, then build a new FlatGradBuffers"


@pytest.mark.parametrize("convert", CONVERSIONS)
@pytest.mark.parametrize(
    "first", ["backward", "grad_norm", "clip_grad_norm_", "zero_", "check_bindings"]
)
@pytest.mark.parametrize("zeroed", [None, True, False])  # zero_(set_to_none=...) before
def test_conversion_after_build_raises_at_the_first_call(convert, first, zeroed):
    net = model()
    fgb = FlatGradBuffers(net.named_parameters())
    backward(net, 1)
    if zeroed is not None:  # True: every .grad None, where check_bindings once passed
        fgb.zero_(set_to_none=zeroed)
    CONVERSIONS[convert](net)
    # backward: the hook names it, before torch refuses the view's dtype without a name
    calls = every_call(fgb) | {"backward": lambda: backward(net, 2)}
    call = calls[first]
    with pytest.raises(GradientOutsideBufferError, match=CONVERTED + REBUILD):
        call()
    with pytest.raises(GradientOutsideBufferError, match=CONVERTED + REBUILD):
        fgb.clip_grad_norm_(1.0)  # and every call after it


@pytest.mark.parametrize("zeroed", [None, True, False])
def test_a_converted_part_of_the_model_is_found_by_check_bindings_or_the_next_backward(zeroed):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    fgb = FlatGradBuffers(net.named_parameters())
    if zeroed is not None:
        fgb.zero_(set_to_none=zeroed)
    net[1].double()  # not the sampled first parameter of the fp32 buffer
    both = r"'1\.weight' \(and '1\.bias'\) changed from torch.float32 on cpu to torch.float64"
    with pytest.raises(GradientOutsideBufferError, match=both + ".*" + REBUILD):
        fgb.check_bindings()
    x = torch.randn(3, 8)
    # the first of the two whose hook runs is named (torch's order), then backward stops
    one = r"^parameter '1\.(weight|bias)' changed from torch.float32 on cpu to torch.float64 on cpu"
    with pytest.raises(GradientOutsideBufferError, match=one + ".*" + REBUILD):
        net[1](net[0](x).double()).sum().backward()
    with pytest.raises(GradientOutsideBufferError, match=both):
        fgb.clip_grad_norm_(1.0)


def test_zero_keeping_views_names_a_converted_part_of_the_model():
    # torch refuses the fp32 view of a parameter that is fp64 now; the error names it
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    fgb = FlatGradBuffers(net.named_parameters())
    fgb.zero_()
    net[1].double()  # not the sampled first parameter of the fp32 buffer
    fgb.zero_()  # every .grad None: nothing to refuse yet
    with pytest.raises(GradientOutsideBufferError, match=r"'1\.weight' \(and '1\.bias'\) ch"):
        fgb.zero_(set_to_none=False)


@pytest.mark.parametrize("first", ["backward", "check_bindings"])
def test_a_parameter_given_another_shape_is_named_with_both_shapes(first):
    net = model()
    fgb = FlatGradBuffers(net.named_parameters())
    fgb.zero_()
    net.sink.data = torch.randn(1)  # still broadcasts against the output
    calls = every_call(fgb) | {"backward": lambda: backward(net, 1)}
    with pytest.raises(
        GradientOutsideBufferError,
        match=r"^parameter 'sink' changed from torch.float32 \(32,\) on cpu to torch.float32 "
        r"\(1,\) on cpu after",
    ):
        calls[first]()


def test_converted_then_rebuilt_matches_torch():
    net = model()
    net.double()
    fgb = FlatGradBuffers(net.named_parameters())
    for step in range(3):
        fgb.zero_()
        backward(net, step)
        assert_like_torch(fgb, net, max_norm=0.5)


# --- close() -----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["close", "with"])
def test_every_call_after_close_raises(how):
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if how == "close":
        fgb = FlatGradBuffers(net.named_parameters())
        fgb.close()
    else:
        with FlatGradBuffers(net.named_parameters()) as fgb:
            backward(net, 0)
            assert_like_torch(fgb, net)
    opt.zero_grad()
    backward(net, 1)
    assert_every_call_raises(fgb, "were closed")


# --- the model re-created, or its parameters replaced ----------------------------------------


def test_old_buffers_after_the_model_was_recreated_raise():
    net = model()
    fgb = FlatGradBuffers(net.named_parameters())
    backward(net, 0)
    net = model(seed=1)  # the old parameters are freed: the buffers held them weakly
    gc.collect()
    backward(net, 1)
    assert_every_call_raises(fgb, r"'sink' \(and '0\.weight', '0\.bias'\) was freed .*re-created")


def test_load_state_dict_with_assign_raises():
    net = model()
    fgb = FlatGradBuffers(net.named_parameters())
    state = {k: v.clone() for k, v in model(seed=2).state_dict().items()}
    net.load_state_dict(state, assign=True)
    gc.collect()
    backward(net, 1)
    assert_every_call_raises(fgb, r"was freed .*assign=True")
    assert_a_new_one_works(net, seed=2)


def test_load_state_dict_in_place_keeps_working():
    net = model()
    fgb = FlatGradBuffers(net.named_parameters())
    net.load_state_dict(model(seed=3).state_dict())  # copies into the same parameters
    fgb.zero_()
    backward(net, 1)
    assert_like_torch(fgb, net)


# --- gradients set to None before any backward -----------------------------------------------


def test_zero_grad_after_backward_gives_torchs_zero_norm_then_torchs_numbers():
    net = model()
    fgb = FlatGradBuffers(net.named_parameters())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    backward(net, 0)
    opt.zero_grad()  # set_to_none: torch's norm is now 0; the buffers still held the gradients
    assert fgb.clip_grad_norm_(1.0).item() == 0.0
    assert all(p.grad is None for p in net.parameters())  # as torch leaves them
    assert all(buf.eq(0).all() for buf in fgb.buffers.values())
    backward(net, 1)  # a fresh gradient, not one added to the dropped one
    assert all(p.grad is fgb.view(p) for p in net.parameters())
    assert_like_torch(fgb, net)


def test_torch_numbers_over_several_steps_with_sgd():
    net = model(seed=4)
    fgb = FlatGradBuffers(net.named_parameters())
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for step in range(4):
        fgb.zero_()
        backward(net, 10 + step)
        assert_like_torch(fgb, net, max_norm=[0.1, 1e3, 1.0, math.inf][step])
        opt.step()


def test_a_report_over_many_parameters_stays_short():
    net = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(300)))
    fgb = FlatGradBuffers(net.named_parameters())
    net.double()
    with pytest.raises(GradientOutsideBufferError) as info:
        fgb.clip_grad_norm_(1.0)
    # one cause, so one line: its sentence once, four names and a count of the rest
    assert str(info.value).startswith(
        "parameter '0.weight' (and '0.bias', '1.weight', '1.bias' and 596 more) changed from "
        "torch.float32 on cpu to torch.float64 on cpu after"
    )
    assert "\n" not in str(info.value) and str(info.value).count("changed from") == 1


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_a_report_names_each_cause_once_with_its_parameters():
    # create_graph=True on a three-parameter model, and one more cause besides
    net = model()
    fgb = FlatGradBuffers(net.named_parameters())
    x = torch.randn(4, 16).to(BF16)
    (net(x).float() * net.sink).square().sum().backward(create_graph=True)
    try:
        with pytest.raises(GradientOutsideBufferError) as info:
            fgb.clip_grad_norm_(1.0)
        assert str(info.value) == (
            "the gradient of 'sink' (and '0.weight', '0.bias') has an autograd graph of its "
            "own (backward with create_graph=True, where autograd adds out of place, or a "
            ".grad assigned from a tensor that requires grad), which a copy into the flat "
            "buffer would cut: take higher-order gradients with torch.autograd.grad(..., "
            "create_graph=True) instead, or assign a detached tensor; zero_() re-binds it"
        )
        fgb.view(net.sink).data = torch.zeros(32)  # a second cause, one zero_() cannot repair
        with pytest.raises(GradientOutsideBufferError) as info:
            fgb.check_bindings()
        lines = str(info.value).splitlines()
        assert len(lines) == 2, lines
        # the cause zero_() cannot repair comes first
        assert lines[0].startswith("the storage of the gradient of parameter 'sink' was replaced")
        assert lines[1].startswith("the gradient of '0.weight' (and '0.bias') has an autograd")
        assert ".;" not in str(info.value)
    finally:
        for p in net.parameters():
            p.grad = None  # breaks the reference cycle create_graph makes


def test_a_report_over_many_causes_counts_the_rest():
    # four causes, more than a report shows: the last is counted, not dropped
    net = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(4)))
    net[3].bias.requires_grad_(False)
    fgb = FlatGradBuffers(net.named_parameters())
    net[3].bias.requires_grad_(True)  # frozen at build, now with a gradient
    net[3].bias.grad = torch.ones(2)
    net[0].double()
    net[1].half()
    net[2].weight.grad = torch.ones(2, 2, requires_grad=True)  # the one zero_() repairs
    net[2].bias.grad = torch.ones(2)  # replaced: taken in, no cause
    with pytest.raises(GradientOutsideBufferError) as info:
        fgb.check_bindings()
    lines = str(info.value).splitlines()
    assert len(lines) == 4, lines
    shown = "\n".join(lines[:3])  # the three that zero_() cannot repair, in any order
    assert "parameter '3.bias' was frozen" in shown
    assert "'0.weight' (and '0.bias') changed from torch.float32 on cpu to torch.float64" in shown
    assert "'1.weight' (and '1.bias') changed from torch.float32 on cpu to torch.float16" in shown
    assert lines[3].startswith("and 1 more parameter with another cause")  # repairable: last
    assert "2.bias" not in str(info.value)


def test_buffer_storage_freed_and_reallocated_under_the_views_stays_bound():
    # megatron-core's offload_grad_buffers / restore_grad_buffers: the same tensors, new memory
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 7)]
    fgb = FlatGradBuffers(params)
    sum((p * p).sum() for p in params).backward()
    for buf in fgb.buffers.values():
        storage = buf.untyped_storage()
        nbytes = storage.nbytes()
        storage.resize_(0)  # megatron-core's cycle: where the new block lands is the
        storage.resize_(nbytes)  # allocator's choice, maybe the old address again
        before = buf.data_ptr()
        # Growing allocates the new block while the old one is still held, so the memory
        # moves whatever the allocator does: the case the bindings must follow.
        storage.resize_(nbytes + buf.element_size())
        assert buf.data_ptr() != before
    fgb.zero_()
    sum((p * p * p).sum() for p in params).backward()
    want = torch.nn.utils.get_total_norm([p.grad.double() for p in params])
    assert float(fgb.grad_norm()) == pytest.approx(float(want), rel=1e-6)


def test_a_gradient_whose_data_is_reassigned_is_found():
    # `.grad.data = ...` (e.g. module.to(memory_format=...)) moves the bound view itself
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 7)]
    fgb = FlatGradBuffers(params)
    sum((p * p).sum() for p in params).backward()
    params[0].grad.data = torch.zeros(5)
    with pytest.raises(
        GradientOutsideBufferError,
        match=r"storage of the gradient of parameter 'params\[0\]' was replaced",
    ):
        fgb.grad_norm()


def test_a_gradient_whose_data_is_reassigned_is_found_by_the_next_backward():
    # not the parameter every call samples: its hook sees it
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 7)]
    fgb = FlatGradBuffers(params)
    sum((p * p).sum() for p in params).backward()
    params[1].grad.data = torch.zeros(7)
    sum((p * p).sum() for p in params).backward()
    with pytest.raises(
        GradientOutsideBufferError,
        match=r"storage of the gradient of parameter 'params\[1\]' was replaced",
    ):
        fgb.grad_norm()


# --- gradients dropped or replaced after backward: torch's norm and clip ---------------------

EDITS = {
    "set_to_none": lambda p: setattr(p, "grad", None),  # "don't update it this step"
    "scaled": lambda p: setattr(p, "grad", p.grad * 0.1),  # a new tensor, not the view
}
# '0.bias' is the second parameter of the bf16 buffer, 'sink' the first of the fp32 one
EDITED = {"bias": ["0.bias"], "sink": ["sink"], "all": ["0.weight", "0.bias", "sink"]}


def edit(net, how, names):
    params = dict(net.named_parameters())
    for name in names:
        EDITS[how](params[name])


def assert_norm_and_clip_like_torch(fgb, net, max_norm, call="clip_grad_norm_"):
    """The norm and clip torch.nn.utils gives over the gradients the parameters hold now
    (fp64 copies), and a dropped gradient stays None."""
    held = [p for p in net.parameters() if p.grad is not None]
    dropped = [p for p in net.parameters() if p.grad is None]
    twins = [torch.nn.Parameter(p.detach().double()) for p in held]
    for t, p in zip(twins, held, strict=True):
        t.grad = p.grad.double()
    want = torch.nn.utils.get_total_norm([t.grad for t in twins]).item()
    if call == "grad_norm":
        assert fgb.grad_norm().item() == pytest.approx(want, rel=1e-5)
        assert fgb.grad_norm(per_param=True).total.item() == pytest.approx(want, rel=1e-5)
        return
    torch.nn.utils.clip_grad_norm_(twins, max_norm)
    got = fgb.clip_grad_norm_(max_norm)
    assert got.item() == pytest.approx(want, rel=1e-5)
    for p, t in zip(held, twins, strict=True):
        torch.testing.assert_close(p.grad.double(), t.grad, rtol=TOL[p.dtype], atol=1e-30)
    assert all(p.grad is None for p in dropped)


@pytest.mark.parametrize("call", ["clip_grad_norm_", "grad_norm"])
@pytest.mark.parametrize("which", EDITED)
@pytest.mark.parametrize("how", EDITS)
def test_gradients_dropped_or_replaced_after_backward_give_torchs_norm(how, which, call):
    net = model(seed=5)
    fgb = FlatGradBuffers(net.named_parameters())
    for step in range(3):
        fgb.zero_()
        backward(net, 20 + step)
        edit(net, how, EDITED[which])
        assert_norm_and_clip_like_torch(fgb, net, max_norm=0.5, call=call)


@pytest.mark.parametrize("step", ["clip_grad_norm_", "clipped_step"])
@pytest.mark.parametrize("how", EDITS)
def test_a_loop_that_drops_or_replaces_gradients_trains_as_torchs(how, step):
    # fp64 throughout, so torch's clip and ours agree to rounding: the parameters after
    # ten clipped SGD steps with momentum, beside torch's own loop
    torch.manual_seed(6)
    ours = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
    ).double()
    ref = copy.deepcopy(ours)
    fgb = FlatGradBuffers(ours.named_parameters())
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, ref))
    gen = torch.Generator().manual_seed(7)
    for _ in range(10):
        x = torch.randn(16, 8, generator=gen, dtype=torch.float64)
        fgb.zero_()
        ref_opt.zero_grad()
        for m in (ours, ref):
            m(x).square().mean().backward()
            for p in m[2].parameters():  # not the first parameter of the buffer
                EDITS[how](p)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        if step == "clipped_step":
            norm = fgb.clipped_step(opt, 0.05)
        else:
            norm = fgb.clip_grad_norm_(0.05)
            opt.step()
        assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-12)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.parametrize("how", EDITS)
def test_gradients_dropped_or_replaced_between_micro_batches_accumulate_as_torchs(how):
    # torch starts a new tensor after None, and accumulates into a replaced one; so do we
    torch.manual_seed(8)
    ours = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).double()
    ref = copy.deepcopy(ours)
    fgb = FlatGradBuffers(ours.named_parameters())
    fgb.zero_()
    gen = torch.Generator().manual_seed(9)
    for micro in range(3):
        x = torch.randn(4, 8, generator=gen, dtype=torch.float64)
        for m in (ours, ref):
            m(x).square().sum().backward()
            if micro < 2:
                EDITS[how](m[1].weight)
    assert fgb.grad_norm().item() == pytest.approx(
        torch.nn.utils.get_total_norm([q.grad for q in ref.parameters()]).item(), rel=1e-12
    )
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        assert p.grad is fgb.view(p)
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0)


def test_a_gradient_kept_by_reference_after_none_is_intact_until_the_next_call():
    # gradient surgery without clone(): keep the first loss's gradient, set .grad to None,
    # take the second loss's, combine them; the view is reused only at the next call
    torch.manual_seed(10)
    ours = torch.nn.Linear(8, 4).double()
    ref = copy.deepcopy(ours)
    fgb = FlatGradBuffers(ours.named_parameters())
    fgb.zero_()
    x = torch.randn(5, 8, dtype=torch.float64)
    for m in (ours, ref):
        m(x).sum().backward()
        first = [p.grad for p in m.parameters()]
        for p in m.parameters():
            p.grad = None
        m(x).square().sum().backward()
        for p, g in zip(m.parameters(), first, strict=True):
            p.grad = g - 0.5 * p.grad
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    assert fgb.clip_grad_norm_(0.1).item() == pytest.approx(want.item(), rel=1e-12)
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0)


def test_count_zeros_after_a_gradient_is_replaced_counts_the_new_one():
    net = model(seed=11)
    fgb = FlatGradBuffers(net.named_parameters())
    fgb.zero_()
    backward(net, 12)
    grad = net[0].bias.grad.clone()
    grad[:5] = 0
    net[0].bias.grad = grad
    want = sum(int((p.grad == 0).sum()) for p in net.parameters())
    assert want >= 5
    assert fgb.count_zeros().item() == want
