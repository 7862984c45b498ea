"""The delayed offloaded update ([Note: the delayed offloaded update] in
``megatron_ext/offload/chunked.py``), on the CPU: what the "device" holds after every step
equals, bit for bit, a plainly written loop that applies AdamW to the host-updated
parameters one step late and to the GPU-resident ones at once.

The reference is written without the code under test: one ``torch.optim.AdamW(fused=True)``
per parameter (the kernel megatron-core's per-parameter offload step runs), a dict of what
the device holds, and the delay as a pending dict landed at the next step that runs. The
gradients depend on what the device holds when they are computed (a stand-in for forward
and backward), so a step that read other parameters than the delay promises changes them.
Which parameters the host updates is megatron-core's greedy placement (the simulation's).
"""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_ext import drain_offload
from tests.support import offload_internals
from tests.support.delayed_model import (
    MirrorDelayed,
    Model,
    Reference,
    _grads_of,
    assert_device,
    assert_state,
    fail_at_the_second_update,
    grad_dtypes,
    refuses_until_loaded,
)
from tests.support.offload_sim import MirrorChunked

pytestmark = pytest.mark.mcore


def run(model: Model, ref: Reference, steps: range, skip=(), gen=None, check=True):
    gen = gen or torch.Generator().manual_seed(3)
    for step in steps:
        grads = ref.grads(gen, grad_dtypes(model))
        model.set_grads(grads, step)
        if step in skip:  # megatron-core returns before the inner step (inf, threshold)
            continue
        ref.step(grads, step)
        model.hdo.step()
        if check:
            assert_device(model, ref, step)
    return gen


