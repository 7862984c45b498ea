"""Per-optimizer buffer targets (views, fp32 mirrors) from Megatron-style buffers, on the CPU."""

import dataclasses
import types

import pytest
import torch

from buffers.spans import Span
from megatron_ext.counted_spans import GradRecord
from megatron_ext.layout import buffer_layout
from megatron_ext.targets import buffer_target, mirror_view
from tests.support.fakes import FakeGroup

pytestmark = pytest.mark.mcore


def fake_buffer(dp_rank, dp_size, dtype=torch.bfloat16):
    # two buckets, each a multiple of dp_size; params with 64-aligned starts; one shared
    b0, b1 = 512 * dp_size, 1024 * dp_size
    params = {
        "w0": (0, 100, 0),
        "tied": (128, 200, 0),
        "w1": (256, b0 - 3, 0),
        "w2": (b0, b0 + 70, 1),
        "w3": (b0 + 128, b1 - 1, 1),
    }
    gen = torch.Generator().manual_seed(3)
    grad = torch.zeros(b1, dtype=dtype)
    for start, end, _ in params.values():
        grad[start:end] = torch.randn(end - start, generator=gen).to(dtype)
    buf = types.SimpleNamespace(
        grad_data=grad,
        numel=b1,
        bucket_indices=[(0, b0), (b0, b1)],
        data_parallel_group=FakeGroup(dp_rank, dp_size),
        grad_dtype=dtype,
        param_dtype=dtype,
        param_index_map={},
    )
    records = tuple(
        GradRecord(n, s, e, b, "shared" if n == "tied" else None) for n, (s, e, b) in params.items()
    )
    return buf, records


def layout_for(buf, records):
    return dataclasses.replace(buffer_layout(buf, {}), records=tuple(records))


def test_sharded_norm_views_across_ranks_cover_counted_gradients_once():
    dp = 3
    total = 0.0
    for rank in range(dp):
        buf, records = fake_buffer(rank, dp)
        t = buffer_target(buf, layout_for(buf, records), records, sharded=True, needs_mirror=False)
        total += sum(v.double().square().sum().item() for v in t.norm_views)
        for v in t.norm_views:  # every view is a view of the grad buffer itself
            assert v.untyped_storage().data_ptr() == buf.grad_data.untyped_storage().data_ptr()
    buf, records = fake_buffer(0, dp)
    want = sum(
        buf.grad_data[r.start : r.end].double().square().sum().item()
        for r in records
        if r.excluded_because is None
    )
    assert abs(total - want) <= 1e-12 * want


def test_mirror_holds_this_ranks_shard_in_fp32_and_views_find_params():
    dp, rank = 4, 1
    buf, records = fake_buffer(rank, dp)
    t = buffer_target(buf, layout_for(buf, records), records, sharded=True, needs_mirror=True)
    assert t.mirror.dtype == torch.float32 and t.mirror.numel() == t.spans.owned_numel
    assert t.scale_views == [t.mirror]  # the optimizer reads (and clip scales) the mirror
    for dst, src in t.copies:
        dst.copy_(src)
    for owned in t.spans.owned:
        view = mirror_view(t, owned.start, owned.end)
        assert torch.equal(view, buf.grad_data[owned.start : owned.end].float())
    # a piece of a parameter inside the shard
    lo = t.spans.owned[0].start
    assert torch.equal(mirror_view(t, lo + 3, lo + 9), buf.grad_data[lo + 3 : lo + 9].float())


def test_unsharded_target_scales_the_whole_buffer_and_the_island():
    buf, records = fake_buffer(0, 1, dtype=torch.float32)
    island = torch.ones(64)
    buf.buckets = []  # no parameter accumulates in the island: nothing read from it
    t = buffer_target(
        buf, layout_for(buf, records), records, sharded=False, needs_mirror=False, island=island
    )
    assert t.spans.owned == (Span(0, buf.numel),)
    assert t.mirror is None and t.copies == []
    assert t.island_scale_views == [island] and t.island_norm_views == []
    assert sum(v.numel() for v in t.scale_views) == buf.numel
