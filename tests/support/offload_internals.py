"""The one place the offload tests read or set what ``HostMirrorHybridOptimizer`` keeps to
itself (test support).

Every test goes through the optimizer's step, ``state``, ``state_dict`` and its documented
attributes where it can; what it cannot see there (the chunked step's parts, why the step
refuses to run, the sources a simulation hands over) is read here, so that a change of the
optimizer's internals is one change of this file.
"""

from __future__ import annotations

from typing import NamedTuple

from megatron_ext.offload import HostMirrorHybridOptimizer, OffloadSource
from megatron_ext.offload.host_mirror import HostBlock
from megatron_ext.offload.step import ChunkedAdamW


class ChunkedParts(NamedTuple):
    """The chunked step as built: per mirror its stepper; per chunk its copies, its
    device-to-host event and its (mirror, chunk) position."""

    steppers: list[ChunkedAdamW]
    copies: list[HostBlock]
    events: list
    order: list[tuple[int, int]]


def chunked(hdo: HostMirrorHybridOptimizer) -> ChunkedParts | None:
    """The chunked step's parts; None before its first step, or where it fell back to the
    per-parameter step (``hdo.chunked_step_off`` says why)."""
    built = hdo._chunked
    return None if built is None else ChunkedParts(*built)


def torn(hdo: HostMirrorHybridOptimizer) -> str | None:
    """Why the chunked step refuses to run (a step failed part way), None when it runs."""
    return hdo._torn


def sources(hdo: HostMirrorHybridOptimizer) -> tuple[OffloadSource, ...]:
    """The buffers the host mirrors were built from (what ``attach_host_mirrors`` took from
    the distributed optimizer)."""
    return hdo._offload_sources


def set_sources(hdo: HostMirrorHybridOptimizer, given: tuple[OffloadSource, ...]) -> None:
    """Hand ``given`` to an optimizer made with ``__new__``, before megatron-core's
    ``__init__`` builds its sub-optimizers (and with them the host mirrors)."""
    hdo._offload_sources = given
