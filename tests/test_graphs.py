"""GraphReplayer's bookkeeping, on the CPU.

Capturing needs CUDA (tests/gpu/test_graphs_gpu.py does it for real). Here the one
CUDA-specific step, ``_record``, is replaced by a stand-in "graph" that re-runs the function
it recorded, so warm-up, capture, replay, fallback and invalidation on moved storage are
exercised with real tensors.
"""

import pytest
import torch

from buffers import FlatGradBuffers, graphs


class RecordedFn:
    """Stand-in for a CUDA graph: replay() re-runs the recorded function."""

    def __init__(self, fn):
        self.fn = fn
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.fn()


@pytest.fixture
def fake_cuda(monkeypatch):
    recorded = []

    def record(self, fn):
        out = fn()  # a capture records the launches; the stand-in also runs them once
        graph = RecordedFn(fn)
        recorded.append(graph)
        return graph, out

    monkeypatch.setattr(graphs, "graphs_enabled", lambda device: True)
    monkeypatch.setattr(graphs.GraphReplayer, "_record", record)
    return recorded


def test_warm_then_capture_then_replay(fake_cuda):
    buf = torch.zeros(8)
    out = torch.zeros(())
    calls = []

    def fn():
        calls.append(1)
        return out.copy_(buf.sum())

    rep = graphs.GraphReplayer(torch.device("cpu"), [buf])
    for i in range(4):
        buf.fill_(float(i))
        got = rep("k", fn)
        assert float(got) == 8.0 * i
    assert rep.captures == 1 and len(fake_cuda) == 1
    assert fake_cuda[0].replays == 3  # call 1 eager; call 2 captures, then replays; 3, 4


def test_failed_capture_falls_back_to_eager_with_a_warning(fake_cuda, monkeypatch):
    def broken(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs.GraphReplayer, "_record", broken)
    rep = graphs.GraphReplayer(torch.device("cpu"))
    rep("k", lambda: torch.ones(()))
    with pytest.warns(RuntimeWarning, match="could not capture 'k'.*not permitted"):
        assert float(rep("k", lambda: torch.full((), 2.0))) == 2.0
    assert float(rep("k", lambda: torch.full((), 3.0))) == 3.0  # eager from now on
    assert rep.captures == 0


def test_moved_storage_drops_the_graphs_and_recaptures(fake_cuda):
    buf = torch.arange(6, dtype=torch.float32)
    view = buf[2:5]
    rep = graphs.GraphReplayer(torch.device("cpu"), [view, buf[0:2]])
    assert len(rep._sources) == 1  # one storage
    for _ in range(3):
        rep("k", lambda: view.sum())
    assert rep.captures == 1 and rep.invalidations == 0
    # what megatron-core's offload_grad_buffers / restore_grad_buffers do
    storage = buf.untyped_storage()
    nbytes, before = storage.nbytes(), storage.data_ptr()
    storage.resize_(0)
    blocker = torch.empty(6)  # takes the freed block, so the storage comes back elsewhere
    storage.resize_(nbytes)
    assert storage.data_ptr() != before and blocker.numel() == 6
    buf.copy_(torch.arange(6, dtype=torch.float32) * 10)
    got = rep("k", lambda: view.sum())  # dropped: eager again, then re-captured
    assert float(got) == (20 + 30 + 40)
    assert rep.invalidations == 1
    rep("k", lambda: view.sum())
    assert rep.captures == 2


def test_flat_grad_buffers_on_the_cpu_never_capture():
    p = torch.nn.Parameter(torch.zeros(4))
    fgb = FlatGradBuffers([p])
    p.grad.copy_(torch.tensor([3.0, 4.0, 0.0, 0.0]))
    for _ in range(3):
        assert float(fgb.grad_norm()) == 5.0
    assert fgb._norm_clip.replay.captures == 0
