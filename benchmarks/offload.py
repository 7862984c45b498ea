"""CPU-offload copies per step: megatron-core's per-parameter path against flat host mirrors.

Run: ``python benchmarks/offload.py --device {cpu,cuda} --out DIR [--bytes N] [--dp N]
[--fraction F] [--bucket-numel N]``.

Inventories: a dense GPT-like stage (bf16 weights and biases, fp32 layernorms) and a
DeepSeek-like MoE stage (hundreds of expert parameters, fp32 routers, hyper-connection
weights and sinks), widths scaled so that their gradients hold about ``--bytes``. Each is
laid out by megatron-core's own ``DistributedOptimizer.compute_full_param_layout`` (meta
tensors) for ``--dp`` data-parallel ranks; rank 0's shard is what it offloads. Placement is
megatron-core's greedy rule (fp32 shards first, then bf16 ones, while below
``--fraction`` of the elements). The case is the precision-aware one: bf16 gradients and
parameters in the device buffers, fp32 parameters and gradients on the host.

Variants, same shard, same run:

- ``per_param``: what ``HybridDeviceOptimizer`` does: per offloaded parameter, one
  device-to-host copy into its own pinned fp32 gradient (bf16 is converted on the device,
  into a temporary, so fp32 bytes cross), and one host-to-device copy from its fp32 host
  parameter (pageable for bf16 parameters, converted on the device after the copy).
- ``flat``: :mod:`megatron_ext.offload`'s mirrors: one device-to-host copy per block, in
  the gradient's dtype, into one pinned staging tensor per buffer; one host pass per block
  converts to fp32 (``convert``); after the CPU step one host pass per block packs the
  parameters back to bf16 (``pack``) and one host-to-device copy per block sends them.

Measured per step (median): device-to-host time (CUDA events), bytes moved and achieved
bytes per second, against a pinned-copy ceiling (one pinned device-to-host copy of the flat
variant's bytes, measured in the same run); host conversion; the CPU optimizer step
(``torch.optim.AdamW(fused=True)``, megatron-core's CPU optimizer); pack; host-to-device
time. On the CPU there is no device and no pinned memory: host-to-host copies stand in for
both directions and the ceiling is a host memcpy; the output says so.

Rounds are interleaved: both variants of one inventory are built first; then in each of
``--rounds`` rounds the pinned ceiling copies and every part of each variant are timed in
turn. Each time is its fastest round's median, the ceiling its fastest round, and the
verdict (flat device-to-host copies at >= 90% of the ceiling) comes from those, with every
round's ratio (the ceiling of the same round) and their spread beside it; a line warns when
a measurement's rounds spread more than 20%.

Writes DIR/offload.json (one record per inventory and variant, fields :data:`RECORD_FIELDS`:
``d2h_s``, ``h2d_s``, ``convert_s``, ``cpu_step_s``, ``pack_s`` the fastest round's;
``d2h_spread`` and ``d2h_rounds_s`` the device-to-host time's spread and rounds;
``ceiling_spread`` the ceiling copy's; ``ceiling_ratio_rounds`` each round's ratio to that
round's ceiling) and DIR/offload.png.
"""

from __future__ import annotations

import gc
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, find the repo

import torch

from benchmarks import common, inventories, memory
from benchmarks.inventories import Inventory
from buffers.spans import Span, dp_shard_spans, intersect_spans, merge_spans
from megatron_ext.offload import host_mirror
from megatron_ext.offload import mirror_plan as offload_plan

NAME = "offload"
VARIANTS = ("per_param", "flat")
RECORD_FIELDS = (
    "inventory", "variant", "device", "time_kind", "note", "dp", "fraction", "num_params",
    "offloaded_params", "owned_bytes", "d2h_copies", "d2h_bytes", "d2h_s", "d2h_Bps",
    "ceiling_Bps", "ceiling_ratio", "convert_s", "cpu_step_s", "pack_s", "h2d_copies",
    "h2d_bytes", "h2d_s", "h2d_Bps", "h2d_ceiling_Bps", "pinned_bytes", "host_bytes",
    "rounds", "d2h_spread", "d2h_rounds_s", "ceiling_spread", "ceiling_ratio_rounds",
    "error", "error_at",
)  # fmt: skip
AUTO_BYTES = {"cpu": 4 * 2**20, "cuda": 2**30}
CPU_NOTE = (
    "device cpu: host-to-host copies stand in for device-to-host and host-to-device copies "
    "(no device, no pinned memory); the ceiling is a host memcpy"
)
CPU_STEP_REPS = 3  # the CPU optimizer step is slow at real sizes; fewer calls suffice
HOST_PASS_REPS = 10  # host conversion and pack passes
TARGET = 0.9  # flat device-to-host copies at >= 90% of the pinned ceiling


