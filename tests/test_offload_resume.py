"""Resuming CPU-offloaded training from a checkpoint, on the CPU: the continuation after a
save and a load into fresh buffers and a fresh optimizer equals the uninterrupted run, bit
for bit, at offload fractions 0, 0.5 and 1, with either offload step before and after.

The GPU-resident part of a ``HybridDeviceOptimizer`` is stepped by transformer-engine's
``FusedAdam`` on a GPU machine, which counts steps per param group; :class:`GroupStepAdam`
counts them the same way here. The checkpoint's param groups go through megatron-core's own
``DistributedOptimizer.state_dict`` / ``load_state_dict`` as they do with transformer-engine
installed (its module flag set for the call): the saved ``step`` is written into the groups.
"""

from __future__ import annotations

import types

import pytest
import torch
from megatron.core.optimizer import distrib_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron_ext.opt_checkpoint import place_sub_optimizer_state
from tests.support.offload_sim import (
    MirrorChunked,
    MirrorChunkedNative,
    MirrorChunkedOnDevice,
    MirrorChunkedTorch,
    MirrorPlaced,
    MirrorPlacedOnDevice,
    StockPlaced,
    assert_same_state,
    make_hdo,
    one_step,
    sim,
)

pytestmark = pytest.mark.mcore


class GroupStepAdam(torch.optim.Optimizer):
    """AdamW that keeps ``step`` per param group, as transformer-engine's ``FusedAdam``
    does (``group["step"]`` advanced once per step, bias correction from it); the update
    in fp32 torch operations."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, **_):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            t, (b1, b2) = group["step"], group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                p.mul_(1 - lr * wd)
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (v / (1 - b2**t)).sqrt_().add_(eps)
                p.addcdiv_(m, denom, value=-lr / (1 - b1**t))


class StockKeyErrorFixed(StockPlaced):
    """megatron-core's per-parameter path with what lets it train and load natively fp32
    parameters at all (their gradients given as ``.grad``, ``sim``'s ``torch_grads``; their
    master weights reloaded, where megatron-core raises KeyError); its param-group sync as
    is."""

    def _update_fp32_params_by_new_state(self):
        for param, state in self.state.items():
            self.param_to_inner_param[param].data.copy_(state["master_param"])

    def _move_new_state_to_right_device(self):  # megatron-core's sends the GPU part to cuda
        place_sub_optimizer_state(self)


def _distopt(hdo):
    """What megatron-core's DistributedOptimizer reads in its state_dict / load_state_dict
    when it holds a HybridDeviceOptimizer and no parameter state is in the dict."""
    return types.SimpleNamespace(
        optimizer=hdo,
        grad_scaler=None,
        ddp_config=types.SimpleNamespace(use_megatron_fsdp=False),
        config=types.SimpleNamespace(fp16=False),
    )


def _save(hdo, monkeypatch):
    """megatron-core's checkpoint of the optimizer: its param groups (with the ``step`` it
    extracts) and the parameter state (which megatron-core saves separately)."""
    with monkeypatch.context() as m:
        m.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
        groups = DistributedOptimizer.state_dict(_distopt(hdo))["optimizer"]["param_groups"]
    return {"optimizer": {"param_groups": groups}}, hdo.state_dict()["state"]


def _load(hdo, saved, monkeypatch):
    """The parameter state first (what megatron-core's load of it leaves in the state: the
    saved tensors), then megatron-core's load_state_dict of the param groups."""
    groups, state = saved
    own = hdo.state_dict()
    hdo.load_state_dict({"state": state, "param_groups": own["param_groups"]})
    with monkeypatch.context() as m:
        m.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
        DistributedOptimizer.load_state_dict(_distopt(hdo), groups)


STEPS, SAVE_AT = 14, 4  # 10 steps after loading


def _run(classes, gpu_cls, fraction, monkeypatch, save_at=None):
    """STEPS steps of the simulation; with ``save_at``, checkpointed after that many steps
    of ``classes[0]`` and resumed in a fresh ``classes[1]`` over fresh buffers."""
    gen = torch.Generator().manual_seed(11)
    run = None
    for step in range(STEPS):
        if step == 0 or step == save_at:
            cls = classes[0] if step == 0 else classes[1]
            stock = issubclass(cls, StockPlaced)
            bf16, fp32, groups, sources, bind, shard16 = sim(
                True, False, False, 2, 1, torch_grads=stock
            )
            mirrors = None if stock else sources
            hdo = make_hdo(cls, groups, fraction, True, mirrors, 200, 64, gpu_cls=gpu_cls)
            if run is not None:  # the model's parameters, then the optimizer's checkpoint
                saved = _save(run[2], monkeypatch)
                bf16.param_data.copy_(run[0].param_data)
                fp32.param_data.copy_(run[1].param_data)
                _load(hdo, saved, monkeypatch)
            run = (bf16, fp32, hdo, shard16)
        one_step(bf16, fp32, bind, hdo, step, gen)
    return run


