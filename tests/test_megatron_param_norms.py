"""Per-parameter norms of megatron-core optimizers (megatron_ext.global_param_norms), on the CPU.

Ranks are simulated as in tests/test_megatron_distopt_ranks.py (tests/support/distopt_ranks.py):
megatron-core's own range functions decide what each data-parallel rank owns; each rank's
stats are computed in turn, the names are matched across ranks as the all-gather would, and
the per-rank wire vectors are summed as the all-reduce would. Oracle: fp64 norms of each
parameter's whole, unsharded gradient.
"""

import math
import types

import pytest
import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from megatron_ext.global_param_norms import MegatronParamNorms, global_param_names
from megatron_ext.opt_state import _build_state
from tests.support.distopt_ranks import child_for_rank, reduce_ranks
from tests.support.fakes import FakeGroup

pytestmark = pytest.mark.mcore


def names_of(bufs, placed):
    """id(param) -> the name megatron_ext.DistributedDataParallel's layout gave it."""
    out = {}
    for buf, (_, layout, _) in zip(bufs, placed, strict=True):
        by_span = {(r.start, r.end): r.name for r in layout.records}
        for p, (s, e, _) in buf.param_index_map.items():
            out[id(p)] = by_span[(s, e)]
    return out


def fp64_norms(bufs, names):
    return {
        names[id(p)]: buf.grad_data[s:e].double().norm().item()
        for buf in bufs
        for p, (s, e, _) in buf.param_index_map.items()
    }


def reference(dp):
    """fp64 norm of each parameter's whole gradient, from a fresh (never unscaled) build."""
    _, bufs, placed, _ = child_for_rank(dp, 0)
    return fp64_norms(bufs, names_of(bufs, placed))


def split_over_tp(bufs, placed, split):
    """Mark the parameters named in ``split`` as split across tensor-parallel ranks."""
    for buf in bufs:
        for p in buf.param_index_map:
            if names_of(bufs, placed)[id(p)] in split:
                p.tensor_model_parallel = True


def build_rank(dp, rank, *, tp_rank=0, tp=None, scaled=False, scale=1.0, seed=1, split=()):
    child, bufs, placed, _ = child_for_rank(dp, rank, scaled=scaled, seed=seed)
    split_over_tp(bufs, placed, split)
    child.tp_group = FakeGroup(tp_rank, tp or (2 if tp_rank else 1))
    state = _build_state(child, placed)
    for dst, src in (c for t in state.targets for c in t.copies):
        dst.copy_(src)
    if scaled:  # megatron-core's unscale, in place, on what the optimizer reads
        for _, _, view in state.bindings:
            view.div_(scale)
    names = names_of(bufs, placed)
    return MegatronParamNorms(state.targets, names, torch.device("cpu")), bufs, names, state


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_distributed_optimizer_shards_add_up_to_each_parameters_fp64_norm(monkeypatch, dp):
    per_rank = [build_rank(dp, r) for r in range(dp)]
    union, norms = reduce_ranks(monkeypatch, [x[0] for x in per_rank])
    bufs = per_rank[0][1]
    want = reference(dp)
    assert set(union.names) == set(want)  # every parameter, owned on some rank or not
    for i, name in enumerate(union.names):
        assert math.isclose(norms[i].item(), want[name], rel_tol=1e-6), (dp, name)
    # The total is the counted parameters' norm: the shared one is reported, not counted.
    counted = sum(
        buf.grad_data[s:e].double().square().sum().item()
        for buf in bufs
        for p, (s, e, _) in buf.param_index_map.items()
        if param_is_not_shared(p)
    )
    assert math.isclose(norms[-1].item(), math.sqrt(counted), rel_tol=1e-6)
    shared = [n for n, c in zip(union.names, union.counted, strict=True) if not c]
    assert shared == ["bf16.2"]
    # sqrt of the sum of the counted squares is the total
    sq = sum(norms[i].item() ** 2 for i, c in enumerate(union.counted) if c)
    assert math.isclose(math.sqrt(sq), norms[-1].item(), rel_tol=1e-6)
    # and equals what the optimizer's own total norm reads (its norm views), over ranks
    total = sum(
        v.double().square().sum().item() for x in per_rank for g in x[3].norm_groups for v in g
    )
    assert math.isclose(norms[-1].item(), math.sqrt(total), rel_tol=1e-6)


