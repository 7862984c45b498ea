"""megatron-core's ChainedOptimizer made flat (megatron_ext.flat_chain), on the CPU.

A dense and an expert child (megatron-core's Float16OptimizerWithFloat16Params, torch's SGD
at lr=1, so a step subtracts exactly the gradient it applied) in megatron-core's own
ChainedOptimizer, turned flat by the real :func:`megatron_ext.enable_flat_norm`. Groups
are :class:`RankGroup` objects: a group of k ranks multiplies a sum by k, so which group a
statistic went over shows in its value. Oracles: fp64 over the raw gradients drawn here.
"""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron_ext import enable_flat_norm
from megatron_ext.global_param_norms import concat_norms
from tests.support.optimizers import (
    FP32,
    Chunk,
    ConstantScaler,
    RankGroup,
    Spec,
    chain,
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
    Spec("sink", 40, FP32),
]
EXPERT = [Spec("e_split", 200, tp=True, expert=True), Spec("e_repl", 90, expert=True)]


class Built:
    """The chain, its children, and per child the raw gradients and parameters."""

    def __init__(
        self, groups=("shared",), clips=(1.0, 1.0), seed=0, scaler=None, kind="float16", **cfg
    ):
        gen = torch.Generator().manual_seed(seed)
        named, bufs, self.children, self.raw = {}, [], [], []
        shared = RankGroup(2, name="shared")
        self.groups = (
            [shared, shared]
            if groups == ("shared",)
            else [RankGroup(2, name="dense"), RankGroup(3, name="expert")]
        )
        base = config(clips[0], **cfg)
        for specs, group in zip((DENSE, EXPERT), self.groups, strict=True):
            params = make_params(specs, gen)
            by_dtype = {}
            for p in params:
                by_dtype.setdefault(p.dtype, []).append(p)
            mine = [make_buffer(ps, gen) for ps in by_dtype.values()]
            bufs += mine
            named.update({s.name: p for s, p in zip(specs, params, strict=True)})
            self.raw.append(
                {s.name: p.main_grad.double().clone() for s, p in zip(specs, params, strict=True)}
            )
            if kind == "float16":
                child = float16_child(
                    params, base, group, RankGroup(1), RankGroup(1), scaler=scaler
                )
            else:
                child = dist_child(params, mine, base, group, RankGroup(1), RankGroup(1), scaler)
            self.children.append(child)
        self.named = named
        self.opt = chain(self.children)
        for child, clip in zip(self.children, clips, strict=True):
            if clip != base.clip_grad:  # megatron-core's chain wants one config at construction
                child.config = config(clip, **cfg)
        enable_flat_norm(self.opt, [Chunk(named, bufs)])
        self.mains_before = [
            {n: m.detach().clone() for n, m in self.mains(i).items()} for i in range(2)
        ]

    def local(self, i) -> float:
        """Child ``i``'s counted sum of squares on this rank."""
        return sumsq(g for n, g in self.raw[i].items() if counted(self.named[n]))

    def mains(self, i) -> dict:
        """Child ``i``'s main parameters by model parameter name."""
        c = self.children[i]
        name = {id(p): n for n, p in self.named.items()}
        if isinstance(c, DistributedOptimizer):
            pairs = [
                *zip(c.model_float16_groups[0], c.shard_fp32_from_float16_groups[0], strict=True),
                *zip(c.model_fp32_groups[0], c.shard_fp32_groups[0], strict=True),
            ]
        else:
            pairs = [*zip(c.float16_groups[0], c.fp32_from_float16_groups[0], strict=True)]
            pairs += [(p, p) for p in c.fp32_from_fp32_groups[0]]
        return {name[id(model)]: main for model, main in pairs}

    def applied(self, i) -> dict:
        """What the step subtracted from child ``i``'s main parameters (fp64)."""
        return {
            n: (self.mains_before[i][n].double() - m.detach().double()).view(-1)
            for n, m in self.mains(i).items()
        }

    def assert_applied(self, i, coeff):
        for n, delta in self.applied(i).items():
            torch.testing.assert_close(delta, self.raw[i][n] * coeff, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["float16", "dist"])
