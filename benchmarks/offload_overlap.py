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
- ``delayed_offload_F``: ours, the host update one step late (``offload_delayed_update``),
  its worker on every usable core but one (the default);
- ``delayed_offload_F_all_cores`` (first fraction only): the same on every usable core, the
  thread launching the GPU's work competing with the worker for them.

``kept``: the GPU-resident step time over the configuration's (the throughput kept).
``--loss-steps N`` also trains N steps exact and N steps delayed from the same start on
the same fixed batches (fraction 1.0, one micro-batch) and plots both loss curves; the
summary compares the mean loss of the last 50 steps.

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
    gib,
    new_figure,
    run_title,
    save_figure,
    single_rank_process_group,
    write_json,
)

NAME = "offload_overlap"
PA = dict(use_precision_aware_optimizer=True)


def configs(fractions) -> list[tuple[str, dict, dict | None]]:
    """(label, OptimizerConfig overrides, MegatronOptions fields or None for stock)."""
    out: list[tuple[str, dict, dict | None]] = [("gpu_resident", PA, {})]
    for f in fractions:
        offload = PA | dict(optimizer_cpu_offload=True, optimizer_offload_fraction=f)
        out.append((f"stock_offload_{f}", offload, None))
        out.append((f"exact_offload_{f}", offload, dict(offload_step="chunked")))
        out.append(
            (
                f"delayed_offload_{f}",
                offload,
                dict(offload_step="chunked", offload_delayed_update=True, offload_delay_warmup=1),
            )
        )
    if fractions:  # the host worker on every core: none left to the launching thread
        from megatron_ext.offload.threads import usable_cores

        f = fractions[0]
        offload = PA | dict(optimizer_cpu_offload=True, optimizer_offload_fraction=f)
        out.append(
            (
                f"delayed_offload_{f}_all_cores",
                offload,
                dict(
                    offload_step="chunked",
                    offload_delayed_update=True,
                    offload_delay_warmup=1,
                    offload_threads=usable_cores(),
                ),
            )
        )
    return out


def build(args, overrides: dict, options: dict | None):
    import megatron_ext
    from benchmarks.train_step import _model

    config, module = _model(args, fp32_islands=options is not None)
    stack = megatron_ext.build_stack(
        module,
        config,
        per_dtype_grad_buffers=options is not None,
        optimizer=dict(optimizer="adam", lr=args.lr, bf16=True, clip_grad=1.0, **overrides),
        options=None if options is None else megatron_ext.MegatronOptions(**options),
    )
    return stack.model, stack.optimizer


def batches(args, count: int) -> list[tuple[torch.Tensor, ...]]:
    """``count`` fixed micro-batches (tokens, positions, causal mask), from one seed."""
    g = torch.Generator(device="cuda").manual_seed(1)
    position = torch.arange(args.seq, device="cuda").expand(args.batch, -1)
    # Megatron's convention: True marks a masked-out (future) position.
    mask = torch.ones(1, 1, args.seq, args.seq, device="cuda", dtype=torch.bool).triu(1)
    return [
        (torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=g),
         position, mask)
        for _ in range(count)
    ]  # fmt: skip


def train_step(model, opt, micro: list) -> torch.Tensor:
    """One training step over the micro-batches ``micro``; the mean loss (a device tensor)."""
    model.zero_grad_buffer()
    opt.zero_grad()
    total = torch.zeros((), device="cuda")
    for i, (tokens, position, mask) in enumerate(micro):
        sync = model.no_sync() if i < len(micro) - 1 else _nothing()
        with sync:
            loss = model(tokens, position, mask, labels=tokens).float().mean() / len(micro)
            loss.backward()
        total += loss.detach()
    model.finish_grad_sync()
    opt.step()
    return total


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
        seconds = []
        for step in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            train_step(model, opt, data)
            torch.cuda.synchronize()
            if step >= args.warmup:
                seconds.append(time.perf_counter() - t0)
        megatron_ext.drain_offload(opt)
        row["step_ms"] = 1e3 * statistics.median(seconds)
        row["peak_gib"] = gib(torch.cuda.max_memory_allocated())
    except Exception as exc:  # a configuration that cannot run is a result
        row.update(error_fields(exc))
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return row


def loss_curves(args) -> dict:
    """Exact and delayed from the same start over the same fixed batches: per-step losses."""
    import megatron_ext

    curves = {}
    offload = PA | dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)
    data = batches(args, args.loss_batches)
    for name, delayed in (("exact", False), ("delayed", True)):
        options = dict(offload_step="chunked", offload_delayed_update=delayed)
        if delayed:
            options["offload_delay_warmup"] = args.delay_warmup
        model, opt = build(args, offload, options)
        losses = []
        for step in range(args.loss_steps):
            losses.append(train_step(model, opt, [data[step % len(data)]]))
        megatron_ext.drain_offload(opt)
        curves[name] = [float(x) for x in losses]
        del model, opt
        gc.collect()
        torch.cuda.empty_cache()
    tail = min(50, args.loss_steps)
    exact, delayed = (statistics.fmean(curves[k][-tail:]) for k in ("exact", "delayed"))
    return {
        "losses": curves,
        "last_mean_exact": exact,
        "last_mean_delayed": delayed,
        "last_relative": (delayed - exact) / exact,
        "last_steps": tail,
    }


