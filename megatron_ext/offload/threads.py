"""CPU offload, the host threads: how many the CPU update runs on, and a warning when that
is one of several usable cores."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

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


def _sharing_ranks(cores: int) -> int:
    """How many ranks share this process's ``cores`` usable CPUs: ``LOCAL_WORLD_SIZE``
    (which ``torchrun`` sets), unless the launcher already gave each rank cores of its own
    (an affinity narrower than every CPU), or it is not a number: then 1."""
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1
    return ranks if cores >= (os.cpu_count() or cores) else 1


def cores_per_rank() -> int:
    """The cores this rank's host update may use: :func:`usable_cores`, shared with the other
    ranks on this host (:func:`_sharing_ranks`)."""
    cores = usable_cores()
    return max(1, cores // _sharing_ranks(cores))


def rank_cores() -> list[int]:
    """The CPUs this rank's host update may use, in order: its affinity, or, where that is
    every CPU and ``torchrun`` started ``LOCAL_WORLD_SIZE`` ranks on this host, the
    ``LOCAL_RANK``-th of as many equal runs of them (what :func:`cores_per_rank` counts;
    with more ranks than CPUs, one each in turn)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))
    ranks = _sharing_ranks(len(cpus))
    if ranks == 1:
        return cpus
    try:
        rank = int(os.environ.get("LOCAL_RANK", "0")) % ranks
    except ValueError:  # the first run: as many CPUs as cores_per_rank counts
        rank = 0
    each = max(1, len(cpus) // ranks)
    start = rank * each % len(cpus)  # more ranks than CPUs: one each, in turn
    return cpus[start : start + each]


def worker_cpus() -> frozenset[int] | None:
    """Where the delayed update's worker and its helpers are pinned
    (``MegatronOptions(offload_pin_threads=True)``): every CPU of :func:`rank_cores` but
    the first, which is left to the Python thread that launches the GPU's work (nothing of
    ours runs on it; that thread is not pinned). None where there is no second CPU to
    leave it, or the platform cannot pin a thread (``os.sched_setaffinity``: Linux)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = rank_cores()
    return frozenset(cpus[1:]) if len(cpus) > 1 else None


def pin_current_thread(cpus: frozenset[int]) -> None:
    """The calling thread (only it: Linux applies an affinity per thread) on ``cpus``; the
    host kernel's pool threads follow the thread that calls it (``host_adamw.c``)."""
    os.sched_setaffinity(0, cpus)


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
    """The host worker's threads for the delayed update: every core of this rank's
    (:func:`cores_per_rank`) but one, which the Python thread launching the GPU's forward and
    backward keeps."""
    return max(1, cores_per_rank() - 1)


@dataclass
class ThreadTuner:
    """The delayed update's worker threads, adapted each time an update lands: the fewest
    with which the host update still ends before the next step needs it.

    A worker on more threads ends sooner but slows the forward and backward beside it (the
    launching thread and the copies compete with it for cores and memory bandwidth:
    measured in ``benchmarks/offload_overlap.py``); one on fewer makes the next step wait.
    So: when landing had to wait for the worker, more threads (a quarter more, up to
    ``high``); when the worker ended well inside the time it had (under ``slack`` of it),
    one fewer (down to ``low``). The threads change no result: the host kernel's
    arithmetic per element does not depend on how the work is split.
    """

    threads: int
    low: int
    high: int
    slack: float = 0.75

    @classmethod
    def for_host(cls, sharing: int = 1, pinned: frozenset[int] | None = None) -> ThreadTuner:
        """From every core of this rank's (:func:`cores_per_rank`) but one, between a quarter
        of them and all of them (when the next step waits, the launching thread waits too:
        its core is free); ``sharing``: how many delayed updates run at once on this rank
        (one per offloading optimizer of a chain), which divide those cores among them.
        ``pinned``: the CPUs the workers are pinned to (:func:`worker_cpus`), which then
        bound the threads (more would only take turns on them)."""
        cores = max(1, cores_per_rank() // max(1, sharing))
        high = cores if pinned is None else max(1, min(cores, len(pinned) // max(1, sharing)))
        low = max(1, min(cores // 4, high))
        return cls(threads=max(1, min(cores - 1, high)), low=low, high=high)

    def landed(self, worker_s: float, wait_s: float, window_s: float) -> int:
        """The threads for the next update, from the one that landed: its worker's wall
        time, how long landing it waited, and the time it had (from its start to its
        landing). A wait under 1 ms (or 1% of the time it had) counts as none."""
        if wait_s > max(1e-3, 0.01 * window_s):
            self.threads = min(self.high, self.threads + max(1, self.threads // 4))
        elif worker_s < self.slack * window_s:
            self.threads = max(self.low, self.threads - 1)
        return self.threads
