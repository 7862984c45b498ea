"""Demo: the norm of a mixed bf16/fp32 gradient list, stock megatron-core next to ours and fp64.

Run: ``python -m megatron_ext.mixed_list_demo``. The list is ``bf16[128]`` and ``fp32[128]``,
every element 1/64 (true 2-norm 0.25), in both orders. Stock megatron-core's
``get_grad_norm_fp32`` runs only on a GPU, each order in its own process (the reversed order
can end its process with an illegal memory access), and is wrong only where megatron-core
calls transformer-engine's (or Apex's) fused ``multi_tensor_l2norm``, which reads every
tensor of the list with the first tensor's dtype. Where stock cannot run, or runs without
such a kernel, the output says that the bug cannot be shown there. Every run also prints a
pure-torch emulation of that read, labelled as an emulation.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

import torch

from buffers import FlatGradBuffers

NUMEL = 128
VALUE = 1 / 64
ORDERS = ("bf16,fp32", "fp32,bf16")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Recorded on an H200 with TE 2.20.2 and megatron-core 0.19.2 (issue 26); printed only as a record.
RECORDED_H200_TE = {"bf16,fp32": "0.2165", "fp32,bf16": "39.64 (and clipping writes padding)"}


def make_list(order: str, device: torch.device | str) -> list[torch.Tensor]:
    """The demo's gradients in ``order``: one tensor per dtype, ``NUMEL`` elements of 1/64."""
    return [torch.full((NUMEL,), VALUE, dtype=DTYPES[n], device=device) for n in order.split(",")]


def fp64_norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


def ours_norm(tensors: list[torch.Tensor]) -> float:
    """FlatGradBuffers' norm over parameters whose gradients are ``tensors``."""
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in tensors]
    with FlatGradBuffers([(f"p{i}", p) for i, p in enumerate(params)]) as fgb:
        for p, t in zip(params, tensors, strict=True):
            fgb.view(p).copy_(t)
        return float(fgb.grad_norm())


@dataclass(frozen=True)
class EmulatedRead:
    """One launch reading every tensor as the first tensor's dtype, within bounds only."""

    norm: float  # over the elements that lie inside their tensors' allocations
    past_end: int  # elements such a launch reads past the end of a tensor (not read here)


def emulate_first_dtype_read(tensors: list[torch.Tensor]) -> EmulatedRead:
    """Re-read each tensor's bytes as ``tensors[0].dtype``, ``numel`` elements each, in fp32.

    This is what TE's ``multi_tensor_l2norm`` does with a mixed list (it dispatches on the
    first tensor's dtype and takes each tensor's element count); bytes past a tensor's end
    are left out and counted, since what lies there is whatever the allocator put next.
    """
    first = tensors[0].dtype
    width = torch.empty((), dtype=first).element_size()
    total, past_end = 0.0, 0
    for t in tensors:
        raw = t.contiguous().view(torch.uint8)
        inside = min(t.numel(), raw.numel() // width)
        past_end += t.numel() - inside
        read = raw[: inside * width].view(first).float()
        total += float(read.square().sum())
    return EmulatedRead(math.sqrt(total), past_end)


@dataclass(frozen=True)
class StockResult:
    """What stock ``get_grad_norm_fp32`` gave in its own process, or how that process ended."""

    norm: float | None
    kernel: str  # the l2-norm kernel megatron-core bound at import, as the child reported it
    fallback: bool  # megatron-core's per-tensor torch fallback (no TE, no Apex)
    failure: str | None = None


def _stock_child(order: str, device: str) -> None:
    """Run stock megatron-core's norm on ``device`` and print JSON lines (the child process)."""
    from . import seam

    get_grad_norm_fp32 = seam.target("get_grad_norm_fp32")  # stock's: nothing installed here
    impl, fallback = seam.optional("l2 norm kernel"), seam.optional("fallback l2 norm")
    name = f"{getattr(impl, '__module__', None) or '?'}.{getattr(impl, '__name__', impl)}"
    kernel = "unknown" if impl is None else name
    report = {"kernel": kernel, "fallback": impl is not None and impl is fallback}
    print(json.dumps(report), flush=True)  # known before the call that may crash
    store = torch.distributed.HashStore()  # stock all-reduces over the default group
    torch.distributed.init_process_group("nccl", store=store, rank=0, world_size=1)
    norm = get_grad_norm_fp32(make_list(order, device))
    report["norm"] = float(torch.as_tensor(norm).reshape(-1)[0])  # waits for the kernel
    print(json.dumps(report), flush=True)
    torch.distributed.destroy_process_group()


def run_stock_child(
    order: str, device: str = "cuda", timeout_s: float = 300
) -> subprocess.CompletedProcess:
    module = "megatron_ext.mixed_list_demo"
    cmd = [sys.executable, "-m", module, "--stock-child", order, "--device", device]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:  # a hung child is a result too
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        return subprocess.CompletedProcess(cmd, -9, out, f"killed after {timeout_s:g} s")


def stock_result(proc: subprocess.CompletedProcess) -> StockResult:
    """Read a child's report: its last JSON line, and how it ended."""
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    last = reports[-1] if reports else {}
    kernel, fallback = last.get("kernel", "unknown"), bool(last.get("fallback", False))
    if proc.returncode == 0 and "norm" in last:
        return StockResult(last["norm"], kernel, fallback)
    # the exception's own line, not the hints CUDA errors end with or exit-time warnings
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"[\w.]*(Error|Exception)\b", line)]
    why = (errors or lines or ["no message"])[-1]
    failure = f"process ended with status {proc.returncode}: {why}"
    return StockResult(None, kernel, fallback, failure)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.6f}"


