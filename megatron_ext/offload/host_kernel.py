"""The offloaded step's compiled kernel: AdamW over a chunk of a host mirror in one pass.

:class:`~megatron_ext.offload.step.ChunkedAdamW` otherwise runs, per cache-sized sub-range,
a conversion of the bf16 gradients into an fp32 scratch, torch's fused AdamW call and a
rounding of the new parameters into the staging: three passes, about 40 bytes of memory
traffic per element where the fused-AdamW floor moves 28. ``host_adamw.c`` does all three
per element in one pass (28 bytes; 20 with bf16 moments), with torch's arithmetic, on the
widest vector path the CPU has (AVX-512, AVX2 or portable C: the same bits on each;
``BUFFERS_HOST_ADAMW_ISA=avx2`` or ``portable`` narrows it, for comparing them).

Equal bit for bit to the torch path, or not used: torch's kernel is C++ compiled by
whoever built torch, and two of its roundings (whether ``v * beta2 + c2 * g * g`` became a
fused multiply-add, in its vector body and in the scalar code that finishes each tensor's
last elements) and its vector width depend on that build. The first use in a process
compares every candidate with ``torch._fused_adamw_`` on random data (sizes with odd tails,
both lerp branches, with and without weight decay, early and late steps, bf16 rounding of
the result) and keeps the one that matches everywhere; if none does, the torch path runs
and one :class:`HostAdamWWarning` says so.

Built like the CPU norm's kernel (:mod:`buffers.native`: the system's C compiler, a cache
directory, ctypes); ``BUFFERS_CPU_KERNEL=off`` turns both off. Without a compiler the
torch path runs, and one :class:`HostAdamWWarning` says so.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from buffers import native as _native

SOURCE = Path(__file__).with_name("host_adamw.c")
KINDS = {torch.bfloat16: 0, torch.float32: 2}
FLAGS = ("-ffp-contract=off", "-pthread")
LIBS = ("-lm",)
# the vector widths torch's fused CPU kernel is built with (AVX2 and NEON: 8 floats;
# AVX512: 16); which one applies here is part of the probe
WIDTHS = (8, 16)
# candidate builds of torch's arithmetic (host_adamw.c's variant bits): the vector body's
# second moment (3 ways), the tail's (3 ways, bits 2-3), the tail's lerp fused or not (16)
VARIANTS = tuple(
    vec | (tail << 2) | lerp for vec in range(3) for tail in range(3) for lerp in (0, 16)
)
# elements per task handed to a thread; a multiple of the step's cut quantum
TASK_NUMEL = 1 << 16


# the kernel's vector paths, by the level host_adamw.c's adamw_host_vectorized reports: the
# widest this CPU runs is used, unless BUFFERS_HOST_ADAMW_ISA names a narrower one
ISAS = ("portable", "AVX2", "AVX-512")


def isa_cap() -> int:
    """The widest vector path ``BUFFERS_HOST_ADAMW_ISA`` allows (``avx512``, the default:
    any; ``avx2``; ``portable``): the same bits on each, for comparing their speed."""
    value = os.environ.get("BUFFERS_HOST_ADAMW_ISA", "avx512").strip().lower() or "avx512"
    names = {"portable": 0, "avx2": 1, "avx512": 2}
    if value not in names:
        raise ValueError(
            f"BUFFERS_HOST_ADAMW_ISA={value!r}; expected one of {', '.join(names)} (the "
            "widest vector path the offloaded step's kernel may use)"
        )
    return names[value]


def streaming() -> bool:
    """Whether the AVX-512 path writes the packed parameters with non-temporal stores:
    ``BUFFERS_HOST_ADAMW_STREAM`` ``1`` (the default) or ``0`` (plain stores; the same bits,
    for comparing their speed)."""
    value = os.environ.get("BUFFERS_HOST_ADAMW_STREAM", "1").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(
            f"BUFFERS_HOST_ADAMW_STREAM={value!r}; expected 1 (non-temporal stores of the "
            "packed parameters on the AVX-512 path) or 0 (plain stores)"
        )
    return value == "1"


class HostAdamWWarning(UserWarning):
    """The offloaded step's compiled kernel is not used (torch's ops run instead)."""


class Task(ctypes.Structure):
    """One run of one parameter (``adamw_task`` in host_adamw.c). ``family`` -1: only
    write the parameters into ``out`` (a gap between parameters), no update."""

    _fields_ = [
        ("n", ctypes.c_int64),
        ("vec_n", ctypes.c_int64),
        ("param", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("exp_avg", ctypes.c_void_p),
        ("exp_avg_sq", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("grad_kind", ctypes.c_int32),
        ("entry", ctypes.c_int32),
        ("family", ctypes.c_int32),
        ("out_kind", ctypes.c_int32),
    ]


@dataclass(frozen=True)
class Build:
    """How torch's kernel computes in this process: the variant and vector width that
    matched it, and the kernel's vector path (:data:`ISAS`: 0 portable, 1 AVX2, 2 AVX-512)."""

    variant: int
    width: int
    vectorized: int


