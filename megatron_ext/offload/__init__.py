"""CPU-offloaded optimizer steps through one pinned host mirror per flat gradient buffer.

The flow, one module each:

- :mod:`.mirror_plan`: which elements of a buffer move, in which blocks, laid out where, and
  when each block's copies run (pure data, testable on the CPU);
- :mod:`.sources`: per buffer of a distributed optimizer, what its mirror is built from;
- :mod:`.host_mirror`: the tensors: one pinned staging tensor per buffer, the host
  parameters and gradients, the per-block copies, built once;
- :mod:`.step`: the CPU update over a mirror's blocks, in chunks (:mod:`.host_kernel`: its
  compiled kernel);
- :mod:`.chunked`: the chunked step's driver, in its three modes: exact, delayed (one step
  late) and overlapped (exact, beside the next forward pass);
- :mod:`.forward_waits`: the overlapped step's waits in the forward pass (module pre-hooks,
  the parameter all-gathers);
- :mod:`.offload_state`: the mode, the copy streams and what the step carries from one call
  to the next, one named object on the optimizer;
- :mod:`.hybrid`: megatron-core's ``HybridDeviceOptimizer`` driving the above
  (:func:`attach_host_mirrors`; :func:`megatron_ext.drain_offload` lands an update in flight);
- :mod:`.host_memory`: what the offloaded part needs of host and GPU memory, worked out and
  checked before building;
- :mod:`.threads`, :mod:`.moment_dtypes`, :mod:`.checkpoint_classes`: the host threads,
  the Adam moment dtypes read from megatron-core's config, loading its checkpoints.
"""

from .hybrid import HostMirrorHybridOptimizer, attach_host_mirrors, offloads_to_host
from .sources import OffloadSource, offload_sources, source_mirror

__all__ = [
    "HostMirrorHybridOptimizer",
    "OffloadSource",
    "attach_host_mirrors",
    "offloads_to_host",
    "offload_sources",
    "source_mirror",
]
