"""Multi-process norm/clip on gloo with asymmetric ownership, spawned from pytest."""

import math
import os

import pytest
import torch
import torch.distributed as dist

from buffers import FlatGradBuffers
from tests.support.spawn import spawn

BF16, FP32 = torch.bfloat16, torch.float32

# Per world size, each rank's inventory: a rank with no fp32, a rank with nothing at all.
INVENTORIES = {
    2: [[(300, BF16), (65, FP32)], [(129, BF16)]],
    3: [[(300, BF16), (65, FP32), (3, FP32)], [], [(1000, BF16), (7, BF16)]],
}


def rank_grads(world: int, rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * world + rank)
    return [torch.randn(n, generator=gen).to(dt) for n, dt in INVENTORIES[world][rank]]


def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    grads = rank_grads(world, rank)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    fgb = FlatGradBuffers(params)
    for p, g in zip(params, grads, strict=True):
        fgb.view(p).copy_(g)
    out = {
        "l2": fgb.grad_norm(2.0, group=dist.group.WORLD),
        "inf": fgb.grad_norm(math.inf, group=dist.group.WORLD),
        "l1": fgb.grad_norm(1.0, group=dist.group.WORLD),
        "zeros": fgb.count_zeros(group=dist.group.WORLD),
    }
    max_norm = 0.5
    out["clip_pre"] = fgb.clip_grad_norm_(max_norm, group=dist.group.WORLD)
    out["clipped"] = [fgb.view(p).clone() for p in params]
    out["post"] = fgb.grad_norm(2.0, group=dist.group.WORLD)
    # NaN on one rank only must reach every rank, for the sum and for the max.
    if rank == world - 1 and params:
        fgb.view(params[0])[0] = math.nan
    out["nan_l2"] = fgb.grad_norm(2.0, group=dist.group.WORLD)
    out["nan_inf"] = fgb.grad_norm(math.inf, group=dist.group.WORLD)
    torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_asymmetric_ranks_agree_with_reference(tmp_path, world):
    spawn(worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world)
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    all_grads = [g.double() for r in range(world) for g in rank_grads(world, r)]
    flat = torch.cat(all_grads)
    ref = {p: torch.linalg.vector_norm(flat, p).item() for p in (2.0, 1.0, math.inf)}
    coeff = 0.5 / (ref[2.0] + 1e-6)
    for r, res in enumerate(results):
        assert res["l2"].item() == pytest.approx(ref[2.0], rel=1e-5)
        assert res["l1"].item() == pytest.approx(ref[1.0], rel=1e-5)
        assert res["inf"].item() == pytest.approx(ref[math.inf], rel=1e-6)
        assert res["zeros"].item() == int((flat == 0).sum())
        assert res["clip_pre"].item() == pytest.approx(ref[2.0], rel=1e-5)
        assert res["post"].item() == pytest.approx(0.5, rel=1e-2)
        for got, g in zip(res["clipped"], rank_grads(world, r), strict=True):
            tol = 2**-7 if g.dtype == BF16 else 1e-6
            torch.testing.assert_close(got.double(), g.double() * coeff, rtol=tol, atol=0)
        assert math.isnan(res["nan_l2"].item())
        assert math.isnan(res["nan_inf"].item())
    # identical bits on every rank
    for res in results[1:]:
        assert torch.equal(res["l2"], results[0]["l2"])