def stock_results(
    run_child: Callable[[str], subprocess.CompletedProcess] = run_stock_child,
) -> dict[str, StockResult]:
    """Stock megatron-core's norm of each order, each in its own process (needs CUDA)."""
    return {order: stock_result(run_child(order)) for order in ORDERS}


def report(
    device: torch.device, te_installed: bool, stock: dict[str, StockResult] | None
) -> list[str]:
    """The demo's lines: stock (None: not run), ours, fp64 and the emulated read per order."""
    lines = [
        f"list: bf16[{NUMEL}] and fp32[{NUMEL}], every element 1/64 (true 2-norm 0.25)",
        f"device: {device}; transformer-engine: {'installed' if te_installed else 'not installed'}",
    ]
    lines.append(
        f"{'order':>9}  {'stock megatron-core':>19}  {'ours':>8}  {'fp64':>8}  emulated TE read"
    )
    for order in ORDERS:
        tensors = make_list(order, device)
        s = None if stock is None else stock[order]
        stock_cell = "not run" if s is None else ("failed" if s.failure else _fmt(s.norm))
        emu = emulate_first_dtype_read(tensors)
        emu_cell = f"{emu.norm:.6f}" + (
            f" + {emu.past_end} elements past the end (not read)" if emu.past_end else ""
        )
        lines.append(
            f"{order:>9}  {stock_cell:>19}  {ours_norm(tensors):8.6f}  "
            f"{fp64_norm(tensors):8.6f}  {emu_cell}"
        )
    lines.append(
        "emulated TE read: a pure-torch re-read of each tensor's bytes in the first tensor's "
        "dtype, as one fused multi_tensor_l2norm launch reads them; an emulation, not "
        "stock's result."
    )
    if stock is None:
        lines += [
            "stock megatron-core: not run, as it needs CUDA (get_grad_norm_fp32 allocates its "
            "result there). Its bug is in transformer-engine's fused multi_tensor_l2norm, a GPU "
            "kernel, so it cannot be shown here. Without TE (or Apex) megatron-core falls back "
            "to one torch.norm per tensor, which is right up to the bf16 rounding of the bf16 "
            "tensor's own norm (0.249987 on an H200).",
            "Recorded on an H200 with TE 2.20.2 (not computed here): stock "
            + "; ".join(f"{o}: {v}" for o, v in RECORDED_H200_TE.items())
            + ". Run this on a GPU with transformer-engine to see it.",
        ]
        return lines
    for order, s in stock.items():
        lines.append(f"stock {order}: kernel {s.kernel}" + (f"; {s.failure}" if s.failure else ""))
    if all(s.fallback for s in stock.values()):
        lines.append(
            "megatron-core runs its per-tensor torch fallback here (no transformer-engine or "
            "Apex), which is right up to the bf16 rounding of the bf16 tensor's own norm: the "
            "kernel bug needs TE's fused multi_tensor_l2norm, so it cannot be shown on this "
            "machine."
        )
    return lines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m megatron_ext.mixed_list_demo", description=__doc__.splitlines()[0]
    )
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where ours and the emulation run; stock runs only on cuda (default: cuda when "
        "torch sees a GPU, else cpu; here %(default)s)",
    )
    ap.add_argument("--stock-child", choices=ORDERS, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.stock_child:
        _stock_child(args.stock_child, args.device)
        return
    device = torch.device(args.device)
    te_installed = importlib.util.find_spec("transformer_engine") is not None
    run_child = functools.partial(run_stock_child, device=str(device))
    stock = stock_results(run_child) if device.type == "cuda" else None
    for line in report(device, te_installed, stock):
        in_table = line.split()[0] in ("order", *ORDERS)
        print(
            line
            if in_table
            else textwrap.fill(line, 100, subsequent_indent="  ", break_on_hyphens=False)
        )


if __name__ == "__main__":
    main()
