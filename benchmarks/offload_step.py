"""The offloaded optimizer step, phase by phase: per-parameter against chunked, and its floors.

Run: ``python benchmarks/offload_step.py --device {cpu,cuda} --out DIR [--hidden H]
[--layers L] [--vocab V] [--fraction F] [--chunk-numel N] [--threads T [T ...]]
[--variants NAME [NAME ...]]``.

What is stepped: the precision-aware CPU-offload case of a GPT's parameters (``--layers``
transformer layers of width ``--hidden``, a ``--vocab`` embedding; bf16 weights, one fp32
scale per layer as an fp32 island), laid out in one flat buffer as megatron-core's would be,
bf16 gradients and parameters on the device, fp32 parameters, gradients and AdamW moments on
the host. The host side is megatron_ext's own: one host mirror
(:func:`megatron_ext.offload.host_mirror.build_buffer_mirror`, pinned on CUDA) over the
first ``--fraction`` of the parameters; the rest is updated on the device by torch's fused
AdamW over fp32 master copies (as megatron-core's GPU optimizer does).

Variants, same parameters, same run:

- ``per_parameter``: what ``HostMirrorHybridOptimizer`` does by default: one device-to-host
  copy per block, wait, convert the block to fp32, one ``AdamW(fused=True)`` step per
  parameter (megatron-core's CPU optimizers), pack the block to bf16, one host-to-device
  copy per block.
- ``chunked``: :mod:`megatron_ext.offload.step` (``MegatronOptions(offload_step="chunked")``):
  every chunk's device-to-host copy issued at once on a copy stream; per chunk wait, then
  one call of the compiled kernel (:mod:`megatron_ext.offload.host_kernel`: per element the bf16
  gradient widened, torch's fused AdamW arithmetic, the parameter rounded to bf16 into the
  staging, in one pass; its ``cpu_update`` phase holds all of it, ``convert`` and ``pack``
  are 0), and its host-to-device copy on another stream. Where the kernel is not available
  (no compiler, ``BUFFERS_CPU_KERNEL=off``) this is ``chunked_torch``; the ``kernel``
  field says which ran.
- ``chunked_torch``: the same step on torch's ops: per sub-range of ``--compute-numel``
  elements convert, one ``torch._fused_adamw_`` per hyperparameter set, pack.
- ``chunked_device``: ``chunked`` with ``MegatronOptions(offload_convert="device")``: fp32
  crosses both ways, converted on the device, so the host runs only the AdamW update over
  the pinned fp32 gradients and parameters (twice the bus bytes of a bf16 buffer; its
  ``d2h_bytes`` / ``h2d_bytes`` and the fp32 copy floors say how many).
- ``chunked_bf16m`` and ``chunked_device_bf16m``: those two keeping Adam's moments in bf16
  (the precision-aware optimizer's ``exp_avg_dtype`` / ``exp_avg_sq_dtype``): each moment
  widened to fp32 for the update and rounded back (to nearest even), 2 bytes per element
  in host memory instead of 4. Their state differs from the fp32-moment variants' by
  design (``tests/test_offload_moments.py`` checks it against fp64); the floor stays the
  fp32 one.

Each is measured two ways: ``overlapped`` (the step as it runs, end to end, device drained
only before and after) and ``drained`` (each phase timed alone with the device drained
around it: ``d2h``, ``convert``, ``cpu_update``, ``pack``, ``h2d``, ``gpu_update``,
``wait`` the host's waits for copies). Floors, measured in the same rounds:
``cpu_floor`` torch's fused AdamW over one flat fp32 tensor holding as many elements as the
CPU updates; ``d2h_floor`` / ``h2d_floor`` one pinned copy of the bytes each way. On the
CPU there is no device: the copies are host copies and the floors of copies are host
memcpys; the output says so. ``--threads`` repeats everything at each number of torch
intra-op threads (the CPU update's knob; default: torch's current number); ``--variants``
measures a subset (the floors always).

Rounds are interleaved: every variant and floor is timed once per round, in turn; each
reports its fastest round's median, and a line warns when rounds spread more than 20%.

Writes DIR/offload_step.json (one record per threads x variant x mode) and
DIR/offload_step.png (stacked phases, floors marked), and prints the table.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, find the repo

import torch

from benchmarks import common
from buffers.plan import ALIGN  # megatron-core's parameter alignment too
from buffers.spans import Span
from megatron_ext.offload import host_kernel as offload_native
from megatron_ext.offload import host_mirror
from megatron_ext.offload import mirror_plan as offload_plan
from megatron_ext.offload.step import (
    DEFAULT_CHUNK_NUMEL,
    DEFAULT_COMPUTE_NUMEL,
    ChunkedAdamW,
    HostParam,
    chunk_spans,
)

NAME = "offload_step"
PHASES = ("d2h", "wait", "convert", "cpu_update", "pack", "h2d", "gpu_update")
ADAM = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def gpt_shapes(hidden: int, layers: int, vocab: int) -> list[tuple[str, int, torch.dtype]]:
    """(name, numel, dtype) of a GPT's parameters, one fp32 island (a scale) per layer."""
    h = hidden
    out = [("embedding", vocab * h, torch.bfloat16)]
    for i in range(layers):
        for name, n in (
            ("ln1", 2 * h), ("qkv", 3 * h * h + 3 * h), ("proj", h * h + h),
            ("ln2", 2 * h), ("fc1", 4 * h * h + 4 * h), ("fc2", 4 * h * h + h),
        ):  # fmt: skip
            out.append((f"layer{i}.{name}", n, torch.bfloat16))
        out.append((f"layer{i}.scale", h, torch.float32))
    out.append(("final_ln", 2 * h, torch.bfloat16))
    return out


