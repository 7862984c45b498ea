"""Opt-in, reversible replacement of megatron-core's list-based norm and clip functions."""

from __future__ import annotations

import sys

import torch

from buffers import lists, ops

from . import seam

_NAMES = ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32")
_originals: dict[str, object] = {}  # name -> megatron-core's function, while installed
_replaced: list[str] = []  # what install() replaced, while installed


def get_grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
    """Dtype-safe ``get_grad_norm_fp32``: same arguments and collectives, fp32 accumulation.

    Groups the list by (device, dtype) before any fused launch, so a mix of bf16 and fp32
    gradients gives the right norm. DTensor gradients (Megatron-FSDP, torch FSDP2) are read
    through their local shards and the statistic is first all-reduced over the DTensors'
    data-parallel group, then over ``grad_stats_parallel_group``, as stock does
    (``megatron/core/optimizer/clip_grads.py``). A list that mixes DTensors and plain
    tensors raises ``ValueError`` (stock takes the group of the list's last element, so
    its result depends on the order).

    Returns a 0-dim fp32 tensor on the gradients' device, not the ``float`` stock is
    annotated with (see :func:`install`): ``float(norm)`` or ``norm.item()`` gives the float.
    """
    to_local_if_dtensor = seam.target("dtensor helpers")

    grads = [grads_for_norm] if isinstance(grads_for_norm, torch.Tensor) else list(grads_for_norm)
    data_parallel_group = _dtensor_group(grads)
    grads = [to_local_if_dtensor(grad) for grad in grads]
    p = ops.check_norm_type(norm_type)
    device = grads[0].device if grads else _default_device()
    stat = ops.local_power_stat(lists.group_by_device_dtype(grads), p, device)
    if data_parallel_group is not None:
        stat = ops.all_reduce_stat(stat, p, data_parallel_group)
    # megatron-core always all-reduces here (a None group is the whole world).
    group = grad_stats_parallel_group
    if group is None:
        group = torch.distributed.group.WORLD
    return ops.finish_norm(ops.all_reduce_stat(stat, p, group), p)


def _default_device() -> torch.device:
    """Where a norm over no gradients lives: the current CUDA device (as megatron-core's),
    or the CPU on a machine without one."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _dtensor_group(grads: list):
    """The data-parallel group of DTensor gradients; None for plain tensors (or no grads)."""
    get_data_parallel_group_if_dtensor = seam.target("dtensor group")

    groups = [get_data_parallel_group_if_dtensor(g) for g in grads]
    kinds = {g is not None for g in groups}
    if len(kinds) > 1:
        plain = groups.index(None)
        raise ValueError(
            f"grads_for_norm mixes DTensor gradients with plain tensors (element {plain} is "
            "plain): megatron-core would all-reduce the whole norm over the DTensors' "
            "data-parallel group or not at all, depending on the last element. Pass only "
            "DTensors (Megatron-FSDP) or only local tensors."
        )
    group = groups[0] if groups else None
    if any(g != group for g in groups):
        raise ValueError(
            "grads_for_norm holds DTensors over different data-parallel groups; megatron-core "
            "reduces a norm over one: pass each group's gradients separately"
        )
    return group


def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Dtype-safe ``clip_grad_by_total_norm_fp32``: any grad dtype, coefficient on device.

    DTensor gradients are scaled through their local shards, as stock does. A negative or
    NaN ``max_norm`` raises ``ValueError`` (stock would flip or poison every gradient).
    """
    to_local_if_dtensor = seam.target("dtensor helpers")

    max_norm = ops.check_max_norm(max_norm)
    params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [
        to_local_if_dtensor(g).detach()
        for g in (getattr(p, attr, None) for p in params)
        if g is not None
    ]
    if not grads:
        return
    if not isinstance(total_norm, torch.Tensor):
        total_norm = torch.tensor(float(total_norm), dtype=torch.float32)
    coeff = ops.clip_coefficient(total_norm.to(grads[0].device), max_norm)
    lists.scale_(grads, coeff)


_REPLACEMENTS = {
    "get_grad_norm_fp32": get_grad_norm_fp32,
    "clip_grad_by_total_norm_fp32": clip_grad_by_total_norm_fp32,
}


def _rebind(old_to_new: dict[int, tuple[object, object]]) -> list[str]:
    """Point every module-level name bound to an old function at its new one.

    This module is skipped: its own definitions are the replacements.
    """
    rebound = []
    for module in list(sys.modules.values()):
        if module is sys.modules[__name__]:
            continue
        try:
            namespace = vars(module)
        except TypeError:  # a module stand-in without a __dict__
            continue
        for name, value in list(namespace.items()):
            swap = old_to_new.get(id(value))
            if swap is not None and value is swap[0]:
                setattr(module, name, swap[1])
                rebound.append(f"{module.__name__}.{name}")
    return rebound


def install() -> list[str]:
    """Replace megatron-core's ``get_grad_norm_fp32`` and ``clip_grad_by_total_norm_fp32``.

    Replaces the two functions in ``megatron.core.optimizer.clip_grads`` and wherever an
    imported module holds them at module level, under any name (in megatron-core 0.19:
    ``megatron.core.optimizer.optimizer``, ``megatron.core.optimizer.layer_wise_optimizer``
    and ``megatron.core.models.mimo.optimizer``, when imported), with the dtype-safe versions
    in this module, built on :mod:`buffers.lists`' grouping by (device, dtype). Modules
    imported later that import them from ``clip_grads`` get the new ones too.
    ``count_zeros_fp32`` is left alone (it is per-tensor and dtype-safe). Idempotent.

    The norm comes back as a 0-dim fp32 tensor on the gradients' device, where stock's is
    annotated ``-> float``: a float would cost a host sync at every call, and the optimizer
    step calls it between the gradients' reduction and the clip and update it launches,
    which would then wait for the norm. Stock's own type is not one either: a 1-element
    tensor where transformer-engine is installed (no sync), a float only without it (or for
    ``norm_type=inf``). megatron-core's callers take both (the clip, the chained optimizer's
    ``math.sqrt`` of squares), and Megatron-LM's training loop makes it a float once per
    step for its log. Code of your own that logs it (``json.dumps``) takes ``float(norm)``.

    Returns:
        The ``module.name`` entries replaced.
    """
    if not _originals:
        originals = {n: seam.target(n) for n in _NAMES}
        _originals.update(originals)
        _replaced.extend(_rebind({id(f): (f, _REPLACEMENTS[n]) for n, f in originals.items()}))
    return list(_replaced)


def uninstall() -> list[str]:
    """Restore megatron-core's functions wherever :func:`install`'s replacements are bound.

    That includes modules imported after :func:`install` that took the replacements from
    ``clip_grads`` (``from ... import get_grad_norm_fp32``). Idempotent.

    Returns:
        The ``module.name`` entries restored.
    """
    if not _originals:
        return []
    restored = _rebind({id(_REPLACEMENTS[n]): (_REPLACEMENTS[n], f) for n, f in _originals.items()})
    _originals.clear()
    _replaced.clear()
    return restored