class HostAdamW:
    """The loaded kernel."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        self.path = path
        if lib.adamw_host_task_size() != ctypes.sizeof(Task):
            raise RuntimeError("host_adamw.c's task layout disagrees with host_kernel.py's")
        self._step = lib.adamw_host_step
        self._step.restype = None
        self._step.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
        ]
        self.vectorized = min(int(lib.adamw_host_vectorized()), isa_cap())
        self.stream = streaming()
        self.build: Build | None = None  # set by the probe

    def run(
        self,
        tasks,
        hyper,
        steps: torch.Tensor,
        moment_kinds: tuple[int, int],
        threads: int,
        variant: int | None = None,
        vectorized: int | None = None,
        stream: bool | None = None,
    ) -> None:
        """Update every task (a ``Task`` array); ``hyper``: a ``c_double`` array, 5 per
        family (lr, beta1, beta2, weight_decay, eps); ``steps``: fp32, the step count each
        entry's constants use."""
        if variant is None:  # the probe passes its candidates; every other call the build's
            if self.build is None:
                raise RuntimeError("the offloaded step's kernel runs once its probe chose a build")
            variant = self.build.variant
        self._step(
            ctypes.addressof(tasks),
            len(tasks),
            ctypes.addressof(hyper),
            steps.data_ptr(),
            moment_kinds[0],
            moment_kinds[1],
            variant,
            int(self.vectorized if vectorized is None else vectorized),
            max(1, int(threads)),
            int(self.stream if stream is None else stream),
        )


def tasks_for(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    out: torch.Tensor | None,
    entry: int,
    family: int,
    tail_from: int,
    task_numel: int = TASK_NUMEL,
) -> list[Task]:
    """The tasks of one run of one parameter (flat, contiguous views of equal length):
    elements from ``tail_from`` on (relative to the run) take torch's tail formula."""
    n = param.numel()
    es = [t.element_size() for t in (param, grad, exp_avg, exp_avg_sq)]
    out_es = 0 if out is None else out.element_size()
    out_ptr = 0 if out is None else out.data_ptr()
    result = []
    for a in range(0, n, task_numel):
        b = min(n, a + task_numel)
        result.append(
            Task(
                b - a,
                min(max(tail_from - a, 0), b - a),
                param.data_ptr() + a * es[0],
                grad.data_ptr() + a * es[1],
                exp_avg.data_ptr() + a * es[2],
                exp_avg_sq.data_ptr() + a * es[3],
                out_ptr + a * out_es if out is not None else None,
                KINDS[grad.dtype],
                entry,
                family,
                KINDS[out.dtype] if out is not None else 0,
            )
        )
    return result


_BYTES = {kind: dtype.itemsize for dtype, kind in KINDS.items()}  # element size per kind


def rounds(tasks: list[Task]) -> list[list[Task]] | None:
    """``tasks`` in rounds to run one after another (each round one kernel call, its tasks
    on the pool in any order), so that no task writes its packed parameters (``out``) over
    gradient bytes that another task of its round or a later one has still to read.

    That happens where the staging holds fp32 gradients and the bf16 parameters are packed
    into the same bytes: element j's parameter lands on element j/2's gradient, which an
    earlier task of the same chunk may read. A task that packs over its own gradients is
    safe when its output runs behind its reads (it reads each element before writing it,
    and ``out`` starts at or before ``grad`` with elements no wider). None where the tasks
    cannot be ordered so (a task packing over a later task's gradients, or over its own
    ahead of its reads): the caller then takes the torch path, one sub-range after another.
    """
    reads = sorted(
        (t.grad, t.grad + t.n * _BYTES[t.grad_kind], i)
        for i, t in enumerate(tasks)
        if t.grad and t.n > 0
    )
    starts = [r[0] for r in reads]
    ends = [r[1] for r in reads]
    disjoint = all(a <= b for a, b in zip(ends[:-1], starts[1:], strict=True))
    level = [0] * len(tasks)
    for i, t in enumerate(tasks):
        if not t.out or t.n <= 0:
            continue
        lo, hi = t.out, t.out + t.n * _BYTES[t.out_kind]
        # the reads overlapping [lo, hi): start < hi and end > lo
        first = bisect.bisect_right(ends, lo) if disjoint else 0
        for start, end, other in reads[first : bisect.bisect_left(starts, hi)]:
            if end <= lo:
                continue
            if other == i:
                if lo > start or _BYTES[t.out_kind] > _BYTES[t.grad_kind]:
                    return None
            elif other > i:
                return None
            else:
                level[i] = max(level[i], level[other] + 1)
    out: list[list[Task]] = [[] for _ in range(max(level, default=-1) + 1)]
    for t, lv in zip(tasks, level, strict=True):
        out[lv].append(t)
    return out


