"""Megatron-LM's pretrain_gpt.py through ``megatron_ext.train``, at 1 and 2 ranks on one GPU.

Each run is ``torchrun ... megatron_lm_launcher.py pretrain_gpt.py --mock-data ...`` (a tiny
GPT, bf16, ``--transformer-impl local``); the launcher records, per step and rank, the norm
Megatron-LM logs next to an fp64 norm of megatron-core's reduced gradient buffers. Two
ranks share the GPU through gloo with ``tests/support/multirank`` first on ``PYTHONPATH``.
Needs ``MEGATRON_LM_PATH`` (``scripts/fetch_megatron_lm.sh``: pretrain_gpt.py and its
two sibling modules from Megatron-LM ``core_v0.19.0``).
"""

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from megatron_lm_gpt import flags, gpt

MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH", "")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        not (MEGATRON_LM and (Path(MEGATRON_LM) / "pretrain_gpt.py").is_file()),
        reason="MEGATRON_LM_PATH does not hold pretrain_gpt.py (scripts/fetch_megatron_lm.sh)",
    ),
]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MULTIRANK = HERE.parent / "support" / "multirank"


GPT = [*gpt("local"), "--no-gradient-accumulation-fusion", "--no-persist-layer-norm"]
# fp32 islands: MoE router weights kept in fp32 (the router's gating accepts a bf16 input with
# an fp32 weight; a torch LayerNorm on CUDA would not), with CPU offload of the optimizer.
ISLANDS = flags(
    r"--num-experts 4 --moe-router-topk 2 --moe-router-dtype fp32 "
    r"--keep-in-fp32-params router\.weight$ --disable-bias-linear"
)  # no biases: megatron-core 0.19.2's local experts add theirs in place on an autograd view
# ("Output 0 of _ReduceFromModelParallelRegionBackward is a view and is being modified
# inplace", mlp.py, with the option on or off; seen on the H200, run 33)
OFFLOAD = flags(
    "--use-precision-aware-optimizer --optimizer-cpu-offload --optimizer-offload-fraction 1.0"
)
STOCK_OFFLOAD_ERROR = "can't optimize a non-leaf Tensor"
ON = ["--per-dtype-grad-buffers"]


@dataclass
class Run:
    rc: int
    output: str
    steps: dict[int, list[dict]]  # rank -> one record per optimizer step
    losses: dict[int, float]  # iteration -> lm loss, as Megatron-LM logged it

    def check(self) -> None:
        assert self.rc == 0, self.output[-6000:]
        assert self.steps and all(self.steps.values()), "no step recorded"


