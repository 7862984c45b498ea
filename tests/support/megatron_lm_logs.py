"""Megatron-LM runs rehearsed on the CPU, for the tests of tests/gpu's drivers of
pretrain_gpt.py (megatron_lm_te.py, megatron_lm_scale.py): command lines parsed by Megatron-LM's
own parser, console lines in its own format, and a stand-in run that prints them and writes
the launcher's record."""

import json
import math
import sys
import warnings
from pathlib import Path


def pretrain_flags(cmd: list[str]) -> list[str]:
    return cmd[cmd.index("pretrain_gpt.py") + 1 :]


def parse(flags: list[str]):
    """Megatron-LM's parse_and_validate_args over ``flags`` with megatron_ext.train
    installed, as pretrain_gpt.py's __main__ does; then everything is restored."""
    from megatron.training import global_vars

    from megatron_ext import train

    patches = train.install()
    try:
        from megatron.training.arguments import parse_and_validate_args

        sys.argv = ["pretrain_gpt.py", *flags]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    finally:
        patches.remove()
        global_vars.unset_global_variables()


def log_line(it, total, loss, grad_norm, zeros=0, skipped=0, nan=0, moe=False, ms=123.4,
             tflops=None):  # fmt: skip
    """One console line exactly as Megatron-LM's training_log formats it (``tflops``: with
    ``--log-throughput``)."""
    s = " [2026-12-04 10:00:00.000000]"
    s += f" iteration {it:8d}/{total:8d} |"
    s += f" consumed samples: {2 * it:12d} |"
    s += f" elapsed time per iteration (ms): {ms:.1f} |"
    if tflops is not None:
        s += f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
    s += f" learning rate: {3e-4:.6E} |"
    s += f" global batch size: {2:5d} |"
    if loss is not None:  # Megatron-LM prints a loss only when it is >= 0
        s += " {}: {:.6E} |".format("lm loss", loss)
    if moe:
        s += " load_balancing_loss: 1.000244E+00 |"
    s += f" loss scale: {1.0:.1f} |"
    s += f" grad norm: {grad_norm:.3f} |"
    s += f" num zeros: {zeros} |"
    s += f" number of skipped iterations: {skipped:3d} |"
    s += f" number of nan iterations: {nan:3d} |"
    return s


def stand_in(tmp_path: Path, iters: int, rc: int, norms: list[float], losses: list, text="",
             timing=None):  # fmt: skip
    """A Run whose command prints Megatron-LM's log lines, writes the launcher's record
    (norm and fp64 reference per step) and exits with ``rc``. ``timing``: per iteration
    (milliseconds, TFLOP/s) for the lines' elapsed time and throughput."""
    timing = timing or [(123.4, None)] * len(norms)
    lines = [
        log_line(i + 1, iters, loss, n, ms=ms, tflops=tf)
        for i, (loss, n, (ms, tf)) in enumerate(zip(losses, norms, timing, strict=True))
    ]
    rows = [json.dumps(dict(ok=True, norm=n, ref=abs(n) if math.isfinite(n) else 1.0, zeros=0))
            for n in norms]  # fmt: skip
    record = "".join(row + "\n" for row in rows)
    script = tmp_path / f"stand_in_{len(list(tmp_path.glob('stand_in_*')))}.py"
    script.write_text(
        "import os, pathlib, sys\n"
        "rec = pathlib.Path(os.environ['MEGATRON_LM_RECORD'])\n"
        "rec.mkdir(parents=True, exist_ok=True)\n"
        f"(rec / 'rank0.jsonl').write_text({record!r})\n"
        f"print({chr(10).join(lines)!r})\n"
        f"sys.stderr.write({text!r})\n"
        f"sys.exit({rc})\n"
    )
    return [sys.executable, str(script)]


# how a stock run that cannot build the offloaded optimizer ends
STOCK_OFFLOAD_FAILURE = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "pretrain_gpt.py", line 300, in <module>
[rank0]:   File "megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py", line 80, in __init__
[rank0]: ValueError: can't optimize a non-leaf Tensor
E1204 10:00:00 torch/distributed/elastic/multiprocessing/api.py: failed (exitcode: 1)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""