def pack_task(param: torch.Tensor, out: torch.Tensor) -> Task:
    """A task that only writes ``param`` (fp32) into ``out`` (bf16 rounded to nearest
    even, or fp32), updating nothing: a gap between parameters."""
    return Task(
        param.numel(), 0, param.data_ptr(), None, None, None, out.data_ptr(),
        KINDS[torch.float32], 0, -1, KINDS[out.dtype],
    )  # fmt: skip


def hyper_array(hypers) -> ctypes.Array:
    """5 doubles per family: (lr, beta1, beta2, weight_decay, eps)."""
    flat = [float(x) for h in hypers for x in h]
    return (ctypes.c_double * max(1, len(flat)))(*flat)


def probe(kernel: HostAdamW, vectorized: int | None = None) -> Build | None:
    """The (variant, width) that reproduces ``torch._fused_adamw_`` bit for bit on random
    data here, or None."""
    gen = torch.Generator().manual_seed(20261205)
    sizes = (16 * 40 + 13, 16 * 3 + 7, 5, 16, 8 * 9 + 3)
    settings = (  # lr, beta1, beta2, weight_decay, eps, step
        (1e-3, 0.9, 0.999, 0.01, 1e-8, 1.0),
        (3e-2, 0.3, 0.95, 0.0, 1e-6, 7.0),
        (1e-4, 0.9, 0.999, 0.1, 1e-8, 1000.0),
        (2.5e-1, 0.6, 0.9, 0.5, 1e-3, 3.0),
    )
    cases = []
    for n, (lr, b1, b2, wd, eps, step) in itertools.product(sizes, settings):
        scale = torch.pow(10.0, torch.empty(n).uniform_(-4, 1, generator=gen))
        p = torch.randn(n, generator=gen)
        g = torch.randn(n, generator=gen) * scale
        m = torch.randn(n, generator=gen) * scale * 0.3
        v = torch.rand(n, generator=gen) * scale * scale
        want = [p.clone(), m.clone(), v.clone()]
        torch._fused_adamw_(
            [want[0]], [g.clone()], [want[1]], [want[2]], [], [torch.tensor(step)],
            amsgrad=False, lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps,
            maximize=False, grad_scale=None, found_inf=None,
        )  # fmt: skip
        cases.append((p, g, m, v, (lr, b1, b2, wd, eps), step, want))
    for width, variant in itertools.product(WIDTHS, VARIANTS):
        if all(_matches(kernel, case, width, variant, vectorized) for case in cases):
            return Build(variant, width, kernel.vectorized if vectorized is None else vectorized)
    return None


def _matches(kernel, case, width, variant, vectorized) -> bool:
    p, g, m, v, hyper, step, want = case
    got = [p.clone(), m.clone(), v.clone()]
    out = torch.empty(p.numel(), dtype=torch.bfloat16)
    n = p.numel()
    tasks = tasks_for(got[0], g, got[1], got[2], out, 0, 0, n - n % width, task_numel=64)
    array = (Task * len(tasks))(*tasks)
    steps = torch.tensor([step], dtype=torch.float32)
    fp32 = KINDS[torch.float32]
    kernel.run(array, hyper_array([hyper]), steps, (fp32, fp32), 1, variant, vectorized)
    return all(
        torch.equal(a.view(torch.int32), b.view(torch.int32))
        for a, b in zip(got, want, strict=True)
    ) and torch.equal(out.view(torch.int16), want[0].to(torch.bfloat16).view(torch.int16))


_LOADED: dict[str, object] = {}  # "kernel": HostAdamW | None, "reason": str


def _load() -> HostAdamW:
    k = HostAdamW(_native.build_library(SOURCE, "host_adamw", FLAGS, LIBS))
    k.build = probe(k)
    if k.build is None:
        raise RuntimeError("its arithmetic does not reproduce torch's fused AdamW here bit for bit")
    return k


def kernel() -> HostAdamW | None:
    """The kernel, built, loaded and probed on the first call of the process; None when
    it is off (``BUFFERS_CPU_KERNEL=off``), could not be built, or computes otherwise than
    torch here (one :class:`HostAdamWWarning` says why)."""
    return _native.load_once(  # type: ignore[return-value]
        _LOADED,
        _load,
        (OSError, RuntimeError, ValueError),
        lambda reason: (
            f"megatron_ext: the offloaded step's compiled kernel is not used ({reason}); the "
            "chunked step runs on torch's ops (about 1.3x the kernel's time). Install a C "
            "compiler (cc, or set CC), or set BUFFERS_CPU_KERNEL=off to use torch's ops "
            "without this warning"
        ),
        HostAdamWWarning,
    )


def describe() -> str:
    """One line: which path the chunked offload step takes in this process."""
    if _native.choice() == "off":
        return "torch's ops (BUFFERS_CPU_KERNEL=off)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HostAdamWWarning)
        k = kernel()
    if k is None:
        return f"torch's ops ({_LOADED.get('reason')})"
    b = k.build
    if b is None:
        return f"torch's ops (the kernel's probe matched no build): {k.path}"
    return (
        f"compiled kernel ({ISAS[int(b.vectorized)]}, variant {b.variant}, "
        f"width {b.width}): {k.path}"
    )
