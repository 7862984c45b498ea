"""``attach_host_mirrors`` on a distributed optimizer's attributes, on the CPU: the glue
(sources, class swap, the chunked step through it) and the step's thread setting."""

from __future__ import annotations

import pytest
import torch
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

from megatron_ext import offload
from megatron_ext.offload import HostMirrorHybridOptimizer
from tests.support import offload_internals
from tests.support.offload_sim import (
    assert_same_state,
    distopt_shaped,
)

pytestmark = pytest.mark.mcore


@pytest.mark.parametrize("dp,rank", [(1, 0), (2, 1)])
@pytest.mark.parametrize("pa", [True, False], ids=["pa", "main"])
def test_attach_to_a_distributed_optimizer(cpu_streams, pa, dp, rank):
    child = distopt_shaped(pa, dp, rank)
    hdo = child.optimizer
    offloaded = list(hdo.gpu_params_map_cpu_copy.items())
    assert offload.attach_host_mirrors(child) is True
    assert type(hdo) is HostMirrorHybridOptimizer and hdo.host_mirrors
    # megatron-core's placement and CPU copies are kept, not made again
    assert list(hdo.gpu_params_map_cpu_copy.items()) == offloaded
    sources = offload_internals.sources(hdo)
    for source, buf, target in zip(
        sources, child.buffers, offload_internals.flat_targets(child), strict=True
    ):
        assert source.owned == target.spans.owned
        assert source.param_data is buf.param_data
        if target.mirror is not None:  # fp32 main grads of bf16 params: the fp32 mirror
            assert source.grads is target.mirror and source.grads_coords == target.spans.owned
        else:
            assert source.grads is buf.grad_data and source.grads_coords is None
        for shard, span in source.spans.items():
            if pa or buf.param_dtype == torch.float32:  # a view of the parameter buffer
                assert shard.storage_offset() == span.start
    for cpu in hdo.cpu_copys_map_gpu_param:
        hosts = {m.host_params.untyped_storage().data_ptr() for m in hdo.host_mirrors}
        assert cpu.untyped_storage().data_ptr() in hosts
    for buf in child.buffers:
        buf.grad_data.normal_()
    for t in offload_internals.flat_targets(child):
        for dst, src in t.copies:
            dst.copy_(src)
    hdo.step()  # gradients straight from the buffers (or the fp32 mirror), no .grad needed
    assert all(hdo.state[p] for p, _ in offloaded)


@pytest.mark.parametrize("pa", [True, False], ids=["pa", "main"])
def test_attach_with_the_chunked_step_trains_as_the_per_parameter_one(cpu_streams, pa):
    """Through the glue (a DistributedOptimizer's attributes, megatron_ext's targets):
    attach_host_mirrors(chunked_step=True) steps chunk by chunk, to the same bits."""
    finals = []
    for chunked in (False, True):
        child = distopt_shaped(pa, 2, 1)
        hdo = child.optimizer
        assert offload.attach_host_mirrors(child, chunked_step=chunked, chunk_numel=64)
        assert hdo.chunked_step is chunked and hdo.chunk_numel == 64
        gen = torch.Generator().manual_seed(4)
        for _ in range(3):
            for buf in child.buffers:
                buf.grad_data.copy_(torch.randn(buf.grad_data.shape, generator=gen))
            for t in offload_internals.flat_targets(child):
                for dst, src in t.copies:
                    dst.copy_(src)
            hdo.step()
        assert (offload_internals.chunked(hdo) is not None) is chunked
        if chunked:
            copies = offload_internals.chunked(hdo).copies
            assert len(copies) > sum(len(m.blocks) for m in hdo.host_mirrors)
        assert all(hdo.state[p] for p in hdo.gpu_params_map_cpu_copy)
        finals.append(([b.param_data.clone() for b in child.buffers], hdo))
    (a, stock), (b, mine) = finals
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    pa_ = [p for g in stock.param_groups for p in g["params"]]
    pb = [p for g in mine.param_groups for p in g["params"]]
    for p, q in zip(pa_, pb, strict=True):
        assert stock.state[p].keys() == mine.state[q].keys()
        for key in stock.state[p]:
            assert torch.equal(stock.state[p][key], mine.state[q][key]), key


