"""Starting a test's ranks: forked from one server that imported torch, megatron-core,
``megatron_ext`` and the CPU shim once (``tests/support/preload.py``).

[Note: ranks forked from a preloaded server]
A rank started with ``spawn`` is a fresh interpreter that imports torch, megatron-core and
the shim again, about 9 CPU-seconds before it runs a line of the test; the suite starts
about a hundred. Here every rank is a ``forkserver`` child instead: multiprocessing's server
process is started once per pytest process with :mod:`tests.support.preload` imported, and
each rank is a fork of it, so the imports are paid once. What a spawned rank got, a forked
one gets too:

- the parent's ``sys.path`` and working directory (multiprocessing sends them to every
  child, whatever the start method);
- the parent's environment *at the start of the ranks* (the server's was fixed when it
  started): :class:`_Parent` carries it and :func:`_as_the_parent` puts it in place before
  the rank's function runs;
- the parent's standard output and error as they are then (pytest's capture of the running
  test, not of the test during which the server started): :class:`_Parent` passes them
  as file descriptors;
- nothing of an earlier rank: every rank is a fork of the server, which runs no test code.

What differs: a variable read at import time by a preloaded module was read when the
server started. So when the environment differs from the server's (pytest's own
``PYTEST_CURRENT_TEST`` aside), the ranks are started with ``spawn``, fresh interpreters
that read it, and a warning names the variables. On a machine where torch sees a GPU the
ranks are spawned too: the server's imports may initialise the CUDA driver, which a
forked child cannot use.

A test that checks what happens at import, at install or on a command line needs a fresh
interpreter on purpose, and starts one with ``subprocess``, not with this module.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import multiprocessing.reduction
import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

PRELOAD = "tests.support.preload"
# set by pytest for every test, so it always differs from the server's
IGNORED = frozenset({"PYTEST_CURRENT_TEST"})
# megatron-core sets the attention backend's variables when a language model is built in
# this process; only transformer-engine reads them at import, and the server never imports
# it (a machine with TE has a GPU, where ranks are spawned), while every rank takes the
# parent's environment at its start: they need no fresh interpreter
IGNORED_PREFIXES = ("NVTE_",)

_lock = threading.Lock()
_server_env: dict[str, str] | None = None  # os.environ when the server was started


def start_method() -> str:
    """``"forkserver"`` (the preloaded server, started at the first call), or ``"spawn"``
    where a forked rank would not get what a spawned one gets (the Note above)."""
    global _server_env
    import torch

    if torch.cuda.is_available():
        return "spawn"
    with _lock:
        if _server_env is None:
            multiprocessing.forkserver.set_forkserver_preload([PRELOAD])
            multiprocessing.forkserver.ensure_running()
            _server_env = dict(os.environ)
        changed = sorted(
            k
            for k in set(os.environ) | set(_server_env)
            if k not in IGNORED
            and not k.startswith(IGNORED_PREFIXES)
            and os.environ.get(k) != _server_env.get(k)
        )
    if changed:
        warnings.warn(
            f"environment variables {changed} differ from the rank server's: these ranks are "
            "spawned as fresh interpreters (slower) so that imports read them",
            stacklevel=3,
        )
        return "spawn"
    return "forkserver"


def context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context :func:`start_method` chooses."""
    return multiprocessing.get_context(start_method())


class _Parent:
    """What a rank takes from its parent at its start: the environment, and standard
    output and error (passed as descriptors while the child is being started)."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.fds: dict[int, Any] = {}  # in the child: fd -> its duplicate, to detach

    def __reduce__(self):
        fds = {fd: multiprocessing.reduction.DupFd(fd) for fd in (1, 2)}
        return _Parent._rebuild, (self.env, fds)

    @staticmethod
    def _rebuild(env: dict[str, str], fds: dict[int, Any]) -> _Parent:
        out = _Parent.__new__(_Parent)
        out.env, out.fds = env, fds
        return out

    def apply(self) -> None:
        for fd, dup in self.fds.items():
            got = dup.detach()
            if got != fd:
                (sys.stdout if fd == 1 else sys.stderr).flush()
                os.dup2(got, fd)
                os.close(got)
        os.environ.clear()
        os.environ.update(self.env)


def _as_the_parent(i: int, parent: _Parent, fn: Callable, args: tuple) -> None:
    parent.apply()
    fn(i, *args)


def _as_the_parent_process(parent: _Parent, target: Callable, args: tuple) -> None:
    parent.apply()
    target(*args)


def spawn(fn: Callable, args: tuple = (), nprocs: int = 1) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)``, its contract unchanged
    (``fn(i, *args)`` in ``nprocs`` processes, joined; a rank's exception or non-zero exit
    raised here, the other ranks ended), with the ranks started by :func:`start_method`.
    ``fn`` and ``args`` are pickled, so ``fn`` is a module-level function."""
    import torch.multiprocessing as mp

    mp.start_processes(
        _as_the_parent,
        args=(_Parent(), fn, args),
        nprocs=nprocs,
        join=True,
        start_method=start_method(),
    )


def process(target: Callable, args: tuple = ()) -> multiprocessing.process.BaseProcess:
    """A ``Process`` (not started) that runs ``target(*args)``, started by
    :func:`start_method` like the ranks of :func:`spawn`."""
    return context().Process(target=_as_the_parent_process, args=(_Parent(), target, args))
