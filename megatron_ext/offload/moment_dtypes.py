"""CPU offload, which Adam moment dtypes the host keeps, read from megatron-core's
``OptimizerConfig``."""

from __future__ import annotations

import warnings

import torch

from .step import MOMENT_DTYPES


def offload_moment_dtypes(config, chunked_step: bool) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes of the offloaded Adam moments: megatron-core's ``exp_avg_dtype`` and
    ``exp_avg_sq_dtype`` with the precision-aware optimizer and the chunked step, else fp32.

    megatron-core's ``HybridDeviceOptimizer`` ignores them (its CPU AdamW keeps fp32); the
    per-parameter step still does, with a warning. ``main_params_dtype`` other than fp32 is
    not honoured by either step (warned: the host master weights stay fp32).
    """
    fp32 = torch.float32
    if not getattr(config, "use_precision_aware_optimizer", False):
        return (fp32, fp32)
    asked = (getattr(config, "exp_avg_dtype", fp32), getattr(config, "exp_avg_sq_dtype", fp32))
    main = getattr(config, "main_params_dtype", fp32)
    if main != fp32:
        warnings.warn(
            f"main_params_dtype={main} is not honoured by the CPU-offloaded optimizer step: "
            "its master weights on the host stay fp32",
            stacklevel=3,
        )
    if asked == (fp32, fp32):
        return asked
    if not chunked_step:
        warnings.warn(
            f"exp_avg_dtype={asked[0]} / exp_avg_sq_dtype={asked[1]} are not honoured by the "
            "per-parameter CPU-offloaded step (torch's AdamW keeps fp32 moments on the host); "
            "use MegatronOptions(offload_step='chunked') to keep them as asked",
            stacklevel=3,
        )
        return (fp32, fp32)
    kept = " or ".join(map(str, MOMENT_DTYPES))
    for dtype in asked:
        if dtype not in MOMENT_DTYPES:
            raise ValueError(
                f"the CPU-offloaded step keeps Adam moments in {kept}, not {dtype} "
                "(OptimizerConfig exp_avg_dtype / exp_avg_sq_dtype)"
            )
    return asked
