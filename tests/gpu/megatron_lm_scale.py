"""Megatron-LM's pretrain_gpt.py at a GPT-3 size with the project's offload flags, ours only.

``python tests/gpu/megatron_lm_scale.py --out DIR --size 6.7b`` runs, one at a time (each
holds the host memory of a whole optimizer), ``pretrain_gpt.py --transformer-impl
transformer_engine`` at that size through ``megatron_lm_launcher.py`` (``python -m
megatron_ext.train`` plus a per-step record of the norm ``optimizer.step()`` returned and an
fp64 norm of megatron-core's reduced gradient buffers) for each configuration of
:data:`CONFIGS`. Every configuration: bf16, the distributed optimizer, the precision-aware
optimizer, CPU offload of fraction 1.0 (``--optimizer-cpu-offload
--optimizer-offload-fraction 1.0``), ``--per-dtype-grad-buffers``, the chunked host step,
fp32 islands (:data:`ISLANDS`: the layer norms' weights kept in fp32, those of
transformer-engine's fused norm-and-linear layers and the final norm), mock data, sequence
``--seq`` (2048), micro-batches of one sequence, ``--micro-batches`` (8) of them per
iteration, Megatron-LM's own throughput line (``--log-throughput``). Stock megatron-core
cannot build these (the precision-aware optimizer with CPU offload and fp32 parameters:
"can't optimize a non-leaf Tensor", docs/RESULTS.md), so there is no stock arm.

Configurations: ``delayed`` (the one-step delayed update, ``--offload-delayed-update``),
``delayed_bf16`` (the same with bf16 moments: ``--exp-avg-dtype bf16 --exp-avg-sq-dtype
bf16``, 4 bytes a parameter less on the host), ``exact`` (the exact step). ``--size tiny``
is the 2-layer GPT of ``megatron_lm_te.py``, a rehearsal of the same flags in a minute.

Writes ``DIR/megatron_lm_scale.json`` (per run: command, exit status, first error line, per
iteration what Megatron-LM logged: loss, grad norm, elapsed ms, TFLOP/s per GPU; the
launcher's record of norm and fp64 reference) and ``DIR/megatron_lm_scale.txt`` (a line per
configuration: status, iterations, loss first and last, worst norm against fp64, and, over
the iterations after ``--skip`` (3), the median iteration time, tokens/s and Megatron-LM's
TFLOP/s per GPU). Both are rewritten as each run ends. ``--dry-run`` prints the command
lines only. Exits 1 when a run failed. Needs ``MEGATRON_LM_PATH``
(``scripts/fetch_megatron_lm.sh``), a GPU and transformer-engine;
``tests/test_megatron_lm_scale.py`` rehearses the rest on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
NAME = "megatron_lm_scale"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
import megatron_lm_te as te  # noqa: E402

from benchmarks.offload_scale import SIZES  # noqa: E402

# the layer norms' weights: in transformer-engine's fused LayerNormLinear (QKV, first MLP
# projection) and the final norm (megatron_ext.train's --keep-in-fp32-params, comma-separated)
ISLANDS = ["--keep-in-fp32-params", r"layer_norm_weight$,final_layernorm\.weight$"]
VOCAB = "50304"  # GPT-3's vocabulary, padded as Megatron-LM's examples pad it
OURS = [*te.ON, *te.PA, *te.OFFLOAD, "--offload-step", "chunked", *ISLANDS, "--log-throughput"]
DELAYED = ["--offload-delayed-update"]
BF16_MOMENTS = ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
CONFIGS = {
    "delayed": (*DELAYED,),
    "delayed_bf16": (*DELAYED, *BF16_MOMENTS),
    "exact": (),
}
TINY = "tiny"
TINY_SEQ = int(te.GPT[te.GPT.index("--seq-length") + 1])  # the base GPT's, which tiny keeps


def shape_flags(size: str, seq: int, micro_batches: int) -> list[str]:
    """The model and batch flags of ``size`` (a key of SIZES, or ``tiny``: the base GPT's
    own shape, only the batch changed)."""
    batch = ["--micro-batch-size", "1", "--global-batch-size", str(micro_batches)]
    if size == TINY:
        return batch
    layers, hidden, heads = SIZES[size]
    return [*("--num-layers", str(layers), "--hidden-size", str(hidden)),
            *("--num-attention-heads", str(heads), "--seq-length", str(seq)),
            *("--max-position-embeddings", str(seq), "--vocab-size", VOCAB), *batch]  # fmt: skip


def command(config: str, size: str, seq: int, micro_batches: int, iters: int,
            fusion: list[str]) -> list[str]:  # fmt: skip
    """The command line of one run; the size's flags come after the base GPT's, which
    Megatron-LM's parser then takes (the last of a repeated flag wins)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
            str(HERE / "megatron_lm_launcher.py"), "pretrain_gpt.py", *te.GPT, *fusion,
            *shape_flags(size, seq, micro_batches), "--train-iters", str(iters), *OURS,
            *CONFIGS[config]]  # fmt: skip


_TIMING = re.compile(
    r"elapsed time per iteration \(ms\): ([0-9.]+) \|"
    r"(?:.*?throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+) \|)?"
)


def parse_timing(text: str) -> dict[int, dict]:
    """Per iteration, Megatron-LM's elapsed milliseconds and TFLOP/s per GPU (None where it
    printed no throughput)."""
    out = {}
    for line in text.splitlines():
        it = te._ITERATION.search(line)
        m = _TIMING.search(line) if it else None
        if m:
            out[int(it.group(1))] = dict(
                ms=float(m.group(1)), tflops=float(m.group(2)) if m.group(2) else None
            )
    return out