def test_with_a_loss_scaler_the_norms_read_the_unscaled_copies(monkeypatch):
    dp, scale = 2, 1024.0
    per_rank = [build_rank(dp, r, scaled=True, scale=scale) for r in range(dp)]
    assert all(t.norm_reads_mirror for x in per_rank for t in x[3].targets if t.mirror is not None)
    union, norms = reduce_ranks(monkeypatch, [x[0] for x in per_rank])
    want = reference(dp)
    for i, name in enumerate(union.names):
        assert math.isclose(norms[i].item(), want[name] / scale, rel_tol=1e-6), name


def test_tensor_parallel_duplicates_are_reported_once(monkeypatch):
    # Two TP ranks x two DP ranks holding the same replicated parameters: TP rank 1's
    # copies are duplicates (uncounted), so each norm must come from TP rank 0 alone.
    ranks = [build_rank(2, dp_rank, tp_rank=tp) for tp in (0, 1) for dp_rank in (0, 1)]
    assert not any(ranks[2][0].counted) and all(
        c for n, c in zip(ranks[0][0].names, ranks[0][0].counted, strict=True) if n != "bf16.2"
    )
    union, norms = reduce_ranks(monkeypatch, [x[0] for x in ranks])
    want = reference(2)
    for i, name in enumerate(union.names):
        # bf16.2 (shared) is counted nowhere but reported all the same: from TP rank 0's
        # copy too, since TP rank 1's is a replica of it
        assert math.isclose(norms[i].item(), want[name], rel_tol=1e-6), name


class _Layer(torch.nn.Module):
    def __init__(self, number, experts=None):
        super().__init__()
        self.layer_number = number
        self.norm = torch.nn.Linear(2, 2, bias=False)
        if experts is not None:
            self.mlp = experts


class _Sequential(torch.nn.Module):
    def __init__(self, ep_rank, ep, local):
        super().__init__()
        self.ep_group = FakeGroup(ep_rank, ep)
        self.num_local_experts = local
        self.local_experts = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(local))


class _Grouped(torch.nn.Module):
    def __init__(self, ep_rank, ep, local):
        super().__init__()
        self.ep_group = FakeGroup(ep_rank, ep)
        self.num_local_experts = local
        self.fc = torch.nn.Module()
        for i in range(local):
            self.fc.register_parameter(f"weight{i}", torch.nn.Parameter(torch.zeros(2)))


def test_global_names_use_global_layer_and_expert_indices():
    # The second pipeline stage of a 4-layer model (layer numbers 3 and 4, 1-based) on
    # expert rank 1 of 2 with 2 local experts per rank.
    decoder = torch.nn.Module()
    decoder.layers = torch.nn.ModuleList(
        [_Layer(3, _Sequential(1, 2, 2)), _Layer(4, _Grouped(1, 2, 2))]
    )
    model = torch.nn.Module()
    model.decoder = decoder
    names = set(global_param_names(model).values())
    assert names == {
        "decoder.layers.2.norm.weight",
        "decoder.layers.2.mlp.local_experts.2.weight",
        "decoder.layers.2.mlp.local_experts.2.bias",
        "decoder.layers.2.mlp.local_experts.3.weight",
        "decoder.layers.2.mlp.local_experts.3.bias",
        "decoder.layers.3.norm.weight",
        "decoder.layers.3.mlp.fc.weight2",
        "decoder.layers.3.mlp.fc.weight3",
    }
    # A module without layer numbers or expert groups keeps named_parameters()'s names.
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert set(global_param_names(plain).values()) == {n for n, _ in plain.named_parameters()}


# -- the per-parameter norms against megatron-core's own norm filter ------------------------
# Oracle: megatron-core's optimizer filter (get_grads_for_grad_norm / 0.18's
# get_main_grads_for_grad_norm, which apply param_is_not_shared and
# param_is_not_tensor_parallel_duplicate) over main parameters built as its distributed
# optimizer builds them, and its get_grad_norm_fp32 run on the CPU (its "cuda" allocations
# made on the CPU, its all-reduce done here as the SUM of the ranks' squares it is).


def megatron_main_params(child, held):
    """This rank's fp32 main parameters as megatron-core's distributed optimizer makes them:
    the shard of each held parameter, tensor-parallel attributes and ``shared`` copied, its
    ``.grad`` the shard of the parameter's gradient (what the optimizer's copy step leaves)."""
    from megatron.core import tensor_parallel

    mains = []
    for p in held:
        r = child._get_model_param_range_map(p)["param"]
        main = torch.nn.Parameter(p.detach().view(-1)[r.start : r.end].float().clone())
        tensor_parallel.copy_tensor_model_parallel_attributes(main, p)
        if hasattr(p, "shared"):  # megatron-core's copy_optimizer_param_metadata / 0.18's copy
            main.shared = p.shared
        main.grad = p.main_grad.view(-1)[r.start : r.end].float().clone()
        mains.append(main)
    return mains


