"""Offloaded training end to end: time per training step with several micro-batches, the
host step exact or delayed, against the GPU-resident precision-aware optimizer; and the cost
of the delay in loss.

A ``GPTModel`` (``benchmarks/train_step.py``'s, fp32 islands on every layer) on one GPU.
One training step: gradients zeroed, ``--micro-batches`` forward and backward passes
accumulating into the gradient buffers, the gradient sync, ``optimizer.step()``. Timed from
the device drained before to the device drained after (the host worker of a delayed update
may still run: that is the overlap). Configurations, per micro-batch count:

- ``gpu_resident``: the precision-aware optimizer, no offload (ours: stock's is the same
  step; its norm and clip are ``train_step``'s subject);
- ``stock_offload_F``: stock megatron-core's CPU offload at fraction F, the fp32 islands in
  bf16 (with them it cannot build);
- ``exact_offload_F``: ours, the chunked step in series with the GPU;
- ``overlapped_offload_F``: ours, the same exact step with its host update beside the next
  forward pass, which waits per module for the chunks it reads
  (``offload_overlap_forward``);
- ``delayed_offload_F``: ours, the host update one step late (``offload_delayed_update``),
  its worker on every usable core but one (the default);
- ``delayed_offload_F_threads_N`` (first fraction only, ``--thread-variants``): the same
  with its worker on N threads; N every usable core: the thread launching the GPU's work
  competing with the worker for them;
- ``delayed_offload_F_pinned`` (first fraction only, unless ``--no-pinned``): the default
  worker pinned (``offload_pin_threads``) to every usable core but the first, which the
  launching thread then has to itself.

``kept``: the GPU-resident step time over the configuration's (the throughput kept).
``fwd_bwd``: the device time from the step's start to the end of its gradient sync (CUDA
events, no synchronization added): where it exceeds the GPU-resident one, the forward and
backward themselves were slowed (a starved launching thread, copies competing for memory).
For a delayed or overlapped row, ``worker``: the host update's wall time on its worker;
``land wait``: how long the next step waited for it (on the critical path when above
zero); ``d2h wait``: how much of the worker's time went waiting for the gradients' copies
to the host (the device finishing the backward pass, the norm and the clip before them
included).

``--loss-steps N`` also trains N steps of each loss task (``--loss-tasks``; fraction 1.0,
one micro-batch) from the same start on the same batches, four ways: ours exact and
delayed, and, as an independent reference, the GPU-resident optimizer exact and with its
forward and backward reading the parameters one step late (:class:`Lagged`: the previous
step's values swapped in around them, the same warm-up). The loss is next-token
prediction: each sample is drawn one token longer than ``--seq``, the inputs are its first
``--seq`` tokens and the labels its last (Megatron's convention). The lr is constant, or
warms up and decays as Megatron-LM's training loop schedules it (``--lr-warmup-steps``,
``--lr-decay-style``, ``--min-lr``: megatron-core's ``OptimizerParamScheduler``). Tasks:
``markov``, fresh batches of a fixed random Markov chain over ``--markov-states`` tokens
with 4 successors each (its entropy is the loss floor); ``memorize``, ``--loss-batches``
fixed batches of random tokens cycled: the next tokens are random, learnable only by
memorizing the fixed batches (progress per step is large, so is the cost of a stale
gradient). ``--loss-curves`` trains some of the four only. The summary
compares the mean loss of the last 50 steps, delayed against exact, ours and the
reference's.

CUDA only: megatron-core's DDP and optimizers allocate on CUDA.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, find the repo

import torch

from benchmarks.common import (
    Column,
    base_parser,
    empty_panel,
    error_fields,
    format_table,
    fraction,
    gib,
    new_figure,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    run_title,
    save_figure,
    single_rank_process_group,
    write_json,
)

NAME = "offload_overlap"
PA = dict(use_precision_aware_optimizer=True)


def configs(
    fractions, thread_variants=None, pinned: bool = True, overlap_threads=()
) -> list[tuple[str, dict, dict | None]]:
    """(label, OptimizerConfig overrides, MegatronOptions fields or None for stock);
    ``thread_variants``: the delayed worker's thread counts to measure at the first fraction
    (None: every usable core); ``pinned``: also the default worker pinned there;
    ``overlap_threads``: the overlapped step's thread counts to measure there (its default:
    torch's setting)."""
    delayed = dict(offload_step="chunked", offload_delayed_update=True, offload_delay_warmup=1)
    overlapped = dict(offload_step="chunked", offload_overlap_forward=True)
    out: list[tuple[str, dict, dict | None]] = [("gpu_resident", PA, {})]
    for f in fractions:
        offload = PA | dict(optimizer_cpu_offload=True, optimizer_offload_fraction=f)
        out.append((f"stock_offload_{f}", offload, None))
        out.append((f"exact_offload_{f}", offload, dict(offload_step="chunked")))
        out.append((f"overlapped_offload_{f}", offload, dict(overlapped)))
        out.append((f"delayed_offload_{f}", offload, dict(delayed)))
    if fractions:  # other worker sizes; every core: none left to the launching thread
        from megatron_ext.offload.threads import usable_cores

        f = fractions[0]
        offload = PA | dict(optimizer_cpu_offload=True, optimizer_offload_fraction=f)
        for n in [usable_cores()] if thread_variants is None else thread_variants:
            out.append(
                (f"delayed_offload_{f}_threads_{n}", offload, delayed | {"offload_threads": n})
            )
        if pinned:
            out.append(
                (f"delayed_offload_{f}_pinned", offload, delayed | {"offload_pin_threads": True})
            )
        for n in overlap_threads:
            out.append(
                (
                    f"overlapped_offload_{f}_threads_{n}",
                    offload,
                    overlapped | {"offload_threads": n},
                )
            )
    return out