@dataclass
class Row:
    config: str
    status: str
    iterations: int
    loss_first: float | None
    loss_last: float | None
    norm_vs_fp64: float | None
    ms: float | None  # median over the iterations after the skipped ones
    tokens_per_s: float | None
    tflops: float | None
    error: str | None


def row(run: te.Run, timing: dict[int, dict], tokens: int, skip: int) -> Row:
    its = run.iterations
    losses = [its[i]["loss"] for i in sorted(its) if its[i]["loss"] is not None]
    steady = [timing[i] for i in sorted(timing) if i > skip]
    ms = statistics.median(t["ms"] for t in steady) if steady else None
    tfl = [t["tflops"] for t in steady if t["tflops"] is not None]
    return Row(
        config=run.config,
        status=run.status,
        iterations=len(its),
        loss_first=losses[0] if losses else None,
        loss_last=losses[-1] if losses else None,
        norm_vs_fp64=max((te.rel(r["norm"], r["ref"]) for r in run.record), default=None),
        ms=ms,
        tokens_per_s=tokens / (ms / 1000) if ms else None,
        tflops=statistics.median(tfl) if tfl else None,
        error=run.error,
    )


def table(rows: list[Row], title: str) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    head = (f"{'configuration':14} {'status':15} {'its':>3} {'loss first':>10} {'last':>7} "
            f"{'vs fp64':>7} {'ms/it':>8} {'tokens/s':>9} {'TFLOP/s':>7}")  # fmt: skip
    lines = [title, head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.config:14} {r.status:15} {r.iterations:>3} {f(r.loss_first, '.4f'):>10} "
            f"{f(r.loss_last, '.4f'):>7} {f(r.norm_vs_fp64, '.1e'):>7} {f(r.ms, '.1f'):>8} "
            f"{f(r.tokens_per_s, ',.0f'):>9} {f(r.tflops, '.1f'):>7}"
        )
    lines += [f"{r.config}: {r.error}" for r in rows if r.error]
    return "\n".join(lines)


def write(runs: list[te.Run], timings: dict[str, dict], args, fusion: list[str]) -> str:
    """JSON and table of the runs so far into ``args.out``; returns the table."""
    args.out.mkdir(parents=True, exist_ok=True)
    seq = TINY_SEQ if args.size == TINY else args.seq
    tokens = seq * args.micro_batches
    rows = [row(r, timings.get(r.config, {}), tokens, args.skip) for r in runs]
    title = (f"pretrain_gpt.py at {args.size}, sequence {seq}, "
             f"{args.micro_batches} micro-batches of 1, offload 1.0, islands, ours "
             f"({te.versions()}); medians after iteration {args.skip}")  # fmt: skip
    text = table(rows, title)
    blob = dict(title=title, size=args.size, seq=seq, micro_batches=args.micro_batches,
                fusion_flags=fusion, rows=[asdict(r) for r in rows],
                runs=[asdict(r) | {"status": r.status, "timing": timings.get(r.config, {})}
                      for r in runs])  # fmt: skip
    (args.out / f"{NAME}.json").write_text(json.dumps(blob, indent=1, default=str))
    (args.out / f"{NAME}.txt").write_text(text + "\n")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for JSON and table")
    parser.add_argument(
        "--size",
        choices=[*SIZES, TINY],
        default="6.7b",
        help="GPT-3's shape (offload_scale.py's SIZES), or tiny (6.7b)",
    )
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated, from {list(CONFIGS)}, run in that order (all)",
    )
    parser.add_argument("--iters", type=int, default=20, help="iterations per run (20)")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length (2048)")
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=8,
        help="micro-batches of one sequence per iteration (8)",
    )
    parser.add_argument(
        "--skip",
        type=int,
        default=3,
        help="iterations left out of the medians (3: build and warm-up)",
    )
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds per run (540)")
    parser.add_argument("--dry-run", action="store_true", help="print the command lines only")
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        parser.error(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    for name in ("iters", "seq", "micro_batches", "timeout"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if not 0 <= args.skip < args.iters:
        parser.error(f"--skip must be in [0, --iters): {args.skip}")
    if not args.dry_run and not os.environ.get("MEGATRON_LM_PATH"):
        parser.error("set MEGATRON_LM_PATH to a folder with pretrain_gpt.py "
                     "(scripts/fetch_megatron_lm.sh)")  # fmt: skip
    fusion = te.fusion_flags()
    runs = [te.Run(c, "ours", command(c, args.size, args.seq, args.micro_batches, args.iters,
                                      fusion)) for c in configs]  # fmt: skip
    if args.dry_run:
        for run in runs:
            print(f"# {run.config}\n{shlex.join(run.command)}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)  # an unwritable folder: before any run
    timings: dict[str, dict] = {}
    text = ""
    for i, run in enumerate(runs, 1):
        print(f"[{i}/{len(runs)}] {run.config} at {args.size}: up to {args.timeout:.0f} s",
              flush=True)  # fmt: skip
        te.launch(run, args.out, args.timeout)
        log = args.out / f"{run.config}-ours" / "output.log"
        timings[run.config] = parse_timing(log.read_text()) if log.exists() else {}
        print(f"{run.config}: {run.status} {run.error or ''}", flush=True)
        text = write(runs, timings, args, fusion)
    print(text)
    return 1 if any(r.status != "ok" for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