def parse_args(argv: list[str] | None):
    """The command line: common options plus sizes, data parallelism and fraction."""
    ap = common.base_parser(__doc__.splitlines()[0])
    ap.add_argument(
        "--bytes", type=common.positive_int, default=None,
        help="gradient bytes of each inventory (default: 4 MiB on the CPU, 1 GiB on CUDA)",
    )  # fmt: skip
    ap.add_argument(
        "--dp",
        type=common.positive_int,
        default=1,
        help="data-parallel ranks; rank 0's shard is measured (default: %(default)s)",
    )
    ap.add_argument(
        "--fraction",
        type=common.fraction,
        default=1.0,
        help="optimizer_offload_fraction, in (0, 1] (default: %(default)s)",
    )
    ap.add_argument(
        "--bucket-numel", type=common.positive_int, default=40_000_000,
        help="elements per DDP bucket (default: %(default)s, megatron-core's for dp <= 40)",
    )  # fmt: skip
    return ap.parse_args(argv)


@dataclass
class ShardBuffer:
    """Rank 0's shard of one gradient buffer, with device tensors and its placement."""

    name: str
    owned: tuple[Span, ...]
    offloaded: list[Span]  # CPU-updated parameter shards (buffer coordinates)
    resident: list[Span]
    grad: torch.Tensor  # the device gradient buffer
    param: torch.Tensor  # the device parameter buffer

    @property
    def owned_bytes(self) -> int:
        return sum(s.numel for s in self.owned) * self.grad.element_size()


def build_inventories(args, device: torch.device) -> list[Inventory]:
    """The two model inventories, scaled to about ``--bytes`` of gradients each."""
    target = args.bytes or AUTO_BYTES[device.type]
    return [inventories.model_stage(name, target) for name in inventories.MODEL_STAGES]


def shard_buffers(inv: Inventory, args, device: torch.device) -> list[ShardBuffer]:
    """megatron-core's distributed-optimizer layout of ``inv``; rank 0's shard, placed."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    params = memory.meta_params(inv)
    layout = DistributedOptimizer.compute_full_param_layout(
        params, args.bucket_numel, args.dp,
        DistributedDataParallelConfig(use_distributed_optimizer=True),
        expert_data_parallel_world_size=args.dp,
    )  # fmt: skip
    shards = []  # (buffer index, dtype, span) in megatron-core's placement order
    buffers = []
    gen = torch.Generator(device=device).manual_seed(0)
    for key, per in layout.layouts.items():
        numel = per.bucket_indices[-1][1]
        buckets = [Span(s, e) for s, e in per.bucket_indices]
        owned = merge_spans(dp_shard_spans(buckets, args.dp, 0))
        grad = torch.empty(numel, dtype=key.grad_dtype, device=device)
        param = torch.empty(numel, dtype=key.param_dtype, device=device)
        grad.normal_(generator=gen)
        param.normal_(generator=gen)
        name = f"{key.grad_dtype} grads".replace("torch.", "")
        buffers.append(ShardBuffer(name, owned, [], [], grad, param))
        for start, end, _ in per.param_index_map.values():
            for piece in intersect_spans([Span(start, end)], owned):
                shards.append((len(buffers) - 1, key.param_dtype, piece))
    # megatron-core's HybridDeviceOptimizer: greedy, in the distributed optimizer's group
    # order (fp32 shards, then the others), until the fraction of elements is reached
    shards.sort(key=lambda s: s[1] != torch.float32)
    total, done = sum(s[2].numel for s in shards), 0
    for index, _, span in shards:
        on_cpu = done < total * args.fraction
        done += span.numel if on_cpu else 0
        (buffers[index].offloaded if on_cpu else buffers[index].resident).append(span)
    return [b for b in buffers if b.offloaded]


class PerParam:
    """megatron-core's per-parameter copies (``HybridDeviceOptimizer``), reproduced."""

    def __init__(self, buffers: list[ShardBuffer], pin: bool):
        self.d2h, self.h2d, self.cpu_params = [], [], []
        for buf in buffers:
            for s in buf.offloaded:
                cpu = buf.param[s.start : s.end].detach().clone().cpu()
                if pin:
                    cpu = cpu.pin_memory()
                cpu = cpu.float()  # megatron-core's fp32 copy (pageable for bf16 params)
                cpu.grad = torch.empty(s.numel, dtype=cpu.dtype, pin_memory=pin)
                self.d2h.append((cpu.grad, buf.grad[s.start : s.end]))
                self.h2d.append((buf.param[s.start : s.end], cpu))
                self.cpu_params.append(cpu)
        host = [g for g, _ in self.d2h] + self.cpu_params
        self.pinned_bytes = sum(t.nbytes for t in host if t.is_pinned())
        self.host_bytes = sum(p.nbytes for p in self.cpu_params) + sum(
            g.nbytes for g, _ in self.d2h
        )
        # bf16 is converted on the device before the copy: the destination's bytes cross
        self.d2h_bytes = sum(dst.nbytes for dst, _ in self.d2h)
        self.h2d_bytes = sum(src.nbytes for _, src in self.h2d)

    def start_d2h(self) -> None:
        for dst, src in self.d2h:
            dst.copy_(src, non_blocking=True)

    def start_h2d(self) -> None:
        for dst, src in self.h2d:
            dst.copy_(src, non_blocking=True)

    convert = pack = None


