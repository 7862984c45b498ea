"""Megatron-LM's pretrain_gpt.py with transformer-engine's layers, ours against stock.

``python tests/gpu/megatron_lm_te.py --out DIR`` runs, for each configuration of
:data:`CONFIGS`, ``pretrain_gpt.py --transformer-impl transformer_engine`` for ``--iters``
iterations (20) through ``megatron_lm_launcher.py`` (``python -m megatron_ext.train`` plus a
per-step record of the norm ``optimizer.step()`` returned and an fp64 norm of megatron-core's
reduced gradient buffers) twice: with ``--per-dtype-grad-buffers`` (ours) and without
(stock). Configurations: a dense GPT; the same with the precision-aware optimizer and CPU
offload; MoE router weights kept in fp32 (``--moe-router-dtype fp32 --keep-in-fp32-params
'router\\.weight$'``: the fp32 islands Megatron-LM offers), alone, with the precision-aware
optimizer (transformer-engine's FusedAdam), and with it and CPU offload (ours also with
``--offload-step chunked``). Without apex's ``fused_weight_gradient_mlp_cuda`` every run
gets ``--no-gradient-accumulation-fusion`` (``megatron_ext.train`` refuses the fusion
otherwise; one flag drives TE's layers and megatron-core's output layer alike).

Writes ``DIR/megatron_lm_te.json`` (per run: command, exit status, the first error line,
per iteration the logged loss and grad norm, the recorded norm and its fp64 reference),
``DIR/megatron_lm_te.txt`` (the table: per configuration ours and stock, where stock fails
its error) and ``DIR/megatron_lm_te.png`` (loss and grad-norm curves, ours and stock side by
side per configuration). ``--dry-run`` prints the command lines only. Exits 1 when one of
ours' runs failed. Needs ``MEGATRON_LM_PATH`` (``scripts/fetch_megatron_lm.sh``) and a GPU
with transformer-engine; ``tests/test_megatron_lm_te.py`` rehearses the rest on the CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
NAME = "megatron_lm_te"
sys.path.insert(0, str(HERE))
from megatron_lm_gpt import flags, gpt  # noqa: E402
from te_layers_driver import run_group  # noqa: E402

# tests/gpu/test_megatron_lm_gpu.py's GPT with transformer-engine's layers; one rank.
GPT = [*gpt("transformer_engine"), "--global-batch-size", "2"]
NO_FUSION = "--no-gradient-accumulation-fusion"
ON = ["--per-dtype-grad-buffers"]
ISLANDS = flags(
    r"--num-experts 4 --moe-router-topk 2 --moe-router-dtype fp32 "
    r"--keep-in-fp32-params router\.weight$ --disable-bias-linear"
)
PA = ["--use-precision-aware-optimizer"]
OFFLOAD = flags("--optimizer-cpu-offload --optimizer-offload-fraction 1.0")


@dataclass(frozen=True)
class Config:
    """One configuration: the flags both arms get, those only ours gets (stock cannot take
    them), and what stock is known to do (for the table; the run decides)."""

    flags: tuple[str, ...]
    ours_only: tuple[str, ...] = ()
    stock_known: str = "runs"


CONFIGS = {
    "dense": Config(()),
    # megatron-core's per-parameter CPU step (ours' default is chunked: the last config)
    "dense_pa_offload": Config((*PA, *OFFLOAD), ours_only=("--offload-step", "per_parameter")),
    "router_fp32": Config(tuple(ISLANDS)),
    "router_fp32_pa": Config(
        # the one-list norm over bf16 and fp32 gradients that gives GPTModel cells of
        # test_te_layers_gpu.py a wrong or non-finite norm: on 2026-12-05 right here
        (*ISLANDS, *PA),
    ),
    "router_fp32_pa_offload": Config(
        (*ISLANDS, *PA, *OFFLOAD),
        ours_only=("--offload-step", "per_parameter"),
        stock_known="fails to build: can't optimize a non-leaf Tensor",
    ),
    "router_fp32_pa_offload_chunked": Config(
        (*ISLANDS, *PA, *OFFLOAD),
        ours_only=("--offload-step", "chunked"),
        stock_known="as router_fp32_pa_offload",
    ),
}


def fusion_flags() -> list[str]:
    """``--no-gradient-accumulation-fusion`` unless apex's kernel is installed."""
    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None:
        return []
    return [NO_FUSION]


