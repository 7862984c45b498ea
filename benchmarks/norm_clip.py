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

Writes DIR/norm_clip.json, one record per (inventory, variant, op), fields:
``inventory, series ("model" | "scaling"), variant, path, op, device, num_params, bytes,
max_norm, time_s, time_kind ("cuda_events" | "perf_counter"), host_time_s (median host
seconds to issue one call, the device drained before each, sampled in 5 rounds that
interleave a variant's ops), host_time_p10_s, host_time_p90_s, host_time_burst_s (``flat``
rows only: median over 15 bursts, 3 per round, of the mean host seconds per call when 20
calls are issued back to back), bandwidth_Bps,
floor_s, ratio (time_s / floor_s), host_syncs (null on the CPU), norm, norm_ref (fp64),
rel_err, per_param_rel_err (``per_param`` rows: the largest relative error of one
parameter's norm against its fp64 norm), note, error, error_at, host_profile (with
``--host-profile N``: the functions with the most own host time per call over N profiled
calls, also printed)``; and DIR/norm_clip.png.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, find the repo

import torch

from benchmarks import common, inventories
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
HOST_ROUNDS = 5  # host times are sampled in this many interleaved rounds (measure_host)
BURSTS_PER_ROUND = 3
RECORD_FIELDS = (
    "inventory", "series", "variant", "path", "op", "device", "num_params", "bytes", "max_norm",
    "time_s", "time_kind", "host_time_s", "host_time_p10_s", "host_time_p90_s",
    "host_time_burst_s",
    "bandwidth_Bps", "floor_s", "ratio", "host_syncs",
    "norm", "norm_ref", "rel_err", "per_param_rel_err", "note", "error", "error_at",
    "host_profile",
)  # fmt: skip
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


def measure(prep: Prepared, op: str, device: torch.device, warmup: int, reps: int) -> dict:
    """Accuracy first (fresh values), then device time and host syncs of one op."""
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
        "time_s": common.device_time(call, device, warmup, reps),
        "host_syncs": common.count_host_syncs(call, device),
    }


def _call(prep: Prepared, op: str):
    if op == "per_param":
        if prep.per_param is None:
            raise NotImplementedError("this row has no per-parameter norms")
        return prep.per_param
    max_norm = OPS[op][0]
    return prep.norm if max_norm is None else (lambda: prep.clip(max_norm))


