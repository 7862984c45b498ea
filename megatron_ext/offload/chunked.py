"""CPU offload through host mirrors, the chunked step's driver: the plan built once (per
mirror one :class:`~.step.ChunkedAdamW`, per chunk its copies and its device-to-host
event) and the three ways of running it (:class:`~.offload_state.OffloadMode`): exact,
delayed, and overlapped ([Note: the overlapped exact step] in :mod:`.forward_waits`). Every
copy runs on the offload's own streams ([Note: the offload copy streams] in
:mod:`.offload_state`).

[Note: the delayed offloaded update]
The exact chunked step runs in series with the GPU: the device waits for the host update
before the next forward pass, and the host idles while the device computes. With the
delayed update (ZeRO-Offload's one-step delayed parameter update, opt-in), the step of
iteration t:

1. lands step t-1's update: waits for its host worker, then issues its parameters'
   host-to-device copies, after the compute stream's work so far (the forward and backward
   of iteration t, which read the parameters step t-1 had not yet changed);
2. issues step t's gradient copies to the host (the compute stream's later work, the next
   zeroing of the gradient buffer, after them), and steps the GPU-resident part (offload
   fraction < 1) at once;
3. starts step t's host update on a worker thread and returns.

The parameters go back from pinned bytes of their own (``split_staging`` of
:func:`~.host_mirror.build_buffer_mirror`), so the copies of steps 1 and 2 run at once, one
each way over the bus; the worker packs a chunk's new parameters only once that chunk's
copy back (step 1) is complete.

So iteration t+1's forward and backward run beside step t's host update and read the
host-updated parameters as step t-1 left them: one step late. Everything that decides
step t (the norm, the clip coefficient, a skip) is computed from step t's own gradients
before the step is called. What is not delayed: the GPU-resident parameters at offload
fractions below 1 (their optimizer reads gradients that the next backward overwrites;
delaying it would need a second copy of them on the device, the memory offload saves).
A skipped step (megatron-core returns before calling this optimizer) lands nothing: the
update in flight lands at the next step that runs, or at a drain.

A drain (:meth:`~.hybrid.HostMirrorHybridOptimizer.drain`: before ``state_dict``, at the
end of training, after an error) lands the update in flight, so a checkpoint holds every
update its step count says; ``load_state_dict`` first waits for the worker and drops its
result, which the loaded state replaces. The first ``warmup`` steps of an optimizer (by
its step count, so a resumed run does not warm up again) run exact.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from buffers.graphs import profiler_range

from .host_mirror import HostBlock, chunk_copies
from .step import ChunkedAdamW, HostParam, chunk_spans
from .threads import cpu_threads, pin_current_thread

if TYPE_CHECKING:
    from .hybrid import HostMirrorHybridOptimizer


class ChunkedPlan(NamedTuple):
    """The chunked step's work, built once per set of sizes."""

    steppers: list[ChunkedAdamW]  # one per host mirror
    copies: list[HostBlock]  # one per chunk, in the order they are updated
    events: list  # per chunk: its device-to-host copy is complete (torch.cuda.Event)
    order: list[tuple[int, int]]  # per chunk: (its mirror, its index among that mirror's)
    # per chunk: the host-to-device copy last issued for it is complete (its parameters'
    # staging may be packed again); never recorded before the first
    landed: list
    # the gradients' copies to the host write bytes the parameters' copies back read (a
    # mirror without split staging): the former then wait for the latter
    shared_staging: bool


