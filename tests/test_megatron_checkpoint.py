"""The flat optimizer class's checkpoint-load fixes, on the CPU with torch's Adam.

megatron-core's DistributedOptimizer needs CUDA; these tests call the two overridden methods
on a small stand-in holding exactly the attributes they read (the GPU round trips are in
tests/gpu/test_reliability_gpu.py).
"""

import copy
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_ext.flat_optimizer import FlatNormOptimizer  # noqa: E402

pytestmark = pytest.mark.mcore


def _stepped_adam(n_params=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5 + i, generator=g)) for i in range(n_params)]
    adam = torch.optim.Adam(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    adam.step()
    return params, adam


def _stand_in(adam, params, precision_aware=False, base=None):
    return SimpleNamespace(
        config=SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=precision_aware),
        model_param_group_index_map={p: (0, i) for i, p in enumerate(params)},
        optimizer=adam,
        _flat_base=base,
    )


def test_set_state_copies_every_tensor_and_keeps_the_restored_step():
    params, adam = _stepped_adam()
    me = _stand_in(adam, params)
    target = params[1]
    g = torch.Generator().manual_seed(7)
    src = {k: torch.randn(target.shape, generator=g) for k in ("param", "exp_avg", "exp_avg_sq")}
    src["step"] = torch.tensor(99.0)  # dp_reshardable carries a stale step: must be ignored
    step_before = adam.state[target]["step"].clone()
    FlatNormOptimizer._set_main_param_and_optimizer_states(me, target, src)
    assert torch.equal(target.detach(), src["param"])
    assert torch.equal(adam.state[target]["exp_avg"], src["exp_avg"])
    assert torch.equal(adam.state[target]["exp_avg_sq"], src["exp_avg_sq"])
    assert torch.equal(adam.state[target]["step"], step_before)
    # an fp32 shard that is a view of a leaf requiring grad: the copy runs under no_grad
    assert target.requires_grad


def test_set_state_without_step_works_and_missing_state_is_named():
    params, adam = _stepped_adam()
    me = _stand_in(adam, params)
    target = params[0]
    src = {"param": torch.zeros(target.shape), "exp_avg": torch.ones(target.shape)}
    with pytest.raises(KeyError, match=r"exp_avg_sq.*shape \(5,\)"):
        FlatNormOptimizer._set_main_param_and_optimizer_states(me, target, src)
    src["exp_avg_sq"] = torch.full(target.shape, 2.0)  # fully_reshardable: no step at all
    FlatNormOptimizer._set_main_param_and_optimizer_states(me, target, src)
    assert torch.equal(adam.state[target]["exp_avg_sq"], src["exp_avg_sq"])
    assert torch.equal(target.detach(), torch.zeros(target.shape))


def test_set_state_skips_non_tensor_entries_as_megatron_does():
    params, adam = _stepped_adam()
    me = _stand_in(adam, params)
    target = params[2]
    before = {k: v.clone() for k, v in adam.state[target].items()}
    src = {"param": None, "exp_avg": None, "exp_avg_sq": torch.full(target.shape, 3.0)}
    FlatNormOptimizer._set_main_param_and_optimizer_states(me, target, src)
    assert torch.equal(adam.state[target]["exp_avg"], before["exp_avg"])
    assert torch.equal(adam.state[target]["exp_avg_sq"], src["exp_avg_sq"])


def test_load_state_dict_gives_each_parameter_its_own_step():
    params, adam = _stepped_adam()
    shared = torch.tensor(3.0)

    class Base:
        def load_state_dict(self, state_dict):  # what megatron-core 0.19.2 leaves behind
            for state in self.optimizer.state.values():
                state["step"] = shared

    me = _stand_in(adam, params, base=Base)
    FlatNormOptimizer.load_state_dict(me, {})
    steps = [adam.state[p]["step"] for p in params]
    assert len({id(s) for s in steps}) == len(params)
    assert all(float(s) == 3.0 for s in steps)

    # With the aliasing gone, one more step advances every parameter's step by exactly 1,
    # and the update matches a fresh Adam whose state was loaded the ordinary way.
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = torch.optim.Adam(ref_params, lr=1e-2)
    ref.load_state_dict(copy.deepcopy(adam.state_dict()))  # its own tensors
    for a, b in zip(params, ref_params, strict=True):
        a.grad = torch.ones_like(a)
        b.grad = torch.ones_like(b)
    adam.step()
    ref.step()
    assert all(float(adam.state[p]["step"]) == 4.0 for p in params)
    for a, b in zip(params, ref_params, strict=True):
        assert torch.equal(a, b)


def test_float16_sharded_state_dict_pairs_states_with_their_own_parameters():
    """Float16OptimizerWithFloat16Params layout with fp32 parameters *before* a bf16 one in a
    group: every saved state and main copy must be keyed by its own parameter's name."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

    from megatron_ext.opt_checkpoint import _float16_sharded_state_dict

    g = torch.Generator().manual_seed(3)
    shapes = {"w": (4, 3), "b": (4,), "alpha": (3,), "sink": (5,)}
    model = {
        n: torch.nn.Parameter(
            torch.randn(s, generator=g).to(
                torch.float32 if n in ("alpha", "sink") else torch.bfloat16
            )
        )
        for n, s in shapes.items()
    }
    main = {n: model[n].detach().float().clone().requires_grad_() for n in ("w", "b")}
    groups = [[main["w"]], [model["alpha"], main["b"], model["sink"]]]  # fp32 first in group 1
    adam = torch.optim.Adam([{"params": gr} for gr in groups], lr=1e-2)
    for q in (p for gr in groups for p in gr):
        q.grad = torch.randn(q.shape, generator=g)
    adam.step()
    fp32_from_float16 = [[main["w"]], [main["b"]]]
    opt = SimpleNamespace(
        float16_groups=[[model["w"]], [model["b"]]],
        fp32_from_float16_groups=fp32_from_float16,
        fp32_from_fp32_groups=[[], [model["alpha"], model["sink"]]],
        optimizer=adam,
        config=None,
        init_state_fn=None,
        state_dict=lambda: {
            "optimizer": adam.state_dict(),
            "fp32_from_fp16_params": fp32_from_float16,
        },
        _extract_common_per_param_step=MixedPrecisionOptimizer._extract_common_per_param_step,
    )
    model_sd = {n: ShardedTensor.from_rank_offsets(n, p) for n, p in model.items()}
    out = _float16_sharded_state_dict(opt, model_sd)
    owner = {
        id(q): n for n, q in [*main.items(), ("alpha", model["alpha"]), ("sink", model["sink"])]
    }
    inner = [q for gr in groups for q in gr]
    for idx, state in out["optimizer"]["state"].items():
        if idx == "common_step":
            continue
        name = owner[id(inner[idx])]
        for key in ("exp_avg", "exp_avg_sq"):
            sh = state[key]
            assert sh.key == f"optimizer.state.{key}.{name}", (idx, sh.key)
            assert torch.equal(sh.data, adam.state[inner[idx]][key])
    mains = [sh for gr in out["fp32_from_fp16_params"] for sh in gr]
    assert [sh.key for sh in mains] == [
        "optimizer.state.fp32_param.w",
        "optimizer.state.fp32_param.b",
    ]
    assert torch.equal(mains[1].data, main["b"])
