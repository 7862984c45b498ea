"""Offload at the size it exists for: one GPT size per run, each kind of optimizer in a
process of its own, against forward and backward alone.

A ``GPTModel`` (``benchmarks/train_step.py``'s, fp32 islands on every layer) of one size per
invocation: ``--size`` names one of GPT-3's shapes (:data:`SIZES`; 1.3B with 16 heads of
128, 13B at hidden 5120, as Megatron-LM's examples have them), or ``--layers/--hidden/
--heads`` give one; sequence 2048, micro-batch 1, 8 and 16 micro-batches per step by
default; transformer-engine's layer spec when it imports (``--layer-spec auto``), else
megatron-core's local one, said in every row. The gradients are megatron-core DDP's default
(in bf16). Kinds (``--kinds``), at ``--fraction`` (1.0):

- ``fwd_bwd``: forward and backward alone, the same micro-batches and gradient sync, no
  optimizer built or stepped: the ceiling of a step whose optimizer runs elsewhere;
- ``gpu_resident``: the precision-aware optimizer on the GPU (an out-of-memory is its row);
- ``stock``: megatron-core's CPU offload, the fp32 islands in bf16 (with them it cannot
  build);
- ``exact``, ``overlapped``, ``delayed``: ours, ``benchmarks/offload_overlap.py``'s
  configurations of those names;
- ``delayed_bf16``: ``delayed`` with bf16 Adam moments (``exp_avg_dtype`` and
  ``exp_avg_sq_dtype`` of megatron-core's ``OptimizerConfig``);
- ``deepspeed``: DeepSpeed's ZeRO-Offload (stage 2, ``offload_optimizer`` on the CPU,
  pinned, ``overlap_comm``, its ``DeepSpeedCPUAdam``) driving the same ``GPTModel``
  (islands in bf16, as stock) on the same tokens; imported for this row only, whose error
  says so where DeepSpeed is not installed.

Columns: the median step time (device drained before and after; ``--warmup`` untimed steps
first), tokens per second, model TFLOPS and MFU, ``kept`` (the ``fwd_bwd`` step time at the
same micro-batch count over the row's), the GPU's peak allocated memory, the host's peak and
after-build resident set (``VmHWM`` and ``VmRSS`` of ``/proc/self/status``), the pinned
bytes (ours: ``host_mirror_stats()``; every kind: torch's pinned host allocator), the build
time (model, DDP and optimizer with its pinned mirrors, device drained) and the time to the
first step's end. Model FLOPs per step are Megatron-LM's ``num_floating_point_operations``
(``megatron/training/training.py``) for this GPT: per sequence of ``s`` tokens
``s * (72 L h^2 + 6 h V) + 6 L h s^2`` (:func:`megatron_flops`), forward and backward, with
no recomputation counted; MFU divides by the GPU's dense bf16 peak (:data:`PEAK_TFLOPS` by
device name, or ``--peak-tflops``).

Each kind runs in a fresh process (``--row KIND``, started by the default driver mode with
a time limit of ``--row-timeout``): the host's peak resident set is a process's high-water
mark, so only a process of its own gives a row its own; torch keeps freed GPU and pinned
host memory cached; and an out-of-memory kill or a CUDA error takes one row, not the run.
A process times every ``--micro-batches`` count on one build. Every row is written to the
JSON as it ends (the driver reads the child's rows as they come); a row that fails, times
out or whose process dies is a row with its error. ``--merge`` reads earlier runs' JSON, so
that calls of a few kinds each make one table.

On the CPU (``--device cpu``) nothing is measured: every row says it was skipped
(megatron-core's DDP and optimizers allocate on CUDA).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, find the repo

import torch

from benchmarks import offload_overlap
from benchmarks.common import (
    Column,
    base_parser,
    empty_panel,
    error_fields,
    format_table,
    gib,
    new_figure,
    run_title,
    save_figure,
    single_rank_process_group,
    write_json,
)

NAME = "offload_scale"
# GPT-3's shapes (layers, hidden, heads), as Megatron-LM's examples train them.
SIZES = {
    "0.35b": (24, 1024, 16),
    "1.3b": (24, 2048, 16),
    "2.7b": (32, 2560, 32),
    "6.7b": (32, 4096, 32),
    "13b": (40, 5120, 40),
}
KINDS = (
    "fwd_bwd", "gpu_resident", "stock", "exact", "overlapped", "delayed", "delayed_bf16",
    "deepspeed",
)  # fmt: skip
# Dense bf16 tensor-core peaks (TFLOPS, no sparsity) by a part of torch's device name; the
# first that matches counts.
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))
SKIPPED_ON_CPU = (
    "skipped on the CPU: megatron-core's DDP and optimizers allocate on CUDA (--device cuda "
    "on a GPU)"
)
DEEPSPEED_MISSING = (
    "deepspeed is not installed: pip install deepspeed (docs/benchmarks.md says how on a "
    "host without network)"
)
# The row of a shape, a micro-batch count and a kind; --merge replaces rows by it.
ROW_KEY = ("layers", "hidden", "heads", "vocab", "seq", "batch", "micro_batches", "kind")


def say(message: str) -> None:
    """A progress line on stderr, flushed (a log read while the run goes on shows it)."""
    print(f"{NAME}: {message}", file=sys.stderr, flush=True)


# --- what a row is worth: FLOPs, tokens, parameters, peaks ------------------------------


def megatron_flops(layers: int, hidden: int, vocab: int, seq: int, sequences: int) -> float:
    """Model FLOPs of forward and backward over ``sequences`` sequences of ``seq`` tokens:
    Megatron-LM's ``num_floating_point_operations`` for this GPT (multi-head attention, a
    GELU MLP of ``4 * hidden``, no MoE, no MTP, causal attention counted half).

    Per token ``72 L h^2`` (the projections and the MLP, 3 GEMMs each way, 2 FLOPs per
    multiply-add) plus ``6 h V`` (the logits); per sequence ``6 L h s^2`` (QK^T and its
    product with V).
    """
    tokens = sequences * seq
    dense = tokens * (72 * layers * hidden**2 + 6 * hidden * vocab)
    return float(dense + sequences * seq**2 * 6 * layers * hidden)


def gpt_params(layers: int, hidden: int, vocab: int, seq: int) -> int:
    """The GPT's parameters: word and position embeddings, the output layer (megatron-core's
    ``GPTModel`` does not share it with the word embedding by default), per layer
    ``12 h^2 + 13 h`` (QKV, projection, MLP, two layer norms, biases) and the fp32 island
    (``h``), the final layer norm."""
    per_layer = 12 * hidden**2 + 13 * hidden + hidden
    return 2 * vocab * hidden + seq * hidden + layers * per_layer + 2 * hidden


def peak_tflops(device_name: str, given: float | None) -> float | None:
    """The dense bf16 peak MFU is taken against: ``given`` (``--peak-tflops``), else
    :data:`PEAK_TFLOPS`' entry for the device's name, else None (no MFU)."""
    if given is not None:
        return given
    return next((peak for part, peak in PEAK_TFLOPS if part in device_name), None)


def host_memory() -> dict[str, int | None]:
    """This process's resident set now and its high-water mark, in bytes (``VmRSS``,
    ``VmHWM`` of ``/proc/self/status``; None where there is no such file)."""
    out: dict[str, int | None] = {"VmRSS": None, "VmHWM": None}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in out:
                out[key] = int(value.split()[0]) * 1024  # kB
    return out


_UNITS = {"B": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_TRIED = re.compile(r"Tried to allocate ([0-9.]+) (B|bytes|KiB|MiB|GiB|TiB)")
_HELD = re.compile(r"([0-9.]+) (B|bytes|KiB|MiB|GiB|TiB) is allocated by PyTorch")


def oom_fields(exc: BaseException) -> dict[str, Any]:
    """For a CUDA out-of-memory error: the request that failed and what PyTorch held then,
    in bytes, as torch's message says them (``oom_request_bytes``, ``oom_held_bytes``;
    a figure the message lacks is left out). Other errors: nothing."""
    if not isinstance(exc, torch.cuda.OutOfMemoryError):
        return {}
    out: dict[str, Any] = {"oom": True}
    for key, pattern in (("oom_request_bytes", _TRIED), ("oom_held_bytes", _HELD)):
        found = pattern.search(str(exc))
        if found:
            out[key] = round(float(found.group(1)) * _UNITS[found.group(2)])
    return out


def failed(exc: BaseException) -> dict[str, Any]:
    """A row's fields for an exception: the error, where, and for an OOM its bytes."""
    return error_fields(exc) | oom_fields(exc)


