"""GraphReplayer's bookkeeping, on the CPU.

Capturing needs CUDA (tests/gpu/test_graphs_gpu.py does it for real). Here the one
CUDA-specific step, ``_record``, is replaced by a stand-in "graph" that re-runs the function
it recorded, so warm-up, capture, replay, fallback and invalidation on moved storage are
exercised with real tensors.
"""

import pytest
import torch

from buffers import FlatGradBuffers, graphs
from buffers.graphs import NormClip


class RecordedFn:
    """Stand-in for a CUDA graph: replay() re-runs the recorded function.

    A real capture records without running, and GraphReplayer replays right after it; the
    stand-in runs the function while "recording" (to get its output tensor), so the first
    replay after that is skipped: one run per call, as on CUDA. A replay writes its result
    into the recorded output tensor, as a graph rewrites the same memory. ``inside`` is
    True while the function runs as part of the "graph" (recording or replaying).
    """

    inside = False

    def __init__(self, fn, out):
        self.fn = fn
        self.out = out
        self.replays = 0
        self._ran_at_record = True

    def replay(self):
        self.replays += 1
        if self._ran_at_record:
            self._ran_at_record = False
            return
        RecordedFn.inside = True
        try:
            result = self.fn()
        finally:
            RecordedFn.inside = False
        if result is not self.out:
            self.out.copy_(result)


@pytest.fixture
def fake_cuda(monkeypatch):
    recorded = []

    def record(self, fn):
        RecordedFn.inside = True
        try:
            out = fn()
        finally:
            RecordedFn.inside = False
        graph = RecordedFn(fn, out)
        recorded.append(graph)
        return graph, out

    monkeypatch.setattr(graphs, "graphs_enabled", lambda device, options=None: True)
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
    blockers = []  # take freed blocks until the storage comes back elsewhere
    for _ in range(100):
        storage.resize_(0)
        blockers.append(torch.empty(6))
        storage.resize_(nbytes)
        if storage.data_ptr() != before:
            break
    assert storage.data_ptr() != before
    rep._pool = stale = object()  # the graphs' memory pool, released with them
    buf.copy_(torch.arange(6, dtype=torch.float32) * 10)
    got = rep("k", lambda: view.sum())  # dropped: eager again, then re-captured
    assert float(got) == (20 + 30 + 40)
    assert rep.invalidations == 1
    assert rep._pool is not stale  # a new pool for the new graphs (the CUDA test's assert)
    rep("k", lambda: view.sum())
    assert rep.captures == 2


def test_flat_grad_buffers_on_the_cpu_never_capture():
    p = torch.nn.Parameter(torch.zeros(4))
    fgb = FlatGradBuffers([p])
    p.grad.copy_(torch.tensor([3.0, 4.0, 0.0, 0.0]))
    for _ in range(3):
        assert float(fgb.grad_norm()) == 5.0
    assert fgb._norm_clip.replay.captures == 0


@pytest.mark.parametrize("in_graph", [True, False])
@pytest.mark.parametrize("op", ["norm", "clip"])
def test_reduced_norm_and_clip_put_the_reduction_in_the_graph_only_when_asked(
    fake_cuda, in_graph, op
):
    """The reduction (here a stand-in that multiplies the stat by 4) runs once per call:
    inside the graph with ``capture_reduce``, between replays without; same results."""
    gen = torch.Generator().manual_seed(3)
    bufs = [torch.zeros(40, dtype=torch.float32), torch.zeros(24, dtype=torch.bfloat16)]
    views = [bufs[0][0:30], bufs[0][32:40], bufs[1][0:17]]
    nc = NormClip([views[:2], views[2:]], [views[:2], views[2:]], torch.device("cpu"))
    where = []

    def reduce(stat):
        where.append(RecordedFn.inside)
        return stat.mul_(4.0)

    for i in range(5):
        for v in views:
            v.copy_(torch.randn(v.shape, generator=gen) * (i + 1))
        before = [v.double().clone() for v in views]
        ref = 2.0 * float(sum(b.square().sum() for b in before) ** 0.5)  # sqrt(4 * sumsq)
        if op == "norm":
            got = nc.norm_reduced(2.0, reduce, in_graph)
        else:
            got = nc.clip_reduced_(1.0, 2.0, reduce, in_graph)
            coeff = min(1.0 / (ref + 1e-6), 1.0)
            for v, b in zip(views, before, strict=True):
                tol = 1e-2 if v.dtype == torch.bfloat16 else 1e-5
                torch.testing.assert_close(v.double(), b * coeff, rtol=tol, atol=1e-7)
        assert float(got) == pytest.approx(ref, rel=1e-5)
    assert len(where) == 5  # once per call, whichever route
    if in_graph:
        assert where == [False, True, True, True, True]  # eager, captured, replayed
    else:
        assert where == [False] * 5


