"""megatron-core optimizers whose norm, clip and zero count read flat buffer spans."""

from __future__ import annotations

import contextlib
import math

import torch

from buffers import graphs, ops
from buffers.graphs import NormClip
from buffers.options import DEFAULT, BufferOptions

from . import offload, refusals, seam
from .ddp import counted_records
from .layout import BufferLayout
from .options import MegatronOptions
from .param_norms import MegatronParamNorms, concat_norms, global_param_names
from .targets import FlatOptimizerState, buffer_target, mirror_view

DistributedOptimizer = seam.target("DistributedOptimizer")
Float16OptimizerWithFloat16Params = seam.target("Float16OptimizerWithFloat16Params")
FP32Optimizer = seam.target("FP32Optimizer")
ChainedOptimizer = seam.target("ChainedOptimizer")


def get_megatron_optimizer(
    config, model_chunks, *args, options: MegatronOptions | None = None, **kwargs
):
    """megatron-core's ``get_megatron_optimizer``, flat norm/clip when the DDP option is on.

    Same signature and return types as megatron-core's. When the model chunks are
    :class:`megatron_ext.DistributedDataParallel` with ``per_dtype_grad_buffers=True``, the
    returned optimizers (each child of the ``ChainedOptimizer`` and the chain itself) compute
    ``get_grad_norm``, ``clip_grad_norm``, ``count_zeros`` and ``step`` from spans of the
    flat buffers computed here, once. Natively fp32 parameters also work with the
    distributed optimizer and CPU offload, which stock megatron-core 0.19 rejects.

    ``options`` (:class:`megatron_ext.MegatronOptions`, only read when the option is on):
    the kernels' backend, CUDA-graph replay, and with CPU offload
    (``optimizer_cpu_offload=True``) whether gradients and parameters move through one
    pinned host mirror per flat buffer (``host_mirrors=True``, the default;
    :mod:`megatron_ext.offload`) or megatron-core's per-parameter copies.
    """
    flags = [bool(getattr(m, "per_dtype_grad_buffers", False)) for m in model_chunks]
    if not any(flags):
        return seam.target("get_megatron_optimizer")(config, model_chunks, *args, **kwargs)
    if not all(flags):
        raise ValueError(
            "some model chunks have per_dtype_grad_buffers=True and some do not; wrap every "
            "chunk in megatron_ext.DistributedDataParallel with the same ddp_config"
        )
    with _fp32_shards_as_leaves():
        opt = seam.target("get_megatron_optimizer")(config, model_chunks, *args, **kwargs)
    return enable_flat_norm(opt, model_chunks, options=options)


