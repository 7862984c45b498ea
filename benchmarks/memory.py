"""Gradient-buffer bytes per rank: ours against megatron-core's default and grad_reduce_in_fp32.

Run: ``python benchmarks/memory.py --device {cpu,cuda} --out DIR [--dp N]``.

Layout rows (computed, nothing allocated; full-size models) for one pipeline stage on one
rank: a DeepSeek-V3/V4-like model at TP1/PP32/EP8 (two MoE layers, 256 / 8 = 32 routed
experts per layer on this rank) and a dense 70B-like model at TP8/PP8 (ten layers,
TP-sharded shapes). Columns: ours (``buffers.plan_layout``: bf16 buffers, fp32 islands,
64-element alignment), stock (megatron-core's own
``DistributedOptimizer.compute_full_param_layout`` with ``grad_reduce_in_fp32=False``:
gradients in their parameter's dtype) and fp32 (the same with ``grad_reduce_in_fp32=True``).

Measured rows: a megatron-core DDP + distributed optimizer model with ``megatron_ext``'s
``per_dtype_grad_buffers`` on, off, and with ``grad_reduce_in_fp32=True``, each in a process
of its own, through its optimizer steps (see ``memory_ddp.py``): the bytes held between steps
and inside the step on both devices; peak allocated, and the peaks of forward+backward and of
the optimizer step, on CUDA only (the CPU rows run megatron-core through the test shim, at
small sizes, and count live tensor bytes).

Writes DIR/memory.json (``kind`` is ``"layout"`` or ``"measured"``; fields in
:data:`LAYOUT_FIELDS` and ``memory_ddp.MEASURED_FIELDS``), DIR/memory.png and DIR/memory.txt
(the tables printed).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, find the repo

import torch

from benchmarks import common, inventories, isolation, memory_ddp
from benchmarks.inventories import Inventory
from buffers import plan_layout
from buffers.plan import ALIGN

LAYOUT_FIELDS = (
    "kind", "model", "tp", "pp", "ep", "dp", "expert_dp", "bucket_size", "num_params", "numel",
    "ours_bytes", "ours_fp32_island_bytes", "ours_padding_bytes", "stock_bytes", "fp32_bytes",
    "ours_gib", "stock_gib", "fp32_gib", "fp32_minus_ours_gib", "stock_minus_ours_gib",
    "stock_minus_ours_bytes", "stock_method",
)  # fmt: skip
STOCK_METHOD = "megatron.core DistributedOptimizer.compute_full_param_layout (meta tensors)"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One model stage on one rank, and the parallelism that shaped it."""

    inventory: Inventory
    tp: int
    pp: int
    ep: int


def settings() -> list[Setting]:
    """The production settings we report: DeepSeek-like TP1/PP32/EP8, dense 70B TP8/PP8."""
    ep = 8
    moe = dataclasses.replace(inventories.DEEPSEEK_STAGE, ep=ep)
    dense = inventories.DENSE_70B_STAGE
    return [
        Setting(inventories.moe_stage("deepseek_tp1_pp32_ep8", moe), tp=1, pp=32, ep=ep),
        Setting(inventories.dense_stage("dense70b_tp8_pp8", dense), tp=dense.tp, pp=8, ep=1),
    ]


def meta_params(inv: Inventory) -> list[torch.nn.Parameter]:
    """Storage-less parameters carrying the attributes Megatron's layout reads."""
    out = []
    for e in inv.entries:
        p = torch.nn.Parameter(torch.empty(e.shape, dtype=e.dtype, device="meta"))
        if e.name in inv.expert_parallel:
            p.allreduce = False  # Megatron's mark for expert-parallel buffers
        out.append(p)
    return out


def stock_bytes(
    inv: Inventory, dp: int, expert_dp: int, bucket_size: int | None, grad_reduce_in_fp32: bool
) -> int:
    """Gradient-buffer bytes megatron-core's distributed-optimizer layout gives this rank.

    Args:
        inv: the rank's parameters.
        dp: data-parallel size (bucket ends are padded to a multiple of lcm(dp, 128)).
        expert_dp: the expert data-parallel size, for expert-parallel buffers.
        bucket_size: elements per bucket, or None for one bucket per buffer.
        grad_reduce_in_fp32: Megatron's option: every gradient buffer in fp32.

    Returns:
        Bytes of all gradient buffers, padding included.
    """
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32, use_distributed_optimizer=True
    )
    layout = DistributedOptimizer.compute_full_param_layout(
        meta_params(inv), bucket_size, dp, cfg, expert_data_parallel_world_size=expert_dp
    )
    return sum(
        per_buffer.bucket_indices[-1][1] * torch.empty((), dtype=key.grad_dtype).element_size()
        for key, per_buffer in layout.layouts.items()
    )


