"""Checkpoint repair for the flat optimizers: megatron-core 0.19's save and load paths,
fixed where fp32 parameters, torch's Adam or the CPU-offload optimizer break them.

The three methods the flat optimizer class takes from here (:func:`sharded_state_dict`,
:func:`load_state_dict`, :func:`_set_main_param_and_optimizer_states`) are plain
functions of the optimizer, so a test can call them on a stand-in.
"""

from __future__ import annotations

import inspect

import torch

from . import seam

DistributedOptimizer = seam.target("DistributedOptimizer")
Float16OptimizerWithFloat16Params = seam.target("Float16OptimizerWithFloat16Params")


def place_sub_optimizer_state(hdo) -> None:
    """Every state tensor of the CPU-offload optimizer's sub-optimizers on its parameter's
    device; ``step`` where torch's optimizer keeps it (the parameter's device when the group
    is fused or capturable, else the CPU).

    megatron-core 0.19.2's ``_move_new_state_to_right_device`` (run by its sync after a
    load) tells the two sub-optimizers apart by class: without TE both are torch's Adam, so
    it moves the GPU optimizer's moments to the CPU too, and the next fused GPU step fails
    ("exp_avgs is on cpu", seen on the GPU at offload fraction 0.5). The state dicts are
    shared with the offload optimizer's own ``state``, so both see the move.
    """
    cpu = torch.device("cpu")
    for sub in hdo.sub_optimizers:
        for group in sub.param_groups:
            step_on_device = bool(group.get("fused") or group.get("capturable"))
            for p in group["params"]:
                state = sub.state.get(p)
                for key, value in (state or {}).items():
                    if not isinstance(value, torch.Tensor):
                        continue
                    want = p.device if key != "step" or step_on_device else cpu
                    if value.device != want:
                        state[key] = value.to(want)


def create_state_before_loading(child) -> None:
    """Give a never-stepped distributed optimizer its state before a checkpoint loads.

    Without TE or Apex, megatron-core 0.19's ``DistributedOptimizer.state_dict()`` (which
    ``sharded_state_dict(is_loading=True)`` calls first) reads Adam's ``step`` from torch's
    per-parameter state and asserts there is exactly one value: a fresh optimizer (Megatron-LM
    resuming with ``--load``) has none. Created here as megatron-core's own
    ``load_state_dict`` creates it right after: ``dummy_step()`` for its CPU-offload
    optimizer, else its ``init_state_fn`` and a zero ``step``. Loading then overwrites all
    of it. Nothing happens with TE/Apex or once the optimizer has state.
    """
    if seam.target("distopt without TE or Apex"):
        return
    inner = child.optimizer
    if len(inner.state) != 0:
        return
    if isinstance(inner, seam.target("HybridDeviceOptimizer")):
        inner.dummy_step()
        return
    if child.init_state_fn is not None:
        child.init_state_fn(inner, child.config)
    for group in inner.param_groups:
        for p in group["params"]:
            inner.state[p].setdefault("step", torch.tensor(0.0))


def align_group_order(child) -> None:
    """Number each group's parameters as the optimizer lists them (seam: param group order).

    megatron-core's ``model_param_group_index_map`` gives a parameter's place among the
    parameters this rank owns in its group, in the group's order; the optimizer's group
    lists the fp32 parameters' shards first, then the fp16/bf16 ones'. Where a group holds
    both, checkpoint save and load (``_get/_set_main_param_and_optimizer_states``, the
    ``dp_reshardable`` and ``fully_reshardable`` paths) read another parameter's state.
    Every entry is checked against the shard's size before the map is replaced.
    """
    seam.check_instance("param group order", child)
    groups = child.optimizer.param_groups
    fixed = {}
    for g, (fp32s, low) in enumerate(
        zip(child.model_fp32_groups, child.model_float16_groups, strict=True)
    ):
        ordered = [*fp32s, *low]
        if len(ordered) != len(groups[g]["params"]):
            raise RuntimeError(
                f"optimizer group {g} holds {len(groups[g]['params'])} parameters but this "
                f"rank owns {len(ordered)} of it (megatron-core's layout changed?)"
            )
        for i, p in enumerate(ordered):
            owned = child._get_model_param_range_map(p)["param"].size
            if groups[g]["params"][i].numel() != owned:
                raise RuntimeError(
                    f"optimizer group {g}, position {i}: {groups[g]['params'][i].numel()} "
                    f"elements, but the parameter there owns {owned} on this rank"
                )
            fixed[p] = (g, i)
    if set(fixed) != set(child.model_param_group_index_map):
        raise RuntimeError("the optimizer's groups and megatron-core's index map disagree")
    child.model_param_group_index_map = fixed


