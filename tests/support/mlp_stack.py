"""The MLP of ``tests/support/megatron_mlp.py`` under megatron-core's DDP and distributed
optimizer (test support): built on an Adam path (torch's, the Apex stand-in's, megatron-core's
CPU offload), its checkpoints saved and loaded through ``dist_checkpointing`` (torch_dist),
and the comparison of states across data-parallel and model-parallel shapes.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterator

import pytest
import torch

from tests.support.megatron_mlp import BF16, CLIP, LR, MLP, H
from tests.support.megatron_ranks import DEVICE, _no_psutil, rank_device


def path_options(path: str) -> dict:
    """``build``'s arguments for an Adam path (the ``LOADS`` of
    ``tests/test_megatron_cpu_reshard.py``): ``+experts`` (``w2`` an expert weight);
    ``+offload<f>`` (megatron-core's CPU offload at fraction f with the precision-aware
    optimizer, through host mirrors, megatron-core's per-parameter step); ``+chunked`` (the
    chunked offload step, the default elsewhere)."""
    import megatron_ext

    out: dict = {"experts": "+experts" in path}
    for part in path.split("+")[1:]:
        if part.startswith("offload"):
            out.update(
                optimizer_cpu_offload=True,
                optimizer_offload_fraction=float(part.removeprefix("offload")),
                use_precision_aware_optimizer=True,
            )
    if "+offload" in path:  # the per-parameter step unless the path says chunked
        step = "chunked" if "+chunked" in path else "per_parameter"
        out["options"] = megatron_ext.MegatronOptions(offload_step=step)
    return out


def build(option: bool, *, seed: int = 11, fp16: bool = False, extra: str | None = None,
          rename: dict[str, str] | None = None, islands: tuple[str, ...] | None = None,
          experts: bool = False, options=None, **optimizer):  # fmt: skip
    """DDP and the distributed optimizer (Adam, clipped), ``sink`` in a group of its own.

    ``extra``: one more parameter of that name, bf16 marked ``keep_in_fp32`` (an fp32
    island the checkpoint does not have). ``rename``: parameters registered under other
    names. ``islands``: the bf16 parameters marked ``keep_in_fp32`` instead of ``alpha``
    (with the option; an unmarked ``alpha`` is an ordinary bf16 parameter). ``fp16``: fp16
    weights and megatron-core's dynamic loss scaler, starting at 1024 (its default, 2**32,
    overflows fp16 gradients on every step). ``optimizer``: more ``OptimizerConfig`` fields.
    """
    from megatron.core.optimizer import (
        OptimizerConfig,
        ParamKey,
        get_standard_config_overrides,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_ext

    dtype = torch.float16 if fp16 else BF16
    module = MLP(option, seed)
    if experts:  # an expert weight: its own DDP buffers and optimizer, megatron-core's MoE path
        module.w2.allreduce = False
    if fp16:
        for p in module.parameters():
            if p.dtype == BF16:
                p.data = p.data.to(torch.float16)
    for name, p in module.named_parameters() if option and islands is not None else ():
        if name in islands:
            megatron_ext.mark_keep_in_fp32(p)
        elif megatron_ext.fp32.is_keep_in_fp32(p):
            del p.keep_in_fp32
    if extra is not None:
        p = torch.nn.Parameter(torch.randn(8, generator=torch.Generator().manual_seed(5)).to(BF16))
        module.register_parameter(extra, p)
        megatron_ext.mark_keep_in_fp32(p)
    for old, new in (rename or {}).items():
        module.register_parameter(new, module._parameters.pop(old))
    module.to(rank_device())  # megatron-core's buffers are made on the device (the shim's: CPU)
    tcfg = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, bf16=not fp16, fp16=fp16,
        params_dtype=dtype,
    )  # fmt: skip
    ddp_config = megatron_ext.DistributedDataParallelConfig(
        per_dtype_grad_buffers=option, use_distributed_optimizer=True
    )
    model = megatron_ext.DistributedDataParallel(tcfg, ddp_config, module)
    ocfg = OptimizerConfig(
        optimizer="adam", lr=LR, clip_grad=CLIP, bf16=not fp16, fp16=fp16,
        use_distributed_optimizer=True, **({"initial_loss_scale": 1024.0} if fp16 else {}),
        **optimizer,
    )  # fmt: skip
    overrides = get_standard_config_overrides(ocfg)
    overrides[ParamKey(name="*sink")] = {"max_lr": LR}
    return model, megatron_ext.get_megatron_optimizer(ocfg, [model], overrides, options=options)


def group_steps(opt) -> list[tuple[int, object]]:
    """(number of parameters on this rank, ``step``) of every inner param group."""
    return [
        (len(g["params"]), g.get("step"))
        for child in opt.chained_optimizers
        for g in child.optimizer.param_groups
    ]


def _sharded(model, opt, fmt: str, loading: bool) -> dict:
    state = {"model": model.module.sharded_state_dict()}
    state["optimizer"] = opt.sharded_state_dict(
        state["model"], is_loading=loading, metadata={"distrib_optim_sharding_type": fmt}
    )
    return state


def save(model, opt, path: str, fmt: str) -> None:
    from megatron.core import dist_checkpointing

    _no_psutil()
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(_sharded(model, opt, fmt, loading=False), path)


def load(model, opt, path: str, fmt: str) -> None:
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(_sharded(model, opt, fmt, loading=True), path)
    model.module.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])


@contextlib.contextmanager
def adam_path(path: str) -> Iterator[None]:
    """``"torch"``: megatron-core's torch-Adam code path (this machine has neither TE nor
    Apex). ``"apex"``: its Apex code path, with ``tests/gpu/apex_standin.py``'s pure-torch
    FusedAdam (one ``step`` per param group), the only path where stock megatron-core loads
    its own distributed-optimizer checkpoints."""
    with pytest.MonkeyPatch.context() as patch:
        if path.startswith("apex"):
            from tests.gpu.apex_standin import use_apex_path

            use_apex_path(patch)
        if "+offload" in path and DEVICE == "cpu":
            # megatron-core offloads only parameters on a CUDA device: here every parameter
            # is on the CPU, so its placement is replayed as if they were on the device
            from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import (
                HybridDeviceOptimizer,
            )

            from tests.support.offload_sim import placement

            patch.setattr(
                HybridDeviceOptimizer,
                "_get_sub_optimizer_param_groups",
                lambda self, fraction: placement(self.param_groups, fraction),
            )
        yield


def _error(e: Exception) -> dict:
    """The exception and the last line of megatron-core it came from."""
    frames = traceback.extract_tb(e.__traceback__)
    where = next((f for f in reversed(frames) if "megatron/core" in f.filename), frames[-1])
    place = f"{os.path.basename(where.filename)}:{where.lineno} {where.line}"
    return dict(error=f"{type(e).__name__}: {e}"[:2000], where=place)


# The tolerance of a continuation at another DP size, normwise per tensor (|got - want| over
# max |want|). The gradients are the same bits at both shapes: DP=2 scales each rank's
# gradient by 1/2 (exact) and reduce-scatters a 2-term sum (one rounding, in bf16 for the
# bf16 buffer, fp32 for the island and sink); DP=1 accumulates two micro-batches of half
# the loss (each exactly half its gradient) into the same buffer: the same one rounding.
# What differs is the order of the fp32 sum of squares behind the norm: DP=2 sums each
# rank's shard and all-reduces the two sums. With pairwise summation over n = 3200 squares
# the norm moves by at most ~log2(n) u = 12 * 2^-24 < 1e-6 relative, and so does the clip
# coefficient that scales every step's gradient (each step clips). Adam's update m/sqrt(v)
# is invariant to that scale but for eps and the coefficient's change between steps: each
# of STEPS steps moves a parameter by lr * (1 +- 2e-6), i.e. < 4 * 0.05 * 2e-6 = 4e-7 in
# absolute terms for parameters of order 0.3-1, and m, v by the same relative 1e-6 and 2e-6.
# 1e-5 leaves a factor of ten over that; a state paired with the wrong parameter, a rank's
# shard misplaced or a wrong step (bias correction) moves these by 1e-2 or more.
# The bf16 parameters are rounded from fp32 main values that differ by ~1e-6 relative,
# far below half a bf16 ulp (2^-9), so they round alike unless a value sits within 1e-6 of
# a rounding boundary: in these seeded runs none does, and they are compared bit for bit.
TOLERANCE = 1e-5


def assert_close_normwise(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name, entry in want.items():
        assert got[name].keys() == entry.keys(), (what, name)
        for k, v in entry.items():
            a, b = got[name][k].double(), v.double()
            err = (a - b).abs().max().item() / b.abs().max().item()
            assert err <= TOLERANCE, (what, name, k, err)


def assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name, entry in want.items():
        assert got[name].keys() == entry.keys(), (what, name)
        for k, v in entry.items():
            assert torch.equal(got[name][k], v), (what, name, k)
