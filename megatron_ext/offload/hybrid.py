"""CPU-offloaded optimizer steps through one pinned host mirror per flat gradient buffer.

megatron-core's ``HybridDeviceOptimizer`` moves gradients to the host one parameter at a
time (converting bf16 to fp32 on the GPU, into a temporary, on the way) and moves updated
parameters back one at a time. With ``per_dtype_grad_buffers=True`` the distributed
optimizer's shard of each buffer is a few contiguous ranges, so here, per buffer:

- the offloaded part of this rank's shard is cut into blocks (:func:`offload_blocks`):
  maximal runs of the owned ranges that hold no GPU-updated parameter; at offload
  fraction 1 that is one block per owned range;
- one pinned staging tensor holds every block (:class:`BufferMirror`); each step fills it
  with one device-to-host copy per block, in the gradient's own dtype;
- the CPU optimizer's gradients are views of that staging tensor, or, when the CPU
  parameters are fp32 copies of lower-precision ones, views of one host fp32 tensor filled
  from it by one conversion per block; its parameters are views of one host tensor;
- after a block's last CPU update, one conversion per block packs the parameters into the
  same staging bytes and one host-to-device copy per block sends them back.

Everything is built once: the offloaded part of a step allocates nothing, on either side
(GPU-resident parameters keep megatron-core's handling). Layout and schedule are plain data
(:class:`MirrorLayout`, :class:`CopySchedule`), computable and testable on the CPU.

Pinned memory per buffer: the blocks' elements times the wider of the gradient and the
device-parameter dtype, i.e. at most this rank's shard of the buffer (the owned ranges less
any padding at their ends). Host (pageable) memory: the CPU parameters, and an fp32 copy of
the gradients where they arrive in a narrower dtype.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from buffers.graphs import profiler_range

from .. import seam
from ..opt_checkpoint import place_sub_optimizer_state
from .checkpoint_classes import allow_optimizer_classes_in_checkpoints
from .chunked import (
    ChunkedPlan,
    LandedUpdate,
    OverlappedUpdate,
    build_chunked_plan,
    land,
    launch_delayed,
    launch_overlapped,
    run_exact,
)
from .forward_waits import ForwardWaits
from .host_mirror import BufferMirror
from .mirror_plan import copy_schedule, itemsize
from .moment_dtypes import offload_moment_dtypes
from .offload_state import CopyStreams, OffloadMode, OffloadState
from .sources import offload_sources, source_mirror
from .step import DEFAULT_CHUNK_NUMEL, DEFAULT_COMPUTE_NUMEL, chunked_step_refusal
from .threads import ThreadTuner, cpu_threads, rank_cores, threads_warning, worker_cpus

# megatron-core ships no type hints
HybridDeviceOptimizer: Any = seam.target("HybridDeviceOptimizer")
DistributedOptimizer: Any = seam.target("DistributedOptimizer")


class HostMirrorHybridOptimizer(HybridDeviceOptimizer):
    """megatron-core's ``HybridDeviceOptimizer`` moving whole blocks through host mirrors.

    Made by :func:`attach_host_mirrors` (a class swap of an existing instance, [Note: the
    class swap] in :mod:`megatron_ext.flat_state`); the placement (which parameters the CPU
    updates), the sub-optimizers and megatron-core's per-parameter step are megatron-core's.
    What changes: the CPU parameters and their gradients are views of one host mirror per
    buffer (:attr:`host_mirrors`), gradients arrive with one device-to-host copy per block,
    parameters leave with one host-to-device copy per block (:class:`CopySchedule` says
    when), every copy runs on the offload's own streams ([Note: the offload copy streams] in
    :mod:`.offload_state`), and the GPU optimizer's gradients are set on the compute stream
    just before the GPU step (megatron-core makes the fp32 masters' ones on its copy stream,
    which the GPU step does not wait for, and gives natively fp32 parameters with
    precision-aware gradients none: see :meth:`_set_gpu_grads`).

    Everything the step carries from one call to the next is one :class:`OffloadState`,
    :attr:`offload`; the class attributes below are its settings (set on the class or the
    instance before the first step; :func:`attach_host_mirrors` sets them from its
    arguments).
    """

    offload: OffloadState
    # The chunked step (:mod:`.step`): one fused AdamW call per chunk of a host mirror, the
    # chunks' copies pipelined with the updates; set ``chunked_step`` on the class or the
    # instance before the first step (False: megatron-core's per-parameter step).
    chunked_step: bool = False
    chunk_numel: int = DEFAULT_CHUNK_NUMEL
    # torch intra-op threads during the step (the CPU update's); None: leave torch's setting
    cpu_threads: int | None = None
    compute_numel: int = DEFAULT_COMPUTE_NUMEL  # sub-ranges of a chunk (ChunkedAdamW)
    # gradients to the host and parameters back in fp32, converted on the device
    # (build_buffer_mirror's device_convert): the host runs only the optimizer
    convert_on_device: bool = False
    # the dtypes of the chunked step's Adam moments (megatron-core's exp_avg_dtype and
    # exp_avg_sq_dtype with the precision-aware optimizer; its per-parameter step keeps fp32)
    moment_dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32)
    # how the chunked step updates a chunk (ChunkedAdamW's kernel): "auto" the compiled
    # one-pass kernel where it reproduces torch's fused AdamW here, "native", "torch"
    offload_kernel: str = "auto"
    # The chunked step's update one step late, beside the next forward and backward
    # ([Note: the delayed offloaded update] in :mod:`.chunked`), after ``delay_warmup``
    # exact steps (counted by the optimizer's step count).
    delayed_update: bool = False
    delay_warmup: int = 0
    # The exact chunked step's host update beside the next forward pass, which waits per
    # module for the chunks it reads ([Note: the overlapped exact step] in
    # :mod:`.forward_waits`); set by attach_host_mirrors with the model chunks.
    overlap_forward: bool = False
    chunked_step_off: str | None = None  # why the chunked step cannot run, once it was built
    # the last delayed update landed: its host worker's time and how long landing waited
    # for it (benchmarks read it); None before one lands
    last_landed: LandedUpdate | None = None
    # adapts cpu_threads at each landing in a step (the delayed update without a thread
    # count given); None: cpu_threads stays as set
    thread_tuner: ThreadTuner | None = None
    # the CPUs the delayed update's worker and its helpers run on (offload_pin_threads):
    # this rank's but the one left to the launching thread; None: not pinned
    worker_cpus: frozenset[int] | None = None
    _keeping_placement = False

    @property
    def mode(self) -> OffloadMode:
        """How the chunked step runs its host update (from :attr:`delayed_update` and
        :attr:`overlap_forward`; the delayed update's warm-up steps run exact)."""
        if self.delayed_update:
            return OffloadMode.DELAYED
        if self.overlap_forward:
            return OffloadMode.OVERLAPPED
        return OffloadMode.EXACT

    @property
    def host_mirrors(self) -> list[BufferMirror]:
        """One host mirror per flat buffer with offloaded parameters."""
        return self.offload.mirrors

    def _offload_state(self) -> OffloadState:
        """:attr:`offload`, made with the copy streams at the first build."""
        state = self.__dict__.get("offload")
        if state is None:
            state = self.offload = OffloadState((), CopyStreams.create())
        return state

    def rebuild_keeping_placement(self) -> None:
        """megatron-core's ``_init_sub_optimizers`` with the placement it made when it built
        this instance (which parameters the CPU updates, their CPU copies): the
        sub-optimizers and this class's hooks are rebuilt, no parameter is copied again.
        A later rebuild (a checkpoint load) computes the placement afresh, as megatron-core
        does."""
        self._keeping_placement = True
        try:
            self._init_sub_optimizers()
        finally:
            self._keeping_placement = False

    def _get_sub_optimizer_param_groups(self, offload_fraction):
        """megatron-core's placement, or during :meth:`rebuild_keeping_placement` the one
        already made (the tuple megatron-core's returns, from the attributes its caller
        unpacked it into)."""
        if self._keeping_placement:
            return (
                self.cpu_param_groups,
                self.gpu_param_groups,
                self.gpu_params_map_cpu_copy,
                self.cpu_copys_map_gpu_param,
                self.param_to_fp32_param,
            )
        return super()._get_sub_optimizer_param_groups(offload_fraction)

    def _init_sub_optimizers(self):
        super()._init_sub_optimizers()
        self._pair_groups()
        self._build_host_mirrors()

    def _pair_groups(self) -> None:
        """(sub-optimizer, its group index, this optimizer's group index) of every
        sub-optimizer group, worked out once per set of sub-optimizers."""
        group_of = {
            self.param_to_inner_param[p]: i
            for i, g in enumerate(self.param_groups)
            for p in g["params"]
        }
        self._offload_state().group_pairs = [
            (opt, j, group_of[g["params"][0]])
            for opt in self.sub_optimizers
            for j, g in enumerate(opt.param_groups)
        ]

    def _sync_hdo_param_groups_to_sub_optimizers(self):
        """Each param group's hyperparameters (lr, weight decay, ...) into the sub-optimizer
        groups built from it, ``step`` excepted: a sub-optimizer keeps its own count, and
        one that counts per group has it copied back after the step
        (:meth:`_sync_sub_optimizers_state_to_hdo`), so that a checkpoint saves it.

        megatron-core's version copies ``step`` too. An optimizer that counts steps per
        group (transformer-engine's ``FusedAdam``, the GPU part at offload fractions below
        1) then has its count reset before every step to what these groups hold: after a
        checkpoint load, the saved step, so its bias correction stays at the saved step + 1
        until the next restart (torch's optimizers count per parameter and are immune).
        """
        for opt, j, i in self.offload.group_pairs:
            sub = opt.param_groups[j]
            for key, value in self.param_groups[i].items():
                if key not in ("params", "step"):
                    sub[key] = value

    def _sync_sub_optimizers_state_to_hdo(self):
        """megatron-core's state sync, then the ``step`` of every sub-optimizer group that
        counts steps per group into this optimizer's group (what a checkpoint saves; at
        offload fraction 0 megatron-core finds no per-parameter step to save). A torch
        optimizer's group ``step`` (copied in at a load) is not its count: not copied."""
        super()._sync_sub_optimizers_state_to_hdo()
        for opt, j, i in self.offload.group_pairs:
            step = opt.param_groups[j].get("step")
            if step is not None and _counts_per_group(opt):
                self.param_groups[i]["step"] = step

    def _move_new_state_to_right_device(self):
        """After a load: each sub-optimizer's state on its parameters' device
        (:func:`~megatron_ext.opt_checkpoint.place_sub_optimizer_state`), and no
        per-parameter ``step`` in the state of an optimizer that counts steps per group.

        megatron-core tells the two sub-optimizers apart by class (both are torch's AdamW
        without transformer-engine), and its distributed optimizer's load gives every
        state a ``step`` tensor, which transformer-engine's ``FusedAdam`` never reads and
        an uninterrupted run does not have.
        """
        for opt in self.sub_optimizers:
            if _counts_per_group(opt):
                for state in opt.state.values():
                    state.pop("step", None)
        place_sub_optimizer_state(self)

    def _build_host_mirrors(self) -> None:
        offloaded = self.gpu_params_map_cpu_copy
        state = self._offload_state()
        state.mirrors, state.mirror_params, state.blocks = [], [], []
        block_of: dict[torch.Tensor, int] = {}
        # lean: the chunked step converts gradients into its scratch, so no mirror-sized
        # host copy of them in the CPU dtype (4 bytes per element) is kept
        lean = bool(self.chunked_step) and chunked_step_refusal(self.cpu_optimizers) is None
        for source in state.sources:
            built = source_mirror(
                source,
                offloaded,
                pin=self.pin_cpu_grads,
                lean=lean,
                device_convert=bool(self.convert_on_device),
                # the delayed update sends step t-1's parameters back while step t's
                # gradients come over: not through the same bytes
                split_staging=bool(self.delayed_update),
            )
            if built is None:
                continue
            mirror, mine = built
            layout = mirror.layout
            for p, s in mine:
                cpu = offloaded[p]
                data, grad = mirror.cpu_views(s)
                cpu.data = data.view(cpu.shape)
                cpu.requires_grad = False
                cpu.grad = None if grad is None else grad.view(cpu.shape)
                block_of[cpu] = len(state.blocks) + layout.block_of(s)
            state.mirrors.append(mirror)
            state.mirror_params.append([(offloaded[p], layout.local(s)) for p, s in mine])
            state.blocks += mirror.blocks
        missing = [p for p, cpu in offloaded.items() if cpu not in block_of]
        if missing:
            raise RuntimeError(
                f"{len(missing)} offloaded parameters (shape {tuple(missing[0].shape)}, ...) "
                "lie in no flat buffer this optimizer owns; build the optimizer with "
                "megatron_ext.get_megatron_optimizer, or pass host_mirrors=False"
            )
        reads = [
            [block_of[p] for g in opt.param_groups for p in g["params"]]
            for opt in self.cpu_optimizers
        ]
        state.schedule = copy_schedule(reads, len(state.blocks))
        state.block_copied = [torch.cuda.Event() for _ in state.blocks]
        state.reset_step()
        state.gpu_masters = [
            (p, fp32) for p, fp32 in self.param_to_fp32_param.items() if p not in offloaded
        ]
        state.gpu_natives = [
            p
            for g in self.gpu_param_groups
            for p in g["params"]
            if p not in self.fp32_param_to_orig_param
        ]

    def step(self, closure=None):
        """megatron-core's step, or the chunked one (:attr:`chunked_step`), with torch's
        intra-op threads set to :attr:`cpu_threads` for its duration when that is set."""
        with cpu_threads(self.cpu_threads):
            return self._step(closure)

    def _step(self, closure=None):
        """megatron-core's step, or the chunked one (:attr:`chunked_step`): exact
        (:func:`.chunked.run_exact`) or, with :attr:`delayed_update`, one step late
        (:func:`.chunked.launch_delayed`, after landing the update in flight)."""
        if not self.chunked_step or closure is not None:
            self._refuse_if_lean("chunked_step is off" if closure is None else "a closure")
            return super().step(closure)
        state = self.offload
        plan = self._chunked_plan()
        if plan is None:
            self._refuse_if_lean(self.chunked_step_off or "the chunked step cannot run")
            if set(self.moment_dtypes) != {torch.float32} and not state.fallback_warned:
                state.fallback_warned = True
                warnings.warn(
                    f"the chunked offload step cannot run ({self.chunked_step_off}): the "
                    "per-parameter step keeps the Adam moments in fp32, not "
                    f"{self.moment_dtypes}",
                    stacklevel=3,
                )
            return super().step(closure)
        # the gradients are final here: the next delayed launch's copies to the host need
        # not wait behind the copies back that landing the update in flight issues
        mode = self.mode
        ready = None
        if mode is OffloadMode.DELAYED and state.in_flight is not None:
            ready = torch.cuda.current_stream().record_event()
        if self.drain() and self.thread_tuner is not None and self.last_landed is not None:
            landed = self.last_landed
            self.cpu_threads = self.thread_tuner.landed(
                landed.worker_s, landed.wait_s, landed.window_s
            )
        if state.torn is not None:
            raise RuntimeError(state.torn)
        if mode is OffloadMode.DELAYED and self._past_warmup():
            with profiler_range("megatron_ext::offload_launch"):
                state.in_flight = launch_delayed(self, plan, ready)
        elif mode is OffloadMode.OVERLAPPED:
            with profiler_range("megatron_ext::offload_launch"):
                state.in_flight = launch_overlapped(self, plan)
        else:
            with profiler_range("megatron_ext::offload_exact_step"):
                run_exact(self, plan)

    def _chunked_plan(self) -> ChunkedPlan | None:
        """The chunked step's plan for the current sizes (rebuilt when one changes), or None
        (the reason in ``chunked_step_off``) where the per-parameter optimizers compute
        something else."""
        sizes = (
            self.chunk_numel,
            self.compute_numel,
            tuple(self.moment_dtypes),
            self.offload_kernel,
        )
        state = self.offload
        if state.plan_for != sizes:
            self.drain()
            self.chunked_step_off = chunked_step_refusal(self.cpu_optimizers)
            plan = None if self.chunked_step_off is not None else build_chunked_plan(self)
            waits = state.forward_waits if self.mode is OffloadMode.OVERLAPPED else None
            if plan is not None and waits is not None:
                # the chunks the next forward pass reads first are updated first
                plan = waits.arrange(plan)
            state.plan, state.plan_for = plan, sizes
        return state.plan

    def _past_warmup(self) -> bool:
        """Whether this optimizer has taken :attr:`delay_warmup` steps, by the ``step`` of
        its host parameters' state (a loaded checkpoint's included); once true it stays so
        until the sub-optimizers are rebuilt (a load), so the walk runs only in warm-up."""
        if not self.offload.warmed:
            taken = max(
                (
                    float(state["step"])
                    for opt in self.cpu_optimizers
                    for state in opt.state.values()
                    if "step" in state
                ),
                default=0.0,
            )
            self.offload.warmed = taken >= self.delay_warmup
        return self.offload.warmed

    def drain(self) -> bool:
        """Land the delayed update in flight, if any: wait for its host worker and send its
        parameters to the device (ordered before the compute stream's later work); its
        error, if it raised, is raised here. Returns whether there was one.

        Called before every step, ``state_dict`` and a change of sizes; call it before
        reading the parameters outside the training loop (evaluation, the end of
        training). :func:`megatron_ext.drain_offload` does it for a whole optimizer.
        """
        state = self.offload
        flight, state.in_flight = state.in_flight, None
        if flight is None:
            return False
        with profiler_range("megatron_ext::offload_land"):
            land(self, flight)
        return True

    def await_chunk(self, position: int) -> None:
        """With an overlapped exact step in flight: until its worker has sent back the
        parameters of every chunk up to ``position`` (in update order), and the compute
        stream's later work is ordered after those copies; else nothing."""
        flight = self.offload.in_flight
        if not isinstance(flight, OverlappedUpdate) or position <= flight.awaited:
            return
        flight.await_chunk(position)
        torch.cuda.current_stream().wait_event(flight.plan.landed[position])
        flight.awaited = position

    def state_dict(self):
        """megatron-core's, after :meth:`drain`: it holds every update its step says."""
        self.drain()
        return super().state_dict()

    def load_state_dict(self, state_dict):
        """megatron-core's, after waiting for an update in flight and dropping it (the
        loaded state replaces what it would have written)."""
        state = self.offload
        flight, state.in_flight = state.in_flight, None
        if flight is not None:
            flight.wait()
            # the worker of an overlapped step may have sent parameters back: what loads
            # them on the compute stream comes after
            state.streams.order_after_copies_back(torch.cuda.current_stream())
        return super().load_state_dict(state_dict)

    def _refuse_if_lean(self, why: str) -> None:
        if any(m.cpu_grads is None for m in self.host_mirrors):
            raise RuntimeError(
                f"the per-parameter offload step cannot run here ({why}): these host mirrors "
                "were built for the chunked step, without a host copy of the gradients; keep "
                "chunked_step on, or build with MegatronOptions(offload_step='per_parameter')"
            )

    def _register_param_copy_back_gpu_hook(self):
        for k, optimizer in enumerate(self.cpu_optimizers):
            optimizer.register_step_pre_hook(functools.partial(self._before_cpu_step, k))
            optimizer.register_step_post_hook(functools.partial(self._after_cpu_step, k))
        if self.gpu_optimizer is not None:
            self.gpu_optimizer.register_step_pre_hook(self._set_gpu_grads)
            if self.param_update_in_fp32:
                self.gpu_optimizer.register_step_post_hook(self._copy_gpu_masters_back)

    def _set_sub_optimizer_grads(self):
        """One device-to-host copy per block on the offload's ``to_host`` stream, after
        the stream megatron-core's step calls this on (its ``_d2h_stream``, which waited for
        the compute stream), then one event per block, handed to megatron-core's step, which
        synchronizes each CPU optimizer's before its step."""
        state = self.offload
        to_host = state.streams.to_host
        to_host.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(to_host):
            for b in state.schedule.d2h_order:
                state.blocks[b].start_d2h()
                state.block_copied[b].record(to_host)
        for k, optimizer in enumerate(self.cpu_optimizers):
            self._cpu_optimizer_map_data_event[optimizer] = state.block_copied[
                state.schedule.wait_for[k]
            ]

    def _before_cpu_step(self, k: int, optimizer, args, kwargs) -> None:
        # megatron-core's step has synchronized this optimizer's event: its blocks are here.
        for b in self.offload.schedule.convert_before[k]:
            self.offload.blocks[b].convert_grads()

    def _after_cpu_step(self, k: int, optimizer, args, kwargs) -> None:
        state = self.offload
        blocks = [state.blocks[b] for b in state.schedule.copy_back_after[k]]
        if not blocks:
            return
        # The staging bytes are free: this step's gradients in them have been read. The
        # next step's device-to-host copy waits for these copies through the compute stream.
        for block in blocks:
            block.pack_params()
        to_device = state.streams.to_device
        to_device.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(to_device):
            for block in blocks:
                block.start_h2d()
        state.streams.order_after_copies_back(torch.cuda.current_stream())

    def _set_gpu_grads(self, optimizer, args, kwargs) -> None:
        """The GPU optimizer's gradients, on the compute stream just before its step.

        fp32 masters of lower-precision parameters: megatron-core's conversion. Parameters
        the GPU optimizer updates in place (natively fp32 ones): ``.grad`` is bound to
        ``.decoupled_grad`` where the precision-aware optimizer left their gradient there;
        megatron-core binds nothing, so its torch GPU optimizer skips them.
        """
        for param in self.offload.gpu_natives:
            grad = getattr(param, "decoupled_grad", None)
            if grad is not None and grad.dtype == param.dtype:
                param.grad = grad
        for param, fp32_param in self.offload.gpu_masters:
            grad = getattr(param, "decoupled_grad", param.grad)
            if grad is not None:
                fp32_param.grad = grad.to(fp32_param.dtype)
                fp32_param.requires_grad = True
            else:
                fp32_param.requires_grad = False

    def _copy_gpu_masters_back(self, optimizer, args, kwargs) -> None:
        for param, fp32_param in self.offload.gpu_masters:
            param.data.copy_(fp32_param.data)

    def _update_fp32_params_by_new_state(self):
        """Loaded master weights into the inner parameters, natively fp32 ones included.

        megatron-core's version looks every parameter up in ``param_to_fp32_param``, which
        has no entry for a natively fp32 parameter (KeyError when loading a checkpoint);
        its inner parameter is its CPU copy, or the parameter itself on the GPU.
        """
        if not self.param_update_in_fp32:
            return
        for param, state in self.state.items():
            self.param_to_inner_param[param].data.copy_(state["master_param"])

    def update_fp32_param_by_new_param(self):
        """Refresh every inner copy from its parameter (megatron-core skips fp32 ones)."""
        for param, inner in self.param_to_inner_param.items():
            if inner is not param:
                inner.data.copy_(param)

    def host_mirror_stats(self) -> list[dict]:
        """:meth:`BufferMirror.stats` of every buffer with offloaded parameters; once the
        chunked step has been built, also its host bytes per buffer: ``moment_bytes`` (the
        flat AdamW moments, 0 before the first step; per-parameter optimizers hold the same
        minus the padding between parameters, ``moment_padding_bytes``) and
        ``scratch_bytes`` (the reused fp32 scratch: gradients, and narrow moments widened;
        the compiled kernel does not touch it), ``moment_dtypes``, and ``kernel`` (after the
        first step: ``"native"`` where the compiled kernel updates the chunks, else
        ``"torch"``)."""
        stats = [m.stats() for m in self.host_mirrors]
        plan = self.offload.plan
        if plan is not None:
            for row, stepper in zip(stats, plan.steppers, strict=True):
                flat = stepper.host_params
                params = sum(e.local.numel for e in stepper.entries)
                allocated = stepper.exp_avg is not None
                per_element = sum(itemsize(d) for d in stepper.moment_dtypes)
                row["moment_bytes"] = flat.numel() * per_element if allocated else 0
                row["moment_padding_bytes"] = (
                    (flat.numel() - params) * per_element if allocated else 0
                )
                row["moment_dtypes"] = stepper.moment_dtypes
                if stepper.uses_native is not None:
                    row["kernel"] = "native" if stepper.uses_native else "torch"
                row["scratch_bytes"] = sum(
                    t.numel() * t.element_size()
                    for t in (stepper.scratch, *stepper.moment_scratch)
                    if t is not None
                )
        return stats


def _counts_per_group(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` keeps ``step`` per param group (transformer-engine's and Apex's
    ``FusedAdam``) rather than per parameter in its state (torch's optimizers)."""
    return not type(opt).__module__.startswith("torch.optim")


def offloads_to_host(child) -> bool:
    """Whether ``child`` (one optimizer of a chain) is a distributed optimizer over a
    ``HybridDeviceOptimizer`` with parameters on the host."""
    hdo = getattr(child, "optimizer", None)
    return (
        isinstance(child, DistributedOptimizer)
        and isinstance(hdo, HybridDeviceOptimizer)
        and not getattr(child, "is_stub_optimizer", False)
        and bool(getattr(hdo, "cpu_param_groups", None))
    )


def attach_host_mirrors(
    child,
    *,
    chunked_step: bool = False,
    chunk_numel: int = DEFAULT_CHUNK_NUMEL,
    threads: int | None = None,
    convert_on_device: bool = False,
    delayed_update: bool = False,
    delay_warmup: int = 0,
    sharing: int = 1,
    pin_threads: bool = False,
    overlap_forward: bool = False,
    model_chunks: Sequence[Any] = (),
) -> bool:
    """Give a distributed optimizer's ``HybridDeviceOptimizer`` flat host mirrors.

    Args:
        child: one optimizer of the chain, after ``enable_flat_norm`` built its targets.
        chunked_step: step with :mod:`.step` (:attr:`HostMirrorHybridOptimizer.chunked_step`).
        chunk_numel: about how many elements one chunk of that step holds.
        threads: torch's intra-op threads during each step (the CPU update's); None
            leaves torch's setting. Warns when the update would get one thread of several
            usable cores.
        convert_on_device: gradients and parameters cross in fp32, converted on the
            device (:attr:`HostMirrorHybridOptimizer.convert_on_device`).
        delayed_update: the chunked step's host update one step late, beside the next
            forward and backward ([Note: the delayed offloaded update] in :mod:`.chunked`);
            needs ``chunked_step``.
        delay_warmup: with ``delayed_update``, how many steps run exact first.
        sharing: with ``delayed_update`` and ``threads`` None, how many delayed host
            updates run at once on this rank (the offloading optimizers of one chain): the
            rank's cores are divided among their workers.
        pin_threads: with ``delayed_update``, the worker and the host kernel's helpers
            pinned to this rank's cores but one (:func:`.threads.worker_cpus`), which the
            thread launching the GPU's work keeps; a warning, and nothing pinned, where
            there is no second core or the platform cannot pin.
        overlap_forward: the exact chunked step's host update beside the next forward
            pass, which waits per module for the chunks it reads ([Note: the overlapped
            exact step] in :mod:`.forward_waits`); needs ``chunked_step``, the
            precision-aware optimizer and ``model_chunks``; not with ``delayed_update``.
        model_chunks: the model chunks the optimizer steps (megatron-core's DDP modules),
            for ``overlap_forward``.

    Attached at every offload fraction: at fraction 0 there is no mirror, but natively
    fp32 parameters on the GPU still need :meth:`HostMirrorHybridOptimizer._set_gpu_grads`.

    Returns:
        True when it did; False when ``child`` is not a distributed optimizer over a
        ``HybridDeviceOptimizer``.
    """
    hdo = getattr(child, "optimizer", None)
    if not (
        isinstance(child, DistributedOptimizer)
        and isinstance(hdo, HybridDeviceOptimizer)
        and not getattr(child, "is_stub_optimizer", False)
    ):
        return False
    if hdo.state:
        raise RuntimeError(
            "host mirrors must be attached before the first optimizer step (the optimizer "
            "already has state); build it with megatron_ext.get_megatron_optimizer"
        )
    seam.check_instance("HybridDeviceOptimizer", hdo)
    hdo.__class__ = HostMirrorHybridOptimizer
    state = hdo._offload_state()
    if delayed_update and not chunked_step:
        raise ValueError(
            "the delayed offloaded update runs the chunked step; use offload_step='chunked' "
            "with offload_delayed_update=True"
        )
    hdo.chunked_step, hdo.chunk_numel = bool(chunked_step), int(chunk_numel)
    if pin_threads and not delayed_update:
        raise ValueError(
            "offload_pin_threads=True pins the delayed update's worker threads; add "
            "offload_delayed_update=True or drop offload_pin_threads (the exact step runs "
            "while the GPU waits for it, on every core)"
        )
    hdo.delayed_update, hdo.delay_warmup = bool(delayed_update), int(delay_warmup)
    if overlap_forward:
        _check_overlap_forward(child, chunked_step, delayed_update, model_chunks)
        hdo.overlap_forward = True
        state.forward_waits = ForwardWaits(hdo, model_chunks)
    hdo.worker_cpus = worker_cpus() if pin_threads else None
    if pin_threads and hdo.worker_cpus is None:
        warnings.warn(
            "megatron_ext: offload_pin_threads=True pins nothing here: this rank has one "
            f"usable core ({rank_cores()}) or the platform cannot pin a thread "
            "(os.sched_setaffinity, Linux); the delayed update runs unpinned",
            stacklevel=2,
        )
    hdo.thread_tuner = None
    if delayed_update and threads is None:
        # the host update then runs beside the Python thread that launches the GPU's work:
        # as few threads as keep it hidden (ThreadTuner), from every core but one
        hdo.thread_tuner = ThreadTuner.for_host(sharing, hdo.worker_cpus)
        threads = hdo.thread_tuner.threads
    hdo.cpu_threads = threads
    hdo.convert_on_device = bool(convert_on_device)
    hdo.moment_dtypes = offload_moment_dtypes(child.config, chunked_step)
    if hdo.cpu_param_groups and hdo.thread_tuner is None:  # the tuner's choice is deliberate
        warning = threads_warning(threads)
        if warning:
            warnings.warn(warning, stacklevel=2)
    state.sources = offload_sources(child)
    # the (stateless) sub-optimizers rebuilt so that our hooks replace the per-parameter ones
    hdo.rebuild_keeping_placement()
    allow_optimizer_classes_in_checkpoints(hdo)
    return True


def _check_overlap_forward(child, chunked_step: bool, delayed_update: bool, model_chunks) -> None:
    """Why ``overlap_forward`` cannot run on ``child``, as an error; else nothing."""
    if not chunked_step:
        raise ValueError(
            "offload_overlap_forward runs the chunked step's host update beside the forward "
            "pass; use offload_step='chunked' (the default with host mirrors)"
        )
    if delayed_update:
        raise ValueError(
            "offload_overlap_forward and offload_delayed_update are two ways of running the "
            "host update beside the GPU (exact, or one step late); choose one"
        )
    config = child.config
    precision_aware = getattr(
        config,
        "use_precision_aware_optimizer_no_fp8_or_ds_fp8",
        getattr(config, "use_precision_aware_optimizer", False),
    )
    if not precision_aware:
        raise ValueError(
            "offload_overlap_forward needs use_precision_aware_optimizer=True (and no FP8 "
            "parameter gather): otherwise megatron-core copies every main parameter to the "
            "model's right after the step, before the host update has ended; drop "
            "offload_overlap_forward or turn on the precision-aware optimizer"
        )
    if not model_chunks:
        raise ValueError(
            "offload_overlap_forward needs the model chunks, to wait in their forward "
            "pass; pass model_chunks (megatron_ext.get_megatron_optimizer does)"
        )
    for chunk in model_chunks:
        cfg = getattr(chunk, "config", None)
        graphs = getattr(cfg, "cuda_graph_impl", "none") or "none"
        if (
            graphs != "none"
            or getattr(cfg, "enable_cuda_graph", False)
            or getattr(cfg, "external_cuda_graph", False)
        ):
            raise ValueError(
                "offload_overlap_forward waits in forward pre-hooks, which a replayed CUDA "
                f"graph skips (cuda_graph_impl={graphs!r}): its forward could read parameters "
                "the host update has not sent back; drop offload_overlap_forward or the CUDA "
                "graphs"
            )
