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
import dataclasses
import gc
import math
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, find the repo

import torch

from benchmarks import common, inventories, isolation
from benchmarks.inventories import Inventory
from benchmarks.norm_clip_variants import CUDA_ONLY, VARIANTS, NamedParams, Prepared

# op -> (max_norm, passes over the bytes at the floor). max_norm 0 makes the coefficient 0
# on every timed call, so every call really scales (a small positive max_norm does not: once
# clipped, rounded gradients can fall just under it and the coefficient clamps to 1). A huge
# max_norm clamps it to 1: the no-op case.
OPS: dict[str, tuple[float | None, int]] = {
    "norm": (None, 1),
    "clip": (0.0, 3),
    "clip_noop": (1e30, 1),
    "per_param": (None, 1),
}
BURSTS_PER_ROUND = 3
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
# A norm further than this from the fp64 reference is wrong: above bf16's rounding (2**-8,
# what per-tensor bf16 norms are off by), far below a misread list (TE's 0.2165 for 0.25).
WRONG_NORM_REL_ERR = 1e-2
SEED = 1234
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
        default="80,300,1000,3000,10000",
        help="parameter counts of the scaling series, comma-separated; empty: no series "
        "(default: %(default)s)",
    )
    ap.add_argument(
        "--scaling-bytes",
        type=int,
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
        type=int,
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
    if args.host_profile < 0:
        ap.error("--host-profile takes a number of calls >= 0")
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
    out += [inventories.scaling_inventory(int(n), total) for n in _split(args.scaling_counts)]
    return out


def make_params(inv: Inventory, device: torch.device) -> NamedParams:
    """Parameters with the inventory's names, shapes and dtypes, and no weight storage."""
    return [
        (e.name, torch.nn.Parameter(torch.empty(1, dtype=e.dtype, device=device).expand(e.shape)))
        for e in inv.entries
    ]


def fill_random(grads: list[torch.Tensor], device: torch.device) -> None:
    """Fresh normal values in every gradient, in its dtype; the same for every variant."""
    gen = torch.Generator(device=device).manual_seed(SEED)
    for g in grads:
        g.normal_(generator=gen)


def reference_norm(grads: list[torch.Tensor]) -> float:
    """The L2 norm of the gradients' values, accumulated in fp64."""
    total = sum(torch.linalg.vector_norm(g, dtype=torch.float64).square() for g in grads)
    return float(torch.as_tensor(total).sqrt())


def check(prep: Prepared, op: str, device: torch.device) -> dict:
    """Accuracy of one call on fresh values."""
    call = _call(prep, op)
    fill_random(prep.grads, device)
    ref = reference_norm(prep.grads)
    extra = {}
    if op == "per_param":
        norms = call().double()
        if prep.per_param_order is not None:
            norms = norms.index_select(0, prep.per_param_order)
        want = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in prep.grads])
        norm = float(torch.linalg.vector_norm(norms))
        extra["per_param_rel_err"] = float(((norms - want).abs() / want).max())
    else:
        norm = float(call())
    return extra | {
        "norm": norm,
        "norm_ref": ref,
        "rel_err": abs(norm - ref) / ref,
    }


def _call(prep: Prepared, op: str):
    if op == "per_param":
        if prep.per_param is None:
            raise NotImplementedError("this row has no per-parameter norms")
        return prep.per_param
    max_norm = OPS[op][0]
    return prep.norm if max_norm is None else (lambda: prep.clip(max_norm))


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
        call = _call(prep, op)
        burst = prep.fields.get("variant", label) == "flat"  # ours: a few launches per call
        return lambda r: measure_call(call, device, warmup if r == 0 else 0, per, burst)

    measures = {COPY: lambda r: floor.measure(warmup if r == 0 else 0, per)}
    for label, op in keys:
        measures[(label, op)] = timed(label, op)
    return common.interleave(measures, rounds)


def measure_call(call, device: torch.device, warmup: int, per: int, burst: bool) -> dict:
    """One round of one row: its device time, host times and (``burst``) burst host times."""
    return {
        "time": common.device_time(call, device, warmup, per),
        "host": common.host_times(call, device, per),
        "burst": common.burst_host_times(call, device, bursts=BURSTS_PER_ROUND) if burst else None,
    }


