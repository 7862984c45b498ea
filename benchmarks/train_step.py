"""One training step of a real megatron-core GPTModel: option on vs the stock configurations.

A ``GPTModel`` with megatron-core's local (non-TE) layer spec, bf16 weights and fp32 islands
(a hyper-connection-like fp32 scale on every layer's MLP output), on one GPU with the
distributed optimizer. Each configuration is built with our option and with stock
megatron-core; a configuration that fails to build or step is reported with its error.
Per step: forward+backward, norm+clip, optimizer (copy to main grads + inner step + param
gather), each timed with the device drained before and after; and peak allocated memory.
Rounds are interleaved (``--rounds``): every configuration is built and stepped once per
round, in turn; each phase reports its fastest round's median, ``step_spread`` how far the
rounds' step times are apart, and a line warns when that exceeds 20%. Stock's configurations
run in a process of their own (``benchmarks/isolation.py``; a fresh one after any error), so
that a CUDA error there cannot poison ours: each row's ``status`` is ``ok``, ``failed (...)``
or ``crashed (...)``.

CUDA only: megatron-core's DDP and optimizers allocate on CUDA.
"""

from __future__ import annotations

import contextlib
import gc
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


def _model(args, fp32_islands: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
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
    gpt = GPTModel(
        config, get_gpt_layer_local_spec(), vocab_size=args.vocab, max_sequence_length=args.seq
    ).cuda()
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


def _measure(args, option: bool, label: str, overrides: dict, fp32_islands: bool) -> dict:
    row = {"config": label, "variant": "ours" if option else "stock", "fp32_islands": fp32_islands}
    torch.cuda.reset_peak_memory_stats()
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

            def fwd_bwd():
                loss = model(tokens, position, mask, labels=tokens).float().mean()
                loss.backward()
                model.finish_grad_sync()
                return loss

            t_fb, loss = _timed(fwd_bwd)
            t_prep, _ = _timed(opt.prepare_grads)
            t_clip, norm = _timed(lambda: _norm_and_clip(opt, option))
            t_step, _ = _timed(opt.step_with_ready_grads)
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
        row["peak_gib"] = gib(torch.cuda.max_memory_allocated())
        row["grad_buffer_gib"] = gib(sum(b.grad_data.nbytes for b in model.all_grad_buffers()))
    except Exception as exc:  # a configuration stock cannot run is a result, not a crash
        row.update(error_fields(exc))
    gc.collect()
    torch.cuda.empty_cache()
    return row


def _measure_stock(child: isolation.Child, args, label: str, overrides: dict, islands: bool):
    """Stock's :func:`_measure` in ``child``, a process of its own: a CUDA error there
    (megatron-core's norm with transformer-engine on a mixed list) cannot poison ours, and
    a child that dies or raises is this row's error."""
    row = {"config": label, "variant": "stock", "fp32_islands": islands}
    try:
        return child.call(f"{CHILD_MODULE}:_child_measure", args, label, overrides, islands)
    except isolation.ChildCrashed as exc:
        return row | {"error": f"crashed: {exc}", "error_at": "its own process"}
    except isolation.ChildFailed as exc:
        return row | exc.fields


CHILD_MODULE = "benchmarks.train_step"  # how the child imports this file


def _child_measure(state: dict, args, label: str, overrides: dict, islands: bool) -> dict:
    isolation.fire(isolation.injected_fault(label))
    if "group" not in state:  # this process's own one-rank group and model parallel state
        from megatron.core import parallel_state

        torch.cuda.set_device(0)
        state["group"] = contextlib.ExitStack()
        store = Path(state["group"].enter_context(tempfile.TemporaryDirectory())) / "store"
        state["group"].enter_context(single_rank_process_group(f"file://{store}"))
        parallel_state.initialize_model_parallel()
    return _measure(args, False, label, overrides, islands)


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


def combine_rounds(rounds: list[dict]) -> dict:
    """One configuration's row from its rounds: each phase's fastest round, the spread of
    the step times, the largest peak memory; the last round's norm and losses. A round that
    failed makes the row that failure (a configuration either runs or it does not)."""
    failed = next((r for r in rounds if "error" in r), None)
    if failed is not None:
        return failed | {"rounds": len(rounds)}
    row = dict(rounds[-1])
    for key in PHASES:
        row[key] = min(r[key] for r in rounds)
    steps = [r["step_ms"] for r in rounds]
    row["step_spread"], row["step_rounds_ms"] = spread(steps), steps
    row["peak_gib"] = max(r["peak_gib"] for r in rounds)
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


def parse_args(argv: list[str] | None):
    """The command line: common options plus the model's sizes and the step counts."""
    ap = base_parser(__doc__.splitlines()[0], timed=False)
    for name, default, meaning in (
        ("--layers", 4, "transformer layers"),
        ("--hidden", 2048, "hidden size"),
        ("--heads", 16, "attention heads"),
        ("--vocab", 32000, "vocabulary size"),
        ("--seq", 1024, "sequence length"),
        ("--batch", 4, "micro-batch size"),
        ("--steps", 6, "timed training steps per configuration"),
        ("--warmup", 2, "untimed training steps first"),
        ("--rounds", 2, "interleaved rounds: every configuration built and stepped once each"),
    ):
        ap.add_argument(name, type=int, default=default, help=f"{meaning} (default: %(default)s)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    """Measure every configuration, write JSON and PNG, print the table; CUDA only."""
    args = parse_args(argv)
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
    rows = []
    with single_rank_process_group("tcp://127.0.0.1:29541"):
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel()
        runs = [(opt, label, ov, True) for label, ov in CONFIGS for opt in (True, False)]
        runs.append((False, "pa_offload_0.5", CONFIGS[0][1], False))  # stock, islands in bf16
        for label, ov in CONFIGS[:2]:  # ours with the chunked offload step
            runs.append((True, f"{label}_chunked", ov | {OFFLOAD_STEP: "chunked"}, True))
        child = None  # stock's process; a fresh one after any error there

        def measure(i: int) -> dict:
            nonlocal child
            if runs[i][0]:
                return _measure(args, *runs[i])
            child = child if child is not None and child.usable else isolation.Child(NAME)
            row = _measure_stock(child, args, *runs[i][1:])
            if "error" in row:
                child.close()
                child = None
            return row

        try:
            rows = measure_rounds(
                len(runs), max(1, args.rounds), measure, lambda r: write_json(r, args.out, NAME)
            )
        finally:
            if child is not None:
                child.close()
        parallel_state.destroy_model_parallel()
    warning = spread_warning(
        {f"{r['config']} {r['variant']}": r["step_spread"] for r in rows if "error" not in r},
        max(1, args.rounds),
    )
    if warning:
        print(warning)
    _plot(rows, args, title)
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
                Column("peak GiB", "peak_gib", lambda v: f"{v:.2f}", "peak allocated"),
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
    return rows


def _plot(rows: list[dict], args, title: str) -> None:
    ok = [r for r in rows if "error" not in r]
    fig, (ax,) = new_figure(1, width=9)
    if not ok:
        empty_panel(ax, "every configuration failed (see the error column)")
        save_figure(fig, args.out, NAME, title)
        return
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
    save_figure(fig, args.out, NAME, title)


if __name__ == "__main__":
    main()
