"""Keeping chosen parameters in fp32 inside a bf16/fp16 Megatron model."""

from __future__ import annotations

from typing import Any

import torch

from . import seam

_MCoreFloat16Module: Any = seam.target("Float16Module")

KEEP_IN_FP32 = "keep_in_fp32"


def mark_keep_in_fp32(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """Mark ``param`` to stay fp32 (sets ``param.keep_in_fp32 = True``) and return it."""
    if not isinstance(param, torch.Tensor) or not param.is_floating_point():
        raise TypeError(f"mark_keep_in_fp32 needs a floating-point parameter, got {type(param)}")
    upstream = seam.optional("upstream mark_keep_in_fp32")  # Megatron-LM main (#5929)
    if upstream is not None:
        upstream(param)
    setattr(param, KEEP_IN_FP32, True)  # the attribute upstream sets too
    return param


def is_keep_in_fp32(param: torch.Tensor) -> bool:
    return bool(getattr(param, KEEP_IN_FP32, False))


def cast_marked_to_fp32(module: torch.nn.Module) -> list[str]:
    """Cast every parameter marked ``keep_in_fp32`` back to fp32, in place; return names."""
    names = []
    for name, p in module.named_parameters():
        if is_keep_in_fp32(p) and p.dtype != torch.float32:
            p.data = p.data.float()
            names.append(name)
    return names


_ALIGNED = "_megatron_ext_input_follows_weight"


def align_router_inputs(module: torch.nn.Module) -> list[str]:
    """Give every MoE router of ``module`` whose weight is kept in fp32 a forward pre-hook
    that casts its input to the weight's dtype (bf16 to fp32 is exact); return their names.

    megatron-core's gating (``router_gating_linear``) multiplies the router's input by its
    weight as they come. With transformer-engine installed that is TE's GEMM, which refuses
    a bf16 input beside an fp32 weight (cuBLAS: "an unsupported value or parameter was
    passed to the function"); without TE it rounds the fp32 weight to the input's dtype
    unless ``moe_router_dtype`` is fp32. With the input cast, the gating runs in fp32 with
    the unrounded weight on both paths, its logits are fp32, and the input's gradient goes
    back in the input's dtype. The cost: the router saves its input in fp32 for the
    backward (one activation per MoE layer at twice its bf16 size). Registered once per
    router, so calling this again changes nothing."""
    router = seam.target("MoE router")
    names = []
    for name, sub in module.named_modules():
        if not isinstance(sub, router) or getattr(sub, _ALIGNED, False):
            continue
        weight = getattr(sub, "weight", None)
        if isinstance(weight, torch.Tensor) and is_keep_in_fp32(weight):
            sub.register_forward_pre_hook(_input_to_weight_dtype, with_kwargs=True)
            setattr(sub, _ALIGNED, True)
            names.append(name)
    return names


def _input_to_weight_dtype(module: torch.nn.Module, args: tuple, kwargs: dict):
    weight = module.weight
    if not isinstance(weight, torch.Tensor):  # registered only where it is one
        return None
    dtype = weight.dtype
    if args and _needs_cast(args[0], dtype):
        return (args[0].to(dtype), *args[1:]), kwargs
    if _needs_cast(kwargs.get("input"), dtype):
        return args, {**kwargs, "input": kwargs["input"].to(dtype)}
    return None


def _needs_cast(x, dtype: torch.dtype) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype


class Float16Module(_MCoreFloat16Module):
    """megatron-core's ``Float16Module`` that leaves ``keep_in_fp32`` parameters in fp32.

    megatron-core 0.19 casts every parameter to bf16/fp16. Marked parameters are saved
    before that cast and restored after it, so their values are not rounded through bf16.
    The wrapped module must accept a mix of dtypes in its forward (as models with fp32
    islands do anyway); an MoE router kept in fp32 gets its input cast
    (:func:`align_router_inputs`).
    """

    def __init__(self, config, module: torch.nn.Module) -> None:
        kept = {id(p): p.detach().clone() for p in module.parameters() if is_keep_in_fp32(p)}
        super().__init__(config, module)
        for p in self.module.parameters():
            if id(p) in kept:
                p.data = kept[id(p)].float()
        align_router_inputs(self.module)
