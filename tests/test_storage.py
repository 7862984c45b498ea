import math

import pytest
import torch

from buffers import FlatGradBuffers, GradientOutsideBufferError

BF16, FP32 = torch.bfloat16, torch.float32


def params_of(specs, device, requires_grad=True):
    return [
        torch.nn.Parameter(torch.zeros(n, dtype=dt, device=device), requires_grad=requires_grad)
        for n, dt in specs
    ]


def fill_grads(fgb, params, gen):
    """Random gradients written through the views (as backward would), fp64 copies returned."""
    ref = []
    for p in params:
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        fgb.view(p).copy_(g)
        ref.append(fgb.view(p).double().cpu())
    return ref


def ref_norm(grads, p=2.0):
    flat = torch.cat([g.flatten() for g in grads])
    return torch.linalg.vector_norm(flat, p).item()


def padding_is_zero(fgb):
    for dt, b in fgb.plan.buffers.items():
        mask = torch.ones(b.numel, dtype=torch.bool)
        for s in b.slots:
            mask[s.offset : s.offset + s.numel] = False
        if fgb.buffers[dt].cpu()[mask].ne(0).any():
            return False
    return True


@pytest.mark.parametrize("order", [(BF16, FP32), (FP32, BF16)])
def test_seed_regression_mixed_bf16_fp32_gives_exactly_quarter(device, order):
    params = params_of([(128, order[0]), (128, order[1])], device)
    fgb = FlatGradBuffers(params)
    for p in params:
        fgb.view(p).fill_(1 / 64)
    norm = fgb.grad_norm()
    assert norm.dtype == FP32 and norm.dim() == 0 and norm.device.type == device.type
    assert norm.item() == 0.25  # sqrt(256 / 64**2), exact in binary


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_homogeneous_controls(device, dtype):
    params = params_of([(128, dtype), (128, dtype)], device)
    fgb = FlatGradBuffers(params)
    for p in params:
        fgb.view(p).fill_(1 / 64)
    assert fgb.grad_norm().item() == 0.25
    assert list(fgb.buffers) == [dtype]


LENGTHS = [1, 3, 63, 65, 127, 129, 1000]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
def test_unaligned_lengths_against_fp64(device, norm_type):
    gen = torch.Generator().manual_seed(1)
    specs = [(n, BF16 if i % 2 else FP32) for i, n in enumerate(LENGTHS)]
    params = params_of(specs, device)
    fgb = FlatGradBuffers(params)
    ref = fill_grads(fgb, params, gen)
    got = fgb.grad_norm(norm_type).item()
    assert got == pytest.approx(ref_norm(ref, norm_type), rel=1e-5)


def test_backward_accumulates_into_views_and_padding_stays_zero(device):
    torch.manual_seed(0)
    lin = torch.nn.Linear(65, 3, dtype=BF16, device=device)
    extra = torch.nn.Parameter(torch.randn(63, device=device))
    fgb = FlatGradBuffers([*lin.parameters(), extra])
    x = torch.randn(4, 65, dtype=BF16, device=device)
    for _ in range(2):  # two backwards accumulate
        (lin(x).float().sum() + (extra * 2).sum()).backward()
    for p in [*lin.parameters(), extra]:
        assert p.grad.data_ptr() == fgb.view(p).data_ptr()
    torch.testing.assert_close(extra.grad, torch.full_like(extra, 4.0))
    torch.testing.assert_close(lin.bias.grad.float(), torch.full((3,), 8.0, device=device))
    assert padding_is_zero(fgb)
    fgb.clip_grad_norm_(0.1)
    assert padding_is_zero(fgb)


def test_zero_clears_canaries_in_padding(device):
    params = params_of([(3, BF16), (5, FP32)], device)
    fgb = FlatGradBuffers(params, align=64)
    for buf in fgb.buffers.values():
        buf.fill_(7.0)
    assert not padding_is_zero(fgb)
    fgb.zero_()
    assert all(buf.eq(0).all() for buf in fgb.buffers.values())


