"""The chunked offload step when something goes wrong, on the CPU: a fused call that raises,
step counters shared between parameters, and the per-step work it does not redo."""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_ext.offload import host_kernel as native
from tests.support import offload_internals
from tests.support.offload_sim import (
    MirrorChunked,
    MirrorChunkedNative,
    MirrorChunkedTorch,
    assert_same_run,
    make_hdo,
    one_step,
    sim,
    train,
)

pytestmark = pytest.mark.mcore

KERNELS = {"torch": MirrorChunkedTorch, "native": MirrorChunkedNative}


def _fresh(fraction=0.5, kernel="torch"):
    bf16, fp32, groups, sources, bind, shard16 = sim(True, False, False, 2, 1)
    hdo = make_hdo(KERNELS[kernel], groups, fraction, True, sources, 200, 64)
    return bf16, fp32, hdo, shard16, bind


def _snapshot(run):
    bf16, fp32, hdo, shard16, _ = run
    state = {
        (i, key): value.clone()
        for i, p in enumerate(p for g in hdo.param_groups for p in g["params"])
        for key, value in hdo.state[p].items()
        if isinstance(value, torch.Tensor)
    }
    hosts = [m.host_params.clone() for m in hdo.host_mirrors]
    return bf16.param_data.clone(), fp32.param_data.clone(), state, hosts