def megatron_grads_for_norm(child, mains):
    """megatron-core's own choice of the gradients its norm counts on this rank."""
    opt = object.__new__(type(child))
    opt.config = types.SimpleNamespace(
        use_precision_aware_optimizer=False, use_precision_aware_optimizer_no_fp8_or_ds_fp8=False
    )
    opt.tp_group, opt.expert_tp_group = child.tp_group, child.expert_tp_group
    opt.get_parameters = lambda: mains
    if hasattr(opt, "get_grads_for_grad_norm"):  # megatron-core 0.19+
        return opt.get_grads_for_grad_norm()
    return opt.get_main_grads_for_grad_norm()  # 0.18


def megatron_local_norm_sq(grads):
    """megatron-core's get_grad_norm_fp32 on this rank, all-reduce left out: its square is
    what this rank adds to the SUM all-reduce."""
    from megatron.core.optimizer import clip_grads

    fn = clip_grads.get_grad_norm_fp32
    assert fn.__module__ == "megatron.core.optimizer.clip_grads", "megatron_ext.install() is on"
    zeros, tensor = torch.zeros, torch.tensor

    def on_cpu(make):
        def made(*args, device=None, **kwargs):
            return make(*args, device="cpu" if device == "cuda" else device, **kwargs)

        return made

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "zeros", on_cpu(zeros))
        mp.setattr(torch, "tensor", on_cpu(tensor))
        mp.setattr(dist, "all_reduce", lambda t, op=None, group=None, async_op=False: None)
        norm = fn(grads, grad_stats_parallel_group=None)
    return float(norm) ** 2


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("split", [(), ("bf16.2",)], ids=["replicated", "shared-split"])
def test_shared_parameters_against_megatron_cores_own_filter(monkeypatch, tp, split):
    # TP x DP = tp x 2 ranks holding the same parameters, none split across TP ranks but
    # those in `split` (a vocab-parallel tied output weight is shared and split: its TP
    # pieces add up). bf16.2 is `shared`. Fresh random gradients (a seed per tp).
    dp = 2
    grid = [(t, d) for t in range(tp) for d in range(dp)]
    ours, oracle_total_sq, oracle = [], 0.0, {}
    for t, d in grid:
        ours.append(build_rank(dp, d, tp_rank=t, tp=tp, seed=100 + tp, split=split)[0])
        # the oracle's own build of the same rank: same gradients, its own tensors
        child, bufs, placed, held = child_for_rank(dp, d, seed=100 + tp)
        split_over_tp(bufs, placed, split)
        child.tp_group = FakeGroup(t, tp)
        mains = megatron_main_params(child, held)
        grads = megatron_grads_for_norm(child, mains)
        oracle_total_sq += megatron_local_norm_sq(grads)
        names = names_of(bufs, placed)
        for p, main in zip(held, mains, strict=True):
            # A parameter's own norm: the copies megatron-core does not call tensor-parallel
            # duplicates (its shared filter is about the total, not about the copies).
            if param_is_not_tensor_parallel_duplicate(main, tp_group=child.tp_group):
                sq = main.grad.double().square().sum().item()
                oracle[names[id(p)]] = oracle.get(names[id(p)], 0.0) + sq
    union, norms = reduce_ranks(monkeypatch, ours)
    counted = dict(zip(union.names, union.counted, strict=True))
    assert counted["bf16.2"] is False and sum(counted.values()) == len(counted) - 1
    # 1. the total is megatron-core's global norm
    assert math.isclose(norms[-1].item(), math.sqrt(oracle_total_sq), rel_tol=1e-6)
    # 2. the counted per-parameter norms add up to it (sum of squares = total squared)
    sq = sum(norms[i].item() ** 2 for i, n in enumerate(union.names) if counted[n])
    assert math.isclose(sq, oracle_total_sq, rel_tol=1e-6)
    # 3. every parameter's norm is its gradient's norm, the shared one included: each
    #    tensor-parallel replica is the same gradient, counted once (not sqrt(tp) times);
    #    pieces of a split one add up (the fake gives every TP piece the same values)
    for i, name in enumerate(union.names):
        assert math.isclose(norms[i].item(), math.sqrt(oracle[name]), rel_tol=1e-6), (
            name,
            norms[i].item() / math.sqrt(oracle[name]),
        )
