"""CPU offload, memory as an input: what the offloaded part will hold on the host and the
GPU-resident part on the device, worked out from the buffers' layouts before anything is
built, and a refusal in one line where the host has less ([Note: offload memory]).

Plain data and pure functions, testable on the CPU: :func:`shard_buffers` reads each flat
buffer's share of this rank's shard from the model chunks' layouts, :func:`host_bytes` and
:func:`gpu_state_bytes` count bytes, :func:`host_available` reads what the host has,
:func:`check_host_memory` refuses, :func:`auto_offload_fraction` picks a fraction.

[Note: offload memory]
Per offloaded element of a buffer whose optimizer reads gradients of g bytes and sends
parameters of p bytes back (with host mirrors, :mod:`.host_mirror`):

- pinned staging: max(g, p); with the delayed update (``split_staging``) p more for the
  parameters going back; 4 per element of an fp32 island's gradients;
- host parameters: 4 (fp32); a host fp32 copy of the gradients: 4 where they arrive
  narrower and the step is the per-parameter one (the chunked step converts them into a
  scratch of at most ``compute_numel`` fp32 elements per buffer, one more per bf16 moment);
- Adam moments: the chunked step's flat moments, 4 or 2 bytes each (``exp_avg_dtype``,
  ``exp_avg_sq_dtype``), over the mirror's padding too; the per-parameter step's, 8;
- with ``offload_convert="device"``: staging 4 and host parameters 4, both pinned, nothing
  else but the moments and the scratch.

megatron-core's ``HybridDeviceOptimizer`` first makes its own CPU copy of every offloaded
parameter (4 bytes an element, fp32), which lives until the mirrors replace it: the build's
peak is those copies plus the mirrors; the step's (from the first step on) the mirrors, the
moments and the scratch. Without host mirrors megatron-core keeps those copies, a pinned
fp32 copy of each gradient and torch's fp32 moments: 16 bytes an element.

Which parameters megatron-core offloads at fraction f is its greedy rule over the param
groups: parameters in order until the offloaded count reaches f times the total. So at
least f of the elements and at most f plus the largest one parameter are offloaded, in
buffers that depend on the groups' order: the counts here take the worst case (the most
expensive buffers first), so they are upper bounds, exact at fraction 1 but for the padding
at the ends of the shard's runs.

The GPU side, per element this rank's optimizer holds: megatron-core's GPU optimizer under
the offload keeps fp32 moments (8) and, with the precision-aware optimizer, an fp32 copy
of each resident lower-precision parameter (4); without it, the distributed optimizer's
fp32 main parameters stay on the device for every element, offloaded or not (4).
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from buffers.spans import Span, intersect_spans

from .step import CUT_QUANTUM, DEFAULT_CHUNK_NUMEL, DEFAULT_COMPUTE_NUMEL

FP32 = torch.float32
GiB = 2**30
# how offloaded parameters are stepped: the chunked step or megatron-core's per-parameter
# one over host mirrors, or megatron-core's own copies (no host mirrors)
STEPS = ("chunked", "per_parameter", "megatron")
CONVERTS = ("host", "device")


class OffloadMemoryError(RuntimeError):
    """The offloaded optimizer would not fit in the memory there is (raised before
    anything is allocated)."""


@dataclass(frozen=True)
class ShardBuffer:
    """One flat buffer's part of this rank's optimizer shard, as the offload sees it.

    Attributes:
        name: the buffer, for messages.
        param_numel: elements of the parameters (their pieces) in the shard.
        padding_numel: elements between those pieces inside the shard's runs.
        largest_param: elements of the largest one piece.
        island_numel: of ``param_numel``, those whose gradients the optimizer reads in an
            fp32 island (an upper bound).
        model_dtype: the model's parameter dtype in this buffer.
        grads_dtype: what the optimizer's gradients are (what crosses to the host).
        params_dtype: what the updated parameters go back as.
        optimizer: which optimizer of the chain holds it (each applies the fraction to its
            own parameters): ``"dense"`` or ``"expert"``.
    """

    name: str
    param_numel: int
    padding_numel: int
    largest_param: int
    island_numel: int
    model_dtype: torch.dtype
    grads_dtype: torch.dtype
    params_dtype: torch.dtype
    optimizer: str = "dense"


@dataclass(frozen=True)
class OffloadSettings:
    """What decides the offload's bytes besides the buffers.

    Attributes:
        fraction: megatron-core's ``optimizer_offload_fraction``, in [0, 1].
        moment_dtypes: the host's Adam moments (``exp_avg``, ``exp_avg_sq``): fp32 or bf16
            with the chunked step; the other steps keep fp32.
        step: one of :data:`STEPS`.
        convert: with host mirrors, where gradients and parameters change dtype
            (:data:`CONVERTS`, ``MegatronOptions.offload_convert``).
        split_staging: the parameters go back from pinned bytes of their own (the delayed
            update).
        compute_numel: the chunked step's sub-range (its scratch).
        chunk_numel: the chunked step's chunk (the device's conversion temporaries with
            ``convert="device"``).
        precision_aware: megatron-core's ``use_precision_aware_optimizer``.
    """

    fraction: float
    moment_dtypes: tuple[torch.dtype, torch.dtype] = (FP32, FP32)
    step: str = "chunked"
    convert: str = "host"
    split_staging: bool = False
    compute_numel: int = DEFAULT_COMPUTE_NUMEL
    chunk_numel: int = DEFAULT_CHUNK_NUMEL
    precision_aware: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"fraction={self.fraction!r}; expected a number in [0, 1]")
        if self.step not in STEPS:
            raise ValueError(f"step={self.step!r}; expected one of {STEPS}")
        if self.convert not in CONVERTS:
            raise ValueError(f"convert={self.convert!r}; expected one of {CONVERTS}")
        for dtype in self.moment_dtypes:
            if dtype not in (FP32, torch.bfloat16):
                raise ValueError(f"moment dtype {dtype}; expected torch.float32 or torch.bfloat16")

    @property
    def moments_kept(self) -> tuple[torch.dtype, torch.dtype]:
        """The moments' dtypes on the host: as asked with the chunked step, else fp32."""
        return tuple(self.moment_dtypes) if self.step == "chunked" else (FP32, FP32)  # type: ignore[return-value]


