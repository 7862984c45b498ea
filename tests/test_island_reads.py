"""fp32 local accumulation: the norm, zero count, per-parameter norms, clip and host mirrors
read what megatron-core's optimizer reads, on the CPU, at DP = 1, 2 and 4.

Parameters matching ``param_name_patterns_for_fp32_local_accumulation`` accumulate into a
separate fp32 ``main_grad`` (here: views of one island per buffer, as
:class:`megatron_ext.DistributedDataParallel` carves it, by its own method); megatron-core
copies it into the buffer for the reduction and back after. Without an fp32 mirror the
optimizer then reads, and with a loss scaler unscales in place, that fp32 copy, so its
buffer slice keeps the loss-scaled values. The state comes from the real ``_build_state``
on a ``DistributedOptimizer`` stand-in whose shard ranges are megatron-core's own.

Oracle: fp64 over what megatron-core's distributed optimizer reads for each parameter it
holds (``model_param.main_grad.view(-1)[param_range]``, its ``_copy_model_grads_to_main_
grads`` rule for precision-aware and fp32 gradients), after the unscale, unioned over ranks.
"""

import math
import types

import pytest
import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.transformer.module import param_is_not_shared

from buffers import ops
from buffers.spans import Span
from megatron_ext.ddp import DistributedDataParallel
from megatron_ext.global_param_norms import MegatronParamNorms
from megatron_ext.layout import buffer_layout
from megatron_ext.offload import offload_sources, source_mirror
from megatron_ext.offload.host_mirror import chunk_copies
from megatron_ext.offload.step import ChunkedAdamW, HostParam, chunk_spans
from megatron_ext.opt_state import _build_state
from tests.support.distopt_ranks import BF16, FP32, child_for_rank, reduce_ranks

pytestmark = pytest.mark.mcore

# A loss scale that is not a power of two (a static bf16 loss_scale can be any number):
# unscaled, the island's fp32 gradients are values bf16 cannot hold, so a dtype slip on the
# island path (an island copy staged or read in bf16) changes what is read.
SCALE = 1000.0
ISLAND = ("bf16.1", "bf16.3", "fp32.1")  # what a pattern such as "*fc2*" would match


def carve(buf, names, island_names):
    """megatron-core's promotion (a separate fp32 main_grad, the buffer slice kept as
    main_grad_copy_in_grad_buffer), then megatron_ext's island, by DDP's own method."""
    per_bucket = [[] for _ in buf.buckets]
    for p, (s, e, b) in buf.param_index_map.items():
        if names[p] in island_names:
            p.main_grad_copy_in_grad_buffer = buf.grad_data[s:e]
            p.main_grad = torch.empty(e - s, dtype=torch.float32)
            per_bucket[b].append(p)
    for bucket, params in zip(buf.buckets, per_bucket, strict=True):
        bucket.params_with_extra_main_grads = params
    buf.extra_main_grads = [p.main_grad for ps in per_bucket for p in ps]
    return DistributedDataParallel._carve_fp32_island(None, buf)


def after_step(bufs, held, child, scale):
    """Reduce-and-copy-back as megatron-core's buffer does, then its unscale of what the
    optimizer reads. Returns ``{param: fp64 values the optimizer reads}`` for the held
    parameters (their shard)."""
    for buf in bufs:
        for b in buf.buckets:
            for p in b.params_with_extra_main_grads:  # _copy_back_extra_main_grads
                p.main_grad.copy_(p.main_grad_copy_in_grad_buffer)
    reads = {}
    for p in held:
        r = child._get_model_param_range_map(p)["param"]
        view = p.main_grad.view(-1)[r.start : r.end]  # decoupled_grad / fp32 main grad
        if scale is not None:
            view.div_(scale)
        reads[p] = view
    return {p: v.double().clone() for p, v in reads.items()}


def build(dp, rank, *, scale, decoupled=True, island_names=ISLAND, seed=1):
    child, bufs, _, held = child_for_rank(dp, rank, seed=seed)  # main_grad: buffer views
    names = _names(bufs)
    for buf in bufs:
        if scale is not None:
            buf.grad_data.mul_(scale)  # the reduced gradients, still loss-scaled
    islands = [carve(buf, names, island_names) for buf in bufs]
    child.config = types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=decoupled)
    child.grad_scaler = object() if scale is not None else None
    placed = [(b, buffer_layout(b, names), isl) for b, isl in zip(bufs, islands, strict=True)]
    state = _build_state(child, placed)
    reads = after_step(bufs, held, child, scale)
    return child, bufs, state, reads, names, islands


