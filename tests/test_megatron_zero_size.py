"""Zero-size parameters in offset matching, on the CPU.

megatron-core lays a zero-size parameter out at the (64-aligned) start of the next
parameter, so two parameters share a start; anything that finds a parameter by its start
alone gives the zero-size one its neighbour's flags. Buffers are laid out by megatron-core's
own layout function where it has one (0.19+), else by the same rule
(tests/test_megatron_distopt_ranks.py); ownership by megatron-core's range functions.
Oracles: megatron-core's param_is_not_shared / param_is_not_tensor_parallel_duplicate for
the verdicts, fp64 sums over the raw gradient tensors for the norms.
"""

import math
import types

import pytest
import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from megatron_ext.ddp import counted_records
from megatron_ext.global_param_norms import MegatronParamNorms
from megatron_ext.layout import buffer_layout
from megatron_ext.opt_state import _build_state
from tests.support.distopt_ranks import layout as mirrored_layout
from tests.support.distopt_ranks import reduce_ranks
from tests.support.fakes import FakeGroup, megatron_buffer

pytestmark = pytest.mark.mcore

BF16 = torch.bfloat16

# In layout order: every zero-size parameter shares its start with the one after it, and
# its flags differ from that one's.
SPECS = [
    ("a", 100, {}),
    ("z_shared", 0, {"shared": True}),  # before a counted one
    ("b", 300, {}),
    ("z_split", 0, {"tensor_model_parallel": True}),  # before a TP duplicate (rank > 0)
    ("c", 200, {}),
    ("z_one", 0, {}),  # two zero-size ones before a shared one
    ("z_two", 0, {"tensor_model_parallel": True}),
    ("d", 130, {"shared": True}),
    ("e", 1700, {"tensor_model_parallel": True}),
    ("z_last", 0, {"shared": True}),  # the last one: nothing after it
]


def make_params():
    params, names = [], {}
    for name, n, flags in SPECS:
        p = torch.nn.Parameter(torch.zeros(n, dtype=BF16))
        for k, v in flags.items():
            setattr(p, k, v)
        params.append(p)
        names[p] = name
    return params, names


def megatron_layout(params, dp, bucket_elems):
    """(param_index_map, bucket ranges, numel): megatron-core's layout where it has one."""
    compute = getattr(DistributedOptimizer, "_compute_per_buffer_param_layout", None)
    if compute is None:  # megatron-core 0.18: the same start rule, mirrored by the test helper
        return mirrored_layout(params, dp, bucket_elems)
    config = types.SimpleNamespace(pad_buckets_for_high_nccl_busbw=False)
    # megatron-core lays out params[::-1] (backprop order); hand it them reversed
    lay = compute(params[::-1], bucket_elems, dp, config)
    return lay.param_index_map, lay.bucket_indices, lay.bucket_indices[-1][1]


def fake_buffer(params, dp, rank, seed):
    index, buckets, numel = megatron_layout(params, dp, 1500)
    gen = torch.Generator().manual_seed(seed)
    grad = torch.zeros(numel, dtype=BF16)
    for s, e, _ in index.values():
        grad[s:e] = (torch.randn(e - s, generator=gen, dtype=torch.float64) * 3).to(BF16)
    return megatron_buffer(grad, index, buckets, FakeGroup(rank, dp))


def test_the_layout_puts_zero_size_parameters_at_their_neighbours_start():
    params, names = make_params()
    index = megatron_layout(params, 2, 1500)[0]
    start = {names[p]: s for p, (s, _, _) in index.items()}
    assert start["z_shared"] == start["b"] and start["z_split"] == start["c"]
    assert start["z_one"] == start["z_two"] == start["d"]


def megatron_counts(p, tp_rank, tp):
    """megatron-core's own verdict: does this rank's copy of ``p`` count toward the norm."""
    group = FakeGroup(tp_rank, tp)
    return param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p, tp_group=group)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_every_records_verdict_is_its_own_parameters(tp_rank):
    params, names = make_params()
    buf = fake_buffer(params, 1, 0, seed=5)
    group = FakeGroup(tp_rank, 2)
    records = counted_records(buf, buffer_layout(buf, names).records, group, group)
    assert sorted(r.name for r in records) == sorted(names.values())
    by_name = {n: p for p, n in names.items()}
    wrong = {
        r.name: r.excluded_because
        for r in records
        if (r.excluded_because is None) != megatron_counts(by_name[r.name], tp_rank, 2)
    }
    assert not wrong, f"verdicts that are not megatron-core's: {wrong}"