def build_chunked_plan(hdo: HostMirrorHybridOptimizer) -> ChunkedPlan:
    """One :class:`ChunkedAdamW` per host mirror of ``hdo`` and the copies of its chunks
    (the caller has checked that the per-parameter optimizers are ones it reproduces)."""
    # every CPU parameter is one mirror's (_build_host_mirrors checked that)
    where = {
        p: (opt, gi)
        for opt in hdo.cpu_optimizers
        for gi, g in enumerate(opt.param_groups)
        for p in g["params"]
    }
    # the offload optimizer's group each per-parameter optimizer's group was made from
    family = {(id(opt), j): i for opt, j, i in hdo.offload.group_pairs}
    steppers: list[ChunkedAdamW] = []
    copies: list[HostBlock] = []
    order: list[tuple[int, int]] = []
    state = hdo.offload
    for k, (m, params) in enumerate(zip(state.mirrors, state.mirror_params, strict=True)):
        entries = [
            HostParam(cpu, local, *where[cpu], family=family[id(where[cpu][0]), where[cpu][1]])
            for cpu, local in params
        ]
        runs = chunk_spans(
            [m.layout.local(b) for b in m.layout.blocks],
            max(1, int(hdo.chunk_numel)),
            [e.local for e in entries],
        )
        steppers.append(
            ChunkedAdamW(
                m.host_params,
                m.cpu_grads,
                entries,
                [r for _, r in runs],
                hdo.compute_numel,
                hdo.moment_dtypes,
                hdo.offload_kernel,
            )
        )
        copies += chunk_copies(m, runs)
        order += [(k, i) for i in range(len(runs))]
    events = [torch.cuda.Event() for _ in copies]
    landed = [torch.cuda.Event() for _ in copies]
    shared = any(m.param_staging is None and not m.device_convert for m in hdo.host_mirrors)
    return ChunkedPlan(steppers, copies, events, order, landed, shared)


def _begin(hdo: HostMirrorHybridOptimizer, plan: ChunkedPlan, ready=None) -> torch.cuda.Stream:
    """Hyperparameters read, counters prepared, every chunk's device-to-host copy issued on
    the ``to_host`` stream after the compute stream's work so far (or, given ``ready``,
    after the compute stream's work up to that event); returns the compute stream."""
    hdo._sync_hdo_param_groups_to_sub_optimizers()
    for stepper in plan.steppers:
        stepper.begin()
    compute = torch.cuda.current_stream()
    streams = hdo.offload.streams
    if ready is None:
        streams.to_host.wait_stream(compute)
    else:
        streams.to_host.wait_event(ready)
    if plan.shared_staging:  # the staging may still be read by copies back issued before
        streams.to_host.wait_stream(streams.to_device)
    with torch.cuda.stream(streams.to_host):
        for chunk, event in zip(plan.copies, plan.events, strict=True):
            chunk.start_d2h()
            event.record(streams.to_host)
    return compute


def _finish(hdo: HostMirrorHybridOptimizer, plan: ChunkedPlan) -> None:
    for stepper in plan.steppers:
        stepper.finish()
    hdo._sync_sub_optimizers_state_to_hdo()


def _torn_message(plan: ChunkedPlan, gpu_stepped: bool) -> str | None:
    updated = sum(s.updated for s in plan.steppers)
    if not updated and not gpu_stepped:
        return None
    done = f"{updated} fused AdamW calls on the host had updated parameters and moments"
    if gpu_stepped:
        done += ", the GPU-resident part had stepped"
    return (
        f"the previous offloaded optimizer step failed part way ({done}, the rest of the "
        "step had not), so this optimizer's state is inconsistent; load the last checkpoint "
        "(load_state_dict) before stepping again"
    )


def run_exact(hdo: HostMirrorHybridOptimizer, plan: ChunkedPlan) -> None:
    """The chunked step in series with the device: per chunk, in order, wait for its copy,
    update it in cache-sized sub-ranges (convert, fused AdamW per family, pack), send its
    parameters back on the other copy stream; then the GPU optimizer steps.

    If the CPU part raises, every copy already issued completes before the exception
    leaves, and the compute stream waits for the copies back. Raised before any fused call
    had updated anything, the optimizer is as it was before the step; raised later, the
    step refuses to run again until a checkpoint is loaded.
    """
    compute = _begin(hdo, plan)
    to_device = hdo.offload.streams.to_device
    # the device parameters may still be read by work queued before this step
    to_device.wait_stream(compute)
    waited = 0
    try:
        for j, ((k, i), chunk, event) in enumerate(
            zip(plan.order, plan.copies, plan.events, strict=True)
        ):
            # (this copy waited for the compute stream, which waited for the previous
            # step's copies back: the chunk's staging is free to pack into once it is done)
            event.synchronize()
            waited += 1
            plan.steppers[k].update(i, chunk)
            with torch.cuda.stream(to_device):
                chunk.start_h2d()
                plan.landed[j].record(to_device)
        # after the CPU part: a CPU failure leaves the GPU part untouched too
        if hdo.gpu_optimizer is not None:
            hdo.gpu_optimizer.step()
    except BaseException:
        # no copy left in flight: the host may free or reuse the staging
        for event in plan.events[waited:]:
            event.synchronize()
        to_device.synchronize()
        hdo.offload.torn = _torn_message(plan, gpu_stepped=False)
        raise
    finally:  # later device work is ordered after the copies back already issued
        hdo.offload.streams.order_after_copies_back(compute)
    _finish(hdo, plan)


