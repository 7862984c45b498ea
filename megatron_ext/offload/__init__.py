"""CPU-offloaded optimizer steps through one pinned host mirror per flat gradient buffer.

The flow, one module each:

- :mod:`.plan`: which elements of a buffer move, in which blocks, laid out where, and
  when each block's copies run (pure data, testable on the CPU);
- :mod:`.host_mirror`: the tensors: one pinned staging tensor per buffer, the host
  parameters and gradients, the per-block copies, built once;
- :mod:`.step`: the CPU update over a mirror's blocks, in chunks, pipelined with the copies;
- :mod:`.hybrid`: megatron-core's ``HybridDeviceOptimizer`` driving the above
  (:func:`attach_host_mirrors`).
"""

from .hybrid import (
    HostMirrorHybridOptimizer,
    OffloadSource,
    attach_host_mirrors,
    offload_sources,
    source_mirror,
)

__all__ = [
    "HostMirrorHybridOptimizer",
    "OffloadSource",
    "attach_host_mirrors",
    "offload_sources",
    "source_mirror",
]
