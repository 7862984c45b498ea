"""CPU offload, loading its checkpoints: the optimizer classes a ``HybridDeviceOptimizer``
keeps in its param groups, made loadable by torch's weights-only unpickler."""

from __future__ import annotations

from typing import Any

import torch


def allow_optimizer_classes_in_checkpoints(hdo) -> list[type]:
    """Let ``torch.load(weights_only=True)`` read a checkpoint holding this optimizer's
    param groups: megatron-core's ``HybridDeviceOptimizer`` keeps its CPU and GPU optimizer
    classes in every param group (``cpu_optimizer_cls``, ``gpu_optimizer_cls``), and
    megatron-core 0.18's ``dist_checkpointing`` loads the common state with torch's default
    weights-only unpickler, which refuses any class it was not told about ("Unsupported
    global: GLOBAL torch.optim.adamw.AdamW"): an offloaded checkpoint could be saved but
    not loaded. The two classes (optimizer classes of torch, transformer-engine or Apex,
    named by the optimizer itself) are added to torch's safe globals; returns them."""
    classes: list[Any] = [
        c
        for c in (getattr(hdo, "cpu_optimizer_cls", None), getattr(hdo, "gpu_optimizer_cls", None))
        if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
    ]
    if classes:
        torch.serialization.add_safe_globals(classes)
    return classes