# --- one kind, in its own process (--row) ------------------------------------------------


@dataclass
class Built:
    """One kind, built: ``step(micro)`` runs one training step over the micro-batches;
    ``optimizer``: ours or stock's chain (read for pinned bytes and drained), else None;
    ``resize(n)``: what changes the step to ``n`` micro-batches where the build fixed it
    (DeepSpeed's gradient accumulation), else None; ``info()``: fields for the row, read
    after its steps; ``params``: the parameters of the model built."""

    step: Callable[[list], Any]
    params: int
    optimizer: Any = None
    resize: Callable[[int], None] | None = None
    info: Callable[[], dict] = dict


def kind_configs(fraction: float) -> dict[str, tuple[str, dict, dict | None]]:
    """The kinds built by ``offload_overlap.build``: kind -> (label, OptimizerConfig
    overrides, MegatronOptions fields or None for stock) at ``fraction``."""
    out = {
        offload_overlap.kind_of(label): (label, overrides, options)
        for label, overrides, options in offload_overlap.configs([fraction], [], False)
    }
    label, overrides, options = out["delayed"]
    bf16 = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    out["delayed_bf16"] = (f"{label}_bf16_moments", overrides | bf16, options)
    return out


def build_kind(args, kind: str, layer_spec: str) -> Built:
    """Build ``kind``'s model and optimizer (for ``fwd_bwd``, the model in our DDP alone)."""
    if kind == "fwd_bwd":
        model = ddp_model(args, layer_spec)
        return Built(lambda micro: offload_overlap.train_step(model, None, micro), numel(model))
    if kind == "deepspeed":
        return deepspeed_build(args, layer_spec)
    _, overrides, options = kind_configs(args.fraction)[kind]
    model, opt = offload_overlap.build(args, overrides, options, layer_spec=layer_spec)
    step = lambda micro: offload_overlap.train_step(model, opt, micro)  # noqa: E731
    return Built(step, numel(model), optimizer=opt)