KINDS = ("gpu_resident", "stock", "exact", "overlapped", "delayed")


def kind_of(label: str) -> str:
    """Which of :data:`KINDS` a configuration of :func:`configs` is."""
    kind = label.split("_offload", 1)[0]
    if kind not in KINDS:
        raise ValueError(f"no kind for configuration {label!r}")
    return kind


def selected_configs(args) -> list[tuple[str, dict, dict | None]]:
    """:func:`configs` for the arguments, of the kinds ``--kinds`` names."""
    return [
        c
        for c in configs(args.fractions, args.thread_variants, args.pinned, args.overlap_threads)
        if kind_of(c[0]) in args.kinds
    ]


def build(args, overrides: dict, options: dict | None, layer_spec: str = "local"):
    """The model in megatron-core's DDP and its optimizer: ``overrides`` of the
    ``OptimizerConfig``; ``options``: ours (``MegatronOptions`` fields, fp32 islands) or None
    for stock (islands in bf16); ``layer_spec``: :data:`benchmarks.train_step.LAYER_SPECS`."""
    import megatron_ext
    from benchmarks.train_step import _model

    config, module = _model(args, fp32_islands=options is not None, layer_spec=layer_spec)
    stack = megatron_ext.build_stack(
        module,
        config,
        per_dtype_grad_buffers=options is not None,
        optimizer=dict(
            optimizer="adam",
            lr=args.lr,
            min_lr=min_lr(args),
            bf16=True,
            clip_grad=1.0,
            **overrides,
        ),  # fmt: skip
        options=None if options is None else megatron_ext.MegatronOptions(**options),
    )
    return stack.model, stack.optimizer


def batches(args, count: int, device="cuda") -> list[tuple[torch.Tensor, ...]]:
    """``count`` fixed micro-batches (tokens, positions, causal mask, labels), from one seed.
    Each sample is drawn with ``args.seq + 1`` tokens: the inputs are its first ``args.seq``,
    the labels its last ``args.seq`` (the next token of each input, Megatron's convention)."""
    g = torch.Generator(device=device).manual_seed(1)
    position = torch.arange(args.seq, device=device).expand(args.batch, -1)
    # Megatron's convention: True marks a masked-out (future) position.
    mask = torch.ones(1, 1, args.seq, args.seq, device=device, dtype=torch.bool).triu(1)
    out = []
    for _ in range(count):
        sample = torch.randint(
            0, args.vocab, (args.batch, args.seq + 1), device=device, generator=g
        )
        out.append((sample[:, :-1], position, mask, sample[:, 1:]))
    return out


