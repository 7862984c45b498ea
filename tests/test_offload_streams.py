"""The recording stand-ins for CUDA streams and events the offload tests run on
(:mod:`tests.support.streams`): they pass what the device orders and raise on what it
would not."""

from __future__ import annotations

import pytest
import torch

from tests.support import streams

pytestmark = pytest.mark.mcore


def test_recording_streams_order_copies_events_waits_and_reads(monkeypatch):
    """The stand-ins the offload tests run on: copy -> event -> synchronize -> read passes;
    a read without the synchronize, a copy not ordered after the compute stream, and a step
    end before the compute stream waits for the copies back each raise."""
    log = streams.install(monkeypatch)
    host = torch.zeros(8)
    side = torch.cuda.Stream()
    log.step_begins()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        log.device_copy("d2h", streams.host_bytes(host), to_host=True)
        event = torch.cuda.Event()
        event.record(side)
    with pytest.raises(streams.OrderError, match="may not have finished"):
        log.host_access("reads", streams.host_bytes(host[2:4]))
    event.synchronize()
    log.host_access("reads", streams.host_bytes(host[2:4]))
    log.host_access("reads", streams.host_bytes(torch.zeros(8)))  # other bytes: no copy
    with torch.cuda.stream(side):
        log.device_copy("h2d", streams.host_bytes(host), to_host=False)
    with pytest.raises(streams.OrderError, match="before the compute stream was ordered"):
        log.step_ends()
    torch.cuda.current_stream().wait_stream(side)
    log.step_ends()
    log.step_begins()
    late = torch.cuda.Stream()  # never told to wait for the compute stream
    with torch.cuda.stream(late), pytest.raises(streams.OrderError, match="queued before"):
        log.device_copy("d2h", streams.host_bytes(host), to_host=True)


def _fresh_class():
    """A class of the chunked host-mirror step no test has built yet."""
    from tests.support.offload_sim import MirrorChunked

    class Fresh(MirrorChunked):
        pass

    return Fresh


def test_the_trace_sees_the_step_of_a_class_built_before_it(monkeypatch):
    """torch puts its profiler hook on the first class of a kind that is built
    (``Optimizer._patch_step_function``); built before the trace, that hook shadows a trace
    of the parent's ``step``. The trace still sees every step."""
    from tests.support.offload_sim import recording_streams, train

    fresh = _fresh_class()
    with pytest.MonkeyPatch.context() as untraced:
        streams.install(untraced)
        train(fresh, True, 1.0, 1)
    assert "step" in fresh.__dict__  # torch's hook, on the class itself
    log = recording_streams(monkeypatch)
    train(fresh, True, 1.0, 2)
    assert log.steps == 2 and log.checks > 0


def test_a_class_built_under_a_trace_keeps_none_of_it():
    """A class first built during a traced test gets no hook wrapping that test's trace,
    which would send a later test's steps to the earlier log and none to its own."""
    from tests.support.offload_sim import recording_streams, train

    fresh = _fresh_class()
    logs = []
    for steps in (1, 2):
        with pytest.MonkeyPatch.context() as traced:
            logs.append(recording_streams(traced))
            train(fresh, True, 1.0, steps)
    assert [log.steps for log in logs] == [1, 2]


def test_a_copy_outside_any_traced_step_is_an_error(monkeypatch):
    """The host-mirror copies are traced only to be checked against the step's start and
    end: issued while no traced step has begun, they raise instead of passing unchecked."""
    from megatron_ext.offload import HostMirrorHybridOptimizer
    from tests.support.offload_sim import recording_streams, train

    log = recording_streams(monkeypatch)
    fresh = _fresh_class()
    # a step this trace does not see: as a shadowing subclass's would be
    monkeypatch.setattr(fresh, "step", HostMirrorHybridOptimizer._step)
    with pytest.raises(streams.OrderError, match="before any traced optimizer step"):
        train(fresh, True, 1.0, 1)
    assert log.steps == 0


@pytest.mark.parametrize("step", ["per_parameter", "chunked", "delayed"])
@pytest.mark.parametrize("overlap", [False, True], ids=["mcore_no_overlap", "mcore_overlap"])
def test_every_copy_runs_on_the_offloads_own_streams(monkeypatch, step, overlap):
    """Whatever megatron-core's overlap_cpu_optimizer_d2h_h2d says (without it, its copy
    streams are the compute stream), the gradients go to the host on one stream of the
    offload's own and the parameters come back on another, neither the compute stream."""
    from tests.support.offload_sim import MirrorChunked, MirrorPlaced, recording_streams, train

    class Delayed(MirrorChunked):
        delayed_update = True

    cls = {"per_parameter": MirrorPlaced, "chunked": MirrorChunked, "delayed": Delayed}[step]
    log = recording_streams(monkeypatch)
    _, _, hdo, _ = train(cls, True, 0.5, 3, overlap=overlap)
    hdo.drain()
    to_host = {op.stream for op in log.copies if op.what.startswith(("d2h", "island d2h"))}
    to_device = {op.stream for op in log.copies if op.what.startswith("h2d")}
    streams = hdo.offload.streams
    assert (to_host, to_device) == ({streams.to_host}, {streams.to_device})
    assert log.compute not in (streams.to_host, streams.to_device)
    assert streams.to_host is not streams.to_device
    assert (hdo._d2h_stream is log.compute) == (not overlap)  # megatron-core's own, unused


def test_no_module_binds_the_cuda_stream_api_at_import():
    """The recording stand-ins replace ``torch.cuda.Stream``, ``Event``, ``stream`` and
    ``current_stream`` on the module; code that bound one of them at import
    (``from torch.cuda import Event``) would keep the real one and run unchecked. Every
    module of the package reaches them through ``torch.cuda.`` at the call."""
    import ast
    from pathlib import Path

    replaced = {"Stream", "Event", "stream", "current_stream", "default_stream"}
    root = Path(__file__).resolve().parents[1]
    bound = []
    for path in sorted([*root.glob("megatron_ext/**/*.py"), *root.glob("buffers/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in (
                "torch.cuda",
                "torch.cuda.streams",
            ):
                bound += [f"{path.name}: {a.name}" for a in node.names if a.name in replaced]
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute):
                v = node.value
                if v.attr in replaced and ast.unparse(v.value) == "torch.cuda":
                    bound.append(f"{path.name}: {ast.unparse(node)}")
    assert not bound, bound
