"""``gradient_accumulation_fusion`` without apex: refused in one line, before the buffers are built.

With ``gradient_accumulation_fusion=True`` in the ``TransformerConfig``, megatron-core's own
linear layers (``ColumnParallelLinear``, ``RowParallelLinear``, e.g. a GPT's output layer,
or every layer of the local spec) accumulate weight gradients through apex's CUDA extension
``fused_weight_gradient_mlp_cuda``. Without it, ``ColumnParallelLinear`` raises at
construction and ``RowParallelLinear`` fails at the first backward (megatron-core calls the
missing module). transformer-engine's layers fuse without apex, but the same config field
drives both, so the choice is the user's: turn the fusion off, or install apex.
"""

from __future__ import annotations

import importlib.util

import torch

from . import seam

KERNEL = "fused_weight_gradient_mlp_cuda"


class MissingFusionKernelError(RuntimeError):
    """``gradient_accumulation_fusion`` is on and apex's fused weight-gradient kernel is absent."""


def fusion_kernel_available() -> bool:
    """Whether apex's ``fused_weight_gradient_mlp_cuda`` is installed (megatron-core imports
    it by that name)."""
    return importlib.util.find_spec(KERNEL) is not None


def message(turn_off: str, layer: str | None = None) -> str:
    """The one-line refusal; ``turn_off`` says how this entry point turns the fusion off,
    ``layer`` names one of the module's megatron-core linear layers when known."""
    which = f"; here {layer!r}" if layer else ""
    return (
        f"gradient_accumulation_fusion needs apex's {KERNEL} CUDA extension for "
        "megatron-core's own linear layers (ColumnParallelLinear, RowParallelLinear: a GPT's "
        f"output layer, every layer of the local spec{which}), and it is not installed: "
        f"{turn_off}, or install apex with its --cpp_ext --cuda_ext extensions"
    )


def check_module(module: torch.nn.Module) -> None:
    """Refuse ``module`` when apex's kernel is absent and one of its megatron-core linear
    layers was built with ``gradient_accumulation_fusion`` on (the layer's own attribute,
    which its forward passes on: transformer-engine layers fused beside megatron-core layers
    built unfused pass).

    Raises:
        MissingFusionKernelError: one line naming the kernel, a layer and what to do.
    """
    if fusion_kernel_available():
        return
    for name, layer in module.named_modules():
        entry = next((e for e in LAYER_ENTRIES if isinstance(layer, seam.target(e))), None)
        if entry is None:
            continue
        seam.check_instance(entry, layer)
        if layer.gradient_accumulation_fusion:
            turn_off = "set gradient_accumulation_fusion=False in the TransformerConfig"
            raise MissingFusionKernelError(message(turn_off, name or type(module).__name__))


LAYER_ENTRIES = ("ColumnParallelLinear", "RowParallelLinear")  # seam entries