@dataclass(frozen=True)
class HostBytes:
    """What the offloaded part holds on the host, in bytes.

    Attributes:
        parts: bytes of each kind of allocation (:data:`PARTS`) from the first step on.
        pinned: of them, page-locked.
        build: the peak while building: megatron-core's own CPU copies and the mirrors
            (below ``step`` with Adam, whose moments take at least the copies' 4 bytes).
        step: the peak from the first step on (the mirrors, the moments, the scratch).
        offloaded: elements of the parameters offloaded (the upper bound used).
    """

    parts: Mapping[str, int]
    pinned: int
    build: int
    step: int
    offloaded: int

    @property
    def needed(self) -> int:
        return max(self.build, self.step)


# the parts, in the order a message lists them
PARTS = (
    "host parameters",
    "Adam moments",
    "pinned staging",
    "host gradients",
    "scratch",
)


def _per_element(buf: ShardBuffer, s: OffloadSettings) -> dict[str, tuple[int, bool]]:
    """Bytes per offloaded element of ``buf`` by part: (bytes, pinned)."""
    g, p = buf.grads_dtype.itemsize, buf.params_dtype.itemsize
    moments = sum(d.itemsize for d in s.moments_kept)
    if s.step == "megatron":
        return {
            "host parameters": (4, False),
            "host gradients": (4, True),
            "Adam moments": (moments, False),
        }
    if s.convert == "device":
        return {
            "pinned staging": (4, True),
            "host parameters": (4, True),
            "Adam moments": (moments, False),
        }
    width = max(g, p)
    in_place = g == 4  # the staging holds the fp32 gradients the step reads (p <= 4)
    lean = s.step == "chunked"
    return {
        "pinned staging": (width + (p if s.split_staging else 0), True),
        "host parameters": (4, False),
        "host gradients": (0 if in_place or lean else 4, False),
        "Adam moments": (moments, False),
    }


def offloaded_numel(buffers: Sequence[ShardBuffer], fraction: float) -> int:
    """The most elements megatron-core's greedy rule offloads at ``fraction``: per optimizer
    of the chain, f of its elements rounded up plus its largest parameter, at most all."""
    if fraction <= 0:
        return 0
    out = 0
    for name in dict.fromkeys(b.optimizer for b in buffers):
        mine = [b for b in buffers if b.optimizer == name]
        total = sum(b.param_numel for b in mine)
        out += min(total, math.ceil(fraction * total) + max(b.largest_param for b in mine))
    return out


