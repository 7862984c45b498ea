"""Norm and clip replayed as CUDA graphs (buffers/graphs.py), on one CUDA GPU.

Every check runs on fresh random gradients at every call, so a graph that read stale data,
stale inputs (max_norm) or handed out its own output tensor would fail.
"""

import math

import pytest
import torch

from buffers import FlatGradBuffers, ops

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = [
    ((3, 5), torch.bfloat16),
    ((1000,), torch.float32),
    ((7, 129), torch.bfloat16),
    ((33,), torch.float32),
    ((4096, 3), torch.float16),
]


def make(seed=0):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dt, device="cuda")) for s, dt in SHAPES]
    return params, FlatGradBuffers(params)


def fill(params, gen):
    for p in params:
        p.grad.copy_(torch.randn(p.shape, generator=gen, device="cuda") * 3)


def ref_norm(params):
    return math.sqrt(sum(p.grad.double().square().sum().item() for p in params))


def eager_norm(fgb):
    stat = ops.local_power_stat(fgb._norm_groups, 2.0, fgb.device)
    return ops.finish_norm(stat, 2.0)


def test_norm_replays_live_data_and_matches_eager_bit_for_bit():
    params, fgb = make()
    gen = torch.Generator(device="cuda").manual_seed(1)
    norms = []
    for _ in range(6):
        fill(params, gen)
        got = fgb.grad_norm()
        assert torch.equal(got, eager_norm(fgb))
        assert float(got) == pytest.approx(ref_norm(params), rel=1e-5)
        norms.append((got, float(got)))
    assert fgb._norm_clip.replay.captures == 1
    for tensor, value in norms:  # earlier results were not overwritten by later replays
        assert float(tensor) == value


@pytest.mark.parametrize("max_norms", [[1.0, 1.0, 5.0, 0.5, 1e9, 2.0, 2.0]])
def test_clip_replays_with_changing_max_norm(max_norms):
    params, fgb = make()
    twin_params, twin = make()
    gen = torch.Generator(device="cuda").manual_seed(2)
    for max_norm in max_norms:
        fill(params, gen)
        for p, q in zip(params, twin_params, strict=True):
            q.grad.copy_(p.grad)
        want = [p.grad.double().clone() for p in params]
        ref = ref_norm(params)
        total = fgb.clip_grad_norm_(max_norm)
        # eager reference with the same launches: twin's views, no graph
        t_total = eager_norm(twin)
        coeff = ops.clip_coefficient(t_total, torch.tensor(max_norm, device="cuda"))
        ops.scale_groups_(twin._scale_groups, coeff)
        assert torch.equal(total, t_total)
        coeff64 = min(max_norm / (ref + 1e-6), 1.0)
        for p, q, w in zip(params, twin_params, want, strict=True):
            assert torch.equal(p.grad, q.grad)
            tol = 1e-2 if p.dtype != torch.float32 else 1e-5
            torch.testing.assert_close(p.grad.double(), w * coeff64, rtol=tol, atol=1e-6)
        if max_norm >= ref:  # coefficient 1: bit-for-bit untouched
            for p, w in zip(params, want, strict=True):
                assert torch.equal(p.grad.double(), w)
    assert fgb._norm_clip.replay.captures == 1


