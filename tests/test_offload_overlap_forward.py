"""The overlapped exact offload step ([Note: the overlapped exact step] in
``megatron_ext/offload/forward_waits.py``) inside a real training loop, on the CPU:
megatron-core's DDP and distributed optimizer (``tests/support/cpu_megatron.py``), each step
``zero_grad_buffer``, ``zero_grad``, forward and backward, ``finish_grad_sync``, ``step``.

The reference is the exact chunked step on a second, identical stack, which computes its own
forward and backward: each step's loss, norm and gradients, and what each model holds, must
equal it bit for bit. The host update of the overlapped run is slowed (a sleep per chunk), so
a forward pass that read a parameter before its chunk came back would read the last step's
value and change the loss; and the first layer's forward must begin before that update ends
(the overlap took place).
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

from megatron_ext.offload.chunked import OverlappedUpdate
from tests.support import offload_internals
from tests.support.megatron_mlp import BF16, CLIP, LR
from tests.support.megatron_ranks import rank_device, run_ranks, to_model
from tests.support.mlp_stack import adam_path

pytestmark = pytest.mark.mcore

pytest.importorskip("megatron.core")

H, LAYERS, BATCH, STEPS = 64, 4, 8, 4
SLEEP_S = 0.02  # per chunk of the overlapped run's host update


class Layer(torch.nn.Module):
    """A bf16 weight and bias and, marked keep_in_fp32, an fp32 gate (an island)."""

    def __init__(self, g: torch.Generator):
        super().__init__()
        self.w = torch.nn.Parameter((torch.randn(H, H, generator=g) * 0.2).to(BF16))
        self.b = torch.nn.Parameter((torch.randn(H, generator=g) * 0.2).to(BF16))
        self.gate = torch.nn.Parameter((torch.randn(H, generator=g) + 1).to(BF16))

    def forward(self, x):
        y = torch.tanh(x @ self.w.t() + self.b)
        return (y.float() * self.gate).to(BF16)


class Stack(torch.nn.Module):
    """Layers in order, then a head tied to the first layer's weight (read after that
    layer's forward, by the root module, which holds a natively fp32 scale of its own)."""

    def __init__(self):
        super().__init__()
        import megatron_ext

        g = torch.Generator().manual_seed(3)
        self.layers = torch.nn.ModuleList(Layer(g) for _ in range(LAYERS))
        self.scale = torch.nn.Parameter(torch.randn(H, generator=g))  # fp32
        for layer in self.layers:
            megatron_ext.mark_keep_in_fp32(layer.gate)

    def forward(self, x, t):
        for layer in self.layers:
            x = layer(x)
        y = (x @ self.layers[0].w).float() * self.scale
        return ((y - t) ** 2).sum() / BATCH


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, H, generator=g).to(BF16), torch.randn(BATCH, H, generator=g)


def build(overlap: bool, fraction: float, world: int, gather: bool = False, pa: bool = True):
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_ext

    module = Stack().to(rank_device())
    tcfg = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, bf16=True, params_dtype=BF16
    )
    ddp_config = megatron_ext.DistributedDataParallelConfig(
        per_dtype_grad_buffers=True,
        use_distributed_optimizer=True,
        overlap_param_gather=gather,
        overlap_grad_reduce=gather,
        bucket_size=4096 if gather else None,
    )
    model = megatron_ext.DistributedDataParallel(tcfg, ddp_config, module)
    ocfg = OptimizerConfig(
        optimizer="adam", lr=LR, clip_grad=CLIP, bf16=True, use_distributed_optimizer=True,
        optimizer_cpu_offload=True, optimizer_offload_fraction=fraction,
        use_precision_aware_optimizer=pa, overlap_param_gather=gather,
    )  # fmt: skip
    options = megatron_ext.MegatronOptions(
        offload_overlap_forward=overlap, offload_chunk_numel=1024
    )
    return model, megatron_ext.get_megatron_optimizer(ocfg, [model], options=options)


