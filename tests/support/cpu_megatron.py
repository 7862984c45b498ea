"""megatron-core's real DDP and distributed optimizer on CPU tensors (test support).

megatron-core 0.18/0.19 hard-codes CUDA in the code a CPU test needs: buffers allocated on
``torch.cuda.current_device()`` or ``device='cuda'``, ``.cuda()`` copies, type checks
against ``'torch.cuda.BFloat16Tensor'``, and ``torch.cuda.Stream`` / ``Event`` /
``current_stream`` / ``stream`` for overlapping the gradient reduction. Its coalesced
collectives (``_coalescing_manager``) have no gloo implementation. :func:`cpu_megatron`
redirects all of that, for the duration of a ``with`` block, so that megatron-core's own
``DistributedDataParallel``, ``ParamAndGradBuffer`` and ``DistributedOptimizer`` run on the
CPU under gloo, at one rank or several spawned ranks:

- a torch function mode rewrites every CUDA device argument (``'cuda'``, ``'cuda:0'``,
  ``torch.device('cuda')``, a bare device index as ``torch.cuda.current_device()`` returns)
  to the CPU, makes ``Tensor.cuda()`` stay on the CPU, and answers ``Tensor.type()`` with
  the CUDA type name megatron-core checks for. ``Tensor.cuda()`` of a host tensor is a copy,
  as on the device (megatron-core calls it on host tensors: loaded checkpoint shards, gather
  buffers), and so is ``.to(cuda)`` of one, so a bug that writes to one side and reads the
  other is not hidden by aliasing;
  of a tensor the shim put "on the device" (a factory's CUDA device argument, a
  ``.cuda()`` or ``.to(cuda)`` copy, or a view of one) it is that tensor, as CUDA's is;
- streams and events are stand-ins that *record* what was asked of them: which stream was
  current when each collective was issued, every ``wait_stream`` / ``wait_event`` /
  ``record``, synchronizations; a test can assert the order the real device needs;
- collectives run synchronously, one by one, as ``tests/support/multirank`` runs them on
  one GPU, and each is recorded once, as megatron-core called it (function, reduce op,
  group ranks, stream, async or not), whichever way torch dispatches it inside.

Nothing of megatron-core is changed: its modules see the stand-ins through ``torch.cuda``
and ``torch.distributed``, and the collectives ``param_and_grad_buffer`` and
``tensor_parallel.mappings`` bound by value at import.
Everything is restored when the block ends.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode

_COLLECTIVES = (
    "all_reduce",
    "reduce_scatter_tensor",
    "all_gather_into_tensor",
    "_all_gather_base",
    "_reduce_scatter_base",
    "broadcast",
    "all_gather",
    "all_gather_object",
    "reduce_scatter",
    "all_to_all_single",
    "barrier",
)


@dataclass
class Log:
    """What megatron-core asked of the device, in order: tuples whose first item is the kind
    (``"collective"``, ``"wait_stream"``, ``"wait_event"``, ``"record"``, ``"synchronize"``,
    ``"set_device"``, ``"cuda_copy"``)."""

    entries: list[tuple] = field(default_factory=list)

    def of(self, kind: str) -> list[tuple]:
        return [e for e in self.entries if e[0] == kind]

    def clear(self) -> None:
        self.entries.clear()


class RecordingStream:
    """A ``torch.cuda.Stream`` stand-in: records every request against its name."""

    _ids = itertools.count()

    def __init__(self, device: Any = None, priority: int = 0, *, log: Log, name: str = ""):
        self.log = log
        self.name = name or f"stream{next(self._ids)}"

    def wait_stream(self, other: RecordingStream) -> None:
        self.log.entries.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: RecordingEvent) -> None:
        self.log.entries.append(("wait_event", self.name, event.name))

    def record_event(self, event: RecordingEvent | None = None) -> RecordingEvent:
        event = event if event is not None else RecordingEvent(log=self.log)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.log.entries.append(("synchronize", self.name))

    def query(self) -> bool:
        return True  # every CPU op has finished when it returns

    def __repr__(self) -> str:
        return f"RecordingStream({self.name})"


class RecordingEvent:
    """A ``torch.cuda.Event`` stand-in: records on which stream it was recorded and waited."""

    _ids = itertools.count()

    def __init__(self, *args: Any, log: Log, **kwargs: Any):
        self.log = log
        self.name = f"event{next(self._ids)}"
        self.recorded_on: str | None = None

    def record(self, stream: RecordingStream | None = None) -> None:
        stream = stream if stream is not None else _STATE.current()
        self.recorded_on = stream.name
        self.log.entries.append(("record", self.name, stream.name))

    def wait(self, stream: RecordingStream | None = None) -> None:
        stream = stream if stream is not None else _STATE.current()
        self.log.entries.append(("wait_event", stream.name, self.name))

    def synchronize(self) -> None:
        self.log.entries.append(("synchronize", self.name))

    def query(self) -> bool:
        return True


class _State:
    """The stream stack of the active shim (one shim at a time per process)."""

    def __init__(self) -> None:
        self.stack: list[RecordingStream] = []
        self.in_collective = False  # a recorded collective is running (see the recorder)

    def current(self) -> RecordingStream:
        if not self.stack:
            raise RuntimeError("torch.cuda stand-ins used outside cpu_megatron()")
        return self.stack[-1]


_STATE = _State()


def _is_cuda(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # torch.cuda.current_device()'s answer, used as a device
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """Every CUDA device argument becomes the CPU; ``Tensor.type()`` reads as CUDA's;
    ``Tensor.cuda()`` copies what is not "on the device" (module docstring)."""

    def __init__(self, log: Log):
        super().__init__()
        self.log = log
        # id -> weak reference, by identity (a tensor's == is elementwise); an id reused
        # after its tensor died fails the identity check
        self._on_device: dict[int, weakref.ref] = {}

    def _mark_on_device(self, t: torch.Tensor) -> None:
        self._on_device[id(t)] = weakref.ref(t)

    def _is_on_device(self, t: torch.Tensor) -> bool:
        return any(
            x is not None and (r := self._on_device.get(id(x))) is not None and r() is x
            for x in (t, t._base)
        )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            t = args[0]
            self.log.entries.append(("cuda_copy", tuple(t.shape), t.dtype, _STATE.current().name))
            if self._is_on_device(t):
                return t
            with torch._C.DisableTorchFunction():
                copy = t.clone()
            self._mark_on_device(copy)
            return copy
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            # megatron-core's dtype dispatch compares against 'torch.cuda.BFloat16Tensor'
            return (
                name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
            )
        to_device = _is_cuda(kwargs.get("device"))
        if to_device:
            kwargs["device"] = "cpu"
        # pinned host memory needs a CUDA driver; on the CPU it is plain host memory
        if func is torch.Tensor.pin_memory:
            self.log.entries.append(("pin", tuple(args[0].shape), args[0].dtype))
            return args[0]
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
            self.log.entries.append(("pin", None, kwargs.get("dtype")))
        if func is torch.Tensor.to:
            to_device = to_device or any(_is_cuda(a) for a in args[1:])
            args = tuple("cpu" if i > 0 and _is_cuda(a) else a for i, a in enumerate(args))
        out = func(*args, **kwargs)
        if to_device and isinstance(out, torch.Tensor):
            if args and out is args[0] and not self._is_on_device(out):
                # .to(cuda) of a host tensor: a copy, as .cuda()'s
                with torch._C.DisableTorchFunction():
                    out = out.clone()
            self._mark_on_device(out)  # what a CUDA device argument made is on the device
        return out


class _OneByOne:
    """The handle a coalescing manager or an async collective hands back: already done."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _recording_collective(name: str, fn, log: Log):
    @functools.wraps(fn)
    def wrapper(*args: Any, async_op: bool = False, **kwargs: Any):
        if _STATE.in_collective:
            # torch's own re-dispatch of the collective being recorded, not a second call:
            # with a torch function mode active (_CudaToCpu), torch hands the call back
            # through ``handle_torch_function`` with the module-level name, which is this
            # wrapper (all_reduce on every torch; reduce_scatter_tensor and
            # all_gather_into_tensor on torch 2.11, not 2.14, where they delegate to
            # unpatched ``*_single`` functions)
            return fn(*args, async_op=async_op, **kwargs)
        group = kwargs.get("group")
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else "world"
        op = kwargs.get("op")
        stream = _STATE.current().name if _STATE.stack else None
        log.entries.append(("collective", name, str(op) if op is not None else "", ranks,
                            stream, async_op))  # fmt: skip
        if name == "all_gather_object":
            return fn(*args, **kwargs)
        _STATE.in_collective = True
        try:
            out = fn(*args, async_op=False, **kwargs)
        finally:
            _STATE.in_collective = False
        return _OneByOne() if async_op else out

    return wrapper


