"""The driver of the transformer-engine GPT cells: launching each arm of
``te_layers_worker.py`` under torchrun, a crashed or hung cell as a row, judging ours and
stock per cell, the table (imported by tests/gpu/test_te_layers_gpu.py and the CPU tests;
``run_group`` also by megatron_lm_te.py)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
from pathlib import Path

import torch
from te_layers_worker import (  # noqa: F401 - cells(), cell_name: the tests read them here
    CLIP,
    HERE,
    KINDS,
    ROOT,
    STEPS,
    STOCK_FP32_UNSTEPPED,
    STOCK_MIXED_NORM,
    STOCK_NON_LEAF,
    cell_name,
    cells,
    finite,
    parse_cell,
    stock_cell,
    stock_expected,
)


def read_rows(out: Path, arm: str) -> tuple[dict[str, dict], set[str]]:
    """Every rank's rows of ``arm``: per cell, the rank rows (rank -> row); and the cells
    started by some rank."""
    rows: dict[str, dict] = {}
    started: set[str] = set()
    for path in sorted(out.glob(f"{arm}-rank*.jsonl")):
        rank = int(path.stem.rsplit("rank", 1)[1])
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if "start" in row:
                started.add(row["start"])
            else:
                rows.setdefault(row["cell"], {})[rank] = row
    return rows, started


def launch(arm: str, names: list[str], out: Path, *, cpu: bool = False,
           timeout: float = 600.0) -> dict[str, dict]:  # fmt: skip
    """Run ``names`` (one world size) for ``arm`` under torchrun; a cell whose process dies
    becomes a ``crashed`` row (exit status and first error line) and the cells after it run
    in a fresh launch. Returns per cell rank 0's row, with ``ranks_disagree`` set where
    another rank's status differs."""
    world = {parse_cell(n)["world"] for n in names}
    if len(world) != 1:
        raise ValueError(f"cells of one world size per launch, not {sorted(world)}")
    (world,) = world
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"{arm}-rank*.jsonl"):  # rows of an earlier launch (read already)
        stale.unlink()
    env = dict(os.environ)
    paths = [str(ROOT), env.get("PYTHONPATH", "")]
    if world > 1 and not cpu:
        paths.insert(0, str(ROOT / "tests" / "support" / "multirank"))
    env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1")
    remaining = list(names)
    crashed: dict[str, dict] = {}
    while remaining:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={world}", str(HERE / "te_layers_worker.py"), "--arm", arm,
               "--out", str(out), *(["--cpu"] if cpu else []), *remaining]  # fmt: skip
        rc, text = run_group(cmd, env, None, timeout)
        rows, started = read_rows(out, arm)
        left = [n for n in remaining if n not in rows and n not in crashed]
        if not left:
            break
        dead = next((n for n in left if n in started), left[0])
        crashed[dead] = dict(cell=dead, arm=arm, **parse_cell(dead), status=f"crashed ({rc})",
                             error=first_error_line(text), output=text[-4000:])  # fmt: skip
        remaining = [n for n in left if n != dead]
    rows, _ = read_rows(out, arm)
    result = {}
    for name in names:
        if name in crashed:
            result[name] = crashed[name]
            continue
        ranks = rows[name]
        row = dict(ranks[min(ranks)])
        statuses = {r["status"] for r in ranks.values()}
        row["ranks_disagree"] = len(ranks) != world or len(statuses) > 1
        result[name] = row
    return result


_ERROR = re.compile(r"Signal \d+|SIG[A-Z]+|\b\w+(Error|Exception): |illegal memory|Aborted")