@dataclass
class InFlightUpdate:
    """A host update running on its worker thread (the base of :class:`DelayedUpdate` and
    :class:`OverlappedUpdate`, one per mode that runs one)."""

    plan: ChunkedPlan
    threads: int | None
    cpus: frozenset[int] | None = None  # where the worker runs (None: not pinned)
    gpu_stepped: bool = False
    waited: int = 0  # chunks whose device-to-host copy the worker has waited for
    error: BaseException | None = None
    seconds: float = 0.0  # the worker's wall time, once it has ended
    started: float = 0.0  # time.perf_counter() when it started
    d2h_wait_s: float = 0.0  # of which waiting for the gradients' copies to the host
    done: int = 0  # chunks updated (and, for an overlapped step, their copy back issued)
    ended: bool = False

    thread: threading.Thread = field(init=False)
    progress: threading.Condition = field(init=False, default_factory=threading.Condition)

    def start(self) -> None:
        self.started = time.perf_counter()
        self.thread = threading.Thread(
            target=self._run, name="megatron_ext-offload-update", daemon=False
        )
        self.thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            if self.cpus is not None:  # the kernel's helpers follow this thread's CPUs
                pin_current_thread(self.cpus)
            # torch's intra-op thread count is per calling thread under OpenMP
            with (
                cpu_threads(self.threads),
                profiler_range("megatron_ext::offload_host_update"),
            ):
                for (k, i), chunk, event, landed in zip(
                    self.plan.order,
                    self.plan.copies,
                    self.plan.events,
                    self.plan.landed,
                    strict=True,
                ):
                    waiting = time.perf_counter()
                    event.synchronize()
                    self.d2h_wait_s += time.perf_counter() - waiting
                    self.waited += 1
                    landed.synchronize()  # the last copy back out of these bytes
                    self.plan.steppers[k].update(i, chunk)
                    self.updated(chunk, landed)
                    with self.progress:
                        self.done += 1
                        self.progress.notify_all()
        except BaseException as error:  # handed to the thread that lands the update
            self.error = error
        finally:
            self.seconds = time.perf_counter() - start
            with self.progress:
                self.ended = True
                self.progress.notify_all()

    def updated(self, chunk: HostBlock, landed) -> None:
        """What the worker does once it has updated ``chunk``, before counting it."""

    def wait(self) -> None:
        """Until the worker has ended, and every copy it had not waited for has too."""
        self.thread.join()
        for event in self.plan.events[self.waited :]:
            event.synchronize()


@dataclass
class DelayedUpdate(InFlightUpdate):
    """A delayed step's host update ([Note: the delayed offloaded update]): the landing
    sends its parameters back."""


@dataclass
class OverlappedUpdate(InFlightUpdate):
    """An overlapped exact step's host update ([Note: the overlapped exact step]): the
    worker sends each chunk's parameters back on ``copies_back`` as soon as it has updated
    the chunk; the forward pass waits for them per module."""

    copies_back: torch.cuda.Stream | None = None  # the offload's to_device stream
    awaited: int = -1  # the compute stream waits for the chunks up to this one

    def updated(self, chunk: HostBlock, landed) -> None:
        with torch.cuda.stream(self.copies_back):
            chunk.start_h2d()
            landed.record(self.copies_back)

    def await_chunk(self, position: int) -> None:
        """Until the worker has updated the chunk at ``position`` (in update order) and
        every one before it, and issued their copies back; raises if it failed first."""
        with self.progress:
            while self.done <= position and not self.ended:
                self.progress.wait()
        if self.done <= position:
            raise RuntimeError(
                "the offloaded optimizer step's host update failed before the parameters "
                "this forward pass reads were updated; the error is raised again at the "
                "next optimizer step or drain_offload"
            ) from self.error