def test_reduce_capturable_only_for_nccl_while_graphs_are_on(monkeypatch):
    import torch.distributed as dist

    cuda = torch.device("cuda")
    assert graphs.reduce_capturable(None, torch.device("cpu")) is False
    monkeypatch.setattr(graphs, "graphs_enabled", lambda device, options=None: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for backend, want in [("nccl", True), ("cpu:gloo,cuda:nccl", True), ("gloo", False)]:
        monkeypatch.setattr(dist, "get_backend", lambda group, b=backend: b)
        assert graphs.reduce_capturable(None, cuda) is want, backend
    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    monkeypatch.setenv("BUFFERS_GRAPH_COLLECTIVES", "0")
    assert graphs.reduce_capturable(None, cuda) is False
    monkeypatch.delenv("BUFFERS_GRAPH_COLLECTIVES")

    def not_a_member(group):
        raise ValueError("Invalid process group specified")

    monkeypatch.setattr(dist, "get_backend", not_a_member)
    assert graphs.reduce_capturable(None, cuda) is False


def test_group_reducer_looks_up_the_backend_once_and_rereads_the_switches(monkeypatch):
    import torch.distributed as dist

    cuda = torch.device("cuda")
    lookups = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group: lookups.append(group) or "nccl")
    enabled = {"on": True}
    monkeypatch.setattr(graphs, "graphs_enabled", lambda device, options=None: enabled["on"])
    group = object()
    reducer = graphs.GroupReducer(2.0, group, cuda)
    assert reducer.args()[1] is True
    monkeypatch.setenv("BUFFERS_GRAPH_COLLECTIVES", "0")
    assert reducer.args()[1] is False  # the environment switch is read per call
    monkeypatch.delenv("BUFFERS_GRAPH_COLLECTIVES")
    enabled["on"] = False  # e.g. inside a caller's own capture
    assert reducer.args()[1] is False
    enabled["on"] = True
    assert reducer.args()[1] is True
    assert lookups == [group]  # one backend lookup for all of the above
    monkeypatch.setattr(dist, "get_backend", lambda group: "gloo")
    assert graphs.GroupReducer(2.0, group, cuda).args()[1] is False


def test_group_reducer_reduces_the_stat_over_its_group(monkeypatch):
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(graphs.ops, "all_reduce_stat", lambda s, p, g: calls.append((p, g)) or s)
    group = object()
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    reduce, capture, _key = graphs.GroupReducer(1.0, group, torch.device("cpu")).args()
    stat = torch.tensor(3.0)
    assert reduce(stat) is stat and calls == [(1.0, group)] and capture is False


def test_group_key_tells_groups_apart_without_holding_them():
    import gc
    import weakref

    class Group:
        def __init__(self, name):
            self.group_name = name

    a, b = Group("1"), Group("2")
    assert graphs.group_key(a) != graphs.group_key(b)
    assert graphs.group_key(a) == graphs.group_key(a)
    assert graphs.group_key(None) is None
    nameless = object()
    assert graphs.group_key(nameless) == (None, id(nameless))
    ref = weakref.ref(a)
    reducer = graphs.GroupReducer(2.0, b, torch.device("cpu"))
    key = graphs.group_key(a)
    del a
    gc.collect()
    assert ref() is None and key is not None  # the key does not keep the group alive
    assert reducer.args()[2] == graphs.group_key(b)
