"""Checkpoint repairs (megatron_ext.opt_checkpoint): every branch, on the CPU.

The ``meta`` device stands in for the GPU where a test needs two devices; megatron-core's
methods that these repairs call around are replaced by recorders where they need CUDA.
"""

from types import SimpleNamespace

import pytest
import torch
from megatron.core.optimizer import distrib_optimizer
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

from megatron_ext import opt_checkpoint
from megatron_ext.opt_checkpoint import (
    align_group_order,
    create_state_before_loading,
    place_sub_optimizer_state,
)
from tests.support.optimizers import (
    BF16,
    FP32,
    RankGroup,
    Spec,
    config,
    dist_child,
    make_buffer,
    make_params,
)

pytestmark = pytest.mark.mcore


class Recorder:
    def __init__(self, result=None):
        self.calls, self.result = [], result

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.result


def _hdo_after_megatron_cores_load():
    """An offload optimizer as megatron-core 0.19.2's load leaves it: a GPU (meta) and a
    CPU sub-optimizer, one ``step`` tensor shared by every parameter's state."""
    hdo = HybridDeviceOptimizer.__new__(HybridDeviceOptimizer)
    gpu_p = torch.nn.Parameter(torch.zeros(3, device="meta"))
    cpu_p, cpu_q = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2))
    step = torch.tensor(5.0)
    states = {
        gpu_p: {"exp_avg": torch.ones(3), "step": step},  # moments left on the CPU
        cpu_p: {"exp_avg": torch.ones(4), "step": step},
        cpu_q: {"exp_avg": torch.ones(2), "step": step},
    }
    hdo.gpu_optimizer = SimpleNamespace(
        param_groups=[{"params": [gpu_p], "fused": True}], state={gpu_p: states[gpu_p]}
    )
    hdo.cpu_optimizers = [
        SimpleNamespace(
            param_groups=[{"params": [cpu_p, cpu_q]}],
            state={p: states[p] for p in (cpu_p, cpu_q)},
        )
    ]
    hdo.state = states  # the offload optimizer's own state holds the same dicts
    return hdo, gpu_p, cpu_p, cpu_q


def test_load_resyncs_the_offload_optimizer_then_places_and_unshares_state(monkeypatch):
    hdo, gpu_p, cpu_p, cpu_q = _hdo_after_megatron_cores_load()
    sync = Recorder()
    monkeypatch.setattr(HybridDeviceOptimizer, "_sync_hdo_state_to_sub_optimizers", sync)
    base = SimpleNamespace(load_state_dict=Recorder())
    me = SimpleNamespace(optimizer=hdo, _flat_base=base)
    opt_checkpoint.load_state_dict(me, {"x": 1})
    assert base.load_state_dict.calls == [((me, {"x": 1}), {})]
    assert sync.calls == [((hdo,), {})]
    assert hdo.state[gpu_p]["exp_avg"].device.type == "meta"
    assert hdo.state[gpu_p]["step"].device.type == "meta"  # fused: torch keeps it there
    assert hdo.state[cpu_p]["exp_avg"].device.type == "cpu"
    steps = [hdo.state[p]["step"] for p in (cpu_p, cpu_q)]  # both stay on the CPU
    assert steps[0] is not steps[1] and [float(s) for s in steps] == [5.0, 5.0]


def test_load_without_offload_does_not_sync(monkeypatch):
    sync = Recorder()
    monkeypatch.setattr(HybridDeviceOptimizer, "_sync_hdo_state_to_sub_optimizers", sync)
    p, q = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    step = torch.tensor(2.0)
    inner = SimpleNamespace(state={p: {"step": step}, q: {"step": step, "lr": 1}})
    me = SimpleNamespace(optimizer=inner, _flat_base=SimpleNamespace(load_state_dict=Recorder()))
    opt_checkpoint.load_state_dict(me, {})
    assert sync.calls == []
    assert inner.state[p]["step"] is not inner.state[q]["step"]


@pytest.mark.parametrize("flags,step_device", [({}, "cpu"), ({"capturable": True}, "meta")])
def test_sub_optimizer_step_stays_where_torch_keeps_it(flags, step_device):
    p = torch.nn.Parameter(torch.zeros(3, device="meta"))
    sub = SimpleNamespace(param_groups=[{"params": [p], **flags}], state={})
    sub.state[p] = {"exp_avg": torch.ones(3), "step": torch.tensor(1.0)}
    place_sub_optimizer_state(SimpleNamespace(sub_optimizers=[sub]))
    assert sub.state[p]["exp_avg"].device.type == "meta"
    assert sub.state[p]["step"].device.type == step_device


def _fresh_distopt(inner):
    child = DistributedOptimizer.__new__(DistributedOptimizer)
    child.optimizer = inner
    child.config = config()
    child.init_state_fn = Recorder()
    return child


def test_no_state_is_created_when_megatron_core_reads_the_step_elsewhere(monkeypatch):
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    p = torch.nn.Parameter(torch.zeros(2))
    child = _fresh_distopt(torch.optim.Adam([p]))
    create_state_before_loading(child)
    assert len(child.optimizer.state) == 0 and child.init_state_fn.calls == []