def test_separate_groups_combine_as_the_root_of_the_sum_of_squares(monkeypatch, kind):
    log = record_all_reduce(monkeypatch)
    b = Built(groups=("dense", "expert"), kind=kind)
    assert not b.opt.grads_states_parallel_group_is_shared()
    want = math.sqrt(2 * b.local(0) + 3 * b.local(1))
    assert b.opt.get_grad_norm().item() == pytest.approx(want, rel=1e-6)
    assert [g for g, _ in log] == b.groups  # each child over its own group, in order


@pytest.mark.parametrize("kind", ["float16", "dist"])
def test_a_shared_group_is_one_norm_over_every_childs_spans(monkeypatch, kind):
    log = record_all_reduce(monkeypatch)
    b = Built(kind=kind)
    want = math.sqrt(2 * (b.local(0) + b.local(1)))
    assert b.opt.get_grad_norm().item() == pytest.approx(want, rel=1e-6)
    assert log == [(b.groups[0], dist.ReduceOp.SUM)]  # one all-reduce for both children


def test_the_chains_reducer_follows_a_new_group_object(monkeypatch):
    log = record_all_reduce(monkeypatch)
    b = Built()
    b.opt.get_grad_norm()
    other = RankGroup(7, name="other")
    for c in b.children:
        c.grad_stats_parallel_group = other
    want = math.sqrt(7 * (b.local(0) + b.local(1)))
    assert b.opt.get_grad_norm().item() == pytest.approx(want, rel=1e-6)
    assert log[-1][0] is other


@pytest.mark.parametrize("groups", [("shared",), ("dense", "expert")])
def test_zero_count_goes_over_the_optimizers_groups(monkeypatch, groups):
    log = record_all_reduce(monkeypatch)
    b = Built(groups=groups)
    zeros = [
        sum(int((g == 0).sum()) for n, g in b.raw[i].items() if counted(b.named[n]))
        for i in range(2)
    ]
    assert min(zeros) > 0
    sizes = [g.size() for g in b.groups]
    assert b.opt.count_zeros().item() == sizes[0] * zeros[0] + sizes[1] * zeros[1]
    assert [g for g, _ in log] == ([b.groups[0]] if groups == ("shared",) else b.groups)


def test_children_that_do_not_log_zeros_are_left_out_of_separate_counts(monkeypatch):
    record_all_reduce(monkeypatch)
    b = Built(groups=("dense", "expert"))
    b.children[1].config = config(zeros=False)
    dense = sum(int((g == 0).sum()) for n, g in b.raw[0].items() if counted(b.named[n]))
    assert b.opt.count_zeros().item() == 2 * dense


@pytest.mark.parametrize("groups", [("shared",), ("dense", "expert")])
def test_per_parameter_norms_over_the_chain(monkeypatch, groups):
    record_all_reduce(monkeypatch)
    b = Built(groups=groups)
    pn = b.opt.per_param_grad_norms()
    got = pn.as_dict()
    for i, group in enumerate(b.groups):
        for n, g in b.raw[i].items():
            if counted(b.named[n]):
                assert got[n] == pytest.approx(math.sqrt(group.size() * sumsq([g])), rel=1e-6)
    want = math.sqrt(b.groups[0].size() * b.local(0) + b.groups[1].size() * b.local(1))
    assert pn.total.item() == pytest.approx(want, rel=1e-6)


def test_concat_norms_concatenates_and_combines_totals_as_a_root_of_squares():
    from buffers.param_norms import ParamNorms

    gen = torch.Generator().manual_seed(5)
    parts = []
    for names in (("a", "b"), ("c",)):
        norms = torch.rand(len(names), generator=gen, dtype=torch.float64) + 0.5
        total = norms.square().sum().sqrt()
        parts.append(ParamNorms(total, norms, names, (True,) * len(names), 2.0))
    got = concat_norms(parts)
    assert got.names == ("a", "b", "c") and got.counted == (True, True, True)
    assert torch.equal(got.norms, torch.cat([p.norms for p in parts]))
    want = math.sqrt(sum(float(p.total) ** 2 for p in parts))
    assert got.total.item() == pytest.approx(want, rel=1e-12)
    assert concat_norms(parts[:1]) is parts[0]


