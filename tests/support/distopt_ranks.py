"""The distributed optimizer's data-parallel ranks simulated one by one on the CPU (test
support): fake gradient buffers padded as megatron-core pads them, each rank's optimizer
built by megatron-core's own range functions (:func:`child_for_rank`), and the sum of the
ranks' per-parameter norms as the all-reduce would make it (:func:`reduce_ranks`).
"""

import types

import torch
import torch.distributed as dist
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from buffers.param_norms import gather_union, to_wire
from megatron_ext.layout import buffer_layout
from tests.support.fakes import FakeGroup, megatron_buffer

BF16, FP32 = torch.bfloat16, torch.float32


def layout(specs, dp, bucket_elems):
    """(param_index_map, bucket ranges, numel) the way megatron-core pads them: every
    parameter starts 64-aligned, every bucket ends at a multiple of 64 * dp elements."""
    index, buckets, pos, start, bucket = {}, [], 0, 0, 0
    for i, p in enumerate(specs):
        pos = -(-pos // 64) * 64
        index[p] = (pos, pos + p.numel(), bucket)
        pos += p.numel()
        if pos - start >= bucket_elems or i == len(specs) - 1:
            end = -(-pos // (64 * dp)) * (64 * dp)
            buckets.append((start, end))
            start, pos, bucket = end, end, bucket + 1
    return index, buckets, pos


def fake_buffer(params, dtype, dp, rank, bucket_elems, gen):
    index, buckets, numel = layout(params, dp, bucket_elems)
    grad = torch.zeros(numel, dtype=dtype)
    for s, e, _ in index.values():
        grad[s:e] = (torch.randn(e - s, generator=gen, dtype=torch.float64) * 3).to(dtype)
    return megatron_buffer(grad, index, buckets, FakeGroup(rank, dp))


def model(seed=0, fp32_sizes=(64, 40)):
    """bf16 parameters that straddle bucket and shard boundaries, a shared one, and a small
    fp32 buffer (a sink and a kept-in-fp32 weight) that some ranks own none of."""
    torch.manual_seed(seed)
    bf16 = [torch.nn.Parameter(torch.zeros(n, dtype=BF16)) for n in (300, 1000, 77, 2500, 130)]
    bf16[2].shared = True
    fp32 = [torch.nn.Parameter(torch.zeros(n, dtype=FP32)) for n in fp32_sizes]
    names = {p: f"bf16.{i}" for i, p in enumerate(bf16)} | {
        p: f"fp32.{i}" for i, p in enumerate(fp32)
    }
    return bf16, fp32, names


def child_for_rank(dp, rank, *, scaled=False, seed=1, fp32_sizes=(64, 40)):
    bf16, fp32, names = model(fp32_sizes=fp32_sizes)
    gen = torch.Generator().manual_seed(seed)
    bufs = [
        fake_buffer(bf16, BF16, dp, rank, 1500, gen),
        fake_buffer(fp32, FP32, dp, rank, 10**6, gen),
    ]
    child = object.__new__(DistributedOptimizer)
    child.config = types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)
    child.grad_scaler = object() if scaled else None
    child.tp_group = child.expert_tp_group = FakeGroup(0, 1)
    child.buffers = bufs
    child.gbuf_ranges = [DistributedOptimizer._build_gbuf_range_map(b) for b in bufs]
    child.model_param_gbuf_map = DistributedOptimizer._build_model_param_gbuf_map(child.gbuf_ranges)
    groups = [{"params": bf16 + fp32}]
    _, group_ranges = DistributedOptimizer._build_optimizer_group_ranges(groups, child.gbuf_ranges)
    held = group_ranges[0]["params"]

    def shard(p):
        r = child._get_model_param_range_map(p)["param"]
        return p.detach().view(-1)[r.start : r.end]

    child.model_float16_groups = [[p for p in held if p.dtype == BF16]]
    child.shard_fp32_from_float16_groups = [[shard(p).float() for p in held if p.dtype == BF16]]
    child.model_fp32_groups = [[p for p in held if p.dtype == FP32]]
    child.shard_fp32_groups = [[shard(p) for p in held if p.dtype == FP32]]
    for p in held:  # what DDP binds: views of the grad buffer
        buf = bufs[child.model_param_gbuf_map[p][0]]
        s, e, _ = buf.param_index_map[p]
        p.main_grad = buf.grad_data[s:e]
    placed = [(b, buffer_layout(b, names), None) for b in bufs]
    return child, bufs, placed, held


def reduce_ranks(monkeypatch, per_rank):
    """Sum every rank's wire vector as one all-reduce would; names gathered as
    all_gather_object would. ``per_rank``: MegatronParamNorms, one per rank."""
    everyone = [(pn.names, pn.counted) for pn in per_rank]

    def all_gather_object(gathered, obj, group=None):
        assert obj in everyone
        gathered[:] = everyone

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: len(everyone))
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    unions = [gather_union(pn.names, pn.counted, None, torch.device("cpu")) for pn in per_rank]
    assert all(u.names == unions[0].names for u in unions)
    summed = sum(to_wire(pn.local(2.0), u) for pn, u in zip(per_rank, unions, strict=True))
    return unions[0], summed.sqrt()