def _worst(buffers: Sequence[ShardBuffer], count: int, cost) -> list[int]:
    """``count`` elements placed in ``buffers`` (at most each one's ``param_numel``) where
    they cost most: per buffer, how many."""
    out = [0] * len(buffers)
    for i in sorted(range(len(buffers)), key=lambda i: -cost(buffers[i])):
        out[i] = min(buffers[i].param_numel, count)
        count -= out[i]
    return out


def host_bytes(buffers: Sequence[ShardBuffer], settings: OffloadSettings) -> HostBytes:
    """The host memory the offloaded part needs ([Note: offload memory]), an upper bound.

    Args:
        buffers: this rank's shard, per flat buffer (:func:`shard_buffers`).
        settings: the fraction, moment dtypes and how the step runs.

    Returns:
        The bytes, by part and at both peaks.
    """
    count = offloaded_numel(buffers, settings.fraction)
    if count == 0:
        return HostBytes(dict.fromkeys(PARTS, 0), 0, 0, 0, 0)

    def mirror_cost(b):
        return sum(n for n, _ in _per_element(b, settings).values())

    placed = _worst(buffers, count, mirror_cost)
    mirror: dict[str, int] = dict.fromkeys(PARTS, 0)
    pinned = 0
    for b, q in zip(buffers, placed, strict=True):
        if q == 0:
            continue
        # a mirror holds the padding between its parameters too (not in megatron's copies)
        n = q if settings.step == "megatron" else q + b.padding_numel
        for part, (size, locked) in _per_element(b, settings).items():
            # only the chunked step's flat moments cover the padding: torch's are per parameter
            over = q if part == "Adam moments" and settings.step != "chunked" else n
            mirror[part] += over * size
            pinned += over * size * locked
        if settings.step != "megatron" and settings.convert == "host":
            island = 4 * min(b.island_numel, q)
            mirror["pinned staging"] += island
            pinned += island
        if settings.step == "chunked":
            widened = 1 + sum(d != FP32 for d in settings.moments_kept)
            # the longest sub-range: at most a chunk, a sub-range or the mirror long
            longest = min(
                n,
                max(settings.compute_numel, CUT_QUANTUM),
                max(settings.chunk_numel, CUT_QUANTUM),
            )
            mirror["scratch"] += 4 * longest * widened
    if settings.step == "megatron":
        return HostBytes(mirror, pinned, sum(mirror.values()), sum(mirror.values()), count)
    # megatron-core's CPU copies (4 bytes an element) live beside the mirrors while they are
    # built; the moments and the scratch come at the first step, once the copies are gone
    allocated = sum(v for k, v in mirror.items() if k not in ("Adam moments", "scratch"))
    return HostBytes(mirror, pinned, allocated + 4 * count, sum(mirror.values()), count)


def _gpu_costs(b: ShardBuffer, s: OffloadSettings) -> tuple[int, int]:
    """(bytes per resident element, bytes per element either way) on the GPU."""
    narrow = b.model_dtype != FP32
    if s.precision_aware:
        return (4 if narrow else 0) + 8, 0
    return 8, 4 if narrow else 0


def gpu_state_bytes(buffers: Sequence[ShardBuffer], settings: OffloadSettings) -> int:
    """The optimizer state the GPU holds at ``settings.fraction`` ([Note: offload memory]),
    an upper bound: its resident elements (at most 1 - f of each optimizer's, placed where
    they cost most), the fp32 main parameters every element keeps without the precision-aware
    optimizer, and with ``convert="device"`` two chunks' fp32 conversion temporaries."""
    resident = 0
    for name in dict.fromkeys(b.optimizer for b in buffers):
        total = sum(b.param_numel for b in buffers if b.optimizer == name)
        resident += total - math.ceil(settings.fraction * total)
    placed = _worst(buffers, resident, lambda b: _gpu_costs(b, settings)[0])
    out = 0
    for b, r in zip(buffers, placed, strict=True):
        per_resident, per_element = _gpu_costs(b, settings)
        out += r * per_resident + b.param_numel * per_element
    if settings.fraction > 0 and settings.convert == "device" and settings.step != "megatron":
        out += 2 * 4 * settings.chunk_numel
    return out


