"""One flat megatron-core optimizer (megatron_ext.flat_optimizer), built on the CPU.

The optimizers are megatron-core's own classes made by ``tests/support/optimizers.py`` and
turned flat by the real :func:`megatron_ext.enable_flat_norm`. Oracles: fp64 over the raw
gradients drawn here, which parameters count from first principles, and the process group
the optimizer was given (a :class:`RankGroup` of k ranks multiplies a sum by k).
"""

import math

import pytest
import torch
import torch.distributed as dist

from megatron_ext import enable_flat_norm
from megatron_ext.opt_state import buffers_device
from tests.support.optimizers import (
    BF16,
    FP32,
    WORLD_SIZE,
    Chunk,
    ConstantScaler,
    RankGroup,
    Spec,
    config,
    counted,
    dist_child,
    float16_child,
    make_buffer,
    make_params,
    record_all_reduce,
    sumsq,
)

pytestmark = pytest.mark.mcore

DENSE = [
    Spec("w_split", 300, tp=True),
    Spec("w_repl", 130),
    Spec("w_shared", 77, shared=True),
    Spec("b_repl", 5),
    Spec("sink", 40, FP32),
    Spec("w_fp32_split", 70, FP32, tp=True),
]
EXPERT = [Spec("e_split", 200, tp=True, expert=True), Spec("e_repl", 90, expert=True)]


def build(specs=DENSE, *, kind="float16", seed=0, cfg=None, tp=None, etp=None, **kw):
    """(flat optimizer, {name: param}, {name: raw fp64 grad}, its group)."""
    gen = torch.Generator().manual_seed(seed)
    params = make_params(specs, gen)
    named = {s.name: p for s, p in zip(specs, params, strict=True)}
    groups = {}  # one buffer per (dtype, expert), as megatron-core keeps them
    for s, p in zip(specs, params, strict=True):
        groups.setdefault((p.dtype, s.expert), []).append(p)
    bufs = [make_buffer(ps, gen) for ps in groups.values()]
    raw = {n: p.main_grad.double().clone() for n, p in named.items()}
    group = kw.pop("group", RankGroup(3, name="optimizer's"))
    cfg = config() if cfg is None else cfg
    tp = RankGroup(1) if tp is None else tp
    if kind == "float16":
        child = float16_child(params, cfg, group, tp, etp, **kw)
    else:
        child = dist_child(params, bufs, cfg, group, tp, etp, **kw)
    child._has_grad_norm_group_cache = {"mtp": False}
    enable_flat_norm(child, [Chunk(named, bufs)])
    return child, named, raw, group


def counted_sumsq(named, raw, tp_rank=0, etp_rank=0):
    return sumsq(raw[n] for n, p in named.items() if counted(p, tp_rank, etp_rank))


def test_norm_is_the_fp64_norm_of_the_counted_gradients_over_the_optimizers_group(monkeypatch):
    log = record_all_reduce(monkeypatch)
    child, named, raw, group = build()
    assert type(child).__name__ == "FlatFloat16OptimizerWithFloat16Params"
    assert child._flat.norm_clip.device == torch.device("cpu")
    norm = child.get_grad_norm()
    want = math.sqrt(3 * counted_sumsq(named, raw))
    assert norm.item() == pytest.approx(want, rel=1e-6)
    assert log == [(group, dist.ReduceOp.SUM)]


def test_zero_count_is_reduced_over_the_optimizers_group(monkeypatch):
    log = record_all_reduce(monkeypatch)
    child, named, raw, group = build()
    zeros = child.count_zeros()
    local = sum(int((raw[n] == 0).sum()) for n, p in named.items() if counted(p))
    assert local > 0  # the draw has zeros
    assert zeros.dtype == torch.int64 and zeros.item() == 3 * local
    assert log == [(group, dist.ReduceOp.SUM)]


def test_the_reducer_follows_a_new_group_object(monkeypatch):
    log = record_all_reduce(monkeypatch)
    child, named, raw, group = build()
    local = counted_sumsq(named, raw)
    assert child.get_grad_norm().item() == pytest.approx(math.sqrt(3 * local), rel=1e-6)
    other = RankGroup(7, name="other")
    child.grad_stats_parallel_group = other
    assert child.get_grad_norm().item() == pytest.approx(math.sqrt(7 * local), rel=1e-6)
    assert child.clip_grad_norm(0.0).item() == pytest.approx(math.sqrt(7 * local), rel=1e-6)
    assert [g for g, _ in log] == [group, other, other]