def train_step(model, opt, micro: list, synced=None, lag: Lagged | None = None) -> torch.Tensor:
    """One training step over the micro-batches ``micro``; the mean loss (a device tensor).
    ``opt``: None for forward and backward alone (gradients synced, no optimizer step);
    ``synced``: a CUDA event recorded once the gradients are synced; ``lag``: forward and
    backward read the parameters one step late (:class:`Lagged`)."""
    model.zero_grad_buffer()
    if opt is not None:
        opt.zero_grad()
    total = torch.zeros((), device=micro[0][0].device)
    with lag.late_values() if lag is not None else _nothing():
        for i, (tokens, position, mask, labels) in enumerate(micro):
            sync = model.no_sync() if i < len(micro) - 1 else _nothing()
            with sync:
                loss = model(tokens, position, mask, labels=labels).float().mean() / len(micro)
                loss.backward()
            total += loss.detach()
        model.finish_grad_sync()
    if synced is not None:
        synced.record()
    if opt is None:
        return total
    if lag is not None:
        lag.before_step()
    opt.step()
    if lag is not None:
        lag.after_step()
    return total


class Lagged:
    """Forward and backward read each parameter's value of one step before (ZeRO-Offload's
    one-step delayed update), on any optimizer: a reference for the delayed offloaded
    update that shares no code with it.

    The parameters always hold the optimizer's latest values, except inside
    :meth:`late_values`, which swaps in the values they held before the last step (from
    the step numbered ``warmup`` on: the steps before run exact) and swaps the latest back
    after. So step t's gradients are computed at the values step t-2 left, and step t
    updates the values step t-1 left: the optimizer's masters (fp32 parameters stepped in
    place included) never see the late values.
    """

    def __init__(self, params, warmup: int) -> None:
        self.params = list(params)
        self.warmup, self.taken = warmup, 0
        self.late: list[torch.Tensor] | None = None
        self.before: list[torch.Tensor] | None = None

    def _snapshot(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params]

    def _load(self, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, v in zip(self.params, values, strict=True):
                p.copy_(v)

    def late_values(self):
        lag = self

        class _Swap:
            def __enter__(self):
                self.latest = None
                if lag.late is not None:
                    self.latest = lag._snapshot()
                    lag._load(lag.late)

            def __exit__(self, *exc):
                if self.latest is not None:
                    lag._load(self.latest)
                return False

        return _Swap()

    def before_step(self) -> None:
        self.before = self._snapshot()

    def after_step(self) -> None:
        self.taken += 1
        self.late = self.before if self.taken > self.warmup else None
        self.before = None


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def measure(args, label: str, overrides: dict, options: dict | None, micro: int) -> dict:
    import megatron_ext

    row = {
        "config": label,
        "micro_batches": micro,
        "variant": "stock" if options is None else "ours",
    }
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    row["baseline_gib"] = gib(torch.cuda.memory_allocated())  # left by earlier configurations
    model = opt = None
    try:
        model, opt = build(args, overrides, options)
        data = batches(args, micro)
        seconds, fwd_bwd, worker, wait, d2h = [], [], [], [], []
        threads = None  # the worker's at the last timed step: where the tuner had got to
        for step in range(args.warmup + args.steps):
            start, synced = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            start.record()
            train_step(model, opt, data, synced)
            torch.cuda.synchronize()
            if step >= args.warmup:
                seconds.append(time.perf_counter() - t0)
                fwd_bwd.append(start.elapsed_time(synced))
                landed = landed_updates(opt)  # the update this step landed (the last one's)
                if landed:
                    worker.append(1e3 * sum(x.worker_s for x in landed))
                    wait.append(1e3 * sum(x.wait_s for x in landed))
                    d2h.append(1e3 * sum(x.d2h_wait_s for x in landed))
                    threads = max((x.threads or 0) for x in landed)
        megatron_ext.drain_offload(opt)
        row["step_ms"] = 1e3 * statistics.median(seconds)
        row["fwd_bwd_ms"] = statistics.median(fwd_bwd)
        if worker:
            row["worker_ms"] = statistics.median(worker)
            row["land_wait_ms"] = statistics.median(wait)
            row["d2h_wait_ms"] = statistics.median(d2h)
            row["worker_threads"] = threads
        row["peak_gib"] = gib(torch.cuda.max_memory_allocated())
    except Exception as exc:  # a configuration that cannot run is a result
        row.update(error_fields(exc))
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return row


def landed_updates(opt) -> list:
    """The delayed updates the last step landed, one per offloading optimizer of the chain
    (``HostMirrorHybridOptimizer.last_landed``), each read once."""
    out = []
    for child in getattr(opt, "chained_optimizers", [opt]):
        hdo = getattr(child, "optimizer", None)
        landed = getattr(hdo, "last_landed", None)
        if landed is not None:
            out.append(landed)
            hdo.last_landed = None
    return out


def markov_tokens(states: int, successors: int, rows: int, seq: int, seed: int, device):
    """``rows`` sequences of a fixed random Markov chain over tokens ``0..states-1``: each
    token has ``successors`` possible next tokens, with Dirichlet(1) probabilities. Returns
    (tokens [rows, seq], the chain's mean conditional entropy per token in nats)."""
    g = torch.Generator(device=device).manual_seed(seed)
    nxt = torch.randint(0, states, (states, successors), generator=g, device=device)
    weights = -torch.log(torch.rand(states, successors, generator=g, device=device))
    probs = weights / weights.sum(dim=1, keepdim=True)
    tokens = torch.empty(rows, seq, dtype=torch.long, device=device)
    tokens[:, 0] = torch.randint(0, states, (rows,), generator=g, device=device)
    for i in range(1, seq):
        prev = tokens[:, i - 1]
        pick = torch.multinomial(probs[prev], 1, generator=g).squeeze(1)
        tokens[:, i] = nxt[prev, pick]
    entropy = float(-(probs * probs.log()).sum(dim=1).mean())
    return tokens, entropy


def task_batches(args, task: str, device="cuda") -> tuple[list, float | None]:
    """Per loss step its micro-batch (tokens, positions, causal mask, labels: the next
    tokens), and the loss floor where the task has one (the Markov chain's entropy)."""
    if task == "memorize":
        data = batches(args, args.loss_batches, device)
        return [data[step % len(data)] for step in range(args.loss_steps)], None
    sample, entropy = markov_tokens(
        args.markov_states, 4, args.loss_steps * args.batch, args.seq + 1, 2, device
    )
    _, position, mask, _ = batches(args, 1, device)[0]
    out = []
    for s in range(args.loss_steps):
        rows = sample[s * args.batch : (s + 1) * args.batch]
        out.append((rows[:, :-1], position, mask, rows[:, 1:]))
    return out, entropy


CURVES = ("exact", "delayed", "resident_exact", "resident_delayed")


def loss_curves(args, task: str, progress=None) -> dict:
    """The curves of :data:`CURVES` asked for (``--loss-curves``) from the same start over
    the same batches: per-step losses and lrs, and the mean of the last 50 steps, delayed
    against exact. ``progress``: called with the summary so far after each curve (a long
    run cut short keeps the curves it finished)."""
    import megatron_ext

    curves, lrs = {}, {}
    offload = PA | dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)
    data, floor = task_batches(args, task)
    for name in (c for c in CURVES if c in args.loss_curves):
        delayed = name.endswith("delayed")
        if name.startswith("resident"):
            model, opt = build(args, PA, {})
            lag = Lagged(model.parameters(), args.delay_warmup) if delayed else None
        else:
            options = dict(offload_step="chunked", offload_delayed_update=delayed)
            if delayed:
                options["offload_delay_warmup"] = args.delay_warmup
            model, opt = build(args, offload, options)
            lag = None
        schedule = lr_schedule(args, opt)
        losses, lrs[name] = [], []
        for micro in data:
            lrs[name].append(float(opt.param_groups[0]["lr"]))
            losses.append(train_step(model, opt, [micro], lag=lag))
            if schedule is not None:
                schedule.step(1)
        megatron_ext.drain_offload(opt)
        curves[name] = [float(x) for x in losses]
        print(f"{NAME}: {task} {name}: last loss {curves[name][-1]:.4f}", file=sys.stderr)
        del model, opt, lag
        gc.collect()
        torch.cuda.empty_cache()
        if progress is not None:
            progress(_loss_summary(args, curves, lrs, floor))
    return _loss_summary(args, curves, lrs, floor)