def build_rank(dp, rank, tp_rank, tp, seed):
    """This data-parallel rank's distributed optimizer over the zero-size model, and the
    per-parameter norms its flat state reads."""
    params, names = make_params()
    buf = fake_buffer(params, dp, rank, seed)
    child = object.__new__(DistributedOptimizer)
    child.config = types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)
    child.grad_scaler = None
    child.tp_group = child.expert_tp_group = FakeGroup(tp_rank, tp)
    child.buffers = [buf]
    child.gbuf_ranges = [DistributedOptimizer._build_gbuf_range_map(buf)]
    child.model_param_gbuf_map = DistributedOptimizer._build_model_param_gbuf_map(child.gbuf_ranges)
    _, ranges = DistributedOptimizer._build_optimizer_group_ranges(
        [{"params": params}], child.gbuf_ranges
    )
    held = ranges[0]["params"]

    def shard(p):
        r = child._get_model_param_range_map(p)["param"]
        return p.detach().view(-1)[r.start : r.end]

    child.model_float16_groups = [list(held)]
    child.shard_fp32_from_float16_groups = [[shard(p).float() for p in held]]
    child.model_fp32_groups = [[]]
    child.shard_fp32_groups = [[]]
    for p in held:
        s, e, _ = buf.param_index_map[p]
        p.main_grad = buf.grad_data[s:e]
    placed = [(buf, buffer_layout(buf, names), None)]
    state = _build_state(child, placed)
    for dst, src in (c for t in state.targets for c in t.copies):
        dst.copy_(src)
    ids = {id(p): n for p, n in names.items()}
    return MegatronParamNorms(state.targets, ids, torch.device("cpu")), state, buf, names


@pytest.mark.parametrize("dp, tp", [(1, 2), (2, 2), (4, 1)])
def test_norms_and_per_parameter_norms_with_zero_size_parameters(monkeypatch, dp, tp):
    seed = 10 * dp + tp
    per_rank = [build_rank(dp, r, t, tp, seed) for t in range(tp) for r in range(dp)]
    union, norms = reduce_ranks(monkeypatch, [x[0] for x in per_rank])
    _, _, buf, names = per_rank[0]
    by_name = {n: p for p, n in names.items()}
    whole = {names[p]: buf.grad_data[s:e].double() for p, (s, e, _) in buf.param_index_map.items()}
    # every parameter is listed once, zero-size ones included, with megatron-core's verdict
    assert sorted(union.names) == sorted(whole)
    counted = dict(zip(union.names, union.counted, strict=True))
    ranks = [(t, r) for t in range(tp) for r in range(dp)]
    for (t, _), (pn, _, _, _) in zip(ranks, per_rank, strict=True):  # each rank's verdicts
        mine = dict(zip(pn.names, pn.counted, strict=True))
        assert mine == {n: megatron_counts(p, t, tp) for n, p in by_name.items()}, t
    for name, p in by_name.items():
        assert counted[name] == any(megatron_counts(p, t, tp) for t in range(tp)), name

    # Oracle: each TP rank's copy of a parameter is its whole gradient here (the fake gives
    # the pieces of a TP-split parameter equal values); megatron-core's filter says which
    # copies its total counts, and (its shared filter aside) which are one parameter's
    # pieces rather than replicas.
    def oracle_sq(name, ignore_shared=False):
        p = by_name[name]
        copies = sum(
            param_is_not_tensor_parallel_duplicate(p, tp_group=FakeGroup(t, tp))
            and (ignore_shared or param_is_not_shared(p))
            for t in range(tp)
        )
        return copies * whole[name].square().sum().item()

    want_sq = sum(oracle_sq(n) for n in whole)
    assert math.isclose(norms[-1].item() ** 2, want_sq, rel_tol=1e-6)
    views_sq = sum(
        v.double().square().sum().item() for x in per_rank for g in x[1].norm_groups for v in g
    )
    assert math.isclose(views_sq, want_sq, rel_tol=1e-6)
    for i, name in enumerate(union.names):
        want = math.sqrt(oracle_sq(name, ignore_shared=True))
        assert math.isclose(norms[i].item(), want, rel_tol=1e-6), name
        if whole[name].numel() == 0:
            assert norms[i].item() == 0.0, name


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_the_norm_audit_keys_each_parameter_by_its_own_flags(tp_rank):
    from megatron_ext import norm_audit

    _, state, buf, names = build_rank(2, 0, tp_rank, 2, seed=7)
    by_name = {n: p for p, n in names.items()}
    (target,) = state.targets
    claims = norm_audit._target_claims(0, buf, target, norm_audit.ParallelRanks(tp=tp_rank))
    assert sorted(c.key.name for c in claims) == sorted(names.values())
    for c in claims:
        split = getattr(by_name[c.key.name], "tensor_model_parallel", False)
        assert c.key.tp_piece == (tp_rank if split else None), c.key.name
        assert c.numel == by_name[c.key.name].numel(), c.key.name


def test_records_that_are_not_the_buffers_layout_are_refused():
    params, names = make_params()
    buf = fake_buffer(params, 1, 0, seed=5)
    records = buffer_layout(buf, names).records
    group = FakeGroup(0, 1)
    for wrong in (records[:-1], (records[1], records[0], *records[2:]), records[::-1]):
        with pytest.raises(ValueError, match="not the layout of this buffer"):
            counted_records(buf, wrong, group, group)