def _same_parameters(a, b) -> bool:
    return torch.equal(a[0].param_data, b[0].param_data) and torch.equal(
        a[1].param_data, b[1].param_data
    )


PAIRS = {
    "per_parameter_to_per_parameter": (MirrorPlaced, MirrorPlaced),
    "per_parameter_to_chunked": (MirrorPlaced, MirrorChunked),
    "chunked_to_per_parameter": (MirrorChunked, MirrorPlaced),
    "chunked_to_chunked": (MirrorChunked, MirrorChunked),
    # the compiled kernel and torch's ops: the same state either way
    "chunked_native_to_chunked_torch": (MirrorChunkedNative, MirrorChunkedTorch),
    "chunked_torch_to_chunked_native": (MirrorChunkedTorch, MirrorChunkedNative),
    # converting on the host or on the device: the same state either way
    "chunked_to_chunked_on_device": (MirrorChunked, MirrorChunkedOnDevice),
    "per_parameter_on_device_to_chunked": (MirrorPlacedOnDevice, MirrorChunked),
}


@pytest.mark.parametrize("gpu_cls", [GroupStepAdam, torch.optim.AdamW], ids=["te_like", "torch"])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("pair", PAIRS, ids=list(PAIRS))
def test_offloaded_resume_continues_bit_for_bit(cpu_streams, monkeypatch, pair, fraction, gpu_cls):
    """10 steps after loading equal the uninterrupted run: every parameter and every
    optimizer state tensor, bit for bit; the GPU optimizer's per-group step continues."""
    first, second = PAIRS[pair]
    plain = _run((first, first), gpu_cls, fraction, monkeypatch)
    resumed = _run((first, second), gpu_cls, fraction, monkeypatch, save_at=SAVE_AT)
    assert torch.equal(plain[0].param_data, resumed[0].param_data)
    assert torch.equal(plain[1].param_data, resumed[1].param_data)
    assert_same_state(plain[2], resumed[2])
    gpu = resumed[2].gpu_optimizer
    if gpu_cls is GroupStepAdam and gpu is not None:
        assert [g["step"] for g in gpu.param_groups] == [STEPS] * len(gpu.param_groups)


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_stock_resume_with_a_per_group_step_optimizer_drifts(cpu_streams, monkeypatch, fraction):
    """The measured row beside ours: megatron-core's own path (its KeyError on natively
    fp32 parameters fixed) resumes wrongly when the GPU optimizer counts steps per group.
    At 0.5 its param-group sync writes the saved step into the GPU optimizer before every
    step (bias correction stuck at the saved step + 1); at 0 nothing saves the step at all
    (the GPU optimizer restarts at 1). With torch's AdamW (steps per parameter) it resumes
    right."""
    stock = (StockKeyErrorFixed,) * 2
    te_like = _same_parameters(
        _run(stock, GroupStepAdam, fraction, monkeypatch),
        _run(stock, GroupStepAdam, fraction, monkeypatch, SAVE_AT),
    )
    torch_adamw = _same_parameters(
        _run(stock, torch.optim.AdamW, fraction, monkeypatch),
        _run(stock, torch.optim.AdamW, fraction, monkeypatch, SAVE_AT),
    )
    assert not te_like
    assert torch_adamw


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_only_a_per_group_count_goes_back_into_the_groups(cpu_streams, monkeypatch, fraction):
    """A torch optimizer's group ``step`` (a copy made at a load, not its count) never
    reaches the offload optimizer's groups (at fraction 1 no GPU optimizer would overwrite
    it); the per-group stand-in's count does."""
    run = _run((MirrorChunked, MirrorChunked), GroupStepAdam, fraction, monkeypatch, SAVE_AT)
    hdo = run[2]
    for opt in hdo.cpu_optimizers:
        for group in opt.param_groups:
            group["step"] = 999  # what a stale copy would hold
    one_step(run[0], run[1], lambda: None, hdo, STEPS, torch.Generator().manual_seed(1))
    steps = [g.get("step") for g in hdo.param_groups]
    assert 999 not in steps
    if hdo.gpu_optimizer is not None:
        assert STEPS + 1 in steps  # the GPU optimizer's own count, for its groups
