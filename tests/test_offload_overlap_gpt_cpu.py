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

import contextlib

import pytest
import torch

from tests.test_megatron_cpu import run_ranks
from tests.test_megatron_cpu_reshard import adam_path

pytest.importorskip("megatron.core")

WARMUP = 3
ARGV = [
    "--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "128", "--seq", "16",
    "--batch", "2", "--loss-steps", "8", "--delay-warmup", str(WARMUP),
    "--markov-states", "32", "--loss-batches", "4",
]  # fmt: skip


def _host_generator(device=None) -> torch.Generator:
    """``torch.Generator(device="cuda")`` as the benchmark asks for it, on the CPU."""
    return torch._C.Generator()


def loss_curves_job(rank, world, log, out_dir, task):
    from megatron.core.tensor_parallel import random as mp_random

    from benchmarks import offload_overlap

    args = offload_overlap.parse_args(["--out", out_dir, *ARGV])
    with pytest.MonkeyPatch.context() as patch, adam_path("torch+offload"):
        # megatron-core's CUDA RNG: no device generator here, and nothing reads it
        patch.setattr(mp_random, "model_parallel_cuda_manual_seed", lambda *a, **k: None)
        patch.setattr(
            type(mp_random.get_cuda_rng_tracker()),
            "fork",
            lambda self, *a, **k: contextlib.nullcontext(),
        )
        patch.setattr(torch, "Generator", _host_generator)
        patch.setattr(offload_overlap, "PA", dict(use_precision_aware_optimizer=False))
        return offload_overlap.loss_curves(args, task)


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
