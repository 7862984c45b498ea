"""One training step of a real megatron-core GPTModel: option on vs the stock configurations.

A ``GPTModel`` with megatron-core's local (non-TE) layer spec, bf16 weights and fp32 islands
(a hyper-connection-like fp32 scale on every layer's MLP output), on one GPU with the
distributed optimizer. Each configuration is built with our option and with stock
megatron-core; a configuration that fails to build or step is reported with its error.
Per step: forward+backward, norm+clip, optimizer (copy to main grads + inner step + param
gather), each timed with the device drained before and after; and memory: the peak
allocated over build and steps, the bytes held between steps (after ``zero_grad``, what
forward starts with) and the peaks of the last step's forward+backward and optimizer phases.
Every measurement (one configuration, one variant, one round) runs in a fresh process of
its own (:func:`measure_in_fresh_process`, ``benchmarks/isolation.py``): a peak is that
configuration's alone, nothing an earlier build left allocated or cached counts, and a CUDA
error in stock's arm cannot poison ours. Rounds are interleaved (``--rounds``): every
configuration is built and stepped once per round, in turn; each phase reports its fastest
round's median, ``step_spread`` how far the rounds' step times are apart, and a line warns
when that exceeds 20%. Each row's ``status`` is ``ok``, ``failed (...)`` or
``crashed (...)``.

CUDA only: megatron-core's DDP and optimizers allocate on CUDA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, find the repo

import torch

from benchmarks import isolation
from benchmarks.common import (
    Column,
    base_parser,
    empty_panel,
    error_fields,
    format_table,
    gib,
    new_figure,
    non_negative_int,
    positive_int,
    progress,
    run_title,
    save_figure,
    single_rank_process_group,
    spread,
    spread_warning,
    write_json,
)

NAME = "train_step"
# (label, OptimizerConfig overrides): the seed scenario first, then what stock can run.
CONFIGS = [
    (
        "pa_offload_0.5",
        dict(
            use_precision_aware_optimizer=True,
            optimizer_cpu_offload=True,
            optimizer_offload_fraction=0.5,
        ),
    ),
    (
        "pa_offload_1.0",
        dict(
            use_precision_aware_optimizer=True,
            optimizer_cpu_offload=True,
            optimizer_offload_fraction=1.0,
        ),
    ),
    ("pa_no_offload", dict(use_precision_aware_optimizer=True)),
    ("offload_0.5", dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)),
    ("distopt", dict()),
]


LAYER_SPECS = ("local", "te")  # megatron-core's local layers, or transformer-engine's


def _model(args, fp32_islands: bool, layer_spec: str = "local"):
    """(TransformerConfig, the GPT of ``args``' sizes in our ``Float16Module``); its layers
    ``layer_spec``: ``"local"`` (megatron-core's own) or ``"te"`` (transformer-engine's,
    which must import)."""
    if layer_spec not in LAYER_SPECS:
        raise ValueError(f"layer_spec {layer_spec!r}: use one of {list(LAYER_SPECS)}")
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_ext

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
    )
    spec = (
        gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
        if layer_spec == "te"
        else gpt_layer_specs.get_gpt_layer_local_spec()
    )
    gpt = GPTModel(config, spec, vocab_size=args.vocab, max_sequence_length=args.seq).cuda()
    for layer in gpt.decoder.layers:
        alpha = torch.nn.Parameter(
            torch.ones(
                args.hidden, device="cuda", dtype=torch.float32 if fp32_islands else torch.bfloat16
            )
        )
        layer.mlp.register_parameter(
            "hc_alpha", megatron_ext.mark_keep_in_fp32(alpha) if fp32_islands else alpha
        )
        layer.mlp.register_forward_hook(
            lambda mod, inp, out: (out[0] * mod.hc_alpha.to(out[0].dtype), *out[1:])
        )
    # As Megatron's training loop does: everything to bf16 (the layer specs' norms are
    # created in fp32), except the parameters marked keep_in_fp32.
    return config, megatron_ext.Float16Module(config, gpt)


# A config key that is ours, not an OptimizerConfig field: MegatronOptions.offload_step.
OFFLOAD_STEP = "megatron_ext_offload_step"


@dataclasses.dataclass(frozen=True)
class Run:
    """One measured run: a configuration, with our option or stock's."""

    option: bool  # per_dtype_grad_buffers
    label: str  # the configuration's name in the table
    overrides: dict  # OptimizerConfig fields (and OFFLOAD_STEP)
    fp32_islands: bool = True


def runs() -> list[Run]:
    """Every run of the table, in order: each configuration ours then stock, stock's seed
    scenario with its islands in bf16 (with them it cannot build), ours' chunked steps."""
    out = [Run(opt, label, ov) for label, ov in CONFIGS for opt in (True, False)]
    out.append(Run(False, "pa_offload_0.5", CONFIGS[0][1], fp32_islands=False))
    for label, ov in CONFIGS[:2]:
        out.append(Run(True, f"{label}_chunked", ov | {OFFLOAD_STEP: "chunked"}))
    return out


def _build(args, option: bool, overrides: dict, fp32_islands: bool):
    import megatron_ext

    overrides = dict(overrides)
    step = overrides.pop(OFFLOAD_STEP, "per_parameter")
    config, module = _model(args, fp32_islands)
    stack = megatron_ext.build_stack(
        module,
        config,
        per_dtype_grad_buffers=option,
        optimizer=dict(optimizer="adam", lr=1e-4, bf16=True, clip_grad=1.0, **overrides),
        options=megatron_ext.MegatronOptions(offload_step=step) if option else None,
    )
    return stack.model, stack.optimizer


def _timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


class _Peaks:
    """Peak allocated bytes of the whole measurement and of named phases, from one process
    whose allocations are all this measurement's (:func:`measure_in_fresh_process`)."""

    def __init__(self) -> None:
        torch.cuda.synchronize()
        self.baseline = torch.cuda.memory_allocated()  # the process group's, before any build
        torch.cuda.reset_peak_memory_stats()
        self.overall = 0
        self.phases: dict[str, int] = {}

    def _fold(self) -> None:
        self.overall = max(self.overall, torch.cuda.max_memory_allocated())

    def phase(self, name: str, fn):
        """Run ``fn``; its own peak is ``self.phases[name]`` (the last call's)."""
        torch.cuda.synchronize()
        self._fold()  # a reset would lose the peak so far
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        self.phases[name] = torch.cuda.max_memory_allocated()
        self._fold()
        return out

    def fields(self) -> dict:
        self._fold()
        out = {"peak_gib": gib(self.overall), "baseline_gib": gib(self.baseline)}
        out |= {f"peak_{k}_gib": gib(v) for k, v in self.phases.items()}
        return out


def _measure(args, option: bool, label: str, overrides: dict, fp32_islands: bool) -> dict:
    row = {"config": label, "variant": "ours" if option else "stock", "fp32_islands": fp32_islands}
    peaks = _Peaks()
    try:
        model, opt = _build(args, option, overrides, fp32_islands)
        g = torch.Generator(device="cuda").manual_seed(1)
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=g)
        position = torch.arange(args.seq, device="cuda").expand(args.batch, -1)
        # Megatron's convention: True marks a masked-out (future) position.
        mask = torch.ones(1, 1, args.seq, args.seq, device="cuda", dtype=torch.bool).triu(1)
        times = {"fwd_bwd": [], "norm_clip": [], "optimizer": []}
        inner = _time_offload_steps(opt)
        losses = []
        for step in range(args.steps):
            model.zero_grad_buffer()
            opt.zero_grad()
            torch.cuda.synchronize()
            row["held_gib"] = gib(torch.cuda.memory_allocated())  # what forward starts with

            def fwd_bwd():
                loss = model(tokens, position, mask, labels=tokens).float().mean()
                loss.backward()
                model.finish_grad_sync()
                return loss

            def optimizer_phases():
                t_prep, _ = _timed(opt.prepare_grads)
                t_clip, norm = _timed(lambda: _norm_and_clip(opt, option))
                t_step, _ = _timed(opt.step_with_ready_grads)
                return t_prep, t_clip, norm, t_step

            t_fb, loss = peaks.phase("fwd_bwd", lambda: _timed(fwd_bwd))
            t_prep, t_clip, norm, t_step = peaks.phase("optimizer", optimizer_phases)
            if step >= args.warmup:
                times["fwd_bwd"].append(t_fb)
                times["norm_clip"].append(t_clip)
                times["optimizer"].append(t_prep + t_step)
            losses.append(loss.item())
        row.update({f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()})
        if inner is not None:  # the offload optimizer's own step, and megatron-core's rest
            kept = inner[-len(times["optimizer"]) :] if times["optimizer"] else []
            if kept:
                row["offload_step_ms"] = 1e3 * statistics.median(kept)
                row["optimizer_rest_ms"] = 1e3 * statistics.median(
                    o - i for o, i in zip(times["optimizer"], kept, strict=True)
                )
        row["step_ms"] = sum(row[f"{k}_ms"] for k in times)
        row["grad_norm"] = float(norm)
        row["loss_first"], row["loss_last"] = losses[0], losses[-1]
        row.update(peaks.fields())
        row["grad_buffer_gib"] = gib(sum(b.grad_data.nbytes for b in model.all_grad_buffers()))
        row["norm_graph_invalidations"] = _graph_invalidations(opt)
    except Exception as exc:  # a configuration stock cannot run is a result, not a crash
        row.update(error_fields(exc))
    return row


