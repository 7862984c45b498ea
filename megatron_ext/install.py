"""Opt-in, reversible replacement of megatron-core's list-based norm and clip functions."""

from __future__ import annotations

import sys

import torch

import buffers
from buffers import ops

_NAMES = ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32")
_patched: list[tuple[object, str, object]] = []  # (module, name, original)


def get_grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
    """Dtype-safe ``get_grad_norm_fp32``: same arguments and collective, fp32 accumulation.

    Groups the list by (device, dtype) before any fused launch, so a mix of bf16 and fp32
    gradients gives the right norm. Returns a 0-dim fp32 tensor (no host sync).
    """
    grads = [grads_for_norm] if isinstance(grads_for_norm, torch.Tensor) else list(grads_for_norm)
    device = grads[0].device if grads else torch.device("cuda", torch.cuda.current_device())
    # megatron-core always all-reduces (a None group is the whole world); total_norm reads
    # None as "local only", so name the world group explicitly.
    group = grad_stats_parallel_group
    if group is None:
        group = torch.distributed.group.WORLD
    return buffers.total_norm(grads, norm_type, group=group, device=device)


def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Dtype-safe ``clip_grad_by_total_norm_fp32``: any grad dtype, coefficient on device."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [g.detach() for g in (getattr(p, attr, None) for p in params) if g is not None]
    if not grads:
        return
    if not isinstance(total_norm, torch.Tensor):
        total_norm = torch.tensor(float(total_norm), dtype=torch.float32)
    buffers.scale_(grads, ops.clip_coefficient(total_norm.to(grads[0].device).float(), max_norm))


_REPLACEMENTS = {
    "get_grad_norm_fp32": get_grad_norm_fp32,
    "clip_grad_by_total_norm_fp32": clip_grad_by_total_norm_fp32,
}


def install() -> list[str]:
    """Replace megatron-core's ``get_grad_norm_fp32`` and ``clip_grad_by_total_norm_fp32``.

    Replaces the two functions in ``megatron.core.optimizer.clip_grads`` and in every
    module already imported that holds them under those names (in megatron-core 0.19:
    ``megatron.core.optimizer.optimizer``, ``megatron.core.optimizer.layer_wise_optimizer``
    and ``megatron.core.models.mimo.optimizer``, when imported), with the dtype-safe versions
    in this module, built on :func:`buffers.total_norm`'s grouping and :func:`buffers.scale_`.
    Modules imported later that import them from ``clip_grads`` get the new ones too.
    ``count_zeros_fp32`` is left alone (it is per-tensor and dtype-safe). Idempotent.

    Returns:
        The ``module.name`` entries replaced.
    """
    import megatron.core.optimizer.clip_grads as clip_grads

    if _patched:
        return [f"{m.__name__}.{n}" for m, n, _ in _patched]
    originals = {n: getattr(clip_grads, n) for n in _NAMES}
    for module in list(sys.modules.values()):
        for name, original in originals.items():
            if getattr(module, name, None) is original:
                _patched.append((module, name, original))
                setattr(module, name, _REPLACEMENTS[name])
    return [f"{m.__name__}.{n}" for m, n, _ in _patched]


def uninstall() -> None:
    """Restore every function :func:`install` replaced."""
    while _patched:
        module, name, original = _patched.pop()
        setattr(module, name, original)