def sharded_state_dict(self, *args, **kwargs):
    """megatron-core's, with the ids right when fp32 parameters sit in a group.

    megatron-core 0.19.2's ``Float16OptimizerWithFloat16Params.sharded_state_dict``
    numbers the model parameters by walking only its bf16/fp16 parameters, while the
    optimizer state numbers every parameter of every group, natively fp32 ones included:
    once a group holds both (fp32 hyper-connection weights or sinks beside bf16 biases
    in the no-weight-decay group), states are paired with the wrong parameters, which
    fails with a shape mismatch (seen on the GPU) or, where shapes agree, would save
    them under the wrong names (from reading its code). Here the model parameters are
    walked in the optimizer's own order.
    """
    base = self._flat_base.sharded_state_dict
    # megatron-core's own signature says where is_loading is (and gives
    # model_sharded_state_dict a default in DistributedOptimizer's)
    megatron_cls = next(
        (
            c
            for c in (DistributedOptimizer, Float16OptimizerWithFloat16Params)
            if isinstance(self, c)
        ),
        None,
    )
    signature = inspect.signature(getattr(megatron_cls, "sharded_state_dict", base))
    bound = signature.bind(self, *args, **kwargs)
    bound.apply_defaults()
    if bound.arguments.get("is_loading", False) and isinstance(self, DistributedOptimizer):
        create_state_before_loading(self)
    if not isinstance(self, Float16OptimizerWithFloat16Params) or not any(
        self.fp32_from_fp32_groups
    ):
        return base(self, *args, **kwargs)
    return _float16_sharded_state_dict(self, *args, **kwargs)


def load_state_dict(self, state_dict):
    """megatron-core's load, then the CPU-offload optimizer's sub-optimizers synced to
    the loaded state (:func:`place_sub_optimizer_state`), then one ``step`` tensor per
    parameter again.

    megatron-core 0.19.2 sets the loaded parameter state into its CPU-offload
    optimizer's state after that optimizer's own post-load sync (it syncs again only
    for the ``fully_sharded_model_space`` format): GPU-resident parameters' moments stay
    on the CPU and the next GPU step fails (seen on the GPU at offload fraction 0.5).
    Without TE/Apex it also gives every parameter's torch Adam state the same ``step``
    tensor object; torch's Adam then increments that one tensor once per parameter per
    step, and the bias correction after a resume is wrong.
    """
    self._flat_base.load_state_dict(self, state_dict)
    if isinstance(self.optimizer, seam.target("HybridDeviceOptimizer")):
        seam.target("hdo sync after load")(self.optimizer)
        place_sub_optimizer_state(self.optimizer)
    seen = set()
    for state in self.optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                state["step"] = step.clone()
            seen.add(id(state["step"]))


@torch.no_grad()
def _set_main_param_and_optimizer_states(self, model_param, tensors):
    """Checkpoint load (distributed optimizer): one parameter's main copy and state.

    megatron-core 0.19.2's version fails with torch's Adam (no TE/Apex), option on or
    off: it demands a per-parameter ``step`` that ``fully_reshardable`` does not store
    (KeyError), it copies ``dp_reshardable``'s stale ``step`` over the one
    ``load_state_dict`` restored from the param groups, and it copies into fp32 shards
    with autograd on. Here ``step`` always comes from the param groups, every other
    state tensor must be in the checkpoint, and copies run under ``no_grad``.
    """
    tensors = {k: v for k, v in tensors.items() if k != "step"}
    if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
        base = self._flat_base._set_main_param_and_optimizer_states
        return base(self, model_param, tensors)
    group_index, group_order = self.model_param_group_index_map[model_param]
    main_param = self.optimizer.param_groups[group_index]["params"][group_order]
    dst = {"param": main_param}
    for key, value in self.optimizer.state[main_param].items():
        if key != "step" and isinstance(value, torch.Tensor):
            dst[key] = value
    missing = sorted(set(dst) - set(tensors))
    if missing:
        raise KeyError(
            f"checkpoint has no optimizer state {missing} for a parameter of shape "
            f"{tuple(model_param.shape)} (it has {sorted(tensors)}): was it saved with "
            "a different optimizer type?"
        )
    for key, target in dst.items():
        if isinstance(tensors[key], torch.Tensor):  # megatron-core skips non-tensors too
            target.copy_(tensors[key])


def _float16_sharded_state_dict(opt, model_sharded_state_dict, is_loading=False, metadata=None):
    """``Float16OptimizerWithFloat16Params.sharded_state_dict`` with ids in optimizer order."""
    get_param_id_to_sharded_param_map = seam.target("param id map")
    make_sharded_optimizer_tensor = seam.target("sharded optimizer tensor")
    optim_state_to_sharding_state = seam.target("optimizer state sharding")
    backfill_gtp = seam.optional("GTP backfill")
    if is_loading:
        opt.init_state_fn(opt.optimizer, opt.config)
    state_dict = opt.state_dict()
    # The model parameter behind every optimizer parameter, in the optimizer's order (the
    # order of the state dict's integer ids): a bf16 parameter for its fp32 main copy.
    model_of = {
        id(main): model
        for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True)
        for model, main in zip(models, mains, strict=True)
    }
    inner = [q for g in opt.optimizer.param_groups for q in g["params"]]
    ordered = [model_of.get(id(q), q) for q in inner]
    position = {id(q): i for i, q in enumerate(inner)}
    id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, ordered)
    if backfill_gtp is not None:  # megatron-core 0.19+: GTP-remat entries
        backfill_gtp(id_map, [ordered], model_sharded_state_dict)
    state_dict["fp32_from_fp16_params"] = [
        [
            make_sharded_optimizer_tensor(
                id_map[position[id(main)]], saved, prefix="optimizer.state.fp32_param"
            )
            for main, saved in zip(mains, saved_group, strict=True)
        ]
        for mains, saved_group in zip(
            opt.fp32_from_float16_groups, state_dict["fp32_from_fp16_params"], strict=True
        )
    ]
    step = opt._extract_common_per_param_step(state_dict["optimizer"])
    optim_state_to_sharding_state(state_dict["optimizer"], id_map, exclude_keys="step")
    if step:
        state_dict["optimizer"]["state"]["common_step"] = step
    return state_dict