def test_capture_and_replay_make_no_host_sync():
    params, fgb = make()
    gen = torch.Generator(device="cuda").manual_seed(3)
    fill(params, gen)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):  # eager, capture, replay, replay
            fgb.grad_norm()
            fgb.clip_grad_norm_(1.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert fgb._norm_clip.replay.captures == 2


def test_inside_a_callers_graph_capture_the_launches_are_recorded():
    params, fgb = make()
    gen = torch.Generator(device="cuda").manual_seed(4)
    fill(params, gen)
    fgb.clip_grad_norm_(1e9)  # warm up (Triton compiles) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fgb.clip_grad_norm_(0.5)
    for _ in range(2):
        fill(params, gen)
        want = [p.grad.double().clone() for p in params]
        ref = ref_norm(params)
        graph.replay()
        torch.cuda.synchronize()
        assert float(out) == pytest.approx(ref, rel=1e-5)
        for p, w in zip(params, want, strict=True):
            tol = 1e-2 if p.dtype != torch.float32 else 1e-5
            torch.testing.assert_close(p.grad.double(), w * 0.5 / ref, rtol=tol, atol=1e-6)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("BUFFERS_CUDA_GRAPHS", "0")
    params, fgb = make()
    gen = torch.Generator(device="cuda").manual_seed(5)
    for _ in range(3):
        fill(params, gen)
        assert float(fgb.grad_norm()) == pytest.approx(ref_norm(params), rel=1e-5)
    assert fgb._norm_clip.replay.captures == 0


def test_storage_freed_and_reallocated_under_the_views_recaptures():
    """megatron-core's offload_grad_buffers/restore_grad_buffers: same tensors, new memory."""
    params, fgb = make()
    gen = torch.Generator(device="cuda").manual_seed(6)
    for _ in range(3):
        fill(params, gen)
        fgb.clip_grad_norm_(1.0)
    assert fgb._norm_clip.replay.captures == 1
    for buf in fgb.buffers.values():
        storage = buf.untyped_storage()
        nbytes = storage.nbytes()
        storage.resize_(0)
    blockers = [torch.empty(b.numel(), dtype=b.dtype, device="cuda") for b in fgb.buffers.values()]
    for buf in fgb.buffers.values():
        buf.untyped_storage().resize_(buf.numel() * buf.element_size())
    assert blockers and nbytes > 0
    # New memory holds garbage, padding included; restore_grad_buffers zeroes it, as here.
    fgb.zero_(set_to_none=False)  # in place, the .grad views kept (as megatron-core)
    for _ in range(3):
        fill(params, gen)
        want = [p.grad.double().clone() for p in params]
        ref = ref_norm(params)
        total = fgb.clip_grad_norm_(1.0)
        assert float(total) == pytest.approx(ref, rel=1e-5)
        for p, w in zip(params, want, strict=True):
            tol = 1e-2 if p.dtype != torch.float32 else 1e-5
            torch.testing.assert_close(p.grad.double(), w / ref, rtol=tol, atol=1e-6)
    assert fgb._norm_clip.replay.invalidations == 1
    assert fgb._norm_clip.replay.captures == 2


# --- reduced over an NCCL group: the all-reduce inside the graph ------------------------


def _counting_all_reduce(monkeypatch):
    import torch.distributed as dist

    calls = []
    real = dist.all_reduce

    def counting(tensor, *a, **k):
        calls.append(torch.cuda.is_current_stream_capturing())
        return real(tensor, *a, **k)

    monkeypatch.setattr(dist, "all_reduce", counting)
    return calls


@pytest.mark.parametrize("op", ["norm", "clip"])
def test_reduced_over_nccl_is_one_replay_with_the_all_reduce_inside(
    megatron_world, monkeypatch, op
):
    """Eager once, captured with the all-reduce once, then replays: no Python all-reduce."""
    import torch.distributed as dist

    params, fgb = make()
    twin_params, twin = make()  # the same on the route with the all-reduce between replays
    gen = torch.Generator(device="cuda").manual_seed(7)
    calls = _counting_all_reduce(monkeypatch)
    for i in range(5):
        fill(params, gen)
        for p, q in zip(params, twin_params, strict=True):
            q.grad.copy_(p.grad)
        ref = ref_norm(params)
        want = [p.grad.double().clone() for p in params]
        if op == "norm":
            got = fgb.grad_norm(group=dist.group.WORLD)
        else:
            got = fgb.clip_grad_norm_(1.0, group=dist.group.WORLD)
        assert float(got) == pytest.approx(ref, rel=1e-5), i
        if op == "clip":
            for p, w in zip(params, want, strict=True):
                tol = 1e-2 if p.dtype != torch.float32 else 1e-5
                torch.testing.assert_close(p.grad.double(), w / ref, rtol=tol, atol=1e-6)
        # bit for bit what the two-replay route gives
        monkeypatch.setenv("BUFFERS_GRAPH_COLLECTIVES", "0")
        if op == "norm":
            other = twin.grad_norm(group=dist.group.WORLD)
        else:
            other = twin.clip_grad_norm_(1.0, group=dist.group.WORLD)
        monkeypatch.delenv("BUFFERS_GRAPH_COLLECTIVES")
        assert torch.equal(got, other), i
        for p, q in zip(params, twin_params, strict=True):
            assert torch.equal(p.grad, q.grad), i
    # Python all-reduce calls, in order (True: inside a capture). Ours: eager at call 1,
    # captured at call 2, none after; the twin: one per call, never captured.
    assert calls == [False, False, True, False, False, False, False]
    assert fgb._norm_clip.replay.captures == 1


@pytest.mark.parametrize("op", ["norm", "clip"])
def test_a_captured_reduction_is_replayed_only_for_its_own_group(op):
    """Two stand-in groups whose reductions multiply the stat by 4 and by 9: a graph
    captured with the first is never replayed for the second (issue 15, item 4)."""
    params, fgb = make()
    nc = fgb._norm_clip
    gen = torch.Generator(device="cuda").manual_seed(5)
    factors = {"group a": 4.0, "group b": 9.0}
    for key in ["group a", "group a", "group a", "group b", "group b", "group b", "group a"]:
        fill(params, gen)
        want = math.sqrt(factors[key]) * ref_norm(params)

        def reduce(stat, f=factors[key]):
            return stat.mul_(f)

        if op == "norm":
            got = nc.norm_reduced(2.0, reduce, True, key)
        else:
            got = nc.clip_reduced_(1e30, 2.0, reduce, True, key)
        assert float(got) == pytest.approx(want, rel=1e-5), key
    assert nc.replay.captures == 2  # one graph per group


def test_a_gloo_group_is_reduced_outside_the_graph_with_the_same_result(megatron_world):
    import torch.distributed as dist

    gloo = dist.new_group([0], backend="gloo")
    params, fgb = make()
    gen = torch.Generator(device="cuda").manual_seed(6)
    for _ in range(5):
        fill(params, gen)
        local = eager_norm(fgb)
        assert torch.equal(fgb.grad_norm(group=gloo), local)
        fill(params, gen)
        want = ref_norm(params)
        assert float(fgb.clip_grad_norm_(1e30, group=gloo)) == pytest.approx(want, rel=1e-5)
    keys = {k[0] for k in fgb._norm_clip.replay._graphs}
    assert not keys & {"norm_reduced", "clip_reduced"}, keys  # no all-reduce was captured
    assert keys == {"stat", "stat_in", "finish_scale"}, keys
    assert fgb._norm_clip.replay.captures >= 2  # the local parts were graphed