# the grid auto_offload_fraction picks from (megatron-core's fraction is a float)
FRACTION_STEP = 0.01


def auto_offload_fraction(
    buffers: Sequence[ShardBuffer], settings: OffloadSettings, gpu_budget: int
) -> float:
    """The smallest fraction (a multiple of :data:`FRACTION_STEP`) whose GPU-resident
    optimizer state fits in ``gpu_budget`` bytes (:func:`gpu_state_bytes`).

    Args:
        buffers: this rank's shard, per flat buffer.
        settings: how the offload runs (its ``fraction`` is ignored).
        gpu_budget: the device memory the optimizer state may take: what is free once the
            model and its gradient buffers are built, less the activations' headroom.

    Raises:
        OffloadMemoryError: not even fraction 1 fits.
    """
    steps = round(1 / FRACTION_STEP)
    for k in range(steps + 1):
        fraction = k / steps
        if gpu_state_bytes(buffers, replace(settings, fraction=fraction)) <= gpu_budget:
            return fraction
    need = gpu_state_bytes(buffers, replace(settings, fraction=1.0))
    raise OffloadMemoryError(
        f"megatron_ext: offload_fraction='auto' finds no fraction that fits: even at 1.0 the "
        f"optimizer state left on the GPU takes {_gib(need)} GiB, over the "
        f"{_gib(max(gpu_budget, 0))} GiB left for it after the model, its gradients and the "
        "activations' headroom; lower the headroom, use the precision-aware optimizer "
        "(use_precision_aware_optimizer=True: no fp32 main parameters left on the GPU), or "
        "shard the model over more GPUs"
    )


@dataclass(frozen=True)
class HostMemory:
    """What this rank may use on the host.

    Attributes:
        available: bytes (the host's share for this rank).
        source: where it was read, for messages.
    """

    available: int
    source: str


def _meminfo_available(proc: Path) -> int | None:
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _cgroup_headroom(proc: Path, cgroup_root: Path) -> tuple[int, str] | None:
    """The tightest limit less usage over this process's cgroup and its ancestors (v2:
    ``memory.max`` less ``memory.current`` plus the reclaimable ``inactive_file``; v1:
    ``memory.limit_in_bytes`` less ``memory.usage_in_bytes``)."""
    best: tuple[int, str] | None = None
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        v2 = controllers == ""
        if not (v2 or "memory" in controllers.split(",")):
            continue
        base = cgroup_root if v2 else cgroup_root / "memory"
        here = base / rel.lstrip("/")
        for d in (here, *here.parents):
            if not d.is_relative_to(base):
                break
            if v2:
                limit, used = _read_int(d / "memory.max"), _read_int(d / "memory.current")
                if used is not None:
                    used -= _inactive_file(d / "memory.stat")
            else:
                limit = _read_int(d / "memory.limit_in_bytes")
                used = _read_int(d / "memory.usage_in_bytes")
            if limit is None or used is None:  # v2's "max": no limit (v1's is huge)
                continue
            left = max(limit - used, 0)
            if best is None or left < best[0]:
                best = (left, f"cgroup limit {_gib(limit)} GiB at {d}")
    return best


