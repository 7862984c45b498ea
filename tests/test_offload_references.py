"""megatron-core's ``HybridDeviceOptimizer`` with host mirrors against its stock
per-parameter path (bit for bit) and against AdamW written out in fp64, on the CPU: streams
and events are recording stand-ins, the shard parameters hand-made
(:mod:`tests.support.offload_sim`)."""

from __future__ import annotations

import pytest
import torch

from tests.support import offload_internals
from tests.support.offload_sim import (
    MirrorChunked,
    MirrorChunkedNative,
    MirrorChunkedOnDevice,
    MirrorChunkedTorch,
    MirrorPlaced,
    MirrorPlacedOnDevice,
    StockPlaced,
    assert_adamw_in_fp64_terms,
    assert_same_state,
    fp64_run,
    make_hdo,
    placement,
    sim,
    train,
)

pytestmark = pytest.mark.mcore


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