def command(config: str, arm: str, iters: int, fusion: list[str]) -> list[str]:
    """The command line of one run (``arm``: ours or stock)."""
    cfg = CONFIGS[config]
    extra = [*ON, *cfg.ours_only] if arm == "ours" else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
            str(HERE / "megatron_lm_launcher.py"), "pretrain_gpt.py", *GPT, *fusion,
            "--train-iters", str(iters), *cfg.flags, *extra]  # fmt: skip


def stock_of(config: str) -> str:
    """The configuration whose stock run stands for ``config``'s (the same stock flags)."""
    flags_ = CONFIGS[config].flags
    return next(name for name, c in CONFIGS.items() if c.flags == flags_)


_ITERATION = re.compile(r" iteration\s+(\d+)/\s*(\d+) \|(.*)")
_FIELD = re.compile(r" ([a-z][a-z _-]*?): +([-+0-9.eE]+|nan|inf|-inf) \|")


def parse_log(text: str) -> dict[int, dict]:
    """Megatron-LM's per-iteration console lines: per iteration the ``lm loss`` (None where
    Megatron-LM did not print it: it prints only losses >= 0, so a NaN loss is absent), the
    ``grad norm`` as printed (three decimals; ``inf``/``nan`` as floats), the zeros and the
    skipped and NaN iteration counts."""
    out: dict[int, dict] = {}
    for line in text.splitlines():
        m = _ITERATION.search(line)
        if not m:
            continue
        fields = {k.strip(): v for k, v in _FIELD.findall(" " + m.group(3))}

        def num(key, cast=float, fields=fields):
            return cast(float(fields[key])) if key in fields else None

        out[int(m.group(1))] = dict(
            loss=num("lm loss"),
            grad_norm=num("grad norm"),
            zeros=num("num zeros"),
            skipped=num("number of skipped iterations", int),
            nan=num("number of nan iterations", int),
        )
    return out


_ERROR = re.compile(
    r"\b\w+(Error|Exception): |megatron_ext\.train: .*(refuse|needs)|Signal \d+|illegal memory"
)


def first_error(text: str) -> str | None:
    """The first line that says why a run failed (an exception with its message, a refusal
    of ours, a signal), else None."""
    for line in text.splitlines():
        if _ERROR.search(line) and "ChildFailedError" not in line:
            return re.sub(r"^\[rank\d+\]:\s*", "", line.strip())[:300]
    return None


@dataclass
class Run:
    config: str
    arm: str
    command: list[str]
    rc: int | str | None = None
    error: str | None = None
    iterations: dict[int, dict] = field(default_factory=dict)
    record: list[dict] = field(default_factory=list)  # rank 0's per-step launcher rows

    @property
    def status(self) -> str:
        if self.rc is None:
            return "not run"
        norms = [r["norm"] for r in self.record]
        if self.rc != 0:
            return "failed"
        if norms and not any(n is not None and math.isfinite(n) for n in norms):
            return "non-finite norm"
        return "ok"


