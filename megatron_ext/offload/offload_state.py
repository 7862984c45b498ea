"""What the offload step keeps on megatron-core's ``HybridDeviceOptimizer``, in one named
object: its mode, its copy streams and the state it carries from step to step.

[Note: the offload copy streams]
The offload step's copies run on two streams of its own, made in one place
(:meth:`CopyStreams.create`), whatever megatron-core's ``overlap_cpu_optimizer_d2h_h2d``
says (without it megatron-core's ``_d2h_stream`` and ``_h2d_stream`` are the compute stream
itself, so a copy back would queue behind the next forward pass's kernels):

- ``to_host``: the gradients' device-to-host copies. Each step's first waits for the
  compute stream's work queued before the step (the backward pass, the norm, the clip:
  ``wait_stream``), or, for the delayed update, for the event the step recorded once the
  gradients were final; where the parameters' copies back read the same staging bytes
  (no split staging) it waits for ``to_device`` too. The host waits for each chunk's copy
  through its event; the compute stream waits for ``to_host`` before the next zeroing of the
  gradient buffer when the step returns without the host having waited for every copy (the
  delayed and overlapped steps).
- ``to_device``: the parameters' host-to-device copies. Before the first of a step it waits
  for the compute stream (work queued before the step may still read the parameters it
  overwrites). The compute stream's later work waits for it through ``copies_back_done``
  (the exact step, a landing) or per chunk (the overlapped step's forward waits).

So one copy each way can run over the bus at once, beside the compute stream's kernels.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .mirror_plan import CopySchedule, copy_schedule

if TYPE_CHECKING:
    from .chunked import ChunkedPlan, InFlightUpdate
    from .forward_waits import ForwardWaits
    from .host_mirror import BufferMirror, HostBlock
    from .sources import OffloadSource


class OffloadMode(enum.Enum):
    """How the chunked offload step runs its host update."""

    EXACT = "exact"  # in series with the device: the next forward waits for all of it
    DELAYED = "delayed"  # one step late, beside the next forward and backward
    OVERLAPPED = "overlapped"  # exact, beside the next forward, which waits per module


@dataclass(eq=False)
class CopyStreams:
    """The offload step's copy streams ([Note: the offload copy streams])."""

    to_host: Any  # torch.cuda.Stream: the gradients' device-to-host copies
    to_device: Any  # torch.cuda.Stream: the parameters' host-to-device copies
    # recorded on ``to_device`` after the copies back issued so far; a stream that waits
    # for it is ordered after all of them
    copies_back_done: Any  # torch.cuda.Event

    @classmethod
    def create(cls) -> CopyStreams:
        return cls(torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Event())

    def order_after_copies_back(self, stream) -> None:
        """``stream``'s later work waits for every host-to-device copy issued so far."""
        self.copies_back_done.record(self.to_device)
        stream.wait_event(self.copies_back_done)


@dataclass(eq=False)
class OffloadState:
    """The host-mirror offload step's state on one ``HybridDeviceOptimizer`` (the
    ``offload`` attribute of :class:`~.hybrid.HostMirrorHybridOptimizer`), rebuilt with its
    sub-optimizers.

    Attributes:
        sources: per flat buffer of the distributed optimizer, what its mirror is built from.
        mirrors: one host mirror per buffer with offloaded parameters.
        mirror_params: per mirror, its CPU parameters and their local spans.
        blocks: every mirror's blocks, in order (the per-parameter step's copies).
        schedule: when the per-parameter step copies each block.
        block_copied: per block, its device-to-host copy is complete (per-parameter step).
        streams: the copy streams.
        group_pairs: (sub-optimizer, its group index, this optimizer's group index) of
            every sub-optimizer group.
        gpu_masters: (parameter, its fp32 master) of the GPU-updated lower-precision
            parameters; gpu_natives: the GPU-updated parameters updated in place.
        plan: the chunked step's plan, built for the sizes ``plan_for``; None before the
            first chunked step or where it cannot run.
        in_flight: the host update running on a worker (delayed or overlapped), or None.
        warmed: the delayed update's warm-up steps have been taken.
        torn: why the chunked step refuses to run (a step failed part way), or None.
        fallback_warned: the per-parameter fallback's moment-dtype warning was given.
        forward_waits: the overlapped step's pre-hooks and all-gather waits, or None.
    """

    sources: tuple[OffloadSource, ...]
    streams: CopyStreams
    forward_waits: ForwardWaits | None = None
    mirrors: list[BufferMirror] = field(default_factory=list)
    mirror_params: list[list[tuple[torch.Tensor, Any]]] = field(default_factory=list)
    blocks: list[HostBlock] = field(default_factory=list)
    schedule: CopySchedule = field(default_factory=lambda: copy_schedule([], 0))
    block_copied: list = field(default_factory=list)
    group_pairs: list[tuple[Any, int, int]] = field(default_factory=list)
    gpu_masters: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    gpu_natives: list[torch.Tensor] = field(default_factory=list)
    plan: ChunkedPlan | None = None
    plan_for: tuple | None = None
    in_flight: InFlightUpdate | None = None
    warmed: bool = False
    torn: str | None = None
    fallback_warned: bool = False

    def reset_step(self) -> None:
        """What a rebuild of the sub-optimizers invalidates: the plan, the update in
        flight (already landed or dropped by the caller), the warm-up and a torn step."""
        self.plan = None
        self.plan_for = None
        self.in_flight = None
        self.warmed = False
        self.torn = None