def test_threads_are_set_for_the_step_and_restored(cpu_streams, monkeypatch):
    import warnings as w

    from megatron_ext.offload import threads

    seen = []
    real_step = HybridDeviceOptimizer.step

    def spy(self, closure=None):
        seen.append(torch.get_num_threads())
        return real_step(self, closure)

    monkeypatch.setattr(HybridDeviceOptimizer, "step", spy)
    before = torch.get_num_threads()
    other = 1 if before > 1 else 2
    child = distopt_shaped(True, 1, 0)
    with w.catch_warnings():
        w.simplefilter("ignore")  # other=1 may warn; the warning has its own test
        offload.attach_host_mirrors(child, threads=other)
    for buf in child.buffers:
        buf.grad_data.normal_()
    for t in offload_internals.flat_targets(child):
        for dst, src in t.copies:
            dst.copy_(src)
    child.optimizer.step()
    assert seen == [other] and torch.get_num_threads() == before
    # chunked: the fused kernel runs under the same setting
    counts = []
    real = torch._fused_adamw_
    monkeypatch.setattr(
        torch,
        "_fused_adamw_",
        lambda *a, **k: counts.append(torch.get_num_threads()) or real(*a, **k),
    )
    child.optimizer.chunked_step = True
    child.optimizer.offload_kernel = "torch"
    child.optimizer.step()
    assert counts and set(counts) == {other} and torch.get_num_threads() == before
    # the compiled kernel is handed the same number of threads
    from megatron_ext.offload import host_kernel as native

    handed = []
    real_run = native.HostAdamW.run
    monkeypatch.setattr(
        native.HostAdamW,
        "run",
        lambda self, *a: handed.append(a[4]) or real_run(self, *a),
    )
    child.optimizer.offload_kernel = "native"
    child.optimizer.step()
    assert handed and set(handed) == {other} and torch.get_num_threads() == before
    with threads.cpu_threads(None):
        assert torch.get_num_threads() == before


def test_one_thread_of_several_cores_is_warned_about(cpu_streams, monkeypatch):
    import warnings as w

    from megatron_ext.offload import threads

    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    with pytest.warns(UserWarning, match=r"1 thread of the 16 cores.*offload_threads=N"):
        offload.attach_host_mirrors(distopt_shaped(True, 1, 0), threads=1)
    with w.catch_warnings():
        w.simplefilter("error")
        offload.attach_host_mirrors(distopt_shaped(True, 1, 0), threads=4)
    monkeypatch.setattr(threads, "usable_cores", lambda: 1)
    assert threads.threads_warning(1) is None
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    assert "1 thread of the 8 cores" in threads.threads_warning(None)


def test_pinning_is_refused_without_the_delayed_update_and_warned_where_nothing_can_be_left(
    cpu_streams, monkeypatch
):
    import warnings as w

    from megatron_ext.offload import hybrid, threads

    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="pins the delayed update's worker threads"):
        offload.attach_host_mirrors(distopt_shaped(True, 1, 0), chunked_step=True, pin_threads=True)
    monkeypatch.setattr(hybrid, "worker_cpus", lambda: frozenset({2, 3}))
    with w.catch_warnings():
        w.simplefilter("error")
        child = distopt_shaped(True, 1, 0)
        offload.attach_host_mirrors(child, chunked_step=True, delayed_update=True, pin_threads=True)
    assert child.optimizer.worker_cpus == frozenset({2, 3})
    # no more threads than the CPUs pinned to
    assert (child.optimizer.thread_tuner.high, child.optimizer.cpu_threads) == (2, 2)
    monkeypatch.setattr(hybrid, "worker_cpus", lambda: None)
    monkeypatch.setattr(hybrid, "rank_cores", lambda: [5])
    child = distopt_shaped(True, 1, 0)
    with pytest.warns(
        UserWarning, match=r"pins nothing here: this rank has one usable core \(\[5\]\)"
    ):
        offload.attach_host_mirrors(child, chunked_step=True, delayed_update=True, pin_threads=True)
    assert child.optimizer.worker_cpus is None


