"""The one place the offload tests read or set what ``HostMirrorHybridOptimizer``,
``ChunkedAdamW`` and the flat state of a distributed optimizer keep to themselves (test
support).

Every test goes through the optimizer's step, ``state``, ``state_dict`` and its documented
attributes where it can; what it cannot see there (the chunked step's parts and plans, why
the step refuses to run, the sources and flat state a simulation hands over, the point
between building the sub-optimizers and the host mirrors) is reached here, so that a change
of those internals is one change of this file.
"""

from __future__ import annotations

from typing import NamedTuple

from megatron_ext.offload import HostMirrorHybridOptimizer, OffloadSource
from megatron_ext.offload.host_mirror import HostBlock
from megatron_ext.offload.step import ChunkedAdamW


class ChunkedParts(NamedTuple):
    """The chunked step as built: per mirror its stepper; per chunk its copies, its
    device-to-host event, its (mirror, chunk) position and its host-to-device event;
    whether gradients and parameters share the staging."""

    steppers: list[ChunkedAdamW]
    copies: list[HostBlock]
    events: list
    order: list[tuple[int, int]]
    landed: list
    shared_staging: bool


def chunked(hdo: HostMirrorHybridOptimizer) -> ChunkedParts | None:
    """The chunked step's parts; None before its first step, or where it fell back to the
    per-parameter step (``hdo.chunked_step_off`` says why)."""
    built = hdo.offload.plan
    return None if built is None else ChunkedParts(*built)


def chunked_built(opt) -> bool:
    """Whether ``opt`` is a host-mirror offload optimizer whose chunked step was built."""
    return isinstance(opt, HostMirrorHybridOptimizer) and opt.offload.plan is not None


def torn(hdo: HostMirrorHybridOptimizer) -> str | None:
    """Why the chunked step refuses to run (a step failed part way), None when it runs."""
    return hdo.offload.torn


def in_flight(hdo: HostMirrorHybridOptimizer):
    """The host update running on a worker (a delayed or an overlapped step's), or None."""
    return hdo.offload.in_flight


def sources(hdo: HostMirrorHybridOptimizer) -> tuple[OffloadSource, ...]:
    """The buffers the host mirrors were built from (what ``attach_host_mirrors`` took from
    the distributed optimizer)."""
    return hdo.offload.sources


def set_sources(hdo: HostMirrorHybridOptimizer, given: tuple[OffloadSource, ...]) -> None:
    """Hand ``given`` to an optimizer made with ``__new__``, before megatron-core's
    ``__init__`` builds its sub-optimizers (and with them the host mirrors)."""
    hdo._offload_state().sources = given


def set_forward_waits(hdo: HostMirrorHybridOptimizer, waits) -> None:
    """Give an optimizer built by hand the overlapped step's waits (``attach_host_mirrors``
    installs them from the model chunks)."""
    hdo.offload.forward_waits = waits


def cpu_adamw_not_fused(cls: type[HostMirrorHybridOptimizer]) -> type[HostMirrorHybridOptimizer]:
    """A subclass of ``cls`` whose per-parameter CPU AdamWs are not fused (set once the
    sub-optimizers exist, before the host mirrors are built from them)."""

    class NotFused(cls):
        def _build_host_mirrors(self):
            for opt in self.cpu_optimizers:
                for g in opt.param_groups:
                    g["fused"] = None
            super()._build_host_mirrors()

    return NotFused


def chunk_plans(stepper: ChunkedAdamW, kernel: str) -> dict[int, tuple]:
    """What ``stepper`` built for each chunk it has updated, by chunk: (copies, the views of
    its sub-ranges) with ``kernel`` "torch", (copies, the compiled kernel's tasks) with
    "native"."""
    return stepper._plans if kernel == "torch" else stepper._native_plans


def flat_targets(child) -> list:
    """The flat-buffer targets (``megatron_ext.targets``) of a distributed optimizer, which
    ``attach_host_mirrors`` builds its sources from."""
    return child._flat.targets


def set_flat_state(child, state) -> None:
    """Give a distributed-optimizer stand-in the flat state ``enable_flat_norm`` would."""
    child._flat = state
