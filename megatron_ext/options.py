"""The Megatron side's options: the buffers' switches plus how CPU offload moves data."""

from __future__ import annotations

from dataclasses import dataclass

from buffers.options import BufferOptions


@dataclass(frozen=True)
class MegatronOptions(BufferOptions):
    """:class:`buffers.options.BufferOptions` plus the offload path.

    Attributes:
        host_mirrors: with CPU offload (``optimizer_cpu_offload=True``), move gradients and
            parameters through one pinned host mirror per flat buffer
            (:mod:`megatron_ext.offload.hybrid`); False keeps megatron-core's per-parameter copies.
    """

    host_mirrors: bool = True