def test_clip_active_scales_by_torch_convention(device):
    gen = torch.Generator().manual_seed(2)
    params = params_of([(300, BF16), (70, FP32), (129, BF16)], device)
    fgb = FlatGradBuffers(params)
    ref = fill_grads(fgb, params, gen)
    n = ref_norm(ref)
    max_norm = n / 4
    got = fgb.clip_grad_norm_(max_norm)
    assert got.item() == pytest.approx(n, rel=1e-5)
    coeff = max_norm / (n + 1e-6)
    for p, g in zip(params, ref, strict=True):
        want = g * coeff
        # bf16 results: the coefficient and the product are each rounded to bf16.
        tol = 2**-7 if p.dtype == BF16 else 1e-6
        torch.testing.assert_close(fgb.view(p).double().cpu(), want, rtol=tol, atol=0)
    assert fgb.grad_norm().item() == pytest.approx(max_norm, rel=1e-2)


def test_clip_inactive_is_bit_for_bit(device):
    gen = torch.Generator().manual_seed(3)
    params = params_of([(100, BF16), (37, FP32)], device)
    fgb = FlatGradBuffers(params)
    fill_grads(fgb, params, gen)
    before = {dt: b.clone() for dt, b in fgb.buffers.items()}
    norm = fgb.clip_grad_norm_(1e6)
    assert norm.item() > 0
    for dt, b in fgb.buffers.items():
        assert torch.equal(b.view(torch.uint8 if b.element_size() == 1 else b.dtype), before[dt])
        assert torch.equal(b, before[dt])


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_nonfinite_propagates_and_can_raise(device, bad, norm_type):
    params = params_of([(10, BF16), (10, FP32)], device)
    fgb = FlatGradBuffers(params)
    fgb.view(params[0]).fill_(0.5)
    fgb.view(params[1])[3] = bad
    norm = fgb.grad_norm(norm_type).item()
    assert math.isnan(norm) if math.isnan(bad) else norm == math.inf
    with pytest.raises(RuntimeError, match="non-finite"):
        fgb.clip_grad_norm_(1.0, norm_type, error_if_nonfinite=True)
    fgb.clip_grad_norm_(1.0, norm_type)
    assert not torch.isfinite(fgb.view(params[1])).all()


def test_repeat_gives_identical_bits(device):
    gen = torch.Generator().manual_seed(4)
    params = params_of([(5000, BF16), (999, FP32)], device)
    fgb = FlatGradBuffers(params)
    fill_grads(fgb, params, gen)
    snap = {dt: b.clone() for dt, b in fgb.buffers.items()}
    results = []
    for _ in range(3):
        for dt, b in fgb.buffers.items():
            b.copy_(snap[dt])
        norm = fgb.clip_grad_norm_(1.0)
        results.append((norm.clone(), {dt: b.clone() for dt, b in fgb.buffers.items()}))
    for norm, bufs in results[1:]:
        assert torch.equal(norm, results[0][0])
        assert all(torch.equal(bufs[dt], results[0][1][dt]) for dt in bufs)


def test_count_zeros_excludes_padding(device):
    params = params_of([(3, BF16), (65, BF16), (10, FP32)], device)
    fgb = FlatGradBuffers(params)
    gen = torch.Generator().manual_seed(5)
    fill_grads(fgb, params, gen)
    fgb.view(params[1])[:7] = 0
    fgb.view(params[2])[2] = 0
    assert fgb.count_zeros().item() == 8


def test_counted_subset_norm_and_full_clip(device):
    params = params_of([(16, FP32), (16, FP32)], device)
    fgb = FlatGradBuffers(params, counted=lambda p: p is params[0])
    fgb.view(params[0]).fill_(1.0)
    fgb.view(params[1]).fill_(2.0)
    assert fgb.grad_norm().item() == 4.0
    fgb.clip_grad_norm_(2.0)
    # the uncounted gradient is scaled by the same coefficient (Megatron clips duplicates too)
    assert fgb.view(params[1]).mean().item() == pytest.approx(1.0, rel=1e-5)


def test_frozen_skipped_existing_grad_kept(device):
    a, b = params_of([(4, FP32), (4, FP32)], device)
    frozen = torch.nn.Parameter(torch.zeros(4, device=device), requires_grad=False)
    a.grad = torch.full_like(a, 3.0)
    fgb = FlatGradBuffers([a, frozen, b])
    assert a.grad.data_ptr() == fgb.view(a).data_ptr()
    assert fgb.grad_norm().item() == 6.0
    with pytest.raises(KeyError, match="no gradient view"):
        fgb.view(frozen)