def numel(module: torch.nn.Module) -> int:
    """Elements of ``module``'s parameters, each once."""
    return sum(p.numel() for p in module.parameters())


def ddp_model(args, layer_spec: str):
    """The GPT with fp32 islands in our DDP (per-dtype gradient buffers, the distributed
    optimizer's layout), no optimizer."""
    import megatron_ext
    from benchmarks.train_step import _model

    config, module = _model(args, fp32_islands=True, layer_spec=layer_spec)
    ddp_config = megatron_ext.DistributedDataParallelConfig(
        per_dtype_grad_buffers=True, use_distributed_optimizer=True
    )
    return megatron_ext.DistributedDataParallel(config, ddp_config, module)


def deepspeed_config(args, micro: int) -> dict:
    """ZeRO-Offload as its paper runs it: stage 2, the optimizer on the CPU in pinned
    memory, communication overlapped, bf16, clipping at 1.0, DeepSpeed's CPU AdamW with
    megatron-core's defaults (betas 0.9/0.999, eps 1e-8, weight decay 0.01)."""
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": micro,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "steps_per_print": 2**31 - 1,
    }


def deepspeed_build(args, layer_spec: str) -> Built:
    """DeepSpeed's engine over the GPT (islands in bf16: DeepSpeed's bf16 casts the whole
    module); its CPU Adam compiled first (a JIT build on a fresh machine), timed apart."""
    try:
        import deepspeed
    except ImportError as exc:
        raise RuntimeError(f"{DEEPSPEED_MISSING} ({exc})") from None
    from deepspeed.ops.op_builder import CPUAdamBuilder

    from benchmarks.train_step import _model

    t0 = time.perf_counter()
    CPUAdamBuilder().load()
    say(f"deepspeed: its CPU Adam built or loaded in {time.perf_counter() - t0:.1f} s")
    for name, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)  # DeepSpeed's launcher would set them
    _, module = _model(args, fp32_islands=False, layer_spec=layer_spec)
    engine, *_ = deepspeed.initialize(
        model=module,
        model_parameters=[p for p in module.parameters() if p.requires_grad],
        config=deepspeed_config(args, args.micro_batches[0]),
    )

    def step(micro: list) -> torch.Tensor:
        total = torch.zeros((), device=micro[0][0].device)
        for tokens, position, mask, labels in micro:
            loss = engine(tokens, position, mask, labels=labels).float().mean()
            engine.backward(loss)  # scaled by 1 / gradient_accumulation_steps in there
            engine.step()  # the optimizer steps at the last micro-batch only
            total += loss.detach() / len(micro)
        return total

    def info() -> dict:
        inner = getattr(engine.optimizer, "optimizer", None)
        return {
            "optimizer_steps": engine.global_steps,
            "optimizer_class": f"{type(engine.optimizer).__name__}/{type(inner).__name__}",
        }

    resize = lambda n: engine.set_train_batch_size(n * args.batch)  # noqa: E731
    return Built(step, numel(module), resize=resize, info=info)


def offload_memory(opt) -> dict[str, int]:
    """Ours: the host mirrors' pinned bytes, the host bytes of the offloaded state (fp32
    parameters, moments, staging, scratch) and of its moments alone, summed over the
    offloading optimizers (``host_mirror_stats()``), and which host kernel stepped them;
    nothing for an optimizer without host mirrors."""
    pinned = state = moments = 0
    kernels: set[str] = set()
    found = False
    for child in getattr(opt, "chained_optimizers", [opt]):
        stats = getattr(getattr(child, "optimizer", None), "host_mirror_stats", None)
        if stats is None:
            continue
        for s in stats():
            found = True
            pinned += s["pinned_bytes"]
            moments += s.get("moment_bytes", 0)
            kernels.add(s.get("kernel", "not yet stepped"))
            state += sum(
                s.get(k, 0)
                for k in (
                    "host_param_bytes", "staging_bytes", "param_staging_bytes",
                    "host_grad_bytes", "moment_bytes", "scratch_bytes",
                )
            )  # fmt: skip
    if not found:
        return {}
    out = {"pinned_bytes": pinned, "host_state_bytes": state, "moment_bytes": moments}
    return out | {"host_kernel": "+".join(sorted(kernels))}


