"""CPU offload, the host threads: how many the CPU update runs on, and a warning when that
is one of several usable cores."""

from __future__ import annotations

import contextlib
import os

import torch


@contextlib.contextmanager
def cpu_threads(n: int | None):
    """torch's intra-op threads set to ``n`` inside, restored after (None: unchanged)."""
    if n is None or n == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity), else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_warning(threads: int | None) -> str | None:
    """A line when the CPU update would run on one thread of several usable cores."""
    n = torch.get_num_threads() if threads is None else threads
    cores = usable_cores()
    if n > 1 or cores <= 1:
        return None
    return (
        f"the offloaded CPU optimizer step will use 1 thread of the {cores} cores this "
        "process may use (torchrun sets OMP_NUM_THREADS=1 unless told otherwise); pass "
        "megatron_ext.MegatronOptions(offload_threads=N), N about the cores per rank on "
        "this host, or set OMP_NUM_THREADS"
    )


def delayed_update_threads() -> int:
    """The host worker's threads for the delayed update: every usable core but one, which
    the Python thread launching the GPU's forward and backward keeps."""
    return max(1, usable_cores() - 1)