def _loss_summary(args, curves: dict, lrs: dict, floor: float | None) -> dict:
    tail = min(50, args.loss_steps)
    last = {k: statistics.fmean(v[-tail:]) for k, v in curves.items()}

    def relative(late: str, exact: str) -> float | None:
        if late not in last or exact not in last:
            return None
        return (last[late] - last[exact]) / last[exact]

    return {
        "losses": curves,
        "lr": lrs,
        "last_mean": last,
        "last_relative": relative("delayed", "exact"),
        "resident_relative": relative("resident_delayed", "resident_exact"),
        "last_steps": tail,
        "floor": floor,
        "schedule": _schedule_words(args),
    }


def lr_schedule(args, opt):
    """megatron-core's ``OptimizerParamScheduler`` over the loss curve's steps, as
    Megatron-LM's training loop drives it (``step(1)`` after each optimizer step; the lr of
    step 0 is the warm-up's start, 0), or None for a constant lr (no warm-up, constant
    decay)."""
    if not lr_scheduled(args):
        return None
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    wd = float(opt.param_groups[0]["weight_decay"])
    return OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=min_lr(args),
        lr_warmup_steps=args.lr_warmup_steps,
        lr_decay_steps=args.loss_steps,
        lr_decay_style=args.lr_decay_style,
        start_wd=wd,
        end_wd=wd,
        wd_incr_steps=args.loss_steps,
        wd_incr_style="constant",
    )


