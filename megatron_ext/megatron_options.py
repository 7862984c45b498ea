"""The Megatron side's options: the buffers' switches plus how CPU offload moves data."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from buffers.options import BufferOptions

# exact steps before the delayed update starts (MegatronOptions and megatron_ext.train's flag)
DEFAULT_DELAY_WARMUP = 10


@dataclass(frozen=True)
class MegatronOptions(BufferOptions):
    """:class:`buffers.options.BufferOptions` plus the offload path.

    Attributes:
        host_mirrors: with CPU offload (``optimizer_cpu_offload=True``), move gradients and
            parameters through one pinned host mirror per flat buffer
            (:mod:`megatron_ext.offload.hybrid`); False keeps megatron-core's per-parameter copies.
        offload_step: with host mirrors, how the CPU updates its parameters:
            ``"per_parameter"`` (megatron-core's per-parameter ``AdamW(fused=True)``
            optimizers, one after another, after the whole block has arrived) or
            ``"chunked"`` (:mod:`megatron_ext.offload.step`: the same fused kernel over
            chunks of the mirror, each chunk's copies overlapping other chunks' updates; bit
            for bit the same results; the default with host mirrors, and the only step
            without them is ``"per_parameter"``).
        offload_chunk_numel: with ``"chunked"``, about how many elements one chunk holds.
        offload_threads: torch's intra-op threads the offloaded optimizer's CPU update runs
            on. An int fixes them (about the host's cores divided by the ranks on it). None:
            with ``offload_delayed_update``, adapted as updates land
            (:class:`megatron_ext.offload.threads.ThreadTuner`): from every core of this
            rank's but one (the usable cores, divided among the ``LOCAL_WORLD_SIZE`` ranks
            on the host unless the launcher pinned each rank, and among the offloading
            optimizers of a chain, whose updates run at once), the fewest threads (at least
            a quarter of those cores) with which the host update still ends before the next
            step needs it; otherwise torch's setting (``OMP_NUM_THREADS``, which
            ``torchrun`` sets to 1 unless told otherwise).
        offload_convert: with host mirrors, where bf16 gradients become fp32 and fp32
            parameters bf16: ``"host"`` (the CPU converts; half the bus bytes and pinned
            memory of a bf16 buffer) or ``"device"`` (the GPU converts, fp32 crosses both
            ways, and the CPU only runs the optimizer: no conversion or packing pass; the
            same bits, since bf16 to fp32 is exact and both sides round fp32 to bf16 to
            nearest even). ``"device"`` needs ``offload_step="chunked"`` (the GPU converts
            into an fp32 temporary per chunk copy).
        offload_delayed_update: with ``"chunked"``, the host update of step t runs on a
            worker thread beside the forward and backward of step t+1, which read the
            host-updated parameters as step t-1 left them (ZeRO-Offload's one-step delayed
            update; norm, clip and skip stay step t's own). GPU-resident parameters
            (offload fraction below 1) are not delayed. A checkpoint save lands the update
            in flight; call :func:`megatron_ext.drain_offload` before reading parameters
            outside the loop. [Note: the delayed offloaded update] in
            :mod:`megatron_ext.offload.chunked` says exactly what runs when.
        offload_delay_warmup: with ``offload_delayed_update``, how many steps (by the
            optimizer's step count, so not again after a resume) run exact first.
        offload_pin_threads: with ``offload_delayed_update``, pin the host update's worker
            and its helper threads to this rank's cores but one (Linux; the rank's cores as
            ``offload_threads`` counts them, in order), so the Python thread that launches
            the GPU's forward and backward always finds the first of them free; that thread
            itself is not pinned (nor what it starts, data-loader processes included). No
            result changes.
        offload_overlap_forward: with ``"chunked"`` and the precision-aware optimizer, the
            exact step returns once its host update has started on a worker thread, which
            updates the chunks in the order the next forward pass reads them and sends each
            back when done; each module's forward waits for the chunks holding its own
            parameters, so the first layers' forward runs beside the last ones' update. The
            same bits as the exact step. Parameters are read elsewhere only after the next
            step or :func:`megatron_ext.drain_offload`. Not with ``offload_delayed_update``.
            [Note: the overlapped exact step] in :mod:`megatron_ext.offload.forward_waits`.
        offload_fraction: ``"auto"``: with CPU offload, the smallest
            ``optimizer_offload_fraction`` (in steps of 0.01) whose GPU-resident optimizer
            state fits in the GPU memory free once the model and its gradient buffers are
            built, less ``offload_gpu_headroom``; it replaces the config's fraction (the
            optimizer's ``config`` says which). None: the config's fraction.
        offload_gpu_headroom: with ``offload_fraction="auto"``, bytes of GPU memory kept for
            activations and everything else the step allocates (measure a step's peak).
        offload_host_bytes: with CPU offload, the host memory this rank's offloaded optimizer
            may take, in bytes; None reads what the host has (``MemAvailable`` and cgroup
            limits, divided among the ``LOCAL_WORLD_SIZE`` ranks on it). Where what it needs
            is more, building refuses in one line before allocating anything
            ([Note: offload memory] in :mod:`megatron_ext.offload.host_memory`).
    """

    host_mirrors: bool = True
    offload_step: str | None = None  # None: "chunked" with host mirrors, else "per_parameter"
    offload_chunk_numel: int = 4 * 2**20
    offload_threads: int | None = None
    offload_convert: str = "host"
    offload_delayed_update: bool = False
    offload_delay_warmup: int = DEFAULT_DELAY_WARMUP
    offload_pin_threads: bool = False
    offload_overlap_forward: bool = False
    offload_fraction: str | None = None
    offload_gpu_headroom: int | None = None
    offload_host_bytes: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.offload_step is None:  # the default for the copies in use
            step = "chunked" if self.host_mirrors else "per_parameter"
            object.__setattr__(self, "offload_step", step)
        if self.offload_step not in OFFLOAD_STEPS:
            raise ValueError(f"offload_step={self.offload_step!r}; expected one of {OFFLOAD_STEPS}")
        if self.offload_step == "chunked" and not self.host_mirrors:
            raise ValueError(
                "offload_step='chunked' runs over host mirrors; leave host_mirrors=True or use "
                "offload_step='per_parameter'"
            )
        if self.offload_convert not in OFFLOAD_CONVERTS:
            raise ValueError(
                f"offload_convert={self.offload_convert!r}; expected one of {OFFLOAD_CONVERTS}"
            )
        warmup = self.offload_delay_warmup
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
            raise ValueError(
                f"offload_delay_warmup={warmup!r}; expected an int >= 0 (exact steps before "
                "the delayed update starts)"
            )
        threads = self.offload_threads
        if threads is not None and (
            not isinstance(threads, int) or isinstance(threads, bool) or threads <= 0
        ):
            raise ValueError(
                f"offload_threads={threads!r}; expected None (torch's setting) or a positive "
                "int (threads for the CPU optimizer step)"
            )
        conflict = offload_conflict(vars(self), python_spelling)
        if conflict is not None:
            raise ValueError(conflict)
        if self.offload_fraction not in (None, "auto"):
            raise ValueError(
                f"offload_fraction={self.offload_fraction!r}; expected 'auto' or None (a number "
                "goes in OptimizerConfig.optimizer_offload_fraction)"
            )
        for name in ("offload_gpu_headroom", "offload_host_bytes"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 0
            ):
                raise ValueError(f"{name}={value!r}; expected None or a number of bytes >= 0")
        numel = self.offload_chunk_numel
        if not isinstance(numel, int) or isinstance(numel, bool) or numel <= 0:
            raise ValueError(
                f"offload_chunk_numel={self.offload_chunk_numel!r}; expected a positive int "
                "(elements per chunk, e.g. 4 * 2**20)"
            )

    def offload_only(self) -> list[str]:
        """The options set away from their defaults that only CPU offload reads (each as
        ``name=value``): without ``optimizer_cpu_offload`` they would do nothing."""
        return [
            python_spelling(f.name, getattr(self, f.name))
            for f in fields(self)
            if f.name in OFFLOAD_ONLY and getattr(self, f.name) != f.default
        ]


# the options only CPU offload reads (offload_step: its default depends on host_mirrors)
OFFLOAD_ONLY = (
    "offload_chunk_numel",
    "offload_threads",
    "offload_convert",
    "offload_delayed_update",
    "offload_delay_warmup",
    "offload_pin_threads",
    "offload_overlap_forward",
    "offload_fraction",
    "offload_gpu_headroom",
    "offload_host_bytes",
)


def python_spelling(name: str, value: Any) -> str:
    """An option as a :class:`MegatronOptions` argument: ``offload_step='chunked'``."""
    return f"{name}={value!r}"


def flag_spelling(name: str, value: Any) -> str:
    """An option as ``megatron_ext.train``'s flag: ``--offload-step chunked``, or the flag
    alone for a switch that is on."""
    flag = "--" + name.replace("_", "-")
    return flag if value is True else f"{flag} {value}"


def offload_conflict(values: Mapping[str, Any], spell: Callable[[str, Any], str]) -> str | None:
    """Why the offload options in ``values`` (by :class:`MegatronOptions` field name, with
    ``offload_step`` resolved) cannot go together, each option written by ``spell``; None
    when they can. The one statement of these rules, for the options and for the flags."""
    step = values["offload_step"]
    delayed, overlap = values["offload_delayed_update"], values["offload_overlap_forward"]

    def say(name: str, value: Any = True) -> str:
        return spell(name, value)

    if values["offload_convert"] == "device" and step != "chunked":
        # the GPU converts into a temporary the size of each copy: a chunk, or with the
        # per-parameter step a whole block (up to the shard)
        return (
            f"{say('offload_convert', 'device')} needs {say('offload_step', 'chunked')} (the "
            "GPU converts into fp32 temporaries the size of each copy, which are whole blocks "
            f"in the per-parameter step); add {say('offload_step', 'chunked')} or use "
            f"{say('offload_convert', 'host')}"
        )
    for name, on in (("offload_delayed_update", delayed), ("offload_overlap_forward", overlap)):
        if on and step != "chunked":
            return (
                f"{say(name)} runs the chunked step, not {say('offload_step', step)}; use "
                f"{say('offload_step', 'chunked')} (the default) or drop {say(name)}"
            )
    if values["offload_pin_threads"] and not delayed:
        return (
            f"{say('offload_pin_threads')} pins the delayed update's worker threads; add "
            f"{say('offload_delayed_update')} or drop {say('offload_pin_threads')}"
        )
    headroom = values["offload_gpu_headroom"]
    if (values["offload_fraction"] == "auto") != (headroom is not None):
        given = (
            say("offload_fraction", "auto")
            if headroom is None
            else say("offload_gpu_headroom", headroom)
        )
        headroom_name = say("offload_gpu_headroom").removesuffix("=True")
        return (
            f"{given}: {say('offload_fraction', 'auto')} and {headroom_name} (bytes of GPU "
            "memory kept for activations) go together; give both or neither"
        )
    if overlap and delayed:
        return (
            f"{say('offload_overlap_forward')} and {say('offload_delayed_update')} are two ways "
            "of running the host update beside the GPU (exact, or one step late); choose one"
        )
    return None


OFFLOAD_STEPS = ("per_parameter", "chunked")
OFFLOAD_CONVERTS = ("host", "device")
