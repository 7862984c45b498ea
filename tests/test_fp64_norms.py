"""fp64 gradients at magnitudes fp32 cannot hold: norms and clips against torch and fp64."""

import math
import os

import pytest
import torch
import torch.distributed as dist

from buffers import FlatGradBuffers, total_norm
from tests.support.spawn import spawn

# Squares of 1e19 overflow fp32, of 1e-25 underflow it; 1e100 / 1e-100 need fp64 for the norm.
SCALES = [1e19, 1e100, 1e-25, 1e-100, 1.0]


def fp64_params(scale: float, seed: int, shapes=((300,), (17, 5), (1,))):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in shapes]
    grads = [torch.randn(s, generator=gen, dtype=torch.float64) * scale for s in shapes]
    return params, grads


def build(params, grads, extra=()):
    fgb = FlatGradBuffers([*params, *extra])
    for p, g in zip(params, grads, strict=True):
        fgb.view(p).copy_(g)
    return fgb


def fp64_norm(grads) -> float:
    return torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])).item()


@pytest.mark.parametrize("scale", SCALES)
def test_grad_norm_of_fp64_buffers_is_fp64_and_exact(scale):
    params, grads = fp64_params(scale, seed=1)
    fgb = build(params, grads)
    norm = fgb.grad_norm()
    assert norm.dtype == torch.float64
    assert norm.item() == pytest.approx(fp64_norm(grads), rel=1e-12)
    assert norm.item() == pytest.approx(torch.nn.utils.get_total_norm(grads).item(), rel=1e-12)
    for p in (1.0, math.inf):
        want = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]), p).item()
        assert fgb.grad_norm(p).item() == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("max_norm", [1.0, 1e-3])
def test_clip_of_fp64_buffers_matches_torch(scale, max_norm):
    params, grads = fp64_params(scale, seed=2)
    fgb = build(params, grads)
    torch_params = [torch.nn.Parameter(torch.zeros_like(p)) for p in params]
    for q, g in zip(torch_params, grads, strict=True):
        q.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(torch_params, max_norm)
    got = fgb.clip_grad_norm_(max_norm)
    assert got.dtype == torch.float64
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    # max_norm is held in an fp32 tensor (so a captured CUDA graph serves any value): the
    # coefficient is max_norm rounded to fp32 over the fp64 norm, within 6e-8 of torch's.
    for p, q in zip(params, torch_params, strict=True):
        torch.testing.assert_close(fgb.view(p), q.grad, rtol=1e-7, atol=0)


def test_fp64_beside_bf16_buffers():
    params, grads = fp64_params(1e100, seed=3)
    gen = torch.Generator().manual_seed(4)
    bf = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
    bf_grad = torch.randn(64, generator=gen).bfloat16()
    fgb = build(params, grads, extra=[bf])
    fgb.view(bf).copy_(bf_grad)
    norm = fgb.clip_grad_norm_(1.0)
    assert norm.dtype == torch.float64
    assert norm.item() == pytest.approx(fp64_norm([*grads, bf_grad.double()]), rel=1e-12)
    coeff = 1.0 / (norm.item() + 1e-6)
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(fgb.view(p), g * coeff, rtol=1e-12, atol=0)
    assert torch.equal(fgb.view(bf), torch.zeros_like(bf_grad))  # 1e-101 * O(1) is 0 in bf16


@pytest.mark.parametrize("scale", SCALES)
def test_total_norm_of_fp64_list(scale):
    _, grads = fp64_params(scale, seed=5)
    mixed = [*grads, torch.ones(3, dtype=torch.float32)]
    want = fp64_norm([*grads, torch.ones(3, dtype=torch.float64)])
    assert total_norm(mixed).item() == pytest.approx(want, rel=1e-12)


def two_rank_worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    # fp64 gradients on rank 0; rank 1 owns nothing, so its stat is an fp32 zero.
    params, grads = fp64_params(1e-25, seed=6) if rank == 0 else ([], [])
    fgb = build(params, grads)
    out = {"l2": fgb.grad_norm(group=dist.group.WORLD)}
    out["inf"] = fgb.grad_norm(math.inf, group=dist.group.WORLD)
    torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def test_ranks_with_and_without_fp64_reduce_together(tmp_path):
    """The all-reduce has one dtype on every rank (fp32 on one, fp64 on another aborts gloo)."""
    spawn(two_rank_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    res = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    flat = torch.cat([g.reshape(-1) for g in fp64_params(1e-25, seed=6)[1]])
    want = {p: torch.linalg.vector_norm(flat, p).item() for p in (2.0, math.inf)}
    # Each rank's result has its own stat's dtype: fp64 where it holds fp64 gradients.
    assert res[0]["l2"].dtype == torch.float64 and res[1]["l2"].dtype == torch.float32
    assert res[0]["l2"].item() == pytest.approx(want[2.0], rel=1e-12)
    assert res[0]["inf"].item() == pytest.approx(want[math.inf], rel=1e-12)
    assert res[1]["l2"].item() == pytest.approx(want[2.0], rel=1e-6)
    assert res[1]["inf"].item() == pytest.approx(want[math.inf], rel=1e-6)


@pytest.fixture
def one_rank_gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("how", ["error_if_nonfinite", "group"])
def test_clip_given_or_reduced_norm_keeps_fp64(request, how):
    params, grads = fp64_params(1e100, seed=7)
    fgb = build(params, grads)
    kwargs = {"error_if_nonfinite": True}
    if how == "group":
        kwargs = {"group": request.getfixturevalue("one_rank_gloo")}
    norm = fgb.clip_grad_norm_(1.0, **kwargs)
    assert norm.item() == pytest.approx(fp64_norm(grads), rel=1e-12)
    coeff = 1.0 / (fp64_norm(grads) + 1e-6)
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(fgb.view(p), g * coeff, rtol=1e-7, atol=0)