def device_memory() -> dict[str, int]:
    """The GPU's peak allocated and reserved bytes so far in this process, and the pinned
    host bytes torch's host allocator holds (its blocks are rounded up); nothing without
    CUDA."""
    if not torch.cuda.is_available():
        return {}
    out = {
        "gpu_peak_bytes": torch.cuda.max_memory_allocated(),
        "gpu_reserved_peak_bytes": torch.cuda.max_memory_reserved(),
    }
    stats = getattr(torch.cuda, "host_memory_stats", None)  # not in every torch
    held: dict = {}
    if stats is not None:
        with contextlib.suppress(RuntimeError):  # a figure the benchmark can do without
            held = stats()
        for key, name in (("allocated_bytes.current", "pinned_alloc_bytes"),
                          ("allocated_bytes.peak", "pinned_alloc_peak_bytes")):  # fmt: skip
            if key in held:
                out[name] = held[key]
    return out


def choose_layer_spec(asked: str) -> tuple[str, str]:
    """(``"te"`` or ``"local"``, why): ``auto`` takes transformer-engine's layers where it
    imports on a GPU; ``te`` insists (the build fails where it does not import)."""
    if asked == "local":
        return "local", "--layer-spec local"
    if asked == "te":
        return "te", "--layer-spec te"
    if not torch.cuda.is_available():
        return "local", "no GPU, no transformer-engine"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # not installed, or installed and broken: said in the row
        return "local", f"transformer-engine does not import ({type(exc).__name__}: {exc})"
    return "te", "transformer-engine imports"


def shape_fields(args) -> dict[str, Any]:
    """The fields every row of this shape has (its key among them)."""
    return {
        "size": size_label(args),
        "layers": args.layers,
        "hidden": args.hidden,
        "heads": args.heads,
        "vocab": args.vocab,
        "seq": args.seq,
        "batch": args.batch,
        "fraction": args.fraction,
        "params": gpt_params(args.layers, args.hidden, args.vocab, args.seq),
    }


def row_fields(args, kind: str, micro: int) -> dict[str, Any]:
    """A row's fields before anything is measured: its shape, kind, tokens and FLOPs."""
    sequences = micro * args.batch
    return shape_fields(args) | {
        "kind": kind,
        "micro_batches": micro,
        "tokens_per_step": sequences * args.seq,
        "flops_per_step": megatron_flops(args.layers, args.hidden, args.vocab, args.seq, sequences),
    }


def measure_kind(args, kind: str, write: Callable[[list[dict]], None]) -> list[dict]:
    """Build ``kind`` once, then time a training step at each micro-batch count; a row per
    count, each handed to ``write`` (with the rows before it) as soon as it ends."""
    on_gpu = torch.cuda.is_available()
    spec, why = choose_layer_spec(args.layer_spec)
    title = run_title(torch.device("cuda", 0) if on_gpu else torch.device("cpu"), megatron=True)
    device_name = torch.cuda.get_device_name(0) if on_gpu else "CPU"
    common = {
        "layer_spec": spec,
        "layer_spec_why": why,
        "device_name": device_name,
        "peak_tflops": peak_tflops(device_name, args.peak_tflops),
        "run": title,
    }
    say(f"{kind}: {size_label(args)}, layer spec {spec} ({why}); {title}")
    rows: list[dict] = []
    built_at = host_built = None
    t0 = time.perf_counter()
    try:
        built = build_kind(args, kind, spec)
        torch.cuda.synchronize()
        built_at = time.perf_counter()
        host_built = host_memory()["VmRSS"]
        common["build_s"] = built_at - t0
        common["params_built"] = built.params
        say(f"{kind}: built in {common['build_s']:.1f} s, host RSS {gib(host_built or 0):.1f} GiB")
    except Exception as exc:  # a kind that cannot build is a row per micro-batch count
        error = failed(exc)
        say(f"{kind}: build failed: {error['error'][:300]}")
        for micro in args.micro_batches:
            rows.append(row_fields(args, kind, micro) | common | error | memory_fields(None))
            write(rows)
        return rows
    for i, micro in enumerate(args.micro_batches):
        row = row_fields(args, kind, micro) | common
        row["host_rss_built_bytes"] = host_built
        try:
            if built.resize is not None and i > 0:
                built.resize(micro)
            row |= time_steps(args, kind, built, micro, built_at if i == 0 else None, spec)
            row |= built.info()
        except Exception as exc:  # an OOM at 16 micro-batches leaves the row at 8 standing
            row |= failed(exc)
            say(f"{kind} x{micro}: failed: {row['error'][:300]}")
            with contextlib.suppress(Exception):
                drain(built)
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()
        row |= memory_fields(built.optimizer)
        rows.append(row)
        write(rows)
    with contextlib.suppress(Exception):  # a failed row already said what went wrong
        drain(built)
    return rows