def test_duplicates_laid_out_once_under_first_name(device):
    (a,) = params_of([(4, FP32)], device)
    fgb = FlatGradBuffers([("first", a), ("second", a)])
    assert [s.name for s in fgb.plan.buffers[FP32].slots] == ["first"]
    fgb.view(a).fill_(1.0)
    assert fgb.grad_norm().item() == 2.0  # counted once, not twice


def test_empty_gives_zero_norm():
    fgb = FlatGradBuffers([])
    assert fgb.grad_norm().item() == 0.0
    assert fgb.clip_grad_norm_(1.0).item() == 0.0
    assert fgb.count_zeros().item() == 0
    assert fgb.nbytes == 0


def test_bad_inputs_name_the_parameter():
    ok = torch.nn.Parameter(torch.zeros(2))
    # integer tensors cannot require grad; complex ones can, and have no flat buffer
    cplx = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(TypeError, match="'rot'.*dtype torch.complex64.*accepted dtypes"):
        FlatGradBuffers([("ok", ok), ("rot", cplx)])
    with pytest.raises(TypeError, match="params\\[1\\].*float8_e4m3fn.*accepted dtypes"):
        FlatGradBuffers([ok, torch.nn.Parameter(torch.zeros(2).to(torch.float8_e4m3fn))])
    with pytest.raises(TypeError, match="params\\[0\\] is a str"):
        FlatGradBuffers(["w"])
    with pytest.raises(ValueError, match="norm_type"):  # torch's p < 0 is accepted; NaN is not
        FlatGradBuffers([]).grad_norm(math.nan)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_different_devices_rejected():
    a = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(2, device="cuda"))
    with pytest.raises(ValueError, match="different devices.*'params\\[0\\]' on cpu"):
        FlatGradBuffers([a, b])


def test_device_argument_must_match_parameters():
    with pytest.raises(ValueError, match="device=meta"):
        FlatGradBuffers([torch.nn.Parameter(torch.zeros(2))], device="meta")


@pytest.mark.parametrize("how", ["set_to_none", "reassigned"])
def test_gradient_set_to_none_or_replaced_before_backward_counts_as_in_torch(device, how):
    # torch accumulates the next backward into a new tensor (set_to_none) or into the one
    # assigned; the next call takes it into the view, which .grad is again
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 2, device=device)
    fgb = FlatGradBuffers(lin.named_parameters())
    x = torch.randn(3, 8, device=device)
    lin(x).sum().backward()  # a gradient in the views, to be dropped or replaced
    if how == "set_to_none":
        torch.optim.SGD(lin.parameters(), lr=0.1).zero_grad(set_to_none=True)
    else:
        lin.weight.grad = torch.randn(2, 8, device=device)
    lin(x).square().sum().backward()
    want = torch.cat([lin.weight.grad.flatten(), lin.bias.grad]).double().norm().item()
    assert fgb.grad_norm().item() == pytest.approx(want, rel=1e-6)
    for p in lin.parameters():
        assert p.grad is fgb.view(p)
    assert padding_is_zero(fgb)


def test_check_bindings_takes_in_gradients_set_to_none_or_replaced_without_backward():
    a, b = (torch.nn.Parameter(torch.zeros(4)) for _ in range(2))
    fgb = FlatGradBuffers([("a", a), ("b", b)])
    fgb.check_bindings()
    fgb.view(a).normal_()
    a.grad = None
    new = torch.randn(4)
    b.grad = new
    fgb.check_bindings()
    assert a.grad is None and fgb.view(a).eq(0).all()  # as torch: not counted, not clipped
    assert b.grad is fgb.view(b) and torch.equal(b.grad, new)
    b.grad = torch.ones(4, requires_grad=True)  # a copy would cut its graph
    with pytest.raises(GradientOutsideBufferError, match="'b' has an autograd graph"):
        fgb.check_bindings()


def test_frozen_after_construction_contributes_zero_after_zero(device):
    a, b = params_of([(8, FP32), (8, BF16)], device)
    a.data.normal_()
    b.data.normal_()
    fgb = FlatGradBuffers([a, b])
    (a.sum() + b.float().sum()).backward()
    assert fgb.grad_norm().item() == pytest.approx(4.0)
    b.requires_grad_(False)
    fgb.zero_()
    a.sum().backward()  # b gets no gradient now; its view stays zero
    assert fgb.grad_norm().item() == pytest.approx(math.sqrt(8))
    assert fgb.view(b).eq(0).all()