def parse_args(argv: list[str] | None):
    from benchmarks.train_step import MODEL_SIZES  # its model, so its sizes

    ap = base_parser(__doc__, timed=False)
    for name, default, meaning, kind in (
        *((*size, positive_int) for size in MODEL_SIZES),
        ("--steps", 5, "timed training steps per configuration", positive_int),
        ("--warmup", 3, "untimed training steps first (the delayed update's warm-up among them)",
         non_negative_int),
        ("--loss-steps", 0, "steps of each loss curve (0: none; 200 or more to compare)",
         non_negative_int),
        ("--loss-batches", 16, "fixed micro-batches the loss curves cycle through", positive_int),
        ("--delay-warmup", 10, "exact steps before the delayed loss curve's delay starts",
         non_negative_int),
        ("--markov-states", 1024, "tokens the markov loss task's chain moves over (at most "
         "--vocab)", positive_int),
    ):  # fmt: skip
        ap.add_argument(name, type=kind, default=default, help=f"{meaning} (default: %(default)s)")
    ap.add_argument(
        "--micro-batches", type=positive_int, nargs="*", default=[1, 4, 8],
        help="micro-batches per training step (default: %(default)s; none: only the loss "
        "curves)",
    )  # fmt: skip
    ap.add_argument(
        "--fractions", type=fraction, nargs="+", default=[1.0, 0.5],
        help="offload fractions, each in (0, 1] (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--loss-tasks", nargs="+", choices=["markov", "memorize"], default=["markov", "memorize"],
        help="what the loss curves train on (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--thread-variants", type=positive_int, nargs="*", default=None,
        help="the delayed worker's thread counts also measured at the first fraction "
        "(default: every usable core)",
    )  # fmt: skip
    ap.add_argument(
        "--overlap-threads", type=positive_int, nargs="*", default=[],
        help="the overlapped step's thread counts also measured at the first fraction "
        "(default: none; its own default is torch's setting)",
    )  # fmt: skip
    ap.add_argument(
        "--no-pinned", dest="pinned", action="store_false",
        help="leave out the delayed worker pinned off the launching thread's core (default: "
        "measured, at the first fraction)",
    )  # fmt: skip
    ap.add_argument(
        "--kinds", nargs="+", choices=KINDS, default=list(KINDS),
        help="which kinds of configuration to time (default: all)",
    )  # fmt: skip
    ap.add_argument(
        "--loss-curves", nargs="+", choices=CURVES, default=list(CURVES),
        help="which of the loss curves to train (default: all four)",
    )  # fmt: skip
    ap.add_argument(
        "--lr", type=positive_float, default=3e-4, help="Adam's lr (default: %(default)s)"
    )
    ap.add_argument(
        "--lr-warmup-steps", type=non_negative_int, default=0,
        help="loss curves: the lr rises linearly from 0 over these steps (default: "
        "%(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--lr-decay-style", choices=["constant", "linear", "cosine"], default="constant",
        help="loss curves: then decays to --min-lr at the last step, megatron-core's "
        "OptimizerParamScheduler (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--min-lr", type=non_negative_float, default=None,
        help="loss curves: where a decaying lr ends (default: a tenth of --lr)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.markov_states > args.vocab:
        ap.error(
            f"argument --markov-states: {args.markov_states} tokens, more than --vocab {args.vocab}"
        )
    if 0 < args.loss_steps <= args.lr_warmup_steps:
        ap.error(
            f"--lr-warmup-steps {args.lr_warmup_steps} must be fewer than --loss-steps "
            f"{args.loss_steps}"
        )
    return args


def add_kept(rows: list[dict]) -> None:
    """Each row's ``kept``: the GPU-resident step time at its micro-batch count over its own."""
    resident = {
        r["micro_batches"]: r["step_ms"]
        for r in rows
        if r["config"] == "gpu_resident" and "step_ms" in r
    }
    for r in rows:
        if "step_ms" in r and r["micro_batches"] in resident:
            r["kept"] = resident[r["micro_batches"]] / r["step_ms"]


def main(argv: list[str] | None = None) -> dict:
    """Measure, write JSON and PNG, print the table; CUDA only."""
    args = parse_args(argv)
    if args.device != "cuda" or not torch.cuda.is_available():
        raise SystemExit(
            "offload_overlap needs CUDA (megatron-core's DDP and optimizers allocate on CUDA): "
            f"nothing measured, nothing written to {args.out}"
        )
    torch.cuda.set_device(0)
    title = run_title(torch.device("cuda", 0), megatron=True)
    print(title, file=sys.stderr)
    result: dict = {"rows": [], "loss": None}
    with single_rank_process_group("tcp://127.0.0.1:29543"):
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel()
        for micro in args.micro_batches:
            for label, overrides, options in selected_configs(args):
                row = measure(args, label, overrides, options, micro)
                result["rows"].append(row)
                add_kept(result["rows"])
                print(f"{NAME}: {label} x{micro}: {row.get('step_ms', row.get('error'))}",
                      file=sys.stderr)  # fmt: skip
                write_json([result], args.out, NAME)
        if args.loss_steps > 0:
            result["loss"] = {}
            for task in args.loss_tasks:

                def progress(partial: dict, task=task) -> None:
                    result["loss"][task] = partial
                    write_json([result], args.out, NAME)

                try:
                    result["loss"][task] = loss_curves(args, task, progress)
                except Exception as exc:  # the timings above stand; the failure is shown
                    result.setdefault("loss_error", {})[task] = error_fields(exc)
                    print(f"{NAME}: {task} loss curves failed: {exc}", file=sys.stderr)
                write_json([result], args.out, NAME)
        parallel_state.destroy_model_parallel()
    png_path = _plot(result, args, title)
    print(format_table(result["rows"], COLUMNS))
    for task, error in result.get("loss_error", {}).items():
        print(f"{task} loss curves failed: {error}")
    for task, loss in (result["loss"] or {}).items():
        means = ", ".join(f"{k} {v:.4f}" for k, v in loss["last_mean"].items())
        floor = "" if loss["floor"] is None else f"; the task's floor {loss['floor']:.4f}"
        print(
            f"{task} loss, mean of the last {loss['last_steps']} steps: {means}; delayed vs "
            f"exact {_percent(loss['last_relative'])} (the reference's "
            f"{_percent(loss['resident_relative'])}){floor}"
        )
    print(f"wrote {args.out / f'{NAME}.json'} and {png_path}", file=sys.stderr)
    return result


COLUMNS = [
    Column("config", "config"),
    Column("micro-batches", "micro_batches"),
    Column("step ms", "step_ms", lambda v: f"{v:.1f}", "median, device drained around it"),
    Column("kept", "kept", lambda v: f"{v:.0%}", "GPU-resident step time / this one"),
    Column("fwd+bwd ms", "fwd_bwd_ms", lambda v: f"{v:.1f}", "device time, step start to synced"),
    Column("worker ms", "worker_ms", lambda v: f"{v:.1f}", "on a worker: the host update's time"),
    Column("land wait ms", "land_wait_ms", lambda v: f"{v:.1f}", "on a worker: waited for it"),
    Column("d2h wait ms", "d2h_wait_ms", lambda v: f"{v:.1f}", "worker: waiting for grads"),
    Column("threads", "worker_threads", str, "a worker's, at the last step (0: torch's)"),
    Column("peak GiB", "peak_gib", lambda v: f"{v:.2f}", "peak allocated while it ran"),
    Column("baseline GiB", "baseline_gib", lambda v: f"{v:.2f}", "allocated before it was built"),
    Column("status", "error", lambda v: str(v)[:60], "empty: ran"),
]


def lr_scheduled(args) -> bool:
    """Whether the loss curves' lr changes over the run (a warm-up or a decay)."""
    return args.lr_warmup_steps > 0 or args.lr_decay_style != "constant"


def min_lr(args) -> float:
    """Where a decaying lr ends: ``--min-lr``, else a tenth of ``--lr``."""
    return args.min_lr if args.min_lr is not None else args.lr / 10


def _percent(value: float | None) -> str:
    return "not trained" if value is None else f"{value:+.2%}"


def _schedule_words(args) -> str:
    if not lr_scheduled(args):
        return f"lr {args.lr:g}"
    return (
        f"lr {args.lr:g}, warm-up {args.lr_warmup_steps}, {args.lr_decay_style} to {min_lr(args):g}"
    )


def _plot(result: dict, args, title: str) -> Path | str:
    tasks = list(result["loss"] or {})
    timed = bool(result["rows"]) or not tasks  # no kept panel for a run of loss curves only
    panels = int(timed) + max(len(tasks), 1)
    fig, axes = new_figure(panels, width=6 * panels)
    if timed:
        _plot_kept(axes[0], result["rows"], args)
    for bx, task in zip(axes[int(timed) :], tasks or [None], strict=True):
        if task is None:
            empty_panel(bx, "no loss curves (--loss-steps 0)")
            continue
        loss = result["loss"][task]
        for name, values in loss["losses"].items():
            bx.plot(values, label=name, linestyle="--" if name.startswith("resident") else "-")
        if loss["floor"] is not None:
            bx.axhline(loss["floor"], color="gray", linewidth=0.8, label="floor")
        bx.set_xlabel("step")
        bx.set_ylabel("loss")
        bx.set_title(
            f"{task}, offload 1.0, {_schedule_words(args)}, delay after "
            f"{args.delay_warmup}:\nlast {loss['last_steps']} mean "
            f"{_percent(loss['last_relative'])} (reference "
            f"{_percent(loss['resident_relative'])})",
            fontsize=8,
        )
        bx.legend(fontsize=7)
    return save_figure(fig, args.out, NAME, title)


def _plot_kept(ax, rows: list[dict], args) -> None:
    """Throughput kept against micro-batches per step, a line per configuration; the step
    times where no GPU-resident row ran (nothing to keep against: e.g. the precision-aware
    optimizer without transformer-engine's FusedAdam)."""
    key = "kept" if any("kept" in r for r in rows) else "step_ms"
    ok = [r for r in rows if key in r]
    if not ok:
        empty_panel(ax, "no configuration ran")
        return
    for label in dict.fromkeys(r["config"] for r in ok):
        pts = [(r["micro_batches"], r[key]) for r in ok if r["config"] == label]
        ax.plot(*zip(*pts, strict=True), marker="o", label=label)
    ax.set_xlabel("micro-batches per step")
    if key == "kept":
        ax.set_ylabel("throughput kept vs GPU-resident")
    else:
        ax.set_ylabel("step ms (median)")
    title = f"GPTModel {args.layers}x{args.hidden}, one GPU"
    ax.set_title(title if key == "kept" else f"{title}: no GPU-resident row, step times")
    ax.legend(fontsize=7)


if __name__ == "__main__":
    main()