def test_the_delayed_updates_own_thread_choice_is_not_warned_about(cpu_streams, monkeypatch):
    """On two cores the delayed update's worker takes one thread by design (the other core
    is the launching thread's): not the one-thread warning meant for torchrun's default."""
    import warnings as w

    from megatron_ext.offload import threads

    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    child = distopt_shaped(True, 1, 0)
    with w.catch_warnings():
        w.simplefilter("error")
        offload.attach_host_mirrors(child, chunked_step=True, delayed_update=True)
    assert child.optimizer.cpu_threads == 1
    with pytest.warns(UserWarning, match="1 thread of the 2 cores"):  # a count given: warned
        offload.attach_host_mirrors(
            distopt_shaped(True, 1, 0), chunked_step=True, delayed_update=True, threads=1
        )


def test_attach_ignores_optimizers_without_offload():
    assert offload.attach_host_mirrors(object()) is False


# what attach_host_mirrors rebuilds (megatron-core's _init_sub_optimizers sets them): the
# sub-optimizers, their streams and per-step maps, and the lookups derived from the placement
REBUILT = {
    "cpu_optimizers",
    "gpu_optimizer",
    "cpu_copy_map_grad",
    "_d2h_stream",
    "_h2d_stream",
    "_cpu_optimizer_map_data_event",
    "param_to_inner_param",
    "inner_param_to_orig_param",
    "fp32_param_to_orig_param",
}


def _bind_shard_grads(child):
    """Each shard's gradient as ``.grad`` (an fp32 copy of its gradient-buffer slice), what
    megatron-core's optimizer reads without the precision-aware option."""
    pairs = (
        (child.model_float16_groups[0], child.shard_fp32_from_float16_groups[0]),
        (child.model_fp32_groups[0], child.shard_fp32_groups[0]),
    )
    for models, shards in pairs:
        for model, shard in zip(models, shards, strict=True):
            index = child.model_param_gbuf_map[model][0]
            start = child.buffers[index].param_index_map[model][0]
            r = child._get_model_param_range_map(model)["param"]
            grad = child.buffers[index].grad_data[start + r.start : start + r.end]
            shard.grad = grad.float().clone()


def test_class_swap_keeps_the_instance_layout(cpu_streams):
    """attach_host_mirrors swaps the class of megatron-core's live optimizer: every
    attribute megatron-core set survives, the same objects but for what it rebuilds (its
    sub-optimizers, over the same parameters and CPU copies), and the swapped optimizer
    steps as the unswapped one does, bit for bit."""
    runs = []
    for swap in (False, True):
        child = distopt_shaped(False, 2, 1)
        hdo = child.optimizer
        before = dict(vars(hdo))
        inner = list(hdo.param_to_inner_param.items())
        subs = [[p for g in o.param_groups for p in g["params"]] for o in hdo.sub_optimizers]
        if swap:
            assert offload.attach_host_mirrors(child) is True
            assert type(hdo) is HostMirrorHybridOptimizer and hdo.host_mirrors
            after = vars(hdo)
            assert before.keys() <= after.keys()
            kept = [k for k in before if k not in REBUILT]
            assert [k for k in kept if after[k] is not before[k]] == []
            assert "param_groups" in kept and "gpu_params_map_cpu_copy" in kept
            assert [(a, b) for a, b in hdo.param_to_inner_param.items()] == inner
            now = [[p for g in o.param_groups for p in g["params"]] for o in hdo.sub_optimizers]
            assert [len(x) for x in now] == [len(x) for x in subs]
            assert all(
                a is b for x, y in zip(now, subs, strict=True) for a, b in zip(x, y, strict=True)
            )
        gen = torch.Generator().manual_seed(4)
        for _ in range(3):
            for buf in child.buffers:
                buf.grad_data.copy_(torch.randn(buf.grad_data.shape, generator=gen))
            for t in offload_internals.flat_targets(child):
                for dst, src in t.copies:
                    dst.copy_(src)
            _bind_shard_grads(child)
            hdo.step()
        shards = [*child.shard_fp32_from_float16_groups[0], *child.shard_fp32_groups[0]]
        runs.append(([s.detach().clone() for s in shards], hdo))
    (a, stock), (b, mine) = runs
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert_same_state(stock, mine)
