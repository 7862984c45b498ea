"""``benchmarks/offload_overlap.py``'s GPT and stacks on the CPU shim (test support), inside
a rank (``tests/test_offload_overlap_gpt_cpu.py``'s spawned ranks and
``tests/support/scale_rows_cpu.py``'s process): megatron-core's offload placement replayed
as if the parameters were on a device, no CUDA RNG, host generators.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.support.mlp_stack import adam_path


def _host_generator(device=None) -> torch.Generator:
    """``torch.Generator(device="cuda")`` as the benchmark asks for it, on the CPU."""
    return torch._C.Generator()


@contextlib.contextmanager
def _gpt_on_the_cpu():
    """The benchmark's GPT and stacks on the CPU shim, inside a spawned rank: megatron-core's
    offload placement replayed, no CUDA RNG, host generators, no precision-aware optimizer
    (it needs transformer-engine). Yields the MonkeyPatch for more."""
    from megatron.core.tensor_parallel import random as mp_random

    from benchmarks import offload_overlap

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
        yield patch
