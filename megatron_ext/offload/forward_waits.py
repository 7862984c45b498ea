"""CPU offload through host mirrors, the overlapped exact step's waits: which chunks of the
host update each module's forward pass, and each parameter all-gather, must wait for.

[Note: the overlapped exact step]
The exact chunked step returns only once the last chunk's parameters are on their way back,
so the next forward pass starts after the whole host update. With
``MegatronOptions(offload_overlap_forward=True)`` the step issues the gradients' copies to the
host, steps the GPU-resident part and starts the host update on a worker thread, then
returns. The worker updates the chunks in the order the forward pass first reads them (the
order of the modules' parameters in the model, which for Megatron's models is the order of
the forward pass) and sends each chunk's parameters back as soon as it has updated them. The
next forward pass waits per module: a forward pre-hook on every module of the model waits
until the worker has sent back every chunk up to the last one holding that module's own
parameters (the host waits for the worker, then the compute stream for the copy), so the
forward of the first layers runs beside the update of the last ones. Every chunk is
updated with the same inputs as in the exact step: the same bits, at the same step.

What may read the offloaded parameters while the update runs, and how it waits:

- a module's forward, its own parameters, or those of a module whose forward began before
  it in the same pass (the tied output layer reads the embedding's weight): the pre-hooks;
  the backward pass reads what the forward read;
- megatron-core's parameter all-gathers (distributed optimizer, data-parallel size above
  1): each bucket group's ``start_param_sync`` first waits for the chunks of its own shard.
  With ``overlap_param_gather`` they run during the forward pass; without it, megatron-core
  issues them all at the end of the step, which then waits for the whole update (the
  gathers still overlap the update of later chunks). With one rank the gather moves
  nothing (the shard is the whole bucket): while an update is in flight it is skipped,
  which is what lets the forward pass overlap at one rank without ``overlap_param_gather``;
- anything else (a parameter norm, a weight hash, code outside the training loop): only
  after :func:`megatron_ext.drain_offload` or the next step. ``megatron_ext.train`` refuses
  ``--log-params-norm`` with the option, which reads every parameter right after the step.

The next step, ``state_dict``, ``load_state_dict`` and a drain land the update first (wait
for the worker, order the compute stream after its copies, advance the step counters). A
failure of the worker is raised at the first pre-hook that waits for a chunk it did not
reach, and again at the landing, which marks the optimizer torn as the exact step does.
Needs the precision-aware optimizer (without it megatron-core copies every main parameter to
the model's right after the step); refuses CUDA graphs (a replayed graph skips the
pre-hooks) and the delayed update (which overlaps more, one step late).

Why the gradients still cross to the host at the step, not per bucket during the backward
pass: the host cannot update a chunk before the clip coefficient is known, after the
backward pass, and the copies already run ahead of the host update chunk by chunk. The
worker's wait for them (:attr:`.chunked.LandedUpdate.d2h_wait_s`) is mostly the device
finishing the backward pass, the norm and the clip, which every chunk's update needs first:
copying during the backward pass could save only the first chunk's copy out of it.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from .chunked import ChunkedPlan, OverlappedUpdate, reorder

if TYPE_CHECKING:
    from .hybrid import HostMirrorHybridOptimizer


def device_bytes(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage, first byte, end byte) of the bytes a view may read: its extent in its
    storage (all of it for a contiguous view; for another, from its first element to its
    last, the gaps included)."""
    start = int(t.storage_offset()) * t.element_size()
    extent = 1 + sum((int(n) - 1) * abs(int(s)) for n, s in zip(t.shape, t.stride(), strict=True))
    numel = 0 if t.numel() == 0 else extent
    return (t.untyped_storage().data_ptr(), start, start + numel * t.element_size())


class ChunkMap:
    """Where each chunk's copy back lands on the device, looked up by byte range."""

    def __init__(self, plan: ChunkedPlan):
        found: dict[int, list[tuple[int, int, int]]] = {}
        for position, chunk in enumerate(plan.copies):
            storage, a, z = device_bytes(chunk.h2d[0])
            found.setdefault(storage, []).append((a, z, position))
        self._runs = {k: sorted(v) for k, v in found.items()}
        self._starts = {k: [a for a, _, _ in v] for k, v in self._runs.items()}
        self.count = len(plan.copies)

    def positions(self, ranges) -> list[int]:
        """The positions of the chunks whose destination overlaps any of ``ranges``
        ((storage, first byte, end byte) each)."""
        out = []
        for storage, a, z in ranges:
            runs = self._runs.get(storage)
            if not runs:
                continue
            # the chunks' destinations are disjoint: start from the last one beginning
            # at or before a
            i = max(0, bisect.bisect_right(self._starts[storage], a) - 1)
            while i < len(runs) and runs[i][0] < z:
                if runs[i][1] > a:
                    out.append(runs[i][2])
                i += 1
        return out


def _modules(model_chunks) -> list[torch.nn.Module]:
    seen: dict[int, torch.nn.Module] = {}
    for chunk in model_chunks:
        for m in chunk.modules():
            seen.setdefault(id(m), m)
    return list(seen.values())


def _own_params(module: torch.nn.Module) -> list[torch.Tensor]:
    return list(module.parameters(recurse=False))