def _names(bufs):
    out = {}
    for buf in bufs:
        kind = "bf16" if buf.grad_dtype == BF16 else "fp32"
        for i, p in enumerate(buf.param_index_map):
            out[p] = f"{kind}.{i}"
    return out


def fp64_oracle(per_rank):
    """(sum of squares, zeros, per-name sum of squares) of the counted values read."""
    sumsq, zeros, by_name = 0.0, 0, {}
    for _, _, _, reads, names, _ in per_rank:
        for p, v in reads.items():
            by_name[names[p]] = by_name.get(names[p], 0.0) + v.square().sum().item()
            if param_is_not_shared(p):
                sumsq += v.square().sum().item()
                zeros += int((v == 0).sum())
    return sumsq, zeros, by_name


@pytest.mark.parametrize("scale", [None, SCALE])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_norm_and_zero_count_read_what_the_optimizer_reads(dp, scale):
    per_rank = [build(dp, r, scale=scale) for r in range(dp)]
    # some exact zeros in an island parameter: the zero count must see them once
    sumsq, zeros, _ = fp64_oracle(per_rank)
    got = sum(
        ops.local_power_stat(x[2].norm_groups, 2.0, torch.device("cpu")).double().item()
        for x in per_rank
    )
    assert math.isclose(math.sqrt(got), math.sqrt(sumsq), rel_tol=1e-6), (got, sumsq)
    count = sum(
        int(ops.count_zeros_groups(x[2].norm_groups, x[2].padding, torch.device("cpu")))
        for x in per_rank
    )
    assert count == zeros


def test_zero_count_sees_island_zeros_once():
    dp = 2
    per_rank = []
    for r in range(dp):
        x = build(dp, r, scale=SCALE, seed=5)
        for p, _v in x[3].items():
            if x[4][p] == "bf16.3":  # zero a stretch of what the optimizer reads
                rng = x[0]._get_model_param_range_map(p)["param"]
                p.main_grad.view(-1)[rng.start : rng.start + 37].zero_()
        per_rank.append(x)
    zeros = 0
    for x in per_rank:
        for p in x[3]:
            r = x[0]._get_model_param_range_map(p)["param"]
            if param_is_not_shared(p):
                zeros += int((p.main_grad.view(-1)[r.start : r.end] == 0).sum())
    count = sum(
        int(ops.count_zeros_groups(x[2].norm_groups, x[2].padding, torch.device("cpu")))
        for x in per_rank
    )
    assert zeros >= 37 and count == zeros


@pytest.mark.parametrize("dp", [1, 2])
def test_per_parameter_norms_read_the_island(monkeypatch, dp):
    per_rank = [build(dp, r, scale=SCALE) for r in range(dp)]
    pns = [
        MegatronParamNorms(x[2].targets, {id(p): n for p, n in x[4].items()}, torch.device("cpu"))
        for x in per_rank
    ]
    union, norms = reduce_ranks(monkeypatch, pns)
    sumsq, _, by_name = fp64_oracle(per_rank)
    for i, name in enumerate(union.names):
        assert math.isclose(norms[i].item(), math.sqrt(by_name[name]), rel_tol=1e-6), name
    assert math.isclose(norms[-1].item(), math.sqrt(sumsq), rel_tol=1e-6)


def test_clip_scales_every_value_the_optimizer_reads():
    dp = 2
    for r in range(dp):
        child, bufs, state, reads, names, _ = build(dp, r, scale=SCALE)
        coeff = torch.tensor(0.37)
        ops.scale_groups_(state.scale_groups, coeff)
        for p, before in reads.items():
            rng = child._get_model_param_range_map(p)["param"]
            now = p.main_grad.view(-1)[rng.start : rng.end].double()
            torch.testing.assert_close(now, before * 0.37, rtol=1e-2, atol=0)


def test_island_groups_are_separate_from_the_buffer_groups():
    # one storage per group (one fused launch each): no group mixes the island and a buffer
    _, _, state, _, _, islands = build(2, 0, scale=SCALE)
    for g in state.norm_groups + state.scale_groups:
        assert len({v.untyped_storage().data_ptr() for v in g}) == 1
    for t, island in zip(state.targets, islands, strict=True):
        assert t.island is island
        for v in t.island_norm_views:
            assert v.untyped_storage().data_ptr() == island.untyped_storage().data_ptr()
        assert t.island_scale_views == [island]
    assert any(t.island_norm_views for t in state.targets)


