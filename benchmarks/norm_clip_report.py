"""benchmarks/norm_clip.py's report: the plot, the full table and the summary."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, find the repo

from benchmarks import common
from benchmarks.norm_clip_measure import WRONG_NORM_REL_ERR


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


def spreads(records: list[dict]) -> dict[str, float]:
    """Every measurement's spread over its rounds: each row's time, each inventory's copy."""
    out = {}
    for r in records:
        if r["time_spread"] is not None:
            out[f"{r['inventory']} {row_label(r)} {r['op']}"] = r["time_spread"]
        if r["floor_spread"] is not None:
            out[f"{r['inventory']} copy (floor)"] = r["floor_spread"]
    return out


def table_fields(rec: dict) -> dict:
    """The full table's computed cells of one record (its label, its host time range)."""
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


if __name__ == "__main__":
    sys.exit(common.not_a_script(__file__, ("norm_clip.py",)))
