"""CPU offload through host mirrors, the step: AdamW over a host mirror's flat tensors, chunk
by chunk, so that the copies of one chunk overlap the update of another.

megatron-core steps one ``torch.optim.AdamW(fused=True)`` per offloaded parameter, after the
whole block's gradients have arrived and before any parameter goes back. Here the same fused
kernel (``torch._fused_adamw_``, what ``AdamW(fused=True)`` calls on the CPU) runs over
chunks of the mirror: each chunk's parameters, gradients and moments are slices of flat host
tensors, one call per chunk and distinct set of hyperparameters. Per element the arithmetic is
the kernel's, with the same inputs, so the result equals the per-parameter optimizers' bit
for bit. The optimizer state stays megatron-core's: per parameter, ``step``, ``exp_avg`` and
``exp_avg_sq`` in each per-parameter optimizer's ``state``, the moments being views of this
module's flat tensors (a state loaded from a checkpoint is copied in and re-bound).

Pure CPU code; :mod:`.hybrid` drives it between the device copies.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from buffers.spans import Span

from . import host_kernel

# Each chunk is one fused call per hyperparameter set and one copy each way; 4 Mi elements
# (16 MiB of fp32) keeps a 335M-element shard at ~80 chunks (the per-call overhead is tens
# of microseconds) while the first chunk's copy in and the last one's copy out stay short.
DEFAULT_CHUNK_NUMEL = 4 * 2**20
# Within a chunk, the gradients are converted, the parameters updated and packed in
# sub-ranges of about this many elements (4 MiB of fp32 scratch), which stay in the caches.
DEFAULT_COMPUTE_NUMEL = 2**20


# torch's fused CPU Adam kernel walks a tensor in cache-line units (16 fp32 elements) and
# vector lanes, finishing a tensor's odd end with scalar code whose rounding can differ in
# the last bit. Cutting a parameter only at multiples of this many elements from its start
# gives every element the code path it has in the whole parameter: results stay bit-equal.
CUT_QUANTUM = 64

# how a chunk is updated: "auto" the compiled kernel (:mod:`.host_kernel`: one pass per element)
# where it is built and reproduces torch's fused AdamW here, else torch's ops; "native"
# the kernel or an error; "torch" torch's ops (convert, torch._fused_adamw_, pack)
KERNELS = ("auto", "native", "torch")

# Adam moment dtypes the step keeps on the host (megatron-core's exp_avg_dtype and
# exp_avg_sq_dtype; narrower ones are widened to fp32 for the fused call)
MOMENT_DTYPES = (torch.float32, torch.bfloat16)


def chunk_spans(
    blocks: Sequence[Span],
    chunk_numel: int,
    params: Sequence[Span] = (),
    quantum: int = CUT_QUANTUM,
) -> tuple[tuple[int, Span], ...]:
    """Each block cut into runs of about ``chunk_numel`` elements: (block index, run).

    Args:
        blocks: the mirror's blocks in mirror coordinates (laid end to end).
        chunk_numel: the run length aimed at; positive. A run ends early, or extends to
            the next allowed cut, where it would end inside a parameter elsewhere than at a
            multiple of ``quantum`` from that parameter's start.
        params: the parameters' spans (mirror coordinates, disjoint).
        quantum: see ``chunk_numel``.
    """
    if chunk_numel <= 0:
        raise ValueError(f"chunk_numel must be positive, got {chunk_numel}")
    params = sorted(params, key=lambda s: s.start)
    starts = [p.start for p in params]
    out = []
    for i, block in enumerate(blocks):
        pos = block.start
        while pos < block.end:
            cut = min(block.end, pos + chunk_numel)
            k = bisect.bisect_right(starts, cut - 1) - 1
            if cut < block.end and k >= 0 and params[k].start < cut < params[k].end:
                p = params[k]
                snapped = p.start + (cut - p.start) // quantum * quantum
                if snapped <= pos:  # the next allowed cut after pos, within the block
                    snapped = min(p.end, p.start + ((pos - p.start) // quantum + 1) * quantum)
                cut = min(snapped, block.end)
            out.append((i, Span(pos, cut)))
            pos = cut
    return tuple(out)


@dataclass(frozen=True)
class HostParam:
    """One CPU parameter: where it lies in the mirror and which optimizer group holds it."""

    param: torch.Tensor
    local: Span  # mirror coordinates
    optimizer: torch.optim.Optimizer
    group: int  # index into optimizer.param_groups
    # Entries of one family always share their hyperparameters (one param group of the
    # offload optimizer, copied into each per-parameter optimizer): one fused call per
    # family and sub-range. None: a family of its own optimizer group.
    family: Hashable | None = None


def chunked_step_refusal(optimizers: Sequence[torch.optim.Optimizer]) -> str | None:
    """None when :class:`ChunkedAdamW` computes what ``optimizers`` would; else why not."""
    for opt in optimizers:
        if type(opt) is not torch.optim.AdamW:
            return f"the CPU optimizer is {type(opt).__name__}, not torch.optim.AdamW"
        for g in opt.param_groups:
            if g.get("fused") is not True:
                return "the CPU AdamW is not fused (megatron-core builds it with fused=True)"
            for key in ("amsgrad", "maximize", "capturable", "differentiable"):
                if g.get(key):
                    return f"the CPU AdamW has {key}=True"
            if isinstance(g.get("lr"), torch.Tensor):
                return "the CPU AdamW has a tensor lr"
    return None


@dataclass(frozen=True)
class _SubRange:
    """One sub-range's work, views built once: gradients into the scratch, island pieces
    over them, one fused call per family, the parameters packed."""

    convert: tuple[torch.Tensor, torch.Tensor] | None  # (scratch, staging) or None
    islands: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # (destination, staging)
    # (family, parameters, gradients, exp_avg, exp_avg_sq, next steps)
    calls: tuple[tuple[int, list, list, list, list, list], ...]
    pack: tuple[torch.Tensor, torch.Tensor] | None  # (staging, host parameters)
    # narrow moments: (fp32 scratch, flat moment) widened before the calls, narrowed after
    moments: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()


class ChunkedAdamW:
    """AdamW over one host mirror's parameters, chunk by chunk, each chunk in cache-sized
    sub-ranges: convert its gradients into a reused fp32 scratch, one fused call per
    family of parameters, pack its parameters, while all of it is still in the CPU's caches.

    Converting and packing a whole block in passes of their own moves each element's fp32
    gradient and parameter through memory twice more than the update does (~1.45x the
    update's time on a 2-core EPYC, 32 Mi elements); in sub-ranges of 1 Mi elements, ~1.15x.

    A step is :meth:`begin`, :meth:`update` of every chunk, :meth:`finish`. The step
    counters advance only in :meth:`finish`: until then the kernel reads a copy of them
    advanced by one (:attr:`next_steps`), so a step that stops before any update leaves
    the optimizer as it was. Every parameter's ``step`` is a 0-dim view of one flat
    tensor (:attr:`steps`), one per parameter even where a loaded state shared one tensor
    between several, so each advances once per step.

    Args:
        host_params: the mirror's flat CPU parameters.
        cpu_grads: the mirror's flat CPU gradients (same length); read directly only where
            the gradients arrive in the CPU dtype (no conversion); None for a lean mirror.
        entries: every CPU parameter of the mirror (views of ``host_params``, disjoint; kept
            sorted by position in :attr:`entries`).
        chunks: runs of mirror coordinates covering the parameters, in update order (what
            one device copy each way moves).
        compute_numel: the sub-range length aimed at (cut as :func:`chunk_spans` cuts).
        moment_dtypes: the dtypes ``exp_avg`` and ``exp_avg_sq`` are kept in
            (:data:`MOMENT_DTYPES`). A bf16 moment is widened to fp32 for the fused call and
            rounded back to nearest even after it, as transformer-engine's ``FusedAdam``
            does on the GPU with megatron-core's ``exp_avg_dtype=torch.bfloat16``: 2 bytes
            per element instead of 4, read and written once per step.
        kernel: one of :data:`KERNELS`. The two paths give the same bits (the compiled one
            is only used where a probe shows it reproduces torch's kernel here).
    """

    def __init__(
        self,
        host_params: torch.Tensor,
        cpu_grads: torch.Tensor | None,
        entries: Sequence[HostParam],
        chunks: Sequence[Span],
        compute_numel: int = DEFAULT_COMPUTE_NUMEL,
        moment_dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32),
        kernel: str = "auto",
    ):
        if kernel not in KERNELS:
            raise ValueError(f"kernel={kernel!r}; expected one of {KERNELS}")
        self.kernel = kernel
        for dtype in moment_dtypes:
            if dtype not in MOMENT_DTYPES:
                raise ValueError(
                    f"Adam moments in {dtype} are not supported by the offloaded step; "
                    f"use one of {', '.join(map(str, MOMENT_DTYPES))}"
                )
        if host_params.dtype != torch.float32:
            raise ValueError(f"the host parameters must be fp32, got {host_params.dtype}")
        self.moment_dtypes = tuple(moment_dtypes)
        self._moment_kinds = (
            host_kernel.KINDS[self.moment_dtypes[0]],
            host_kernel.KINDS[self.moment_dtypes[1]],
        )
        if cpu_grads is not None and (
            host_params.shape != cpu_grads.shape or host_params.dtype != cpu_grads.dtype
        ):
            raise ValueError("host parameters and gradients must be flat tensors alike")
        self.host_params, self.cpu_grads = host_params, cpu_grads
        self.entries = tuple(sorted(entries, key=lambda e: e.local.start))
        base = host_params.storage_offset()
        for e in self.entries:
            if not (
                e.param.untyped_storage().data_ptr() == host_params.untyped_storage().data_ptr()
                and e.param.storage_offset() - base == e.local.start
                and e.param.numel() == e.local.numel
                and e.param.is_contiguous()
            ):
                raise ValueError(f"a CPU parameter is not the mirror's view at {e.local}")
        spans = [e.local for e in self.entries]
        for left, right in itertools.pairwise(spans):
            if left.end > right.start:
                raise ValueError(f"CPU parameters overlap in the mirror: {left} and {right}")
        self.chunks = tuple(chunks)
        starts = [s.start for s in spans]
        # per chunk, per sub-range: (sub-range, [(entry index, mirror span) of each piece])
        self.subs: list[list[tuple[Span, list[tuple[int, Span]]]]] = []
        longest = 0
        for c in self.chunks:
            per_chunk = []
            for _, sub in chunk_spans([c], compute_numel, spans):
                inside = []
                k = max(bisect.bisect_right(starts, sub.start) - 1, 0)  # entries are disjoint
                while k < len(spans) and spans[k].start < sub.end:
                    a, b = max(sub.start, spans[k].start), min(sub.end, spans[k].end)
                    if a < b:
                        inside.append((k, Span(a, b)))
                    k += 1
                per_chunk.append((sub, inside))
                longest = max(longest, sub.numel)
            self.subs.append(per_chunk)
        covered = sum(s.numel for c in self.subs for _, p in c for _, s in p)
        if covered != sum(e.local.numel for e in self.entries):
            raise ValueError("the chunks do not cover every parameter exactly once")
        families: dict[Hashable, int] = {}
        self._family = [
            families.setdefault(
                e.family if e.family is not None else ("group", id(e.optimizer), e.group),
                len(families),
            )
            for e in self.entries
        ]
        # the entry whose optimizer group gives each family's hyperparameters
        self._family_entry = [self._family.index(f) for f in range(len(families))]
        self.scratch = torch.empty(longest, dtype=host_params.dtype)
        # moments kept in a narrower dtype are widened into these for the fused call and
        # rounded back (to nearest even) after, sub-range by sub-range
        self.moment_scratch = tuple(
            None if dtype == torch.float32 else torch.empty(longest, dtype=torch.float32)
            for dtype in self.moment_dtypes
        )
        self.exp_avg: torch.Tensor | None = None  # allocated at the first step, as torch does
        self.exp_avg_sq: torch.Tensor | None = None
        self.steps = torch.zeros(len(self.entries), dtype=torch.float32)
        self.next_steps = torch.zeros_like(self.steps)
        self._step_views = list(self.steps.unbind()) if self.entries else []
        self._next_views = list(self.next_steps.unbind()) if self.entries else []
        self._bound: list[tuple | None] = [None] * len(self.entries)
        self._hyper: list[tuple] = []
        self._plans: dict[int, tuple[object, tuple[_SubRange, ...]]] = {}
        self._native_plans: dict[int, tuple[object, object]] = {}
        self._native: host_kernel.HostAdamW | None = None  # resolved at the first begin()
        self._native_resolved = False
        self._hyper_c: Any = None  # a ctypes array of the hyperparameters, per begin()
        self.updated = 0  # fused calls made since begin()
        self.native_updates = 0  # of them, chunks updated by the compiled kernel

    def _flat(self, t: torch.Tensor | None, span: Span) -> torch.Tensor:
        if t is None:
            raise RuntimeError("the flat moments exist from the first begin() on")
        return t[span.start : span.end]

    def _moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(exp_avg, exp_avg_sq), the flat moments (allocated by the first begin())."""
        if self.exp_avg is None or self.exp_avg_sq is None:
            raise RuntimeError("the flat moments exist from the first begin() on")
        return self.exp_avg, self.exp_avg_sq

    def _host_grads(self) -> torch.Tensor:
        """The host gradients in the CPU dtype (a mirror that is not lean has them)."""
        if self.cpu_grads is None:
            raise RuntimeError("a lean mirror's chunk needs its copies (it converts from them)")
        return self.cpu_grads

    def bind_state(self) -> None:
        """Make every parameter's ``exp_avg`` / ``exp_avg_sq`` views of the flat moments
        and its ``step`` a view of :attr:`steps`.

        A parameter without state gets zeros and ``step`` 0, as torch's first step gives; a
        parameter whose state holds other tensors (a loaded checkpoint) has them copied in.
        The state dict objects are kept (megatron-core shares them with its own ``state``).
        Parameters whose state still holds this object's views are skipped by identity.
        """
        if self.exp_avg is None:
            self.exp_avg = torch.zeros_like(self.host_params, dtype=self.moment_dtypes[0])
            self.exp_avg_sq = torch.zeros_like(self.host_params, dtype=self.moment_dtypes[1])
        for k, e in enumerate(self.entries):
            state = e.optimizer.state[e.param]
            bound = self._bound[k]
            if (
                bound is not None
                and state.get("exp_avg") is bound[0]
                and state.get("exp_avg_sq") is bound[1]
                and state.get("step") is bound[2]
            ):
                continue
            views = []
            for key, flat in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
                view = self._flat(flat, e.local).view(e.param.shape)
                held = state.get(key)
                if held is None:
                    if "step" not in state:
                        state["step"] = torch.zeros((), dtype=torch.float32)
                    view.zero_()
                elif held is not view:
                    view.copy_(held)
                state[key] = view
                views.append(view)
            step = state["step"]
            slot = self._step_views[k]
            if step is not slot:
                if isinstance(step, torch.Tensor):
                    slot.copy_(step)
                else:
                    slot.fill_(float(step))
                state["step"] = slot
            self._bound[k] = (*views, slot)

    def begin(self) -> None:
        """Before the chunks: state bound, the next step's counters computed (the
        counters themselves advance in :meth:`finish`), and the current hyperparameters
        read (an lr schedule changes them)."""
        self.bind_state()
        torch.add(self.steps, 1, out=self.next_steps)
        self._hyper = []
        for k in self._family_entry:
            e = self.entries[k]
            g = e.optimizer.param_groups[e.group]
            beta1, beta2 = g["betas"]
            self._hyper.append(
                (
                    float(g["lr"]),
                    float(beta1),
                    float(beta2),
                    float(g["weight_decay"]),
                    float(g["eps"]),
                )
            )
        self.updated = 0
        self.native_updates = 0
        if not self._native_resolved:
            self._native = self._resolve_kernel()
            self._native_resolved = True
        if self._native is not None:
            self._hyper_c = host_kernel.hyper_array(self._hyper)

    def _resolve_kernel(self) -> host_kernel.HostAdamW | None:
        if self.kernel == "torch":
            return None
        found = host_kernel.kernel()
        if found is None and self.kernel == "native":
            raise RuntimeError(
                "kernel='native': the offloaded step's compiled kernel is not available "
                f"({host_kernel.describe()}); use kernel='auto' to fall back to torch's ops"
            )
        return found

    @property
    def uses_native(self) -> bool | None:
        """Whether chunks are updated by the compiled kernel (None before the first
        :meth:`begin`). A chunk the kernel cannot take (fp16 gradients or parameters)
        still takes torch's ops."""
        return (self._native is not None) if self._native_resolved else None

    def finish(self) -> None:
        """After every chunk's update: the step counters advance."""
        self.steps.copy_(self.next_steps)

    def _plan(self, chunk: int, copies) -> tuple[_SubRange, ...]:
        """The views of chunk ``chunk``'s sub-ranges with ``copies``, built at its first
        update and kept (the moments exist from :meth:`begin` on)."""
        cached = self._plans.get(chunk)
        if cached is not None and cached[0] is copies:
            return cached[1]
        c0 = self.chunks[chunk].start
        convert = None if copies is None else copies.convert
        if convert is None and self.cpu_grads is None:
            raise RuntimeError("a lean mirror's chunk needs its copies (it converts from them)")
        islands = []
        if copies is not None:
            for stage, _, cpu, at in copies.islands:
                islands.append((Span(at, at + stage.numel()), stage, cpu))
        plan = []
        for sub, inside in self.subs[chunk]:
            pieces = []
            if convert is not None:
                grads, origin = self.scratch[: sub.numel], sub.start
                into = (grads, convert[1][sub.start - c0 : sub.end - c0])
            else:
                grads, origin, into = self._host_grads(), 0, None
            for span, stage, cpu in islands:
                a, b = max(sub.start, span.start), min(sub.end, span.end)
                if a < b and (convert is not None or cpu is not None):  # None: in place
                    dst = (
                        grads[a - sub.start : b - sub.start]
                        if convert is not None
                        else cpu[a - span.start : b - span.start]
                    )
                    pieces.append((dst, stage[a - span.start : b - span.start]))
            moments, read = [], []
            for flat, wide in zip(self._moments(), self.moment_scratch, strict=True):
                if wide is None:
                    read.append((flat, 0))
                else:
                    moments.append((wide[: sub.numel], self._flat(flat, sub)))
                    read.append((wide, sub.start))
            calls: dict[int, tuple[list, ...]] = {}
            for k, s in inside:
                lists = calls.setdefault(self._family[k], ([], [], [], [], []))
                lists[0].append(self._flat(self.host_params, s))
                lists[1].append(grads[s.start - origin : s.end - origin])
                for i, (t, at) in enumerate(read):
                    lists[2 + i].append(t[s.start - at : s.end - at])
                lists[4].append(self._next_views[k])
            pack = None
            if copies is not None and copies.pack is not None:
                dst, src = copies.pack
                pack = (dst[sub.start - c0 : sub.end - c0], src[sub.start - c0 : sub.end - c0])
            plan.append(
                _SubRange(
                    into,
                    tuple(pieces),
                    tuple((f, v[0], v[1], v[2], v[3], v[4]) for f, v in calls.items()),
                    pack,
                    tuple(moments),
                )
            )
        self._plans[chunk] = (copies, tuple(plan))
        return self._plans[chunk][1]

    def update(self, chunk: int, copies=None) -> None:
        """The AdamW update of chunk ``chunk`` (after :meth:`begin`).

        ``copies``: the chunk's :class:`~megatron_ext.offload.host_mirror.HostBlock`. With
        it, each sub-range's gradients are converted from its staging into the scratch (or
        read in place), its island pieces laid over them, and after the update its
        parameters packed into the staging. Without it, gradients are read from
        ``cpu_grads`` and nothing is packed.
        """
        if self._native is not None:
            rounds = self._native_plan(chunk, copies)
            if rounds is not None:
                for tasks in rounds:  # one call each: a round starts when the last ended
                    self._native.run(
                        tasks,
                        self._hyper_c,
                        self.next_steps,
                        self._moment_kinds,
                        torch.get_num_threads(),
                    )
                self.updated += 1
                self.native_updates += 1
                return
        hyper = self._hyper
        for sub in self._plan(chunk, copies):
            if sub.convert is not None:
                sub.convert[0].copy_(sub.convert[1])
            for dst, src in sub.islands:
                dst.copy_(src)
            for wide, narrow in sub.moments:
                wide.copy_(narrow)
            for family, p, g, m, v, steps in sub.calls:
                lr, beta1, beta2, wd, eps = hyper[family]
                # a fused call that raises does so in its argument checks, before writing
                torch._fused_adamw_(
                    p, g, m, v, [], steps, amsgrad=False, lr=lr, beta1=beta1, beta2=beta2,
                    weight_decay=wd, eps=eps, maximize=False, grad_scale=None, found_inf=None,
                )  # fmt: skip
                self.updated += 1
            for wide, narrow in sub.moments:
                narrow.copy_(wide)  # rounds to nearest even, as a GPU kernel storing bf16
            if sub.pack is not None:
                sub.pack[0].copy_(sub.pack[1])

    def _native_plan(self, chunk: int, copies):
        """Chunk ``chunk``'s tasks for the compiled kernel, in rounds (ctypes arrays, one
        kernel call each: :func:`~megatron_ext.offload.host_kernel.rounds`; built at its first
        update and kept; none for a chunk of padding only), or None where the kernel cannot
        take it: gradients, island stagings or packed parameters in a dtype other than
        bf16 / fp32, island gradients the torch path would also copy into the mirror's own
        gradients, or tasks no order of rounds keeps from packing over unread gradients."""
        cached = self._native_plans.get(chunk)
        if cached is not None and cached[0] is copies:
            return cached[1]
        tasks = self._build_native_plan(chunk, copies)
        self._native_plans[chunk] = (copies, tasks)
        return tasks

    def _build_native_plan(self, chunk: int, copies):
        c = self.chunks[chunk]
        c0 = c.start
        convert = None if copies is None else copies.convert
        if convert is not None:
            grads, origin = convert[1], c0
        elif self.cpu_grads is not None:
            grads, origin = self.cpu_grads, 0
        else:
            return None
        if grads.dtype not in host_kernel.KINDS:
            return None
        islands = []
        for stage, _, cpu, at in () if copies is None else copies.islands:
            if stage.dtype not in host_kernel.KINDS or (convert is None and cpu is not None):
                return None
            islands.append((Span(at, at + stage.numel()), stage))
        islands.sort(key=lambda i: i[0].start)
        out = None
        if copies is not None and copies.pack is not None:
            dst, src = copies.pack
            if dst.dtype not in host_kernel.KINDS or (
                src.numel() and src.data_ptr() != self.host_params[c0:].data_ptr()
            ):
                return None
            out = dst
        kernel = self._native
        if kernel is None or kernel.build is None:
            return None
        width = kernel.build.width
        exp_avg, exp_avg_sq = self._moments()
        tasks, covered = [], []
        for _, inside in self.subs[chunk]:
            for k, s in inside:
                e = self.entries[k]
                tail = e.local.end - e.local.numel % width  # mirror coordinates
                # an island's gradients come from its staging, the rest from ``grads``
                runs, pos = [], s.start
                for span, stage in islands:
                    a, b = max(s.start, span.start), min(s.end, span.end)
                    if a < b:
                        if pos < a:
                            runs.append((Span(pos, a), grads, origin))
                        runs.append((Span(a, b), stage, span.start))
                        pos = b
                if pos < s.end:
                    runs.append((Span(pos, s.end), grads, origin))
                for run, source, at in runs:
                    a, b = run.start, run.end
                    tasks += host_kernel.tasks_for(
                        self.host_params[a:b],
                        source[a - at : b - at],
                        exp_avg[a:b],
                        exp_avg_sq[a:b],
                        None if out is None else out[a - c0 : b - c0],
                        k,
                        self._family[k],
                        tail - a,
                    )
                covered.append(s)
        if out is not None:  # the gaps between parameters are packed as the torch path does
            pos = c.start
            for s in sorted(covered, key=lambda s: s.start) + [Span(c.end, c.end)]:
                if pos < s.start:
                    gap = Span(pos, s.start)
                    tasks.append(
                        host_kernel.pack_task(
                            self._flat(self.host_params, gap), out[pos - c0 : s.start - c0]
                        )
                    )
                pos = max(pos, s.end)
        # packed parameters may land on gradients other tasks of the chunk still read
        ordered = host_kernel.rounds(tasks)
        if ordered is None:
            return None
        return tuple((host_kernel.Task * len(r))(*r) for r in ordered)  # (): padding only