def measure_host(
    prep: Prepared, ops: list[str], device: torch.device, reps: int, burst: bool
) -> dict[str, dict]:
    """Host-time fields per op, sampled in :data:`HOST_ROUNDS` interleaved rounds.

    Each round times every op (``reps / HOST_ROUNDS`` calls each, device drained before
    each call), so a moment when the machine is slow (seen on the test machine: one row's
    median doubling in one round only) is spread over all
    ops instead of landing on whichever row was measured then. Median and p10/p90 over all
    rounds' calls. ``burst``: also the host time per call issued back to back (graph replays
    only), :data:`BURSTS_PER_ROUND` bursts per op per round, median over all of them.
    """
    per_round = max(1, -(-reps // HOST_ROUNDS))
    times: dict[str, list[float]] = {op: [] for op in ops}
    bursts: dict[str, list[float]] = {op: [] for op in ops}
    for _ in range(HOST_ROUNDS):
        for op in ops:
            call = _call(prep, op)
            times[op] += common.host_times(call, device, per_round)
            if burst:
                bursts[op] += common.burst_host_times(call, device, bursts=BURSTS_PER_ROUND)
    return {
        op: _host_fields(times[op])
        | {"host_time_burst_s": statistics.median(bursts[op]) if burst else None}
        for op in ops
    }


def _host_fields(times: list[float]) -> dict:
    """Median host time, and its 10th and 90th percentiles (how noisy the machine was)."""
    return {
        "host_time_s": statistics.median(times),
        "host_time_p10_s": common.percentile(times, 10),
        "host_time_p90_s": common.percentile(times, 90),
    }


def run_variant(
    label: str,
    inv: Inventory,
    device: torch.device,
    bandwidth: float,
    warmup: int,
    reps: int,
    ops: list[str],
    profile_calls: int = 0,
) -> list[dict]:
    """Records of one variant on one inventory, one per op; failures become error records.
    ``profile_calls``: also cProfile that many calls of each measured op (host_profile)."""
    base = {
        "inventory": inv.name,
        "series": "scaling" if inv.name.startswith("scaling_") else "model",
        "variant": label,
        "device": device.type,
        "num_params": inv.num_params,
        "bytes": inv.nbytes,
        "time_kind": "cuda_events" if device.type == "cuda" else "perf_counter",
        "bandwidth_Bps": bandwidth,
    }
    records = []
    try:
        prep = VARIANTS[label](make_params(inv, device), device)
    except Exception as exc:  # a variant that cannot even be set up still gets its rows
        prep, setup_error = None, common.error_fields(exc)
    measured = []
    for op in ops:
        max_norm, passes = OPS[op]
        rec = dict.fromkeys(RECORD_FIELDS) | base | {"op": op, "max_norm": max_norm}
        rec["floor_s"] = passes * inv.nbytes / bandwidth
        if prep is None:
            rec |= setup_error
        else:
            rec |= prep.fields
            try:
                rec |= measure(prep, op, device, warmup, reps)
                rec["ratio"] = rec["time_s"] / rec["floor_s"]
                measured.append(op)
            except Exception as exc:  # e.g. megatron's clip asserting fp32 gradients
                rec |= common.error_fields(exc)
        records.append(rec)
    if measured:
        burst = records[0]["variant"] == "flat"  # ours: a few launches per call
        host = measure_host(prep, measured, device, reps, burst)
        for rec in records:
            rec |= host.get(rec["op"], {})
            if profile_calls and rec["op"] in measured:
                rec["host_profile"] = common.host_profile(
                    _call(prep, rec["op"]), device, profile_calls
                )
                print(f"host profile, {inv.name} {row_label(rec)} {rec['op']}:", file=sys.stderr)
                print("\n".join(rec["host_profile"]), file=sys.stderr)
    return records


def release(device: torch.device) -> None:
    """Free the previous variant's gradients before the next one allocates its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def row_label(rec: dict) -> str:
    """``variant``, or ``variant/path`` for a variant's alternative route."""
    return rec["variant"] if rec["path"] is None else f"{rec['variant']}/{rec['path']}"


def _empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"{what}: no rows in this run", ha="center", va="center")
    ax.set_axis_off()


def _ratio_bars(ax, records: list[dict], op: str) -> None:
    if not any(r["ratio"] for r in records):
        return _empty(ax, op)
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
    ax.set_ylabel("time / floor")
    ax.set_title(f"{op}: time over the memory floor (missing bar: error)")
    ax.legend(fontsize=8)


def _host_lines(ax, records: list[dict]) -> None:
    if not any(r["host_time_s"] for r in records if r["op"] in ("norm", "clip")):
        return _empty(ax, "scaling series")
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


def plot(records: list[dict], out_dir: Path) -> Path:
    """Ratio-to-floor bars for norm and clip, and host time against parameter count."""
    fig, (ax_norm, ax_clip, ax_host) = common.new_figure(3)
    model = [r for r in records if r["series"] == "model"]
    for ax, op in ((ax_norm, "norm"), (ax_clip, "clip")):
        _ratio_bars(ax, [r for r in model if r["op"] == op], op)
    _host_lines(ax_host, [r for r in records if r["series"] == "scaling"])
    return common.save_figure(fig, out_dir, "norm_clip")


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
        "median per call: CUDA events on CUDA, wall time on the CPU",
    ),
    common.Column(
        "host us",
        "host_time_s",
        lambda v: f"{v * 1e6:.0f}",
        "median host time to issue one call, the device drained before it",
    ),
    common.Column("p10-p90 us", "host_range", meaning="10th to 90th percentile of host us"),
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
        "memory floor from the copy bandwidth measured in this run: bytes / bandwidth for "
        "norm and clip_noop, 3 x bytes / bandwidth for clip (read for the norm, read + write "
        "to scale)",
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
    common.Column("error", "error", lambda v: v.splitlines()[0][:48]),
)


def run(args, device: torch.device) -> list[dict]:
    """Every selected variant and op on every inventory, with its floor from this run."""
    warmup, reps = common.repeats(args, device)
    invs = build_inventories(args, device)
    print(inventories.describe(invs), file=sys.stderr)
    labels, ops = _split(args.variants), _split(args.ops)
    bandwidth: dict[int, float] = {}
    records: list[dict] = []
    bar = common.progress([(inv, label) for inv in invs for label in labels], "norm_clip")
    for inv, label in bar:
        bar.set_postfix_str(f"{inv.name} {label}")
        if inv.nbytes not in bandwidth:
            bandwidth[inv.nbytes] = common.copy_bandwidth(inv.nbytes, device, warmup, reps)
        records += run_variant(
            label, inv, device, bandwidth[inv.nbytes], warmup, reps, ops, args.host_profile
        )
        release(device)
    return records


def _table_fields(rec: dict) -> dict:
    out = {"label": row_label(rec)}
    if rec.get("host_time_p10_s") is not None:
        p10, p90 = rec["host_time_p10_s"] * 1e6, rec["host_time_p90_s"] * 1e6
        out["host_range"] = f"{p10:.0f}-{p90:.0f}"
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark, write JSON and PNG, print the table; returns the records."""
    args = parse_args(argv)
    device = common.resolve_device(args.device)
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
    png_path = plot(records, args.out)
    print(f"wrote {json_path} and {png_path}", file=sys.stderr)
    print(common.format_table([r | _table_fields(r) for r in records], TABLE))
    return records


if __name__ == "__main__":
    main()
