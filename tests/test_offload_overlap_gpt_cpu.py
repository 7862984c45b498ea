"""``benchmarks/offload_overlap.py``'s loss curves (``loss_curves``) on the CPU, with a tiny
megatron-core ``GPTModel`` (``benchmarks/train_step.py``'s, fp32 islands on every layer)
through megatron-core's real DDP and distributed optimizer (``tests/support/cpu_megatron.py``;
megatron-core's offload placement replayed as if the parameters were on a device), for both
loss tasks (``markov``, ``memorize``), non-precision-aware (the precision-aware optimizer
needs transformer-engine).

The references: the GPU-resident optimizer (the same stack, nothing offloaded) and, for the
delay, the benchmark's ``Lagged``, which shares no code with the delayed offloaded update:

- ``exact``, ours offloaded to the host with the exact chunked step, equals
  ``resident_exact`` loss by loss, bit for bit;
- ``delayed``, ours with the host update one step late (``offload_delayed_update``), equals
  ``resident_delayed`` loss by loss, bit for bit: the GPU-resident optimizer with forward and
  backward reading the parameters one step late (``Lagged``, the same warm-up);
- ``delayed`` equals ``exact`` through the warm-up and the step after it (its loss is still
  computed at values exact steps left), and differs from it at every step from the next
  on: the test sees the delay.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.gpt_on_the_cpu import _gpt_on_the_cpu
from tests.support.megatron_ranks import run_ranks

pytestmark = pytest.mark.mcore

pytest.importorskip("megatron.core")

WARMUP = 3
ARGV = [
    "--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "128", "--seq", "16",
    "--batch", "2", "--loss-steps", "8", "--delay-warmup", str(WARMUP),
    "--markov-states", "32", "--loss-batches", "4",
]  # fmt: skip


def loss_curves_job(rank, world, log, out_dir, task, extra=()):
    from benchmarks import offload_overlap

    args = offload_overlap.parse_args(["--out", out_dir, *ARGV, *extra])
    seen: list[list[str]] = []  # the curves each progress call held
    with _gpt_on_the_cpu():
        out = offload_overlap.loss_curves(args, task, lambda s: seen.append(list(s["losses"])))
    return out | {"progress": seen}


@pytest.mark.parametrize("task", ["markov", "memorize"])
def test_ours_exact_and_delayed_equal_the_resident_optimizer_exact_and_one_step_late(
    tmp_path, task
):
    (out,) = run_ranks(tmp_path, 1, loss_curves_job, task)
    curves = out["losses"]
    steps = int(ARGV[ARGV.index("--loss-steps") + 1])
    assert {k: len(v) for k, v in curves.items()} == dict.fromkeys(
        ("exact", "delayed", "resident_exact", "resident_delayed"), steps
    )
    assert curves["exact"] == curves["resident_exact"]
    assert curves["delayed"] == curves["resident_delayed"]
    # the first WARMUP steps are exact, and the step after them still computes its loss at
    # the values exact steps left; the next reads values one step old
    first_late = WARMUP + 1
    assert curves["delayed"][:first_late] == curves["exact"][:first_late]
    late = zip(curves["delayed"][first_late:], curves["exact"][first_late:], strict=True)
    assert all(d != e for d, e in late)


SCHEDULE = ["--lr", "1e-3", "--lr-warmup-steps", "2", "--lr-decay-style", "cosine"]


def _cosine_lrs(steps: int, warmup: int, top: float, bottom: float) -> list[float]:
    """The lr of each step, written from Megatron-LM's schedule: linear from 0 over
    ``warmup`` steps, then a half cosine from ``top`` down to ``bottom`` at the last step."""
    out = []
    for n in range(steps):
        if n <= warmup:
            out.append(top * n / warmup)
        else:
            ratio = (n - warmup) / (steps - warmup)
            out.append(bottom + (top - bottom) * 0.5 * (1 + math.cos(math.pi * ratio)))
    return out


def test_a_scheduled_lr_reaches_every_curve_and_keeps_ours_equal_to_the_references(tmp_path):
    """With a warm-up and a cosine decay, every curve steps at the scheduled lr, and ours
    still equals the references bit for bit (the delayed update reads each step's lr when
    it starts, as the exact one does); the lr changes the losses (the schedule acts). Also:
    ``--loss-curves`` trains only the curves named, in the order of ``CURVES``."""
    (out,) = run_ranks(tmp_path, 1, loss_curves_job, "markov", SCHEDULE)
    steps = int(ARGV[ARGV.index("--loss-steps") + 1])
    want = _cosine_lrs(steps, 2, 1e-3, 1e-4)
    assert set(out["lr"]) == set(out["losses"]) == {
        "exact", "delayed", "resident_exact", "resident_delayed"
    }  # fmt: skip
    for name, lrs in out["lr"].items():
        assert lrs == pytest.approx(want, rel=1e-12, abs=0), name
    curves = out["losses"]
    assert curves["exact"] == curves["resident_exact"]
    assert curves["delayed"] == curves["resident_delayed"]
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    (plain,) = run_ranks(
        plain_dir,
        1,
        loss_curves_job,
        "markov",
        ["--lr", "1e-3", "--loss-curves", "delayed", "exact"],
    )
    assert list(plain["losses"]) == ["exact", "delayed"]
    assert plain["progress"] == [["exact"], ["exact", "delayed"]]  # after each curve
    assert plain["last_relative"] is not None and plain["resident_relative"] is None
    assert plain["lr"]["exact"] == [1e-3] * steps
    assert plain["losses"]["exact"][0] == curves["exact"][0]  # the same start and batch
    assert all(
        a != b for a, b in zip(plain["losses"]["exact"][1:], curves["exact"][1:], strict=True)
    )


class _TimingEvent:
    """``torch.cuda.Event(enable_timing=True)`` on the CPU: host time at ``record``."""

    def __init__(self, *args, **kwargs):
        self.at = None

    def record(self, stream=None):
        import time

        self.at = time.perf_counter()

    def elapsed_time(self, end) -> float:
        return 1e3 * (end.at - self.at)


def measure_job(rank, world, log, out_dir):
    from benchmarks import offload_overlap

    args = offload_overlap.parse_args(["--out", out_dir, *ARGV, "--steps", "3", "--warmup", "3"])
    real_event = torch.cuda.Event
    with _gpt_on_the_cpu() as patch:
        patch.setattr(
            torch.cuda,
            "Event",
            lambda *a, **k: _TimingEvent() if k.get("enable_timing") else real_event(*a, **k),
        )
        for name in ("reset_peak_memory_stats", "empty_cache"):
            patch.setattr(torch.cuda, name, lambda *a, **k: None)
        for name in ("max_memory_allocated", "memory_allocated"):
            patch.setattr(torch.cuda, name, lambda *a, **k: 0)
        rows = {}
        for label, overrides, options in offload_overlap.configs([1.0], [1]):
            if options is None:  # stock's offload: megatron-core's own CUDA copies
                continue
            if options.get("offload_overlap_forward"):  # needs it; offloaded, no TE needed
                overrides = overrides | dict(use_precision_aware_optimizer=True)
            rows[label] = offload_overlap.measure(args, label, overrides, options, 2)
        return rows


def test_measure_reports_where_a_delayed_step_spends_its_time(tmp_path):
    """``measure`` on the CPU, two micro-batches per step: every configuration ran; the
    delayed ones report their worker's time, the landing's wait and the worker's threads
    (the adapted default, and the one given), the others none of these."""
    from megatron_ext.offload.threads import ThreadTuner

    (rows,) = run_ranks(tmp_path, 1, measure_job)
    assert set(rows) == {
        "gpu_resident", "exact_offload_1.0", "overlapped_offload_1.0", "delayed_offload_1.0",
        "delayed_offload_1.0_threads_1", "delayed_offload_1.0_pinned",
    }  # fmt: skip
    for label, row in rows.items():
        assert "error" not in row, (label, row)
        assert row["step_ms"] > 0 and row["fwd_bwd_ms"] > 0 and row["micro_batches"] == 2
        worker = label.startswith(("delayed", "overlapped"))
        assert ("worker_ms" in row) is worker and ("worker_threads" in row) is worker
        assert ("d2h_wait_ms" in row) is worker
        if worker:
            assert row["worker_ms"] > 0 and row["land_wait_ms"] >= 0
            assert 0 <= row["d2h_wait_ms"] <= row["worker_ms"]
    tuner = ThreadTuner.for_host()
    assert tuner.low <= rows["delayed_offload_1.0"]["worker_threads"] <= tuner.high
    assert rows["delayed_offload_1.0_threads_1"]["worker_threads"] == 1
