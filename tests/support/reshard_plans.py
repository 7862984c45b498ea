"""A model-parallel test's plan of runs, saves and loads (test support), as the TP and PP
tests on the CPU run it: each rank's part of the plan at its (model-parallel size,
data-parallel size) shape (:func:`run_plan`), every rank's full state with the shards
joined (:func:`full_state`), and the spawns of a list of plans keyed by shape
(:func:`runs_by_shape`).
"""

from __future__ import annotations

import os

import torch

from tests.support.megatron_mlp import owned_state
from tests.support.megatron_ranks import run_ranks
from tests.support.mlp_stack import load, save

SAVED_AT, STEPS = 2, 4  # save after two steps, continue to four


def full_state(model, opt) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter name: its full main value and Adam state, and its model value. The
    data-parallel shards are joined by a sum over the data-parallel group of tensors that
    hold zeros outside each rank's owned range (``step``: the largest, a rank that owns
    none of the parameter holds 0); tensor-parallel shards (the TP test's ``fc1``) are then
    gathered and joined along the split dimension."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    dp_group = ps.get_data_parallel_group()
    owned = owned_state(model, opt)
    out = {}
    for name, p in model.module.named_parameters():
        pieces = [(lo, hi, e) for (n, lo, hi), e in owned.items() if n == name]
        full = {}
        step = torch.zeros((), dtype=torch.float32)
        for _, _, e in pieces:
            if "step" in e:
                step = torch.maximum(step, e["step"].float().cpu())
        dist.all_reduce(step, op=dist.ReduceOp.MAX, group=dp_group)
        full["step"] = step
        tensors = {}
        for k in ("exp_avg", "exp_avg_sq", "param"):
            flat = torch.zeros(p.numel(), dtype=torch.float32)
            for lo, hi, e in pieces:
                flat[lo:hi] = e[k]
            dist.all_reduce(flat, group=dp_group)
            tensors[k] = flat.reshape(p.shape)
        tensors["model"] = p.detach().cpu().clone()  # gathered on the host, as the rest
        for k, v in tensors.items():
            if getattr(p, "tensor_model_parallel", False) and dist.get_world_size(tp_group) > 1:
                parts = [torch.empty_like(v) for _ in range(dist.get_world_size(tp_group))]
                dist.all_gather(parts, v.contiguous(), group=tp_group)
                v = torch.cat(parts, dim=p.partition_dim)
            full[k] = v
        out[name] = full
    return out


def ckpt(out_dir: str, shape: tuple[int, int], fmt: str, option: bool = True) -> str:
    tag = "on" if option else "off"
    return os.path.join(out_dir, f"ckpt-{shape[0]}x{shape[1]}-{fmt}-{tag}")


def run_plan(plan: dict, shape: tuple[int, int], out_dir: str, make) -> dict:
    """One rank's part of ``plan`` at ``shape`` (model-parallel size, data-parallel size):
    per option in ``plan["run"]``, STEPS steps, saved at SAVED_AT in each format of
    ``plan["save"]`` (option on) or ``plan["save_off"]`` (off); then per (saved shape,
    format[, "off"]) in ``plan["load"]``, a model built from other values (option on)
    loads that checkpoint (saved with the option off where "off" is given) and continues
    to STEPS; a load's exception is its result. ``make(option, seed)`` gives (model,
    optimizer, train) with ``train(steps)`` -> (norms, fp64 norms)."""
    from torch.distributed.checkpoint.api import CheckpointException

    out = {}
    for option in plan["run"]:
        model, opt, train_ = make(option, 11)
        norms, refs = train_(range(SAVED_AT))
        at_save = full_state(model, opt)
        for fmt in plan["save"] if option else plan.get("save_off", []):
            save(model, opt, ckpt(out_dir, shape, fmt, option), fmt)
        more = train_(range(SAVED_AT, STEPS))
        out["run", option] = dict(norms=norms + more[0], refs=refs + more[1], at_save=at_save,
                                  end=full_state(model, opt))  # fmt: skip
    for saved, fmt, *off in plan["load"]:
        model, opt, train_ = make(True, 12)
        try:
            load(model, opt, ckpt(out_dir, saved, fmt, not off), fmt)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - the result
            # torch's CheckpointException derives from BaseException, not Exception
            out["load", saved, fmt, *off] = dict(error=f"{type(e).__name__}: {str(e)[-1500:]}")
            continue
        state = full_state(model, opt)
        norms, refs = train_(range(SAVED_AT, STEPS))
        out["load", saved, fmt, *off] = dict(loaded=state, end=full_state(model, opt),
                                             norms=norms, refs=refs)  # fmt: skip
    return out


def runs_by_shape(tmp_path, job, plans, size: str) -> dict:
    """Every rank's results of ``job`` over ``plans`` ((world, plan) each, spawned in
    order), keyed by (what, ..., (plan[size], world / plan[size])), in rank order."""
    out: dict = {}
    for world, plan in plans:
        shape = (plan[size], world // plan[size])
        for result in run_ranks(tmp_path, world, job, plan):
            for key, value in result.items():
                out.setdefault(key + (shape,), []).append(value)
    return out
