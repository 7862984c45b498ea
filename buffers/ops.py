"""Fused reductions and scaling over spans of flat, homogeneous-dtype buffers.

Every function here takes, per flat buffer, the list of views (spans) it must read. A list
never mixes dtypes: that is the invariant the flat buffers exist for. Each call issues one
fused launch per buffer (a single ``vector_norm`` for one span, a multi-tensor launch for
several) plus a handful of scalar ops on the results, and never syncs with the host.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

INF = math.inf


def check_norm_type(norm_type: float) -> float:
    """Return ``norm_type`` as a float, or raise: p > 0 or inf are accepted."""
    p = float(norm_type)
    if not (p == INF or p > 0):
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}")
    return p


class TorchBackend:
    """torch's own kernels; CPU and CUDA."""

    name = "torch"

    def norms(self, views: Sequence[torch.Tensor], p: float) -> torch.Tensor:
        """Per-view p-norms of one homogeneous list, accumulated in fp32 or wider (1-D)."""
        acc = torch.promote_types(views[0].dtype, torch.float32)
        if len(views) == 1:
            return torch.linalg.vector_norm(views[0], p, dtype=acc).reshape(1)
        return torch.stack(torch._foreach_norm(list(views), p, dtype=acc))

    def scale_(self, views: Sequence[torch.Tensor], coeff: torch.Tensor) -> None:
        if len(views) == 1:
            views[0].mul_(coeff)
        else:
            torch._foreach_mul_(list(views), coeff)


class TransformerEngineBackend(TorchBackend):
    """transformer-engine's multi-tensor L2 norm for p = 2; torch for everything else.

    The kernel functions are injected (``applier``, ``l2norm``) so the logic around them is
    exercised by tests with a torch stand-in; TE itself is only loaded by :func:`backend_for`.
    TE's scale kernel takes a host float, which would need a sync, so scaling stays torch's.
    """

    name = "transformer_engine"

    def __init__(self, applier, l2norm, device: torch.device) -> None:
        self._applier = applier
        self._l2norm = l2norm
        self._overflow = torch.zeros(1, dtype=torch.int32, device=device)

    def norms(self, views: Sequence[torch.Tensor], p: float) -> torch.Tensor:
        if p != 2.0:
            return super().norms(views, p)
        # TE reads every tensor of one launch with the first tensor's dtype: the list is
        # homogeneous by construction (one buffer), which is what makes this call safe.
        norm, _ = self._applier(self._l2norm, self._overflow, [list(views)], False)
        return norm.reshape(1).float()


_TORCH = TorchBackend()
_TE_CACHE: dict[torch.device, TorchBackend] = {}


def backend_for(device: torch.device) -> TorchBackend:
    """TE's kernels on CUDA when TE imports (unless ``BUFFERS_BACKEND=torch``), else torch."""
    if device.type != "cuda" or os.environ.get("BUFFERS_BACKEND", "") == "torch":
        return _TORCH
    if device not in _TE_CACHE:
        try:
            import transformer_engine_torch as tex
            from transformer_engine.pytorch.optimizers import multi_tensor_applier
        except ImportError:
            _TE_CACHE[device] = _TORCH
        else:
            _TE_CACHE[device] = TransformerEngineBackend(
                multi_tensor_applier, tex.multi_tensor_l2norm, device
            )
    return _TE_CACHE[device]


def local_power_stat(
    groups: Sequence[Sequence[torch.Tensor]], p: float, device: torch.device
) -> torch.Tensor:
    """This rank's contribution to a p-norm: sum of |x|^p (max |x| for inf), fp32, 0-dim.

    ``groups`` holds one homogeneous list of views per flat buffer; empty lists are skipped
    and no views at all give 0.
    """
    parts = []
    for views in groups:
        if not views:
            continue
        norms = backend_for(views[0].device).norms(views, p)
        if p == INF:
            parts.append(norms.max())
        elif p == 2.0:
            parts.append(norms.square().sum())
        else:
            parts.append(norms.pow(p).sum())
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=device)
    # fp64 buffers accumulate in fp64; the combined statistic is fp32 like every other.
    stacked = torch.stack([t.to(device, torch.float32) for t in parts])
    return stacked.max() if p == INF else stacked.sum()


def all_reduce_stat(stat: torch.Tensor, p: float, group) -> torch.Tensor:
    """Combine per-rank stats with exactly one all-reduce (SUM, or MAX for inf)."""
    import torch.distributed as dist

    if p != INF:
        dist.all_reduce(stat, op=dist.ReduceOp.SUM, group=group)
        return stat
    # MAX is not NaN-propagating on every backend: carry "some rank saw NaN" as a second
    # element of the same MAX all-reduce.
    nan = torch.isnan(stat)
    packed = torch.stack([torch.where(nan, torch.zeros_like(stat), stat), nan.float()])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    return torch.where(packed[1] > 0, torch.full_like(stat, math.nan), packed[0])


def finish_norm(stat: torch.Tensor, p: float) -> torch.Tensor:
    """Turn a (reduced) power stat into the norm."""
    if p == INF:
        return stat
    if p == 2.0:
        return stat.sqrt()
    return stat.pow(1.0 / p)


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``max_norm / (norm + 1e-6)`` clamped to 1, as a device tensor (torch's convention)."""
    coeff = max_norm / (total_norm + 1e-6)
    # Clamping on device instead of `if coeff < 1` avoids a host sync.
    return torch.clamp(coeff, max=1.0)


def scale_groups_(groups: Sequence[Sequence[torch.Tensor]], coeff: torch.Tensor) -> None:
    """Multiply every view by the device scalar ``coeff``; one launch per buffer."""
    for views in groups:
        if views:
            backend_for(views[0].device).scale_(views, coeff.to(views[0].device))


def count_zeros_groups(
    groups: Sequence[Sequence[torch.Tensor]], padding: int, device: torch.device
) -> torch.Tensor:
    """Zero elements in all views minus ``padding`` known-zero padding elements (int64)."""
    total = torch.zeros((), dtype=torch.int64, device=device)
    numel = 0
    for views in groups:
        for v in views:
            total = total + torch.count_nonzero(v).to(device)
            numel += v.numel()
    return (numel - padding) - total