def _inactive_file(stat: Path) -> int:
    try:
        for line in stat.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "inactive_file":
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def host_available(
    *,
    ranks: int | None = None,
    proc: str | Path = "/proc",
    cgroup_root: str | Path = "/sys/fs/cgroup",
) -> HostMemory:
    """This rank's share of the host memory available now: the smaller of ``MemAvailable``
    and any cgroup limit less its usage, divided among the ``ranks`` on this host (default:
    ``LOCAL_WORLD_SIZE``, as torchrun sets it, else 1), which build their optimizers at once.

    Raises:
        OffloadMemoryError: neither /proc/meminfo nor a cgroup limit can be read (set
            ``MegatronOptions(offload_host_bytes=...)`` instead).
    """
    if ranks is None:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if ranks < 1:
        raise ValueError(f"ranks={ranks!r}; expected the ranks on this host, at least 1")
    proc, cgroup_root = Path(proc), Path(cgroup_root)
    found = []
    meminfo = _meminfo_available(proc)
    if meminfo is not None:
        found.append((meminfo, f"MemAvailable {_gib(meminfo)} GiB"))
    limited = _cgroup_headroom(proc, cgroup_root)
    if limited is not None:
        found.append(limited)
    if not found:
        raise OffloadMemoryError(
            f"megatron_ext: cannot tell the host memory available ({proc / 'meminfo'} has no "
            "MemAvailable and no cgroup limit is readable); pass "
            "MegatronOptions(offload_host_bytes=...) with what this rank may use"
        )
    available, source = min(found)
    if ranks > 1:
        source += f" shared by {ranks} ranks on this host"
    return HostMemory(available // ranks, source)


def _gib(n: int) -> str:
    return f"{n / GiB:.1f}"


def check_host_memory(
    buffers: Sequence[ShardBuffer],
    settings: OffloadSettings,
    memory: HostMemory,
) -> HostBytes:
    """:func:`host_bytes`, or :class:`OffloadMemoryError` in one line where it exceeds
    ``memory``: needed against available, and what would fit (a lower fraction, bf16 moments).

    Returns:
        The bytes (within ``memory``).
    """
    need = host_bytes(buffers, settings)
    if need.needed <= memory.available:
        return need
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in need.parts.items() if v)
    peak = "the build" if need.build > need.step else "the first step"
    changes = []
    fitting = _largest_fitting_fraction(buffers, settings, memory.available)
    changes.append(f"lower optimizer_offload_fraction to {fitting:.2f} or less")
    if settings.moments_kept != (torch.bfloat16, torch.bfloat16):
        narrow = replace(settings, moment_dtypes=(torch.bfloat16, torch.bfloat16), step="chunked")
        narrow_need = host_bytes(buffers, narrow).needed
        how = "exp_avg_dtype=exp_avg_sq_dtype=torch.bfloat16 with use_precision_aware_optimizer"
        if settings.step != "chunked":
            how += " and the chunked step (host_mirrors=True, offload_step='chunked')"
        changes.append(f"keep the Adam moments in bf16 ({how}: {_gib(narrow_need)} GiB)")
    raise OffloadMemoryError(
        f"megatron_ext: the CPU-offloaded optimizer needs {_gib(need.needed)} GiB of host "
        f"memory on this rank at optimizer_offload_fraction={settings.fraction:g} ({parts} "
        f"GiB; peak at {peak}), but {_gib(memory.available)} GiB is available "
        f"({memory.source}); {', or '.join(changes)}; or pass "
        "MegatronOptions(offload_host_bytes=...) if this rank may use more"
    )


def _largest_fitting_fraction(
    buffers: Sequence[ShardBuffer], settings: OffloadSettings, available: int
) -> float:
    """The largest multiple of :data:`FRACTION_STEP` whose host bytes fit ``available``
    (0 always does: nothing offloaded)."""
    steps = round(1 / FRACTION_STEP)
    lo, hi = 0, steps  # host bytes grow with the fraction: bisect on the grid
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if host_bytes(buffers, replace(settings, fraction=mid / steps)).needed <= available:
            lo = mid
        else:
            hi = mid - 1
    return lo / steps


def shard_buffers(model_chunks: Iterable, *, precision_aware: bool, distributed: bool = True):
    """Each flat buffer's part of this rank's optimizer shard (:class:`ShardBuffer`), from
    the model chunks' layouts (:class:`megatron_ext.layout.ChunkLayout`), before the
    optimizer is built.

    Args:
        model_chunks: :class:`megatron_ext.DistributedDataParallel` modules.
        precision_aware: megatron-core's ``use_precision_aware_optimizer`` (the optimizer
            reads the buffer's gradients and writes the model's parameters; otherwise fp32
            main gradients and parameters).
        distributed: ``use_distributed_optimizer`` (each rank holds its shard of every
            bucket); otherwise each rank holds every parameter.
    """
    out: list[ShardBuffer] = []
    for chunk in model_chunks:
        for layout in chunk.layout.buffers:
            runs = layout.shard if distributed else (Span(0, layout.numel),)
            pieces = [
                piece
                for r in layout.records
                if r.end > r.start
                for piece in intersect_spans([r.span], runs)
            ]
            hull = 0
            for run in runs:
                inside = [p for p in pieces if run.start <= p.start and p.end <= run.end]
                if inside:
                    hull += max(p.end for p in inside) - min(p.start for p in inside)
            params = sum(p.numel for p in pieces)
            key = layout.key
            out.append(
                ShardBuffer(
                    name=key.describe(),
                    param_numel=params,
                    padding_numel=hull - params,
                    largest_param=max((p.numel for p in pieces), default=0),
                    island_numel=min(layout.island_numel, params),
                    model_dtype=key.param_dtype,
                    grads_dtype=key.grad_dtype if precision_aware else FP32,
                    params_dtype=key.param_dtype if precision_aware else FP32,
                    optimizer="expert" if key.is_expert else "dense",
                )
            )
    return out