def parse_args(argv: list[str] | None):
    ap = base_parser(__doc__.splitlines()[0], timed=False)
    for name, default, meaning in (
        ("--layers", 4, "transformer layers"),
        ("--hidden", 2048, "hidden size"),
        ("--heads", 16, "attention heads"),
        ("--vocab", 32000, "vocabulary size"),
        ("--seq", 1024, "sequence length"),
        ("--batch", 4, "micro-batch size"),
        ("--steps", 5, "timed training steps per configuration"),
        ("--warmup", 3, "untimed training steps first (the delayed update's warm-up among them)"),
        ("--loss-steps", 0, "steps of each loss curve (0: none; 200 or more to compare)"),
        ("--loss-batches", 16, "fixed micro-batches the loss curves cycle through"),
        ("--delay-warmup", 10, "exact steps before the delayed loss curve's delay starts"),
    ):
        ap.add_argument(name, type=int, default=default, help=f"{meaning} (default: %(default)s)")
    ap.add_argument(
        "--micro-batches", type=int, nargs="+", default=[1, 4, 8],
        help="micro-batches per training step (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--fractions", type=float, nargs="+", default=[1.0, 0.5],
        help="offload fractions (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument("--lr", type=float, default=3e-4, help="Adam's lr (default: %(default)s)")
    return ap.parse_args(argv)


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
            for label, overrides, options in configs(args.fractions):
                row = measure(args, label, overrides, options, micro)
                result["rows"].append(row)
                add_kept(result["rows"])
                print(f"{NAME}: {label} x{micro}: {row.get('step_ms', row.get('error'))}",
                      file=sys.stderr)  # fmt: skip
                write_json([result], args.out, NAME)
        if args.loss_steps > 0:
            try:
                result["loss"] = loss_curves(args)
            except Exception as exc:  # the timings above stand; the curves' failure is shown
                result["loss_error"] = error_fields(exc)
                print(f"{NAME}: loss curves failed: {exc}", file=sys.stderr)
            write_json([result], args.out, NAME)
        parallel_state.destroy_model_parallel()
    _plot(result, args, title)
    print(format_table(result["rows"], COLUMNS))
    if result.get("loss_error"):
        print(f"loss curves failed: {result['loss_error']}")
    if result["loss"] is not None:
        loss = result["loss"]
        print(
            f"loss, mean of the last {loss['last_steps']} steps: exact "
            f"{loss['last_mean_exact']:.4f}, delayed {loss['last_mean_delayed']:.4f} "
            f"({loss['last_relative']:+.2%})"
        )
    return result


COLUMNS = [
    Column("config", "config"),
    Column("micro-batches", "micro_batches"),
    Column("step ms", "step_ms", lambda v: f"{v:.1f}", "median, device drained around it"),
    Column("kept", "kept", lambda v: f"{v:.0%}", "GPU-resident step time / this one"),
    Column("peak GiB", "peak_gib", lambda v: f"{v:.2f}", "peak allocated while it ran"),
    Column("baseline GiB", "baseline_gib", lambda v: f"{v:.2f}", "allocated before it was built"),
    Column("status", "error", lambda v: str(v)[:60], "empty: ran"),
]


def _plot(result: dict, args, title: str) -> None:
    fig, (ax, bx) = new_figure(2, width=12)
    ok = [r for r in result["rows"] if "kept" in r]
    if ok:
        for label in dict.fromkeys(r["config"] for r in ok):
            pts = [(r["micro_batches"], r["kept"]) for r in ok if r["config"] == label]
            ax.plot(*zip(*pts, strict=True), marker="o", label=label)
        ax.set_xlabel("micro-batches per step")
        ax.set_ylabel("throughput kept vs GPU-resident")
        ax.set_title(f"GPTModel {args.layers}x{args.hidden}, one GPU")
        ax.legend(fontsize=7)
    else:
        empty_panel(ax, "no configuration ran")
    loss = result["loss"]
    if loss is not None:
        for name, values in loss["losses"].items():
            bx.plot(values, label=name)
        bx.set_xlabel("step")
        bx.set_ylabel("loss")
        bx.set_title(
            f"offload 1.0, lr {args.lr:g}, delay after {args.delay_warmup} steps: last "
            f"{loss['last_steps']} mean {loss['last_relative']:+.2%}"
        )
        bx.legend()
    else:
        empty_panel(bx, "no loss curves (--loss-steps 0)")
    save_figure(fig, args.out, NAME, title)


if __name__ == "__main__":
    main()
