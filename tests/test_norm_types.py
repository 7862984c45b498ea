"""torch's norm_type values beyond p > 0 (0, -inf, p < 0) against torch on fp64 copies,
through FlatGradBuffers, the list functions and a gloo process group; argument errors."""

import math
import os

import pytest
import torch
import torch.distributed as dist

from buffers import FlatGradBuffers, lists, ops
from tests.support.spawn import spawn

BF16, FP32 = torch.bfloat16, torch.float32
NEG = [0.0, 0, -math.inf, "-inf", -1.0, -0.5, -2.5]  # as a user may pass them
# Lengths that leave alignment padding (zeros) between parameters in the buffers.
SHAPES = [(37, BF16), ((5, 7), FP32), (129, BF16), (3, FP32), (64, BF16), (11, BF16)]


def make_grads(seed: int, all_zero: tuple[int, ...] = (3,)) -> list[torch.Tensor]:
    """Random gradients with no zero element, but the tensors in ``all_zero`` all zeros
    and one zero in tensor 1 (0-norm: tensors with a nonzero; -inf: smallest |x|)."""
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for i, (shape, dtype) in enumerate(SHAPES):
        g = torch.randn(shape, generator=gen) * 3 + 0.01  # fp32 values bf16 rounds
        g = torch.where(g.abs() < 1e-3, torch.full_like(g, 0.3), g).to(dtype)
        grads.append(torch.zeros_like(g) if i in all_zero else g)
    return grads


def build(grads):
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    fgb = FlatGradBuffers(params, align=64)
    for p, g in zip(params, grads, strict=True):
        p.grad.copy_(g)
    return params, fgb


def torch_norm(grads, norm_type) -> float:
    return torch.nn.utils.get_total_norm([g.double() for g in grads], norm_type).item()


def same(got: torch.Tensor, want: float) -> None:
    assert got.item() == pytest.approx(want, rel=1e-6, abs=0)


@pytest.mark.parametrize("norm_type", NEG)
@pytest.mark.parametrize("all_zero", [(3,), ()])
def test_flat_and_list_norms_match_torch(norm_type, all_zero):
    grads = make_grads(1, all_zero)
    want = torch_norm(grads, float(norm_type))
    _, fgb = build(grads)
    same(fgb.grad_norm(norm_type), want)
    same(lists.total_norm(grads, norm_type), want)


def test_minus_inf_is_not_the_padding_and_zero_counts_tensors():
    grads = make_grads(2, all_zero=())
    smallest = min(g.double().abs().min().item() for g in grads)
    assert smallest > 0  # the padding between parameters is zero; the gradients are not
    _, fgb = build(grads)
    assert sum(b.numel() for b in fgb.buffers.values()) > sum(g.numel() for g in grads)
    same(fgb.grad_norm(-math.inf), smallest)
    assert fgb.grad_norm(0).item() == len(grads)  # torch's: the 0-norm of the norms
    grads[1].view(-1)[4] = 0.0
    grads[5].zero_()
    _, fgb = build(grads)
    assert fgb.grad_norm(-math.inf).item() == 0.0
    assert fgb.grad_norm(0).item() == len(grads) - 1


@pytest.mark.parametrize("norm_type", [0.0, -math.inf, -1.0])
def test_clip_scales_as_torch(norm_type):
    grads = make_grads(3)
    params, fgb = build(grads)
    ref = [torch.nn.Parameter(torch.zeros_like(g, dtype=torch.float64)) for g in grads]
    for q, g in zip(ref, grads, strict=True):
        q.grad = g.double()
    max_norm = 0.5 * torch_norm(grads, norm_type) if norm_type != 0 else 2.0
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type, foreach=True)
    got = fgb.clip_grad_norm_(max_norm, norm_type)
    same(got, want.item())
    for p, q in zip(params, ref, strict=True):
        tol = 2**-8 if p.dtype == BF16 else 1e-6
        torch.testing.assert_close(p.grad.double(), q.grad, rtol=tol, atol=0)
    assert any(
        not torch.equal(p.grad.double(), g.double()) for p, g in zip(params, grads, strict=True)
    )


