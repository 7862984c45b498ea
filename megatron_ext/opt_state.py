"""Per optimizer, once: which flat buffers it reads, and the state its norm and clip use.

:func:`_build_state` turns a megatron-core optimizer (one child of a chain) and the model
chunks' placed buffers into a :class:`~megatron_ext.targets.FlatOptimizerState`.
"""

from __future__ import annotations

import torch

from buffers import ops
from buffers.options import DEFAULT, BufferOptions

from . import seam
from .ddp import counted_records
from .layout import BufferLayout
from .targets import FlatOptimizerState, buffer_target, mirror_view

DistributedOptimizer = seam.target("DistributedOptimizer")
Float16OptimizerWithFloat16Params = seam.target("Float16OptimizerWithFloat16Params")
FP32Optimizer = seam.target("FP32Optimizer")


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


def buffers_device(placed) -> torch.device:
    """Where the flat buffers live (the first one's device), so results live there too.

    With no buffers at all: the current CUDA device when there is one, else the CPU.
    """
    if placed:
        return placed[0][0].grad_data.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
