"""Dtype-safe norm and scale for gradients that are not in flat buffers.

The correct replacements for handing one mixed-dtype list to a fused multi-tensor kernel:
tensors are grouped by (device, dtype) first, so every launch sees one dtype.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from . import ops
from .plan import check_grad_dtype


def group_by_device_dtype(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Homogeneous lists, one per (device, dtype), in first-seen order."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for i, t in enumerate(tensors):
        check_grad_dtype(t.dtype, f"tensors[{i}]")
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def total_norm(
    tensors: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    group=None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The p-norm of all ``tensors`` together, accumulated in fp32, whatever their dtypes.

    Args:
        tensors: gradients of any mix of floating dtypes and devices.
        norm_type: any number or +-inf, as torch's (0 counts the tensors holding a
            nonzero, -inf is the smallest ``|x|``: :func:`buffers.ops.check_torch_norm_type`).
        group: a process group to reduce over (one all-reduce), or None.
        device: where the result lives; default the first tensor's device (CPU if none).

    Returns:
        0-dim fp32 tensor.
    """
    p = ops.check_torch_norm_type(norm_type)
    groups = group_by_device_dtype(tensors)
    if device is None:
        device = groups[0][0].device if groups else torch.device("cpu")
    if not groups and group is None:
        return torch.zeros((), dtype=torch.float32, device=device)  # torch's, for any p
    stat = ops.local_power_stat(groups, p, torch.device(device))
    if group is not None:
        stat = ops.all_reduce_stat(stat, p, group)
    return ops.finish_norm(stat, p)


def scale_(tensors: Iterable[torch.Tensor], coeff: torch.Tensor | float) -> None:
    """Multiply every tensor in place by ``coeff`` (a device tensor needs no host sync)."""
    if not isinstance(coeff, torch.Tensor):
        coeff = torch.tensor(ops.as_number(coeff, "coeff"), dtype=torch.float32)
    groups = group_by_device_dtype(tensors)
    ops.scale_groups_(groups, coeff)