def memory_fields(opt) -> dict[str, Any]:
    """The host's resident set now and at its peak, the device's peaks, ours' pinned and
    state bytes (where ``opt`` has host mirrors)."""
    host = host_memory()
    out = {"host_rss_bytes": host["VmRSS"], "host_peak_bytes": host["VmHWM"]}
    return out | device_memory() | ({} if opt is None else offload_memory(opt))


def drain(built: Built) -> None:
    """Land a delayed update still in flight (ours), so the process can end cleanly."""
    if built.optimizer is not None:
        import megatron_ext

        megatron_ext.drain_offload(built.optimizer)


def time_steps(
    args, kind: str, built: Built, micro: int, built_at: float | None, layer_spec: str
) -> dict:
    """``--warmup`` then ``--steps`` training steps of ``micro`` micro-batches, each timed
    from the device drained to the device drained: the median, every timed step, the mean
    loss of the last, the delayed update's worker time where it reports one, and (for the
    first count, ``built_at`` given) the time from the build's end to the first step's."""
    data = offload_overlap.batches(args, micro)
    if layer_spec == "te":  # TE's attention is causal by its layer spec and takes no mask
        data = [(tokens, position, None, labels) for tokens, position, _, labels in data]
    seconds, worker = [], []
    out: dict[str, Any] = {}
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = built.step(data)
        torch.cuda.synchronize()
        end = time.perf_counter()
        if step == 0 and built_at is not None:
            out["first_step_s"] = end - built_at
        landed = offload_overlap.landed_updates(built.optimizer) if built.optimizer else []
        timed = step >= args.warmup
        if timed:
            seconds.append(end - start)
            if landed:
                worker.append(sum(x.worker_s for x in landed))
        say(f"{kind} x{micro}: step {step + 1}/{args.warmup + args.steps} {end - start:.3f} s"
            f"{'' if timed else ' (warm-up)'}")  # fmt: skip
    out["step_s"] = statistics.median(seconds)
    out["step_all_s"] = seconds
    out["loss"] = float(loss)
    if worker:
        out["worker_s"] = statistics.median(worker)
    return out


def run_row(args) -> list[dict]:
    """``--row KIND``: this process's one-rank group and megatron-core's parallel state,
    then :func:`measure_kind`; its rows go to ``--out`` as they end."""
    from megatron.core import parallel_state

    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    with contextlib.ExitStack() as stack:
        store = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "store"
        stack.enter_context(single_rank_process_group(f"file://{store}", backend=backend))
        parallel_state.initialize_model_parallel()
        stack.callback(parallel_state.destroy_model_parallel)
        return measure_kind(args, args.row, lambda rows: write_json(rows, args.out, NAME))


# --- the driver: one child process per kind ---------------------------------------------


def child_command(argv: list[str], kind: str, out: Path) -> list[str]:
    """The command that runs ``kind``'s rows in a fresh process, writing to ``out``: this
    script with the run's own arguments (its last ``--out`` and ``--row`` win)."""
    return [sys.executable, str(Path(__file__).resolve()), *argv, "--row", kind, "--out", str(out)]


@dataclass
class ChildEnd:
    """How a child ended: its rows, whether it ran past the limit, its exit status, and
    the last lines it printed."""

    rows: list[dict]
    timed_out: bool
    returncode: int | None
    tail: list[str]


def _read_rows(path: Path) -> list[dict]:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())
    return []


def run_child(
    cmd: list[str], out: Path, timeout_s: float, progress: Callable[[list[dict]], None]
) -> ChildEnd:
    """Run ``cmd`` (a ``--row`` process writing ``out/offload_scale.json``), its output
    echoed to stderr line by line; ``progress`` gets its rows each time they change; killed
    after ``timeout_s`` seconds."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        errors="replace",
    )  # fmt: skip
    tail: deque[str] = deque(maxlen=40)

    def pump() -> None:
        for line in proc.stdout:
            sys.stderr.write(line)
            sys.stderr.flush()
            tail.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    path, seen = out / f"{NAME}.json", None
    deadline, timed_out = time.monotonic() + timeout_s, False
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                timed_out = True
                proc.kill()
                break
            seen = _progress(path, seen, progress)
            time.sleep(0.5)
    finally:
        if proc.poll() is None:  # the driver itself is stopping: take the child with it
            proc.kill()
        proc.wait()
        reader.join(10)
    _progress(path, seen, progress)
    return ChildEnd(_read_rows(path), timed_out, proc.returncode, list(tail))


def _progress(path: Path, seen: float | None, progress: Callable[[list[dict]], None]):
    with contextlib.suppress(OSError):
        stamp = path.stat().st_mtime_ns
        if stamp != seen:
            progress(_read_rows(path))
            return stamp
    return seen


def missing_rows(args, kind: str, end: ChildEnd, timeout_s: float) -> list[dict]:
    """Rows for the micro-batch counts ``kind``'s process left without one: why."""
    have = {r["micro_batches"] for r in end.rows}
    if end.timed_out:
        why = f"timed out: the process ran past --row-timeout {timeout_s:g} s and was killed"
    elif end.returncode:
        from benchmarks.isolation import first_error_line

        code = end.returncode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
        if code == -signal.SIGKILL:
            how += " (the host's out-of-memory killer, if not a time limit)"
        line = first_error_line("\n".join(end.tail))
        why = f"crashed: {how}" + (f": {line}" if line else "")
    else:
        why = "the process ended without writing this row"
    return [row_fields(args, kind, m) | {"error": why} for m in args.micro_batches if m not in have]