@contextlib.contextmanager
def _one_by_one(group=None, device=None, async_ops=False):
    yield _OneByOne()


def _setattr(saved: list, obj: Any, name: str, value: Any) -> None:
    saved.append((obj, name, getattr(obj, name, _MISSING)))
    setattr(obj, name, value)


_MISSING = object()


@contextlib.contextmanager
def cpu_megatron() -> Iterator[Log]:
    """Run megatron-core's DDP and optimizers on CPU tensors for the block; yield the log.

    Import megatron-core's modules before or inside the block, either works: they read the
    patched names at call time. Streams created inside the block are recording stand-ins
    (the default one is named ``"default"``); the log holds every collective with the
    stream that was current when it was issued.
    """
    import megatron.core.distributed.param_and_grad_buffer as pgb
    import megatron.core.tensor_parallel.mappings as mappings

    import megatron_ext.ddp

    log = Log()
    saved: list = []
    default = RecordingStream(log=log, name="default")
    _STATE.stack = [default]

    @contextlib.contextmanager
    def stream(s):
        if s is None:
            yield
            return
        _STATE.stack.append(s)
        try:
            yield
        finally:
            _STATE.stack.pop()

    cuda = torch.cuda
    try:
        _setattr(saved, cuda, "Stream", functools.partial(RecordingStream, log=log))
        _setattr(saved, cuda, "Event", functools.partial(RecordingEvent, log=log))
        _setattr(saved, cuda, "current_stream", lambda *a, **k: _STATE.current())
        _setattr(saved, cuda, "default_stream", lambda *a, **k: default)
        _setattr(saved, cuda, "stream", stream)
        _setattr(saved, cuda, "current_device", lambda: 0)
        _setattr(saved, cuda, "set_device", lambda d: log.entries.append(("set_device", d)))
        _setattr(saved, cuda, "synchronize", lambda *a: log.entries.append(("synchronize",)))
        _setattr(saved, cuda, "empty_cache", lambda: None)
        # megatron_ext's up-front "needs a CUDA GPU" refusal: the shim is that GPU
        _setattr(saved, megatron_ext.ddp, "require_cuda", lambda: None)
        for n in _COLLECTIVES:
            if hasattr(dist, n):
                wrapped = _recording_collective(n, getattr(dist, n), log)
                _setattr(saved, dist, n, wrapped)
                _setattr(saved, c10d, n, wrapped)
        for mod in (dist, c10d, pgb):
            _setattr(saved, mod, "_coalescing_manager", _one_by_one)
        # bound by value when megatron-core was imported: through these, an async gloo
        # op would be handed a done handle and read before it finished
        for mod in (pgb, mappings):
            for n in ("dist_all_gather_func", "dist_reduce_scatter_func"):
                fn = getattr(mod, n, None)
                if fn is not None:
                    _setattr(saved, mod, n, _recording_collective(fn.__name__, fn, log))
        with _CudaToCpu(log):
            yield log
    finally:
        for obj, name, value in reversed(saved):
            if value is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
        _STATE.stack = []