def _held(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def _grads(model) -> list[torch.Tensor]:
    return [b.grad_data.clone() for b in model.all_grad_buffers()]


def overlap_loop_job(rank, world, log, out_dir, fraction, gather):
    import threading

    import megatron_ext
    from megatron_ext.offload.step import ChunkedAdamW

    with adam_path("torch+offload"):  # megatron-core's placement, as on a device
        ours, ours_opt = build(True, fraction, world, gather)
        ref, ref_opt = build(False, fraction, world, gather)
    update = ChunkedAdamW.update
    ended: list[float] = []  # when each chunk of an overlapped update ended

    def slowed(self, *a, **k):
        if threading.current_thread().name == "megatron_ext-offload-update":
            time.sleep(SLEEP_S)
            out = update(self, *a, **k)
            ended.append(time.perf_counter())
            return out
        return update(self, *a, **k)

    began: list[float] = []  # when each forward pass of the first layer began
    ours.module.layers[0].register_forward_pre_hook(lambda m, a: began.append(time.perf_counter()))
    ChunkedAdamW.update = slowed
    out = []
    try:
        for s in range(STEPS):
            row = {}
            for name, model, opt in (("ours", ours, ours_opt), ("ref", ref, ref_opt)):
                model.zero_grad_buffer()
                opt.zero_grad()
                loss = model(*to_model(model, *batch(rank, s)))
                loss.backward()
                model.finish_grad_sync()
                grads = _grads(model)
                ok, norm, _ = opt.step()
                row[name] = (loss.detach().clone(), grads, ok, float(norm))
            (hdo,) = [c.optimizer for c in ours_opt.chained_optimizers]
            row["in_flight"] = offload_internals.in_flight(hdo) is not None
            row["chunks"] = len(offload_internals.chunked(hdo).copies)
            out.append(row)
        megatron_ext.drain_offload(ours_opt)
        # the forward of the step after the last: only once its update has ended
        loss = ours(*to_model(ours, *batch(rank, STEPS)))
        ref_loss = ref(*to_model(ref, *batch(rank, STEPS)))
        out.append(
            dict(
                final=(loss.detach(), ref_loss.detach()),
                held=(_held(ours), _held(ref)),
                began=began,
                ended=ended,
            )
        )
    finally:
        ChunkedAdamW.update = update
    return out


def refusals_job(rank, world, log, out_dir):
    from megatron_ext.offload import attach_host_mirrors

    out = []
    with adam_path("torch+offload"):
        try:
            build(True, 1.0, world, pa=False)
        except ValueError as error:
            out.append(str(error))
        model, opt = build(False, 1.0, world)
    (child,) = opt.chained_optimizers
    for kwargs in (
        dict(chunked_step=False),
        dict(chunked_step=True, delayed_update=True),
        dict(chunked_step=True),  # no model chunks
    ):
        try:
            attach_host_mirrors(child, overlap_forward=True, **kwargs)
        except ValueError as error:
            out.append(str(error))
    for field, value in (
        ("cuda_graph_impl", "local"),
        ("enable_cuda_graph", True),
        ("external_cuda_graph", True),
    ):
        config = model.config
        before = getattr(config, field)
        setattr(config, field, value)
        try:
            attach_host_mirrors(
                child, chunked_step=True, overlap_forward=True, model_chunks=[model]
            )
        except ValueError as error:
            out.append(str(error))
        finally:
            setattr(config, field, before)
    return out


def test_the_overlapped_step_refuses_what_it_cannot_wait_for(tmp_path):
    (errors,) = run_ranks(tmp_path, 1, refusals_job)
    assert len(errors) == 7, errors
    assert "needs use_precision_aware_optimizer=True" in errors[0]
    assert "use offload_step='chunked'" in errors[1]
    assert "choose one" in errors[2]
    assert "needs the model chunks" in errors[3]
    assert all("a replayed CUDA graph skips" in e for e in errors[4:]), errors[4:]


def _check(rows) -> None:
    *steps, last = rows
    for s, row in enumerate(steps):
        (loss, grads, ok, norm), (rloss, rgrads, rok, rnorm) = row["ours"], row["ref"]
        assert torch.equal(loss, rloss), (s, loss, rloss)
        assert all(torch.equal(a, b) for a, b in zip(grads, rgrads, strict=True)), s
        assert (ok, norm) == (rok, rnorm), s
        assert row["in_flight"], s  # the step returned with its host update running
    assert torch.equal(*last["final"])
    ours, ref = last["held"]
    assert ours.keys() == ref.keys()
    differ = [n for n in ours if not torch.equal(ours[n], ref[n])]
    assert not differ, differ


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_the_overlapped_step_gives_the_exact_steps_bits_and_overlaps_the_forward(
    tmp_path, fraction
):
    (rows,) = run_ranks(tmp_path, 1, overlap_loop_job, fraction, False)
    _check(rows)
    # every forward after the first began while the last step's host update still ran:
    # before the last chunk of the update launched at the step before ended
    *steps, last = rows
    n = steps[0]["chunks"]
    assert n > LAYERS and all(r["chunks"] == n for r in steps)
    assert len(last["ended"]) == STEPS * n and len(last["began"]) == STEPS + 1
    for s in range(1, STEPS):
        assert last["began"][s] < last["ended"][s * n - 1], s
    # after drain_offload, the forward began once the last update had ended
    assert last["began"][STEPS] > last["ended"][-1]


@pytest.mark.parametrize("gather", [False, True], ids=["gather_in_step", "gather_in_forward"])
def test_two_ranks_gather_each_bucket_after_its_chunks(tmp_path, gather):
    for rows in run_ranks(tmp_path, 2, overlap_loop_job, 1.0, gather):
        _check(rows)


# The same step in the simulation of ``tests/support/offload_sim.py`` (two buffers, islands,
# megatron-core's placement), with the recording streams checking every copy's order: the
# device holds what AdamW applied at once gives (the reference of
# ``tests/support/delayed_model.py``, exact), once a forward pass has waited for every chunk.


def _sim(fraction: float):
    from megatron_ext.offload.forward_waits import ForwardWaits
    from tests.support.delayed_model import Model
    from tests.support.offload_sim import MirrorChunked

    class MirrorOverlap(MirrorChunked):
        overlap_forward = True

    model = Model(True, fraction, cls=MirrorOverlap)
    offload_internals.set_forward_waits(model.hdo, ForwardWaits(model.hdo, []))
    return model


def _forward(model, log) -> None:
    """What a forward pass over every parameter waits for, in update order; then it reads."""
    flight = offload_internals.in_flight(model.hdo)
    assert isinstance(flight, OverlappedUpdate)
    for position in range(len(flight.plan.copies)):
        model.hdo.await_chunk(position)
    log.forward_reads()


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_the_simulated_overlapped_step_orders_its_copies_and_equals_adamw(cpu_streams, fraction):
    from tests.support.delayed_model import Reference, assert_device, assert_state, grad_dtypes

    model = _sim(fraction)
    ref = Reference(model, delayed=False, warmup=0)
    gen = torch.Generator().manual_seed(3)
    for step in range(4):
        grads = ref.grads(gen, grad_dtypes(model))
        model.set_grads(grads, step)
        ref.step(grads, step)
        model.hdo.step()
        _forward(model, cpu_streams)
        assert_device(model, ref, step)
    assert model.hdo.drain() and offload_internals.in_flight(model.hdo) is None
    assert_state(model, ref)
    assert cpu_streams.checks > 0


def test_the_forward_pass_may_not_read_before_its_chunks_came_back(cpu_streams):
    """Without the waits the recording streams see the read before the copies."""
    from tests.support.delayed_model import _grads_of
    from tests.support.streams import OrderError

    model = _sim(1.0)
    model.set_grads(_grads_of(model, torch.Generator().manual_seed(1)), 0)
    model.hdo.step()
    offload_internals.in_flight(model.hdo).thread.join()  # every copy back issued, none waited for
    with pytest.raises(OrderError, match="forward pass reads parameters before"):
        cpu_streams.forward_reads()
    model.hdo.drain()
    cpu_streams.forward_reads()  # a drain orders the compute stream after every copy


def test_state_dict_and_load_state_dict_land_or_drop_the_overlapped_update(cpu_streams):
    from tests.support.delayed_model import _grads_of

    model = _sim(1.0)
    gen = torch.Generator().manual_seed(2)
    model.set_grads(_grads_of(model, gen), 0)
    model.hdo.step()
    saved = copy.deepcopy(model.hdo.state_dict())  # lands it: every step it counts
    assert offload_internals.in_flight(model.hdo) is None
    assert {float(s["step"]) for s in saved["state"].values() if "step" in s} == {1.0}
    model.set_grads(_grads_of(model, gen), 1)
    model.hdo.step()
    model.hdo.load_state_dict(saved)
    assert offload_internals.in_flight(model.hdo) is None and not model.hdo.drain()
    # what loads the parameters on the compute stream comes after the worker's copies back
    cpu_streams.forward_reads()
    assert {float(s["step"]) for s in model.hdo.state.values() if "step" in s} == {1.0}


def test_a_failing_overlapped_update_is_raised_where_the_forward_waits(cpu_streams, monkeypatch):
    """The forward pass's wait for a chunk the worker did not reach raises; the landing
    raises the worker's error; the optimizer then refuses to step until a load."""
    from tests.support.delayed_model import (
        _grads_of,
        fail_at_the_second_update,
        refuses_until_loaded,
    )

    model = _sim(1.0)
    gen = torch.Generator().manual_seed(1)
    model.set_grads(_grads_of(model, gen), 0)
    model.hdo.step()
    saved = copy.deepcopy(model.hdo.state_dict())
    real = fail_at_the_second_update(monkeypatch)
    model.set_grads(_grads_of(model, gen), 1)
    model.hdo.step()
    model.hdo.await_chunk(0)  # the chunk it updated
    with pytest.raises(RuntimeError, match="host update failed before") as raised:
        model.hdo.await_chunk(1)
    assert "injected failure" in str(raised.value.__cause__)
    with pytest.raises(RuntimeError, match="injected failure"):
        model.hdo.step()
    # no copy left in flight, the chunk the worker sent back included (the staging is free)
    assert any(op.what.startswith("h2d") for op in cpu_streams.copies)
    assert all(cpu_streams.known_done(op) for op in cpu_streams.copies)
    refuses_until_loaded(model, monkeypatch, real, saved)


def test_a_views_bytes_span_its_extent_in_its_storage():
    from megatron_ext.offload.forward_waits import device_bytes

    base = torch.zeros(4, 6)
    storage = base.untyped_storage().data_ptr()
    assert device_bytes(base) == (storage, 0, 96)
    assert device_bytes(base[1]) == (storage, 24, 48)
    assert device_bytes(base.t()) == (storage, 0, 96)  # not contiguous: the same bytes
    assert device_bytes(base[1:3, 2:4]) == (storage, (6 + 2) * 4, (2 * 6 + 4) * 4)
    assert device_bytes(base[:, 5]) == (storage, 20, 96)
    assert device_bytes(base[2:2]) == (storage, 48, 48)


class _BucketGroup:
    """A stand-in for megatron-core's bucket group: only what the waits wrap."""

    def start_param_sync(self, *args, **kwargs):
        return "gathered"


def test_a_second_optimizers_waits_replace_the_first_ones_and_free_it(cpu_streams):
    """Waits installed for a second optimizer on the same model chunk take the first one's
    pre-hooks and all-gather wrapper off (one set, not two stacked), and hold nothing that
    keeps the first optimizer or its host mirrors alive; freeing an optimizer takes its
    waits off the model."""
    import gc
    import weakref

    from megatron_ext.offload.forward_waits import ForwardWaits

    chunk = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    group = _BucketGroup()
    chunk.bucket_groups = [group]

    def hooks() -> list[int]:
        return [len(m._forward_pre_hooks) for m in chunk]

    first = _sim(1.0)
    ForwardWaits(first.hdo, [chunk])
    assert hooks() == [1, 1] and "start_param_sync" in group.__dict__
    first_mirror = weakref.ref(first.hdo.host_mirrors[0].staging)
    second = _sim(1.0)
    second_waits = ForwardWaits(second.hdo, [chunk])
    assert hooks() == [1, 1]
    # the group's wait is the second's own, over the class's method (not over the first's)
    assert group.start_param_sync() == "gathered"
    assert group.__dict__["start_param_sync"].__closure__ is not None
    assert second_waits.wrapped == [(group, None)]
    del first
    gc.collect()
    assert first_mirror() is None, "the first optimizer's host mirror is still alive"
    del second, second_waits
    gc.collect()
    assert hooks() == [0, 0] and "start_param_sync" not in group.__dict__
