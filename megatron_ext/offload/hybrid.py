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

import contextlib
import functools
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from buffers.spans import Span

from .. import seam
from ..opt_checkpoint import place_sub_optimizer_state
from .host_mirror import (
    BufferMirror,
    HostBlock,
    add_island_copies,
    build_buffer_mirror,
    chunk_copies,
)
from .plan import MirrorLayout, copy_schedule, itemsize, mirror_layout
from .step import (
    DEFAULT_CHUNK_NUMEL,
    DEFAULT_COMPUTE_NUMEL,
    MOMENT_DTYPES,
    ChunkedAdamW,
    Entry,
    chunk_spans,
    eligible,
)

HybridDeviceOptimizer = seam.target("HybridDeviceOptimizer")
DistributedOptimizer = seam.target("DistributedOptimizer")


@dataclass
class OffloadSource:
    """What the host mirror of one buffer is built from (taken from the optimizer once)."""

    name: str
    owned: tuple[Span, ...]  # this rank's ranges (buffer coordinates)
    grads: torch.Tensor  # what the optimizer's gradients are views of
    grads_coords: tuple[Span, ...] | None  # None: buffer coordinates; else owned, end to end
    param_data: torch.Tensor  # the DDP parameter buffer
    spans: dict[torch.Tensor, Span]  # every inner-optimizer parameter of this buffer
    # (owned piece, its view in the fp32 island) of each parameter whose gradient the
    # optimizer reads in the buffer's fp32 local-accumulation island
    island: tuple[tuple[Span, torch.Tensor], ...] = ()