def run_group(cmd: list[str], env: dict, cwd, timeout: float) -> tuple[int | str, str]:
    """Run ``cmd``; its exit status (``"timeout"`` when it ran past ``timeout`` seconds:
    then it and every process under it are killed, torchrun's workers too, which it starts
    in process groups of their own, so that none is left holding the GPU) and its output."""
    import signal
    import subprocess

    proc = subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        text, _ = proc.communicate(timeout=timeout)
        return proc.returncode, text
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        text, _ = proc.communicate()
        return "timeout", text


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (from /proc), children before their children."""
    parent_of = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parent_of[int(stat.parent.name)] = int(fields[1])
    out, frontier = [], [pid]
    while frontier:
        frontier = [p for p, parent in parent_of.items() if parent in frontier]
        out += frontier
    return out


def first_error_line(text: str) -> str:
    """The line of a dead launch's output that says what happened: a signal, an error with
    its message; else the last line."""
    for line in text.splitlines():
        if _ERROR.search(line) and "ChildFailedError" not in line:
            return line.strip()[:300]
    return text.strip().splitlines()[-1][:300] if text.strip() else "no output"


def norm_errors(row: dict) -> list[float]:
    """Per step, the norm's relative error against the fp64 reference (inf where either is
    not finite)."""
    out = []
    for s in row.get("steps", []):
        ok = finite(s["norm"]) and finite(s["ref"]) and s["ref"] > 0
        out.append(abs(s["norm"] - s["ref"]) / s["ref"] if ok else math.inf)
    return out


# Parameters after the first step (the same gradients on both sides), ours against stock,
# per element: within one unit in the last place of the parameter's dtype relative to
# stock's value, plus 1e-6 absolute (ours' norm and stock's differ in the last bits of
# fp32, so the clip coefficients do, and a rounding may land on the other side). From the
# second step on the gradients differ in the last bits too and Adam amplifies the ones that
# are rounding noise (a key bias's, zero in exact arithmetic; measured on the CPU: 1 ulp
# after one step, up to 70 after three), so later steps compare the loss: within LOSS_RTOL.
LOSS_RTOL = 1e-4
PARAM_RTOL = {"torch.bfloat16": 2.0**-7, "torch.float16": 2.0**-10, "torch.float32": 2.0**-20}
PARAM_ATOL = 1e-6


def compare_params(ours: Path, stock: Path) -> dict:
    """Ours' saved parameters against stock's: the worst element relative to its
    tolerance (at most 1 passes), how many tensors are bit for bit equal, and the names
    of those out of tolerance."""
    a, b = torch.load(ours), torch.load(stock)
    if set(a["params"]) != set(b["params"]):
        return dict(worst=math.inf, equal=0, total=0, bad=["different parameter names"])
    worst, equal, bad = 0.0, 0, []
    for n, x in a["params"].items():
        y = b["params"][n]
        tol = PARAM_RTOL[b["dtypes"][n]] * y.abs() + PARAM_ATOL
        ratio = float(((x - y).abs() / tol).max()) if x.numel() else 0.0
        worst = max(worst, ratio)
        equal += bool(torch.equal(x, y))
        if not ratio <= 1.0:
            bad.append(n)
    return dict(worst=worst, equal=equal, total=len(a["params"]), bad=bad)


def judge(name: str, ours: dict, stock: dict, out: Path, stock_tol: float = 1e-6) -> dict:
    """One result row for ``name``: ours' and stock's outcome, the worst norm errors
    against fp64, where stock runs and is right the parameters after the first step and the
    losses compared (:data:`PARAM_RTOL`, :data:`LOSS_RTOL`), and
    ``failures``: what contradicts the expectations (ours right every step; stock as
    :func:`stock_expected` says; "right" is within ``stock_tol`` of fp64)."""
    cell = parse_cell(name)
    failures = []
    ours_err = norm_errors(ours)
    if ours["status"] != "ok" or ours.get("ranks_disagree"):
        failures.append(f"ours: {ours['status']} {ours.get('error') or ''}".strip())
    elif len(ours_err) != STEPS or not max(ours_err) <= 1e-6:
        failures.append(f"ours: norm vs fp64 per step {ours_err}")
    elif not all(s["ok"] for s in ours["steps"]):
        failures.append("ours: a step was skipped")
    elif not min(s["ref"] for s in ours["steps"]) > CLIP:
        failures.append("ours: clipping was not active")
    if ours["status"] == "ok" and ours.get("fp32_unchanged"):
        failures.append(f"ours: fp32 parameters never changed: {ours['fp32_unchanged']}")
    if ours.get("te") and ours["status"] == "ok" and not ours.get("te_weights"):
        failures.append("ours: the model holds no transformer-engine layer")
    if ours.get("te_weights") and ours.get("te_fused") != ours["te_weights"]:
        failures.append(
            f"ours: TE accumulated {ours.get('te_fused')} of {ours['te_weights']} weight "
            "gradients into main_grad (fuse_wgrad_accumulation not in effect)"
        )
    low = "torch.float16" if KINDS[cell["kind"]].get("fp16") else "torch.bfloat16"
    want = sorted({low, "torch.float32"} if cell["islands"] else {low})
    if ours["status"] == "ok" and ours.get("grad_dtypes") != want:
        failures.append(f"ours: gradient buffers {ours.get('grad_dtypes')}, not {want}")
    expected = stock_expected(cell["kind"], cell["islands"])
    stock_err = norm_errors(stock)
    if stock["status"] == "ok" and stock_err and max(stock_err) <= stock_tol:
        outcome = "ok"
    elif (
        stock["status"] == "ok" and stock_err and not any(finite(s["norm"]) for s in stock["steps"])
    ):
        outcome = "nonfinite"
    elif stock["status"] == "ok":
        outcome = "wrong norm"
    else:
        outcome = stock["status"]
    if stock["status"] == "ok" and cell["islands"] and stock.get("fp32_unchanged"):
        outcome = STOCK_FP32_UNSTEPPED  # it ran, and left fp32 parameters as they were
    row = dict(cell=name, **cell, ours=ours["status"], ours_norm_err=max(ours_err, default=None),
               stock=outcome, stock_error=stock.get("error"),
               stock_norm_err=max(stock_err, default=None), expected_stock=expected)  # fmt: skip
    if expected == "ok":
        if outcome != "ok":
            failures.append(f"stock: {outcome} {stock.get('error') or stock_err}")
        elif ours["status"] == "ok":
            first = abs(ours["steps"][0]["ref"] - stock["steps"][0]["ref"])
            if not first <= 1e-6 * stock["steps"][0]["ref"]:
                failures.append("the first step's gradients differ between ours and stock")
            cmp = compare_params(out / f"ours-{name}-1.pt", out / f"stock-{stock['cell']}-1.pt")
            row.update(params_worst=cmp["worst"], params_equal=f"{cmp['equal']}/{cmp['total']}")
            if cmp["bad"]:
                failures.append(f"parameters after step 1 differ from stock's: {cmp['bad']}")
            last = compare_params(out / f"ours-{name}.pt", out / f"stock-{stock['cell']}.pt")
            row["params_equal_last"] = f"{last['equal']}/{last['total']}"
            loss = max(
                abs(a["loss"] - b["loss"]) / abs(b["loss"])
                for a, b in zip(ours["steps"], stock["steps"], strict=True)
            )
            row["loss_vs_stock"] = loss
            if not loss <= LOSS_RTOL:
                failures.append(f"losses differ from stock's by up to {loss:.2e} (relative)")
    elif expected == STOCK_MIXED_NORM:
        if outcome not in ("nonfinite", "wrong norm"):
            failures.append(f"stock was expected to give a {expected}, gave {outcome}")
    elif outcome == STOCK_FP32_UNSTEPPED and expected == STOCK_NON_LEAF:
        row["stock_error"] = f"{STOCK_FP32_UNSTEPPED}: {', '.join(stock['fp32_unchanged'])}"
    elif not (outcome == "build failed" and expected in (stock.get("error") or "")):
        failures.append(f"stock was expected to fail to build ({expected}), gave {outcome}")
    row["failures"] = failures
    return row


def run_all(names: list[str], out: Path, timeout: float) -> tuple[dict[str, dict], str]:
    """Both arms of ``names``, a world size at a time (stock once per :func:`stock_cell`),
    judged; the table and the rows as JSON written to ``out`` after each world size (a run
    cut short keeps the first's). Returns the judged rows by cell, and the table."""
    out.mkdir(parents=True, exist_ok=True)
    judged: dict[str, dict] = {}
    text = ""
    for world in sorted({parse_cell(n)["world"] for n in names}):
        these = [n for n in names if parse_cell(n)["world"] == world]
        ours = launch("ours", these, out, timeout=timeout)
        stock = launch("stock", list(dict.fromkeys(map(stock_cell, these))), out, timeout=timeout)
        for n in these:
            judged[n] = judge(n, ours[n], stock[stock_cell(n)], out)
        rows = [judged[n] for n in names if n in judged]
        text = table(rows)
        (out / "te_layers.txt").write_text(text + "\n")
        (out / "te_layers.json").write_text(json.dumps(rows, indent=1, default=str))
    return judged, text


def table(rows: list[dict]) -> str:
    """The result rows as a fixed-width table (one line per cell)."""

    def fmt(x):
        return "-" if x is None else f"{x:.1e}" if isinstance(x, float) else str(x)

    def ratio(x):
        return "-" if x is None else f"{x:.2f}"

    head = (f"{'cell':40} {'ours':4} {'vs fp64':>7} {'stock':14} {'vs fp64':>7} "
            f"{'step1':>5} {'equal':>5} {'loss':>7} {'last':>5}  verdict")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        stock = r["stock"] if r["stock"] != "build failed" else "fails to build"
        lines.append(
            f"{r['cell']:40} {r['ours']:4} {fmt(r['ours_norm_err']):>7} {stock[:14]:14} "
            f"{fmt(r['stock_norm_err']):>7} {ratio(r.get('params_worst')):>5} "
            f"{r.get('params_equal', '-'):>5} {fmt(r.get('loss_vs_stock')):>7} "
            f"{r.get('params_equal_last', '-'):>5}  {'ok' if not r['failures'] else 'FAILED'}"
        )
    lines.append(
        "vs fp64: worst relative norm error over the steps; step1: parameters after step 1, "
        "worst element / tolerance; equal: tensors bit for bit equal after step 1 / after "
        "the last (last); loss: worst relative loss difference"
    )
    errors = sorted({r["stock_error"] for r in rows if r.get("stock_error")})
    lines += [f"stock error: {e}" for e in errors]
    return "\n".join(lines)