def launch(tmp: Path, ranks: int, iters: int, *flags: str, batch: int | None = None) -> Run:
    """``batch``: the global batch size (default two samples per rank: one micro-batch of 2
    each)."""
    tmp.mkdir(parents=True, exist_ok=True)
    record = tmp / "record"
    env = dict(os.environ)
    paths = [str(ROOT), env.get("PYTHONPATH", "")]
    if ranks > 1:
        paths.insert(0, str(MULTIRANK))
    env.update(PYTHONPATH=os.pathsep.join(paths), MEGATRON_LM_RECORD=str(record),
               PYTHONUNBUFFERED="1", CUDA_DEVICE_MAX_CONNECTIONS="1")  # fmt: skip
    extra = ["--distributed-backend", "gloo"] if ranks > 1 else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={ranks}", str(HERE / "megatron_lm_launcher.py"), "pretrain_gpt.py",
           *GPT, "--global-batch-size", str(batch or 2 * ranks), "--train-iters", str(iters),
           *extra, *flags]  # fmt: skip
    proc = subprocess.run(
        cmd, env=env, cwd=tmp, capture_output=True, text=True,
        timeout=int(os.environ.get("MEGATRON_LM_TIMEOUT", "300")),
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    steps = {
        int(p.stem[4:]): [json.loads(line) for line in p.read_text().splitlines()]
        for p in sorted(record.glob("rank*.jsonl"))
    }
    losses = {
        int(m.group(1)): float(m.group(2))
        for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", output)
    }
    return Run(proc.returncode, output, steps, losses)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def assert_norms_match_fp64(run: Run, tol: float) -> float:
    worst = 0.0
    for rank, rows in run.steps.items():
        for i, row in enumerate(rows):
            assert row["norm"] is not None, (rank, i)
            worst = max(worst, rel(row["norm"], row["ref"]))
    assert worst <= tol, f"grad norm vs fp64 reference: worst relative error {worst:.3e}"
    return worst


@pytest.mark.parametrize("ranks", [1, 2])
def test_flag_on_and_off_give_the_same_curve(ranks, tmp_path):
    """No fp32 islands: 50 steps with the flag off (stock) and on."""
    off = launch(tmp_path / "off", ranks, 50)
    on = launch(tmp_path / "on", ranks, 50, *ON)
    off.check()
    on.check()
    assert "megatron_ext.train: --per-dtype-grad-buffers" in on.output
    assert "megatron_ext.train: --per-dtype-grad-buffers" not in off.output
    assert len(on.losses) == len(off.losses) == 50
    ours = assert_norms_match_fp64(on, 1e-5)
    # stock without TE takes per-tensor bf16 norms: about 1e-3 off (DESIGN.md, measured)
    stock = assert_norms_match_fp64(off, 1e-2)
    first_on, first_off = on.steps[0][0], off.steps[0][0]
    assert rel(first_on["ref"], first_off["ref"]) <= 1e-6  # same gradients at step 1
    assert on.losses[1] == off.losses[1]
    assert first_on["zeros"] == first_off["zeros"]
    drift = max(rel(on.losses[i], off.losses[i]) for i in off.losses)
    print(f"ranks={ranks}: ours vs fp64 {ours:.2e}, stock vs fp64 {stock:.2e}, "
          f"loss curve max relative difference {drift:.2e}")  # fmt: skip
    assert drift <= 1e-2


@pytest.mark.parametrize("ranks", [1, 2])
def test_fp32_islands_with_cpu_offload_train_where_stock_fails(ranks, tmp_path):
    off = launch(tmp_path / "off", ranks, 30, *ISLANDS, *OFFLOAD)
    assert off.rc != 0 and STOCK_OFFLOAD_ERROR in off.output, off.output[-4000:]
    stock_error = next(ln for ln in off.output.splitlines() if STOCK_OFFLOAD_ERROR in ln)
    print(f"stock megatron-core at {ranks} rank(s): {stock_error.strip()}")
    on = launch(tmp_path / "on", ranks, 30, *ON, *ISLANDS, *OFFLOAD)
    on.check()
    assert "keeping 2 parameters in fp32" in on.output  # one router per layer
    worst = assert_norms_match_fp64(on, 1e-5)
    losses = [on.losses[i] for i in sorted(on.losses)]
    assert sum(losses[-5:]) < sum(losses[:5]), losses
    print(f"ranks={ranks}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, norm vs fp64 {worst:.2e}")


@pytest.mark.parametrize("ranks", [1, 2])
def test_overlapped_grad_reduce_and_param_gather(ranks, tmp_path):
    run = launch(tmp_path, ranks, 20, *ON, *ISLANDS, "--overlap-grad-reduce",
                 "--overlap-param-gather")  # fmt: skip
    run.check()
    assert_norms_match_fp64(run, 1e-5)


def side_by_side(whole: Run, resumed: Run, rank: int) -> str:
    """Every step after the resume next to the uninterrupted run's, so a failure shows where
    the runs part (loss i is the forward before update i; norm i is update i's norm)."""
    return "\n".join(
        f"{i}: loss {whole.losses[i]:.6f} / {resumed.losses[i]:.6f}, norm {b['norm']:.6e} / "
        f"{a['norm']:.6e}, zeros {b['zeros']} / {a['zeros']}"
        for i, a, b in zip(range(21, 31), resumed.steps[rank], whole.steps[rank][20:],
                           strict=True)
    )  # fmt: skip


def logged_after_resume(whole: Run) -> dict[int, float]:
    """The losses a run resumed at iteration 20 logs if it continues exactly as ``whole``.
    Megatron-LM logs the first iteration of every run without resetting its loss accumulator
    (training.py: should_reset = not is_first_iteration), so the next line shows the mean of
    both iterations: iteration 2 in both fresh runs, and iteration 22 after the resume (seen
    in run 41: 6.084007 = (5.984010 + 6.184003) / 2)."""
    logged = {i: whole.losses[i] for i in range(21, 31)}
    logged[22] = (whole.losses[21] + whole.losses[22]) / 2
    return logged


def test_save_at_20_and_resume_reproduce_steps_21_to_30(tmp_path):
    flags = [*ON, *ISLANDS, *OFFLOAD]
    ckpt = str(tmp_path / "ckpt")
    whole = launch(tmp_path / "whole", 1, 30, *flags)
    first = launch(tmp_path / "first", 1, 30, *flags, "--save", ckpt, "--save-interval", "20",
                   "--exit-interval", "20")  # fmt: skip
    resumed = launch(tmp_path / "resumed", 1, 30, *flags, "--load", ckpt)
    for run in (whole, first, resumed):
        run.check()
    assert sorted(first.losses) == list(range(1, 21))
    assert sorted(resumed.losses) == list(range(21, 31))
    for i in range(1, 21):
        assert first.losses[i] == whole.losses[i], i
    table = side_by_side(whole, resumed, 0)
    print(f"iteration: uninterrupted / resumed\n{table}")
    logged = logged_after_resume(whole)
    for i in range(21, 31):
        assert rel(resumed.losses[i], logged[i]) <= 1e-6, table
    for a, b in zip(resumed.steps[0], whole.steps[0][20:], strict=True):
        assert rel(a["norm"], b["norm"]) <= 1e-6 and a["zeros"] == b["zeros"], table


# Resuming at one rank what two ranks saved: the global batch (4 samples) stays, as two
# micro-batches on one rank instead of one on each of two. Iteration 21's forward uses the
# loaded parameters on the same samples, so its loss is the uninterrupted run's to 1e-6;
# its gradient is summed in another order (micro-batches in one bf16 buffer instead of a
# reduce-scatter across ranks), so the norms are compared within 1e-3 at 21 and, as the two
# runs' parameters part by bf16 rounding, within 1e-2 after it (the flag-on/flag-off curves
# of 50 steps stay within 1e-2 of each other, test_flag_on_and_off_give_the_same_curve).
RESHARD_NORM_TOL = (1e-3, 1e-2)
RESHARD_LOSS_TOL = 2e-3


def test_two_rank_checkpoint_resumes_at_two_and_at_one_rank(tmp_path):
    """Issue 36, item 2: fp32 islands, precision-aware, CPU offload; saved at iteration 20 by
    two ranks in megatron-core's fully reshardable optimizer format, loaded at two ranks
    (bit for bit with the uninterrupted run) and at one (within the tolerances above)."""
    flags = [*ON, *ISLANDS, *OFFLOAD]
    ckpt = str(tmp_path / "ckpt")
    whole = launch(tmp_path / "whole", 2, 30, *flags)
    first = launch(tmp_path / "first", 2, 30, *flags, "--save", ckpt, "--save-interval", "20",
                   "--exit-interval", "20", "--dist-ckpt-optim-fully-reshardable")  # fmt: skip
    at_two = launch(tmp_path / "at_two", 2, 30, *flags, "--load", ckpt)
    at_one = launch(tmp_path / "at_one", 1, 30, *flags, "--load", ckpt, batch=4)
    for run in (whole, first, at_two, at_one):
        run.check()
    assert sorted(first.losses) == list(range(1, 21))
    assert sorted(at_two.losses) == sorted(at_one.losses) == list(range(21, 31))
    for i in range(1, 21):
        assert first.losses[i] == whole.losses[i], i
    logged = logged_after_resume(whole)
    tables = {r: side_by_side(whole, at_two, r) for r in (0, 1)}
    tables["one rank"] = side_by_side(whole, at_one, 0)
    for name, table in tables.items():
        print(f"resumed at {'two ranks, rank ' if name != 'one rank' else ''}{name}; "
              f"iteration: uninterrupted / resumed\n{table}")  # fmt: skip
    for rank in (0, 1):
        for a, b in zip(at_two.steps[rank], whole.steps[rank][20:], strict=True):
            assert rel(a["norm"], b["norm"]) <= 1e-6, tables[rank]
            assert a["zeros"] == b["zeros"], tables[rank]
    for i in range(21, 31):
        assert rel(at_two.losses[i], logged[i]) <= 1e-6, tables[0]
    table = tables["one rank"]
    assert rel(at_one.losses[21], whole.losses[21]) <= 1e-6, table
    assert at_one.steps[0][0]["zeros"] == whole.steps[0][20]["zeros"], table
    worst = 0.0
    for k, (a, b) in enumerate(zip(at_one.steps[0], whole.steps[0][20:], strict=True)):
        d = rel(a["norm"], b["norm"])
        worst = max(worst, d)
        assert d <= RESHARD_NORM_TOL[k > 0], table
    for i in range(22, 31):
        assert rel(at_one.losses[i], logged[i]) <= RESHARD_LOSS_TOL, table
    assert_norms_match_fp64(at_one, 1e-5)
    print(f"resumed at one rank: norms within {worst:.2e} of the two-rank run")


@pytest.mark.parametrize("ranks", [2])
def test_per_layer_grad_norms_are_logged_every_interval(ranks, tmp_path):
    """--log-per-layer-grad-norm with --log-interval 5 over 10 steps: a console line at
    iterations 5 and 10, each layer's value within 1e-5 of an fp64 norm of the same
    buffers, and the layers' root sum of squares equal to the step's grad norm."""
    run = launch(tmp_path, ranks, 10, *ON, *ISLANDS, "--log-per-layer-grad-norm",
                 "--log-interval", "5")  # fmt: skip
    run.check()
    lines = re.findall(r" per-layer grad norm \| iteration\s+(\d+) \| (.*)", run.output)
    assert [int(i) for i, _ in lines] == [5, 10], lines
    worst = 0.0
    for iteration, cells in lines:
        logged = {k: float(v) for k, v in (c.split(": ") for c in cells.split(" | "))}
        for rank, rows in run.steps.items():
            row = rows[int(iteration) - 1]
            ref = row["per_layer_ref"]
            assert ref is not None and set(ref) == set(logged), (rank, ref, logged)
            for k, v in logged.items():
                worst = max(worst, rel(v, ref[k]))
            root = sum(v * v for v in logged.values()) ** 0.5
            assert rel(root, row["norm"]) <= 1e-5, (root, row["norm"])
        assert any(k.startswith("decoder.layers.1") for k in logged), logged
    assert all(r["per_layer_ref"] is None for r in run.steps[0] if r is not run.steps[0][4]
               and r is not run.steps[0][9])  # fmt: skip
    assert worst <= 1e-5, worst
    print(f"ranks={ranks}: per-layer norms vs fp64 {worst:.2e}; logged: {lines[-1][1][:300]}")


DELAY_WARMUP = 5


@pytest.mark.parametrize("ranks", [1, 2])
def test_delayed_offload_update_trains_and_departs_from_exact_after_its_warmup(ranks, tmp_path):
    """``--offload-delayed-update --offload-delay-warmup 5`` with fp32 islands, the
    precision-aware optimizer and CPU offload at fraction 1.0, 30 iterations, beside the same
    run exact: the first six logged losses are the exact run's (five exact updates, and
    iteration 6's forward still reads what they left); iteration 7's differs (its forward
    reads the parameters one update late); every step's norm is that step's own (within
    1e-5 of an fp64 norm of the same buffers); it trains; and the run ends cleanly
    (``megatron_ext.train`` lands the last update before it exits)."""
    flags = [*ON, *ISLANDS, *OFFLOAD]
    exact = launch(tmp_path / "exact", ranks, 30, *flags)
    delayed = launch(tmp_path / "delayed", ranks, 30, *flags, "--offload-delayed-update",
                     "--offload-delay-warmup", str(DELAY_WARMUP))  # fmt: skip
    for run in (exact, delayed):
        run.check()
    assert sorted(delayed.losses) == sorted(exact.losses) == list(range(1, 31))
    for i in range(1, DELAY_WARMUP + 2):
        assert delayed.losses[i] == exact.losses[i], i
    assert delayed.losses[DELAY_WARMUP + 2] != exact.losses[DELAY_WARMUP + 2]
    worst = assert_norms_match_fp64(delayed, 1e-5)
    losses = [delayed.losses[i] for i in range(1, 31)]
    assert sum(losses[-5:]) < sum(losses[:5]), losses
    gap = max(rel(delayed.losses[i], exact.losses[i]) for i in range(1, 31))
    print(f"ranks={ranks}: delayed loss {losses[0]:.4f} -> {losses[-1]:.4f} (exact "
          f"{exact.losses[30]:.4f}), largest gap to exact {gap:.2e}, "
          f"norm vs fp64 {worst:.2e}")  # fmt: skip


@pytest.mark.parametrize("ranks", [1, 2])
def test_overlapped_offload_step_gives_the_exact_runs_losses_and_norms(ranks, tmp_path):
    """``--offload-overlap-forward`` with fp32 islands, the precision-aware optimizer and CPU
    offload at fraction 1.0, 20 iterations, beside the same run exact: every logged loss and
    every step's norm are the exact run's (the same bits: the forward waits for the chunks
    it reads), and the run ends cleanly (``megatron_ext.train`` lands the last update)."""
    flags = [*ON, *ISLANDS, *OFFLOAD]
    exact = launch(tmp_path / "exact", ranks, 20, *flags)
    overlapped = launch(tmp_path / "overlapped", ranks, 20, *flags, "--offload-overlap-forward")
    for run in (exact, overlapped):
        run.check()
    assert "--offload-overlap-forward" in overlapped.output
    assert sorted(overlapped.losses) == sorted(exact.losses) == list(range(1, 21))
    assert overlapped.losses == exact.losses
    for rank, rows in exact.steps.items():
        assert [r["norm"] for r in overlapped.steps[rank]] == [r["norm"] for r in rows], rank
    worst = assert_norms_match_fp64(overlapped, 1e-5)
    print(f"ranks={ranks}: overlapped = exact over 20 iterations, norm vs fp64 {worst:.2e}")