def test_a_fresh_offload_optimizer_takes_a_dummy_step(monkeypatch):
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    hdo = HybridDeviceOptimizer.__new__(HybridDeviceOptimizer)
    hdo.state = {}
    hdo.dummy_step = Recorder()
    child = _fresh_distopt(hdo)
    create_state_before_loading(child)
    assert hdo.dummy_step.calls == [((), {})] and child.init_state_fn.calls == []


def test_without_init_state_fn_each_parameter_gets_its_own_zero_step(monkeypatch):
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (2, 3)]
    child = _fresh_distopt(torch.optim.Adam(params))
    child.init_state_fn = None
    create_state_before_loading(child)
    steps = [child.optimizer.state[p]["step"] for p in params]
    assert [float(s) for s in steps] == [0.0, 0.0] and steps[0] is not steps[1]


@pytest.mark.parametrize("is_loading", [True, False])
@pytest.mark.parametrize("positional", [True, False])
def test_distributed_sharded_state_dict_creates_state_only_when_loading(
    monkeypatch, is_loading, positional
):
    created = Recorder()
    monkeypatch.setattr(opt_checkpoint, "create_state_before_loading", created)
    me = DistributedOptimizer.__new__(DistributedOptimizer)
    me._flat_base = SimpleNamespace(sharded_state_dict=Recorder("base"))
    args, kwargs = ((is_loading,), {}) if positional else ((), {"is_loading": is_loading})
    assert opt_checkpoint.sharded_state_dict(me, {"m": 1}, *args, **kwargs) == "base"
    assert created.calls == ([((me,), {})] if is_loading else [])
    assert me._flat_base.sharded_state_dict.calls == [((me, {"m": 1}, *args), kwargs)]


@pytest.mark.parametrize("has_fp32", [True, False])
def test_float16_sharded_state_dict_is_repaired_only_with_fp32_parameters(monkeypatch, has_fp32):
    repaired = Recorder("repaired")
    monkeypatch.setattr(opt_checkpoint, "_float16_sharded_state_dict", repaired)
    me = Float16OptimizerWithFloat16Params.__new__(Float16OptimizerWithFloat16Params)
    me.fp32_from_fp32_groups = [[], [torch.zeros(1)]] if has_fp32 else [[], []]
    me._flat_base = SimpleNamespace(sharded_state_dict=Recorder("base"))
    got = opt_checkpoint.sharded_state_dict(me, {"m": 1}, is_loading=True)
    assert got == ("repaired" if has_fp32 else "base")
    assert len(repaired.calls) == int(has_fp32)


def test_precision_aware_state_load_is_megatron_cores_without_the_step():
    base = Recorder("loaded")
    me = SimpleNamespace(
        config=config(precision_aware=True),
        _flat_base=SimpleNamespace(_set_main_param_and_optimizer_states=base),
    )
    p = torch.nn.Parameter(torch.zeros(2))
    tensors = {"param": torch.ones(2), "exp_avg": torch.ones(2), "step": torch.tensor(3.0)}
    assert opt_checkpoint._set_main_param_and_optimizer_states(me, p, tensors) == "loaded"
    [((_, model_param, passed), _)] = base.calls
    assert model_param is p and set(passed) == {"param", "exp_avg"}


def _distopt():
    specs = [Spec("w", 300), Spec("sink", 40, FP32), Spec("b", 7)]
    gen = torch.Generator().manual_seed(0)
    params = make_params(specs, gen)
    bufs = [make_buffer([p for p in params if p.dtype == dt], gen) for dt in (BF16, FP32)]
    return dist_child(params, bufs, config(), RankGroup(1), RankGroup(1)), params


def test_align_group_order_numbers_fp32_shards_first():
    child, (w, sink, b) = _distopt()
    align_group_order(child)
    assert child.model_param_group_index_map == {sink: (0, 0), w: (0, 1), b: (0, 2)}


def test_align_group_order_refuses_a_group_of_another_length():
    child, _ = _distopt()
    child.optimizer.param_groups[0]["params"].pop()
    with pytest.raises(RuntimeError, match="holds 2 parameters but this rank owns 3"):
        align_group_order(child)


def test_align_group_order_refuses_a_shard_of_another_size():
    child, _ = _distopt()
    group = child.optimizer.param_groups[0]["params"]
    group[1], group[2] = group[2], group[1]
    with pytest.raises(RuntimeError, match="position 1: 7 elements"):
        align_group_order(child)


def test_align_group_order_refuses_a_map_of_other_parameters():
    child, _ = _distopt()
    child.model_param_group_index_map[torch.nn.Parameter(torch.zeros(1))] = (0, 3)
    with pytest.raises(RuntimeError, match="disagree"):
        align_group_order(child)


def test_distributed_sharded_state_dict_without_a_model_state_dict(monkeypatch):
    # megatron-core's DistributedOptimizer.sharded_state_dict gives model_sharded_state_dict
    # a default; ours forwards exactly what it was given, and still finds is_loading
    created = Recorder()
    monkeypatch.setattr(opt_checkpoint, "create_state_before_loading", created)
    me = DistributedOptimizer.__new__(DistributedOptimizer)
    me._flat_base = SimpleNamespace(sharded_state_dict=Recorder("base"))
    assert opt_checkpoint.sharded_state_dict(me) == "base"
    assert opt_checkpoint.sharded_state_dict(me, is_loading=True) == "base"
    assert me._flat_base.sharded_state_dict.calls == [((me,), {}), ((me,), {"is_loading": True})]
    assert created.calls == [((me,), {})]