@pytest.mark.parametrize("pa", [True, False], ids=["pa", "main-shards"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_delayed_update_equals_adamw_applied_one_step_late(cpu_streams, fraction, pa):
    """Two exact steps, then every host-updated parameter one step late (GPU-resident ones
    at once), an lr schedule, a skipped step (nothing lands: the update in flight waits for
    the next step that runs), natively fp32 parameters beside bf16; then a drain lands the
    last update. Device values after every step, and the optimizer state, bit for bit."""
    model = Model(pa, fraction)
    ref = Reference(model, delayed=True, warmup=MirrorDelayed.delay_warmup)
    assert any(ref.late.values()) and (fraction == 1.0) == all(ref.late.values())
    run(model, ref, range(8), skip={5})
    assert offload_internals.in_flight(model.hdo) is not None
    assert model.hdo.drain() and not model.hdo.drain()
    ref.land()
    assert_device(model, ref, "drained")
    assert_state(model, ref)


@pytest.mark.parametrize("pa", [True, False], ids=["pa", "main-shards"])
def test_gradients_cross_to_the_host_while_parameters_cross_back(cpu_streams, pa):
    """A delayed step's copies to the host wait for the gradients (the compute stream's
    work before the step), not for the copies back that landing the previous update
    issues: the parameters leave from staging bytes of their own, so both directions run
    at once. The exact step keeps one staging (its copies are not concurrent)."""
    model = Model(pa, 1.0)
    ref = Reference(model, delayed=True, warmup=MirrorDelayed.delay_warmup)
    run(model, ref, range(5))
    mirrors = model.hdo.host_mirrors
    assert all(m.param_staging is not None for m in mirrors)
    assert all(m.stats()["param_staging_bytes"] == m.param_staging.numel() for m in mirrors)
    chunks = len(offload_internals.chunked(model.hdo).copies)
    h2d = [op for op in cpu_streams.copies if op.what.startswith("h2d")]
    d2h = [op for op in cpu_streams.copies if op.what.startswith("d2h")]
    landed, sent = h2d[-chunks:], d2h[-chunks:]  # the last step's, both ways
    assert len({op.stream for op in landed}) == len({op.stream for op in sent}) == 1
    assert landed[0].stream is not sent[0].stream
    assert all(op.after.get(landed[0].stream, 0) < landed[0].index for op in sent)
    # and the copies of an exact step (the warm-up) still wait, sharing one staging
    exact = Model(pa, 1.0, cls=MirrorChunked)
    assert all(m.param_staging is None for m in exact.hdo.host_mirrors)
    landed = model.hdo.last_landed
    assert landed is not None and landed.worker_s > 0 and landed.wait_s >= 0


def test_the_delay_is_seen_and_the_exact_step_is_not_delayed(cpu_streams):
    """The same loop with the reference's delay removed fails on the delayed optimizer,
    and the exact chunked step equals the reference without delay: the test tells them
    apart."""
    model = Model(True, 1.0)
    undelayed = Reference(model, delayed=False, warmup=0)
    with pytest.raises(AssertionError):
        run(model, undelayed, range(5))
    model = Model(True, 1.0, cls=MirrorChunked)
    ref = Reference(model, delayed=False, warmup=0)
    run(model, ref, range(5))
    assert_state(model, ref)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_state_dict_drains_and_a_resumed_run_continues_bit_for_bit(cpu_streams, fraction):
    """A checkpoint mid-run lands the update in flight (it holds every update its step
    says); a fresh optimizer over fresh buffers loaded from it continues exactly as the
    uninterrupted delayed run that took the same checkpoint, past the warm-up (a resumed
    run does not warm up again)."""
    model = Model(True, fraction)
    ref = Reference(model, delayed=True, warmup=MirrorDelayed.delay_warmup)
    gen = run(model, ref, range(5))
    assert offload_internals.in_flight(model.hdo) is not None
    saved = copy.deepcopy(model.hdo.state_dict())  # the live tensors go on changing
    assert offload_internals.in_flight(model.hdo) is None
    ref.land()
    assert_device(model, ref, "saved")
    params = (model.bf16.param_data.clone(), model.fp32.param_data.clone())
    state = gen.get_state()
    run(model, ref, range(5, 9), gen=gen)

    resumed = Model(True, fraction)
    resumed.bf16.param_data.copy_(params[0])
    resumed.fp32.param_data.copy_(params[1])
    resumed.hdo.load_state_dict(saved)
    gen = torch.Generator()
    gen.set_state(state)
    for step in range(5, 9):
        resumed.set_grads(_grads_of(resumed, gen), step)
        resumed.hdo.step()
    assert (
        offload_internals.in_flight(resumed.hdo) is not None
    )  # delayed at once: the warm-up is behind
    for m in (model, resumed):
        m.hdo.drain()
    for n in model.inner:
        assert torch.equal(model.device(n), resumed.device(n)), n
    for n, p in model.inner.items():
        a, b = model.hdo.state[p], resumed.hdo.state[resumed.inner[n]]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), (n, key)


def test_a_failing_host_update_is_raised_at_the_next_step(cpu_streams, monkeypatch):
    """An error on the host worker leaves no copy in flight, is raised where the update
    would land, and the optimizer then refuses to step until a checkpoint is loaded."""

    model = Model(True, 1.0)
    model.hdo.delay_warmup = 1
    gen = torch.Generator().manual_seed(1)
    model.set_grads(_grads_of(model, gen), 0)
    model.hdo.step()  # exact
    saved = copy.deepcopy(model.hdo.state_dict())
    real = fail_at_the_second_update(monkeypatch)
    model.set_grads(_grads_of(model, gen), 1)
    model.hdo.step()  # launched; the worker fails on its second chunk
    model.set_grads(_grads_of(model, gen), 2)
    with pytest.raises(RuntimeError, match="injected failure"):
        model.hdo.step()
    assert all(cpu_streams.known_done(op) for op in cpu_streams.copies)
    refuses_until_loaded(model, monkeypatch, real, saved)


@pytest.mark.parametrize("mode", ["delayed", "overlapped"])
def test_a_failing_gpu_resident_step_leaves_no_copy_to_the_host_in_flight(
    cpu_streams, monkeypatch, mode
):
    """The GPU-resident part fails after the step issued its gradients' copies to the host
    and before its worker started: every one of those copies is complete when the error
    leaves (the host may free or reuse the staging), and no worker runs."""
    from tests.support.offload_sim import MirrorChunked

    class MirrorOverlap(MirrorChunked):
        overlap_forward = True

    model = Model(True, 0.5, cls=MirrorOverlap) if mode == "overlapped" else Model(True, 0.5)
    model.hdo.delay_warmup = 0
    assert model.hdo.gpu_optimizer is not None  # fraction 0.5: a GPU-resident part

    def broken(*args, **kwargs):
        raise RuntimeError("injected GPU step failure")

    monkeypatch.setattr(model.hdo.gpu_optimizer, "step", broken)
    model.set_grads(_grads_of(model, torch.Generator().manual_seed(5)), 0)
    with pytest.raises(RuntimeError, match="injected GPU step failure"):
        model.hdo.step()
    to_host = [op for op in cpu_streams.copies if op.what.startswith(("d2h", "island d2h"))]
    assert to_host and all(cpu_streams.known_done(op) for op in to_host)
    assert offload_internals.in_flight(model.hdo) is None


def test_load_state_dict_drops_the_update_in_flight(cpu_streams):
    """A load while an update is in flight waits for it and drops it: the loaded state
    and parameters are what the next step starts from."""
    model = Model(True, 1.0)
    model.hdo.delay_warmup = 1
    gen = torch.Generator().manual_seed(2)
    model.set_grads(_grads_of(model, gen), 0)
    model.hdo.step()  # exact
    saved = copy.deepcopy(model.hdo.state_dict())
    before = {n: model.device(n).clone() for n in model.inner}
    model.set_grads(_grads_of(model, gen), 1)
    model.hdo.step()
    assert offload_internals.in_flight(model.hdo) is not None
    model.hdo.load_state_dict(saved)
    assert offload_internals.in_flight(model.hdo) is None
    assert not model.hdo.drain()
    for n in model.inner:  # nothing landed on the device
        assert torch.equal(model.device(n), before[n]), n
    steps = {float(s["step"]) for s in model.hdo.state.values() if "step" in s}
    assert steps == {1.0}
    model.hdo.step()  # from the loaded state, past the warm-up: delayed
    assert offload_internals.in_flight(model.hdo) is not None


def test_drain_offload_lands_every_child(cpu_streams):
    """``megatron_ext.drain_offload`` over a chain: each child's update lands, then its
    main parameters are copied into the model's (megatron-core's own method)."""
    models = [Model(True, 1.0), Model(True, 0.5)]
    copied = []

    class Child:
        def __init__(self, hdo):
            self.optimizer = hdo

        def _copy_main_params_to_model_params(self):
            copied.append(self)

    class Chain:
        chained_optimizers = [Child(m.hdo) for m in models]

    gen = torch.Generator().manual_seed(4)
    for m in models:
        m.hdo.delay_warmup = 0
        m.set_grads(_grads_of(m, gen), 0)
        m.hdo.step()
    assert drain_offload(Chain) == 2 and copied == Chain.chained_optimizers
    assert drain_offload(Chain) == 0 and len(copied) == 2


def test_the_offload_phases_are_named_ranges_in_a_profile(cpu_streams):
    """A profile of the offloaded steps shows each phase by name: the exact step, and with
    the delayed update its launch and, at the next step (or a drain), its landing."""
    from torch.profiler import ProfilerActivity, profile

    def ranges(fn) -> list[str]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        names = [e.name for e in prof.events() if e.name.startswith("megatron_ext::offload")]
        return sorted(set(names) - {"megatron_ext::offload_host_update"})  # the worker's

    model = Model(True, 1.0)
    gen = torch.Generator().manual_seed(5)
    model.set_grads(_grads_of(model, gen), 0)
    assert ranges(model.hdo.step) == ["megatron_ext::offload_exact_step"]  # the warm-up
    model.hdo.delay_warmup = 0
    model.set_grads(_grads_of(model, gen), 1)
    assert ranges(model.hdo.step) == ["megatron_ext::offload_launch"]
    model.set_grads(_grads_of(model, gen), 2)
    assert ranges(model.hdo.step) == ["megatron_ext::offload_land", "megatron_ext::offload_launch"]
    assert ranges(model.hdo.drain) == ["megatron_ext::offload_land"]


def test_the_thread_tuner_adds_threads_when_landing_waits_and_drops_them_when_idle():
    from megatron_ext.offload.threads import ThreadTuner

    tuner = ThreadTuner(threads=8, low=3, high=12)
    # waited 5 ms of a 100 ms window: a quarter more, then capped at high
    assert tuner.landed(worker_s=0.105, wait_s=0.005, window_s=0.1) == 10
    assert tuner.landed(0.105, 0.005, 0.1) == 12
    assert tuner.landed(0.105, 0.005, 0.1) == 12
    # a wait under 1 ms, or under 1% of the window, is none; the worker used 90% of the
    # window (over the 75% slack): kept
    assert tuner.landed(0.09, 0.0009, 0.1) == 12
    assert tuner.landed(0.9, 0.009, 1.0) == 12
    # ended inside 75% of its window: one fewer each time, down to low
    assert [tuner.landed(0.05, 0.0, 0.1) for _ in range(11)] == [11, 10, 9, 8, 7, 6, 5, 4, 3, 3, 3]
    one = ThreadTuner(threads=1, low=1, high=2)
    assert one.landed(0.2, 0.1, 0.1) == 2  # a quarter of 1 rounds down: still one more


def test_for_host_starts_at_every_core_but_one(monkeypatch):
    from megatron_ext.offload import threads

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    assert threads.ThreadTuner.for_host() == threads.ThreadTuner(15, 4, 16)
    monkeypatch.setattr(threads, "usable_cores", lambda: 1)
    assert threads.ThreadTuner.for_host() == threads.ThreadTuner(1, 1, 1)
    # two delayed updates at once on the rank (two offloading optimizers in a chain): eight
    # cores each; three: five each
    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    assert threads.ThreadTuner.for_host(2) == threads.ThreadTuner(7, 2, 8)
    assert threads.ThreadTuner.for_host(3) == threads.ThreadTuner(4, 1, 5)
    assert threads.ThreadTuner.for_host(32) == threads.ThreadTuner(1, 1, 1)


def test_for_host_bounds_the_threads_by_the_pinned_cpus(monkeypatch):
    from megatron_ext.offload import threads

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    pinned = frozenset(range(1, 16))
    # fifteen CPUs for the worker: at most fifteen threads (sixteen would take turns)
    assert threads.ThreadTuner.for_host(1, pinned) == threads.ThreadTuner(15, 4, 15)
    assert threads.ThreadTuner.for_host(2, pinned) == threads.ThreadTuner(7, 2, 7)
    assert threads.ThreadTuner.for_host(1, frozenset({3})) == threads.ThreadTuner(1, 1, 1)


@pytest.mark.parametrize(
    ("affinity", "ranks", "rank", "want"),
    [
        (range(16), None, None, range(16)),  # one rank: every CPU
        (range(16), "4", "2", range(8, 12)),  # the third of four ranks: the third quarter
        (range(16), "4", "3", range(12, 16)),
        (range(16), "3", "2", range(10, 15)),  # 16 // 3 = 5 each
        (range(4, 10), "4", "1", range(4, 10)),  # the launcher gave this rank its own: those
        (range(16), "32", "20", [4]),  # more ranks than CPUs: one each, in turn
        (range(16), "x", "0", range(16)),  # not a number: not read
        (range(16), "4", "y", range(4)),  # a rank that is not a number: the first run
        ([3, 1, 7], None, None, [1, 3, 7]),  # in order
    ],
)
def test_each_rank_pins_its_worker_to_its_own_cpus_but_one(
    monkeypatch, affinity, ranks, rank, want
):
    from megatron_ext.offload import threads

    for name, value in (("LOCAL_WORLD_SIZE", ranks), ("LOCAL_RANK", rank)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(affinity), raising=False)
    monkeypatch.setattr(threads.os, "sched_setaffinity", lambda pid, c: None, raising=False)
    assert threads.rank_cores() == list(want)
    assert len(threads.rank_cores()) == threads.cores_per_rank() or ranks == "32"
    workers = threads.worker_cpus()
    assert workers == (frozenset(list(want)[1:]) if len(list(want)) > 1 else None)


def test_nothing_is_pinned_where_the_platform_cannot_pin(monkeypatch):
    from megatron_ext.offload import threads

    monkeypatch.delattr(threads.os, "sched_setaffinity", raising=False)
    assert threads.worker_cpus() is None


def test_without_an_affinity_to_read_the_rank_has_every_cpu(monkeypatch):
    from megatron_ext.offload import threads

    def unreadable(pid):
        raise OSError("no affinity here")

    monkeypatch.setattr(threads.os, "sched_getaffinity", unreadable, raising=False)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert threads.rank_cores() == list(range(6))


@pytest.mark.parametrize(
    ("ranks", "usable", "want"),
    [
        ("1", 16, 16),  # one rank: every core
        ("4", 16, 4),  # four ranks share the host's 16: four each
        ("32", 16, 1),  # more ranks than cores: one each
        ("4", 6, 6),  # the launcher gave this rank 6 cores of its own: those
        ("x", 16, 16),  # not a number: not read
        (None, 16, 16),  # not launched by torchrun
    ],
)
def test_a_rank_shares_the_host_cores_with_the_others_on_it(monkeypatch, ranks, usable, want):
    from megatron_ext.offload import threads

    if ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(threads, "usable_cores", lambda: usable)
    assert threads.cores_per_rank() == want
    assert threads.delayed_update_threads() == max(1, want - 1)
    assert threads.ThreadTuner.for_host().high == want


def test_the_worker_threads_follow_the_time_each_update_had(cpu_streams, monkeypatch):
    """A slow host update stepped back to back makes landing wait: the next updates get
    more threads; given time to spare, fewer. The parameters stay the reference's bit for
    bit throughout (the thread count changes no result)."""
    import time

    from megatron_ext.offload.step import ChunkedAdamW
    from megatron_ext.offload.threads import ThreadTuner

    model = Model(True, 1.0)
    ref = Reference(model, delayed=True, warmup=MirrorDelayed.delay_warmup)
    model.hdo.thread_tuner = ThreadTuner(threads=2, low=1, high=6)
    model.hdo.cpu_threads = 2
    real = ChunkedAdamW.update
    slow = [True]

    def update(self, chunk, copies=None):
        if slow[0]:
            time.sleep(0.005)
        return real(self, chunk, copies)

    monkeypatch.setattr(ChunkedAdamW, "update", update)
    gen = torch.Generator().manual_seed(9)
    used = []
    for step in range(14):
        slow[0] = step < 8
        grads = ref.grads(gen, grad_dtypes(model))
        model.set_grads(grads, step)
        ref.step(grads, step)
        if not slow[0]:
            time.sleep(0.3)  # the forward and backward of a long step
        model.hdo.step()
        assert_device(model, ref, step)
        landed = model.hdo.last_landed
        used.append(None if landed is None else landed.threads)
    # steps 0-1 exact, 2 the first launch: landings from step 3 on, each with its threads
    assert used[:3] == [None, None, None]
    # landings 3-7 waited (back to back): a quarter more (at least one), up to high; from 8
    # on each update had time to spare: one fewer, down to low
    chunks = len(offload_internals.chunked(model.hdo).copies)
    assert chunks * 0.005 < 0.75 * 0.3  # a slow update still ends well inside 0.3 s
    assert used[3:] == [2, 3, 4, 5, 6, 6, 5, 4, 3, 2, 1]
    assert model.hdo.cpu_threads == 1
    model.hdo.drain()
    ref.land()
    assert_device(model, ref, "drained")
    assert_state(model, ref)


def test_a_mirror_sharing_its_staging_still_orders_the_delayed_copies(cpu_streams):
    """Mirrors built for the exact step (one staging for gradients and parameters) then
    stepped delayed: the copies to the host must wait for the copies back out of the same
    bytes (the stream checker raises at the copy otherwise); the device values stay the
    one-step-late reference's."""
    model = Model(True, 1.0, cls=MirrorChunked)
    assert all(m.param_staging is None for m in model.hdo.host_mirrors)
    model.hdo.delayed_update, model.hdo.delay_warmup = True, 2
    ref = Reference(model, delayed=True, warmup=2)
    run(model, ref, range(5))
    assert offload_internals.chunked(model.hdo).shared_staging
    model.hdo.drain()
    ref.land()
    assert_device(model, ref, "drained")