@contextlib.contextmanager
def _fp32_shards_as_leaves():
    """Make the distributed optimizer's fp32 parameter shards detached views (leaves).

    megatron-core 0.19 slices fp32 parameters without ``detach()``; with CPU offload the
    rebuilt ``HybridDeviceOptimizer`` then raises "can't optimize a non-leaf Tensor". A
    detached view shares the same storage, so updates still land in the model's buffer.
    Scoped to the construction call, and restored after it.
    """
    original = DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]

    def build(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config):
        groups = original.__func__(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
        for shard_group, group_range in zip(groups[3], opt_group_ranges, strict=True):
            swap = {}
            for i, shard in enumerate(shard_group):
                if shard is not None and not shard.is_leaf:
                    leaf = shard.detach()
                    leaf.__dict__.update(shard.__dict__)  # Megatron's tensor-parallel attributes
                    shard_group[i] = leaf
                    swap[id(shard)] = leaf
            params = group_range["orig_group"]["params"]
            group_range["orig_group"]["params"] = [swap.get(id(p), p) for p in params]
        return groups

    DistributedOptimizer._build_model_and_main_param_groups = classmethod(build)
    try:
        yield
    finally:
        DistributedOptimizer._build_model_and_main_param_groups = original


def enable_flat_norm(opt, model_chunks, *, options: MegatronOptions | None = None):
    """Give ``opt`` (a ChainedOptimizer or one child) flat norm/clip; returns it.

    ``options.host_mirrors``: CPU-offloaded distributed optimizers also get flat host
    mirrors (:func:`megatron_ext.offload.attach_host_mirrors`).
    """
    options = MegatronOptions() if options is None else options
    if isinstance(opt, ChainedOptimizer):
        seam.check_instance("ChainedOptimizer", opt)
    children = opt.chained_optimizers if isinstance(opt, ChainedOptimizer) else [opt]
    placed = placed_buffers(model_chunks)
    _check_no_separate_norm_groups(opt)
    names: dict[int, str] = {}  # global names, for per-parameter norms
    for m in model_chunks:
        names.update(global_param_names(m.module))
    opt._flat_names = names
    for child in children:
        child._flat_names = names
        if isinstance(child, DistributedOptimizer) and not getattr(
            child, "is_stub_optimizer", False
        ):
            align_group_order(child)
        _check_supported(child)
        refusals.check(child, placed)
        child._flat = _build_state(child, placed, options)
        child.__class__ = _flat_class(type(child))
        if options.host_mirrors:
            offload.attach_host_mirrors(child)
        # Norm and scale launches over these fixed spans, replayed as CUDA graphs.
        child._flat_norm_clip = NormClip(
            child._flat.norm_groups, child._flat.scale_groups, _device(), options
        )
    if isinstance(opt, ChainedOptimizer):
        opt.__class__ = _flat_class(type(opt))
        if len(children) > 1:  # a chain of one hands everything to its child
            # Every child's spans in one sequence, for a norm and clip over a shared group:
            # one replay in all (the same kernels per buffer as the children's; tables shared).
            opt._flat_norm_clip = NormClip(
                [g for c in children for g in c._flat.norm_groups],
                [g for c in children for g in c._flat.scale_groups],
                _device(),
                options,
            )
    return opt


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


def _check_supported(child) -> None:
    if getattr(child, "is_stub_optimizer", False):
        return
    if not isinstance(
        child, DistributedOptimizer | Float16OptimizerWithFloat16Params | FP32Optimizer
    ):
        raise NotImplementedError(
            f"per_dtype_grad_buffers=True does not support {type(child).__name__}; supported: "
            "DistributedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer (and "
            "ChainedOptimizer / HybridDeviceOptimizer around them)"
        )
    seam.check_instance(_entry_of(child), child)


def _entry_of(child) -> str:
    for cls in (DistributedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer):
        if isinstance(child, cls):
            return cls.__name__
    raise AssertionError(type(child))


def _check_no_separate_norm_groups(opt) -> None:
    # has_grad_norm_group() is megatron-core's globally consistent (all-reduced, cached)
    # flag, so every rank raises together or none does. Versions before 0.19 have no
    # separate grad-norm groups.
    tags = seam.optional("separate grad-norm groups")
    if tags is None or seam.optional("has_grad_norm_group") is None:
        return
    for tag in tags:
        if opt.has_grad_norm_group(tag):
            raise NotImplementedError(
                f"parameters are tagged grad_norm_group={tag!r} (clipped by their own norm); "
                "per_dtype_grad_buffers=True does not support separate grad-norm groups yet"
            )


def _model_params(child) -> set[int]:
    if isinstance(child, DistributedOptimizer):
        groups = [*child.model_float16_groups, *child.model_fp32_groups]
    elif isinstance(child, Float16OptimizerWithFloat16Params):
        groups = [*child.float16_groups, *child.fp32_from_fp32_groups]
    else:
        groups = [g["params"] for g in child.optimizer.param_groups]
    return {id(p) for g in groups for p in g}


def placed_buffers(model_chunks) -> list[tuple[object, BufferLayout, torch.Tensor | None]]:
    """(megatron-core buffer, its layout, its fp32 island) for every buffer of every chunk."""
    return [
        (m.grad_buffer(layout.key), layout, m.fp32_island(layout.key))
        for m in model_chunks
        for layout in m.layout.buffers
    ]


def _build_state(child, placed, options: BufferOptions = DEFAULT) -> FlatOptimizerState:
    if getattr(child, "is_stub_optimizer", False):
        return FlatOptimizerState([], None)
    distributed = isinstance(child, DistributedOptimizer)
    decoupled = bool(child.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    mine = _model_params(child)
    if distributed:
        # Its own buffers (megatron-core's per_model_buffers), in its order.
        candidates = [next(p for p in placed if p[0] is b) for b in child.buffers]
    else:
        candidates = [p for p in placed if any(id(q) in mine for q in p[0].param_index_map)]
    # Loss-scaled optimizers unscale only what they read: the norm reads that too.
    scaled = getattr(child, "grad_scaler", None) is not None
    tp_group = getattr(child, "tp_group", None)
    expert_tp_group = getattr(child, "expert_tp_group", None)
    targets = []
    by_buffer = []
    for buf, layout, island in candidates:
        # The distributed optimizer holds only the parameters that overlap this rank's
        # shard of each bucket, and every buffer in child.buffers is its own.
        if not distributed and not all(id(p) in mine for p in buf.param_index_map):
            raise RuntimeError(
                f"the optimizer holds only some parameters of a {buf.grad_dtype} gradient "
                "buffer; per_dtype_grad_buffers=True needs each buffer wholly in one optimizer"
            )
        needs_mirror = (
            not decoupled
            and buf.grad_dtype != torch.float32
            and not isinstance(child, FP32Optimizer)
        )
        t = buffer_target(
            buf,
            layout,
            counted_records(buf, layout.records, tp_group, expert_tp_group),
            sharded=distributed,
            needs_mirror=needs_mirror,
            island=island,
            norm_reads_mirror=needs_mirror and scaled,
        )
        targets.append(t)
        by_buffer.append((buf, t))
    bindings = _bindings(child, by_buffer) if any(t.mirror is not None for t in targets) else None
    state = FlatOptimizerState(targets, bindings)
    ops.prepare_groups(state.norm_groups + state.scale_groups, options)
    return state


def _bindings(child, by_buffer):
    """(main param, "grad", view) for every main parameter: what the copy step assigns."""
    out = []
    pmap = {}
    for buf, t in by_buffer:
        for p, (start, end, _) in buf.param_index_map.items():
            pmap[id(p)] = (start, end, t)
    if isinstance(child, DistributedOptimizer):
        pairs = [
            *zip(
                _flat(child.model_float16_groups),
                _flat(child.shard_fp32_from_float16_groups),
                strict=True,
            ),
            *zip(_flat(child.model_fp32_groups), _flat(child.shard_fp32_groups), strict=True),
        ]
        for model_param, main_param in pairs:
            start, _, t = pmap[id(model_param)]
            r = child._get_model_param_range_map(model_param)["param"]
            view = (
                mirror_view(t, start + r.start, start + r.end)
                if t.mirror is not None
                else model_param.main_grad.view(-1)[r.start : r.end]
            )
            out.append((main_param, "grad", view))
    else:  # Float16OptimizerWithFloat16Params
        for model_param, main_param in zip(
            _flat(child.float16_groups), _flat(child.fp32_from_float16_groups), strict=True
        ):
            start, end, t = pmap[id(model_param)]
            out.append((main_param, "grad", mirror_view(t, start, end).view(model_param.shape)))
        for model_param in _flat(child.fp32_from_fp32_groups):
            out.append((model_param, "grad", model_param.main_grad))
    return out


def _flat(groups):
    return [p for g in groups for p in g]


class FlatNormOptimizer:
    """Mixin for one megatron-core optimizer: norm, clip and zero count from flat spans."""

    _flat: FlatOptimizerState

    def _copy_model_grads_to_main_grads(self):
        if self._flat.bindings is None:
            return self._flat_base._copy_model_grads_to_main_grads(self)
        for dst, src in (c for t in self._flat.targets for c in t.copies):
            dst.copy_(src)  # one copy (and cast) per owned range, into a preallocated mirror
        for tensor, attr, view in self._flat.bindings:
            setattr(tensor, attr, view)

    def _flat_local_zeros(self) -> torch.Tensor:
        return ops.count_zeros_groups(self._flat.norm_groups, self._flat.padding, _device())

    def _flat_scale(self, total_norm: torch.Tensor, max_norm: float) -> None:
        self._flat_norm_clip.scale_by_norm_(total_norm, max_norm)

    def _flat_reducer(self, group=None):
        """(the all-reduce of a stat over ``group``, default this optimizer's, whether a
        graph holds it)

        The :class:`buffers.graphs.GroupReducer` is kept while the group stays the same
        object (megatron-core fixes it at construction), so its backend is looked up once.
        """
        if group is None:
            group = self.get_grad_stats_parallel_group()
        reducer = self.__dict__.get("_flat_group_reducer")
        if reducer is None or reducer.group is not group:
            nc = self._flat_norm_clip
            reducer = graphs.GroupReducer(2.0, group, nc.device, nc.options)
            self._flat_group_reducer = reducer
        return reducer.args()

    @torch.no_grad()
    def get_grad_norm(self):
        return self._flat_norm_clip.norm_reduced(2.0, *self._flat_reducer())

    def _flat_clip(self, clip_grad: float) -> torch.Tensor:
        """Norm over this optimizer's group (a chain's: every child's spans), then scale:
        one fused sequence, no sync."""
        return self._flat_norm_clip.clip_reduced_(clip_grad, 2.0, *self._flat_reducer())

    def clip_grad_norm(self, clip_grad: float):
        if clip_grad > 0.0:
            return self._flat_clip(clip_grad)
        return self.get_grad_norm()

    def count_zeros(self):
        zeros = self._flat_local_zeros()
        torch.distributed.all_reduce(zeros, group=self.get_grad_stats_parallel_group())
        return zeros

    @torch.no_grad()
    def per_param_grad_norms(self):
        """Every parameter's gradient norm and the total, from one pass, one all-reduce.

        Returns a :class:`buffers.ParamNorms`: ``total`` (what :meth:`get_grad_norm`
        returns, up to summation order), ``norms`` (a device vector), ``names`` (global:
        :mod:`megatron_ext.param_norms`) and ``counted``; ``.as_dict()`` is
        ``{name: norm}``, copied to the host only when read; ``.by_group(index)`` folds
        them into layers or module types on the device. Reads what the norm reads (call
        it where :meth:`get_grad_norm` would be called: after the gradients are reduced,
        before clipping), over the same process group. No host sync.
        """
        return _per_param(self, [self], self.get_grad_stats_parallel_group())

    def sharded_state_dict(self, model_sharded_state_dict, *args, **kwargs):
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
        is_loading = kwargs.get("is_loading", args[0] if args else False)
        if is_loading and isinstance(self, DistributedOptimizer):
            create_state_before_loading(self)
        if not isinstance(self, Float16OptimizerWithFloat16Params) or not any(
            self.fp32_from_fp32_groups
        ):
            return base(self, model_sharded_state_dict, *args, **kwargs)
        return _float16_sharded_state_dict(self, model_sharded_state_dict, *args, **kwargs)

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


class FlatChainedOptimizer:
    """Mixin for ``ChainedOptimizer``: one norm over every child's flat spans."""

    def _active(self):
        return [c for c in self.chained_optimizers if not getattr(c, "is_stub_optimizer", False)]

    def _flat_reducer(self):
        # Only called where grads_states_parallel_group_is_shared() was just checked, so the
        # first child's group is every child's (the chain's own getter would check again).
        group = self.chained_optimizers[0].get_grad_stats_parallel_group()
        return FlatNormOptimizer._flat_reducer(self, group)

    _flat_clip = FlatNormOptimizer._flat_clip

    @torch.no_grad()
    def get_grad_norm(self):
        children = self.chained_optimizers
        if len(children) == 1:
            return children[0].get_grad_norm()
        if self.grads_states_parallel_group_is_shared():
            # Every child's spans in one sum, one all-reduce: stock's one norm over the union.
            return self._flat_norm_clip.norm_reduced(2.0, *self._flat_reducer())
        # Different groups (non-distributed dense + expert): each child reduces over its
        # own group, in order, as megatron-core does; then combine.
        return torch.stack([c.get_grad_norm() for c in children]).square().sum().sqrt()

    def clip_grad_norm(self, clip_grad: float):
        """The global norm over every child; then each child's gradients scaled, on device."""
        if len(self.chained_optimizers) == 1:
            return self.chained_optimizers[0].clip_grad_norm(clip_grad)
        if clip_grad > 0.0 and self.grads_states_parallel_group_is_shared():
            return self._flat_clip(clip_grad)
        grad_norm = self.get_grad_norm()
        if clip_grad > 0.0:
            for child in self._active():
                child._flat_scale(grad_norm, clip_grad)
        return grad_norm

    @torch.no_grad()
    def per_param_grad_norms(self):
        """As :meth:`FlatNormOptimizer.per_param_grad_norms`, over every child: one pass
        and one all-reduce when the children share a group, else one per child (as
        :meth:`get_grad_norm`), the total then combined as megatron-core combines norms."""
        children = self.chained_optimizers
        if len(children) == 1:
            return children[0].per_param_grad_norms()
        if self.grads_states_parallel_group_is_shared():
            return _per_param(self, children, children[0].get_grad_stats_parallel_group())
        return concat_norms([c.per_param_grad_norms() for c in children])

    def request_per_param_grad_norms(self) -> None:
        """Make the next :meth:`step` compute every parameter's norm in its norm pass (one
        read, as without) and keep them in ``last_per_param_grad_norms`` (a
        :class:`buffers.ParamNorms`); that step clips by their total."""
        self._flat_per_param_requested = True

    def take_per_param_grad_norms(self):
        """The :class:`buffers.ParamNorms` the last requested step kept, or None (no step
        since the request, or it was skipped); clears them and any pending request."""
        self.__dict__.pop("_flat_per_param_requested", None)
        return self.__dict__.pop("last_per_param_grad_norms", None)

    @torch.no_grad()
    def count_zeros(self):
        children = self.chained_optimizers
        if self.grads_states_parallel_group_is_shared():
            zeros = sum(
                (c._flat_local_zeros() for c in children),
                torch.zeros((), dtype=torch.int64, device=_device()),
            )
            torch.distributed.all_reduce(zeros, group=self.get_grad_stats_parallel_group())
            return zeros
        return sum(c.count_zeros() for c in children if c.config.log_num_zeros_in_grad)

    @torch.no_grad()
    def step(self):
        if self.prepare_grads():
            return False, None, None
        children = [c for c in self._active() if c._flat.targets]
        clips = {c.config.clip_grad for c in children}
        if self.__dict__.pop("_flat_per_param_requested", False):
            # The per-parameter pass is the norm pass: its total clips, as get_grad_norm's.
            per_param = self.per_param_grad_norms()
            self.last_per_param_grad_norms = per_param
            grad_norm = per_param.total
            for child in children:
                if child.config.clip_grad > 0.0:
                    child._flat_scale(grad_norm, child.config.clip_grad)
        elif len(self.chained_optimizers) == 1 and children and children[0].config.clip_grad > 0:
            # One child: norm and clip as one fused sequence around the all-reduce.
            grad_norm = children[0]._flat_clip(children[0].config.clip_grad)
        elif len(clips) == 1 and min(clips) > 0.0 and self.grads_states_parallel_group_is_shared():
            # Several children, one clip value, one group: the same, over all their spans.
            grad_norm = self._flat_clip(clips.pop())
        else:
            grad_norm = self.get_grad_norm()
            for child in children:
                if child.config.clip_grad > 0.0:
                    child._flat_scale(grad_norm, child.config.clip_grad)
        skip = False
        for child in children:
            threshold = child.config.grad_norm_skip_threshold
            if math.isfinite(threshold) and grad_norm.item() > threshold:
                skip = True  # the one host sync, only when a threshold is set (as stock)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        ok = False if skip else self.step_with_ready_grads()
        return ok, grad_norm, num_zeros


def _per_param(owner, children, group):
    """Per-parameter norms over ``children``'s flat targets, reduced over ``group``.

    The stats pass and (NCCL) the all-reduce replay as one CUDA graph, as the norm does;
    gloo groups reduce between replays. Built at the first call, then kept.
    """
    nc = owner._flat_norm_clip
    pn = owner.__dict__.get("_flat_param_norms")
    if pn is None:
        targets = [t for c in children for t in c._flat.targets]
        pn = MegatronParamNorms(targets, owner._flat_names, nc.device, nc.options)
        owner._flat_param_norms = pn
    return pn.norms(2.0, nc.replay, group, FlatNormOptimizer._flat_reducer(owner, group))


_CLASSES: dict[type, type] = {}


def _flat_class(cls: type) -> type:
    """A subclass of ``cls`` with the flat methods (cached; isinstance(x, cls) still holds).

    The methods are copied into a direct subclass rather than mixed in as a second base:
    only single inheritance keeps the instance layout that ``__class__`` assignment needs.
    """
    mixin = FlatChainedOptimizer if issubclass(cls, ChainedOptimizer) else FlatNormOptimizer
    if getattr(cls, "_flat_base", None) is not None:
        return cls
    if cls not in _CLASSES:
        methods = {k: v for k, v in vars(mixin).items() if not k.startswith("__")}
        methods.update(_flat_base=cls, __doc__=mixin.__doc__)
        _CLASSES[cls] = type(f"Flat{cls.__name__}", (cls,), methods)
    return _CLASSES[cls]


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())
