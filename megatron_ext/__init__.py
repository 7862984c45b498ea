"""Megatron-Core integration of per-dtype contiguous gradient buffers.

Adopt it by swapping three names::

    cfg = megatron_ext.DistributedDataParallelConfig(per_dtype_grad_buffers=True, ...)
    model = megatron_ext.DistributedDataParallel(transformer_config, cfg, module)
    opt = megatron_ext.get_megatron_optimizer(optimizer_config, [model])

or build all three in one call, the two configs agreeing on the distributed optimizer::

    stack = megatron_ext.build_stack(module, transformer_config, optimizer=dict(lr=1e-3))
"""

from . import requirements

requirements.check()  # megatron-core (the `megatron` extra) and its Python, named if missing

from . import seam
from .notices import import_notices_hidden

with import_notices_hidden():  # megatron-core's notices about its own fallbacks (notices.py)
    seam.check()  # the installed megatron-core against every touch point, before any is used

from .config import DistributedDataParallelConfig
from .ddp import DistributedDataParallel, LayoutMismatchError
from .fp32 import Float16Module, cast_marked_to_fp32, mark_keep_in_fp32
from .install import install, uninstall
from .megatron_options import MegatronOptions
from .norm_audit import AuditResult, NormOwnershipError, audit_norm_ownership, explain_norm
from .offload_drain import drain_offload
from .optimizer import enable_flat_norm, get_megatron_optimizer
from .refusals import UnsupportedCombinationError
from .stack import Stack, build_stack
from .wgrad_fusion import MissingFusionKernelError

__all__ = [
    "AuditResult",
    "NormOwnershipError",
    "audit_norm_ownership",
    "build_stack",
    "explain_norm",
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "Float16Module",
    "LayoutMismatchError",
    "MegatronOptions",
    "MissingFusionKernelError",
    "Stack",
    "UnsupportedCombinationError",
    "cast_marked_to_fp32",
    "drain_offload",
    "enable_flat_norm",
    "get_megatron_optimizer",
    "install",
    "mark_keep_in_fp32",
    "uninstall",
]