class Setup:
    """One buffer's offloaded step: device buffers, the host mirror, both CPU updates."""

    def __init__(
        self,
        shapes,
        fraction: float,
        chunk_numel: int,
        device: torch.device,
        compute_numel: int = DEFAULT_COMPUTE_NUMEL,
    ):
        self.device = device
        cuda = device.type == "cuda"
        spans, start = [], 0
        for _, n, _ in shapes:
            spans.append(Span(start, start + n))
            start = -(-(start + n) // ALIGN) * ALIGN
        numel = start
        gen = torch.Generator().manual_seed(0)
        # bf16 buffers on the device (precision-aware: what the optimizer reads and writes)
        self.grads = torch.empty(numel, dtype=torch.bfloat16, device=device)
        self.params = torch.empty(numel, dtype=torch.bfloat16, device=device)
        self.grads.copy_(torch.randn(numel, generator=gen).mul_(1e-3))
        self.params.copy_(torch.randn(numel, generator=gen))
        total = sum(s.numel for s in spans)
        done, offloaded, resident = 0, [], []
        for s in spans:  # megatron-core's greedy placement, in order
            (offloaded if done < fraction * total else resident).append(s)
            done += s.numel if done < fraction * total else 0
        self.cpu_numel = sum(s.numel for s in offloaded)
        self.gpu_numel = sum(s.numel for s in resident)
        layout = offload_plan.mirror_layout([Span(0, numel)], offloaded, resident)
        self.mirror = host_mirror.build_buffer_mirror(
            "bf16", layout, owned_numel=numel, grads=self.grads, grads_coords=None,
            params=self.params, params_coords=None, cpu_dtype=torch.float32, pin=cuda,
        )  # fmt: skip
        self.mirror.load_params()
        self.wide = host_mirror.build_buffer_mirror(
            "bf16", layout, owned_numel=numel, grads=self.grads, grads_coords=None,
            params=self.params, params_coords=None, cpu_dtype=torch.float32, pin=cuda,
            device_convert=True,
        )  # fmt: skip
        self.wide.load_params()
        local = [layout.local(s) for s in offloaded]
        # per_parameter: megatron-core's CPU optimizers, one per parameter, over mirror views
        self.views = []
        for s in local:
            p = self.mirror.host_params[s.start : s.end]
            p.grad = self.mirror.cpu_grads[s.start : s.end]
            self.views.append(p)
        self.per_param = [torch.optim.AdamW([p], fused=True, **ADAM) for p in self.views]
        runs = chunk_spans([layout.local(b) for b in layout.blocks], chunk_numel, local)
        spans = [r for _, r in runs]

        def stepper(mirror, views, moments=(torch.float32, torch.float32), kernel="auto"):
            """Per-parameter optimizers of their own over ``views`` (their state) and the
            chunked step over ``mirror`` that steps them."""
            opts = [torch.optim.AdamW([p], fused=True, **ADAM) for p in views]
            entries = [HostParam(p, s, o, 0) for p, s, o in zip(views, local, opts, strict=True)]
            return opts, ChunkedAdamW(
                mirror.host_params, mirror.cpu_grads, entries, spans, compute_numel,
                moment_dtypes=moments, kernel=kernel,
            )  # fmt: skip

        # chunked: its own parameters' state (separate optimizers, same views)
        self.chunks = host_mirror.chunk_copies(self.mirror, runs)
        self.chunk_opts, self.stepper = stepper(self.mirror, self.views)
        # chunked_torch: the same on torch's ops (convert, fused call, pack per sub-range)
        self.torch_opts, self.torch_stepper = stepper(self.mirror, self.views, kernel="torch")
        # chunked_device: the same over the mirror that converts on the device
        wide_views = [self.wide.host_params[s.start : s.end] for s in local]
        self.wide_chunks = host_mirror.chunk_copies(self.wide, runs)
        self.wide_opts, self.wide_stepper = stepper(self.wide, wide_views)
        # chunked_bf16m / chunked_device_bf16m: the two chunked steps keeping Adam's moments
        # in bf16 (megatron-core's exp_avg_dtype / exp_avg_sq_dtype), their own state
        bf16m = (torch.bfloat16, torch.bfloat16)
        self.bf16m_opts, self.bf16m_stepper = stepper(self.mirror, self.views, bf16m)
        self.wide_bf16m_opts, self.wide_bf16m_stepper = stepper(self.wide, wide_views, bf16m)
        # the GPU-resident part: fp32 masters updated by torch's fused AdamW on the device
        self.gpu_views = [self.params[s.start : s.end] for s in resident]
        self.masters = [v.float().requires_grad_(False) for v in self.gpu_views]
        self.master_grads = [torch.zeros_like(m) for m in self.masters]
        self.gpu_opt = None
        if self.masters:
            for m, g in zip(self.masters, self.master_grads, strict=True):
                m.grad = g
            self.gpu_opt = torch.optim.AdamW(self.masters, fused=cuda, **ADAM)
        self.gpu_grads = [self.grads[s.start : s.end] for s in resident]
        if cuda:
            self.d2h_stream, self.h2d_stream = torch.cuda.Stream(), torch.cuda.Stream()
            self.events = [torch.cuda.Event() for _ in self.chunks]
            self.block_events = [torch.cuda.Event() for _ in self.mirror.blocks]
            self.done = torch.cuda.Event()
        # floors
        self.floor_p = torch.randn(self.cpu_numel, generator=gen)
        self.floor_p.grad = torch.randn(self.cpu_numel, generator=gen).mul_(1e-3)
        self.floor_opt = torch.optim.AdamW([self.floor_p], fused=True, **ADAM)
        d2h = self.mirror.stats()["d2h_bytes"]
        h2d = self.mirror.stats()["h2d_bytes"]
        self.d2h_bytes, self.h2d_bytes = d2h, h2d
        self.wide_bytes = self.wide.stats()["d2h_bytes"]  # each way
        most = max(d2h, h2d, self.wide_bytes)
        self.dev_src = torch.ones(most, dtype=torch.uint8, device=device)
        self.host_dst = torch.empty(most, dtype=torch.uint8, pin_memory=cuda)
        self.host_src = torch.ones(most, dtype=torch.uint8, pin_memory=cuda)
        self.dev_dst = torch.empty(most, dtype=torch.uint8, device=device)

    # -- the GPU-resident part, as megatron-core steps it -----------------------------------
    def gpu_update(self) -> None:
        if self.gpu_opt is None:
            return
        for g, src in zip(self.master_grads, self.gpu_grads, strict=True):
            g.copy_(src)
        self.gpu_opt.step()
        for v, m in zip(self.gpu_views, self.masters, strict=True):
            v.copy_(m)

    # -- the two variants, as they run -------------------------------------------------------
    def per_parameter(self, timer) -> None:
        cuda = self.device.type == "cuda"
        with timer("d2h"):
            for block, event in zip(self.mirror.blocks, self._events(), strict=True):
                if cuda:
                    self.d2h_stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(self.d2h_stream):
                        block.start_d2h()
                        event.record(self.d2h_stream)
                else:
                    block.start_d2h()
        if self.gpu_opt is not None:
            with timer("gpu_update"):
                self.gpu_update()
        for block, event in zip(self.mirror.blocks, self._events(), strict=True):
            with timer("wait"):
                if cuda:
                    event.synchronize()
            with timer("convert"):
                block.convert_grads()
        with timer("cpu_update"):
            for opt in self.per_param:
                opt.step()
        for block in self.mirror.blocks:
            with timer("pack"):
                block.pack_params()
            with timer("h2d"):
                self._h2d(block)
        self._finish()

    def chunked(self, timer) -> None:
        self._chunked(timer, self.chunks, self.stepper)

    def chunked_torch(self, timer) -> None:
        self._chunked(timer, self.chunks, self.torch_stepper)

    def chunked_device(self, timer) -> None:
        self._chunked(timer, self.wide_chunks, self.wide_stepper)

    def chunked_bf16m(self, timer) -> None:
        self._chunked(timer, self.chunks, self.bf16m_stepper)

    def chunked_device_bf16m(self, timer) -> None:
        self._chunked(timer, self.wide_chunks, self.wide_bf16m_stepper)

    def _chunked(self, timer, chunks, stepper) -> None:
        cuda = self.device.type == "cuda"
        with timer("d2h"):
            if cuda:
                self.d2h_stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.d2h_stream):
                    for chunk, event in zip(chunks, self.events, strict=True):
                        chunk.start_d2h()
                        event.record(self.d2h_stream)
            else:
                for chunk in chunks:
                    chunk.start_d2h()
        if cuda:
            self.h2d_stream.wait_stream(torch.cuda.current_stream())
        if self.gpu_opt is not None:
            with timer("gpu_update"):
                self.gpu_update()
        with timer("cpu_update"):
            stepper.begin()
        for i, chunk in enumerate(chunks):
            with timer("wait"):
                if cuda:
                    self.events[i].synchronize()
            with timer("cpu_update"):  # convert, update and pack, per cache-sized sub-range
                stepper.update(i, chunk)
            with timer("h2d"):
                self._h2d(chunk)
        stepper.finish()
        self._finish()

    def _events(self):
        if self.device.type == "cuda":
            return self.block_events
        return [None] * len(self.mirror.blocks)

    def _h2d(self, copies) -> None:
        if self.device.type == "cuda":
            with torch.cuda.stream(self.h2d_stream):
                copies.start_h2d()
        else:
            copies.start_h2d()

    def _finish(self) -> None:
        if self.device.type == "cuda":
            self.done.record(self.h2d_stream)
            torch.cuda.current_stream().wait_event(self.done)

    # -- floors ------------------------------------------------------------------------------
    def cpu_floor(self) -> None:
        self.floor_opt.step()

    def d2h_floor(self) -> None:
        self.host_dst[: self.d2h_bytes].copy_(self.dev_src[: self.d2h_bytes], non_blocking=True)

    def h2d_floor(self) -> None:
        self.dev_dst[: self.h2d_bytes].copy_(self.host_src[: self.h2d_bytes], non_blocking=True)

    def d2h_floor_fp32(self) -> None:
        n = self.wide_bytes
        self.host_dst[:n].copy_(self.dev_src[:n], non_blocking=True)

    def h2d_floor_fp32(self) -> None:
        n = self.wide_bytes
        self.dev_dst[:n].copy_(self.host_src[:n], non_blocking=True)


