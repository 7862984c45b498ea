"""CPU norm and clip: FlatGradBuffers against torch, idle and with the cores busy.

The CPU path of ``FlatGradBuffers.grad_norm`` / ``clip_grad_norm_`` against torch's
``torch.nn.utils.get_total_norm`` and ``clip_grad_norm_(foreach=True)`` over the same
gradients (two copies: each side clips its own), at each ``--threads`` count
(``torch.set_num_threads``), with ``--busy`` other processes spinning on the cores
(``while True: pass``, started before and killed after each configuration). Inventories:
``few_large`` (``--numel`` elements in 150 parameters) and ``many_small`` (``--small``:
3000 parameters of 4096 elements), in each ``--dtypes``.

Times are wall-clock (``perf_counter``: a stall while the cores are taken is what is
measured), each the fastest of ``--rounds`` interleaved rounds' medians. ``first`` is the
first ``grad_norm`` of a freshly built ``FlatGradBuffers`` (one call per round, each over
new parameters holding the same gradients). Clips use ``max_norm=0``: the coefficient is
0 at every call, so the scale always runs (a clip whose coefficient is 1 skips it).
``per_param``: every parameter's norm as one vector, ``grad_norm(per_param=True).norms`` (one
segmented pass per buffer) against ``torch.stack(torch._foreach_norm(grads,
dtype=float32))``. Accuracy: each side's norm of the random gradients against an fp64 norm
of the same values (``per_param``: the largest relative error of one parameter's norm).
``ours`` is the default CPU path (the compiled kernel, ``buffers.native``, where it is
available; the header says which ran); ``ours_torch_ops`` the same buffers with
``BUFFERS_CPU_KERNEL=off`` (torch's ops in pieces: the path before the kernel, and the
one without a compiler).

``zero_backward`` (``many_small`` only, on parameters of their own): one step's zeroing and
a backward that gives every parameter a gradient (``loss.backward(retain_graph=True)`` of a
fixed graph with one node per parameter), ``fgb.zero_()`` against torch's
``opt.zero_grad()``: what the torch loop's ``zero_()`` costs the host, its hooks included
(they point each ``.grad`` at its view when backward reaches it). ``check`` (``many_small``
only): the check every norm, clip and count runs first, alone (each ``.grad`` compared with
what the buffers expect, one C-level pass over the parameters): its ratio is to ours'
steady norm, of which it is part.

Record fields: inventory, dtype, num_params, numel, threads, busy, variant (ours,
ours_torch_ops, torch), op (norm, clip, per_param, first, zero_backward, check), rounds,
time_s, time_spread, time_rounds_s, ratio (ours / torch for norm, clip, per_param and
zero_backward; over ours' steady norm for first and check), rel_err (norm and per_param),
error, error_at.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, find the repo

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from buffers import FlatGradBuffers, native  # noqa: E402

NAME = "cpu_norm"
INVENTORIES = ("few_large", "many_small")
LARGE_PARAMS = 150


def parse_args(argv: list[str] | None):
    ap = common.base_parser(__doc__.splitlines()[0])
    ap.add_argument(
        "--threads",
        type=common.ints_at_least(1),
        default="1,2",
        help="comma-separated torch thread counts to run at (default: %(default)s)",
    )
    ap.add_argument(
        "--busy",
        type=common.ints_at_least(0),
        default="0,2",
        help="comma-separated numbers of busy-looping processes running during the timing "
        "(default: %(default)s)",
    )
    ap.add_argument(
        "--dtypes",
        default="bfloat16,float32",
        help="comma-separated gradient dtypes (default: %(default)s)",
    )
    ap.add_argument(
        "--inventories",
        default=",".join(INVENTORIES),
        help=f"comma-separated, of {', '.join(INVENTORIES)} (default: %(default)s)",
    )
    ap.add_argument(
        "--numel",
        type=common.positive_int,
        default=52_000_000,
        help=f"elements of few_large, in {LARGE_PARAMS} parameters (default: %(default)s)",
    )
    ap.add_argument(
        "--small",
        default="3000x4096",
        help="many_small: PARAMETERSxELEMENTS, elements per parameter (default: %(default)s)",
    )
    args = ap.parse_args(argv)
    try:
        count, each = (int(v) for v in args.small.split("x"))
    except ValueError:
        count = each = 0
    if count < 1 or each < 1:
        ap.error(f"argument --small: expected COUNTxELEMENTS such as 3000x4096, got {args.small!r}")
    args.small = (count, each)
    args.inventories = [i for i in args.inventories.split(",") if i]
    unknown = [i for i in args.inventories if i not in INVENTORIES]
    if unknown:
        ap.error(f"argument --inventories: unknown {unknown}; known: {list(INVENTORIES)}")
    names = [d for d in args.dtypes.split(",") if d]
    args.dtypes = [getattr(torch, name, None) for name in names]
    wrong = [n for n, d in zip(names, args.dtypes, strict=True) if not isinstance(d, torch.dtype)]
    if wrong:
        ap.error(f"argument --dtypes: {wrong} not torch dtypes (e.g. bfloat16,float32)")
    return args


def _params(inventory: str, args, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    if inventory == "few_large":
        n, each = LARGE_PARAMS, max(1, args.numel // LARGE_PARAMS)
    else:
        n, each = args.small
    return [torch.nn.Parameter(torch.empty(each, dtype=dtype)) for _ in range(n)]


class Busy:
    """``count`` processes spinning on the CPU while the block runs."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.procs: list[subprocess.Popen] = []

    def __enter__(self):
        for _ in range(self.count):
            self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        if self.procs:
            time.sleep(0.3)  # let them start spinning
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def _torch_ops(fn):
    """``fn`` with the compiled kernel off (``BUFFERS_CPU_KERNEL=off``) for the call."""

    def run():
        before = os.environ.get("BUFFERS_CPU_KERNEL")
        os.environ["BUFFERS_CPU_KERNEL"] = "off"
        try:
            return fn()
        finally:
            if before is None:
                del os.environ["BUFFERS_CPU_KERNEL"]
            else:
                os.environ["BUFFERS_CPU_KERNEL"] = before

    return run