@pytest.mark.parametrize("tp_rank,etp_rank", [(1, 0), (0, 1), (1, 1)])
def test_dense_parameters_use_the_tp_group_and_expert_ones_the_expert_tp_group(
    monkeypatch, tp_rank, etp_rank
):
    record_all_reduce(monkeypatch)
    child, named, raw, _ = build(
        DENSE + EXPERT, tp=RankGroup(2, tp_rank), etp=RankGroup(2, etp_rank), group=RankGroup(1)
    )
    want = counted_sumsq(named, raw, tp_rank, etp_rank)
    if tp_rank != etp_rank:  # the two groups' verdicts differ here
        assert want != counted_sumsq(named, raw, etp_rank, tp_rank)
    assert child.get_grad_norm().item() == pytest.approx(math.sqrt(want), rel=1e-6)


def test_copy_into_main_grads_binds_the_mirror_and_copies_every_step(monkeypatch):
    record_all_reduce(monkeypatch)
    child, named, raw, _ = build()
    for _ in range(2):  # the second step's gradients must be copied again
        child._copy_model_grads_to_main_grads()
        mirrors = [t.mirror for t in child._flat.targets if t.mirror is not None]
        assert len(mirrors) == 1
        for model, main in zip(
            child.float16_groups[0], child.fp32_from_float16_groups[0], strict=True
        ):
            assert main.grad.dtype == FP32
            assert torch.equal(main.grad, model.main_grad.float())
            # bound to the preallocated mirror, not a fresh copy
            assert main.grad.untyped_storage().data_ptr() == mirrors[0].untyped_storage().data_ptr()
        for p in child.fp32_from_fp32_groups[0]:
            assert p.grad.data_ptr() == p.main_grad.data_ptr()
        for p in named.values():
            p.main_grad.normal_()


def test_without_bindings_the_copy_is_megatron_cores(monkeypatch):
    """Precision-aware distributed optimizer: no mirror, no bindings; megatron-core's own
    copy points each shard's ``decoupled_grad`` at the gradient buffer."""
    record_all_reduce(monkeypatch)
    child, named, raw, _ = build(kind="dist", cfg=config(precision_aware=True))
    assert child._flat.bindings is None
    child._copy_model_grads_to_main_grads()
    for model, shard in zip(
        child.model_float16_groups[0], child.shard_float16_groups[0], strict=True
    ):
        assert shard.decoupled_grad.data_ptr() == model.main_grad.data_ptr()


@pytest.mark.parametrize(
    "kind,precision_aware",
    [("float16", False), ("dist", False), ("dist", True)],  # precision-aware: distributed only
    ids=["float16", "dist-grad", "dist-decoupled_grad"],
)
def test_clip_scales_the_gradients_the_optimizer_reads(monkeypatch, kind, precision_aware):
    """Plain: the fp32 main gradients (``.grad``) are clipped and the buffer is left as it
    is; precision-aware: the buffer itself, which ``.decoupled_grad`` views."""
    record_all_reduce(monkeypatch)
    cfg = config(precision_aware=precision_aware)
    child, named, raw, _ = build(kind=kind, cfg=cfg, group=RankGroup(1))
    buffers_before = [t.buffer.grad_data.clone() for t in child._flat.targets]
    assert child.prepare_grads() is False
    norm = math.sqrt(counted_sumsq(named, raw))
    max_norm = norm / 4
    got = child.clip_grad_norm(max_norm)
    assert got.item() == pytest.approx(norm, rel=1e-6)
    coeff = max_norm / (norm + 1e-6)
    if kind == "float16":
        mains = [*child.fp32_from_float16_groups[0], *child.fp32_from_fp32_groups[0]]
        models = [*child.float16_groups[0], *child.fp32_from_fp32_groups[0]]
    elif precision_aware:
        mains = [*child.shard_float16_groups[0], *child.shard_fp32_groups[0]]
        models = [*child.model_float16_groups[0], *child.model_fp32_groups[0]]
    else:
        mains = [*child.shard_fp32_from_float16_groups[0], *child.shard_fp32_groups[0]]
        models = [*child.model_float16_groups[0], *child.model_fp32_groups[0]]
    name_of = {id(p): n for n, p in named.items()}
    for model, main in zip(models, mains, strict=True):
        grad = main.decoupled_grad if precision_aware else main.grad
        if precision_aware:
            assert main.grad is None
        tol = 2**-7 if model.dtype == BF16 and precision_aware else 1e-6
        want = raw[name_of[id(model)]].view(-1) * coeff
        torch.testing.assert_close(grad.double().view(-1), want, rtol=tol, atol=1e-30)
    if not precision_aware:  # bf16 gradients in the buffer are not what the optimizer reads
        bf16 = [t for t in child._flat.targets if t.buffer.grad_dtype == BF16]
        assert bf16 and all(
            torch.equal(t.buffer.grad_data, b)
            for t, b in zip(child._flat.targets, buffers_before, strict=True)
            if t in bf16
        )