def launch(run: Run, out: Path, timeout: float) -> Run:
    """Run ``run.command`` in ``out/<config>-<arm>``; fill in its exit status, error line,
    parsed iterations and launcher record. A timeout is a failed run."""
    where = out / f"{run.config}-{run.arm}"
    where.mkdir(parents=True, exist_ok=True)
    record = where / "record"
    for stale in record.glob("rank*.jsonl"):
        stale.unlink()
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
               MEGATRON_LM_RECORD=str(record), PYTHONUNBUFFERED="1",
               CUDA_DEVICE_MAX_CONNECTIONS="1",
               NVTE_ALLOW_NONDETERMINISTIC_ALGO="0")  # ours and stock: the same bits  # fmt: skip
    run.rc, text = run_group(run.command, env, where, timeout)
    (where / "output.log").write_text(text)
    run.iterations = parse_log(text)
    run.error = first_error(text) if run.rc != 0 else None
    if run.rc == "timeout":
        run.error = f"timed out after {timeout:.0f} s" + (f"; {run.error}" if run.error else "")
    path = record / "rank0.jsonl"
    run.record = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return run


def rel(a, b) -> float:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-30)


def summary(runs: dict[tuple[str, str], Run], configs: list[str]) -> list[dict]:
    """One row per configuration and arm: status, iterations logged, first and last loss,
    worst norm error against fp64, and (ours) the worst loss and grad-norm differences from
    stock over the iterations both logged."""
    rows = []
    for config in configs:
        ours, stock = runs[(config, "ours")], runs[(stock_of(config), "stock")]
        for arm, run in (("ours", ours), ("stock", stock)):
            its = run.iterations
            losses = [its[i]["loss"] for i in sorted(its)]
            norm_err = max((rel(r["norm"], r["ref"]) for r in run.record), default=None)
            row = dict(config=config, arm=arm, status=run.status, iterations=len(its),
                       loss_first=losses[0] if losses else None,
                       loss_last=losses[-1] if losses else None, norm_vs_fp64=norm_err,
                       error=run.error, stock_known=CONFIGS[config].stock_known)  # fmt: skip
            if arm == "ours" and stock.status == "ok" and run.status == "ok":
                both = sorted(set(its) & set(stock.iterations))
                row["loss_vs_stock"] = max(
                    (rel(its[i]["loss"], stock.iterations[i]["loss"]) for i in both), default=None
                )
                pairs = zip(run.record, stock.record, strict=False)
                row["norm_vs_stock"] = max((rel(a["norm"], b["norm"]) for a, b in pairs),
                                           default=None)  # fmt: skip
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """The summary as text: a line per configuration and arm, then stock's errors."""

    def f(x, spec=".1e"):
        return "-" if x is None else format(x, spec) if isinstance(x, float) else str(x)

    head = (f"{'configuration':31} {'arm':5} {'status':15} {'its':>3} {'loss first':>10} "
            f"{'last':>7} {'vs fp64':>7} {'loss vs':>7} {'norm vs':>7}")  # fmt: skip
    lines = [head, f"{'':31} {'':5} {'':15} {'':>3} {'':>10} {'':>7} {'':>7} "
                   f"{'stock':>7} {'stock':>7}", "-" * len(head)]  # fmt: skip
    for r in rows:
        lines.append(
            f"{r['config']:31} {r['arm']:5} {r['status']:15} {r['iterations']:>3} "
            f"{f(r['loss_first'], '.4f'):>10} {f(r['loss_last'], '.4f'):>7} "
            f"{f(r['norm_vs_fp64']):>7} {f(r.get('loss_vs_stock')):>7} "
            f"{f(r.get('norm_vs_stock')):>7}"
        )
    for r in rows:
        if r["error"]:
            lines.append(f"{r['config']} ({r['arm']}): {r['error']}")
    known = {r["config"]: r["stock_known"] for r in rows if r["stock_known"] != "runs"}
    lines += [f"stock known to: {k}: {v}" for k, v in known.items()]
    return "\n".join(lines)