def test_with_an_fp32_mirror_the_norm_reads_the_mirror_not_the_island():
    # not precision-aware, bf16 grads: the optimizer reads an fp32 mirror of the buffer
    # (megatron_ext's copy step binds it), which after the copy-back equals the island
    child, bufs, state, _, names, islands = build(2, 0, scale=None, decoupled=False)
    bf16_target = state.targets[0]
    assert bf16_target.mirror is not None and bf16_target.island is None
    assert not bf16_target.island_norm_views
    assert state.targets[1].island is islands[1]  # the fp32 buffer has no mirror


@pytest.mark.parametrize("every", [1, 2], ids=["all_offloaded", "every_other"])
@pytest.mark.parametrize(
    "chunk,lean,device",
    [
        (None, False, False),
        (1, False, False),
        (5, False, False),
        (37, False, False),
        (5, True, False),
        (37, True, False),
        (None, False, True),
        (5, False, True),
        (37, False, True),
    ],
    ids=["blocks", "c1", "c5", "c37", "c5_lean", "c37_lean", "device", "c5_device", "c37_device"],
)
def test_host_mirror_gives_the_cpu_the_island_values(chunk, lean, device, every):
    """Per block, and per chunk of the chunked step (chunks that cut island pieces), also
    with lean mirrors (no host gradient copy: only the kernel's reads are there to check)
    and with mirrors that convert on the device (the island copies land in the fp32
    staging the CPU reads in place); every other parameter offloaded cuts the shard into
    several blocks."""
    dp = 2
    blocks_seen, islands_seen = [], []
    for r in range(dp):
        child, bufs, state, reads, names, _ = build(dp, r, scale=SCALE)
        child._flat = state
        child.shard_float16_groups = [
            [p.detach().view(-1)[_rng(child, p)] for p in child.model_float16_groups[0]]
        ]
        shards = {id(s): p for p, s in _pairs(child)}
        sources = offload_sources(child)
        for source in sources:
            offloaded = {
                s: torch.zeros(s.shape, dtype=torch.float32)
                for i, s in enumerate(source.spans)
                if (i + 1) % every == 0
            }
            built = source_mirror(source, offloaded, pin=False, lean=lean, device_convert=device)
            if built is None:
                continue
            mirror, mine = built
            if lean and mirror.grads_dtype != torch.float32:
                assert mirror.cpu_grads is None
            blocks_seen.append(len(mirror.blocks))
            islands_seen += [i for i, b in enumerate(mirror.blocks) if b.islands]
            copies = mirror.blocks
            if chunk is not None:
                runs = chunk_spans([mirror.layout.local(b) for b in mirror.layout.blocks], chunk)
                copies = chunk_copies(mirror, runs)
                assert len(copies) >= len(mirror.blocks)
            if mirror.cpu_grads is not None:
                mirror.cpu_grads.fill_(float("nan"))
                for block in copies:
                    block.start_d2h()
                    block.convert_grads()
                for shard, span in mine:
                    _, grad = mirror.cpu_views(span)
                    want = reads[shards[id(shard)]]
                    torch.testing.assert_close(grad.double(), want, rtol=0, atol=0)
            if chunk is not None:  # what the chunked step reads (scratch, staging, islands)
                for kernel in ("torch", "native"):
                    seen = _kernel_reads(mirror, mine, runs, copies, max(1, chunk // 2), kernel)
                    for shard, span in mine:
                        s = mirror.layout.local(span)
                        want = reads[shards[id(shard)]]
                        torch.testing.assert_close(
                            seen[s.start : s.end], want, rtol=0, atol=0, msg=kernel
                        )
    assert islands_seen
    if every == 2:  # an island past the first block
        assert max(blocks_seen) > 1 and max(islands_seen) > 0


def _kernel_reads(mirror, mine, runs, copies, compute, kernel="torch"):
    """The gradient each mirror element is updated with by ChunkedAdamW.update, NaN where
    none; the staging filled, cpu_grads poisoned. ``kernel`` "torch": through a spy on
    torch's fused kernel; "native": what each of the compiled kernel's tasks points its
    gradients at, read just before the call."""
    import ctypes

    from megatron_ext.offload import host_kernel as native

    entries = []
    for _, span in mine:
        data, _ = mirror.cpu_views(span)
        opt = torch.optim.AdamW([data], fused=True)
        entries.append(HostParam(data, mirror.layout.local(span), opt, 0))
    stepper = ChunkedAdamW(
        mirror.host_params, mirror.cpu_grads, entries, [r for _, r in runs], compute,
        kernel=kernel,
    )  # fmt: skip
    seen = torch.full((mirror.layout.numel,), float("nan"), dtype=torch.float64)
    base = mirror.host_params.data_ptr()
    real = torch._fused_adamw_
    real_run = native.HostAdamW.run

    def spy(params, grads, *args, **kwargs):
        for p, g in zip(params, grads, strict=True):
            at = (p.data_ptr() - base) // p.element_size()
            seen[at : at + p.numel()] = g.double()
        return real(params, grads, *args, **kwargs)

    def spy_run(self, tasks, *args, **kwargs):
        for t in tasks:
            if t.family < 0:
                continue  # padding, only packed
            dtype, size = {0: (torch.bfloat16, 2), 2: (torch.float32, 4)}[t.grad_kind]
            raw = (ctypes.c_uint8 * (t.n * size)).from_address(t.grad)
            at = (t.param - base) // 4
            seen[at : at + t.n] = torch.frombuffer(raw, dtype=dtype).double()
        return real_run(self, tasks, *args, **kwargs)

    for block in copies:
        block.start_d2h()
    if mirror.cpu_grads is not None and any(b.convert is not None for b in copies):
        mirror.cpu_grads.fill_(float("nan"))  # converted into the scratch, not read here
    stepper.begin()
    torch._fused_adamw_ = spy
    native.HostAdamW.run = spy_run
    try:
        for i, block in enumerate(copies):
            stepper.update(i, block)
        stepper.finish()
    finally:
        torch._fused_adamw_ = real
        native.HostAdamW.run = real_run
    assert stepper.uses_native is (kernel == "native")
    return seen


def test_a_stray_island_piece_is_refused():
    child, bufs, state, reads, names, _ = build(2, 0, scale=SCALE)
    child._flat = state
    child.shard_float16_groups = [
        [p.detach().view(-1)[_rng(child, p)] for p in child.model_float16_groups[0]]
    ]
    source = offload_sources(child)[0]
    assert source.island
    bad = types.SimpleNamespace(**vars(source))
    bad.island = ((Span(1, 3), source.island[0][1][:2]),)
    offloaded = {s: torch.zeros(s.shape, dtype=torch.float32) for s in source.spans}
    with pytest.raises(RuntimeError, match="matches no parameter"):
        source_mirror(bad, offloaded, pin=False)


def _rng(child, p):
    r = child._get_model_param_range_map(p)["param"]
    return slice(r.start, r.end)


def _pairs(child):
    return [
        *zip(child.model_float16_groups[0], child.shard_float16_groups[0], strict=True),
        *zip(child.model_fp32_groups[0], child.shard_fp32_groups[0], strict=True),
    ]


def test_fp32_buffer_island_is_read_too():
    # fp32 parameters matching a pattern: an island on an fp32 buffer (no mirror ever)
    per_rank = [build(2, r, scale=SCALE, decoupled=False) for r in range(2)]
    fp32_reads = 0.0
    for x in per_rank:
        for p, v in x[3].items():
            if p.dtype == FP32 and param_is_not_shared(p):
                fp32_reads += v.square().sum().item()
    got = sum(
        ops.local_power_stat(
            [x[2].targets[1].norm_views, x[2].targets[1].island_norm_views],
            2.0,
            torch.device("cpu"),
        )
        .double()
        .item()
        for x in per_rank
    )
    assert math.isclose(got, fp32_reads, rel_tol=1e-6)


def test_island_offsets_must_be_in_the_island():
    child, bufs, state, reads, names, islands = build(1, 0, scale=None)
    p = bufs[0].buckets[0].params_with_extra_main_grads[0]
    p.main_grad = torch.zeros_like(p.main_grad)  # replaced after DDP carved the island
    placed = [(b, buffer_layout(b, names), isl) for b, isl in zip(bufs, islands, strict=True)]
    with pytest.raises(RuntimeError, match="not in its buffer's fp32 island"):
        _build_state(child, placed)


_ = DistributedOptimizer  # the stand-in's class (imported for its range functions)


def test_a_zero_size_island_parameter_does_not_claim_its_neighbour():
    # megatron-core lays a zero-size parameter out at its neighbour's start; if only the
    # zero-size one matches the pattern, the neighbour is still read in the buffer
    buf = types.SimpleNamespace(
        grad_data=torch.randn(256),
        numel=256,
        param_index_map={},
        extra_main_grads=[],
        buckets=[types.SimpleNamespace(params_with_extra_main_grads=[])],
    )
    empty, full = torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.zeros(100))
    buf.param_index_map = {empty: (64, 64, 0), full: (64, 164, 0)}
    empty.main_grad = torch.zeros(0)
    buf.buckets[0].params_with_extra_main_grads = [empty]
    island = DistributedDataParallel._carve_fp32_island(None, buf)
    from megatron_ext.targets import island_offsets

    assert island_offsets(buf, island) == {}