class Stopped(Exception):
    """The driver was told to stop (SIGTERM: an outer time limit)."""


def _stop(signum, frame) -> None:
    raise Stopped(signal.Signals(signum).name)


def drive(args, argv: list[str], rows: list[dict], write: Callable[[list[dict]], None]) -> None:
    """Each selected kind in a child process, in order; ``rows`` (earlier runs' first)
    updated and written as the children's rows come; a stop (SIGTERM) ends the child and
    leaves a row saying so for every row not measured."""
    parts = args.out / f"{NAME}-rows"
    previous = signal.signal(signal.SIGTERM, _stop)
    todo = list(args.kinds)
    try:
        while todo:
            kind = todo[0]
            say(f"{kind}: starting its process (limit {args.row_timeout:g} s)")
            out = parts / kind
            shutil.rmtree(out, ignore_errors=True)

            def progress(got: list[dict], kind=kind) -> None:
                merge(rows, got)
                write(rows)

            end = run_child(child_command(argv, kind, out), out, args.row_timeout, progress)
            merge(rows, end.rows + missing_rows(args, kind, end, args.row_timeout))
            write(rows)
            shutil.rmtree(out, ignore_errors=True)
            todo.pop(0)
    except Stopped as stop:
        say(f"stopped by {stop}: the rows not measured say so")
        why = f"not measured: the run was stopped ({stop}) before this row ended"
        have = {row_key(r) for r in rows}
        for kind in todo:
            merge(rows, [
                row_fields(args, kind, m) | {"error": why}
                for m in args.micro_batches
                if row_key(row_fields(args, kind, m)) not in have
            ])  # fmt: skip
        write(rows)
    finally:
        signal.signal(signal.SIGTERM, previous)
        with contextlib.suppress(OSError):
            parts.rmdir()  # only when empty: a stopped run leaves its children's rows


def row_key(row: dict) -> tuple:
    return tuple(row.get(k) for k in ROW_KEY)


def merge(rows: list[dict], new: list[dict]) -> None:
    """Put ``new`` into ``rows``: a row of the same key (:data:`ROW_KEY`) is replaced in
    place, others are appended; then the derived columns (:func:`derive`)."""
    where = {row_key(r): i for i, r in enumerate(rows)}
    for row in new:
        i = where.get(row_key(row))
        if i is None:
            where[row_key(row)] = len(rows)
            rows.append(dict(row))
        else:
            rows[i] = dict(row)
    derive(rows)


def derive(rows: list[dict]) -> None:
    """Tokens per second, model TFLOPS, MFU (against the row's ``peak_tflops``) and
    ``kept`` (the ``fwd_bwd`` step time of the same shape and micro-batch count over the
    row's) of every row that has a step time."""
    ceiling = {
        row_key(r | {"kind": None}): r["step_s"]
        for r in rows
        if r["kind"] == "fwd_bwd" and "step_s" in r
    }
    for r in rows:
        for key in ("tokens_per_s", "model_tflops", "mfu", "kept"):
            r.pop(key, None)
        if "step_s" not in r:
            continue
        r["tokens_per_s"] = r["tokens_per_step"] / r["step_s"]
        r["model_tflops"] = r["flops_per_step"] / r["step_s"] / 1e12
        if r.get("peak_tflops"):
            r["mfu"] = r["model_tflops"] / r["peak_tflops"]
        fwd_bwd = ceiling.get(row_key(r | {"kind": None}))
        if fwd_bwd is not None:
            r["kept"] = fwd_bwd / r["step_s"]


# --- command line, table, plot ----------------------------------------------------------


def size_label(args) -> str:
    """The ``--size`` whose shape this is, else ``LxH``."""
    shape = (args.layers, args.hidden, args.heads)
    return next((name for name, s in SIZES.items() if s == shape), f"{args.layers}x{args.hidden}")