def layout_record(s: Setting, dp: int, bucket_size: int | None) -> dict:
    """One layout row: ours, stock and fp32 bytes for one setting."""
    inv = s.inventory
    expert_dp = max(1, dp * s.tp // s.ep)
    plan = plan_layout(inv.entries, align=ALIGN)
    fp32_island = plan.buffers.get(torch.float32)
    ours = plan.nbytes
    stock = stock_bytes(inv, dp, expert_dp, bucket_size, grad_reduce_in_fp32=False)
    fp32 = stock_bytes(inv, dp, expert_dp, bucket_size, grad_reduce_in_fp32=True)
    return {
        "kind": "layout",
        "model": inv.name,
        "tp": s.tp,
        "pp": s.pp,
        "ep": s.ep,
        "dp": dp,
        "expert_dp": expert_dp,
        "bucket_size": bucket_size,
        "num_params": inv.num_params,
        "numel": inv.numel,
        "ours_bytes": ours,
        "ours_fp32_island_bytes": fp32_island.nbytes if fp32_island else 0,
        "ours_padding_bytes": ours - inv.nbytes,
        "stock_bytes": stock,
        "fp32_bytes": fp32,
        "ours_gib": common.gib(ours),
        "stock_gib": common.gib(stock),
        "fp32_gib": common.gib(fp32),
        "fp32_minus_ours_gib": common.gib(fp32 - ours),
        "stock_minus_ours_gib": common.gib(stock - ours),
        "stock_minus_ours_bytes": stock - ours,
        "stock_method": STOCK_METHOD,
    }


def parse_args(argv: list[str] | None):
    """The command line: common options plus data-parallel size and the measured model."""
    ap = common.base_parser(__doc__.splitlines()[0], timed=False)
    ap.add_argument(
        "--dp",
        type=common.positive_int,
        default=8,
        help="data-parallel size (default: %(default)s)",
    )
    ap.add_argument(
        "--bucket-size",
        type=common.positive_int,
        default=None,
        help="elements per DDP bucket (default: none; Megatron turns bucketing off on "
        "pipeline stages after the first, and these are middle stages)",
    )
    ap.add_argument(
        "--hidden",
        type=common.positive_int,
        default=None,
        help=f"hidden size of the measured model (default: {MEASURED_SIZES['cuda'][0]} on "
        f"CUDA, {MEASURED_SIZES['cpu'][0]} on the CPU)",
    )
    ap.add_argument(
        "--layers",
        type=common.positive_int,
        default=None,
        help=f"Linear layers of the measured model (default: {MEASURED_SIZES['cuda'][1]} on "
        f"CUDA, {MEASURED_SIZES['cpu'][1]} on the CPU)",
    )
    ap.add_argument(
        "--measured",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the three configurations, each in a process of its own (default: "
        "%(default)s; --no-measured writes the layout rows alone)",
    )
    return ap.parse_args(argv)


MEASURED_SIZES = {"cuda": (8192, 8), "cpu": (256, 2)}  # (hidden, layers) by device type


def plot(records: list[dict], out_dir: Path, title: str) -> Path:
    """Bars: GiB per rank for ours/stock/fp32 per model and, in a second panel when this run
    measured them (CUDA only), peak allocated memory; no panel without data."""
    measured = [r for r in records if r["kind"] == "measured" and r["peak_allocated_gib"]]
    fig, axes = common.new_figure(2 if measured else 1)
    ax_layout = axes[0]
    layout = [r for r in records if r["kind"] == "layout"]
    columns = (("ours", "ours_gib"), ("stock", "stock_gib"), ("grad_reduce_in_fp32", "fp32_gib"))
    for j, (label, key) in enumerate(columns):
        xs = [i + j * 0.27 for i in range(len(layout))]
        ax_layout.bar(xs, [r[key] for r in layout], 0.27, label=label, color=f"C{j}")
    ax_layout.set_xticks([i + 0.27 for i in range(len(layout))], [r["model"] for r in layout])
    ax_layout.set_ylabel("gradient buffers per rank (GiB)")
    ax_layout.set_title("layout: one pipeline stage on one rank")
    ax_layout.legend(fontsize=8)
    if measured:
        ax_measured = axes[1]
        ax_measured.bar(
            [r["config"] for r in measured], [r["peak_allocated_gib"] for r in measured]
        )
        ax_measured.set_ylabel("peak allocated (GiB)")
        ax_measured.set_title("measured: megatron-core DDP + distributed optimizer")
    else:  # said in the figure, instead of a blank panel
        ax_layout.set_xlabel("(measured peak memory: CUDA only, not run here)")
    return common.save_figure(fig, out_dir, "memory", title)


def _gib(v: float) -> str:
    return f"{v:.2f}"


LAYOUT_TABLE = (
    common.Column("model", "model"),
    common.Column("params", "num_params"),
    common.Column("elements", "numel", lambda v: f"{v:,d}"),
    common.Column("ours GiB", "ours_gib", _gib, "our gradient buffers per rank"),
    common.Column(
        "stock GiB",
        "stock_gib",
        _gib,
        "megatron-core's, grad_reduce_in_fp32=False (gradients in their parameter's dtype)",
    ),
    common.Column("fp32 GiB", "fp32_gib", _gib, "megatron-core's, grad_reduce_in_fp32=True"),
    common.Column("fp32-ours", "fp32_minus_ours_gib", _gib, "GiB saved against fp32"),
    common.Column(
        "stock-ours B",
        "stock_minus_ours_bytes",
        lambda v: f"{v:+,d}",
        "bytes, stock minus ours (padding and bucket rounding differ)",
    ),
)


def _gpu_gib(v: float | None) -> str:
    return "GPU only" if v is None else _gib(v)


def _mib(v: int | None) -> str:
    return "" if v is None else f"{v / 2**20:.3f}"


MEASURED_TABLE = (
    common.Column("config", "config"),
    common.Column("device", "device"),
    common.Column(
        "held MiB",
        "held_bytes",
        _mib,
        "after zero_grad, what forward and backward start with (CUDA: allocated; CPU: live "
        "tensor storages)",
    ),
    common.Column(
        "in step MiB",
        "in_step_bytes",
        _mib,
        "after the optimizer's copy to main gradients, as held MiB",
    ),
    common.Column(
        "GPU peak GiB",
        "peak_allocated_gib",
        _gpu_gib,
        "peak allocated over build and steps (GPU only: the CPU keeps no peak)",
    ),
    common.Column(
        "GPU fwd+bwd peak",
        "peak_fwd_bwd_gib",
        _gpu_gib,
        "GiB, peak of the last step's forward and backward (GPU only)",
    ),
    common.Column(
        "GPU opt step peak",
        "peak_optimizer_step_gib",
        _gpu_gib,
        "GiB, peak of the last optimizer step: copy, norm, clip, inner step (GPU only)",
    ),
    common.Column("grad buffers GiB", "grad_buffer_gib", _gib, "DDP gradient buffers alone"),
    common.Column(
        "status",
        "status",
        lambda v: v[:60],
        "ok; failed (the error); crashed (stock configurations run in a process of their own, "
        "and that process died)",
    ),
)


def main(argv: list[str] | None = None) -> list[dict]:
    """Compute the layout rows, measure on CUDA, write JSON and PNG, print the tables."""
    args = parse_args(argv)
    device = common.resolve_device(args.device)
    title = common.run_title(device, megatron=True)
    print(title, file=sys.stderr)
    records = [
        layout_record(s, args.dp, args.bucket_size)
        for s in common.progress(settings(), "memory layouts")
    ]
    hidden, layers = MEASURED_SIZES[device.type]
    hidden = args.hidden if args.hidden is not None else hidden
    layers = args.layers if args.layers is not None else layers
    if args.measured:
        records += memory_ddp.measure_memory(hidden, layers, device.type)
    json_path = common.write_json(records, args.out, "memory")
    png_path = plot(records, args.out, title)
    tables = common.format_table([r for r in records if r["kind"] == "layout"], LAYOUT_TABLE)
    measured = [r for r in records if r["kind"] == "measured"]
    if measured:
        rows = [r | {"status": isolation.status(r["error"])} for r in measured]
        tables += "\n\n" + common.format_table(rows, MEASURED_TABLE)
    txt_path = common.write_text(f"{title}\n\n{tables}", args.out, "memory")
    print(f"wrote {json_path}, {png_path} and {txt_path}", file=sys.stderr)
    print(tables)
    return records


if __name__ == "__main__":
    main()