def test_lists_scale_after_a_minus_inf_norm_as_torch():
    grads = make_grads(4)
    ref = [torch.nn.Parameter(torch.zeros_like(g, dtype=torch.float64)) for g in grads]
    for q, g in zip(ref, grads, strict=True):
        q.grad = g.double()
    total = lists.total_norm(grads, -math.inf)
    lists.scale_(grads, ops.clip_coefficient(total, 0.01))
    torch.nn.utils.clip_grad_norm_(ref, 0.01, -math.inf)
    for g, q in zip(grads, ref, strict=True):
        tol = 2**-8 if g.dtype == BF16 else 1e-6
        torch.testing.assert_close(g.double(), q.grad, rtol=tol, atol=0)


def test_nan_as_torch_nan_for_minus_inf_a_nonzero_for_zero():
    grads = make_grads(5)
    grads[2][7] = math.nan
    _, fgb = build(grads)
    for norm_type in (-math.inf, -1.0, 0.0):
        want = torch_norm(grads, norm_type)
        got = fgb.grad_norm(norm_type).item()
        assert math.isnan(got) == math.isnan(want), norm_type
        if not math.isnan(want):
            assert got == want
    with pytest.raises(RuntimeError, match="non-finite"):
        fgb.grad_norm(-math.inf, error_if_nonfinite=True)


def test_empty_list_is_zero_as_torch():
    for norm_type in (0.0, -math.inf, -1.0):
        assert lists.total_norm([], norm_type).item() == torch_norm([], norm_type) == 0.0


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda f: f.grad_norm("abc"), TypeError, "norm_type must be a number"),
        (lambda f: f.grad_norm(math.nan), ValueError, "norm_type must be a number"),
        (lambda f: f.clip_grad_norm_("abc"), TypeError, "max_norm must be a number"),
        (lambda f: f.clip_grad_norm_([1.0, 2.0]), TypeError, "max_norm must be a number"),
        (lambda f: f.clip_grad_norm_(1.0, "l2"), TypeError, "norm_type must be a number"),
        (lambda f: f.grad_norm(0, per_param=True), ValueError, "per_param=True takes"),
        (lambda f: lists.total_norm([], "abc"), TypeError, "norm_type must be a number"),
        (lambda f: ops.check_norm_type(0), ValueError, "positive number or inf"),
    ],
)
def test_bad_arguments_name_themselves(call, exc, match):
    _, fgb = build(make_grads(6))
    with pytest.raises(exc, match=match):
        call(fgb)


# --- across ranks: 0's counts add up, -inf is the smallest of the ranks' (NaN carried) ---

RANK_SEEDS = {0: 11, 1: 12}


def rank_grads(rank: int) -> list[torch.Tensor]:
    return make_grads(RANK_SEEDS[rank], all_zero=(3,) if rank == 0 else (0, 4))


def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    grads = rank_grads(rank)
    params, fgb = build(grads)
    out = {str(p): fgb.grad_norm(p, group=dist.group.WORLD) for p in (0.0, -math.inf, -1.0)}
    out["list_minf"] = lists.total_norm(grads, -math.inf, group=dist.group.WORLD)
    out["clip_minf"] = fgb.clip_grad_norm_(1e-3, -math.inf, group=dist.group.WORLD)
    out["clipped"] = [p.grad.clone() for p in params]
    if rank == 1:
        params[2].grad.view(-1)[1] = math.nan
    out["nan_minf"] = fgb.grad_norm(-math.inf, group=dist.group.WORLD)
    torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def test_two_ranks_reduce_counts_and_minimum(tmp_path):
    spawn(worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    every = rank_grads(0) + rank_grads(1)
    minf = torch_norm(every, -math.inf)
    for r, res in enumerate(results):
        for p in (0.0, -math.inf, -1.0):
            same(res[str(p)], torch_norm(every, p))
        same(res["list_minf"], minf)
        same(res["clip_minf"], minf)
        coeff = min(1e-3 / (minf + 1e-6), 1.0)
        for got, g in zip(res["clipped"], rank_grads(r), strict=True):
            tol = 2**-8 if g.dtype == BF16 else 1e-6
            torch.testing.assert_close(got.double(), g.double() * coeff, rtol=tol, atol=0)
        assert math.isnan(res["nan_minf"].item())