# --- the stock arm in its own process -------------------------------------------------------

CHILD_MODULE = "benchmarks.norm_clip"  # how the child imports this file, whatever it is here


class StockArm:
    """A variant built and run in a child process (:class:`isolation.Child`); the parent
    holds nothing of it but the fields, and says what to run when.

    Raises (every method): :class:`isolation.ChildFailed` when the call raised there,
    :class:`isolation.ChildCrashed` when the child died.
    """

    def __init__(self, child: isolation.Child, inv: Inventory, label: str, device) -> None:
        self.child = child
        self.fields = child.call(f"{CHILD_MODULE}:_child_build", inv, label, str(device))

    def check(self, op: str) -> dict:
        return self.child.call(f"{CHILD_MODULE}:_child_check", op)

    def measure(self, op: str, warmup: int, per: int) -> dict:
        return self.child.call(f"{CHILD_MODULE}:_child_measure", op, warmup, per)

    def syncs(self, op: str) -> int | None:
        return self.child.call(f"{CHILD_MODULE}:_child_syncs", op)

    def profile(self, op: str, calls: int) -> list[str]:
        return self.child.call(f"{CHILD_MODULE}:_child_profile", op, calls)

    def release(self) -> None:
        with contextlib.suppress(isolation.ChildFailed, isolation.ChildCrashed):
            self.child.call(f"{CHILD_MODULE}:_child_release")


def _with_fault(prep: Prepared, kind: str | None) -> Prepared:
    """``prep`` with the fault ``isolation.FAULT_ENV`` injects into its calls, if any."""
    if kind is None:
        return prep

    def wrap(fn):
        if fn is None:
            return None

        def faulty(*args):
            isolation.fire(kind)  # abort or raise; a wrong norm is returned below
            return fn(*args) * isolation.WRONG_NORM_FACTOR

        return faulty

    return dataclasses.replace(
        prep, norm=wrap(prep.norm), clip=wrap(prep.clip), per_param=wrap(prep.per_param)
    )


def _child_build(state: dict, inv: Inventory, label: str, device_name: str) -> dict:
    device = torch.device(device_name)
    if device.type == "cuda" and "group" not in state:
        # megatron's norm all-reduces over the default group: this process needs its own
        torch.cuda.set_device(device)
        state["group"] = contextlib.ExitStack()
        store = Path(state["group"].enter_context(tempfile.TemporaryDirectory())) / "store"
        state["group"].enter_context(common.single_rank_process_group(f"file://{store}"))
    prep = VARIANTS[label](make_params(inv, device), device)
    state["prep"], state["device"] = _with_fault(prep, isolation.injected_fault(inv.name)), device
    return prep.fields


def _child_check(state: dict, op: str) -> dict:
    return check(state["prep"], op, state["device"])


def _child_measure(state: dict, op: str, warmup: int, per: int) -> dict:
    return measure_call(_call(state["prep"], op), state["device"], warmup, per, burst=False)


def _child_syncs(state: dict, op: str) -> int | None:
    return common.count_host_syncs(_call(state["prep"], op), state["device"])


def _child_profile(state: dict, op: str, calls: int) -> list[str]:
    return common.host_profile(_call(state["prep"], op), state["device"], calls)


def _child_release(state: dict) -> None:
    state.pop("prep", None)
    release(state["device"])


def failure_fields(exc: BaseException) -> dict:
    """A failed cell's ``error``, ``error_at`` and ``status``: ``crashed (...)`` when its
    process died, else ``failed (...)`` with the exception's first line."""
    if isinstance(exc, isolation.ChildCrashed):
        return {
            "error": f"crashed: {exc}",
            "error_at": "its own process",
            "status": f"crashed ({exc})",
        }
    fields = exc.fields if isinstance(exc, isolation.ChildFailed) else common.error_fields(exc)
    return fields | {"status": f"failed ({fields['error'].splitlines()[0]})"}