def _assert_snapshot_equal(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[2].keys() == b[2].keys()
    for key in a[2]:
        assert torch.equal(a[2][key], b[2][key]), key
    for x, y in zip(a[3], b[3], strict=True):
        assert torch.equal(x, y)


class _Failing:
    """torch._fused_adamw_ (kernel "torch") or the compiled kernel's call (kernel
    "native") raising at its ``at``-th call (counted from 1), before it writes anything."""

    def __init__(self, monkeypatch, at, kernel="torch"):
        self.calls, self.at = 0, at
        self.owner, self.name = (
            (torch, "_fused_adamw_") if kernel == "torch" else (native.HostAdamW, "run")
        )
        self.real = getattr(self.owner, self.name)
        self.monkeypatch = monkeypatch
        failing = self

        def call(*args, **kwargs):
            failing.calls += 1
            if failing.calls == failing.at:
                raise RuntimeError("injected failure")
            return failing.real(*args, **kwargs)

        monkeypatch.setattr(self.owner, self.name, call)

    def restore(self):
        self.monkeypatch.setattr(self.owner, self.name, self.real)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_step_failing_at_its_first_update_leaves_everything_as_before(
    cpu_streams, monkeypatch, kernel
):
    """Counters, moments, parameters on both sides unchanged, no copy in flight, and the
    run then continues exactly as one that never failed."""
    plain = train(MirrorChunked, True, 0.5, 4, chunk=200, compute=64)
    run = _fresh(kernel=kernel)
    bf16, fp32, hdo, _, bind = run
    gen = torch.Generator().manual_seed(11)
    one_step(bf16, fp32, bind, hdo, 0, gen)
    one_step(bf16, fp32, bind, hdo, 1, gen)
    before = _snapshot(run)
    failing = _Failing(monkeypatch, at=1, kernel=kernel)
    state = gen.get_state()
    with pytest.raises(RuntimeError, match="injected failure"):
        one_step(bf16, fp32, bind, hdo, 2, gen)
    _assert_snapshot_equal(before, _snapshot(run))
    assert offload_internals.torn(hdo) is None
    # nothing in flight: the host has seen every copy to it complete, and the compute
    # stream is ordered after every copy back that was issued
    log = cpu_streams
    assert all(log.known_done(op) for op in log.copies if op.what.startswith("d2h"))
    assert all(log.compute.precedes(op) for op in log.copies if op.what.startswith("h2d"))
    failing.restore()
    gen.set_state(state)  # the same gradients again
    one_step(bf16, fp32, bind, hdo, 2, gen)
    one_step(bf16, fp32, bind, hdo, 3, gen)
    assert_same_run(plain, (bf16, fp32, hdo, run[3]))


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_step_failing_part_way_refuses_to_continue_until_a_load(cpu_streams, monkeypatch, kernel):
    run = _fresh(kernel=kernel)
    bf16, fp32, hdo, _, bind = run
    gen = torch.Generator().manual_seed(11)
    one_step(bf16, fp32, bind, hdo, 0, gen)
    saved = copy.deepcopy(hdo.state_dict())  # a checkpoint, not the live tensors
    log = cpu_streams
    before = len(log.copies)
    # torch: the 8th fused call is the GPU part's (every chunk went back); native: the
    # second chunk's (the first one updated)
    at = 8 if kernel == "torch" else 2
    failing = _Failing(monkeypatch, at=at, kernel=kernel)
    with pytest.raises(RuntimeError, match="injected failure"):
        one_step(bf16, fp32, bind, hdo, 1, gen)
    assert failing.calls == at
    # no copy left in flight, the ones back to the device included: the host has seen
    # every one complete
    assert any(op.what.startswith("h2d") for op in log.copies[before:])
    assert all(log.known_done(op) for op in log.copies)
    # and later device work (the next forward pass) is ordered after the copies back this
    # step issued, as at the end of a step that returns
    back = [op for op in log.copies[before:] if op.what.startswith("h2d")]
    assert all(log.compute.precedes(op) for op in back)
    log.step_ends()
    failing.restore()
    with pytest.raises(RuntimeError, match="failed part way .*load the last checkpoint"):
        one_step(bf16, fp32, bind, hdo, 1, gen)
    hdo.load_state_dict(saved)
    one_step(bf16, fp32, bind, hdo, 1, gen)
    steps = {float(s["step"]) for s in hdo.state.values() if "step" in s}
    assert steps == {2.0}


@pytest.mark.parametrize("kernel", KERNELS)
def test_step_counters_shared_between_parameters_advance_once(cpu_streams, kernel):
    """A state whose parameters share one ``step`` tensor (a loaded state can) trains as
    one with a counter each (torch's fused kernel advanced the shared one once per
    parameter before)."""
    plain = train(MirrorChunked, True, 1.0, 3, chunk=200, compute=64)
    run = _fresh(1.0, kernel)
    bf16, fp32, hdo, shard16, bind = run
    gen = torch.Generator().manual_seed(11)
    one_step(bf16, fp32, bind, hdo, 0, gen)
    states = [hdo.state[p] for g in hdo.param_groups for p in g["params"]]
    shared = states[0]["step"].clone()
    for s in states:
        s["step"] = shared
    one_step(bf16, fp32, bind, hdo, 1, gen)
    one_step(bf16, fp32, bind, hdo, 2, gen)
    assert {float(s["step"]) for s in states} == {3.0}
    assert_same_run(plain, (bf16, fp32, hdo, shard16))


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_step_reuses_its_views_and_bindings(cpu_streams, monkeypatch, kernel):
    """The views each fused call reads (torch) or the tasks the compiled kernel runs
    (native) are built at a chunk's first update and reused; a state still bound is not
    bound again."""
    bf16, fp32, hdo, _, bind = _fresh(kernel=kernel)
    gen = torch.Generator().manual_seed(11)
    one_step(bf16, fp32, bind, hdo, 0, gen)
    steppers = offload_internals.chunked(hdo).steppers

    def kept(s):
        return offload_internals.chunk_plans(s, kernel)

    plans = [{c: plan for c, (_, plan) in kept(s).items()} for s in steppers]
    assert all(plans)
    copies = []
    real_copy = torch.Tensor.copy_

    def counting(self, src, *args, **kwargs):
        copies.append(self.shape)
        return real_copy(self, src, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "copy_", counting)
        for s in steppers:
            s.bind_state()
    assert copies == []  # still bound: nothing copied in
    one_step(bf16, fp32, bind, hdo, 1, gen)
    for s, before in zip(steppers, plans, strict=True):
        assert all(kept(s)[c][1] is plan for c, plan in before.items())
        assert len(kept(s)) == len(s.chunks)
