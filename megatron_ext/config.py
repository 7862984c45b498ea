"""The DDP config option that turns per-dtype gradient buffers on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import seam

_MCoreDDPConfig: Any = seam.target("DistributedDataParallelConfig")


@dataclass
class DistributedDataParallelConfig(_MCoreDDPConfig):
    """megatron-core's DDP config plus ``per_dtype_grad_buffers`` (default False).

    With the option on, every gradient dtype lives in its own flat buffer (fp32 islands for
    parameters kept in fp32), and the optimizers built by
    :func:`megatron_ext.get_megatron_optimizer` compute norm and clip from spans of those
    buffers worked out once at construction.
    """

    per_dtype_grad_buffers: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.per_dtype_grad_buffers:
            return
        if self.use_megatron_fsdp or self.use_custom_fsdp:
            raise ValueError(
                "per_dtype_grad_buffers=True works with megatron-core's DDP buffers, not "
                "Megatron-FSDP; set use_megatron_fsdp=False (and use_custom_fsdp=False)"
            )
        if self.num_distributed_optimizer_instances != 1:
            raise ValueError(
                "per_dtype_grad_buffers=True supports num_distributed_optimizer_instances=1 "
                f"only (got {self.num_distributed_optimizer_instances})"
            )