class Timer:
    """Per-phase seconds; ``drained``: the device synchronized before and after each phase
    (its time is the phase's alone); otherwise a no-op (the overlapped step is timed whole)."""

    def __init__(self, device: torch.device, drained: bool):
        self.device, self.drained = device, drained
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def __call__(self, phase: str):
        return _Phase(self, phase) if self.drained else _NOOP


class _Phase:
    def __init__(self, timer: Timer, phase: str):
        self.timer, self.phase = timer, phase

    def __enter__(self):
        common.synchronize(self.timer.device)
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        common.synchronize(self.timer.device)
        self.timer.seconds[self.phase] += time.perf_counter() - self.t0


class _Noop:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


_NOOP = _Noop()


def _timed(fn, device, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` calls, device drained around each."""
    times = []
    for _ in range(reps):
        common.synchronize(device)
        t0 = time.perf_counter()
        fn()
        common.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


VARIANTS = (
    "per_parameter",
    "chunked_torch",
    "chunked",
    "chunked_device",
    "chunked_bf16m",
    "chunked_device_bf16m",
)
STEPPERS = {
    "chunked_torch": "torch_stepper",
    "chunked": "stepper",
    "chunked_device": "wide_stepper",
    "chunked_bf16m": "bf16m_stepper",
    "chunked_device_bf16m": "wide_bf16m_stepper",
}


def measure(setup: Setup, rounds: int, warmup: int, reps: int, variants=VARIANTS) -> list[dict]:
    """Every variant (of ``variants``), mode and floor of one setup, interleaved over
    ``rounds``; a progress bar moves at each of them."""
    device = setup.device
    phases: dict[tuple[str, str], list[dict]] = {}

    def variant(name: str, drained: bool):
        def run(r: int) -> float:
            fn = getattr(setup, name)
            for _ in range(warmup if r == 0 else 0):
                fn(Timer(device, False))
            per_call = []
            for _ in range(reps):
                timer = Timer(device, drained)
                common.synchronize(device)
                t0 = time.perf_counter()
                fn(timer)
                common.synchronize(device)
                per_call.append((time.perf_counter() - t0, timer.seconds))
            total = statistics.median(t for t, _ in per_call)
            phases.setdefault((name, "drained" if drained else "overlapped"), []).append(
                {p: statistics.median(s[p] for _, s in per_call) for p in PHASES}
            )
            return total

        return run

    def floor(name: str):
        def run(r: int) -> float:
            fn = getattr(setup, name)
            for _ in range(warmup if r == 0 else 0):
                fn()
            return _timed(fn, device, reps)

        return run

    measures = {
        **{(name, "overlapped"): variant(name, False) for name in variants},
        **{(name, "drained"): variant(name, True) for name in variants},
        ("cpu_floor", "-"): floor("cpu_floor"),
        ("d2h_floor", "-"): floor("d2h_floor"),
        ("h2d_floor", "-"): floor("h2d_floor"),
        ("d2h_floor_fp32", "-"): floor("d2h_floor_fp32"),
        ("h2d_floor_fp32", "-"): floor("h2d_floor_fp32"),
    }
    desc = f"{NAME} {torch.get_num_threads()} threads"
    results, errors = common.interleave(measures, rounds, desc)
    floors = {k[0]: min(v) for k, v in results.items() if k[1] == "-"}
    rows = []
    for (name, mode), per_round in results.items():
        if mode == "-":
            continue
        best = min(range(len(per_round)), key=per_round.__getitem__)
        wide = name.startswith("chunked_device")
        stepper = getattr(setup, STEPPERS[name]) if name in STEPPERS else None
        row = {
            "variant": name,
            "mode": mode,
            # how the chunks were updated: the compiled kernel or torch's ops
            "kernel": None if stepper is None else ("native" if stepper.uses_native else "torch"),
            "threads": torch.get_num_threads(),
            "cpu_numel": setup.cpu_numel,
            "gpu_numel": setup.gpu_numel,
            "chunks": len(setup.chunks),
            "blocks": len(setup.mirror.blocks),
            **common.round_fields("step", per_round),
            **{
                f"{p}_s": phases[(name, mode)][best][p] if mode == "drained" else None
                for p in PHASES
            },
            "cpu_floor_s": floors.get("cpu_floor"),
            "d2h_floor_s": floors.get("d2h_floor_fp32" if wide else "d2h_floor"),
            "h2d_floor_s": floors.get("h2d_floor_fp32" if wide else "h2d_floor"),
            "d2h_bytes": setup.wide_bytes if wide else setup.d2h_bytes,
            "h2d_bytes": setup.wide_bytes if wide else setup.h2d_bytes,
        }
        if row["cpu_floor_s"]:
            row["step_over_cpu_floor"] = row["step_s"] / row["cpu_floor_s"]
        rows.append(row)
    for key, exc in errors.items():
        rows.append({"variant": key[0], "mode": key[1], **common.error_fields(exc)})
    return rows


def same_result(setup: Setup) -> bool:
    """One step of each variant from the same parameters and fresh state: the same bits in
    the host parameters, the moments and the offloaded device parameters (the GPU-resident
    part is stepped by each and not compared). Run before any timing."""
    host = setup.mirror.host_params
    before, device_before = host.clone(), setup.params.clone()
    out = []
    variants = (
        ("per_parameter", setup.per_param, setup.mirror.host_params),
        ("chunked_torch", setup.torch_opts, setup.mirror.host_params),
        ("chunked", setup.chunk_opts, setup.mirror.host_params),
        ("chunked_device", setup.wide_opts, setup.wide.host_params),
    )
    for name, opts, host in variants:
        host.copy_(before)
        setup.params.copy_(device_before)
        getattr(setup, name)(Timer(setup.device, False))
        common.synchronize(setup.device)
        moments = [
            torch.cat([o.state[o.param_groups[0]["params"][0]][k].reshape(-1) for o in opts])
            for k in ("exp_avg", "exp_avg_sq")
        ]
        sent = torch.cat([block.h2d[0] for block in setup.mirror.blocks])  # the device side
        out.append((host.clone(), sent.clone(), *moments))
    return all(torch.equal(a, b) for other in out[1:] for a, b in zip(out[0], other, strict=True))


def parse_args(argv):
    ap = common.base_parser(__doc__.splitlines()[0])
    for name, default, meaning in (
        ("--hidden", 2048, "hidden size"),
        ("--layers", 4, "transformer layers"),
        ("--vocab", 32000, "vocabulary size"),
        ("--chunk-numel", DEFAULT_CHUNK_NUMEL, "elements per chunk (one copy each way)"),
        ("--compute-numel", DEFAULT_COMPUTE_NUMEL, "elements per sub-range of a chunk"),
    ):
        ap.add_argument(
            name, type=common.positive_int, default=default,
            help=f"{meaning} (default: %(default)s)",
        )  # fmt: skip
    ap.add_argument(
        "--fraction",
        type=common.fraction,
        default=1.0,
        help="offload fraction, in (0, 1] (default: %(default)s)",
    )
    ap.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=list(VARIANTS),
        help="the variants to measure (default: all); the floors are always measured",
    )
    ap.add_argument(
        "--threads",
        type=common.positive_int,
        nargs="+",
        default=None,
        help="torch intra-op thread counts to measure at (default: torch's current number)",
    )
    return ap.parse_args(argv)


# what each phase column holds (drained mode only: each phase timed alone)
PHASE_MEANINGS = {
    "d2h": "device-to-host copies of the gradients",
    "wait": "the host's waits for copies",
    "convert": "bf16 to fp32 on the host",
    "cpu_update": "AdamW on the host (chunked: the kernel's whole pass)",
    "pack": "fp32 to bf16 into the staging",
    "h2d": "host-to-device copies of the parameters",
    "gpu_update": "fused AdamW of the GPU-resident part",
}
COLUMNS = [
    common.Column("threads", "threads", meaning="torch intra-op threads"),
    common.Column(
        "variant", "variant", meaning="the step measured (the script's docstring says each)"
    ),
    common.Column(
        "kernel", "kernel", meaning="chunked steps' CPU update: native (compiled) or torch (ops)"
    ),
    common.Column(
        "mode",
        "mode",
        meaning="overlapped: the step end to end; drained: each phase alone, device drained",
    ),
    common.Column("step ms", "step_s", common.show_ms, "median step, fastest round"),
    common.Column(
        "x cpu floor", "step_over_cpu_floor", lambda v: f"{v:.2f}", "step ms / cpu floor ms"
    ),
    *[
        common.Column(f"{p} ms", f"{p}_s", common.show_ms, f"drained: {PHASE_MEANINGS[p]}")
        for p in PHASES
    ],
    common.Column(
        "cpu floor ms", "cpu_floor_s", common.show_ms, "fused AdamW over the CPU's elements"
    ),
    common.Column("d2h floor ms", "d2h_floor_s", common.show_ms, "one pinned copy, same bytes"),
    common.Column("h2d floor ms", "h2d_floor_s", common.show_ms, "one pinned copy, same bytes"),
    common.Column(
        "error", "error", lambda v: v[:60], "why the row failed (its first 60 characters)"
    ),
]


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = common.resolve_device(args.device)
    title = common.run_title(device)
    print(title, file=sys.stderr)
    if device.type == "cpu":
        print(
            "on the CPU there is no device: copies are host copies, the copy floors host "
            "memcpys; the CPU update and its floor are what the numbers say",
            file=sys.stderr,
        )
    print(f"chunked step's CPU update: {offload_native.describe()}", file=sys.stderr)
    warmup, reps = common.repeats(args, device)
    rounds = common.rounds(args, device)
    shapes = gpt_shapes(args.hidden, args.layers, args.vocab)
    setup = Setup(shapes, args.fraction, args.chunk_numel, device, args.compute_numel)
    identical = same_result(setup)
    original = torch.get_num_threads()
    rows = []
    try:
        for threads in args.threads or [original]:
            torch.set_num_threads(threads)
            done = measure(
                setup, rounds, warmup, common.per_round(reps, rounds), tuple(args.variants)
            )
            for r in done:
                r["fraction"] = args.fraction
                r["same_state_as_per_parameter"] = identical
            rows += done
            # after each thread count: a run stopped by a time limit keeps what it measured
            json_path = common.write_json(rows, args.out, NAME)
    finally:
        torch.set_num_threads(original)
    png_path = _plot(rows, args.out, f"{title} | offload fraction {args.fraction}")
    good = [r for r in rows if "error" not in r]
    warning = common.spread_warning(
        {f"{r['variant']} {r['mode']} {r['threads']}t": r["step_spread"] for r in good}, rounds
    )
    if warning:
        print(warning)
    print(common.format_table(rows, COLUMNS))
    print(
        "per-parameter, chunked_torch, chunked and chunked_device leave the same optimizer "
        f"state: {identical}"
    )
    print(f"wrote {json_path} and {png_path}", file=sys.stderr)
    return rows


def _plot(rows, out_dir, title) -> Path | str:
    good = [r for r in rows if "error" not in r and r["mode"] == "drained"]
    # one bar per variant and thread count: wide enough that the labels do not overlap
    fig, (ax,) = common.new_figure(1, width=max(8.0, 0.9 * len(good)))
    if not good:
        common.empty_panel(ax, "no variant ran")
    else:
        labels = [f"{r['variant']}, {r['threads']}t" for r in good]
        bottom = [0.0] * len(good)
        for p in PHASES:
            values = [1e3 * r[f"{p}_s"] for r in good]
            ax.bar(labels, values, bottom=bottom, label=p)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        overlapped = {
            (r["variant"], r["threads"]): r["step_s"]
            for r in rows
            if "error" not in r and r["mode"] == "overlapped"
        }
        ax.scatter(
            labels,
            [1e3 * overlapped.get((r["variant"], r["threads"]), float("nan")) for r in good],
            color="black",
            marker="D",
            zorder=3,
            label="overlapped step",
        )
        for r, label in zip(good, labels, strict=True):
            floor = 1e3 * r["cpu_floor_s"]
            ax.plot([label, label], [floor, floor], marker="_", markersize=40, color="red")
        ax.plot([], [], color="red", label="CPU AdamW floor")
        ax.set_ylabel("ms per step (drained phases stacked)")
        ax.tick_params(axis="x", labelrotation=35, labelsize=7)
        for tick in ax.get_xticklabels():
            tick.set_horizontalalignment("right")
        ax.legend(fontsize=7)
    return common.save_figure(fig, out_dir, NAME, title)


if __name__ == "__main__":
    main()
