"""Gradient norm and clip: megatron, upstream_fix, torch and flat side by side, against floors.

Run: ``python benchmarks/norm_clip.py --device {cpu,cuda} --out DIR [--scale auto|X]``.

Inventories: a dense GPT-like stage (bf16 weights, fp32 layernorms), a DeepSeek-like MoE
stage (every expert's fc1/fc2 a separate parameter, fp32 routers, hyper-connection weights
and attention sinks) and a series of 80 to 10,000 fp32 parameters holding fixed total bytes
(host cost against parameter count). Ops: ``norm``; ``clip`` (a whole ``clip_grad_norm_``:
the norm, then a scale with the coefficient below 1 on every call); ``clip_noop`` (the same
with the coefficient clamped to 1); ``per_param`` (every parameter's L2 norm as one device
vector: flat's ``grad_norm(per_param=True)``, one segmented pass per buffer, against torch's
``torch._foreach_norm`` + stack (the ``torch`` row), the same per dtype group
(``upstream_fix``) and a per-parameter ``vector_norm`` loop as forks that log per-layer norms
do (``megatron``); its ``norm`` is the L2 norm of that vector). Gradients are random
(seeded) in their dtype; the norm is compared with an fp64 reference of the same values.

Floors, from the copy bandwidth measured in the same run (read + write bytes per second):
``norm`` and ``clip_noop`` read every byte once (``bytes / bandwidth``); ``clip`` reads every
byte for the norm, then reads and writes it to scale (``3 * bytes / bandwidth``), so its
scale alone is at the floor when ``clip`` is at its floor.

Timing is interleaved: every variant of one inventory is built first; then, in each of
``--rounds`` rounds, the floor's copy and every (variant, op) are timed in turn (device time,
then host time), so a slow moment of the machine lands on all rows alike. A row's time is its
fastest round's median and its floor comes from the fastest copy of the same run; one line
says how far rounds spread (median and worst over every measurement) and under which ratio a
comparison is noise.

The stock arm (:data:`STOCK`: ``megatron``) is built and run in a process of its own
(``benchmarks/isolation.py``), driven from here in the same interleaved rounds: megatron-core's
norm with transformer-engine can make an illegal memory access, which leaves a process's CUDA
context unusable. A stock cell that raises is a ``failed`` row, one whose process dies a
``crashed`` row, and the run goes on (a fresh process for the next inventory after either);
a norm further than :data:`WRONG_NORM_REL_ERR` from fp64 is a ``wrong norm`` row.

Prints a summary (``--table summary``, the default: per inventory and op, ours and each
peer's time over ours, under 100 columns) or every row (``--table full``).

The parts: measurement (``norm_clip_measure.py``), the stock arm's process
(``norm_clip_stock.py``), plot and tables (``norm_clip_report.py``); this file is the command
line and the order things run in.

Writes DIR/norm_clip.json, one record per (inventory, variant, op), fields:
``inventory, series ("model" | "scaling"), variant, path, op, device, num_params, bytes,
max_norm, rounds, time_s (the fastest round's median), time_spread ((slowest - fastest) /
fastest round), time_rounds_s (every round's median), time_kind ("cuda_events" |
"perf_counter"), host_time_s (host seconds to issue one call, the device drained before
each: the fastest round's median, as time_s), host_time_p10_s, host_time_p90_s (over every
round's calls),
host_time_burst_s (``flat`` rows only: median over 3 bursts per round of the mean host
seconds per call when 20 calls are issued back to back), bandwidth_Bps (from the fastest
copy round), floor_s, floor_spread (the copy's spread over its rounds), ratio (time_s /
floor_s), host_syncs (null on the CPU), norm, norm_ref (fp64), rel_err, per_param_rel_err
(``per_param`` rows: the largest relative error of one parameter's norm against its fp64
norm), note, error, error_at, host_profile (with ``--host-profile N``: the functions with the
most own host time per call over N profiled calls, also printed), isolated (the row ran in
a process of its own), status (``ok``, ``wrong norm (rel err X)``, ``failed (first line of
the error)``, ``crashed (how the process died: first error line it printed)``)``;
DIR/norm_clip.png; and DIR/norm_clip.txt (the noise line and the full table with its legend).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, find the repo

import torch

from benchmarks import common, inventories, isolation
from benchmarks.inventories import Inventory
from benchmarks.norm_clip_measure import (
    OPS,
    check,
    failure_fields,
    make_params,
    measure_call,
    norm_status,
    op_call,
    release,
    timed_fields,
)
from benchmarks.norm_clip_report import TABLE, plot, row_label, spreads, summary, table_fields
from benchmarks.norm_clip_stock import StockArm
from benchmarks.norm_clip_variants import CUDA_ONLY, VARIANTS, Prepared

__all__ = [
    "COPY", "OPS", "RECORD_FIELDS", "STOCK", "Prepared", "VARIANTS", "build_inventories",
    "main", "parse_args", "row_label", "run", "run_inventory", "spreads", "summary",
    "time_rounds", "timed_fields",
]  # fmt: skip

COPY = "copy"  # the floor's measurement key among the rows' (variant, op) keys
RECORD_FIELDS = (
    "inventory", "series", "variant", "path", "op", "device", "num_params", "bytes", "max_norm",
    "rounds", "time_s", "time_spread", "time_rounds_s", "time_kind", "host_time_s",
    "host_time_p10_s", "host_time_p90_s", "host_time_burst_s",
    "bandwidth_Bps", "floor_s", "floor_spread", "ratio", "host_syncs",
    "norm", "norm_ref", "rel_err", "per_param_rel_err", "note", "error", "error_at",
    "host_profile", "isolated", "status",
)  # fmt: skip
# The stock arms: run in a child process of their own (benchmarks/isolation.py), so that a
# crash there (megatron-core's norm with transformer-engine on a mixed list) is a row.
STOCK = frozenset({"megatron"})
# Gradient bytes per model inventory with --scale auto, and of the scaling series.
AUTO_BYTES = {"cpu": 8 * 2**20, "cuda": 6 * 2**30}
SCALING_BYTES = {"cpu": 8 * 2**20, "cuda": 2**30}


def parse_args(argv: list[str] | None):
    """The command line: common options plus inventory sizes, variants and ops."""
    ap = common.base_parser(__doc__.splitlines()[0])
    ap.add_argument(
        "--scale",
        type=_scale,
        default="auto",
        help="width multiplier of the model inventories, or 'auto': about 8 MiB of "
        "gradients each on the CPU, 6 GiB on CUDA (default: auto)",
    )
    ap.add_argument(
        "--scaling-counts",
        type=common.ints_at_least(1),
        default="80,300,1000,3000,10000",
        help="parameter counts of the scaling series, comma-separated; empty: no series "
        "(default: %(default)s)",
    )
    ap.add_argument(
        "--scaling-bytes",
        type=common.positive_int,
        default=None,
        help="total gradient bytes of each scaling inventory (default: 8 MiB on the CPU, "
        "1 GiB on CUDA)",
    )
    ap.add_argument(
        "--variants",
        default=None,
        help=f"comma-separated rows to run, of {list(VARIANTS)} (default: all; "
        f"{sorted(CUDA_ONLY)} only on CUDA)",
    )
    ap.add_argument(
        "--ops",
        default=",".join(OPS),
        help="comma-separated ops: norm; clip (norm, then a scale on every call); clip_noop "
        "(the coefficient clamps to 1); per_param (every parameter's norm) "
        "(default: %(default)s)",
    )
    ap.add_argument(
        "--host-profile",
        type=common.non_negative_int,
        default=0,
        metavar="CALLS",
        help="also profile CALLS calls of every op with cProfile and record the functions "
        "with the most own host time per call (field host_profile; default: off)",
    )
    ap.add_argument(
        "--table",
        choices=("summary", "full"),
        default="summary",
        help="what to print: summary (per inventory and op, each peer's time over ours, "
        "under 100 columns) or full (every row and column); the full table is written to "
        "DIR/norm_clip.txt either way (default: %(default)s)",
    )
    args = ap.parse_args(argv)
    if args.variants is None:
        skip = CUDA_ONLY if args.device != "cuda" else set()
        args.variants = ",".join(v for v in VARIANTS if v not in skip)
        if skip:
            print(f"skipping {sorted(skip)}: CUDA only", file=sys.stderr)
    unknown = set(_split(args.variants)) - set(VARIANTS) | set(_split(args.ops)) - set(OPS)
    if unknown:
        ap.error(f"unknown variant or op {sorted(unknown)}; known: {[*VARIANTS, *OPS]}")
    return args


def _scale(text: str) -> str | float:
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive number, got {text!r}")
    return value


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def build_inventories(args, device: torch.device) -> list[Inventory]:
    """The model inventories at the requested scale, then the scaling series."""
    out = []
    for name, build in inventories.MODEL_STAGES.items():
        if args.scale == "auto":
            out.append(inventories.model_stage(name, AUTO_BYTES[device.type]))
        else:
            out.append(build(args.scale))
    total = args.scaling_bytes or SCALING_BYTES[device.type]
    out += [inventories.scaling_inventory(n, total) for n in args.scaling_counts]
    return out


def time_rounds(
    preps: dict[str, Prepared],
    keys: list[tuple[str, str]],
    floor: common.CopyFloor,
    device: torch.device,
    warmup: int,
    reps: int,
    rounds: int,
):
    """Time the floor's copy and every ``(variant, op)`` in ``rounds`` interleaved rounds.

    In each round, in turn: the copy, then per row its device time (``reps / rounds`` calls,
    median) and host times (as many calls, the device drained before each; ``flat`` rows
    also :data:`BURSTS_PER_ROUND` bursts). Warm-up calls in the first round only.

    Returns:
        :func:`common.interleave`'s ``(results, errors)``, keyed by :data:`COPY` (seconds
        per round) and by ``(variant, op)`` (per round: ``{"time": s, "host": [s, ...],
        "burst": [s, ...] or None}``).
    """
    per = common.per_round(reps, rounds)

    def timed(label: str, op: str):
        prep = preps[label]
        if isinstance(prep, StockArm):  # measured in its own process, in this round's turn
            return lambda r: prep.measure(op, warmup if r == 0 else 0, per)
        call = op_call(prep, op)
        burst = prep.fields.get("variant", label) == "flat"  # ours: a few launches per call
        return lambda r: measure_call(call, device, warmup if r == 0 else 0, per, burst)

    measures = {COPY: lambda r: floor.measure(warmup if r == 0 else 0, per)}
    for label, op in keys:
        measures[(label, op)] = timed(label, op)
    return common.interleave(measures, rounds)


def run_inventory(
    inv: Inventory,
    labels: list[str],
    ops: list[str],
    device: torch.device,
    warmup: int,
    reps: int,
    rounds: int,
    profile_calls: int = 0,
    stock_child: isolation.Child | None = None,
) -> list[dict]:
    """Records of every variant on one inventory, one per op; failures become error records.

    Every variant is built first (so all can be timed in the same rounds), each checked
    for accuracy, then all timed in interleaved rounds with the floor's copy; host syncs
    are counted last. Every record gets a ``status`` (:func:`norm_status`).
    ``profile_calls``: also cProfile that many calls of each measured op (host_profile).
    ``stock_child``: where the :data:`STOCK` variants run (None: in this process).
    """
    base = {
        "inventory": inv.name,
        "series": "scaling" if inv.name.startswith("scaling_") else "model",
        "device": device.type,
        "num_params": inv.num_params,
        "bytes": inv.nbytes,
        "rounds": rounds,
        "time_kind": "cuda_events" if device.type == "cuda" else "perf_counter",
    }
    preps: dict[str, Prepared] = {}
    records: dict[tuple[str, str], dict] = {}
    for label in labels:
        isolated = stock_child is not None and label in STOCK
        try:
            if isolated:
                preps[label] = StockArm(stock_child, inv, label, device)
            else:
                preps[label] = VARIANTS[label](make_params(inv, device), device)
            fields = preps[label].fields
        except Exception as exc:  # a variant that cannot even be set up still gets its rows
            fields = failure_fields(exc)
        for op in ops:
            records[(label, op)] = (
                dict.fromkeys(RECORD_FIELDS)
                | base
                | {"variant": label, "op": op, "max_norm": OPS[op][0], "isolated": isolated}
                | fields
            )
    checked = []
    for (label, op), rec in records.items():
        if label in preps:
            prep = preps[label]
            try:
                rec |= prep.check(op) if isinstance(prep, StockArm) else check(prep, op, device)
                checked.append((label, op))
            except Exception as exc:  # e.g. megatron's clip asserting fp32 gradients
                rec |= failure_fields(exc)
    floor = common.CopyFloor(inv.nbytes, device)
    results, errors = time_rounds(preps, checked, floor, device, warmup, reps, rounds)
    copy = results.get(COPY) or [float("nan")]
    bandwidth = floor.bandwidth(min(copy))
    for key, rec in records.items():
        rec["bandwidth_Bps"] = bandwidth
        rec["floor_s"] = OPS[key[1]][1] * inv.nbytes / bandwidth
        rec["floor_spread"] = common.spread(copy)
        if key in errors:
            rec |= failure_fields(errors[key])
        elif key in results:
            rec |= timed_fields(results[key])
            rec["ratio"] = rec["time_s"] / rec["floor_s"]
            prep, op = preps[key[0]], key[1]
            # after the rounds, as in training: a first call or a graph capture syncs
            try:
                rec["host_syncs"] = (
                    prep.syncs(op)
                    if isinstance(prep, StockArm)
                    else common.count_host_syncs(op_call(prep, op), device)
                )
            except Exception as exc:
                rec |= failure_fields(exc)
            if profile_calls and rec["error"] is None:
                try:
                    rec["host_profile"] = (
                        prep.profile(op, profile_calls)
                        if isinstance(prep, StockArm)
                        else common.host_profile(op_call(prep, op), device, profile_calls)
                    )
                except Exception as exc:
                    rec |= failure_fields(exc)
                    continue
                print(f"host profile, {inv.name} {row_label(rec)} {op}:", file=sys.stderr)
                print("\n".join(rec["host_profile"]), file=sys.stderr)
    for prep in preps.values():
        if isinstance(prep, StockArm):
            prep.release()
    for rec in records.values():
        rec["status"] = norm_status(rec)
    return list(records.values())


def run(args, device: torch.device) -> list[dict]:
    """Every selected variant and op on every inventory, with its floor from this run."""
    warmup, reps = common.repeats(args, device)
    rounds = common.rounds(args, device)
    invs = build_inventories(args, device)
    print(inventories.describe(invs), file=sys.stderr)
    labels, ops = _split(args.variants), _split(args.ops)
    records: list[dict] = []
    bar = common.progress(invs, "norm_clip")
    child = None  # the stock arms' process: a fresh one after any failure there
    try:
        for inv in bar:
            bar.set_postfix_str(inv.name)
            if STOCK & set(labels) and (child is None or not child.usable):
                if child is not None:
                    child.close()
                child = isolation.Child("norm_clip-stock")
            records += run_inventory(
                inv, labels, ops, device, warmup, reps, rounds, args.host_profile, child
            )
            if child is not None and child.crash is not None:
                isolation.crash_report(child, inv.name)
            release(device)
    finally:
        if child is not None:
            child.close()
    return records


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark, write JSON, PNG and the full table, print the summary (or the
    full table with ``--table full``); returns the records."""
    args = parse_args(argv)
    device = common.resolve_device(args.device)
    title = common.run_title(device, megatron=True)
    print(title, file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        # megatron's norm all-reduces over the default group: give it a one-rank one.
        group = (
            common.single_rank_process_group(f"file://{tmp}/store")
            if device.type == "cuda"
            else contextlib.nullcontext()
        )
        with group:
            records = run(args, device)
    json_path = common.write_json(records, args.out, "norm_clip")
    png_path = plot(records, args.out, title)
    noise = common.noise_line(spreads(records), common.rounds(args, device), device)
    full = common.format_table([r | table_fields(r) for r in records], TABLE)
    txt_path = common.write_text(f"{title}\n{noise}\n\n{full}", args.out, "norm_clip")
    print(f"wrote {json_path}, {png_path} and {txt_path}", file=sys.stderr)
    if args.table == "full":
        print(noise)
        print(full)
    else:
        print(summary(records, noise, txt_path))
    return records


if __name__ == "__main__":
    main()
