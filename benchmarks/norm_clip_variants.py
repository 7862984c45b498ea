"""The norm/clip implementations that ``norm_clip.py`` compares, one builder per table row.

:data:`VARIANTS` is the registry (row label -> builder). A builder gets fresh parameters
(names, shapes and dtypes; no weight storage) and the device, allocates gradients its own
way and returns a :class:`Prepared`: the gradient tensors in inventory order (the driver
fills them with random values) and the norm and clip calls to time.

Hook for more rows: register another builder under a new label. Its ``fields`` name the
row, e.g. ``fields={"variant": "flat", "path": "megatron_spans"}`` for a second ``flat``
row that goes through Megatron's buffers and spans.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, find the repo

import torch

from benchmarks import common
from buffers import FlatGradBuffers

NamedParams = list[tuple[str, torch.nn.Parameter]]
CPU_NOTE = "per-parameter algorithm re-implemented for CPU"
CPU_PATH = "cpu_reimpl"  # the megatron row's route on the CPU: shown as megatron/cpu_reimpl


@dataclass
class Prepared:
    """One variant, ready to run on one inventory.

    Attributes:
        grads: every gradient tensor, in inventory order.
        norm: computes the total L2 norm (a tensor or a float).
        clip: clips to the given max norm and returns the pre-clip norm.
        per_param: computes every parameter's L2 norm and returns them as one 1-D tensor
            (what the call itself returns, timed as it is); None where a row has no
            per-parameter path.
        per_param_order: where each inventory parameter's norm sits in that tensor (an
            index tensor), when it is not in inventory order; the accuracy check applies it,
            outside the timed call.
        fields: record fields of this row: ``variant`` (default: the label), ``path`` (which
            route a variant takes, when it has several), ``note``.
        keep: what the calls need alive (FlatGradBuffers holds its parameters weakly).
    """

    grads: list[torch.Tensor]
    norm: Callable[[], Any]
    clip: Callable[[float], Any]
    per_param: Callable[[], torch.Tensor] | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    per_param_order: torch.Tensor | None = None
    keep: Any = None


Builder = Callable[[NamedParams, torch.device], Prepared]
VARIANTS: dict[str, Builder] = {}


def register(label: str) -> Callable[[Builder], Builder]:
    """Decorator: add a builder to :data:`VARIANTS` under ``label``."""

    def add(builder: Builder) -> Builder:
        VARIANTS[label] = builder
        return builder

    return add


def _attach_grads(named: NamedParams) -> list[torch.Tensor]:
    for _, p in named:
        p.grad = torch.empty(p.shape, dtype=p.dtype, device=p.device)
    return [p.grad for _, p in named]


# --- megatron ------------------------------------------------------------------------------


def _per_parameter_norm(grads: list[torch.Tensor]) -> float:
    # Megatron's fallback without TE or Apex: one norm per tensor in the tensor's own dtype,
    # each read back to the host to build a tensor of norms (whose dtype torch infers from
    # them: bf16 when all are bf16), the norm of that, and a host float at the end.
    per_tensor = torch.tensor([torch.linalg.vector_norm(g) for g in grads])
    return float(torch.linalg.vector_norm(per_tensor))


def _per_parameter_clip(grads: list[torch.Tensor], max_norm: float) -> float:
    total = _per_parameter_norm(grads)
    coeff = max_norm / (total + 1.0e-6)
    if coeff < 1.0:  # a host-side decision: the norm is already a Python float
        for g in grads:
            g.copy_(g * coeff)
    return total


def _per_parameter_loop(grads: list[torch.Tensor]) -> torch.Tensor:
    # What forks that log per-layer norms do: one vector_norm per tensor (fp32 accumulation),
    # stacked on the device.
    return torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])


def _megatron_on_cuda(named: NamedParams, grads: list[torch.Tensor]) -> Prepared:
    from megatron.core.optimizer.clip_grads import (
        clip_grad_by_total_norm_fp32,
        get_grad_norm_fp32,
    )

    params = [p for _, p in named]

    def clip(max_norm: float):
        total = get_grad_norm_fp32(grads)
        clip_grad_by_total_norm_fp32(params, max_norm, total)
        return total

    return Prepared(
        grads, lambda: get_grad_norm_fp32(grads), clip, lambda: _per_parameter_loop(grads)
    )


@register("megatron")
def megatron(named: NamedParams, device: torch.device) -> Prepared:
    """megatron-core's ``get_grad_norm_fp32`` and ``clip_grad_by_total_norm_fp32`` on the list.

    They allocate on CUDA (and all-reduce over the default process group, which the driver
    creates), so on the CPU the same per-parameter algorithm runs, re-implemented here: that
    row's path is :data:`CPU_PATH` (``megatron/cpu_reimpl`` in the table and the plot).
    """
    grads = _attach_grads(named)
    if device.type == "cuda":
        return _megatron_on_cuda(named, grads)
    return Prepared(
        grads,
        lambda: _per_parameter_norm(grads),
        lambda max_norm: _per_parameter_clip(grads, max_norm),
        lambda: _per_parameter_loop(grads),
        {"path": CPU_PATH, "note": CPU_NOTE},
    )


# --- upstream_fix --------------------------------------------------------------------------


def _group_by_dtype(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.dtype, []).append(g)
    return list(groups.values())


def _grouped_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """Per-tensor L2 norms in inventory order, computed per dtype group."""
    # The fix regroups on every call; that walk over every gradient is part of what we time.
    # Per-tensor norms accumulate in fp32, as the fused multi-tensor kernel it calls does.
    order: dict[torch.dtype, list[int]] = {}
    for i, g in enumerate(grads):
        order.setdefault(g.dtype, []).append(i)
    norms = torch.empty(len(grads), dtype=torch.float32, device=grads[0].device)
    for idx in order.values():
        group = torch._foreach_norm([grads[i] for i in idx], 2.0, dtype=torch.float32)
        norms[idx] = torch.stack(group)
    return norms


def _grouped_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.linalg.vector_norm(_grouped_norms(grads))


def _grouped_clip(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    total = _grouped_norm(grads)
    # Clamped on the device instead of `if coeff < 1`, so the host never waits.
    coeff = torch.clamp(max_norm / (total + 1.0e-6), max=1.0)
    for group in _group_by_dtype(grads):
        torch._foreach_mul_(group, coeff)
    return total


@register("upstream_fix")
def upstream_fix(named: NamedParams, device: torch.device) -> Prepared:
    """Group the gradient list by dtype on every call, then one multi-tensor call per group."""
    grads = _attach_grads(named)
    return Prepared(
        grads,
        lambda: _grouped_norm(grads),
        lambda max_norm: _grouped_clip(grads, max_norm),
        lambda: _grouped_norms(grads),
    )


# --- torch ---------------------------------------------------------------------------------


@register("torch")
def torch_foreach(named: NamedParams, device: torch.device) -> Prepared:
    """``torch.nn.utils.get_total_norm`` and ``clip_grad_norm_`` with ``foreach=True``."""
    grads = _attach_grads(named)
    params = [p for _, p in named]
    return Prepared(
        grads,
        lambda: torch.nn.utils.get_total_norm(grads, 2.0, foreach=True),
        lambda max_norm: torch.nn.utils.clip_grad_norm_(params, max_norm, 2.0, foreach=True),
        # Per-parameter norms the torch way: one multi-tensor norm, stacked.
        lambda: torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)),
    )


# --- flat (ours) ---------------------------------------------------------------------------


@register("flat")
def flat(named: NamedParams, device: torch.device) -> Prepared:
    """Ours: :class:`buffers.FlatGradBuffers`, one fused launch per dtype buffer."""
    fgb = FlatGradBuffers(named)
    return Prepared(
        [fgb.view(p) for _, p in named],
        fgb.grad_norm,
        fgb.clip_grad_norm_,
        lambda: fgb.grad_norm(per_param=True).norms,
        keep=named,
    )


# --- flat through the Megatron integration --------------------------------------------------

CUDA_ONLY = {"flat/megatron_spans"}


class _Holder(torch.nn.Module):
    """A module that only holds the inventory's parameters (Megatron's DDP wraps modules)."""

    def __init__(self, named: NamedParams) -> None:
        super().__init__()
        for name, p in named:
            self.register_parameter(name.replace(".", "__"), p)


@register("flat/megatron_spans")  # named as its rows are
def flat_megatron(named: NamedParams, device: torch.device) -> Prepared:
    """Ours through megatron_ext: DDP buffers, distributed optimizer, spans over buckets.

    Several buckets (``bucket_size`` about an eighth of the bytes, ``overlap_grad_reduce``)
    so the spans cross bucket boundaries. Routed experts (``.experts.local_experts.`` in the
    name) are marked as megatron-core marks them, so an MoE inventory gets expert buffers
    and a chain of two optimizers (dense and expert) over one group, as in training. CUDA
    only: megatron-core's DDP allocates there.
    """
    if device.type != "cuda":
        raise RuntimeError("flat/megatron_spans needs CUDA (megatron-core's DDP allocates on CUDA)")
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_ext

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    for name, p in named:  # DDP copies parameter values into its buffer: give them storage
        p.data = torch.zeros(p.shape, dtype=p.dtype, device=device)
        if ".experts.local_experts." in name:
            p.allreduce = False  # megatron-core's expert mark: expert buffers, own optimizer
    numel = sum(p.numel() for _, p in named)
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, bf16=True)
    # Precision-aware (decoupled gradients): the optimizer reads the gradient buffers
    # themselves, so clip scales them in place. Without TE, megatron-core allows that only
    # with its CPU-offload optimizer; fraction 0 keeps everything on the GPU.
    stack = megatron_ext.build_stack(
        _Holder(named),
        config,
        ddp=dict(overlap_grad_reduce=True, bucket_size=max(numel // 8, 1_000_000)),
        optimizer=dict(
            optimizer="adam",
            lr=1e-4,
            bf16=True,
            use_precision_aware_optimizer=True,
            optimizer_cpu_offload=True,
            optimizer_offload_fraction=0.0,
        ),
    )
    model, opt = stack.model, stack.optimizer
    buckets = sum(len(b.buckets) for b in model.all_grad_buffers())
    chain = getattr(opt, "chained_optimizers", [opt])

    def clip(max_norm: float):
        # Megatron reads clip_grad=0 as "clipping off"; the driver's max_norm=0 means "always
        # scale", so pass the smallest positive value instead (coefficient ~0 every call).
        return opt.clip_grad_norm(max_norm if max_norm > 0 else 1e-30)

    def per_param() -> torch.Tensor:
        return opt.per_param_grad_norms().norms  # in the optimizer's order of names

    # inventory index -> position in the optimizer's names (for the accuracy check only)
    names = opt.per_param_grad_norms().names
    at = {n: i for i, n in enumerate(names)}
    order = torch.tensor([at[n.replace(".", "__")] for n, _ in named], device=device)

    return Prepared(
        [p.main_grad for _, p in named],
        opt.get_grad_norm,
        clip,
        per_param,
        {
            "variant": "flat",
            "path": "megatron_spans",
            "note": f"{buckets} buckets, {len(chain)} optimizer(s), decoupled",
        },
        per_param_order=order,
    )


if __name__ == "__main__":
    sys.exit(common.not_a_script(__file__, ("norm_clip.py",)))
