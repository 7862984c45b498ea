"""The offload plan, on the CPU: which elements each block holds (layout) and when each
block's copies run (schedule); pure data."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from buffers.spans import (
    dp_shard_spans,
    intersect_spans,
    merge_spans,
    subtract_spans,
)
from megatron_ext.offload.mirror_plan import (
    MirrorLayout,
    copy_schedule,
    mirror_layout,
    offload_blocks,
)
from tests.support.offload_sim import (
    S,
)

pytestmark = pytest.mark.mcore


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
