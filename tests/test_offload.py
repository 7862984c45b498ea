"""Host mirrors for CPU offload, on the CPU: layout, schedule, copies, bytes, and the step.

Pinned memory and megatron-core's DDP need CUDA (``tests/gpu/test_offload_gpu.py``). Here
the "device" is the CPU: the layout and schedule are pure data, the mirrors are built
unpinned, and megatron-core's own ``HybridDeviceOptimizer`` runs with its CUDA streams and
events replaced by no-ops over hand-made shard parameters, against its stock per-parameter
path.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

from buffers.spans import (
    Span,
    dp_shard_spans,
    intersect_spans,
    merge_spans,
    subtract_spans,
    to_local,
)
from megatron_ext import offload
from megatron_ext.layout import buffer_layout
from megatron_ext.offload import HostMirrorHybridOptimizer
from megatron_ext.offload.host_mirror import build_buffer_mirror
from megatron_ext.offload.plan import MirrorLayout, copy_schedule, mirror_layout, offload_blocks
from tests.support import offload_internals, streams
from tests.support.offload_sim import (
    FP32_SHAPES,
    SHAPES,
    MirrorChunked,
    MirrorChunkedNative,
    MirrorChunkedOnDevice,
    MirrorChunkedOnDeviceNative,
    MirrorChunkedOnDeviceTorch,
    MirrorChunkedTorch,
    MirrorPlaced,
    MirrorPlacedOnDevice,
    SimBuffer,
    StockPlaced,
    assert_adamw_in_fp64_terms,
    assert_same_run,
    assert_same_state,
    fp64_run,
    make_hdo,
    placement,
    sim,
    train,
    train_switching,
)

ROOT = Path(__file__).resolve().parents[1]
FP64 = torch.float64

# ---------------------------------------------------------------------------------------
# Layout


def S(a, b):
    return Span(a, b)


def test_all_offloaded_gives_one_block_per_owned_range():
    # params at 64-aligned starts with padding between; two owned ranges (two buckets)
    owned = [S(0, 256), S(512, 768)]
    params = [S(0, 40), S(64, 200), S(512, 600), S(640, 700)]
    assert offload_blocks(owned, params, []) == (S(0, 200), S(512, 700))


def test_resident_params_cut_blocks_and_padding_is_bridged():
    owned = [S(0, 1024)]
    offloaded = [S(0, 40), S(64, 100), S(320, 400), S(448, 500)]
    resident = [S(128, 300)]
    # [0, 100) bridges the padding 40..64; the resident param splits the rest off
    assert offload_blocks(owned, offloaded, resident) == (S(0, 100), S(320, 500))


def test_blocks_reject_bad_input():
    with pytest.raises(ValueError, match="outside"):
        offload_blocks([S(0, 10)], [S(5, 20)], [])
    with pytest.raises(ValueError, match="both"):
        offload_blocks([S(0, 100)], [S(0, 50)], [S(40, 60)])


@st.composite
def inventories(draw):
    """Parameters at 64-aligned starts in one or two buckets; one rank's shards of them."""
    sizes = draw(st.lists(st.integers(1, 300), min_size=1, max_size=12))
    dp = draw(st.sampled_from([1, 2, 3, 4]))
    cut = draw(st.integers(0, len(sizes)))  # parameters before it are in bucket 0
    spans, buckets, start, bucket_start = [], [], 0, 0
    for i, n in enumerate([*sizes, None]):
        if i in (cut, len(sizes)) and start > bucket_start:
            end = bucket_start + -(-(start - bucket_start) // (dp * 8)) * dp * 8
            buckets.append(S(bucket_start, end))
            start = bucket_start = end
        if n is not None:
            spans.append(S(start, start + n))
            start = -(-(start + n) // 64) * 64
    rank = draw(st.integers(0, dp - 1))
    owned = merge_spans(dp_shard_spans(buckets, dp, rank))
    shards = [s for p in spans for s in intersect_spans([p], owned)]
    on_cpu = draw(st.lists(st.booleans(), min_size=len(shards), max_size=len(shards)))
    return owned, shards, on_cpu


@settings(max_examples=300, deadline=None)
@given(inventories())
def test_blocks_cover_offloaded_and_never_resident(inv):
    owned, shards, on_cpu = inv
    offloaded = [s for s, c in zip(shards, on_cpu, strict=True) if c]
    resident = [s for s, c in zip(shards, on_cpu, strict=True) if not c]
    layout = mirror_layout(owned, offloaded, resident)
    blocks = layout.blocks
    assert all(a.end <= b.start for a, b in zip(blocks, blocks[1:], strict=False))
    assert not intersect_spans(blocks, resident)
    assert not subtract_spans(blocks, owned)
    for b in blocks:  # trimmed: a block starts and ends on offloaded elements
        assert intersect_spans(offloaded, [S(b.start, b.start + 1)])
        assert intersect_spans(offloaded, [S(b.end - 1, b.end)])
    for s in offloaded:
        b = layout.block_of(s)
        assert blocks[b].start <= s.start and s.end <= blocks[b].end
        local = layout.local(s)
        assert local.numel == s.numel and local.start >= 0 and local.end <= layout.numel
    assert layout.numel <= sum(o.numel for o in owned)
    if not resident:  # everything offloaded: one block per owned range that holds any
        hulls = []
        for o in owned:
            inside = intersect_spans(offloaded, [o])
            if inside:
                hulls.append(S(inside[0].start, inside[-1].end))
        assert blocks == merge_spans(hulls)


def test_layout_offsets_local_and_bytes():
    layout = MirrorLayout((S(0, 100), S(320, 500)))
    assert layout.numel == 280 and layout.offsets == (0, 100)
    assert layout.local(S(330, 340)) == S(110, 120)
    assert layout.block_of(S(400, 500)) == 1
    with pytest.raises(ValueError, match="no block"):
        layout.block_of(S(90, 110))
    assert layout.staging_nbytes(torch.bfloat16, torch.bfloat16) == 560
    # fp32 gradients of bf16 parameters: the block holds the wider of the two
    assert layout.staging_nbytes(torch.float32, torch.bfloat16) == 1120


# ---------------------------------------------------------------------------------------
# Schedule


def test_schedule_one_optimizer_reads_everything():
    sched = copy_schedule([[2, 0, 1]], 3)
    assert sched.d2h_order == (0, 1, 2)
    assert sched.wait_for == (2,)
    assert sched.convert_before == ((0, 1, 2),)
    assert sched.copy_back_after == ((0, 1, 2),)


def test_schedule_per_parameter_optimizers_out_of_block_order():
    # four optimizers (one parameter each) reading blocks 1, 0, 1, 2
    sched = copy_schedule([[1], [0], [1], [2]], 3)
    assert sched.d2h_order == (1, 0, 2)  # by first reader
    assert sched.wait_for == (1, 0, 1, 2)
    assert sched.convert_before == ((1,), (0,), (), (2,))
    assert sched.copy_back_after == ((), (0,), (1,), (2,))


def test_schedule_rejects_unread_blocks_and_empty_optimizers():
    with pytest.raises(ValueError, match="read by no"):
        copy_schedule([[0]], 2)
    with pytest.raises(ValueError, match="reads no block"):
        copy_schedule([[0], []], 1)


# ---------------------------------------------------------------------------------------
# Mirrors: copies and bytes


@pytest.mark.parametrize(
    "grad_dtype,param_dtype",
    [
        (torch.bfloat16, torch.bfloat16),  # precision-aware, bf16 grads: converted on the host
        (torch.float32, torch.bfloat16),  # grads in fp32: CPU grads are staging views
        (torch.float32, torch.float32),  # fp32 parameters
    ],
)
def test_mirror_copies_move_whole_blocks(grad_dtype, param_dtype):
    gen = torch.Generator().manual_seed(0)
    numel = 1024
    owned = (S(0, 1024),)
    offloaded = [S(0, 40), S(64, 100), S(320, 400), S(448, 500)]
    resident = [S(128, 300)]
    layout = mirror_layout(owned, offloaded, resident)
    grads = torch.randn(numel, generator=gen).to(grad_dtype)
    params = torch.randn(numel, generator=gen).to(param_dtype)
    before = params.clone()
    m = build_buffer_mirror(
        "test", layout, owned_numel=1024, grads=grads, grads_coords=None, params=params,
        params_coords=None, cpu_dtype=torch.float32, pin=False,
    )  # fmt: skip
    stats = m.stats()
    assert stats["blocks"] == 2
    assert stats["staging_bytes"] == layout.staging_nbytes(grad_dtype, param_dtype)
    assert stats["staging_bytes"] <= stats["owned_bytes"]
    assert stats["d2h_bytes"] == layout.numel * grads.element_size()
    assert (stats["host_grad_bytes"] == 0) == (grad_dtype == torch.float32)
    m.load_params()
    for block in m.blocks:
        block.start_d2h()
    for block in m.blocks:
        block.convert_grads()
    for s in offloaded:
        p, g = m.cpu_views(s)
        assert torch.equal(g, grads[s.start : s.end].float())
        assert torch.equal(p, params[s.start : s.end].float())
        p.add_(1.0)  # "the CPU step"
    # pack the first block back: the second block's gradients must survive in staging
    m.blocks[0].pack_params()
    m.blocks[0].start_h2d()
    for s in offloaded[2:]:
        assert torch.equal(m.cpu_views(s)[1], grads[s.start : s.end].float())
    m.blocks[1].pack_params()
    m.blocks[1].start_h2d()
    for s in offloaded:
        assert torch.equal(
            params[s.start : s.end], (before[s.start : s.end].float() + 1).to(param_dtype)
        )
    untouched = subtract_spans(owned, layout.blocks)
    for s in untouched:
        assert torch.equal(params[s.start : s.end], before[s.start : s.end])


def test_mirror_reads_from_a_local_fp32_mirror_and_writes_to_a_local_device_flat():
    # non-precision-aware: gradients are an fp32 mirror of the owned ranges (end to end),
    # parameters go back into a flat of fp32 main shards laid out like the host mirror
    owned = (S(0, 256), S(512, 768))
    offloaded = [S(0, 40), S(64, 200), S(512, 600)]
    resident = [S(640, 700)]
    layout = mirror_layout(owned, offloaded, resident)
    mirror = torch.arange(512, dtype=torch.float32)
    device_flat = torch.zeros(layout.numel)
    m = build_buffer_mirror(
        "local", layout, owned_numel=512, grads=mirror, grads_coords=owned, params=device_flat,
        params_coords=layout.blocks, cpu_dtype=torch.float32, pin=False,
    )  # fmt: skip
    for block in m.blocks:
        block.start_d2h()
    for s in offloaded:
        (local,) = to_local([s], owned)
        assert torch.equal(m.cpu_views(s)[1], mirror[local.start : local.end])
        m.cpu_views(s)[0].fill_(s.start)
    for block in m.blocks:
        block.pack_params()
        block.start_h2d()
    for s in offloaded:
        local = layout.local(s)
        assert torch.all(device_flat[local.start : local.end] == s.start)


# ---------------------------------------------------------------------------------------
# megatron-core's HybridDeviceOptimizer with host mirrors against its per-parameter path


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


@pytest.mark.parametrize("dp,rank", [(1, 0), (2, 1)])
@pytest.mark.parametrize("fp32_first", [True, False], ids=["fp32_first", "fp32_last"])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize(
    "pa,grads_fp32",
    [(True, False), (True, True), (False, False)],
    ids=["pa", "pa_fp32grads", "main"],
)
def test_hdo_with_host_mirrors_matches_stock_bit_for_bit(
    cpu_streams, pa, grads_fp32, fraction, overlap, fp32_first, dp, rank
):
    runs = []
    mirrored = (MirrorPlaced, MirrorChunked, MirrorPlacedOnDevice, MirrorChunkedOnDevice)
    for cls in (StockPlaced, *mirrored):
        stock = cls is StockPlaced
        bf16, fp32, groups, sources, bind, shard16 = sim(
            pa, fp32_first, grads_fp32, dp, rank, torch_grads=stock
        )
        hdo = make_hdo(cls, groups, fraction, overlap, None if stock else sources)
        runs.append((bf16, fp32, bind, hdo, shard16))
    for ours in (run[3] for run in runs[1:]):
        assert ours.host_mirrors and all(not s["pinned"] for s in ours.host_mirror_stats())
        assert not ours.cpu_copy_map_grad  # no per-parameter host gradients
    grads_before = {id(c): c.grad for c in runs[1][3].cpu_copys_map_gpu_param}
    initial = [p.detach().clone() for p in runs[1][4].values()]
    gen = torch.Generator().manual_seed(3)
    for step in range(4):
        g16 = torch.randn(runs[0][0].grad_data.numel(), generator=gen)
        g32 = torch.randn(runs[0][1].grad_data.numel(), generator=gen)
        for bf16, fp32, bind, hdo, _ in runs:
            bf16.grad_data.copy_(g16)
            fp32.grad_data.copy_(g32)
            bind()
            for i, g in enumerate(hdo.param_groups):  # an lr schedule, per group
                g["lr"] = 1e-2 * (step + 1) / (i + 2)
            hdo.step()
        (a16, a32, _, stock, main_a) = runs[0]
        for b16, b32, _, mine, main_b in runs[1:]:
            # The same AdamW kernel on the same values, rounded to bf16 by the same
            # round-to-nearest-even conversion on the host (the stock copy-back converts
            # there too): bit for bit.
            assert torch.equal(a16.param_data, b16.param_data)
            assert torch.equal(a32.param_data, b32.param_data)
            for x, y in zip(main_a.values(), main_b.values(), strict=True):
                assert torch.equal(x, y)  # the updated shards (fp32 main shards without pa)
            assert_same_state(stock, mine)
    for chunked in (runs[2][3], runs[4][3]):
        assert offload_internals.chunked(chunked) is not None, (
            chunked.chunked_step_off
        )  # not a fallback
    for on_device in (runs[3][3], runs[4][3]):  # fp32 crosses: no host conversion or packing
        assert all(m.device_convert for m in on_device.host_mirrors)
        assert all(b.pack is None for m in on_device.host_mirrors for b in m.blocks)
    assert {id(c): c.grad for c in runs[1][3].cpu_copys_map_gpu_param} == grads_before
    moved = [not torch.equal(p, q) for p, q in zip(runs[1][4].values(), initial, strict=True)]
    assert all(moved)


@pytest.mark.parametrize("in_fp32", [True, False], ids=["fp32_updates", "as_is"])
def test_the_simulated_placement_is_megatron_cores_on_the_device(in_fp32):
    """The simulations' placement runs megatron-core's own rule with every parameter on the
    "device": the first parameters up to the fraction get host copies (copies, not views),
    and only with ``param_update_in_fp32`` are bf16 ones given fp32 copies."""
    _, _, groups, _, _, _ = sim(True, False, False, 1, 0)
    params = [p for g in groups for p in g["params"]]
    cpu_groups, gpu_groups, to_cpu, to_gpu, fp32 = placement(groups, 0.5, in_fp32)
    moved, total = 0, sum(p.numel() for p in params)
    for p in params:  # megatron-core's greedy rule, in group order
        assert (p in to_cpu) == (moved < total * 0.5)
        moved += p.numel() if p in to_cpu else 0
    assert 0 < len(to_cpu) < len(params)
    for orig, cpu in to_cpu.items():
        assert to_gpu[cpu] is orig and torch.equal(cpu.double(), orig.double())
        assert cpu.untyped_storage().data_ptr() != orig.untyped_storage().data_ptr()
    cast = {p for p in params if p.dtype == torch.bfloat16} if in_fp32 else set()
    assert set(fp32) == cast and all(t.dtype == torch.float32 for t in fp32.values())
    placed = [p for g in cpu_groups + gpu_groups for p in g["params"]]
    assert {p.dtype for p in placed} == (
        {torch.float32} if in_fp32 else {torch.float32, torch.bfloat16}
    )
    on_cpu = {id(p) for g in cpu_groups for p in g["params"]}
    assert on_cpu == {id(fp32.get(o, c)) for o, c in to_cpu.items()}


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize(
    "pa,grads_fp32,islands",
    [(True, False, False), (True, False, True), (True, True, True), (False, False, False)],
    ids=["pa", "pa_islands", "pa_fp32grads_islands", "main"],
)
@pytest.mark.parametrize(
    "cls",
    [StockPlaced, MirrorPlaced, MirrorChunkedTorch, MirrorChunkedNative, MirrorChunkedOnDevice],
    ids=["stock", "per_parameter", "chunked_torch", "chunked_native", "chunked_on_device"],
)
def test_the_offloaded_step_is_adamw_in_fp64_terms(
    cpu_streams, cls, pa, grads_fp32, islands, fraction
):
    """Every parameter, master weight and moment against AdamW written out in fp64 over the
    gradients megatron-core's optimizer reads (natively fp32 parameters on the GPU
    included; with islands, fp32 gradients bf16 cannot hold, their buffer slices 1000
    times them): an oracle that shares nothing with the optimizer, megatron-core's
    included (``stock``: the reference of the bit-for-bit tests, checked here too)."""
    run = train(cls, pa, fraction, 3, chunk=40, compute=16, grads_fp32=grads_fp32, islands=islands)
    if islands:
        assert all(run[i].island for i in (0, 1))
        if fraction > 0 and cls is not StockPlaced:
            assert any(s.island for s in offload_internals.sources(run[2]))
    assert_adamw_in_fp64_terms(run, fp64_run(pa, 3, grads_fp32, islands))


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_gpu_resident_fp32_params_train_with_precision_aware_grads(cpu_streams, fraction):
    trained = {}
    for cls in (StockPlaced, MirrorPlaced):
        _, fp32, groups, sources, bind, _ = sim(True, False, False, 1, 0)
        hdo = make_hdo(
            cls, groups, fraction, False, None if issubclass(cls, StockPlaced) else sources
        )
        natives = [
            p
            for g in hdo.param_groups
            for p in g["params"]
            if p.dtype == torch.float32 and p not in hdo.gpu_params_map_cpu_copy
        ]
        assert natives
        before = [p.detach().clone() for p in natives]
        fp32.grad_data.normal_(generator=torch.Generator().manual_seed(1))
        bind()
        hdo.step()
        trained[cls] = [
            bool(hdo.state[p]) and not torch.equal(p, b)
            for p, b in zip(natives, before, strict=True)
        ]
    # megatron-core: its torch GPU optimizer never sees their (decoupled) gradients
    assert not any(trained[StockPlaced])
    assert all(trained[MirrorPlaced])


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_state_dict_round_trip_keeps_the_trajectory(cpu_streams, fraction):
    """load_state_dict rebuilds the CPU copies and mirrors; training continues bit for bit,
    natively fp32 parameters included (megatron-core's own reload raises KeyError there)."""
    finals = []
    for reload in (False, True):
        bf16, fp32, groups, sources, bind, shard16 = sim(True, True, False, 1, 0)
        hdo = make_hdo(MirrorPlaced, groups, fraction, False, sources)
        gen = torch.Generator().manual_seed(5)
        for step in range(4):
            if reload and step == 2:
                before = [c.data_ptr() for c in hdo.cpu_copys_map_gpu_param]
                hdo.load_state_dict(hdo.state_dict())
                assert [c.data_ptr() for c in hdo.cpu_copys_map_gpu_param] != before
                hosts = {m.host_params.untyped_storage().data_ptr() for m in hdo.host_mirrors}
                for c in hdo.cpu_copys_map_gpu_param:
                    assert c.untyped_storage().data_ptr() in hosts
            bf16.grad_data.copy_(torch.randn(bf16.grad_data.numel(), generator=gen))
            fp32.grad_data.copy_(torch.randn(fp32.grad_data.numel(), generator=gen))
            bind()
            hdo.step()
        finals.append((bf16, fp32, hdo))
    (a16, a32, a), (b16, b32, b) = finals
    assert torch.equal(a16.param_data, b16.param_data)
    assert torch.equal(a32.param_data, b32.param_data)
    assert_same_state(a, b)


def test_model_param_reload_refreshes_every_cpu_copy(cpu_streams):
    _, fp32, groups, sources, _, _ = sim(True, True, False, 1, 0)
    hdo = make_hdo(MirrorPlaced, groups, 1.0, False, sources)
    fp32.param_data.fill_(3.0)
    hdo.update_fp32_param_by_new_param()  # megatron-core skips natively fp32 parameters
    for orig, cpu in hdo.gpu_params_map_cpu_copy.items():
        if orig.dtype == torch.float32:
            assert torch.all(cpu == 3.0)


def test_cpu_params_and_grads_are_views_of_the_mirrors(cpu_streams):
    _, _, groups, sources, _, _ = sim(True, False, False, 1, 0)
    hdo = make_hdo(MirrorPlaced, groups, 1.0, True, sources)
    hosts = {m.host_params.untyped_storage().data_ptr() for m in hdo.host_mirrors}
    grads = {m.cpu_grads.untyped_storage().data_ptr() for m in hdo.host_mirrors}
    for cpu in hdo.cpu_copys_map_gpu_param:
        assert cpu.untyped_storage().data_ptr() in hosts
        assert cpu.grad.untyped_storage().data_ptr() in grads
    assert hdo.gpu_optimizer is None
    stats = hdo.host_mirror_stats()
    assert [s["blocks"] for s in stats] == [1, 1]  # fraction 1, one owned range each
    for s in stats:
        assert s["staging_bytes"] <= s["owned_bytes"]
    bf16 = next(s for s in stats if s["buffer"] == "bf16")
    assert bf16["d2h_bytes"] == bf16["staging_bytes"]  # bf16 moves as bf16
    assert bf16["host_grad_bytes"] == 2 * bf16["staging_bytes"]  # one fp32 conversion target


def test_a_parameter_outside_every_buffer_is_an_error(cpu_streams):
    _, _, groups, sources, _, _ = sim(True, False, False, 1, 0)
    with pytest.raises(RuntimeError, match="lie in no flat buffer"):
        make_hdo(MirrorPlaced, groups, 1.0, False, sources[:1])


def _distopt_shaped(pa, dp, rank):
    """A DistributedOptimizer's attributes that attach_host_mirrors reads, over _Buffers,
    with its flat targets built by megatron_ext.targets and a megatron-core
    HybridDeviceOptimizer (placed as above) inside: the glue, on the CPU."""
    from types import SimpleNamespace

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_ext.targets import FlatOptimizerState, buffer_target

    group = SimpleNamespace(size=lambda: dp, rank=lambda: rank)
    child = DistributedOptimizer.__new__(DistributedOptimizer)
    child.config = SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=pa)
    child.is_stub_optimizer = False
    child.buffers, targets, ranges = [], [], {}
    child.model_param_gbuf_map = {}
    models, shards = {}, {}
    for index, (shapes, dtype) in enumerate(
        ((SHAPES, torch.bfloat16), (FP32_SHAPES, torch.float32))
    ):
        b = SimBuffer(shapes, dtype, dtype, dp, rank)
        index_map = {}
        for name, span in b.spans.items():
            model = b.param_data[span.start : span.end].view(shapes[name])
            index_map[model] = (span.start, span.end, 0)
            child.model_param_gbuf_map[model] = (index, (dtype, dtype), 0)
            piece = b.shards.get(name)
            if piece is None:
                continue
            ranges[model] = {
                "param": SimpleNamespace(start=piece.start - span.start, end=piece.end - span.start)
            }
            shard = b.param_data[piece.start : piece.end]
            if dtype == torch.bfloat16 and not pa:
                shard = shard.float()  # an fp32 main shard
            models[model], shards[model] = dtype, shard
        buf = SimpleNamespace(
            param_index_map=index_map, grad_data=b.grad_data, param_data=b.param_data,
            numel=b.grad_data.numel(), bucket_indices=[(0, b.grad_data.numel())],
            data_parallel_group=group, grad_dtype=dtype, param_dtype=dtype,
        )  # fmt: skip
        needs_mirror = not pa and dtype != torch.float32
        layout = buffer_layout(buf, {m: n for m, n in zip(index_map, b.spans, strict=True)})
        targets.append(
            buffer_target(buf, layout, layout.records, sharded=True, needs_mirror=needs_mirror)
        )
        child.buffers.append(buf)
    child._get_model_param_range_map = ranges.__getitem__
    child._flat = FlatOptimizerState(targets, None)
    halves = [[m for m in models if models[m] == dt] for dt in (torch.bfloat16, torch.float32)]
    child.model_float16_groups, child.model_fp32_groups = [halves[0]], [halves[1]]
    shard16 = [[shards[m] for m in halves[0]]]
    child.shard_float16_groups = shard16 if pa else [[None] * len(halves[0])]
    child.shard_fp32_from_float16_groups = [[None] * len(halves[0])] if pa else shard16
    child.shard_fp32_groups = [[shards[m] for m in halves[1]]]
    groups = [{"params": [*child.shard_fp32_groups[0], *shard16[0]], "weight_decay": 0.0}]
    child.optimizer = make_hdo(StockPlaced, groups, 0.5, False)
    return child


@pytest.mark.parametrize("dp,rank", [(1, 0), (2, 1)])
@pytest.mark.parametrize("pa", [True, False], ids=["pa", "main"])
def test_attach_to_a_distributed_optimizer(cpu_streams, pa, dp, rank):
    child = _distopt_shaped(pa, dp, rank)
    hdo = child.optimizer
    offloaded = list(hdo.gpu_params_map_cpu_copy.items())
    assert offload.attach_host_mirrors(child) is True
    assert type(hdo) is HostMirrorHybridOptimizer and hdo.host_mirrors
    # megatron-core's placement and CPU copies are kept, not made again
    assert list(hdo.gpu_params_map_cpu_copy.items()) == offloaded
    sources = offload_internals.sources(hdo)
    for source, buf, target in zip(sources, child.buffers, child._flat.targets, strict=True):
        assert source.owned == target.spans.owned
        assert source.param_data is buf.param_data
        if target.mirror is not None:  # fp32 main grads of bf16 params: the fp32 mirror
            assert source.grads is target.mirror and source.grads_coords == target.spans.owned
        else:
            assert source.grads is buf.grad_data and source.grads_coords is None
        for shard, span in source.spans.items():
            if pa or buf.param_dtype == torch.float32:  # a view of the parameter buffer
                assert shard.storage_offset() == span.start
    for cpu in hdo.cpu_copys_map_gpu_param:
        hosts = {m.host_params.untyped_storage().data_ptr() for m in hdo.host_mirrors}
        assert cpu.untyped_storage().data_ptr() in hosts
    for buf in child.buffers:
        buf.grad_data.normal_()
    for t in child._flat.targets:
        for dst, src in t.copies:
            dst.copy_(src)
    hdo.step()  # gradients straight from the buffers (or the fp32 mirror), no .grad needed
    assert all(hdo.state[p] for p, _ in offloaded)


@pytest.mark.parametrize("pa", [True, False], ids=["pa", "main"])
def test_attach_with_the_chunked_step_trains_as_the_per_parameter_one(cpu_streams, pa):
    """Through the glue (a DistributedOptimizer's attributes, megatron_ext's targets):
    attach_host_mirrors(chunked_step=True) steps chunk by chunk, to the same bits."""
    finals = []
    for chunked in (False, True):
        child = _distopt_shaped(pa, 2, 1)
        hdo = child.optimizer
        assert offload.attach_host_mirrors(child, chunked_step=chunked, chunk_numel=64)
        assert hdo.chunked_step is chunked and hdo.chunk_numel == 64
        gen = torch.Generator().manual_seed(4)
        for _ in range(3):
            for buf in child.buffers:
                buf.grad_data.copy_(torch.randn(buf.grad_data.shape, generator=gen))
            for t in child._flat.targets:
                for dst, src in t.copies:
                    dst.copy_(src)
            hdo.step()
        assert (offload_internals.chunked(hdo) is not None) is chunked
        if chunked:
            copies = offload_internals.chunked(hdo).copies
            assert len(copies) > sum(len(m.blocks) for m in hdo.host_mirrors)
        assert all(hdo.state[p] for p in hdo.gpu_params_map_cpu_copy)
        finals.append(([b.param_data.clone() for b in child.buffers], hdo))
    (a, stock), (b, mine) = finals
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    pa_ = [p for g in stock.param_groups for p in g["params"]]
    pb = [p for g in mine.param_groups for p in g["params"]]
    for p, q in zip(pa_, pb, strict=True):
        assert stock.state[p].keys() == mine.state[q].keys()
        for key in stock.state[p]:
            assert torch.equal(stock.state[p][key], mine.state[q][key]), key


def test_threads_are_set_for_the_step_and_restored(cpu_streams, monkeypatch):
    import warnings as w

    from megatron_ext.offload import hybrid

    seen = []
    real_step = HybridDeviceOptimizer.step

    def spy(self, closure=None):
        seen.append(torch.get_num_threads())
        return real_step(self, closure)

    monkeypatch.setattr(HybridDeviceOptimizer, "step", spy)
    before = torch.get_num_threads()
    other = 1 if before > 1 else 2
    child = _distopt_shaped(True, 1, 0)
    with w.catch_warnings():
        w.simplefilter("ignore")  # other=1 may warn; the warning has its own test
        offload.attach_host_mirrors(child, threads=other)
    for buf in child.buffers:
        buf.grad_data.normal_()
    for t in child._flat.targets:
        for dst, src in t.copies:
            dst.copy_(src)
    child.optimizer.step()
    assert seen == [other] and torch.get_num_threads() == before
    # chunked: the fused kernel runs under the same setting
    counts = []
    real = torch._fused_adamw_
    monkeypatch.setattr(
        torch,
        "_fused_adamw_",
        lambda *a, **k: counts.append(torch.get_num_threads()) or real(*a, **k),
    )
    child.optimizer.chunked_step = True
    child.optimizer.offload_kernel = "torch"
    child.optimizer.step()
    assert counts and set(counts) == {other} and torch.get_num_threads() == before
    # the compiled kernel is handed the same number of threads
    from megatron_ext.offload import native

    handed = []
    real_run = native.HostAdamW.run
    monkeypatch.setattr(
        native.HostAdamW,
        "run",
        lambda self, *a: handed.append(a[4]) or real_run(self, *a),
    )
    child.optimizer.offload_kernel = "native"
    child.optimizer.step()
    assert handed and set(handed) == {other} and torch.get_num_threads() == before
    with hybrid.cpu_threads(None):
        assert torch.get_num_threads() == before


def test_one_thread_of_several_cores_is_warned_about(cpu_streams, monkeypatch):
    import warnings as w

    from megatron_ext.offload import hybrid

    monkeypatch.setattr(hybrid, "usable_cores", lambda: 16)
    with pytest.warns(UserWarning, match=r"1 thread of the 16 cores.*offload_threads=N"):
        offload.attach_host_mirrors(_distopt_shaped(True, 1, 0), threads=1)
    with w.catch_warnings():
        w.simplefilter("error")
        offload.attach_host_mirrors(_distopt_shaped(True, 1, 0), threads=4)
    monkeypatch.setattr(hybrid, "usable_cores", lambda: 1)
    assert hybrid.threads_warning(1) is None
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(hybrid, "usable_cores", lambda: 8)
    assert "1 thread of the 8 cores" in hybrid.threads_warning(None)


def test_attach_ignores_optimizers_without_offload():
    assert offload.attach_host_mirrors(object()) is False


# what attach_host_mirrors rebuilds (megatron-core's _init_sub_optimizers sets them): the
# sub-optimizers, their streams and per-step maps, and the lookups derived from the placement
REBUILT = {
    "cpu_optimizers",
    "gpu_optimizer",
    "cpu_copy_map_grad",
    "_d2h_stream",
    "_h2d_stream",
    "_cpu_optimizer_map_data_event",
    "param_to_inner_param",
    "inner_param_to_orig_param",
    "fp32_param_to_orig_param",
}


def _bind_shard_grads(child):
    """Each shard's gradient as ``.grad`` (an fp32 copy of its gradient-buffer slice), what
    megatron-core's optimizer reads without the precision-aware option."""
    pairs = (
        (child.model_float16_groups[0], child.shard_fp32_from_float16_groups[0]),
        (child.model_fp32_groups[0], child.shard_fp32_groups[0]),
    )
    for models, shards in pairs:
        for model, shard in zip(models, shards, strict=True):
            index = child.model_param_gbuf_map[model][0]
            start = child.buffers[index].param_index_map[model][0]
            r = child._get_model_param_range_map(model)["param"]
            grad = child.buffers[index].grad_data[start + r.start : start + r.end]
            shard.grad = grad.float().clone()


def test_class_swap_keeps_the_instance_layout(cpu_streams):
    """attach_host_mirrors swaps the class of megatron-core's live optimizer: every
    attribute megatron-core set survives, the same objects but for what it rebuilds (its
    sub-optimizers, over the same parameters and CPU copies), and the swapped optimizer
    steps as the unswapped one does, bit for bit."""
    runs = []
    for swap in (False, True):
        child = _distopt_shaped(False, 2, 1)
        hdo = child.optimizer
        before = dict(vars(hdo))
        inner = list(hdo.param_to_inner_param.items())
        subs = [[p for g in o.param_groups for p in g["params"]] for o in hdo.sub_optimizers]
        if swap:
            assert offload.attach_host_mirrors(child) is True
            assert type(hdo) is HostMirrorHybridOptimizer and hdo.host_mirrors
            after = vars(hdo)
            assert before.keys() <= after.keys()
            kept = [k for k in before if k not in REBUILT]
            assert [k for k in kept if after[k] is not before[k]] == []
            assert "param_groups" in kept and "gpu_params_map_cpu_copy" in kept
            assert [(a, b) for a, b in hdo.param_to_inner_param.items()] == inner
            now = [[p for g in o.param_groups for p in g["params"]] for o in hdo.sub_optimizers]
            assert [len(x) for x in now] == [len(x) for x in subs]
            assert all(
                a is b for x, y in zip(now, subs, strict=True) for a, b in zip(x, y, strict=True)
            )
        gen = torch.Generator().manual_seed(4)
        for _ in range(3):
            for buf in child.buffers:
                buf.grad_data.copy_(torch.randn(buf.grad_data.shape, generator=gen))
            for t in child._flat.targets:
                for dst, src in t.copies:
                    dst.copy_(src)
            _bind_shard_grads(child)
            hdo.step()
        shards = [*child.shard_fp32_from_float16_groups[0], *child.shard_fp32_groups[0]]
        runs.append(([s.detach().clone() for s in shards], hdo))
    (a, stock), (b, mine) = runs
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert_same_state(stock, mine)


# ---------------------------------------------------------------------------------------
# The benchmark, tiny, on the CPU


def test_offload_benchmark_runs_on_cpu(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "bench_offload", ROOT / "benchmarks" / "offload.py"
    )
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script
    spec.loader.exec_module(script)
    argv = ["--device", "cpu", "--out", str(tmp_path), "--bytes", "262144", "--warmup", "0"]
    returned = script.main([*argv, "--reps", "1", "--dp", "2"])
    records = json.loads((tmp_path / "offload.json").read_text())
    assert (tmp_path / "offload.png").stat().st_size > 0
    assert records == json.loads(json.dumps(returned, default=str))
    assert {r["variant"] for r in records} == {"per_param", "flat"}
    for r in records:
        assert set(script.RECORD_FIELDS) <= set(r)
        assert r["error"] is None, r
        assert r["time_kind"] == "perf_counter" and "stand in" in r["note"]
        assert r["d2h_s"] > 0 and r["cpu_step_s"] > 0 and r["ceiling_Bps"] > 0
    flat = [r for r in records if r["variant"] == "flat"]
    per_param = [r for r in records if r["variant"] == "per_param"]
    for f, p in zip(flat, per_param, strict=True):
        assert f["d2h_copies"] < p["d2h_copies"]
        assert f["d2h_bytes"] < p["d2h_bytes"]  # bf16 moves as bf16, not fp32
        assert f["pinned_bytes"] <= f["owned_bytes"]
    out = capsys.readouterr()
    assert "stand in" in out.out and out.out.rstrip().splitlines()[-1].strip()


def test_sub_optimizer_state_goes_to_its_parameters_device():
    """After a load, megatron-core's sync can leave a GPU sub-optimizer's moments on the CPU
    (it tells the sub-optimizers apart by class). Each state tensor goes to its parameter's
    device; ``step`` stays where torch keeps it (on the device only for fused/capturable
    groups). The ``meta`` device stands in for the GPU."""
    import types

    from megatron_ext.opt_checkpoint import place_sub_optimizer_state

    gpu_p = torch.nn.Parameter(torch.zeros(3, device="meta"))
    cpu_p = torch.nn.Parameter(torch.zeros(3))
    gpu_opt = types.SimpleNamespace(param_groups=[{"params": [gpu_p], "fused": True}], state={})
    cpu_opt = types.SimpleNamespace(param_groups=[{"params": [cpu_p], "fused": None}], state={})
    gpu_opt.state[gpu_p] = {"exp_avg": torch.ones(3), "step": torch.tensor(4.0), "lr": 0.1}
    cpu_state = {"exp_avg": torch.ones(3), "step": torch.tensor(4.0)}
    cpu_opt.state[cpu_p] = dict(cpu_state)
    shared = gpu_opt.state[gpu_p]  # the offload optimizer's own state holds the same dicts
    place_sub_optimizer_state(types.SimpleNamespace(sub_optimizers=[gpu_opt, cpu_opt]))
    assert shared["exp_avg"].device.type == "meta" and shared["step"].device.type == "meta"
    assert shared["lr"] == 0.1
    # already where they belong: the very same tensors (a CPU step stays on the CPU)
    assert all(cpu_opt.state[cpu_p][k] is v for k, v in cpu_state.items())


# ---------------------------------------------------------------------------------------
# The chunked step (megatron_ext.offload.step)


def test_chunked_step_reports_its_host_bytes_and_allocates_once(cpu_streams):
    ours = train(MirrorChunked, True, 1.0, 1, chunk=200, compute=64)
    hdo = ours[2]
    steppers = offload_internals.chunked(hdo).steppers
    stats = hdo.host_mirror_stats()
    ptrs = [(s.exp_avg.data_ptr(), s.exp_avg_sq.data_ptr(), s.scratch.data_ptr()) for s in steppers]
    for row, stepper in zip(stats, steppers, strict=True):
        per_param = sum(8 * e.param.numel() for e in stepper.entries)  # torch's two moments
        assert row["moment_bytes"] == per_param + row["moment_padding_bytes"]
        assert row["moment_padding_bytes"] == 8 * (stepper.host_params.numel() - per_param // 8)
        assert row["scratch_bytes"] == 4 * max(s.numel for c in stepper.subs for s, _ in c)
    hdo.step()
    hdo.step()
    after = [
        (s.exp_avg.data_ptr(), s.exp_avg_sq.data_ptr(), s.scratch.data_ptr()) for s in steppers
    ]
    assert after == ptrs  # the same host tensors every step
    per_param = [m.stats() for m in hdo.host_mirrors]
    for row, plain in zip(stats, per_param, strict=True):
        assert {k: row[k] for k in plain} == plain  # the mirrors' own bytes unchanged


def test_chunked_mirrors_keep_no_host_copy_of_the_gradients(cpu_streams):
    """bf16 gradients: the per-parameter step reads an fp32 host copy of them (4 bytes per
    element); the chunked step converts into its scratch, so its mirror has none."""
    per = train(MirrorPlaced, True, 1.0, 1)[2]
    lean = train(MirrorChunked, True, 1.0, 1, chunk=200, compute=64)[2]
    by_name = {m["buffer"]: m for m in per.host_mirror_stats()}
    for row in lean.host_mirror_stats():
        plain = by_name[row["buffer"]]
        if row["grads_dtype"] == torch.bfloat16:
            assert plain["host_grad_bytes"] == 2 * plain["staging_bytes"] > 0
            assert row["host_grad_bytes"] == 0
        else:  # fp32 gradients are read in the staging by both
            assert row["host_grad_bytes"] == plain["host_grad_bytes"] == 0
        assert row["staging_bytes"] == plain["staging_bytes"]
        assert row["host_param_bytes"] == plain["host_param_bytes"]
    bf16_mirror = next(m for m in lean.host_mirrors if m.grads_dtype == torch.bfloat16)
    assert bf16_mirror.cpu_grads is None
    cpu_streams.compute.synchronize()  # the last step's copies back are done
    with pytest.raises(RuntimeError, match="lean .*only the chunked offload step converts"):
        bf16_mirror.blocks[0].convert_grads()
    lean.chunked_step = False  # the per-parameter step would read no gradients: refused
    with pytest.raises(RuntimeError, match="chunked_step is off.*offload_step='per_parameter'"):
        lean.step()


def test_the_chunked_step_is_rebuilt_when_its_sizes_change(cpu_streams):
    bf16, fp32, hdo, _ = train(MirrorChunked, True, 1.0, 1, chunk=10**9, compute=10**9)
    first = offload_internals.chunked(hdo)
    assert sum(len(c) for s in first.steppers for c in s.subs) == len(first.copies)  # one each
    hdo.compute_numel = 64
    hdo.step()
    now = offload_internals.chunked(hdo)
    assert now.steppers[0] is not first.steppers[0]
    assert sum(len(c) for s in now.steppers for c in s.subs) > len(now.copies)
    hdo.chunk_numel = 200
    hdo.step()
    assert len(offload_internals.chunked(hdo).copies) > len(first.copies)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("pa", [True, False], ids=["pa", "main"])
@pytest.mark.parametrize(
    "first,second",
    [(MirrorChunked, MirrorPlaced), (MirrorPlaced, MirrorChunked)],
    ids=["chunked_to_per_parameter", "per_parameter_to_chunked"],
)
def test_checkpoints_move_between_the_chunked_and_per_parameter_steps(
    cpu_streams, first, second, pa, fraction
):
    """Saved by one step kind, loaded into the other: megatron-core's format either way,
    and the run continues as an uninterrupted per-parameter one, bit for bit."""
    plain = train(StockPlaced, pa, fraction, 4)
    switched = train_switching(first, second, pa, fraction, 4, switch_at=2)
    assert (offload_internals.chunked(switched[2]) is not None) == (second is MirrorChunked)
    assert_same_run(plain, switched)


@pytest.mark.parametrize(
    "chunk,compute", [(1, 1), (7, 10**9), (200, 64), (10**9, 100), (10**9, 10**9)]
)
@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize(
    "pa,grads_fp32",
    [(True, False), (True, True), (False, False)],
    ids=["pa", "pa_fp32grads", "main"],
)
@pytest.mark.parametrize(
    "cls",
    [
        MirrorChunkedNative,
        MirrorChunkedOnDeviceNative,
        MirrorChunkedTorch,
        MirrorChunkedOnDeviceTorch,
    ],
    ids=["host-native", "device-native", "host-torch", "device-torch"],
)
def test_chunked_step_is_stock_bit_for_bit_at_any_chunk_size(
    cpu_streams, cls, pa, grads_fp32, fraction, chunk, compute
):
    """Chunks (copies) and their sub-ranges (convert, update, pack) of any size, the
    gradients and parameters converted on the host or on the device, the chunks updated by
    the compiled kernel (one pass) or by torch's ops; bf16 or fp32 gradient buffers."""
    stock = train(StockPlaced, pa, fraction, 3, grads_fp32=grads_fp32)
    ours = train(cls, pa, fraction, 3, chunk=chunk, compute=compute, grads_fp32=grads_fp32)
    assert offload_internals.chunked(ours[2]) is not None, ours[2].chunked_step_off
    native = cls.offload_kernel == "native"
    for stepper in offload_internals.chunked(ours[2]).steppers:
        assert stepper.uses_native is native
        assert stepper.native_updates == (len(stepper.chunks) if native else 0)
    steppers, copies, _, _ = offload_internals.chunked(ours[2])
    subs = sum(len(c) for s in steppers for c in s.subs)
    assert (subs > len(copies)) == (compute < chunk)
    blocks = sum(len(m.blocks) for m in ours[2].host_mirrors)
    if chunk == 10**9:
        assert len(copies) == blocks
    else:
        assert len(copies) > blocks
    assert_same_run(stock, ours)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_chunked_step_state_round_trip_keeps_the_trajectory(cpu_streams, fraction):
    """A loaded state (other tensors than the flat moments' views) is copied in, re-bound,
    and training continues as without the reload; the state still holds views after."""
    plain = train(MirrorChunked, True, fraction, 4)
    reloaded = train(MirrorChunked, True, fraction, 4, reload_at=2)
    assert_same_run(plain, reloaded)
    for stepper in offload_internals.chunked(reloaded[2]).steppers:
        for e in stepper.entries:
            st = e.optimizer.state[e.param]
            assert st["exp_avg"].untyped_storage().data_ptr() == (
                stepper.exp_avg.untyped_storage().data_ptr()
            )
            assert st["step"].item() == 4


def test_chunked_step_falls_back_where_the_cpu_adamw_is_not_fused(cpu_streams):
    class NotFused(MirrorChunked):
        def _build_host_mirrors(self):
            for opt in self.cpu_optimizers:
                for g in opt.param_groups:
                    g["fused"] = None
            super()._build_host_mirrors()

    ours = train(NotFused, True, 1.0, 2, chunk=7)
    assert offload_internals.chunked(ours[2]) is None
    assert "not fused" in ours[2].chunked_step_off
    # built with the host gradients the fallback reads
    assert all(m.cpu_grads is not None for m in ours[2].host_mirrors)
    assert all(s.get("exp_avg") is not None for s in ours[2].state.values())


def test_chunked_step_order_and_one_call_per_chunk_and_hyperparameters(cpu_streams, monkeypatch):
    """All device-to-host copies first, then per chunk: wait, update (converting and
    packing), copy back, in chunk order; one fused call per sub-range and distinct
    hyperparameter set."""
    from megatron_ext.offload import host_mirror as hm
    from megatron_ext.offload.step import ChunkedAdamW

    log = []
    for name in ("start_d2h", "convert_grads", "pack_params", "start_h2d"):
        real = getattr(hm.HostBlock, name)

        def traced(self, real=real, name=name):
            log.append((name, id(self)))
            return real(self)

        monkeypatch.setattr(hm.HostBlock, name, traced)
    real_update = ChunkedAdamW.update

    def traced_update(self, i, copies=None):
        log.append(("update", id(copies)))
        return real_update(self, i, copies)

    monkeypatch.setattr(ChunkedAdamW, "update", traced_update)
    calls = []
    real_fused = torch._fused_adamw_

    def counting(params, *args, **kwargs):
        calls.append((len(params), kwargs["weight_decay"], kwargs["lr"]))
        return real_fused(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", counting)
    ours = train(MirrorChunkedTorch, True, 1.0, 1, chunk=200, compute=64)
    copies = offload_internals.chunked(ours[2]).copies
    ids = [id(c) for c in copies]
    n = len(ids)
    assert log[:n] == [("start_d2h", i) for i in ids]
    want = []
    for i in ids:
        want += [("update", i), ("start_h2d", i)]  # it converts and packs itself
    assert log[n:] == want
    # every sub-range (64 elements, chunks of 200): one call per weight-decay value in it
    expected = 0
    for stepper in offload_internals.chunked(ours[2]).steppers:
        for subs in stepper.subs:
            for _, pieces in subs:
                wds = {
                    stepper.entries[k].optimizer.param_groups[0]["weight_decay"] for k, _ in pieces
                }
                expected += len(wds)
    assert len(calls) == expected and {wd for _, wd, _ in calls} == {0.0, 0.1}


def test_the_compiled_kernel_runs_once_per_chunk_with_every_family(cpu_streams, monkeypatch):
    """The compiled kernel: one call per chunk, in chunk order, torch's fused AdamW never
    called, the families' hyperparameters (weight decay 0 and 0.1, the lr schedule) and
    the step's thread count handed over."""
    from megatron_ext.offload import native

    native.kernel()  # its probe calls torch's kernel: before the counting starts
    fused = []
    real_fused = torch._fused_adamw_
    monkeypatch.setattr(
        torch, "_fused_adamw_", lambda *a, **k: fused.append(1) or real_fused(*a, **k)
    )
    runs = []
    real_run = native.HostAdamW.run

    def counting(self, tasks, hyper, steps, kinds, threads, *args, **kwargs):
        runs.append((len(tasks), list(hyper), threads))
        return real_run(self, tasks, hyper, steps, kinds, threads, *args, **kwargs)

    monkeypatch.setattr(native.HostAdamW, "run", counting)
    ours = train(MirrorChunkedNative, True, 1.0, 1, chunk=200, compute=64)
    chunks = sum(len(s.chunks) for s in offload_internals.chunked(ours[2]).steppers)
    gpu_calls = 1 if ours[2].gpu_optimizer is not None else 0
    assert len(runs) == chunks and len(fused) == gpu_calls
    lrs_wds = {(h[i], h[i + 3]) for _, h, _ in runs for i in range(0, len(h), 5)}
    assert {wd for _, wd in lrs_wds} == {0.0, 0.1}
    assert {lr for lr, _ in lrs_wds} == {g["lr"] for g in ours[2].param_groups}
    assert {t for _, _, t in runs} == {torch.get_num_threads()}


@pytest.mark.parametrize("chunk", [10**9, 200, 7])
def test_the_compiled_kernel_never_packs_over_gradients_not_yet_read(
    cpu_streams, monkeypatch, chunk
):
    """fp32 gradients of bf16 parameters: the staging holds the gradients (4 bytes an
    element) and the updated parameters are packed into the same bytes (2 an element), so
    element j's new parameter overwrites element j/2's gradient. One kernel call shares its
    tasks among threads in any order; here every call runs its tasks one at a time in
    reverse order (a task of a later parameter packing before an earlier one has read its
    gradients, the order a busy pool can take). Still stock's result bit for bit."""
    from megatron_ext.offload import native

    native.kernel()  # loaded and probed before the reordering starts
    real_run = native.HostAdamW.run
    sizes = []

    def reversed_one_by_one(self, tasks, *args, **kwargs):
        sizes.append(len(tasks))
        for i in reversed(range(len(tasks))):
            real_run(self, (native.Task * 1)(tasks[i]), *args, **kwargs)

    monkeypatch.setattr(native.HostAdamW, "run", reversed_one_by_one)
    stock = train(StockPlaced, True, 1.0, 3, grads_fp32=True)
    ours = train(MirrorChunkedNative, True, 1.0, 3, chunk=chunk, grads_fp32=True)
    bf16_mirror = next(m for m in ours[2].host_mirrors if m.params_dtype == torch.bfloat16)
    assert bf16_mirror.grads_dtype == torch.float32  # packed into the gradients' bytes
    assert bf16_mirror.cpu_grads.data_ptr() == bf16_mirror.staging.data_ptr()
    assert all(s.uses_native for s in offload_internals.chunked(ours[2]).steppers)
    if chunk >= 200:
        assert max(sizes) > 1  # calls of several tasks, whose order was reversed
    assert_same_run(stock, ours)


def test_a_chunk_no_rounds_can_order_takes_the_torch_path(cpu_streams, monkeypatch):
    """Where native.rounds finds no safe order for a chunk's tasks (None), that chunk is
    updated by torch's ops: no kernel call for it, the result stock's bit for bit."""
    from megatron_ext.offload import native

    native.kernel()
    calls = []
    real_run = native.HostAdamW.run
    monkeypatch.setattr(native, "rounds", lambda tasks: None)
    monkeypatch.setattr(
        native.HostAdamW, "run", lambda self, *a, **k: calls.append(1) or real_run(self, *a, **k)
    )
    stock = train(StockPlaced, True, 1.0, 3, grads_fp32=True)
    ours = train(MirrorChunkedNative, True, 1.0, 3, chunk=200, grads_fp32=True)
    assert not calls
    for stepper in offload_internals.chunked(ours[2]).steppers:
        assert stepper.native_updates == 0 and stepper.updated > 0
    assert_same_run(stock, ours)


def test_chunked_adamw_refuses_what_is_not_the_mirror():
    from megatron_ext.offload.step import ChunkedAdamW, Entry, chunk_spans

    host, grads = torch.zeros(100), torch.zeros(100)
    p = host[10:30].view(4, 5)
    opt = torch.optim.AdamW([p], fused=True)
    ChunkedAdamW(host, grads, [Entry(p, S(10, 30), opt, 0)], [S(0, 50), S(50, 100)])
    with pytest.raises(ValueError, match="not the mirror's view at"):
        ChunkedAdamW(host, grads, [Entry(p, S(11, 31), opt, 0)], [S(0, 100)])
    with pytest.raises(ValueError, match="not the mirror's view at"):
        ChunkedAdamW(host, grads, [Entry(torch.zeros(20), S(10, 30), opt, 0)], [S(0, 100)])
    with pytest.raises(ValueError, match="cover every parameter exactly once"):
        ChunkedAdamW(host, grads, [Entry(p, S(10, 30), opt, 0)], [S(0, 20)])
    with pytest.raises(ValueError, match="cover every parameter exactly once"):
        ChunkedAdamW(host, grads, [Entry(p, S(10, 30), opt, 0)], [S(0, 25), S(20, 40)])
    other = host[25:35]
    with pytest.raises(ValueError, match="overlap in the mirror"):
        ChunkedAdamW(
            host, grads,
            [Entry(p, S(10, 30), opt, 0), Entry(other, S(25, 35), opt, 0)], [S(0, 100)],
        )  # fmt: skip
    with pytest.raises(ValueError, match="flat tensors alike"):
        ChunkedAdamW(host, grads.double(), [], [])
    assert chunk_spans([S(0, 10), S(10, 13)], 4) == (
        (0, S(0, 4)), (0, S(4, 8)), (0, S(8, 10)), (1, S(10, 13)),
    )  # fmt: skip
    with pytest.raises(ValueError, match="positive"):
        chunk_spans([S(0, 10)], 0)
    # inside a parameter, cuts fall at multiples of 64 from its start (torch's kernel then
    # treats every element as in the whole parameter); in gaps and at block ends anywhere
    assert chunk_spans([S(0, 300)], 100, [S(10, 210)]) == (
        (0, S(0, 74)), (0, S(74, 138)), (0, S(138, 238)), (0, S(238, 300)),
    )  # fmt: skip
    # a block that ends inside a parameter off the quantum: no run crosses its end
    assert chunk_spans([S(0, 37), S(37, 80)], 18, [S(0, 80)]) == (
        (0, S(0, 37)), (1, S(37, 64)), (1, S(64, 80)),
    )  # fmt: skip
    small = chunk_spans([S(0, 300)], 1, [S(10, 210)])
    assert [r for _, r in small][9:13] == [S(9, 10), S(10, 74), S(74, 138), S(138, 202)]
    assert small[13][1] == S(202, 210) and small[14][1] == S(210, 211)


def test_chunked_adamw_equals_torch_fused_adamw_per_parameter_in_fp64_terms():
    """Against torch's own AdamW(fused=True), one optimizer per parameter, and an fp64
    AdamW computed here from the formula (fresh random data, two hyperparameter sets)."""
    from megatron_ext.offload.step import ChunkedAdamW, Entry, chunk_spans

    gen = torch.Generator().manual_seed(0)
    sizes, gaps = [5, 17, 1, 33, 8], [0, 3, 0, 2, 7]
    n = sum(sizes) + sum(gaps)
    host, grads = torch.randn(n, generator=gen), torch.zeros(n)
    ref, opts, entries, f64, at = [], [], [], [], 0
    for i, (size, gap) in enumerate(zip(sizes, gaps, strict=True)):
        at += gap
        view = host[at : at + size]
        twin = torch.nn.Parameter(view.clone())
        wd = 0.1 if i % 2 else 0.0
        cfg = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, fused=True)
        opts.append(torch.optim.AdamW([view], **cfg))
        ref.append((twin, torch.optim.AdamW([twin], **cfg)))
        entries.append(Entry(view, S(at, at + size), opts[-1], 0))
        f64.append(
            [
                view.double().clone(),
                torch.zeros(size, dtype=FP64),
                torch.zeros(size, dtype=FP64),
                wd,
            ]
        )
        at += size
    runs = chunk_spans([S(0, n)], 9, [e.local for e in entries])
    assert len(runs) > len(entries)
    stepper = ChunkedAdamW(host, grads, entries, [r for _, r in runs])
    for t in range(1, 4):
        grads.copy_(torch.randn(n, generator=gen))
        for e, (twin, opt), x in zip(entries, ref, f64, strict=True):
            g = grads[e.local.start : e.local.end]
            twin.grad = g.clone()
            opt.step()
            p, m, v, wd = x
            p.mul_(1 - 1e-2 * wd)
            m.mul_(0.9).add_(0.1 * g.double())
            v.mul_(0.95).add_(0.05 * g.double() ** 2)
            denom = (v / (1 - 0.95**t)).sqrt() + 1e-8
            p.sub_(1e-2 * (m / (1 - 0.9**t)) / denom)
        stepper.begin()
        for c in range(len(stepper.chunks)):
            stepper.update(c)
        stepper.finish()
        for e, (twin, _), x in zip(entries, ref, f64, strict=True):
            mine = host[e.local.start : e.local.end]
            assert torch.equal(mine, twin.detach())  # torch's kernel, bit for bit
            torch.testing.assert_close(mine.double(), x[0], rtol=1e-6, atol=1e-7)
    untouched = torch.ones(n, dtype=torch.bool)
    for e in entries:
        untouched[e.local.start : e.local.end] = False
    assert torch.equal(
        host[untouched], torch.randn(n, generator=torch.Generator().manual_seed(0))[untouched]
    )


def test_offload_checkpoints_load_with_the_weights_only_unpickler(tmp_path):
    """megatron-core's offload optimizer keeps its optimizer classes in every param group;
    megatron-core 0.18 loads the common checkpoint state with torch's weights-only
    unpickler, which refuses them until they are allowed. In a fresh process (torch's safe
    globals are per process): refused before, loaded after."""
    import subprocess
    import sys

    script = f"""
import types, torch
from megatron_ext.offload.hybrid import allow_optimizer_classes_in_checkpoints
path = {str(tmp_path / "common.pt")!r}
torch.save({{"param_groups": [{{"lr": 0.1, "cpu_optimizer_cls": torch.optim.AdamW,
                                "gpu_optimizer_cls": torch.optim.Adam}}]}}, path)
try:
    torch.load(path)
    print("loaded before")
except Exception as e:
    print("refused before:", type(e).__name__)
hdo = types.SimpleNamespace(cpu_optimizer_cls=torch.optim.AdamW, gpu_optimizer_cls=torch.optim.Adam)
print("allowed", [c.__name__ for c in allow_optimizer_classes_in_checkpoints(hdo)])
got = torch.load(path)["param_groups"][0]
print("loaded after", got["cpu_optimizer_cls"] is torch.optim.AdamW, got["lr"])
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines == [
        "refused before: UnpicklingError",
        "allowed ['AdamW', 'Adam']",
        "loaded after True 0.1",
    ], done.stdout