def launch_delayed(hdo: HostMirrorHybridOptimizer, plan: ChunkedPlan, ready=None) -> DelayedUpdate:
    """Step t of the delayed update: gradients to the host, the GPU-resident part stepped,
    the host update started on a worker (the caller has landed step t-1's).

    ``ready``: an event the caller recorded on the compute stream once the gradients were
    final, before landing step t-1's update: the gradients' copies wait for it alone, not
    for the compute stream's later wait for the parameters' copies back, and the two run
    at once (split staging)."""
    compute = _begin(hdo, plan, ready)
    # the next iteration zeroes the gradient buffer on the compute stream: not before the
    # copies have read it (the host does not wait for them before it returns)
    compute.wait_stream(hdo.offload.streams.to_host)
    return _start(hdo, DelayedUpdate(plan, hdo.cpu_threads, hdo.worker_cpus))


def _start[F: InFlightUpdate](hdo: HostMirrorHybridOptimizer, flight: F) -> F:
    """The GPU-resident part stepped, then ``flight``'s worker started."""
    try:
        if hdo.gpu_optimizer is not None:
            hdo.gpu_optimizer.step()
            flight.gpu_stepped = True
    except BaseException:  # no copy left in flight: the host may reuse the staging
        for event in flight.plan.events:
            event.synchronize()
        raise
    flight.start()
    return flight


def launch_overlapped(hdo: HostMirrorHybridOptimizer, plan: ChunkedPlan) -> OverlappedUpdate:
    """The overlapped exact step ([Note: the overlapped exact step]): gradients to the host,
    the GPU-resident part stepped, the host update started on a worker that sends each
    chunk's parameters back as soon as it has updated them; returns at once."""
    compute = _begin(hdo, plan)
    streams = hdo.offload.streams
    # the device parameters may still be read by work queued before this step
    streams.to_device.wait_stream(compute)
    # the next iteration zeroes the gradient buffer on the compute stream: not before the
    # copies have read it
    compute.wait_stream(streams.to_host)
    return _start(hdo, OverlappedUpdate(plan, hdo.cpu_threads, copies_back=streams.to_device))


class LandedUpdate(NamedTuple):
    """A host update run on a worker, landed: what a benchmark reads to see where the time
    went."""

    worker_s: float  # the host worker's wall time (waits for copies included)
    wait_s: float  # how long landing it waited for the worker: on the critical path
    window_s: float  # from the worker's start to the landing's: the time it had
    threads: int | None  # the worker's threads (None: torch's setting)
    d2h_wait_s: float = 0.0  # of worker_s, waiting for the gradients' copies to the host


def land(hdo: HostMirrorHybridOptimizer, flight: InFlightUpdate) -> None:
    """Wait for the update in flight; send a delayed update's parameters back to the device
    after the compute stream's work so far (an overlapped update's worker sent its own);
    order the compute stream's later work after them. Its error, if it raised, is raised
    here."""
    start = time.perf_counter()
    flight.wait()
    hdo.last_landed = LandedUpdate(
        flight.seconds,
        time.perf_counter() - start,
        start - flight.started,
        flight.threads,
        flight.d2h_wait_s,
    )
    plan = flight.plan
    streams = hdo.offload.streams
    if flight.error is not None:
        if isinstance(flight, OverlappedUpdate):  # no copy back left reading the staging
            streams.to_device.synchronize()
        hdo.offload.torn = _torn_message(plan, flight.gpu_stepped)
        raise flight.error
    compute = torch.cuda.current_stream()
    if not isinstance(flight, OverlappedUpdate):
        streams.to_device.wait_stream(compute)
        with torch.cuda.stream(streams.to_device):
            for chunk, landed in zip(plan.copies, plan.landed, strict=True):
                chunk.start_h2d()
                landed.record(streams.to_device)
    streams.order_after_copies_back(compute)
    _finish(hdo, plan)


def reorder(plan: ChunkedPlan, order) -> ChunkedPlan:
    """``plan`` with its chunks updated (and their copies issued) in ``order`` (the
    positions of its chunks, each once). Each element's update reads and writes only that
    element, so any order gives the same bits."""
    return plan._replace(
        copies=[plan.copies[j] for j in order],
        events=[plan.events[j] for j in order],
        order=[plan.order[j] for j in order],
        landed=[plan.landed[j] for j in order],
    )