def _graph_invalidations(opt) -> int | None:
    """How often the norm's CUDA graphs were dropped because a storage they read moved
    (ours; None for stock): the fp32 mirror is allocated afresh every step."""
    owners = [opt, *getattr(opt, "chained_optimizers", [])]
    replays = [o.__dict__["_flat_norm_clip"].replay for o in owners if "_flat_norm_clip" in vars(o)]
    return sum(r.invalidations for r in replays) if replays else None


CHILD_MODULE = "benchmarks.train_step"  # how the child imports this file


def measure_in_fresh_process(args, run: Run) -> dict:
    """One measurement of ``run`` in a process of its own, started for it and stopped after.

    A fresh process makes the peak that run's alone (no allocation, cache or graph pool of
    an earlier build counts), and a CUDA error or crash there (megatron-core's norm with
    transformer-engine on a mixed list) is this row's error, not the end of the run.
    """
    row = {"config": run.label, "variant": "ours" if run.option else "stock"}
    row["fp32_islands"] = run.fp32_islands
    with isolation.Child(f"{NAME}-{run.label}") as child:
        try:
            # Plain fields: the child imports this file under its own module name.
            fields = (run.option, run.label, run.overrides, run.fp32_islands)
            return child.call(f"{CHILD_MODULE}:_child_measure", args, *fields)
        except isolation.ChildCrashed as exc:
            return row | {"error": f"crashed: {exc}", "error_at": "its own process"}
        except isolation.ChildFailed as exc:
            return row | exc.fields