def _timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _measure(fn, warmup: int, reps: int):
    """A measure for :func:`common.interleave`: warm up in round 0, then time ``reps``."""

    def run(round_index: int) -> float:
        if round_index == 0:
            for _ in range(warmup):
                fn()
        return _timed(fn, reps)

    return run


def measure(inventory: str, dtype: torch.dtype, args, warmup: int, reps: int, rounds: int):
    """Every record of one inventory and dtype, at every thread count and busy count."""
    gen = torch.Generator().manual_seed(0)
    ours = _params(inventory, args, dtype)
    theirs = _params(inventory, args, dtype)
    fgb = FlatGradBuffers(ours)
    for p, q in zip(ours, theirs, strict=True):
        p.grad.copy_(torch.randn(p.shape, generator=gen))
        q.grad = p.grad.clone()
    grads = [q.grad for q in theirs]
    per_ref = torch.stack([g.double().norm() for g in grads])
    ref = torch.linalg.vector_norm(per_ref).item()
    rel_err = {
        ("ours", "norm"): fgb.grad_norm().item() / ref - 1,
        ("ours_torch_ops", "norm"): _torch_ops(fgb.grad_norm)().item() / ref - 1,
        ("torch", "norm"): torch.nn.utils.get_total_norm(grads).float().item() / ref - 1,
    }
    per_param = {
        "ours": lambda: fgb.grad_norm(per_param=True).norms,
        "torch": lambda: torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)),
    }
    for variant, fn in per_param.items():
        rel_err[variant, "per_param"] = ((fn().double() - per_ref).abs() / per_ref).max().item()

    def fresh_first(_round: int) -> float:
        params = _params(inventory, args, dtype)
        fresh = FlatGradBuffers(params)
        for p, q in zip(params, ours, strict=True):
            p.grad.copy_(q.grad)
        t = time.perf_counter()
        fresh.grad_norm()
        return time.perf_counter() - t

    calls = {
        ("ours", "norm"): fgb.grad_norm,
        ("ours_torch_ops", "norm"): _torch_ops(fgb.grad_norm),
        ("torch", "norm"): lambda: torch.nn.utils.get_total_norm(grads),
        ("ours", "clip"): lambda: fgb.clip_grad_norm_(0.0),
        ("ours_torch_ops", "clip"): _torch_ops(lambda: fgb.clip_grad_norm_(0.0)),
        ("torch", "clip"): lambda: torch.nn.utils.clip_grad_norm_(theirs, 0.0, foreach=True),
        ("ours", "per_param"): per_param["ours"],
        ("torch", "per_param"): per_param["torch"],
    }
    if inventory == "many_small":
        calls |= _zero_backward_calls(inventory, args, dtype)
        # the per-call check alone (private: no public call runs it without a norm)
        calls[("ours", "check")] = fgb._check_bound
    records = []
    saved = torch.get_num_threads()
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for busy in args.busy:
                measures = {key: _measure(fn, warmup, reps) for key, fn in calls.items()}
                measures[("ours", "first")] = fresh_first
                desc = f"{NAME} {inventory} {str(dtype).removeprefix('torch.')} "
                desc += f"{threads} threads {busy} busy"
                with Busy(busy):
                    results, errors = common.interleave(measures, rounds, desc)
                base = {
                    "inventory": inventory,
                    "dtype": dtype,
                    "num_params": len(ours),
                    "numel": sum(p.numel() for p in ours),
                    "threads": threads,
                    "busy": busy,
                    "rounds": rounds,
                }
                rows = {}
                for key in measures:
                    rec = {**base, "variant": key[0], "op": key[1]}
                    if key in results:
                        rec.update(common.round_fields("time", results[key]))
                    else:
                        rec.update(common.error_fields(errors[key]))
                    if key in rel_err:
                        rec["rel_err"] = rel_err[key]
                    rows[key] = rec
                for (variant, op), rec in rows.items():
                    other = ("ours", "norm") if op in ("first", "check") else ("torch", op)
                    if variant.startswith("ours") and "time_s" in rec and "time_s" in rows[other]:
                        rec["ratio"] = rec["time_s"] / rows[other]["time_s"]
                records += rows.values()
    finally:
        torch.set_num_threads(saved)
    return records