def parse_args(argv: list[str] | None):
    """The command line; the shape from ``--size`` where ``--layers/--hidden/--heads``
    leave it."""
    ap = base_parser(__doc__, timed=False)
    ap.add_argument(
        "--size", choices=list(SIZES), default="0.35b",
        help="GPT-3's shape (layers x hidden, heads): "
        + ", ".join(f"{k} {v[0]}x{v[1]} {v[2]}" for k, v in SIZES.items())
        + " (default: %(default)s)",
    )  # fmt: skip
    for name, meaning in (("--layers", "layers"), ("--hidden", "hidden size"),
                          ("--heads", "attention heads")):  # fmt: skip
        ap.add_argument(name, type=int, default=None, help=f"{meaning} (default: --size's)")
    for name, default, meaning in (
        ("--vocab", 50304, "vocabulary size (GPT-2's 50257 padded to a multiple of 128)"),
        ("--seq", 2048, "sequence length"),
        ("--batch", 1, "sequences per micro-batch"),
        ("--steps", 3, "timed training steps per micro-batch count"),
        ("--warmup", 2, "untimed training steps first (the delayed update's warm-up among them)"),
    ):
        ap.add_argument(name, type=int, default=default, help=f"{meaning} (default: %(default)s)")
    ap.add_argument(
        "--micro-batches", type=int, nargs="+", default=[8, 16],
        help="micro-batches per training step, each a row (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--kinds", nargs="*", choices=KINDS, default=list(KINDS),
        help="which kinds to run, each in its own process, in this order (default: all; "
        "none: only --merge's rows)",
    )  # fmt: skip
    ap.add_argument(
        "--fraction", type=float, default=1.0,
        help="the offloaded kinds' offload fraction (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--layer-spec", choices=["auto", "te", "local"], default="auto",
        help="transformer-engine's layers or megatron-core's local ones; auto: TE where it "
        "imports on a GPU (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--peak-tflops", type=float, default=None,
        help="dense bf16 peak for MFU (default: by the GPU's name: "
        + ", ".join(f"{k} {v:g}" for k, v in PEAK_TFLOPS) + "; else no MFU)",
    )  # fmt: skip
    ap.add_argument(
        "--row-timeout", type=float, default=900.0,
        help="seconds one kind's process may take, build included (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--merge", type=Path, nargs="*", default=[],
        help="earlier runs' offload_scale.json: their rows join the table, rows measured now "
        "replace theirs (default: none)",
    )  # fmt: skip
    ap.add_argument("--lr", type=float, default=3e-4, help="Adam's lr (default: %(default)s)")
    ap.set_defaults(min_lr=None)  # offload_overlap.build's: a tenth of --lr, no schedule here
    ap.add_argument(
        "--row", choices=KINDS, default=None,
        help="run this one kind in this process, writing its rows to --out (what the driver "
        "starts each process with; default: drive every --kinds in processes of their own)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    layers, hidden, heads = SIZES[args.size]
    args.layers = layers if args.layers is None else args.layers
    args.hidden = hidden if args.hidden is None else args.hidden
    args.heads = heads if args.heads is None else args.heads
    if args.hidden % args.heads:
        ap.error(f"--heads {args.heads} does not divide --hidden {args.hidden}: pick heads that do")
    if min(args.micro_batches) < 1:
        ap.error(f"--micro-batches {args.micro_batches}: every count must be 1 or more")
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: at least one timed step")
    if not 0.0 < args.fraction <= 1.0:
        ap.error(f"--fraction {args.fraction}: an offload fraction in (0, 1]")
    return args


def _gib(value: float) -> str:
    return f"{gib(value):.1f}"


COLUMNS = [
    Column("size", "size"),
    Column("kind", "kind"),
    Column("micro", "micro_batches"),
    Column("step s", "step_s", lambda v: f"{v:.3f}", "median, device drained around it"),
    Column("tokens/s", "tokens_per_s", lambda v: f"{v:,.0f}"),
    Column("TFLOPS", "model_tflops", lambda v: f"{v:.1f}", "model FLOPs (Megatron-LM's) / step s"),
    Column("MFU", "mfu", lambda v: f"{v:.1%}", "TFLOPS / the GPU's dense bf16 peak"),
    Column("kept", "kept", lambda v: f"{v:.0%}", "fwd_bwd step s / this row's"),
    Column("GPU peak", "gpu_peak_bytes", _gib, "GiB allocated at most in the row's process"),
    Column("host peak", "host_peak_bytes", _gib, "GiB, the process's VmHWM at the row's end"),
    Column("host built", "host_rss_built_bytes", _gib, "GiB resident (VmRSS) after the build"),
    Column("host state", "host_state_bytes", _gib, "GiB of ours' offloaded state and staging"),
    Column("pinned", "pinned_bytes", _gib, "GiB, ours' host mirrors (host_mirror_stats)"),
    Column("pinned alloc", "pinned_alloc_bytes", _gib, "GiB held by torch's pinned allocator"),
    Column("build s", "build_s", lambda v: f"{v:.1f}", "model, DDP, optimizer, pinning"),
    Column("first s", "first_step_s", lambda v: f"{v:.1f}", "build's end to first step's end"),
    Column("status", "error", lambda v: str(v)[:70], "empty: ran"),
]


def _plot(rows: list[dict], args, title: str):
    fig, axes = new_figure(2, width=7)
    ran = [r for r in rows if "step_s" in r]
    if not ran:
        empty_panel(axes[0], "no row ran (see the status column)")
    else:
        micros = sorted({r["micro_batches"] for r in ran})
        kinds = [k for k in KINDS if any(r["kind"] == k for r in ran)]
        width = 0.8 / len(micros)
        for j, micro in enumerate(micros):
            xs, ys = [], []
            for i, kind in enumerate(kinds):
                got = [r for r in ran if r["kind"] == kind and r["micro_batches"] == micro]
                if got:
                    xs.append(i + j * width)
                    ys.append(got[0]["tokens_per_s"])
            axes[0].bar(xs, ys, width=width, label=f"{micro} micro-batches")
        axes[0].set_xticks([i + width * (len(micros) - 1) / 2 for i in range(len(kinds))])
        axes[0].set_xticklabels(kinds, rotation=30, fontsize=7)
        axes[0].set_ylabel("tokens / s")
        axes[0].set_title(f"GPT {size_label(args)} ({args.layers}x{args.hidden}), seq {args.seq}")
        axes[0].legend(fontsize=7)
    measured = [r for r in rows if r.get("gpu_peak_bytes") or r.get("host_peak_bytes")]
    if not measured:
        empty_panel(axes[1], "no memory measured")
    else:
        kinds = [k for k in KINDS if any(r["kind"] == k for r in measured)]
        for j, (key, label) in enumerate(
            (("gpu_peak_bytes", "GPU peak"), ("host_peak_bytes", "host peak RSS"))
        ):
            peak = [gib(max((r.get(key) or 0) for r in measured if r["kind"] == k)) for k in kinds]
            axes[1].bar([i + j * 0.4 for i in range(len(kinds))], peak, width=0.4, label=label)
        axes[1].set_xticks([i + 0.2 for i in range(len(kinds))])
        axes[1].set_xticklabels(kinds, rotation=30, fontsize=7)
        axes[1].set_ylabel("GiB (largest over its rows)")
        axes[1].set_title("memory per kind")
        axes[1].legend(fontsize=7)
    return save_figure(fig, args.out, NAME, title)


def main(argv: list[str] | None = None) -> list[dict]:
    """``--row KIND``: measure one kind here. Otherwise: every ``--kinds`` in a process of
    its own (nothing measured on the CPU), the JSON written after every row, then the PNG
    and the table. Returns the rows."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.row is not None:
        return run_row(args)
    rows: list[dict] = []
    for path in args.merge:
        merge(rows, json.loads(path.read_text()))

    def write(current: list[dict]) -> None:
        write_json(current, args.out, NAME)

    shape = size_label(args)
    say(
        f"{shape} ({args.layers} layers x {args.hidden}, {args.heads} heads, "
        f"{gpt_params(args.layers, args.hidden, args.vocab, args.seq) / 1e9:.2f}B parameters), "
        f"seq {args.seq}, micro-batch {args.batch}, micro-batches {args.micro_batches}; "
        f"kinds {' '.join(args.kinds) or 'none'}"
    )
    if args.device == "cpu":
        merge(rows, [
            row_fields(args, kind, m) | {"error": SKIPPED_ON_CPU}
            for kind in args.kinds
            for m in args.micro_batches
        ])  # fmt: skip
        write(rows)
    elif args.kinds:
        drive(args, argv, rows, write)
    else:
        write(rows)
    title = next((r["run"] for r in rows if r.get("run")), None) or run_title(
        torch.device("cpu"), megatron=True
    )
    png_path = _plot(rows, args, title)
    print(format_table(rows, COLUMNS))
    spec = {r.get("layer_spec") for r in rows if r.get("layer_spec")}
    peak = {r.get("peak_tflops") for r in rows if r.get("layer_spec")}
    print(
        "model FLOPs per sequence of s tokens (Megatron-LM's num_floating_point_operations for "
        "this GPT): s * (72 L h^2 + 6 h V) + 6 L h s^2; MFU against "
        + (", ".join(f"{p:g} TFLOPS" for p in peak if p) or "no known peak (--peak-tflops)")
        + "; layer spec "
        + (", ".join(sorted(spec)) or "none built")
    )
    print(f"wrote {args.out / f'{NAME}.json'} and {png_path}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
