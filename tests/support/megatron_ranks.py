"""megatron-core on spawned gloo ranks (test support): where a rank runs megatron-core (the
CPU shim of ``tests/support/cpu_megatron.py`` or GPU 0), and :func:`run_ranks`, which starts
a module-level function on every rank and returns each rank's result.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import uuid
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.support.spawn import spawn

# Where the spawned ranks run megatron-core: "cpu" (the default, and CI's) through the shim
# of tests/support/cpu_megatron.py; "cuda" (MEGATRON_TEST_DEVICE=cuda) on GPU 0, every rank
# on the one GPU over gloo, megatron-core's own CUDA code, with tests/support/multirank
# first on PYTHONPATH (collectives one by one). Jobs that take their device from the model
# (rank_device, to_model) run unchanged on either: test_megatron_cpu_reshard.py's.
DEVICE = os.environ.get("MEGATRON_TEST_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"MEGATRON_TEST_DEVICE={DEVICE!r}: use cpu (the default) or cuda")


def rank_device() -> torch.device:
    """The device a spawned rank builds its model on (:data:`DEVICE`; GPU 0 for cuda)."""
    return torch.device("cuda", 0) if DEVICE == "cuda" else torch.device("cpu")


def skip_unless_the_device_serves() -> None:
    """At a module's top, with MEGATRON_TEST_DEVICE=cuda: skip the module where there is no
    GPU, or where transformer-engine or Apex is installed (the files that call this expect
    megatron-core's torch-Adam fallback where they ask for the "torch" path)."""
    if DEVICE != "cuda":
        return
    if not torch.cuda.is_available():
        pytest.skip("MEGATRON_TEST_DEVICE=cuda: no CUDA device here", allow_module_level=True)
    import importlib.util

    taken = [m for m in ("transformer_engine", "apex") if importlib.util.find_spec(m)]
    if taken:
        pytest.skip(f"MEGATRON_TEST_DEVICE=cuda: run before {taken} is installed "
                    "(megatron-core would not take its torch-Adam path)",
                    allow_module_level=True)  # fmt: skip


def to_model(model, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` on the device of ``model``'s parameters (megatron-core's buffers)."""
    device = next(model.parameters()).device
    return tuple(t.to(device) for t in tensors)


def _rank_main(rank: int, world: int, init_file: str, out_dir: str, job, args) -> None:
    """One spawned rank: gloo (a 60 s timeout, so a hang fails), the shim, megatron-core's
    parallel state, then the job (a module-level function of a test module); its result or
    its traceback goes to a file."""
    import traceback

    warnings.simplefilter("ignore")  # megatron-core's import-time notes about TE and Apex
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    from megatron.core import parallel_state as ps

    try:
        with _rank_context() as log:
            ps.initialize_model_parallel()
            out = job(rank, world, log, out_dir, *args)
    except Exception:  # noqa: BLE001 - reported by the test, with the rank
        out = {"error": traceback.format_exc()[-3000:]}
    torch.save(out, os.path.join(out_dir, f"{job.__name__}-{world}-rank{rank}.pt"))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


class _NoLog:
    """The log the jobs get on CUDA, where nothing records megatron-core's calls."""

    def clear(self) -> None:
        pass

    def of(self, kind: str) -> list:
        raise RuntimeError(f"no {kind} log on CUDA: this job runs on the CPU shim only")


@contextlib.contextmanager
def _rank_context():
    """The shim on the CPU; on CUDA, GPU 0 and a check that megatron-core's collectives run
    one by one (tests/support/multirank's sitecustomize, which gloo needs on CUDA tensors)."""
    if DEVICE == "cpu":
        from tests.support.cpu_megatron import cpu_megatron

        with cpu_megatron() as log:
            yield log
        return
    if getattr(dist._coalescing_manager, "__name__", "") != "_one_by_one":
        raise RuntimeError(
            "MEGATRON_TEST_DEVICE=cuda needs tests/support/multirank first on PYTHONPATH "
            "(several ranks share the GPU over gloo, which cannot coalesce CUDA collectives)"
        )
    torch.cuda.set_device(0)
    yield _NoLog()


def run_ranks(tmp_path, world: int, job, *args) -> list:
    """``job`` (a module-level function) on ``world`` spawned gloo ranks; each rank's
    result, in rank order."""
    name = job.__name__
    # A fresh rendezvous file per call: a second spawn at the same size over a used one
    # meets the last spawn's addresses and never connects.
    init = str(tmp_path / f"init-{name}-{world}-{uuid.uuid4().hex}")
    spawn(_rank_main, args=(world, init, str(tmp_path), job, args), nprocs=world)
    outs = [
        torch.load(tmp_path / f"{name}-{world}-rank{r}.pt", weights_only=False, map_location="cpu")
        for r in range(world)
    ]
    for r, out in enumerate(outs):
        assert not (isinstance(out, dict) and "error" in out), f"rank {r}:\n{out['error']}"
    return outs


def _no_psutil():
    """megatron-core's torch_dist writer logs its process's memory through psutil, which
    the CPU test environment does not install; the number is only logged."""
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fs

    if not fs.HAVE_PSUTIL:
        fs._process_memory = lambda: 0