def norm_status(rec: dict) -> str:
    """``ok``, ``wrong norm (rel err X)`` past :data:`WRONG_NORM_REL_ERR` (or not finite),
    the failure's status, or ``not checked``."""
    if rec.get("status"):
        return rec["status"]
    if rec["error"] is not None:
        return f"failed ({rec['error'].splitlines()[0]})"
    errs = [rec[k] for k in ("rel_err", "per_param_rel_err") if rec.get(k) is not None]
    if not errs:
        return "not checked"
    worst = max(e if math.isfinite(e) else math.inf for e in errs)
    return f"wrong norm (rel err {worst:.1e})" if worst > WRONG_NORM_REL_ERR else "ok"


def _host_fields(per_round: list[list[float]]) -> dict:
    """Host time the way device time is reported, the fastest round's median (so on the
    CPU, where both time the same call, they agree), and the 10th and 90th percentiles over
    every round's calls (how noisy the machine was)."""
    times = [t for r in per_round for t in r]
    return {
        "host_time_s": min(statistics.median(r) for r in per_round),
        "host_time_p10_s": common.percentile(times, 10),
        "host_time_p90_s": common.percentile(times, 90),
    }


def _timed_fields(per_round: list[dict]) -> dict:
    bursts = [b for r in per_round for b in (r["burst"] or ())]
    return (
        common.round_fields("time", [r["time"] for r in per_round])
        | _host_fields([r["host"] for r in per_round])
        | {"host_time_burst_s": statistics.median(bursts) if bursts else None}
    )


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
            rec |= _timed_fields(results[key])
            rec["ratio"] = rec["time_s"] / rec["floor_s"]
            prep, op = preps[key[0]], key[1]
            # after the rounds, as in training: a first call or a graph capture syncs
            try:
                rec["host_syncs"] = (
                    prep.syncs(op)
                    if isinstance(prep, StockArm)
                    else common.count_host_syncs(_call(prep, op), device)
                )
            except Exception as exc:
                rec |= failure_fields(exc)
            if profile_calls and rec["error"] is None:
                try:
                    rec["host_profile"] = (
                        prep.profile(op, profile_calls)
                        if isinstance(prep, StockArm)
                        else common.host_profile(_call(prep, op), device, profile_calls)
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


def release(device: torch.device) -> None:
    """Free the previous variant's gradients before the next one allocates its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def row_label(rec: dict) -> str:
    """``variant``, or ``variant/path`` for a variant's alternative route."""
    return rec["variant"] if rec["path"] is None else f"{rec['variant']}/{rec['path']}"


def _ratio_bars(ax, records: list[dict], op: str) -> None:
    invs = list(dict.fromkeys(r["inventory"] for r in records))
    labels = list(dict.fromkeys(row_label(r) for r in records))
    width = 0.8 / max(1, len(labels))
    for j, label in enumerate(labels):
        by_inv = {r["inventory"]: r["ratio"] for r in records if row_label(r) == label}
        xs = [i + j * width for i, inv in enumerate(invs) if by_inv.get(inv)]
        heights = [by_inv[inv] for inv in invs if by_inv.get(inv)]
        ax.bar(xs, heights, width, label=label, color=f"C{j}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(invs))], invs)
    ax.set_yscale("log")
    ax.set_ylabel("time / floor (fastest round of each)")
    ax.set_title(f"{op}: time over the memory floor (missing bar: error)")
    ax.legend(fontsize=8)


def _host_lines(ax, records: list[dict]) -> None:
    for j, label in enumerate(dict.fromkeys(row_label(r) for r in records)):
        for op, style in (("norm", "-"), ("clip", "--")):
            pts = sorted(
                (r["num_params"], r["host_time_s"] * 1e3)
                for r in records
                if row_label(r) == label and r["op"] == op and r["host_time_s"] is not None
            )
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, style, color=f"C{j}", marker="o", label=f"{label} {op}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters (fixed total bytes)")
    ax.set_ylabel("host time per call (ms)")
    ax.set_title("host cost against parameter count")
    ax.legend(fontsize=7)


def panels(records: list[dict]) -> list[tuple]:
    """The plot's panels that have something to show: ``(draw, records, *args)`` each."""
    model = [r for r in records if r["series"] == "model"]
    out = []
    for op in ("norm", "clip"):
        rows = [r for r in model if r["op"] == op]
        if any(r["ratio"] for r in rows):
            out.append((_ratio_bars, rows, op))
    scaling = [r for r in records if r["series"] == "scaling" and r["op"] in ("norm", "clip")]
    if any(r["host_time_s"] for r in scaling):
        out.append((_host_lines, scaling))
    return out


def plot(records: list[dict], out_dir: Path, title: str) -> Path:
    """Ratio-to-floor bars for norm and clip, and host time against parameter count: the
    panels this run has rows for (no empty panel; nothing at all: one that says so)."""
    shown = panels(records)
    fig, axes = common.new_figure(max(1, len(shown)))
    for ax, (draw, *args) in zip(axes, shown, strict=False):
        draw(ax, *args)
    if not shown:
        common.empty_panel(axes[0], "no norm or clip row was measured (see the error column)")
    return common.save_figure(fig, out_dir, "norm_clip", title)


TABLE = (
    common.Column("inventory", "inventory"),
    common.Column(
        "variant",
        "label",
        meaning="megatron: megatron-core's get_grad_norm_fp32 + clip_grad_by_total_norm_fp32 "
        "(without TE or Apex: its per-tensor fallback; megatron/cpu_reimpl: that algorithm "
        "re-implemented for the CPU, where megatron-core's allocates on CUDA); upstream_fix: "
        "grouped by dtype every call, one torch._foreach_norm per group (the nearest stand-in "
        "for transformer-engine's fused multi-tensor L2 norm); torch: torch.nn.utils "
        "get_total_norm / clip_grad_norm_, foreach; flat: ours (flat/megatron_spans: through "
        "megatron_ext's DDP buffers and spans)",
    ),
    common.Column("op", "op", meaning="clip_noop: a clip whose coefficient clamps to 1"),
    common.Column("params", "num_params"),
    common.Column("MiB", "bytes", common.show_mib),
    common.Column(
        "time ms",
        "time_s",
        common.show_ms,
        "median per call in the row's fastest round: CUDA events on CUDA, wall time on the CPU",
    ),
    common.Column(
        "spread",
        "time_spread",
        lambda v: f"{v:.0%}",
        "(slowest - fastest) / fastest of the row's interleaved rounds",
    ),
    common.Column(
        "host us",
        "host_time_s",
        lambda v: f"{v * 1e6:.0f}",
        "host time to issue one call, the device drained before it: median in the fastest "
        "round (on the CPU the same call as time ms, so the two agree up to noise)",
    ),
    common.Column(
        "p10-p90 us", "host_range", meaning="10th to 90th percentile of host us, all rounds"
    ),
    common.Column(
        "burst us",
        "host_time_burst_s",
        lambda v: f"{v * 1e6:.0f}",
        "host us per call when 20 calls are issued back to back (flat rows only)",
    ),
    common.Column(
        "floor ms",
        "floor_s",
        common.show_ms,
        "memory floor from the copy bandwidth measured in this run (its fastest round, "
        "interleaved with the rows): bytes / bandwidth for norm and clip_noop, 3 x bytes / "
        "bandwidth for clip (read for the norm, read + write to scale)",
    ),
    common.Column("ratio", "ratio", lambda v: f"{v:.2f}", "time ms / floor ms"),
    common.Column("syncs", "host_syncs", meaning="host waits for the GPU in one call (CUDA only)"),
    common.Column("norm", "norm", lambda v: f"{v:.6g}", "the pre-clip norm the call returned"),
    common.Column(
        "rel err",
        "rel_err",
        lambda v: f"{v:.1e}",
        "|norm - reference| / reference; reference: the fp64 norm of the same gradients",
    ),
    common.Column(
        "pp rel err",
        "per_param_rel_err",
        lambda v: f"{v:.1e}",
        "per_param rows: the largest |norm - reference| / reference over the parameters",
    ),
    common.Column(
        "status",
        "status",
        lambda v: v[:60],
        f"ok; wrong norm (rel err past {WRONG_NORM_REL_ERR:.0e}); failed (the exception); crashed "
        "(its process died: the stock rows run in a process of their own)",
    ),
)


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


def spreads(records: list[dict]) -> dict[str, float]:
    """Every measurement's spread over its rounds: each row's time, each inventory's copy."""
    out = {}
    for r in records:
        if r["time_spread"] is not None:
            out[f"{r['inventory']} {row_label(r)} {r['op']}"] = r["time_spread"]
        if r["floor_spread"] is not None:
            out[f"{r['inventory']} copy (floor)"] = r["floor_spread"]
    return out


def _table_fields(rec: dict) -> dict:
    out = {"label": row_label(rec)}
    if rec.get("host_time_p10_s") is not None:
        p10, p90 = rec["host_time_p10_s"] * 1e6, rec["host_time_p90_s"] * 1e6
        out["host_range"] = f"{p10:.0f}-{p90:.0f}"
    return out


# Summary column headers for row labels too wide for a 100-column summary.
SHORT_LABELS = {
    "megatron/cpu_reimpl": "megatron*",
    "upstream_fix": "upstream",
    "flat/megatron_spans": "flat/spans",
}
OURS = "flat"
SUMMARY_WIDTH = 100
MAX_NOTES = 4


def _peer_cell(peer: dict | None, ours: dict | None) -> str:
    if peer is None:
        return "-"
    status = peer["status"] or ""
    for prefix in ("crashed", "failed", "wrong"):
        if status.startswith(prefix):
            return prefix
    if ours is None or not ours["time_s"] or not peer["time_s"]:
        return "-"
    return _times(peer["time_s"] / ours["time_s"])


def _times(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio < 0.1 else f"{ratio:.1f}x"


def summary(records: list[dict], noise: str, full_path: Path) -> str:
    """The compact table: per inventory and op, ours (ms, over its floor, its norm's error)
    and each peer's time over ours, a median row, and one line per kind of failure.

    Returns:
        Lines of at most :data:`SUMMARY_WIDTH` characters.
    """
    by = {(r["inventory"], r["op"], row_label(r)): r for r in records}
    peers = [lb for lb in dict.fromkeys(row_label(r) for r in records) if lb != OURS]
    cells = {(inv, op): None for inv, op, _ in by}
    rows, ratios = [], {p: [] for p in peers}
    for inv, op in cells:
        ours = by.get((inv, op, OURS))
        ok = ours is not None and ours["status"] == "ok" and ours["time_s"]
        row = {
            "inventory": inv,
            "op": op,
            "ours": common.show_ms(ours["time_s"]) if ok else (ours or {}).get("status") or "-",
            "floor": f"{ours['ratio']:.1f}" if ok and ours["ratio"] else "-",
            "err": f"{ours['rel_err']:.0e}" if ok and ours["rel_err"] is not None else "-",
        }
        for p in peers:
            row[p] = _peer_cell(by.get((inv, op, p)), ours if ok else None)
            if row[p].endswith("x"):
                ratios[p].append(float(row[p][:-1]))
        rows.append(row)
    rows.append(
        {"inventory": "median", "op": "all"}
        | {p: _times(statistics.median(v)) if v else "-" for p, v in ratios.items()}
    )
    columns = [
        common.Column("inventory", "inventory"),
        common.Column("op", "op"),
        common.Column("ours ms", "ours", lambda v: v[:9]),
        *(common.Column(SHORT_LABELS.get(p, p[:10]), p) for p in peers),
        common.Column("ours/floor", "floor"),
        common.Column("ours err", "err"),
    ]
    lines = [
        noise,
        "peer columns: the peer's time over ours, fastest rounds (above 1: ours faster)",
        *common.format_table(rows, columns).splitlines(),
    ]
    if "megatron/cpu_reimpl" in peers:
        lines.append("megatron*: megatron-core's per-tensor algorithm, re-implemented for the CPU")
    failures: dict[tuple[str, str], list[str]] = {}
    for r in records:
        if r["status"] != "ok":
            failures.setdefault((row_label(r), r["status"]), []).append(r["inventory"])
    for (label, status), invs in list(failures.items())[:MAX_NOTES]:
        where = ", ".join(dict.fromkeys(invs))
        lines.append(f"{label} at {where}: {status}")
    if len(failures) > MAX_NOTES:
        lines.append(f"and {len(failures) - MAX_NOTES} more kinds of failure (see the full table)")
    lines.append(f"full table: {full_path}")
    return "\n".join(
        ln if len(ln) <= SUMMARY_WIDTH else ln[: SUMMARY_WIDTH - 3] + "..." for ln in lines
    )


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
    full = common.format_table([r | _table_fields(r) for r in records], TABLE)
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