def _zero_backward_calls(inventory: str, args, dtype: torch.dtype) -> dict:
    """``zero_()`` + backward against ``opt.zero_grad()`` + backward, on new parameters."""
    calls = {}
    for variant in ("ours", "torch"):
        params = _params(inventory, args, dtype)
        for p in params:
            p.data.normal_()
        # one node per parameter, as a model's graph has; the same graph on both sides
        loss = torch.stack([p[0] for p in params]).float().sum()
        if variant == "ours":
            fgb = FlatGradBuffers(params)
            zero = fgb.zero_
        else:
            zero = torch.optim.SGD(params, lr=0.0).zero_grad

        def step(zero=zero, loss=loss, keep=params):
            zero()
            loss.backward(retain_graph=True)

        calls[(variant, "zero_backward")] = step
    return calls


COLUMNS = [
    common.Column(
        "inventory",
        "inventory",
        meaning=f"few_large (--numel in {LARGE_PARAMS} parameters) or many_small (--small)",
    ),
    common.Column(
        "dtype", "dtype", lambda d: str(d).removeprefix("torch."), "the gradients' dtype"
    ),
    common.Column("thr", "threads", meaning="torch threads"),
    common.Column("busy", "busy", meaning="busy-looping processes during the timing"),
    common.Column("variant", "variant", meaning="ours, ours_torch_ops (the kernel off) or torch"),
    common.Column(
        "op",
        "op",
        meaning="norm, clip, per_param, first (a fresh build's norm), zero_backward, check",
    ),
    common.Column("ms", "time_s", common.show_ms, "fastest round's median, wall clock"),
    common.Column("spread", "time_spread", lambda v: f"{v:.0%}", "(slowest-fastest)/fastest"),
    common.Column(
        "ratio", "ratio", lambda v: f"{v:.2f}", "ours/torch; first, check: over steady norm"
    ),
    common.Column(
        "rel_err", "rel_err", lambda v: f"{v:.1e}", "norm against fp64 (per_param: the worst)"
    ),
]


def plot(records: list[dict], out: Path, title: str) -> Path | str:
    fig, (ax,) = common.new_figure(1, width=9.0)
    rows = [r for r in records if r.get("ratio") is not None and r["op"] != "first"]
    labels = [
        f"{r['inventory']} {str(r['dtype']).removeprefix('torch.')} t{r['threads']} "
        f"b{r['busy']} {r['op']}"
        for r in rows
    ]
    ax.barh(range(len(rows)), [r["ratio"] for r in rows])
    ax.set_yticks(range(len(rows)), labels, fontsize=6)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("ours / torch time (below 1: ours faster)")
    return common.save_figure(fig, out, NAME, title)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = common.resolve_device(args.device)
    if device.type != "cpu":
        raise SystemExit("benchmarks/cpu_norm.py measures the CPU path: use --device cpu")
    warmup, reps = common.repeats(args, device)
    rounds = common.rounds(args, device)
    per_round = common.per_round(reps, rounds)
    title = common.run_title(device)
    print(title)
    print(f"CPU norm path: {native.describe()}")
    records = []
    for inventory in args.inventories:
        for dtype in args.dtypes:
            records += measure(inventory, dtype, args, warmup, per_round, rounds)
    print(common.format_table(records, COLUMNS))
    spreads = {
        f"{r['inventory']}/{r['dtype']}/{r['threads']}/{r['busy']}/{r['variant']}/{r['op']}": r[
            "time_spread"
        ]
        for r in records
        if "time_spread" in r
    }
    print(common.noise_line(spreads, rounds, device))
    json_path = common.write_json(records, args.out, NAME)
    png_path = plot(records, args.out, title)
    print(f"wrote {json_path} and {png_path}", file=sys.stderr)
    return records


if __name__ == "__main__":
    main()
