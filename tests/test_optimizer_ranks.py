"""The flat optimizers' collectives on real gloo groups: 2 ranks spawned from pytest.

Each rank builds a dense and an expert child (megatron-core's classes made on the CPU by
tests/support/optimizers.py) with different gradients. The dense child reduces over the
world, the expert child over a group of this rank alone: stock megatron-core's layout of a
non-distributed dense + expert chain. Oracles: fp64 over both ranks' raw gradients.
"""

import math
import os

import pytest
import torch
import torch.distributed as dist

from tests.support.optimizers import FP32, Spec
from tests.support.spawn import spawn

pytestmark = pytest.mark.mcore

DENSE = [Spec("w_split", 300, tp=True), Spec("w_repl", 130), Spec("sink", 40, FP32)]
EXPERT = [Spec("e_split", 200, tp=True, expert=True), Spec("e_repl", 90, expert=True)]


def worker(rank: int, init_file: str, out_dir: str) -> None:
    from megatron_ext import enable_flat_norm
    from megatron_ext.install import get_grad_norm_fp32
    from tests.support.optimizers import (
        Chunk,
        RankGroup,
        chain,
        config,
        float16_child,
        make_buffer,
        make_params,
    )

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    alone = [dist.new_group([0]), dist.new_group([1])][rank]
    gen = torch.Generator().manual_seed(100 + rank)
    named, bufs, children, raw = {}, [], [], {}
    for specs, group in ((DENSE, dist.group.WORLD), (EXPERT, alone)):
        params = make_params(specs, gen)
        by_dtype = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        bufs += [make_buffer(ps, gen) for ps in by_dtype.values()]
        for s, p in zip(specs, params, strict=True):
            named[s.name] = p
            raw[s.name] = p.main_grad.double().clone()
        children.append(float16_child(params, config(), group, RankGroup(1), RankGroup(1)))
    opt = chain(children)
    enable_flat_norm(opt, [Chunk(named, bufs)])
    out = {
        "raw": raw,
        "norm": opt.get_grad_norm(),
        "zeros": opt.count_zeros(),
        "expert_zeros": children[1].count_zeros(),
        "expert_norm": children[1].get_grad_norm(),
        "per_param": dict(opt.per_param_grad_norms().as_dict()),
        "installed_world": get_grad_norm_fp32([named["w_split"].main_grad]),
        "installed_alone": get_grad_norm_fp32(
            [named["w_split"].main_grad], grad_stats_parallel_group=alone
        ),
    }
    torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def test_each_child_reduces_over_its_own_gloo_group(tmp_path):
    spawn(worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    res = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    # every parameter counts (TP size 1): sums of squares and zeros per rank and child
    dense = [sum(float(r["raw"][s.name].square().sum()) for s in DENSE) for r in res]
    expert = [sum(float(r["raw"][s.name].square().sum()) for s in EXPERT) for r in res]
    dense_zeros = sum(int((r["raw"][s.name] == 0).sum()) for r in res for s in DENSE)
    for rank, r in enumerate(res):
        expert_zeros = sum(int((r["raw"][s.name] == 0).sum()) for s in EXPERT)
        assert expert_zeros > 0
        want = math.sqrt(dense[0] + dense[1] + expert[rank])
        assert r["norm"].item() == pytest.approx(want, rel=1e-6)
        assert r["expert_norm"].item() == pytest.approx(math.sqrt(expert[rank]), rel=1e-6)
        assert r["expert_zeros"].item() == expert_zeros
        assert r["zeros"].item() == dense_zeros + expert_zeros
        for s in DENSE:  # reduced over the world: both ranks' gradients
            both = sum(float(x["raw"][s.name].square().sum()) for x in res)
            assert r["per_param"][s.name] == pytest.approx(math.sqrt(both), rel=1e-6)
        for s in EXPERT:
            mine = float(r["raw"][s.name].square().sum())
            assert r["per_param"][s.name] == pytest.approx(math.sqrt(mine), rel=1e-6)
        w = [float(x["raw"]["w_split"].square().sum()) for x in res]
        assert r["installed_world"].item() == pytest.approx(math.sqrt(sum(w)), rel=1e-6)
        assert r["installed_alone"].item() == pytest.approx(math.sqrt(w[rank]), rel=1e-6)
