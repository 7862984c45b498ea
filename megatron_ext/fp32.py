"""Keeping chosen parameters in fp32 inside a bf16/fp16 Megatron model."""

from __future__ import annotations

import torch

from . import seam

_MCoreFloat16Module = seam.target("Float16Module")

KEEP_IN_FP32 = "keep_in_fp32"


def mark_keep_in_fp32(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """Mark ``param`` to stay fp32 (sets ``param.keep_in_fp32 = True``) and return it."""
    if not isinstance(param, torch.Tensor) or not param.is_floating_point():
        raise TypeError(f"mark_keep_in_fp32 needs a floating-point parameter, got {type(param)}")
    upstream = seam.optional("upstream mark_keep_in_fp32")  # Megatron-LM main (#5929)
    if upstream is not None:
        upstream(param)
    param.keep_in_fp32 = True  # the attribute upstream sets too
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


class Float16Module(_MCoreFloat16Module):
    """megatron-core's ``Float16Module`` that leaves ``keep_in_fp32`` parameters in fp32.

    megatron-core 0.19 casts every parameter to bf16/fp16. Marked parameters are saved
    before that cast and restored after it, so their values are not rounded through bf16.
    The wrapped module must accept a mix of dtypes in its forward (as models with fp32
    islands do anyway).
    """

    def __init__(self, config, module: torch.nn.Module) -> None:
        kept = {id(p): p.detach().clone() for p in module.parameters() if is_keep_in_fp32(p)}
        super().__init__(config, module)
        for p in self.module.parameters():
            if id(p) in kept:
                p.data = kept[id(p)].float()
