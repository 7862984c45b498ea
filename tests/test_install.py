"""megatron_ext.install()/uninstall(): what they replace, restore and reduce, on the CPU."""

import importlib
import math
import os
import sys

import pytest
import torch
import torch.distributed as dist

import megatron_ext
from tests.support.spawn import spawn

pytestmark = pytest.mark.mcore

install_module = importlib.import_module("megatron_ext.install")


@pytest.fixture
def restored():
    """Uninstall even when a test fails halfway."""
    yield
    megatron_ext.uninstall()


def test_modules_imported_after_install_are_restored_too(tmp_path, monkeypatch, restored):
    import megatron.core.optimizer.clip_grads as cg

    originals = (cg.get_grad_norm_fp32, cg.clip_grad_by_total_norm_fp32)
    (tmp_path / "late_user.py").write_text(
        "from megatron.core.optimizer.clip_grads import get_grad_norm_fp32\n"
        "from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32 as clip\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "late_user", raising=False)
    megatron_ext.install()
    import late_user

    assert late_user.get_grad_norm_fp32 is install_module.get_grad_norm_fp32
    assert late_user.clip is install_module.clip_grad_by_total_norm_fp32
    restored_names = megatron_ext.uninstall()
    assert {"late_user.get_grad_norm_fp32", "late_user.clip"} <= set(restored_names)
    assert (late_user.get_grad_norm_fp32, late_user.clip) == originals
    assert (cg.get_grad_norm_fp32, cg.clip_grad_by_total_norm_fp32) == originals
    assert megatron_ext.uninstall() == []  # idempotent


def test_aliases_held_before_install_are_replaced_and_restored(tmp_path, monkeypatch, restored):
    import megatron.core.optimizer.clip_grads as cg

    (tmp_path / "early_user.py").write_text(
        "from megatron.core.optimizer.clip_grads import get_grad_norm_fp32 as norm_fn\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "early_user", raising=False)
    import early_user

    assert "early_user.norm_fn" in megatron_ext.install()
    assert early_user.norm_fn is install_module.get_grad_norm_fp32
    megatron_ext.uninstall()
    assert early_user.norm_fn is cg.get_grad_norm_fp32


def dtensor_worker(rank: int, init_file: str, out_dir: str) -> None:
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    mesh = DeviceMesh("cpu", [0, 1])  # the data-parallel group of the DTensor gradients
    singletons = [dist.new_group([r]) for r in range(2)]  # every rank creates every group
    grads = [distribute_tensor(full, mesh, [Shard(0)]) for full in full_gradients()]
    out = {}
    for p in (2.0, math.inf):
        out[p] = install_module.get_grad_norm_fp32(
            grads, p, grad_stats_parallel_group=singletons[rank]
        )
    torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def full_gradients() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(64, 3, generator=gen).bfloat16(), torch.randn(10, generator=gen)]


def test_dtensor_gradients_are_reduced_over_their_data_parallel_group(tmp_path):
    """As stock: local shards, one all-reduce over the DTensors' group, then grad stats'."""
    spawn(dtensor_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    everything = torch.cat([g.double().reshape(-1) for g in full_gradients()])
    for rank in range(2):
        got = torch.load(tmp_path / f"{rank}.pt")
        for p in (2.0, math.inf):
            want = torch.linalg.vector_norm(everything, p).item()
            assert got[p].item() == pytest.approx(want, rel=1e-6), (rank, p)


@pytest.fixture
def one_rank_mesh(tmp_path):
    from torch.distributed.tensor import DeviceMesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/s", rank=0, world_size=1)
    yield DeviceMesh("cpu", [0])
    dist.destroy_process_group()


def test_a_list_mixing_dtensors_and_plain_tensors_is_refused(one_rank_mesh):
    from torch.distributed.tensor import Replicate, distribute_tensor

    dt = distribute_tensor(torch.ones(4), one_rank_mesh, [Replicate()])
    with pytest.raises(ValueError, match=r"mixes DTensor .* \(element 1 is plain\)"):
        install_module.get_grad_norm_fp32([dt, torch.ones(4)])


def test_clip_scales_dtensor_local_shards(one_rank_mesh):
    from torch.distributed.tensor import Replicate, distribute_tensor

    grad = torch.randn(8, generator=torch.Generator().manual_seed(2))
    param = torch.nn.Parameter(distribute_tensor(torch.zeros(8), one_rank_mesh, [Replicate()]))
    param.grad = distribute_tensor(grad.clone(), one_rank_mesh, [Replicate()])
    install_module.clip_grad_by_total_norm_fp32([param], 1.0, torch.tensor(4.0))
    want = grad.double() * (1.0 / (4.0 + 1e-6))
    torch.testing.assert_close(param.grad.to_local().double(), want, rtol=1e-6, atol=0)


def test_uninstall_leaves_this_packages_own_definitions(restored):
    ours = (install_module.get_grad_norm_fp32, install_module.clip_grad_by_total_norm_fp32)
    megatron_ext.install()
    megatron_ext.uninstall()
    assert (install_module.get_grad_norm_fp32, install_module.clip_grad_by_total_norm_fp32) == ours


def test_the_norm_all_reduces_over_the_given_group_and_none_means_the_world(monkeypatch):
    """As stock's: one all-reduce over ``grad_stats_parallel_group``, the world's when it
    is None (the recording fake counts 3 ranks for the group and 5 for the world)."""
    from tests.support.optimizers import WORLD_SIZE, RankGroup, record_all_reduce

    log = record_all_reduce(monkeypatch)
    gen = torch.Generator().manual_seed(9)
    grads = [torch.randn(300, generator=gen).bfloat16(), torch.randn(40, generator=gen)]
    local = sum(float(g.double().square().sum()) for g in grads)
    group = RankGroup(3)
    got = install_module.get_grad_norm_fp32(grads, grad_stats_parallel_group=group)
    assert got.item() == pytest.approx(math.sqrt(3 * local), rel=1e-6)
    got = install_module.get_grad_norm_fp32(grads)
    assert got.item() == pytest.approx(math.sqrt(WORLD_SIZE * local), rel=1e-6)
    assert [g for g, _ in log] == [group, dist.group.WORLD]
    # a rank with no gradients still joins the collective (on the CPU without a GPU)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert install_module.get_grad_norm_fp32([], grad_stats_parallel_group=group).item() == 0.0
    assert len(log) == 3


@pytest.mark.parametrize("norm_type", [2, 3.0, math.inf])
def test_the_norm_is_a_0_dim_fp32_tensor_that_stocks_callers_and_a_log_take(norm_type, monkeypatch):
    """Not stock's annotated float (install()'s docstring says why): a 0-dim fp32 tensor
    that megatron-core's own callers combine, and that float() hands to a JSON log."""
    import json

    from megatron.core.optimizer.optimizer import ChainedOptimizer

    from tests.support.optimizers import RankGroup, record_all_reduce

    record_all_reduce(monkeypatch)
    gen = torch.Generator().manual_seed(11)
    parts = [
        [torch.randn(500, generator=gen).bfloat16(), torch.randn(70, generator=gen)],
        [torch.randn(90, generator=gen).half()],
    ]
    group = RankGroup(1)
    norms = [
        install_module.get_grad_norm_fp32(grads, norm_type, grad_stats_parallel_group=group)
        for grads in parts
    ]
    for norm, grads in zip(norms, parts, strict=True):
        want = torch.linalg.vector_norm(torch.cat([g.double() for g in grads]), norm_type)
        assert isinstance(norm, torch.Tensor) and norm.dim() == 0 and norm.dtype == torch.float32
        assert norm.device == grads[0].device
        assert float(norm) == pytest.approx(want.item(), rel=1e-6)
        assert json.loads(json.dumps(float(norm))) == float(norm)
        assert f"{norm:.6e}" == f"{float(norm):.6e}"  # a log line's format
    with pytest.raises(TypeError, match="not JSON serializable"):
        json.dumps(norms[0])  # what the docs say to do instead
    # megatron-core's chained optimizer with groups not shared: the square root of the
    # sum of its optimizers' squared norms, as it combines stock's floats
    chain = type("Chain", (), {})()
    chain.chained_optimizers = [type("Opt", (), {"get_grad_norm": lambda self, n=n: n})()
                                for n in norms]  # fmt: skip
    chain.grads_states_parallel_group_is_shared = lambda: False
    got = ChainedOptimizer.get_grad_norm(chain)
    assert float(got) == pytest.approx(math.sqrt(sum(float(n) ** 2 for n in norms)), rel=1e-6)


@pytest.mark.parametrize("decoupled", [True, False])
def test_clip_scales_decoupled_or_plain_gradients_as_asked(decoupled):
    gen = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (6, 9)]
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    others = [torch.randn(p.shape, generator=gen) for p in params]
    for p, g, o in zip(params, grads, others, strict=True):
        p.decoupled_grad, p.grad = (g.clone(), o.clone()) if decoupled else (o.clone(), g.clone())
    install_module.clip_grad_by_total_norm_fp32(params, 1.0, 8.0, use_decoupled_grad=decoupled)
    for p, g, o in zip(params, grads, others, strict=True):
        read, left = (p.decoupled_grad, p.grad) if decoupled else (p.grad, p.decoupled_grad)
        torch.testing.assert_close(read.double(), g.double() / (8.0 + 1e-6), rtol=1e-6, atol=0)
        assert torch.equal(left, o)