class HostMirrorHybridOptimizer(HybridDeviceOptimizer):
    """megatron-core's ``HybridDeviceOptimizer`` moving whole blocks through host mirrors.

    Made by :func:`attach_host_mirrors` (a class swap of an existing instance); the
    placement (which parameters the CPU updates), the sub-optimizers, the streams and the
    step are megatron-core's. What changes: the CPU parameters and their gradients are views
    of one host mirror per buffer (:attr:`host_mirrors`), gradients arrive with one
    device-to-host copy per block, parameters leave with one host-to-device copy per block
    (:class:`CopySchedule` says when), and the GPU optimizer's gradients are set on the
    compute stream just before the GPU step (megatron-core makes the fp32 masters' ones on
    its copy stream, which the GPU step does not wait for, and gives natively fp32
    parameters with precision-aware gradients none: see :meth:`_set_gpu_grads`).
    """

    _offload_sources: tuple[OffloadSource, ...] = ()
    _reused_placement: tuple | None = None
    host_mirrors: list[BufferMirror]
    # The chunked step (:mod:`.step`): one fused AdamW call per chunk of a host mirror, the
    # chunks' copies pipelined with the updates. Opt-in until it has run on a GPU: set
    # ``chunked_step = True`` on the class or the instance (before the first step).
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
    _chunked: tuple | None = None
    _torn: str | None = None  # why the chunked step refuses to run (a step failed part way)
    _fallback_warned = False

    def _get_sub_optimizer_param_groups(self, offload_fraction):
        if self._reused_placement is not None:
            placement, self._reused_placement = self._reused_placement, None
            return placement
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
        self._group_pairs = [
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
        for opt, j, i in self._group_pairs:
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
        for opt, j, i in self._group_pairs:
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
        self.host_mirrors = []
        self._mirror_params: list[list[tuple[torch.Tensor, Span]]] = []  # (CPU param, local)
        self._host_blocks: list[HostBlock] = []
        block_of: dict[torch.Tensor, int] = {}
        # lean: the chunked step converts gradients into its scratch, so no mirror-sized
        # host copy of them in the CPU dtype (4 bytes per element) is kept
        lean = bool(self.chunked_step) and eligible(self.cpu_optimizers) is None
        for source in self._offload_sources:
            built = source_mirror(
                source,
                offloaded,
                pin=self.pin_cpu_grads,
                lean=lean,
                device_convert=bool(self.convert_on_device),
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
                block_of[cpu] = len(self._host_blocks) + layout.block_of(s)
            self.host_mirrors.append(mirror)
            self._mirror_params.append([(offloaded[p], layout.local(s)) for p, s in mine])
            self._host_blocks += mirror.blocks
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
        self._schedule = copy_schedule(reads, len(self._host_blocks))
        self._d2h_events = [torch.cuda.Event() for _ in self._host_blocks]
        self._h2d_done = torch.cuda.Event()
        self._chunked = None
        self._chunked_for = None
        self._torn = None
        self._gpu_masters = [
            (p, fp32) for p, fp32 in self.param_to_fp32_param.items() if p not in offloaded
        ]
        self._gpu_natives = [
            p
            for g in self.gpu_param_groups
            for p in g["params"]
            if p not in self.fp32_param_to_orig_param
        ]

    def _build_chunked(self):
        """(steppers, copies, events): per mirror one :class:`ChunkedAdamW`; per chunk its
        copies and its device-to-host event. None (with the reason kept in
        ``chunked_step_off``) where the per-parameter optimizers compute something else."""
        self.chunked_step_off = eligible(self.cpu_optimizers)
        if self.chunked_step_off is not None:
            return None
        # every CPU parameter is one mirror's (_build_host_mirrors checked that)
        where = {
            p: (opt, gi)
            for opt in self.cpu_optimizers
            for gi, g in enumerate(opt.param_groups)
            for p in g["params"]
        }
        # the offload optimizer's group each per-parameter optimizer's group was made from
        family = {(id(opt), j): i for opt, j, i in self._group_pairs}
        steppers, copies, order = [], [], []
        for k, (m, params) in enumerate(zip(self.host_mirrors, self._mirror_params, strict=True)):
            entries = [
                Entry(cpu, local, *where[cpu], family=family[id(where[cpu][0]), where[cpu][1]])
                for cpu, local in params
            ]
            runs = chunk_spans(
                [m.layout.local(b) for b in m.layout.blocks],
                max(1, int(self.chunk_numel)),
                [e.local for e in entries],
            )
            steppers.append(
                ChunkedAdamW(
                    m.host_params,
                    m.cpu_grads,
                    entries,
                    [r for _, r in runs],
                    self.compute_numel,
                    tuple(self.moment_dtypes),
                    self.offload_kernel,
                )
            )
            copies += chunk_copies(m, runs)
            order += [(k, i) for i in range(len(runs))]
        events = [torch.cuda.Event() for _ in copies]
        return steppers, copies, events, order

    def step(self, closure=None):
        """megatron-core's step, or the chunked one (:attr:`chunked_step`), with torch's
        intra-op threads set to :attr:`cpu_threads` for its duration when that is set."""
        with cpu_threads(self.cpu_threads):
            return self._step(closure)

    def _step(self, closure=None):
        """megatron-core's step, or the chunked one (:attr:`chunked_step`).

        The chunked step: every chunk's device-to-host copy is issued at once on the copy
        stream; then per chunk, in order: wait for its copy; in cache-sized sub-ranges
        convert, one fused AdamW call per family of parameters, pack; its host-to-device
        copy on the other stream; so that chunk i's copies overlap the update of its
        neighbours; then the GPU optimizer steps and the step counters advance.

        If the CPU part raises, every copy already issued completes before the exception
        leaves, and the compute stream waits for the copies back. Raised before any fused
        call had updated anything, the optimizer is as it was before the step (counters,
        moments, parameters on both sides); raised later, this step refuses to run again
        until a checkpoint is loaded (the state is then part old, part new).
        """
        if not self.chunked_step or closure is not None:
            self._refuse_if_lean("chunked_step is off" if closure is None else "a closure")
            return super().step(closure)
        sizes = (
            self.chunk_numel,
            self.compute_numel,
            tuple(self.moment_dtypes),
            self.offload_kernel,
        )
        if self._chunked_for != sizes:
            self._chunked, self._chunked_for = self._build_chunked(), sizes
        if self._chunked is None:
            self._refuse_if_lean(self.chunked_step_off)
            if set(self.moment_dtypes) != {torch.float32} and not self._fallback_warned:
                self._fallback_warned = True
                warnings.warn(
                    f"the chunked offload step cannot run ({self.chunked_step_off}): the "
                    "per-parameter step keeps the Adam moments in fp32, not "
                    f"{self.moment_dtypes}",
                    stacklevel=3,
                )
            return super().step(closure)
        if self._torn is not None:
            raise RuntimeError(self._torn)
        steppers, copies, events, order = self._chunked
        self._sync_hdo_param_groups_to_sub_optimizers()
        for stepper in steppers:
            stepper.begin()
        compute = torch.cuda.current_stream()
        self._d2h_stream.wait_stream(compute)
        with torch.cuda.stream(self._d2h_stream):
            for chunk, event in zip(copies, events, strict=True):
                chunk.start_d2h()
                event.record(self._d2h_stream)
        # the device parameters may still be read by work queued before this step
        self._h2d_stream.wait_stream(compute)
        waited = 0
        try:
            for (k, i), chunk, event in zip(order, copies, events, strict=True):
                event.synchronize()
                waited += 1
                steppers[k].update(i, chunk)  # convert, update, pack, sub-range by sub-range
                with torch.cuda.stream(self._h2d_stream):
                    chunk.start_h2d()
            # after the CPU part: a CPU failure leaves the GPU part untouched too
            if self.gpu_optimizer is not None:
                self.gpu_optimizer.step()
        except BaseException:
            # no copy left in flight: the host may free or reuse the staging
            for event in events[waited:]:
                event.synchronize()
            self._h2d_stream.synchronize()
            updated = sum(s.updated for s in steppers)
            if updated:
                self._torn = (
                    f"the previous offloaded optimizer step failed part way ({updated} fused "
                    "AdamW calls on the host had updated parameters and moments, the rest "
                    "of the step had not), "
                    "so this optimizer's state is inconsistent; load the last checkpoint "
                    "(load_state_dict) before stepping again"
                )
            raise
        finally:  # later device work is ordered after the copies back already issued
            self._order_after_copies_back(compute)
        for stepper in steppers:
            stepper.finish()
        self._sync_sub_optimizers_state_to_hdo()

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
        """One device-to-host copy per block, on the copy stream (megatron-core's step
        calls this there), then one event per block for the CPU steps to wait on."""
        for b in self._schedule.d2h_order:
            self._host_blocks[b].start_d2h()
            self._d2h_events[b].record(self._d2h_stream)
        for k, optimizer in enumerate(self.cpu_optimizers):
            self._cpu_optimizer_map_data_event[optimizer] = self._d2h_events[
                self._schedule.wait_for[k]
            ]

    def _before_cpu_step(self, k: int, optimizer, args, kwargs) -> None:
        # megatron-core's step has synchronized this optimizer's event: its blocks are here.
        for b in self._schedule.convert_before[k]:
            self._host_blocks[b].convert_grads()

    def _after_cpu_step(self, k: int, optimizer, args, kwargs) -> None:
        blocks = [self._host_blocks[b] for b in self._schedule.copy_back_after[k]]
        if not blocks:
            return
        # The staging bytes are free: this step's gradients in them have been read. The
        # next step's device-to-host copy waits for these copies through the compute stream.
        for block in blocks:
            block.pack_params()
        self._h2d_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._h2d_stream):
            for block in blocks:
                block.start_h2d()
        self._order_after_copies_back(torch.cuda.current_stream())

    def _order_after_copies_back(self, stream) -> None:
        """``stream``'s later work waits for every host-to-device copy issued so far."""
        self._h2d_done.record(self._h2d_stream)
        stream.wait_event(self._h2d_done)

    def _set_gpu_grads(self, optimizer, args, kwargs) -> None:
        """The GPU optimizer's gradients, on the compute stream just before its step.

        fp32 masters of lower-precision parameters: megatron-core's conversion. Parameters
        the GPU optimizer updates in place (natively fp32 ones): ``.grad`` is bound to
        ``.decoupled_grad`` where the precision-aware optimizer left their gradient there;
        megatron-core binds nothing, so its torch GPU optimizer skips them.
        """
        for param in self._gpu_natives:
            grad = getattr(param, "decoupled_grad", None)
            if grad is not None and grad.dtype == param.dtype:
                param.grad = grad
        for param, fp32_param in self._gpu_masters:
            grad = getattr(param, "decoupled_grad", param.grad)
            if grad is not None:
                fp32_param.grad = grad.to(fp32_param.dtype)
                fp32_param.requires_grad = True
            else:
                fp32_param.requires_grad = False

    def _copy_gpu_masters_back(self, optimizer, args, kwargs) -> None:
        for param, fp32_param in self._gpu_masters:
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
        if self._chunked is not None:
            for row, stepper in zip(stats, self._chunked[0], strict=True):
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


@contextlib.contextmanager
def cpu_threads(n: int | None):
    """torch's intra-op threads set to ``n`` inside, restored after (None: unchanged)."""
    if n is None or n == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity), else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_warning(threads: int | None) -> str | None:
    """A line when the CPU update would run on one thread of several usable cores."""
    n = torch.get_num_threads() if threads is None else threads
    cores = usable_cores()
    if n > 1 or cores <= 1:
        return None
    return (
        f"the offloaded CPU optimizer step will use 1 thread of the {cores} cores this "
        "process may use (torchrun sets OMP_NUM_THREADS=1 unless told otherwise); pass "
        "megatron_ext.MegatronOptions(offload_threads=N), N about the cores per rank on "
        "this host, or set OMP_NUM_THREADS"
    )