class Flat:
    """:mod:`megatron_ext.offload`'s host mirrors: one staging tensor per buffer."""

    def __init__(self, buffers: list[ShardBuffer], pin: bool):
        self.mirrors, self.cpu_params = [], []
        for buf in buffers:
            layout = offload_plan.mirror_layout(buf.owned, buf.offloaded, buf.resident)
            m = host_mirror.build_buffer_mirror(
                buf.name, layout, owned_numel=sum(s.numel for s in buf.owned), grads=buf.grad,
                grads_coords=None, params=buf.param, params_coords=None,
                cpu_dtype=torch.float32, pin=pin,
            )  # fmt: skip
            m.load_params()
            for s in buf.offloaded:
                data, grad = m.cpu_views(s)
                data.grad = grad
                self.cpu_params.append(data)
            self.mirrors.append(m)
        self.blocks = [b for m in self.mirrors for b in m.blocks]
        stats = [m.stats() for m in self.mirrors]
        self.pinned_bytes = sum(s["staging_bytes"] for s in stats) if pin else 0
        self.host_bytes = sum(
            s["staging_bytes"] + s["host_param_bytes"] + s["host_grad_bytes"] for s in stats
        )
        self.d2h_bytes = sum(s["d2h_bytes"] for s in stats)
        self.h2d_bytes = sum(s["h2d_bytes"] for s in stats)
        self.d2h = self.h2d = self.blocks

    def start_d2h(self) -> None:
        for block in self.blocks:
            block.start_d2h()

    def convert(self) -> None:
        for block in self.blocks:
            block.convert_grads()

    def pack(self) -> None:
        for block in self.blocks:
            block.pack_params()

    def start_h2d(self) -> None:
        for block in self.blocks:
            block.start_h2d()


