"""Combinations refused when the optimizer is built, each with what to change.

megatron-core accepts them and then fails at the first step (or, through transformer-engine,
asserts there); refusing them at construction names the combination instead.
"""

from __future__ import annotations

import torch


class UnsupportedCombinationError(ValueError):
    """An optimizer configuration megatron-core cannot step, refused at construction."""


def check(child, placed) -> None:
    """Refuse ``child`` (one optimizer of the chain) if megatron-core cannot step it.

    ``placed``: ``(buffer, layout, fp32 island)`` of every gradient buffer
    (:func:`megatron_ext.optimizer.placed_buffers`).
    """
    if getattr(child, "is_stub_optimizer", False):
        return
    if not getattr(child.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
        return
    mine = {id(b) for b in getattr(child, "buffers", ())}
    buffers = [(buf, layout, island) for buf, layout, island in placed if id(buf) in mine]
    if getattr(child, "grad_scaler", None) is not None:
        low = [
            layout.key.describe()
            for buf, layout, island in buffers
            if buf.grad_dtype == torch.bfloat16 and _reads_buffer(buf, island)
        ]
        if low:
            raise UnsupportedCombinationError(
                "the precision-aware optimizer (use_precision_aware_optimizer=True) with a loss "
                f"scale (loss_scale={child.config.loss_scale!r}, fp16={child.config.fp16!r}) "
                f"and bf16 gradients ({low[0]}): megatron-core unscales those in place with "
                "torch's _amp_foreach_non_finite_check_and_unscale_, which has no bf16 kernel, "
                "so the first step would fail. bf16 needs no loss scale: drop loss_scale; or "
                "reduce gradients in fp32 (grad_reduce_in_fp32=True), or turn the "
                "precision-aware optimizer off"
            )
    inner = getattr(child, "optimizer", None)
    if type(inner).__module__.startswith("transformer_engine"):
        mixed = [
            layout.key.describe()
            for buf, layout, island in buffers
            if island is not None and buf.grad_dtype != torch.float32 and _reads_buffer(buf, island)
        ]
        if mixed:
            raise UnsupportedCombinationError(
                "the precision-aware optimizer with transformer-engine's "
                f"{type(inner).__name__} and fp32 local accumulation "
                "(param_name_patterns_for_fp32_local_accumulation) for some parameters of a "
                f"{mixed[0]} buffer: their fp32 gradients would sit beside the buffer's "
                "lower-precision ones in one launch, which transformer-engine's kernel "
                "rejects. Reduce gradients in fp32 (grad_reduce_in_fp32=True), match every "
                "parameter ('all') or none, or offload the optimizer (optimizer_cpu_offload=True)"
            )


def _reads_buffer(buf, island) -> bool:
    """Whether some parameter's gradient is read in ``buf`` itself (not all in the island)."""
    if island is None:
        return True
    in_island = sum(len(b.params_with_extra_main_grads) for b in buf.buckets)
    return in_island < len(buf.param_index_map)