def offload_moment_dtypes(config, chunked_step: bool) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes of the offloaded Adam moments: megatron-core's ``exp_avg_dtype`` and
    ``exp_avg_sq_dtype`` with the precision-aware optimizer and the chunked step, else fp32.

    megatron-core's ``HybridDeviceOptimizer`` ignores them (its CPU AdamW keeps fp32); the
    per-parameter step still does, with a warning. ``main_params_dtype`` other than fp32 is
    not honoured by either step (warned: the host master weights stay fp32).
    """
    fp32 = torch.float32
    if not getattr(config, "use_precision_aware_optimizer", False):
        return (fp32, fp32)
    asked = (getattr(config, "exp_avg_dtype", fp32), getattr(config, "exp_avg_sq_dtype", fp32))
    main = getattr(config, "main_params_dtype", fp32)
    if main != fp32:
        warnings.warn(
            f"main_params_dtype={main} is not honoured by the CPU-offloaded optimizer step: "
            "its master weights on the host stay fp32",
            stacklevel=3,
        )
    if asked == (fp32, fp32):
        return asked
    if not chunked_step:
        warnings.warn(
            f"exp_avg_dtype={asked[0]} / exp_avg_sq_dtype={asked[1]} are not honoured by the "
            "per-parameter CPU-offloaded step (torch's AdamW keeps fp32 moments on the host); "
            "use MegatronOptions(offload_step='chunked') to keep them as asked",
            stacklevel=3,
        )
        return (fp32, fp32)
    kept = " or ".join(map(str, MOMENT_DTYPES))
    for dtype in asked:
        if dtype not in MOMENT_DTYPES:
            raise ValueError(
                f"the CPU-offloaded step keeps Adam moments in {kept}, not {dtype} "
                "(OptimizerConfig exp_avg_dtype / exp_avg_sq_dtype)"
            )
    return asked


def source_mirror(
    source: OffloadSource,
    offloaded,
    *,
    pin: bool,
    lean: bool = False,
    device_convert: bool = False,
):
    """The host mirror of one buffer's offloaded parameters, or None when it has none.

    ``offloaded``: the inner parameters the CPU updates (``gpu_params_map_cpu_copy``).
    Returns ``(mirror, [(parameter, span)])``, the mirror's parameters loaded from the device.
    """
    mine = [(p, s) for p, s in source.spans.items() if p in offloaded]
    if not mine:
        return None
    resident = [s for p, s in source.spans.items() if p not in offloaded]
    layout = mirror_layout(source.owned, [s for _, s in mine], resident)
    params, params_coords, device_params = _device_params(source, layout, mine)
    mirror = build_buffer_mirror(
        source.name,
        layout,
        owned_numel=sum(s.numel for s in source.owned),
        grads=source.grads,
        grads_coords=source.grads_coords,
        params=params,
        params_coords=params_coords,
        cpu_dtype=_one_dtype(offloaded[p] for p, _ in mine),
        pin=pin,
        lean=lean,
        device_convert=device_convert,
    )
    mirror.device_params = device_params
    known = set(source.spans.values())
    stray = [span for span, _ in source.island if span not in known]
    if stray:
        raise RuntimeError(
            f"{source.name}: the fp32-accumulation gradient at {stray[0]} matches no parameter "
            "of the optimizer; pass host_mirrors=False to get_megatron_optimizer"
        )
    offloaded_spans = {s for _, s in mine}
    add_island_copies(mirror, [x for x in source.island if x[0] in offloaded_spans], pin=pin)
    mirror.load_params()
    return mirror, mine


def _one_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise RuntimeError(f"one buffer's offloaded parameters have several dtypes: {dtypes}")
    return dtypes.pop()


def _is_view_of(p: torch.Tensor, base: torch.Tensor, span: Span) -> bool:
    return (
        p.dtype == base.dtype
        and p.device == base.device
        and p.is_contiguous()
        and p.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        and p.storage_offset() == base.storage_offset() + span.start
    )


def _device_params(source: OffloadSource, layout: MirrorLayout, mine):
    """Where one buffer's updated parameters go back to: (tensor, coords, built here).

    The inner optimizer's parameters are either views of the DDP parameter buffer
    (precision-aware shards, fp32 parameters) or separate fp32 main shards of bf16
    parameters; those are moved into one flat device tensor laid out like the mirror, so
    each block still goes back with one copy.
    """
    views = [_is_view_of(p, source.param_data, s) for p, s in mine]
    if all(views):
        return source.param_data, None, None
    if any(views):
        raise RuntimeError(
            f"{source.name}: some offloaded parameters are views of the parameter buffer "
            "and some are not; host mirrors need one kind per buffer"
        )
    flat = torch.zeros(layout.numel, dtype=_one_dtype(p for p, _ in mine), device=mine[0][0].device)
    for p, s in mine:
        local = layout.local(s)
        view = flat[local.start : local.end]
        view.copy_(p.detach().reshape(-1))
        p.data = view.view(p.shape)
    return flat, layout.blocks, flat


def offload_sources(child) -> tuple[OffloadSource, ...]:
    """Per gradient buffer of a distributed optimizer: its shard and inner parameters.

    Needs ``child._flat`` (:func:`megatron_ext.optimizer.enable_flat_norm`): its targets
    say which ranges this rank owns and whether the optimizer's gradients are views of the
    grad buffer or of an fp32 mirror of the owned ranges.
    """
    decoupled = bool(child.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    mains16 = child.shard_float16_groups if decoupled else child.shard_fp32_from_float16_groups
    pairs = [
        *zip(_chain(child.model_float16_groups), _chain(mains16), strict=True),
        *zip(_chain(child.model_fp32_groups), _chain(child.shard_fp32_groups), strict=True),
    ]
    per_buffer: dict[int, dict[torch.Tensor, Span]] = {}
    for model_param, shard in pairs:
        if shard is None:
            raise NotImplementedError(
                "host mirrors do not support quantized (fp8/fp4) parameters; pass "
                "host_mirrors=False to megatron_ext.get_megatron_optimizer"
            )
        index = child.model_param_gbuf_map[model_param][0]
        start = child.buffers[index].param_index_map[model_param][0]
        r = child._get_model_param_range_map(model_param)["param"]
        per_buffer.setdefault(index, {})[shard] = Span(start + r.start, start + r.end)
    sources = []
    for i, (buf, target) in enumerate(zip(child.buffers, child._flat.targets, strict=True)):
        mirrored = target.mirror is not None
        sources.append(
            OffloadSource(
                name=target.name,
                owned=target.spans.owned,
                grads=target.mirror if mirrored else buf.grad_data,
                grads_coords=target.spans.owned if mirrored else None,
                param_data=buf.param_data,
                spans=per_buffer.get(i, {}),
                island=tuple(
                    (piece, target.island[at.start : at.end])
                    for _, piece, at in target.island_pieces
                ),
            )
        )
    return tuple(sources)


def _chain(groups):
    return [p for g in groups for p in g]


def attach_host_mirrors(
    child,
    *,
    chunked_step: bool = False,
    chunk_numel: int = DEFAULT_CHUNK_NUMEL,
    threads: int | None = None,
    convert_on_device: bool = False,
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
    hdo.chunked_step, hdo.chunk_numel = bool(chunked_step), int(chunk_numel)
    hdo.cpu_threads = threads
    hdo.convert_on_device = bool(convert_on_device)
    hdo.moment_dtypes = offload_moment_dtypes(child.config, chunked_step)
    if hdo.cpu_param_groups:
        warning = threads_warning(threads)
        if warning:
            warnings.warn(warning, stacklevel=2)
    hdo._offload_sources = offload_sources(child)
    # Keep megatron-core's placement and CPU copies (no second copy of every parameter);
    # rebuild the (stateless) sub-optimizers so that our hooks replace the per-parameter ones.
    hdo._reused_placement = (
        hdo.cpu_param_groups,
        hdo.gpu_param_groups,
        hdo.gpu_params_map_cpu_copy,
        hdo.cpu_copys_map_gpu_param,
        hdo.param_to_fp32_param,
    )
    hdo._init_sub_optimizers()
    allow_optimizer_classes_in_checkpoints(hdo)
    return True


def allow_optimizer_classes_in_checkpoints(hdo) -> list[type]:
    """Let ``torch.load(weights_only=True)`` read a checkpoint holding this optimizer's
    param groups: megatron-core's ``HybridDeviceOptimizer`` keeps its CPU and GPU optimizer
    classes in every param group (``cpu_optimizer_cls``, ``gpu_optimizer_cls``), and
    megatron-core 0.18's ``dist_checkpointing`` loads the common state with torch's default
    weights-only unpickler, which refuses any class it was not told about ("Unsupported
    global: GLOBAL torch.optim.adamw.AdamW"): an offloaded checkpoint could be saved but
    not loaded. The two classes (optimizer classes of torch, transformer-engine or Apex,
    named by the optimizer itself) are added to torch's safe globals; returns them."""
    classes = [
        c
        for c in (getattr(hdo, "cpu_optimizer_cls", None), getattr(hdo, "gpu_optimizer_cls", None))
        if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
    ]
    if classes:
        torch.serialization.add_safe_globals(classes)
    return classes
