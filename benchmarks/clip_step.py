"""Clip + optimizer step: an explicit clip before fused AdamW, against the clip folded in.

Stretch of issue 6. Three ways to run one step of torch's fused AdamW over the dense
GPT-like inventory's gradients, all in ``FlatGradBuffers``:

- ``step``: ``optimizer.step()`` alone, no clipping (the lower bound);
- ``clip``: ``fgb.clip_grad_norm_(max_norm)`` alone, no step (what the clip costs by
  itself, to compare with what it adds to a step);
- ``clip+step``: ``fgb.clip_grad_norm_(max_norm)`` then ``optimizer.step()``;
- ``folded``: ``fgb.clipped_step(optimizer, max_norm, fold=True)``: the norm pass, then
  the step with the clip coefficient as the fused kernel's ``grad_scale`` (no separate
  scale launch).

All rows are timed on one set of parameters, buffers and optimizer. Each step row's
``clip cost`` is its time minus ``step``'s (the ``clip`` row's is its own
time), and is compared with the norm pass's
floor (bytes / copy bandwidth, measured in the same run) as ``clip / floor``. Timing is
device time (CUDA events) on CUDA, ``perf_counter`` on the CPU. Timed calls use
``max_norm=0``: the coefficient is 0 at every call, so the scale can never take its
early exit (a clip that converged to a coefficient of 1 would time a no-op). Agreement of
folded and explicit is checked separately, with a positive max_norm.

Rounds are interleaved: in each of ``--rounds`` rounds the floor's copy and every row are
timed in turn; a row's time is its fastest round's median, the floor comes from the fastest
copy, and a line warns when a measurement's rounds spread more than 20%.

Record fields: inventory, variant, device, num_params, bytes, max_norm, rounds, time_s (the
fastest round's median), time_spread ((slowest - fastest) / fastest round), time_rounds_s,
time_kind, clip_cost_s, norm_floor_s, norm_floor_spread (the copy's spread), clip_per_floor,
grad_rel_err (on ``folded`` only: its clipped gradients against the explicit clip's,
relative to their largest value), error, error_at.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, find the repo

import torch  # noqa: E402

from benchmarks import common, inventories  # noqa: E402
from buffers import FlatGradBuffers  # noqa: E402

RECORD_FIELDS = (
    "inventory", "variant", "device", "num_params", "bytes", "max_norm", "rounds", "time_s",
    "time_spread", "time_rounds_s", "time_kind", "clip_cost_s", "norm_floor_s",
    "norm_floor_spread", "clip_per_floor", "grad_rel_err", "error", "error_at",
)  # fmt: skip
COPY = "copy"  # the floor's measurement key among the variants
VARIANTS = ("step", "clip", "clip+step", "folded")
AUTO_BYTES = {"cpu": 8 * 2**20, "cuda": 2 * 2**30}
TIMED_MAX_NORM = 0.0  # coefficient 0 every call: the scale always runs
CHECK_MAX_NORM = 1.0  # far below the norm of unit-normal gradients: coefficient in (0, 1)


def parse_args(argv: list[str] | None):
    ap = common.base_parser(__doc__.splitlines()[0])
    ap.add_argument(
        "--bytes",
        type=common.positive_int,
        default=None,
        help="gradient bytes of the inventory (default: 8 MiB on the CPU, 2 GiB on CUDA)",
    )
    return ap.parse_args(argv)


def build(inv, device: torch.device, seed: int = 0):
    """Parameters with real storage, their FlatGradBuffers and a fused AdamW."""
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for e in inv.entries:
        p = torch.empty(e.shape, dtype=e.dtype, device=device)
        p.normal_(generator=gen)
        params.append(torch.nn.Parameter(p))
    fgb = FlatGradBuffers(params)
    for p in params:
        p.grad.normal_(generator=gen)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    return params, fgb, opt


def call_of(variant: str, fgb, opt, max_norm: float = TIMED_MAX_NORM):
    if variant == "step":
        return opt.step
    if variant == "clip":
        return lambda: fgb.clip_grad_norm_(max_norm)
    if variant == "clip+step":
        return lambda: (fgb.clip_grad_norm_(max_norm), opt.step())
    return lambda: fgb.clipped_step(opt, max_norm, fold=True)


def agreement(inv, device: torch.device) -> float:
    """Max |folded - explicit| / max |explicit| of the clipped gradients after one step.

    torch's fused kernel writes the gradients it divided by ``grad_scale`` back, so both
    routes leave clipped gradients behind: the direct check of the clip. (Parameters are
    not compared: Adam's first step is nearly blind to a constant gradient scale.)
    """
    grads = []
    for variant in ("clip+step", "folded"):
        params, fgb, opt = build(inv, device)
        call_of(variant, fgb, opt, CHECK_MAX_NORM)()
        grads.append([p.grad.detach().double() for p in params])
    explicit, folded = grads
    diff = max((a - b).abs().max().item() for a, b in zip(explicit, folded, strict=True))
    return diff / max(a.abs().max().item() for a in explicit)


def run(args, device: torch.device) -> list[dict]:
    warmup, reps = common.repeats(args, device)
    rounds = common.rounds(args, device)
    per = common.per_round(reps, rounds)
    target = args.bytes or AUTO_BYTES[device.type]
    inv = inventories.model_stage("dense_gpt", target)
    print(inventories.describe([inv]), file=sys.stderr)
    # One set of parameters, buffers and optimizer for every row, as in training: timing
    # each row on objects built after the previous row's were freed added about 1.7 ms to
    # a 10 ms step on the H200 (a probe, run 25; in the git history), which the earlier
    # tables took for a cost of the clip.
    try:
        shared = build(inv, device)
    except Exception as e:  # noqa: BLE001 - reported on every row
        shared, setup_error = None, common.error_fields(e)
    copy = common.CopyFloor(inv.nbytes, device)

    def timed(call):
        return lambda r: common.device_time(call, device, warmup if r == 0 else 0, per)

    measures = {COPY: timed(lambda: copy.dst.copy_(copy.src))}
    if shared is not None:
        _, fgb, opt = shared
        measures |= {v: timed(call_of(v, fgb, opt)) for v in VARIANTS}
    results, errors = common.interleave(measures, rounds, f"clip_step {inv.name}")
    copies = results[COPY]
    floor = inv.nbytes / copy.bandwidth(min(copies))
    records = []
    for variant in VARIANTS:
        rec = {
            "inventory": inv.name, "variant": variant, "device": device.type,
            "num_params": len(inv.entries), "bytes": inv.nbytes, "max_norm": TIMED_MAX_NORM,
            "rounds": rounds,
            "time_kind": "cuda_events" if device.type == "cuda" else "perf_counter",
            "norm_floor_s": floor, "norm_floor_spread": common.spread(copies), "time_s": None,
            "time_spread": None, "time_rounds_s": None, "clip_cost_s": None,
            "clip_per_floor": None, "grad_rel_err": None, "error": None, "error_at": None,
        }  # fmt: skip
        if shared is None:
            records.append(rec | setup_error)
            continue
        if variant in errors:
            rec |= common.error_fields(errors[variant])
        else:
            rec |= common.round_fields("time", results[variant])
            if variant == "folded":
                try:
                    rec["grad_rel_err"] = agreement(inv, device)
                except Exception as e:  # noqa: BLE001 - a failing row is reported, not fatal
                    rec |= common.error_fields(e)
        records.append(rec)
    base = records[0]["time_s"]
    for rec in records[1:]:
        if rec["time_s"] is None or base is None:
            continue
        rec["clip_cost_s"] = rec["time_s"] - (0.0 if rec["variant"] == "clip" else base)
        rec["clip_per_floor"] = rec["clip_cost_s"] / floor
    return records


def spreads(records: list[dict]) -> dict[str, float]:
    """Every measurement's spread over its rounds: each row's time and the floor's copy."""
    out = {r["variant"]: r["time_spread"] for r in records if r["time_spread"] is not None}
    if records:
        out["copy (floor)"] = records[0]["norm_floor_spread"]
    return out


TABLE = (
    common.Column("inventory", "inventory"),
    common.Column("variant", "variant"),
    common.Column("MiB", "bytes", common.show_mib),
    common.Column("time ms", "time_s", common.show_ms, "median per call, fastest round"),
    common.Column(
        "spread",
        "time_spread",
        lambda v: f"{v:.0%}",
        "(slowest - fastest) / fastest of the row's interleaved rounds",
    ),
    common.Column(
        "clip cost ms",
        "clip_cost_s",
        common.show_ms,
        "what the clip adds: the row's time minus the step alone's (the clip row: its time)",
    ),
    common.Column(
        "norm floor ms",
        "norm_floor_s",
        common.show_ms,
        "bytes / copy bandwidth measured in this run (fastest round): reading the gradients once",
    ),
    common.Column("clip / floor", "clip_per_floor", lambda v: f"{v:.2f}", "clip cost / floor"),
    common.Column(
        "folded vs explicit",
        "grad_rel_err",
        lambda v: f"{v:.1e}",
        "max relative difference of the folded clip's gradients from the explicit clip's",
    ),
    common.Column("error", "error", lambda v: v.splitlines()[0][:48]),
)


def plot(records: list[dict], out: Path, title: str) -> Path:
    fig, (ax,) = common.new_figure(1)
    rows = [r for r in records if r["time_s"] is not None]
    if not rows:
        common.empty_panel(ax, "no row was measured (see the error column)")
        return common.save_figure(fig, out, "clip_step", title)
    ax.bar([r["variant"] for r in rows], [r["time_s"] * 1e3 for r in rows])
    ax.axhline(rows[0]["norm_floor_s"] * 1e3, color="gray", ls="--", label="norm floor")
    ax.legend()
    ax.set_ylabel("ms per step (fastest round)")
    ax.set_title("fused AdamW step: explicit clip vs folded clip")
    return common.save_figure(fig, out, "clip_step", title)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = common.resolve_device(args.device)
    title = common.run_title(device)
    print(title, file=sys.stderr)
    records = run(args, device)
    json_path = common.write_json(records, args.out, "clip_step")
    png_path = plot(records, args.out, title)
    print(f"wrote {json_path} and {png_path}", file=sys.stderr)
    warning = common.spread_warning(spreads(records), common.rounds(args, device))
    if warning:
        print(warning)
    print(common.format_table(records, TABLE))
    return records


if __name__ == "__main__":
    main()