def _shard_bytes(group) -> list[tuple[int, int, int]]:
    """This rank's shard of each bucket of a megatron-core bucket group: what its
    parameter all-gather sends."""
    size = int(group.intra_distributed_optimizer_instance_size)
    rank = int(group.intra_distributed_optimizer_instance_rank)
    out = []
    for bucket in group.buckets:
        data = bucket.param_data
        n = data.numel() // size
        out.append(device_bytes(data.view(-1)[rank * n : (rank + 1) * n]))
    return out


def bucket_groups(model_chunks) -> list[Any]:
    """megatron-core's bucket groups of the model chunks (dense and expert-parallel)."""
    out = []
    for chunk in model_chunks:
        for name in ("bucket_groups", "expert_parallel_bucket_groups"):
            out += list(getattr(chunk, name, None) or ())
    return out


# the ForwardWaits installed on each model chunk: a second optimizer attached to the same
# model replaces the first one's hooks instead of stacking its own on them
_INSTALLED: weakref.WeakKeyDictionary[Any, ForwardWaits] = weakref.WeakKeyDictionary()


class ForwardWaits:
    """The pre-hooks and all-gather waits of one optimizer's overlapped exact step (see the
    note above), installed once on the model chunks; the chunks' order and what each waits
    for are worked out again whenever the step's plan is rebuilt (:meth:`arrange`).

    It holds the optimizer weakly and keeps what it installed (the pre-hooks' handles, the
    bucket groups' own ``start_param_sync``), so that :meth:`remove` takes all of it off
    again: when another optimizer's waits are installed on the same model chunks, and when
    the optimizer is freed (its pinned host mirrors with it).
    """

    def __init__(self, hdo: HostMirrorHybridOptimizer, model_chunks: Sequence[Any]):
        for chunk in model_chunks:
            previous = _INSTALLED.get(chunk)
            if previous is not None:
                previous.remove()
        self._hdo = weakref.ref(hdo)
        # the modules holding parameters, in the model's order
        self.modules = [m for m in _modules(model_chunks) if _own_params(m)]
        self.groups = bucket_groups(model_chunks)
        # per module (by id) and bucket group (by id): the last position it waits for
        self.needs: dict[int, int] = {}
        self.handles = [m.register_forward_pre_hook(self._pre_hook) for m in self.modules]
        # per bucket group: its start_param_sync before ours (None: the class's method)
        self.wrapped: list[tuple[Any, Any]] = []
        for group in self.groups:
            self._wrap(group)
        for chunk in model_chunks:
            _INSTALLED[chunk] = self
        weakref.finalize(hdo, self.remove)

    def remove(self) -> None:
        """Take off every pre-hook and all-gather wait this installed (idempotent)."""
        for handle in self.handles:
            handle.remove()
        for group, before in self.wrapped:
            if before is None:
                group.__dict__.pop("start_param_sync", None)
            else:
                group.start_param_sync = before
        self.handles, self.wrapped, self.needs = [], [], {}
        for chunk, waits in list(_INSTALLED.items()):
            if waits is self:
                del _INSTALLED[chunk]

    def arrange(self, plan: ChunkedPlan) -> ChunkedPlan:
        """``plan`` with its chunks in the order the forward pass first reads them (by the
        index, in the model's parameter order, of the first parameter each holds; chunks no
        module parameter overlaps last), and what each module and bucket group waits for
        in that order."""
        cmap = ChunkMap(plan)
        keys = [float("inf")] * cmap.count
        held: dict[int, list[int]] = {}  # per module and bucket group: its chunks' positions
        index = 0
        for m in self.modules:
            for p in _own_params(m):
                found = cmap.positions([device_bytes(p)])
                for position in found:
                    keys[position] = min(keys[position], index)
                if found:
                    held.setdefault(id(m), []).extend(found)
                index += 1
        for group in self.groups:
            found = cmap.positions(_shard_bytes(group))
            if found:
                held[id(group)] = found
        order = sorted(range(cmap.count), key=keys.__getitem__)
        moved = {old: new for new, old in enumerate(order)}
        self.needs = {k: max(moved[q] for q in found) for k, found in held.items()}
        return reorder(plan, order)

    def _pre_hook(self, module, args) -> None:
        need = self.needs.get(id(module))
        hdo = self._hdo()
        if need is not None and hdo is not None:
            hdo.await_chunk(need)

    def _wrap(self, group) -> None:
        original = group.start_param_sync
        self.wrapped.append((group, group.__dict__.get("start_param_sync")))
        waits = self

        def start_param_sync(*args, **kwargs):
            hdo = waits._hdo()
            if hdo is not None and isinstance(hdo.offload.in_flight, OverlappedUpdate):
                if (
                    int(group.intra_distributed_optimizer_instance_size) == 1
                    and not group.ddp_config.overlap_param_gather
                ):
                    # a gather over one rank moves nothing (its shard is the whole bucket);
                    # megatron-core's synchronous path ends in this state
                    group.param_gather_handle = None
                    group.param_gather_dispatched = True
                    return None
                need = waits.needs.get(id(group))
                if need is not None:
                    hdo.await_chunk(need)
            return original(*args, **kwargs)

        group.start_param_sync = start_param_sync
