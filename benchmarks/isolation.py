"""Stock arms in their own processes: a crash there becomes a row and the run goes on.

megatron-core's norm, handed a mixed bf16/fp32 list with transformer-engine installed, can
make an illegal memory access: the CUDA context of that process is unusable afterwards (every
later CUDA call fails), and an abort takes the whole process with it. So the benchmarks run
every stock arm in a :class:`Child`: a process started with ``spawn`` (a fork of a process
that has touched CUDA cannot use CUDA), which runs named functions of the benchmark modules
and keeps a state dict between calls. A function that raises comes back as
:class:`ChildFailed` (its error fields; the child lives on, but a CUDA error may have
poisoned it, so callers start a fresh one for their next cell); a child that dies or stops
answering comes back as :class:`ChildCrashed`, naming the signal or exit status and the
first error line it printed.

Fault injection, for tests on the CPU: ``BENCHMARKS_STOCK_FAULT="kind[:tag],..."`` makes
the stock arm of every cell whose tag matches (an inventory's or configuration's name; no
tag: every cell) ``abort`` (``os.abort()``, as a hard crash), ``raise`` (a RuntimeError) or,
where a benchmark computes a norm, return a ``wrong_norm`` (1.5 times the true one).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import re
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script, find the repo

from benchmarks import common  # noqa: E402

FAULT_ENV = "BENCHMARKS_STOCK_FAULT"
FAULT_KINDS = ("abort", "raise", "wrong_norm")
WRONG_NORM_FACTOR = 1.5
# Seconds one call may take before the child counts as hung (a deadlocked collective, say).
CALL_TIMEOUT_S = 1800.0
_ERROR_LINE = re.compile(r"error|exception|abort|terminate|fault|what\(\)", re.IGNORECASE)


class ChildCrashed(RuntimeError):
    """The child process died (signal or exit) or stopped answering; the message says how."""


class ChildFailed(RuntimeError):
    """The function raised in the child; ``fields`` are its ``error`` and ``error_at``."""

    def __init__(self, fields: dict[str, str]) -> None:
        super().__init__(fields.get("error", "error in the child process"))
        self.fields = fields


def injected_fault(tag: str) -> str | None:
    """The fault :data:`FAULT_ENV` asks for at the cell ``tag``, or None.

    Raises:
        ValueError: the variable names a kind not in :data:`FAULT_KINDS`.
    """
    for item in os.environ.get(FAULT_ENV, "").split(","):
        kind, _, where = item.strip().partition(":")
        if not kind:
            continue
        if kind not in FAULT_KINDS:
            raise ValueError(
                f"{FAULT_ENV}={os.environ[FAULT_ENV]!r}: unknown fault {kind!r}; use one of "
                f"{list(FAULT_KINDS)}, optionally ':<inventory or configuration name>'"
            )
        if not where or where == tag:
            return kind
    return None


def fire(kind: str | None) -> None:
    """Crash the way ``kind`` says: ``abort`` kills the process, ``raise`` raises; other
    kinds (and None) do nothing here."""
    if kind == "abort":
        os.abort()
    if kind == "raise":
        raise RuntimeError(f"fault injected by {FAULT_ENV}")


def _resolve(ref: str):
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _serve(conn, log_path: str, root: str) -> None:
    """The child's loop: ``(ref, args)`` in, ``("ok", value)`` or ``("error", fields)`` out,
    until None or the parent goes away."""
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 2)  # what a crash prints is read back by the parent
    os.dup2(log, 1)  # the pipe carries the answers; nothing else goes to the parent's stdout
    sys.path.insert(0, root)
    state: dict[str, Any] = {}
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        ref, args = msg
        try:
            answer = ("ok", _resolve(ref)(state, *args))
        except Exception as exc:  # the parent records it as the cell's error
            answer = ("error", common.error_fields(exc))
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send(answer)


def first_error_line(text: str) -> str:
    """The first line of ``text`` that looks like an error, else its last line, else ''."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return next((ln for ln in lines if _ERROR_LINE.search(ln)), lines[-1] if lines else "")


def status(error: str | None) -> str:
    """A row's status from its ``error`` field: ``ok``; ``crashed (...)`` when the error
    says its process died (``crashed: ...``, as the benchmarks record a
    :class:`ChildCrashed`); else ``failed (first line of the error)``."""
    if not error:
        return "ok"
    first = error.splitlines()[0]
    if first.startswith("crashed: "):
        return f"crashed ({first.removeprefix('crashed: ')})"
    return f"failed ({first})"


class Child:
    """A spawned worker process that runs ``"module:function"`` calls with a kept state.

    Each function is called as ``function(state, *args)``; ``state`` is a dict that lives
    as long as the child. Use as a context manager, or call :meth:`close`.

    Args:
        name: what the child is for (its log file's prefix and crash messages).
        timeout_s: seconds one call may take before the child is killed as hung.
    """

    def __init__(self, name: str, timeout_s: float = CALL_TIMEOUT_S) -> None:
        ctx = multiprocessing.get_context("spawn")
        fd, self._log = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
        os.close(fd)
        self.name, self.timeout_s = name, timeout_s
        self.crash: str | None = None  # set once the child died: why
        self.failed = False  # set once a call raised: the child may be poisoned
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve, args=(child_conn, self._log, str(ROOT)), name=name, daemon=True
        )
        self._proc.start()
        child_conn.close()

    @property
    def usable(self) -> bool:
        """Neither crashed nor failed: safe to give the next cell."""
        return self.crash is None and not self.failed

    def call(self, ref: str, *args: Any) -> Any:
        """Run ``ref`` (``"module:function"``) in the child with ``args``; its return value.

        Raises:
            ChildFailed: the function raised (the child lives on).
            ChildCrashed: the child died, had died before, or gave no answer in time.
        """
        if self.crash is not None:
            raise ChildCrashed(self.crash)
        try:
            self._conn.send((ref, args))
            if not self._conn.poll(self.timeout_s):
                self._proc.kill()
                self._proc.join()
                self.crash = f"no answer in {self.timeout_s:.0f} s ({self._log_line() or 'hung'})"
                raise ChildCrashed(self.crash)
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(30)
            self.crash = self._death()
            raise ChildCrashed(self.crash) from None
        if kind == "error":
            self.failed = True
            raise ChildFailed(value)
        return value

    def _log_line(self) -> str:
        with contextlib.suppress(OSError):
            return first_error_line(Path(self._log).read_text(errors="replace"))
        return ""

    def _death(self) -> str:
        code = self._proc.exitcode
        if code is None:
            how = "stopped answering"
        elif code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        line = self._log_line()
        return f"{how}: {line}" if line else how

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines the child printed (for the parent's stderr)."""
        with contextlib.suppress(OSError):
            return "\n".join(Path(self._log).read_text(errors="replace").splitlines()[-lines:])
        return ""

    def close(self) -> None:
        """Stop the child (asked first, killed if it does not stop) and delete its log."""
        if self._proc.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(None)
            self._proc.join(30)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()
        with contextlib.suppress(OSError):
            os.unlink(self._log)

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def crash_report(child: Child, where: str) -> None:
    """Print, on stderr, that ``child`` crashed at ``where`` and the end of what it printed."""
    print(f"{child.name}: crashed at {where}: {child.crash}", file=sys.stderr)
    tail = child.log_tail()
    if tail:
        print(tail, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(common.not_a_script(__file__))
