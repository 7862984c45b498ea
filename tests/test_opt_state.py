"""What enable_flat_norm builds and refuses (megatron_ext.opt_state, megatron_ext.optimizer),
on the CPU with megatron-core's optimizer classes made by tests/support/optimizers.py."""

import types

import pytest
import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import FP32Optimizer

import megatron_ext
from megatron_ext import enable_flat_norm, opt_checkpoint
from megatron_ext.optimizer import _fp32_shards_as_leaves
from tests.support.optimizers import (
    BF16,
    FP32,
    Chunk,
    RankGroup,
    Spec,
    config,
    dist_child,
    float16_child,
    make_buffer,
    make_params,
    record_all_reduce,
)

pytestmark = pytest.mark.mcore

SPECS = [Spec("w", 300, tp=True), Spec("b", 5), Spec("sink", 40, FP32), Spec("w2", 70)]


def model(seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = make_params(SPECS, gen)
    named = {s.name: p for s, p in zip(SPECS, params, strict=True)}
    bufs = [make_buffer([p for p in params if p.dtype == dt], gen) for dt in (BF16, FP32)]
    return params, named, bufs


def test_a_buffer_split_between_optimizers_is_refused():
    params, named, bufs = model()
    child = float16_child(params[:2], config(), RankGroup(1), RankGroup(1))  # not "w2"
    child._has_grad_norm_group_cache = {"mtp": False}
    with pytest.raises(RuntimeError, match="only some parameters of a torch.bfloat16"):
        enable_flat_norm(child, [Chunk(named, bufs)])


def test_separate_grad_norm_groups_are_refused():
    from megatron_ext import seam

    if seam.optional("separate grad-norm groups") is None:
        pytest.skip("this megatron-core has no separate grad-norm groups (before 0.19)")
    params, named, bufs = model()
    child = float16_child(params, config(), RankGroup(1), RankGroup(1))
    child._has_grad_norm_group_cache = {"mtp": True}
    with pytest.raises(NotImplementedError, match="grad_norm_group='mtp'"):
        enable_flat_norm(child, [Chunk(named, bufs)])


def test_an_unsupported_optimizer_class_is_refused():
    params, named, bufs = model()
    child = float16_child(params, config(), RankGroup(1), RankGroup(1))
    child.__class__ = type("OtherOptimizer", (type(child).__mro__[2],), {})  # a MegatronOptimizer
    child._has_grad_norm_group_cache = {"mtp": False}
    with pytest.raises(NotImplementedError, match="does not support OtherOptimizer"):
        enable_flat_norm(child, [Chunk(named, bufs)])


def test_the_fp32_optimizer_reads_the_buffers_themselves(monkeypatch):
    """FP32Optimizer steps on the model parameters' own gradients: no mirror, no bindings,
    the clip scales the buffers."""
    record_all_reduce(monkeypatch)
    params, named, bufs = model()
    child = FP32Optimizer.__new__(FP32Optimizer)
    child.optimizer = torch.optim.SGD(params, lr=1.0)
    child.config = config()
    child.tp_group, child.expert_tp_group = RankGroup(1), None
    child.grad_stats_parallel_group = RankGroup(1)
    child._has_grad_norm_group_cache = {"mtp": False}
    enable_flat_norm(child, [Chunk(named, bufs)])
    assert child._flat.bindings is None
    assert all(t.mirror is None for t in child._flat.targets)
    before = bufs[0].grad_data.clone()
    norm = child.clip_grad_norm(1e-3)
    coeff = 1e-3 / (norm + 1e-6)
    torch.testing.assert_close(bufs[0].grad_data, (before * coeff).to(BF16))


def test_the_distributed_optimizers_index_map_is_put_in_group_order(monkeypatch):
    """enable_flat_norm re-numbers megatron-core's index map to the optimizer's own order
    (fp32 shards first): each entry then points at a shard of its own parameter's size."""
    record_all_reduce(monkeypatch)
    params, named, bufs = model()
    child = dist_child(params, bufs, config(), RankGroup(1), RankGroup(1))
    child._has_grad_norm_group_cache = {"mtp": False}

    def mismatched():
        groups = child.optimizer.param_groups
        return [
            p.shape
            for p, (g, i) in child.model_param_group_index_map.items()
            if groups[g]["params"][i].numel() != p.numel()
        ]

    assert mismatched(), "megatron-core's map already matches: nothing to test"
    enable_flat_norm(child, [Chunk(named, bufs)])
    assert mismatched() == []


def test_chunks_with_and_without_the_option_are_refused():
    chunks = [types.SimpleNamespace(per_dtype_grad_buffers=v) for v in (True, False)]
    with pytest.raises(ValueError, match="some model chunks have per_dtype_grad_buffers=True"):
        megatron_ext.get_megatron_optimizer(config(), chunks)


class CudaTyped(torch.nn.Parameter):
    """Answers type() as a CUDA tensor would: megatron-core's builder accepts only those
    names; everything it does with the values runs on the CPU alike."""

    def type(self, *args, **kwargs):
        name = super().type(*args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not (args or kwargs) else name


def test_fp32_shards_become_leaves_during_construction_only():
    params = [CudaTyped(torch.randn(n, dtype=dt)) for n, dt in ((300, BF16), (64, FP32))]
    params[1].tensor_model_parallel = True
    gen = torch.Generator().manual_seed(1)
    bufs = [make_buffer([p], gen) for p in params]
    ranges = [DistributedOptimizer._build_gbuf_range_map(b) for b in bufs]
    gbuf_map = DistributedOptimizer._build_model_param_gbuf_map(ranges)
    cfg = types.SimpleNamespace(
        use_precision_aware_optimizer_no_fp8_or_ds_fp8=False, fp8_recipe=None
    )
    original = DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]

    def build():
        _, group_ranges = DistributedOptimizer._build_optimizer_group_ranges(
            [{"params": list(params)}], ranges
        )
        built = DistributedOptimizer._build_model_and_main_param_groups(
            ranges, gbuf_map, group_ranges, cfg
        )
        return built[3][0][0], group_ranges[0]["orig_group"]["params"]

    stock_shard, _ = build()
    assert not stock_shard.is_leaf  # megatron-core's own: a view that needs grad
    with _fp32_shards_as_leaves():
        shard, optimized = build()
    assert DistributedOptimizer.__dict__["_build_model_and_main_param_groups"] is original
    assert shard.is_leaf and shard.data_ptr() == params[1].data_ptr()
    assert shard.tensor_model_parallel is True  # Megatron's attributes kept
    assert any(q is shard for q in optimized)  # the optimizer steps the leaf
    assert not any(q is stock_shard for q in optimized)


@pytest.mark.parametrize(
    "host_mirrors,step,convert,delayed,overlap",
    [
        (True, "per_parameter", "host", False, False),
        (True, "chunked", "host", False, False),
        (True, "chunked", "device", False, False),
        (True, "chunked", "host", True, False),
        (True, "chunked", "host", False, True),
        (False, "per_parameter", "host", False, False),
    ],
)
def test_options_reach_every_child(monkeypatch, host_mirrors, step, convert, delayed, overlap):
    from megatron_ext import MegatronOptions, offload

    attached = []
    monkeypatch.setattr(offload, "attach_host_mirrors", lambda c, **kw: attached.append((c, kw)))
    params, named, bufs = model()
    child = float16_child(params, config(), RankGroup(1), RankGroup(1))
    child._has_grad_norm_group_cache = {"mtp": False}
    options = MegatronOptions(
        host_mirrors=host_mirrors,
        offload_step=step,
        offload_chunk_numel=99,
        offload_convert=convert,
        offload_delayed_update=delayed,
        offload_delay_warmup=3 if delayed else 10,
        offload_pin_threads=delayed,
        offload_overlap_forward=overlap,
    )
    chunk = Chunk(named, bufs)
    enable_flat_norm(child, [chunk], options=options)
    want = dict(
        chunked_step=step == "chunked",
        chunk_numel=99,
        threads=None,
        convert_on_device=convert == "device",
        delayed_update=delayed,
        delay_warmup=3 if delayed else 10,
        sharing=1,  # no child of this one-child chain offloads: the cores are not divided
        pin_threads=delayed,
        overlap_forward=overlap,
        model_chunks=[chunk],
    )
    assert attached == ([(child, want)] if host_mirrors else [])
    assert child._flat.norm_clip.options is options


def test_the_flat_class_is_made_once_and_keeps_the_base():
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    from megatron_ext.optimizer import _flat_class

    params, named, bufs = model()
    child = float16_child(params, config(), RankGroup(1), RankGroup(1))
    child._has_grad_norm_group_cache = {"mtp": False}
    enable_flat_norm(child, [Chunk(named, bufs)])
    flat = type(child)
    assert flat.__bases__ == (Float16OptimizerWithFloat16Params,)
    assert flat._flat_base is Float16OptimizerWithFloat16Params
    assert _flat_class(flat) is flat and _flat_class(Float16OptimizerWithFloat16Params) is flat
    for name in ("sharded_state_dict", "load_state_dict", "_set_main_param_and_optimizer_states"):
        assert getattr(flat, name) is getattr(opt_checkpoint, name), name


def test_megatron_cores_factory_runs_with_fp32_shards_as_leaves(monkeypatch):
    import megatron.core.optimizer as mcore_optimizer

    from megatron_ext import optimizer

    original = DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]
    seen = []

    def factory(cfg, chunks, *args, **kwargs):
        wrapped = DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]
        seen.append((wrapped is not original, args, kwargs))
        return "built"

    monkeypatch.setattr(mcore_optimizer, "get_megatron_optimizer", factory)
    monkeypatch.setattr(optimizer, "enable_flat_norm", lambda opt, chunks, options: (opt, options))
    chunks = [types.SimpleNamespace(per_dtype_grad_buffers=True)]
    options = megatron_ext.MegatronOptions(host_mirrors=False)
    got = megatron_ext.get_megatron_optimizer(config(), chunks, 1, options=options, k=2)
    assert got == ("built", options)
    assert seen == [(True, (1,), {"k": 2})]
    assert DistributedOptimizer.__dict__["_build_model_and_main_param_groups"] is original


def test_enable_flat_norm_refuses_what_megatron_core_cannot_step():
    # the construction path runs megatron_ext.refusals (its cases: tests/test_refusals.py)
    from megatron_ext import UnsupportedCombinationError
    from tests.support.optimizers import ConstantScaler

    params, named, bufs = model()
    cfg = config(precision_aware=True)
    cfg.loss_scale = 1024.0
    child = dist_child(params, bufs, cfg, RankGroup(1), RankGroup(1), scaler=ConstantScaler(1024.0))
    child._has_grad_norm_group_cache = {"mtp": False}
    with pytest.raises(UnsupportedCombinationError, match="loss scale"):
        enable_flat_norm(child, [Chunk(named, bufs)])
