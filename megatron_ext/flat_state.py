"""What megatron_ext adds to one megatron-core optimizer, in one named object.

[Note: the class swap]
megatron-core builds its optimizers inside ``get_megatron_optimizer`` and gives no hook to
build them with other methods or extra state. :func:`megatron_ext.optimizer.enable_flat_norm`
reaches in afterwards: for each optimizer (every child of the chain, and the chain) it builds
a :class:`FlatNormState`, attaches it as ``_flat``, and assigns ``__class__`` to a direct
subclass of the optimizer's own class holding the flat methods
(:mod:`~megatron_ext.flat_optimizer`, :mod:`~megatron_ext.flat_chain`), with ``_flat_base``
naming the megatron-core class whose methods the flat ones fall back on. The CPU offload does
the same to a distributed optimizer's ``HybridDeviceOptimizer``
(:func:`megatron_ext.offload.attach_host_mirrors`: the class swapped for
``HostMirrorHybridOptimizer``, its state one ``OffloadState`` set as ``offload``), and its
overlapped step wraps each DDP bucket group's ``start_param_sync`` on the instance
(:mod:`megatron_ext.offload.forward_waits`). These are not the only attributes set on
megatron-core's objects: every one we read or set is listed in :mod:`megatron_ext.seam`, by
the entry of the class it is on, and ``tests/test_seam_coverage.py`` holds the code to that
list. The mixins that hold the methods are typed against protocols of what they use from
megatron-core's optimizers, so a type checker follows every attribute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from buffers.graphs import GroupReducer, NormClip
from buffers.param_norms import ParamNorms

from .global_param_norms import MegatronParamNorms
from .targets import BufferTarget, FlatOptimizerState

# Profiler ranges of the flat optimizer's norm and clip (as FSDP2's "FSDP::..."), around
# buffers' own ("buffers::grad_norm", "buffers::clip"): host-side records, no sync.
NORM_RANGE = "megatron_ext::grad_norm"
CLIP_RANGE = "megatron_ext::clip"


@dataclass(eq=False)
class FlatNormState:
    """The flat norm/clip state of one optimizer (a child of a chain, or the chain).

    Attributes:
        spans: the flat buffers the optimizer reads and its views of them; a chain's are
            empty (its children hold theirs).
        names: ``id(parameter) -> global name`` over every model chunk (per-parameter norms).
        norm_clip: the norm and scale launches over ``spans`` (a chain's: over every child's,
            in one sequence); None for a chain of one, which hands everything to its child.
        reducer: the all-reduce of the norm's stat over the optimizer's group; built at the
            first norm and kept while the group stays the same object (megatron-core fixes
            it at construction), so its backend is looked up once.
        param_norms: the per-parameter norm pass, built at its first use.
        per_param_requested: the next ``step`` computes per-parameter norms in its norm
            pass (a chain's ``request_per_param_grad_norms``).
        last_param_norms: the per-parameter norms the last requested step kept.
    """

    spans: FlatOptimizerState
    names: dict[int, str]
    norm_clip: NormClip | None
    reducer: GroupReducer | None = None
    param_norms: MegatronParamNorms | None = None
    per_param_requested: bool = False
    last_param_norms: ParamNorms | None = None

    @property
    def targets(self) -> list[BufferTarget]:
        return self.spans.targets

    @property
    def bindings(self) -> list[tuple[torch.Tensor, str, torch.Tensor]] | None:
        return self.spans.bindings

    @property
    def launches(self) -> NormClip:
        """:attr:`norm_clip`, which every optimizer that computes a norm itself has."""
        if self.norm_clip is None:
            raise RuntimeError(
                "a chain of one optimizer has no norm launches of its own; its child computes "
                "the norm (megatron_ext.optimizer.enable_flat_norm)"
            )
        return self.norm_clip

    def reducer_for(self, group) -> GroupReducer:
        """The all-reduce over ``group``, kept while ``group`` stays the same object."""
        if self.reducer is None or self.reducer.group is not group:
            launches = self.launches
            self.reducer = GroupReducer(2.0, group, launches.device, launches.options)
        return self.reducer