def test_a_clip_of_zero_leaves_the_gradients_alone(monkeypatch):
    record_all_reduce(monkeypatch)
    child, named, raw, _ = build(group=RankGroup(1))
    child.prepare_grads()
    norm = child.clip_grad_norm(0.0)
    assert norm.item() == pytest.approx(math.sqrt(counted_sumsq(named, raw)), rel=1e-6)
    for model, main in zip(child.float16_groups[0], child.fp32_from_float16_groups[0], strict=True):
        assert torch.equal(main.grad, model.main_grad.float())


def test_with_a_loss_scaler_norm_and_clip_read_the_unscaled_gradients(monkeypatch):
    record_all_reduce(monkeypatch)
    scale = 1024.0
    child, named, raw, _ = build(group=RankGroup(1), scaler=ConstantScaler(scale))
    assert child.prepare_grads() is False  # megatron-core's unscale of the main grads
    norm = math.sqrt(counted_sumsq(named, raw)) / scale
    assert child.get_grad_norm().item() == pytest.approx(norm, rel=1e-6)
    assert child.count_zeros().item() == sum(
        int((raw[n] == 0).sum()) for n, p in named.items() if counted(p)
    )


def test_per_parameter_norms_read_what_the_norm_reads_over_its_group(monkeypatch):
    log = record_all_reduce(monkeypatch)
    child, named, raw, group = build()
    pn = child.per_param_grad_norms()
    got = pn.as_dict()
    for n, p in named.items():
        if counted(p):
            assert got[n] == pytest.approx(math.sqrt(3 * sumsq([raw[n]])), rel=1e-6), n
    assert pn.total.item() == pytest.approx(math.sqrt(3 * counted_sumsq(named, raw)), rel=1e-6)
    assert {g for g, _ in log} == {group}


def test_a_stub_optimizer_has_nothing_to_count(monkeypatch):
    log = record_all_reduce(monkeypatch)
    child, named, raw, group = build()
    stub = float16_child([], config(), group, RankGroup(1))
    stub.is_stub_optimizer = True
    stub._has_grad_norm_group_cache = {"mtp": False}
    enable_flat_norm(stub, [Chunk({}, [])])
    assert stub._flat.targets == [] and stub._flat.bindings is None
    assert stub.get_grad_norm().item() == 0.0
    assert stub.count_zeros().item() == 0
    assert len(log) == 2  # a stub rank still joins both collectives


def test_the_device_is_the_buffers(monkeypatch):
    buf = make_buffer([torch.nn.Parameter(torch.zeros(3))], torch.Generator())
    assert buffers_device([(buf, None, None)]) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert buffers_device([]) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert buffers_device([]) == torch.device("cuda", 3)
    assert buffers_device([(buf, None, None)]) == torch.device("cpu")


def test_the_default_group_is_not_the_optimizers(monkeypatch):
    """The recording fake tells the groups apart (guards the tests above)."""
    log = record_all_reduce(monkeypatch)
    t = torch.ones(())
    dist.all_reduce(t)
    assert t.item() == WORLD_SIZE and log == [(None, dist.ReduceOp.SUM)]