def gpu_free_bytes() -> int | None:
    """The current CUDA device's free memory (``torch.cuda.mem_get_info``), or None without
    one."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.mem_get_info()[0])


def settings_for(config, options) -> OffloadSettings:
    """The :class:`OffloadSettings` of megatron-core's ``OptimizerConfig`` and
    :class:`megatron_ext.MegatronOptions` (the fraction as the config has it)."""
    from .moment_dtypes import offload_moment_dtypes

    distributed = bool(getattr(config, "use_distributed_optimizer", False))
    # host mirrors are given to distributed optimizers only (attach_host_mirrors)
    step = options.offload_step if options.host_mirrors and distributed else "megatron"
    with warnings.catch_warnings():  # attach_host_mirrors warns about the same, later
        warnings.simplefilter("ignore")
        moments = offload_moment_dtypes(config, step == "chunked")
    return OffloadSettings(
        fraction=float(config.optimizer_offload_fraction),
        moment_dtypes=moments,
        step=step,
        convert=options.offload_convert,
        split_staging=bool(options.offload_delayed_update),
        chunk_numel=int(options.offload_chunk_numel),
        precision_aware=bool(getattr(config, "use_precision_aware_optimizer", False)),
    )


def check_before_build(config, model_chunks, options):
    """Before megatron-core builds a CPU-offloaded optimizer: the fraction chosen where
    ``options.offload_fraction`` is ``"auto"`` (:func:`auto_offload_fraction` over the
    GPU's free memory less ``options.offload_gpu_headroom``), the GPU-resident state checked
    against the GPU's free memory, and the host's bytes against ``options.offload_host_bytes``
    or :func:`host_available`: :class:`OffloadMemoryError` in one line where either does not
    fit, before anything is allocated.

    Returns:
        ``config``, or a shallow copy of it with the fraction chosen.
    """
    settings = settings_for(config, options)
    buffers = shard_buffers(
        model_chunks,
        precision_aware=settings.precision_aware,
        distributed=bool(getattr(config, "use_distributed_optimizer", False)),
    )
    free = gpu_free_bytes()
    if options.offload_fraction == "auto":
        if free is None:
            raise OffloadMemoryError(
                "megatron_ext: offload_fraction='auto' reads the GPU's free memory, and torch "
                "sees no CUDA device; set OptimizerConfig.optimizer_offload_fraction instead"
            )
        fraction = auto_offload_fraction(buffers, settings, free - options.offload_gpu_headroom)
        settings = replace(settings, fraction=fraction)
        config = copy.copy(config)
        config.optimizer_offload_fraction = fraction
    elif free is not None:
        need = gpu_state_bytes(buffers, settings)
        if need > free:
            raise OffloadMemoryError(
                f"megatron_ext: the optimizer state left on the GPU at "
                f"optimizer_offload_fraction={settings.fraction:g} needs {_gib(need)} GiB, "
                f"but {_gib(free)} GiB is free after the model and its gradients; raise the "
                f"fraction to {auto_offload_fraction(buffers, settings, free):.2f} or more "
                "(before the activations' share), or use "
                "MegatronOptions(offload_fraction='auto', offload_gpu_headroom=...)"
            )
    memory = (
        host_available()
        if options.offload_host_bytes is None
        else HostMemory(options.offload_host_bytes, "MegatronOptions.offload_host_bytes")
    )
    check_host_memory(buffers, settings, memory)
    return config
