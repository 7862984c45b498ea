"""The recording stand-ins for CUDA streams and events the offload tests run on
(:mod:`tests.support.streams`): they pass what the device orders and raise on what it
would not."""

from __future__ import annotations

import pytest
import torch

from tests.support import streams


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
