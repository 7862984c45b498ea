"""Recording stand-ins for CUDA streams and events, for CPU tests of the offload step.

On the CPU every copy is synchronous, so stand-ins that do nothing let a copy issued on the
wrong stream, an event recorded before its copy or a missing wait pass every test. These
record instead: each stream keeps its queue of operations, events and waits carry vector
clocks (how far each stream's queue must have run), and the host's clock advances only
through ``Event.synchronize()``. The offload's host-mirror copies are traced by byte range
of host memory, and every access is checked against what the real device would guarantee:

- every copy runs after the compute stream's work queued before the step (the backward
  pass that wrote the gradients, the forward pass that read the parameters), and a
  device-to-host copy after any earlier host-to-device copy out of the same bytes;
- the host reads or writes staging bytes only once every copy into or out of them is known
  to be complete (an event recorded after the copy, on its stream, synchronized);
- when the step returns, the compute stream is ordered after every host-to-device copy
  (the next forward pass reads those parameters), and every device-to-host copy is known
  complete or the compute stream ordered after it too (the next backward overwrites the
  gradients it reads).

A violation raises :class:`OrderError` at the access, naming the copy and the stream.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch


class OrderError(AssertionError):
    """An access the real device would not order after the copy it depends on."""


def _join(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = max(out.get(k, 0), v)
    return out


@dataclass
class Op:
    stream: Stream
    index: int  # position in its stream's queue, from 1
    what: str
    host: tuple[int, int, int] | None  # (storage, first byte, end byte) of host memory
    after: dict = field(default_factory=dict)  # what precedes it: its stream's clock then


class Stream:
    """A queue of operations and the clock of what it waits for."""

    def __init__(self, log: Log, name: str | None = None):
        self.log = log
        self.name = name or f"stream{len(log.streams)}"
        self.ops: list[Op] = []
        self.clock: dict[Stream, int] = {}  # other streams' ops that precede its next op
        log.streams.append(self)

    def __repr__(self) -> str:
        return self.name

    def now(self) -> dict:
        return _join(self.clock, {self: len(self.ops)})

    def push(self, what: str, host=None) -> Op:
        op = Op(self, len(self.ops) + 1, what, host, dict(self.clock))
        self.ops.append(op)
        return op

    def precedes(self, op: Op) -> bool:
        """Whether ``op`` is ordered before this stream's next operation."""
        return self.now().get(op.stream, 0) >= op.index

    def wait_stream(self, other: Stream) -> None:
        self.clock = _join(self.clock, other.now())

    def wait_event(self, event: Event) -> None:
        self.clock = _join(self.clock, event.clock)

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event(self.log)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.log.host = _join(self.log.host, self.now())


class Event:
    def __init__(self, log: Log, *args, **kwargs):
        self.log = log
        self.clock: dict[Stream, int] = {}

    def record(self, stream: Stream | None = None) -> None:
        self.clock = (stream or self.log.current).now()

    def synchronize(self) -> None:
        self.log.host = _join(self.log.host, self.clock)

    def wait(self, stream: Stream | None = None) -> None:
        (stream or self.log.current).wait_event(self)

    def query(self) -> bool:
        return True


@dataclass
class Log:
    """The streams, the host's clock and the host-memory copies in flight."""

    streams: list[Stream] = field(default_factory=list)
    host: dict = field(default_factory=dict)
    copies: list[Op] = field(default_factory=list)  # every device<->host copy issued
    compute: Stream | None = None
    checks: int = 0  # accesses checked (a test can assert the checker ran)
    steps: int = 0  # optimizer steps begun (a test can assert the step was traced)
    # the current stream is per thread, as CUDA's is (a worker thread's stream context does
    # not change the launching thread's); the compute stream where none was set
    _local: threading.local = field(default_factory=threading.local)

    def __post_init__(self):
        self.compute = Stream(self, "compute")

    @property
    def current(self) -> Stream:
        return getattr(self._local, "stream", None) or self.compute

    @current.setter
    def current(self, stream: Stream | None) -> None:
        self._local.stream = stream

    def known_done(self, op: Op) -> bool:
        return self.host.get(op.stream, 0) >= op.index

    def device_copy(self, what: str, host: tuple[int, int, int], *, to_host: bool) -> None:
        stream = self.current
        # a copy to the host reads gradients the backward pass wrote; one to the device
        # overwrites parameters that work queued before the step may still read
        for marker in self.compute.ops:
            if marker.what == "work before the step" and not stream.precedes(marker):
                raise OrderError(
                    f"{what} on {stream} is not ordered after the compute stream's work "
                    "queued before the step (wait_stream(compute) missing)"
                )
        for earlier in self.copies:
            if (
                to_host
                and earlier.what.startswith("h2d")
                and _overlap(earlier.host, host)
                and not stream.precedes(earlier)
            ):
                raise OrderError(
                    f"{what} on {stream} overwrites host bytes that {earlier.what} on "
                    f"{earlier.stream} may still be reading"
                )
        self.checks += 1
        self.copies.append(stream.push(what, host))

    def host_access(self, what: str, host: tuple[int, int, int]) -> None:
        for op in self.copies:
            if _overlap(op.host, host) and not self.known_done(op):
                raise OrderError(
                    f"the host {what} bytes that {op.what} on {op.stream} may not have "
                    "finished copying (no synchronized event after it)"
                )
        self.checks += 1

    def step_begins(self) -> None:
        self.steps += 1
        self.compute.push("work before the step")

    def step_ends(self, overlapped: bool = False) -> None:
        """``overlapped``: the step left its host update sending parameters back (the
        overlapped exact step): the next forward pass waits for them, checked by
        :meth:`forward_reads`."""
        for op in self.copies:
            if op.what.startswith("h2d") and not overlapped and not self.compute.precedes(op):
                raise OrderError(
                    f"the step returned before the compute stream was ordered after {op.what} "
                    f"on {op.stream} (the next forward pass could read stale parameters)"
                )
            if (
                op.what.startswith(("d2h", "island d2h"))
                and not self.compute.precedes(op)
                and not self.known_done(op)
            ):
                raise OrderError(
                    f"the step returned before {op.what} on {op.stream} was known complete or "
                    "the compute stream ordered after it (the next backward overwrites the "
                    "gradients it reads)"
                )
        self.checks += 1

    def forward_reads(self) -> None:
        """The forward pass reads every parameter here: the compute stream must be ordered
        after every host-to-device copy issued so far."""
        for op in self.copies:
            if op.what.startswith("h2d") and not self.compute.precedes(op):
                raise OrderError(
                    f"the forward pass reads parameters before the compute stream was ordered "
                    f"after {op.what} on {op.stream}"
                )
        self.checks += 1


def _overlap(a, b) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def host_bytes(t: torch.Tensor) -> tuple[int, int, int]:
    start = t.storage_offset() * t.element_size()
    return (t.untyped_storage().data_ptr(), start, start + t.numel() * t.element_size())


def install(monkeypatch) -> Log:
    """torch.cuda's streams and events replaced by recording ones; returns the log."""
    log = Log()

    @contextlib.contextmanager
    def stream(s):
        before, log.current = log.current, s
        try:
            yield
        finally:
            log.current = before

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: log.current)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: Stream(log))
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: Event(log))
    monkeypatch.setattr(torch.cuda, "stream", stream)
    return log