def _child_measure(state: dict, args, option: bool, label: str, overrides: dict, islands: bool):
    if not option:  # the fault injection tests' stand-in for stock's crashes
        isolation.fire(isolation.injected_fault(label))
    from megatron.core import parallel_state

    torch.cuda.set_device(0)
    with contextlib.ExitStack() as stack:  # this process's one-rank group
        store = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "store"
        stack.enter_context(single_rank_process_group(f"file://{store}"))
        parallel_state.initialize_model_parallel()
        stack.callback(parallel_state.destroy_model_parallel)
        return _measure(args, option, label, overrides, islands)


def _time_offload_steps(opt) -> list[float] | None:
    """Time every step of the CPU-offload optimizers inside ``opt`` (device drained before
    and after): seconds per optimizer step, summed over them; None when there is none."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    children = getattr(opt, "chained_optimizers", [opt])
    hdos = [
        c.optimizer
        for c in children
        if isinstance(getattr(c, "optimizer", None), HybridDeviceOptimizer)
    ]
    if not hdos:
        return None
    seconds: list[float] = []

    def timed(step):
        def run(*args, **kwargs):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = step(*args, **kwargs)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
            return out

        return run

    for hdo in hdos:
        hdo.step = timed(hdo.step)
    if len(hdos) == 1:
        return seconds
    raise NotImplementedError("several CPU-offload optimizers: time them one by one")


PHASES = ("fwd_bwd_ms", "norm_clip_ms", "optimizer_ms", "step_ms")
MEMORY = ("peak_gib", "held_gib", "peak_fwd_bwd_gib", "peak_optimizer_gib")  # GiB, max of rounds


def combine_rounds(rounds: list[dict]) -> dict:
    """One configuration's row from its rounds: each phase's fastest round, the spread of
    the step times, the largest of each memory figure; the last round's norm and losses. A
    round that failed makes the row that failure (a configuration either runs or it does
    not)."""
    failed = next((r for r in rounds if "error" in r), None)
    if failed is not None:
        return failed | {"rounds": len(rounds)}
    row = dict(rounds[-1])
    for key in PHASES:
        row[key] = min(r[key] for r in rounds)
    steps = [r["step_ms"] for r in rounds]
    row["step_spread"], row["step_rounds_ms"] = spread(steps), steps
    for key in MEMORY:
        if all(key in r for r in rounds):
            row[key] = max(r[key] for r in rounds)
    row["rounds"] = len(rounds)
    return row


def measure_rounds(n: int, rounds: int, measure, write) -> list[dict]:
    """``measure(i)`` for runs 0..n-1, ``rounds`` times over, interleaved; after every
    measurement the rows so far (each run's measured rounds combined, with its status) go to
    ``write``, so that a run cut short by a time limit leaves what it measured. Returns the
    rows of every run."""
    per_round: list[list[dict]] = [[] for _ in range(n)]
    rows: list[dict] = []
    for i in progress([i for _ in range(rounds) for i in range(n)], NAME):
        per_round[i].append(measure(i))
        rows = [combine_rounds(r) for r in per_round if r]
        for row in rows:
            row["status"] = isolation.status(row.get("error"))
        write(rows)
    return rows


def _norm_and_clip(opt, option: bool):
    if option:
        return opt.clip_grad_norm(opt.config.clip_grad)
    # stock ChainedOptimizer has no clip_grad_norm; its step() does norm then clip per child
    return [c.clip_grad_norm(c.config.clip_grad) for c in opt.chained_optimizers][0]


# The GPT every training-step benchmark builds (_model): its sizes on the command line.
MODEL_SIZES = (
    ("--layers", 4, "transformer layers"),
    ("--hidden", 2048, "hidden size"),
    ("--heads", 16, "attention heads"),
    ("--vocab", 32000, "vocabulary size"),
    ("--seq", 1024, "sequence length"),
    ("--batch", 4, "micro-batch size"),
)


def parse_args(argv: list[str] | None):
    """The command line: common options plus the model's sizes and the step counts."""
    ap = base_parser(__doc__.splitlines()[0], timed=False)
    for name, default, meaning in (
        *MODEL_SIZES,
        ("--steps", 6, "timed training steps per configuration"),
        ("--rounds", 2, "interleaved rounds: every configuration built and stepped once each"),
    ):
        ap.add_argument(
            name, type=positive_int, default=default, help=f"{meaning} (default: %(default)s)"
        )
    ap.add_argument(
        "--warmup",
        type=non_negative_int,
        default=2,
        help="untimed training steps first (default: %(default)s)",
    )
    ap.add_argument(
        "--configs",
        default="",
        help="comma-separated configuration names to run, ours and stock (default: every "
        f"one: {', '.join(sorted({r.label for r in runs()}))})",
    )
    return ap.parse_args(argv)


def selected_runs(configs: str) -> list[Run]:
    """The runs of the configurations named in ``configs`` (comma-separated; empty: all).

    Raises:
        SystemExit: a name that is no configuration's.
    """
    todo = runs()
    wanted = [c for c in configs.split(",") if c]
    unknown = sorted(set(wanted) - {r.label for r in todo})
    if unknown:
        raise SystemExit(
            f"--configs: no configuration named {', '.join(unknown)}; the names are "
            f"{', '.join(sorted({r.label for r in todo}))}"
        )
    return [r for r in todo if not wanted or r.label in wanted]


def main(argv: list[str] | None = None) -> list[dict]:
    """Measure every configuration, write JSON and PNG, print the table; CUDA only."""
    args = parse_args(argv)
    todo = selected_runs(args.configs)
    if args.device != "cuda" or not torch.cuda.is_available():
        raise SystemExit(
            "train_step needs CUDA (megatron-core's DDP and optimizers allocate on CUDA): "
            f"nothing measured, nothing written to {args.out}"
        )
    torch.cuda.set_device(0)
    title = run_title(torch.device("cuda", 0), megatron=True)
    print(title, file=sys.stderr)
    print(
        f"torch intra-op threads (the CPU optimizer's): {torch.get_num_threads()}", file=sys.stderr
    )
    rows = measure_rounds(
        len(todo),
        args.rounds,
        lambda i: measure_in_fresh_process(args, todo[i]),
        lambda r: write_json(r, args.out, NAME),
    )
    warning = spread_warning(
        {f"{r['config']} {r['variant']}": r["step_spread"] for r in rows if "error" not in r},
        args.rounds,
    )
    if warning:
        print(warning)
    png_path = _plot(rows, args, title)
    print(
        format_table(
            rows,
            [
                Column("config", "config"),
                Column("variant", "variant"),
                Column("fp32 islands", "fp32_islands"),
                Column(
                    "fwd+bwd ms",
                    "fwd_bwd_ms",
                    lambda v: f"{v:.2f}",
                    "median per step, fastest round",
                ),
                Column(
                    "norm+clip ms",
                    "norm_clip_ms",
                    lambda v: f"{v:.3f}",
                    "median per step, fastest round",
                ),
                Column(
                    "optimizer ms",
                    "optimizer_ms",
                    lambda v: f"{v:.2f}",
                    "median per step, fastest round: copy to main grads, inner step, parameter "
                    "gather",
                ),
                Column(
                    "offload ms",
                    "offload_step_ms",
                    lambda v: f"{v:.2f}",
                    "of which the CPU-offload optimizer's own step (HybridDeviceOptimizer.step, "
                    "device drained around it)",
                ),
                Column(
                    "rest ms",
                    "optimizer_rest_ms",
                    lambda v: f"{v:.2f}",
                    "optimizer ms less that: megatron-core's copies and parameter gather",
                ),
                Column(
                    "spread",
                    "step_spread",
                    lambda v: f"{v:.0%}",
                    "(slowest - fastest) / fastest round's step time",
                ),
                Column(
                    "peak GiB",
                    "peak_gib",
                    lambda v: f"{v:.2f}",
                    "peak allocated over build and steps, in the run's own process (largest round)",
                ),
                Column(
                    "held GiB",
                    "held_gib",
                    lambda v: f"{v:.2f}",
                    "allocated after zero_grad, what forward and backward start with",
                ),
                Column(
                    "fwd+bwd peak",
                    "peak_fwd_bwd_gib",
                    lambda v: f"{v:.2f}",
                    "GiB, peak of the last step's forward and backward",
                ),
                Column(
                    "opt peak",
                    "peak_optimizer_gib",
                    lambda v: f"{v:.2f}",
                    "GiB, peak of the last step's copy, norm+clip and optimizer step",
                ),
                Column("loss first->last", "loss_last", lambda v: f"{v:.4f}"),
                Column(
                    "status",
                    "status",
                    lambda v: v[:70],
                    "ok; failed (the error); crashed (stock runs in a process of its own, "
                    "and that process died)",
                ),
            ],
        )
    )
    print(f"wrote {args.out / f'{NAME}.json'} and {png_path}", file=sys.stderr)
    return rows


def _plot(rows: list[dict], args, title: str) -> Path | str:
    ok = [r for r in rows if "error" not in r]
    fig, (ax,) = new_figure(1, width=9)
    if not ok:
        empty_panel(ax, "every configuration failed (see the error column)")
        return save_figure(fig, args.out, NAME, title)
    labels = [f"{r['config']}\n{r['variant']}{'' if r['fp32_islands'] else ' (bf16)'}" for r in ok]
    bottom = [0.0] * len(ok)
    for key in ("fwd_bwd_ms", "norm_clip_ms", "optimizer_ms"):
        vals = [r[key] for r in ok]
        ax.bar(labels, vals, bottom=bottom, label=key.removesuffix("_ms"))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("ms per step")
    ax.set_title(f"GPTModel {args.layers}x{args.hidden}, one GPU (failed configs omitted)")
    ax.legend()
    ax.tick_params(axis="x", labelsize=7)
    return save_figure(fig, args.out, NAME, title)


if __name__ == "__main__":
    main()