class PinnedCeiling:
    """One pinned copy of ``nbytes`` each way, timed per round: the ceiling of the copies.

    On the CPU: an ordinary host memcpy, both ways (the stand-in).
    """

    def __init__(self, nbytes: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.dev = torch.ones(max(nbytes, 1), dtype=torch.uint8, device=device)
        self.host = torch.ones(self.dev.numel(), dtype=torch.uint8, pin_memory=pin)
        self.device = device

    def measure(self, warmup: int, reps: int) -> dict:
        """Median seconds of one copy: ``{"d2h": s, "h2d": s}``."""
        dev, host = self.dev, self.host
        return {
            "d2h": common.device_time(
                lambda: host.copy_(dev, non_blocking=True), self.device, warmup, reps
            ),
            "h2d": common.device_time(
                lambda: dev.copy_(host, non_blocking=True), self.device, warmup, reps
            ),
        }


PARTS = ("d2h", "h2d", "cpu_step", "convert", "pack")  # timed per round, in this order


def build_variant(variant: str, buffers: list[ShardBuffer], device: torch.device):
    """The variant's copies over the shard, and torch's fused CPU AdamW over its parameters."""
    pin = device.type == "cuda"
    v = (PerParam if variant == "per_param" else Flat)(buffers, pin)
    return v, torch.optim.AdamW(v.cpu_params, lr=1e-4, weight_decay=0.01, fused=True)


def variant_measure(v, opt, device: torch.device, warmup: int, per: int, rounds: int):
    """One round of a variant: device-to-host and host-to-device copies (device time), the
    CPU step, conversion and pack (host time); ``{part: seconds or None}``."""
    step_reps = max(1, CPU_STEP_REPS // rounds)
    pass_reps = max(1, HOST_PASS_REPS // rounds)

    def measure(r: int) -> dict:
        w = warmup if r == 0 else 0
        out = {
            "d2h": common.device_time(v.start_d2h, device, w, per),
            "h2d": common.device_time(v.start_h2d, device, w, per),
            "cpu_step": common.host_time(opt.step, device, step_reps),
        }
        for key, fn in (("convert", v.convert), ("pack", v.pack)):
            out[key] = None if fn is None else common.host_time(fn, device, pass_reps)
        return out

    return measure


def variant_fields(v, per_round: list[dict], ceilings: list[dict]) -> dict:
    """A variant's record fields from its rounds and the same rounds' ceiling copies."""
    out = {
        "offloaded_params": len(v.cpu_params),
        "d2h_copies": len(v.d2h),
        "h2d_copies": len(v.h2d),
        "d2h_bytes": v.d2h_bytes,
        "h2d_bytes": v.h2d_bytes,
        "pinned_bytes": v.pinned_bytes,
        "host_bytes": v.host_bytes,
    }
    for part in PARTS:
        values = [r[part] for r in per_round]
        out[f"{part}_s"] = None if values[0] is None else min(values)
    d2h = [r["d2h"] for r in per_round]
    out["d2h_spread"], out["d2h_rounds_s"] = common.spread(d2h), d2h
    out["d2h_Bps"] = out["d2h_bytes"] / out["d2h_s"]
    out["h2d_Bps"] = out["h2d_bytes"] / out["h2d_s"]
    nbytes = ceilings[0]["nbytes"]
    out["ceiling_Bps"] = nbytes / min(c["d2h"] for c in ceilings)
    out["h2d_ceiling_Bps"] = nbytes / min(c["h2d"] for c in ceilings)
    out["ceiling_spread"] = common.spread([c["d2h"] for c in ceilings])
    out["ceiling_ratio"] = out["d2h_Bps"] / out["ceiling_Bps"]
    out["ceiling_ratio_rounds"] = [
        (v.d2h_bytes / t) / (nbytes / c["d2h"]) for t, c in zip(d2h, ceilings, strict=True)
    ]
    return out


def run_inventory(inv: Inventory, args, device: torch.device, base: dict) -> list[dict]:
    """Both variants on one inventory's shard, timed in interleaved rounds with the ceiling."""
    warmup, reps = common.repeats(args, device)
    rounds = common.rounds(args, device)
    per = common.per_round(reps, rounds)
    records = {v: dict(base, variant=v) for v in VARIANTS}
    try:
        buffers = shard_buffers(inv, args, device)
        flat_bytes = sum(
            offload_plan.mirror_layout(b.owned, b.offloaded, b.resident).numel
            * b.grad.element_size()
            for b in buffers
        )
        ceiling = PinnedCeiling(flat_bytes, device)
    except Exception as exc:  # a failed set-up still gets its rows
        return [rec | common.error_fields(exc) for rec in records.values()]
    owned = sum(b.owned_bytes for b in buffers)
    built = {}
    for variant, rec in records.items():
        rec["owned_bytes"] = owned
        try:
            built[variant] = build_variant(variant, buffers, device)
        except Exception as exc:
            rec |= common.error_fields(exc)
    measures = {"ceiling": lambda r: ceiling.measure(warmup if r == 0 else 0, per)}
    for variant, (v, opt) in built.items():
        measures[variant] = variant_measure(v, opt, device, warmup, per, rounds)
    results, errors = common.interleave(measures, rounds)
    for variant, rec in records.items():
        if "ceiling" in errors or variant in errors:
            rec |= common.error_fields(errors.get(variant) or errors["ceiling"])
        elif variant in built:
            ceilings = [c | {"nbytes": flat_bytes} for c in results["ceiling"]]
            rec |= variant_fields(built[variant][0], results[variant], ceilings)
    return list(records.values())


def run(args, device: torch.device) -> list[dict]:
    """Both variants on both inventories, each inventory's rounds with its own ceilings."""
    invs = build_inventories(args, device)
    print(inventories.describe(invs), file=sys.stderr)
    records = []
    for inv in common.progress(invs, NAME):
        base = dict.fromkeys(RECORD_FIELDS) | {
            "inventory": inv.name,
            "device": device.type,
            "time_kind": "cuda_events" if device.type == "cuda" else "perf_counter",
            "note": CPU_NOTE if device.type == "cpu" else "pinned device-to-host ceiling",
            "dp": args.dp,
            "fraction": args.fraction,
            "num_params": inv.num_params,
            "rounds": common.rounds(args, device),
        }
        records += run_inventory(inv, args, device, base)
        release(device)
    return records


def release(device: torch.device) -> None:
    """Free the previous measurement's host and device tensors."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def plot(records: list[dict], out_dir: Path, title: str) -> Path:
    """Achieved device-to-host bytes per second against the ceiling; per-step time parts."""
    ok = [r for r in records if r["error"] is None]
    if not ok:
        fig, (ax,) = common.new_figure(1)
        common.empty_panel(ax, "no variant was measured (see the error column)")
        return common.save_figure(fig, out_dir, NAME, title)
    fig, (ax_bw, ax_time) = common.new_figure(2)
    invs = list(dict.fromkeys(r["inventory"] for r in ok))
    width = 0.8 / len(VARIANTS)
    for j, variant in enumerate(VARIANTS):
        rows = {r["inventory"]: r for r in ok if r["variant"] == variant}
        xs = [i + j * width for i, inv in enumerate(invs) if inv in rows]
        ax_bw.bar(xs, [rows[i]["d2h_Bps"] / 1e9 for i in invs if i in rows], width, label=variant)
    for i, inv in enumerate(invs):
        ceiling = next(r["ceiling_Bps"] for r in ok if r["inventory"] == inv) / 1e9
        ax_bw.hlines(
            ceiling, i - width / 2, i + width * 1.5, colors="k", label="ceiling" * (i == 0)
        )
        ax_bw.hlines(TARGET * ceiling, i - width / 2, i + width * 1.5, colors="k", linestyles=":")
    ax_bw.set_xticks([i + width / 2 for i in range(len(invs))], invs)
    ax_bw.set_ylabel("GB/s")
    ax_bw.set_title("device-to-host gradient copies, fastest rounds (dotted: 90% of ceiling)")
    ax_bw.legend(fontsize=8)
    parts = ("d2h_s", "convert_s", "cpu_step_s", "pack_s", "h2d_s")
    labels = [f"{r['inventory']}\n{r['variant']}" for r in ok]
    bottom = [0.0] * len(ok)
    for k, part in enumerate(parts):
        heights = [(r[part] or 0.0) * 1e3 for r in ok]
        ax_time.bar(range(len(ok)), heights, bottom=bottom, label=part[:-2], color=f"C{k}")
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax_time.set_xticks(range(len(ok)), labels, fontsize=7)
    ax_time.set_ylabel("ms per step (parts run one after another here)")
    ax_time.set_title("per-step time by part")
    ax_time.legend(fontsize=8)
    return common.save_figure(fig, out_dir, NAME, title)


def _gbps(v: float) -> str:
    return f"{v / 1e9:.2f}"


TABLE = (
    common.Column("inventory", "inventory"),
    common.Column("variant", "variant"),
    common.Column("params", "offloaded_params", meaning="offloaded parameters of rank 0"),
    common.Column("D2H copies", "d2h_copies", meaning="device-to-host copies per step"),
    common.Column("D2H MiB", "d2h_bytes", common.show_mib),
    common.Column(
        "D2H ms", "d2h_s", common.show_ms, "device-to-host time per step, fastest round's median"
    ),
    common.Column(
        "spread", "d2h_spread", lambda v: f"{v:.0%}", "(slowest - fastest) / fastest D2H round"
    ),
    common.Column("GB/s", "d2h_Bps", _gbps, "D2H MiB / D2H ms"),
    common.Column(
        "ceiling GB/s",
        "ceiling_Bps",
        _gbps,
        "one pinned device-to-host copy of the flat bytes, this run's fastest round (CPU: a "
        "host memcpy)",
    ),
    common.Column("% ceiling", "ceiling_ratio", lambda v: f"{100 * v:.0f}", "GB/s / ceiling"),
    common.Column("convert ms", "convert_s", common.show_ms, "host pass to fp32 (flat)"),
    common.Column("CPU step ms", "cpu_step_s", common.show_ms, "fused AdamW on the host"),
    common.Column("pack ms", "pack_s", common.show_ms, "host pass back to bf16 (flat)"),
    common.Column("H2D copies", "h2d_copies", meaning="host-to-device copies per step"),
    common.Column(
        "H2D ms", "h2d_s", common.show_ms, "host-to-device time per step, fastest round's median"
    ),
    common.Column("pinned MiB", "pinned_bytes", common.show_mib, "pinned host memory held"),
    common.Column("owned MiB", "owned_bytes", common.show_mib, "rank 0's offloaded gradients"),
    common.Column("error", "error", lambda v: v.splitlines()[0][:48]),
)


def summary(records: list[dict]) -> list[str]:
    """One line per inventory: the flat variant against the ceiling and the target, from
    the fastest rounds, with every round's ratio and the spread beside it."""
    lines = []
    for r in records:
        if r["variant"] != "flat" or r["error"] is not None:
            continue
        verdict = "met" if r["ceiling_ratio"] >= TARGET else "NOT met"
        per_round = r["ceiling_ratio_rounds"]
        at_target = sum(x >= TARGET for x in per_round)
        if 0 < at_target < len(per_round):
            verdict += f", but the rounds disagree: {at_target} of {len(per_round)} at target"
        lines.append(
            f"{r['inventory']}: flat mirrors copy gradients device-to-host at "
            f"{r['d2h_Bps'] / 1e9:.2f} GB/s, {100 * r['ceiling_ratio']:.0f}% of the pinned "
            f"ceiling {r['ceiling_Bps'] / 1e9:.2f} GB/s measured in this run (fastest of "
            f"{len(per_round)} interleaved rounds each; per round "
            f"{100 * min(per_round):.0f}-{100 * max(per_round):.0f}%, copy spread "
            f"{100 * r['d2h_spread']:.0f}%, ceiling spread {100 * r['ceiling_spread']:.0f}%; "
            f"target {100 * TARGET:.0f}%: {verdict}); pinned {r['pinned_bytes']} B for "
            f"{r['owned_bytes']} owned gradient B"
        )
    return lines


def spreads(records: list[dict]) -> dict[str, float]:
    """Every copy measurement's spread over its rounds: each row's, each ceiling's."""
    out = {}
    for r in records:
        if r["error"] is None:
            out[f"{r['inventory']} {r['variant']} device-to-host"] = r["d2h_spread"]
            out[f"{r['inventory']} ceiling"] = r["ceiling_spread"]
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark, write JSON and PNG, print the table last; returns the records."""
    args = parse_args(argv)
    device = common.resolve_device(args.device)
    title = common.run_title(device, megatron=True)
    print(title, file=sys.stderr)
    records = run(args, device)
    json_path = common.write_json(records, args.out, NAME)
    png_path = plot(records, args.out, title)
    print(f"wrote {json_path} and {png_path}", file=sys.stderr)
    if device.type == "cpu":
        print(CPU_NOTE)
    warning = common.spread_warning(spreads(records), common.rounds(args, device))
    if warning:
        print(warning)
    for line in summary(records):
        print(line)
    print(common.format_table(records, TABLE))
    return records


if __name__ == "__main__":
    main()