@pytest.mark.parametrize("groups", [("shared",), ("dense", "expert")])
@pytest.mark.parametrize("clips", [(0.5, 0.5), (0.5, 2.0), (0.0, 0.5)])
def test_step_clips_each_child_by_its_own_coefficient_of_the_global_norm(
    monkeypatch, groups, clips
):
    record_all_reduce(monkeypatch)
    b = Built(groups=groups, clips=clips)
    total = math.sqrt(b.groups[0].size() * b.local(0) + b.groups[1].size() * b.local(1))
    assert total > 2 * max(clips)  # every clip bites
    ok, norm, zeros = b.opt.step()
    assert ok is True
    assert norm.item() == pytest.approx(total, rel=1e-6)
    assert zeros is not None and zeros.item() > 0
    for i, clip in enumerate(clips):
        b.assert_applied(i, clip / (total + 1e-6) if clip > 0 else 1.0)


def test_chain_clip_grad_norm_scales_every_child(monkeypatch):
    for groups in [("shared",), ("dense", "expert")]:
        record_all_reduce(monkeypatch)
        b = Built(groups=groups)
        b.opt.prepare_grads()
        total = math.sqrt(b.groups[0].size() * b.local(0) + b.groups[1].size() * b.local(1))
        assert b.opt.clip_grad_norm(0.0).item() == pytest.approx(total, rel=1e-6)
        assert b.opt.clip_grad_norm(1.0).item() == pytest.approx(total, rel=1e-6)
        for i in range(2):
            for n, main in b.mains(i).items():
                want = b.raw[i][n] / (total + 1e-6)
                torch.testing.assert_close(main.grad.double().view(-1), want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("clips", [(0.5, 0.5), (0.0, 0.5)])
def test_the_step_that_computes_per_parameter_norms_still_clips(monkeypatch, clips):
    record_all_reduce(monkeypatch)
    b = Built(clips=clips)
    b.opt.request_per_param_grad_norms()
    ok, norm, _ = b.opt.step()
    total = math.sqrt(2 * (b.local(0) + b.local(1)))
    assert ok is True and norm.item() == pytest.approx(total, rel=1e-6)
    for i, clip in enumerate(clips):
        b.assert_applied(i, clip / (total + 1e-6) if clip > 0 else 1.0)
    pn = b.opt.take_per_param_grad_norms()
    assert pn is not None and pn.total.item() == pytest.approx(total, rel=1e-6)
    assert b.opt.take_per_param_grad_norms() is None  # taken, and cleared
    b.opt.step()  # no request: nothing kept
    assert b.opt.take_per_param_grad_norms() is None


def test_a_non_finite_gradient_skips_the_step(monkeypatch):
    """megatron-core's prepare_grads finds the inf in the unscaled main grads: no norm, no
    clip, no update; the scaler is told."""
    record_all_reduce(monkeypatch)
    scaler = ConstantScaler(8.0)
    b = Built(scaler=scaler)
    b.named["e_split"].main_grad[3] = math.inf
    assert b.opt.step() == (False, None, None)
    assert scaler.updates and scaler.updates[-1] is True
    for i in range(2):
        assert all(torch.equal(m, b.mains_before[i][n]) for n, m in b.mains(i).items())


def test_finite_scaled_gradients_step_with_the_unscaled_clip(monkeypatch):
    record_all_reduce(monkeypatch)
    scaler = ConstantScaler(8.0)
    b = Built(scaler=scaler, clips=(0.5, 0.5))
    ok, norm, _ = b.opt.step()
    total = math.sqrt(2 * (b.local(0) + b.local(1))) / 8.0
    assert ok is True and scaler.updates == [False, False]
    assert norm.item() == pytest.approx(total, rel=1e-6)
    for i in range(2):
        b.assert_applied(i, 0.5 / (total + 1e-6) / 8.0)


@pytest.mark.parametrize("above", [True, False])
def test_a_norm_above_the_skip_threshold_skips_the_update(monkeypatch, above):
    record_all_reduce(monkeypatch)
    probe = Built(clips=(0.0, 0.0))
    total = math.sqrt(2 * (probe.local(0) + probe.local(1)))
    threshold = total / 2 if above else total * 2
    b = Built(clips=(0.0, 0.0), threshold=threshold)
    ok, norm, zeros = b.opt.step()
    assert norm.item() == pytest.approx(total, rel=1e-6) and zeros is not None
    assert ok is (not above)
    for i in range(2):
        if above:
            assert all(torch.equal(m, b.mains_before[i][n]) for n, m in b.mains(i).items())
        else:
            b.assert_applied(i, 1.0)


@pytest.mark.parametrize("clip", [0.5, 0.0])
def test_a_chain_of_one_is_its_child(monkeypatch, clip):
    log = record_all_reduce(monkeypatch)
    gen = torch.Generator().manual_seed(2)
    params = make_params(DENSE, gen)
    named = {s.name: p for s, p in zip(DENSE, params, strict=True)}
    bufs = [make_buffer([p for p in params if p.dtype == dt], gen) for dt in (torch.bfloat16, FP32)]
    raw = {n: p.main_grad.double().clone() for n, p in named.items()}
    group = RankGroup(3)
    child = float16_child(params, config(clip), group, RankGroup(1))
    opt = enable_flat_norm(chain([child]), [Chunk(named, bufs)])
    assert opt._flat.norm_clip is None  # everything goes to the child
    local = sumsq(g for n, g in raw.items() if counted(named[n]))
    total = math.sqrt(3 * local)
    assert opt.get_grad_norm().item() == pytest.approx(total, rel=1e-6)
    assert opt.per_param_grad_norms().total.item() == pytest.approx(total, rel=1e-6)
    assert opt.clip_grad_norm(1e9).item() == pytest.approx(total, rel=1e-6)  # no clip
    before = {id(m): m.detach().clone() for m in child.fp32_from_float16_groups[0]}
    ok, norm, zeros = opt.step()
    assert ok is True and norm.item() == pytest.approx(total, rel=1e-6)
    assert {g for g, _ in log} == {group}
    name = {id(p): n for n, p in named.items()}
    for model, main in zip(child.float16_groups[0], child.fp32_from_float16_groups[0], strict=True):
        delta = (before[id(main)].double() - main.detach().double()).view(-1)
        want = raw[name[id(model)]] * (clip / (total + 1e-6) if clip > 0 else 1.0)
        torch.testing.assert_close(delta, want, rtol=1e-5, atol=1e-5)


def test_a_stub_distributed_optimizer_in_the_chain_adds_nothing(monkeypatch):
    """A rank with no parameters for one optimizer gets megatron-core's stub (built with
    ``optimizer=None``: no buffers, no groups, only these attributes)."""
    log = record_all_reduce(monkeypatch)
    gen = torch.Generator().manual_seed(6)
    params = make_params(DENSE, gen)
    named = {s.name: p for s, p in zip(DENSE, params, strict=True)}
    bufs = [make_buffer([p for p in params if p.dtype == dt], gen) for dt in (torch.bfloat16, FP32)]
    raw = {n: p.main_grad.double().clone() for n, p in named.items()}
    group = RankGroup(2)
    cfg = config(0.5)
    child = float16_child(params, cfg, group, RankGroup(1))
    stub = DistributedOptimizer.__new__(DistributedOptimizer)
    stub.optimizer, stub.config, stub.grad_scaler, stub.init_state_fn = None, cfg, None, None
    stub.model_chunks, stub.is_stub_optimizer = [], True
    stub.ddp_config = SimpleNamespace(use_megatron_fsdp=False, overlap_param_gather=False)
    stub.grad_stats_parallel_group = group
    opt = enable_flat_norm(chain([child, stub]), [Chunk(named, bufs)])
    assert stub._flat.targets == []
    local = sumsq(g for n, g in raw.items() if counted(named[n]))
    total = math.sqrt(2 * local)
    assert opt.get_grad_norm().item() == pytest.approx(total, rel=1e-6)
    zeros = sum(int((g == 0).sum()) for n, g in raw.items() if counted(named[n]))
    assert opt.count_zeros().item() == 2 * zeros
    before = {id(m): m.detach().clone() for m in child.fp32_from_float16_groups[0]}
    ok, norm, _ = opt.step()
    assert ok is True and norm.item() == pytest.approx(total, rel=1e-6)
    name = {id(p): n for n, p in named.items()}
    for model, main in zip(child.float16_groups[0], child.fp32_from_float16_groups[0], strict=True):
        delta = (before[id(main)].double() - main.detach().double()).view(-1)
        want = raw[name[id(model)]] * 0.5 / (total + 1e-6)
        torch.testing.assert_close(delta, want, rtol=1e-5, atol=1e-5)
    assert {g for g, _ in log} == {group}