def plot(runs: dict[tuple[str, str], Run], configs: list[str], out: Path, title: str) -> Path:
    """Loss (top) and grad norm (bottom) per iteration, ours and stock, a column per
    configuration; a failed arm is named in the legend with its error."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(configs), figsize=(3.6 * len(configs), 6.5), squeeze=False)
    for col, config in enumerate(configs):
        arms = (("ours", runs[(config, "ours")], "-"),
                ("stock", runs[(stock_of(config), "stock")], "--"))  # fmt: skip
        for row, key in enumerate(("loss", "grad_norm")):
            ax = axes[row][col]
            for label, run, style in arms:
                its = sorted(run.iterations)
                ys = [run.iterations[i][key] for i in its]
                ys = [math.nan if y is None or not math.isfinite(y) else y for y in ys]
                if run.record and key == "grad_norm":  # the norm at full precision
                    its = list(range(1, len(run.record) + 1))
                    ys = [r["norm"] if r["norm"] is not None else math.nan for r in run.record]
                    ys = [y if math.isfinite(y) else math.nan for y in ys]
                what = label if run.status == "ok" else f"{label}: {run.status}"
                ax.plot(its, ys, style, label=what)
            ax.set_xlabel("iteration")
            ax.set_ylabel("lm loss" if key == "loss" else "grad norm")
            if row == 0:
                ax.set_title(config, fontsize=8)
            ax.legend(fontsize=7)
    path = out / f"{NAME}.png"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def versions() -> str:
    """megatron-core's and transformer-engine's versions, as installed."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for dist in ("megatron-core", "transformer-engine", "transformer_engine"):
        try:
            out.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            continue
    return ", ".join(dict.fromkeys(out)) or "versions unknown"


def write(runs: dict[tuple[str, str], Run], configs: list[str], out: Path,
          fusion: list[str]) -> str:  # fmt: skip
    """JSON, table and PNG of ``runs`` (the configurations ``configs``) into ``out``;
    returns the table."""
    out.mkdir(parents=True, exist_ok=True)
    rows = summary(runs, configs)
    text = table(rows)
    title = f"pretrain_gpt.py, transformer-engine layers, ours vs stock ({versions()})"
    blob = dict(title=title, fusion_flags=fusion, rows=rows,
                runs=[asdict(r) | {"status": r.status} for r in runs.values()])  # fmt: skip
    (out / f"{NAME}.json").write_text(json.dumps(blob, indent=1, default=str))
    (out / f"{NAME}.txt").write_text(text + "\n")
    plot(runs, configs, out, title)
    return text


def plan(configs: list[str], iters: int, fusion: list[str]) -> dict[tuple[str, str], Run]:
    """Every run: ours per configuration, stock once per distinct set of stock flags."""
    runs = {}
    for config in configs:
        runs[(config, "ours")] = Run(config, "ours", command(config, "ours", iters, fusion))
        stock = stock_of(config)
        if (stock, "stock") not in runs:
            runs[(stock, "stock")] = Run(stock, "stock", command(stock, "stock", iters, fusion))
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for JSON, table, PNG")
    parser.add_argument("--iters", type=int, default=20, help="iterations per run (20)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, from {list(CONFIGS)} (all)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=3,
                        help="runs at once on the one GPU (3; each is small)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per run (240)")
    parser.add_argument("--dry-run", action="store_true", help="print the command lines only")
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    if not args.dry_run and not os.environ.get("MEGATRON_LM_PATH"):
        parser.error("set MEGATRON_LM_PATH to a folder with pretrain_gpt.py "
                     "(scripts/fetch_megatron_lm.sh)")  # fmt: skip
    fusion = fusion_flags()
    runs = plan(configs, args.iters, fusion)
    if args.dry_run:
        for (config, arm), run in runs.items():
            print(f"# {config} ({arm})\n{shlex.join(run.command)}")
        return 0
    # the outputs are rewritten as each run ends: a step cut short keeps what finished
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        pending = [pool.submit(launch, r, args.out, args.timeout) for r in runs.values()]
        for future in as_completed(pending):
            run = future.result()
            print(f"{run.config} ({run.arm}): {run.status} {run.error or ''}", flush=True)
            text = write(runs, configs, args.out, fusion)
    print(text)
    return 1 if any(r.status != "ok" for (_, arm), r in runs.items() if arm == "ours") else 0


if __name__ == "__main__":
    sys.exit(main())
