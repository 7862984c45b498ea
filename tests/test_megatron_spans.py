"""Span rules of the Megatron integration, on the CPU (no process group, no CUDA)."""

import pytest

from buffers.spans import Span
from megatron_ext.counted_spans import (
    GradRecord,
    counted_runs,
    exclusion_reason,
    rank_spans,
)

pytestmark = pytest.mark.mcore


def rec(name, start, end, bucket=0, why=None):
    return GradRecord(name, start, end, bucket, why)


def test_exclusion_rules_follow_megatron():
    base = dict(
        shared=False, tensor_model_parallel=False, is_expert=False, tp_rank=0, expert_tp_rank=None
    )
    assert exclusion_reason(**base) is None
    assert exclusion_reason(**{**base, "shared": True}) == "shared"
    assert "duplicate" in exclusion_reason(**{**base, "tp_rank": 1})
    assert exclusion_reason(**{**base, "tp_rank": 1, "tensor_model_parallel": True}) is None
    # expert parameters use the expert tensor-parallel rank when it is known
    expert = {**base, "is_expert": True, "tp_rank": 1, "expert_tp_rank": 0}
    assert exclusion_reason(**expert) is None
    assert "rank 1" in exclusion_reason(**{**expert, "tp_rank": 0, "expert_tp_rank": 1})
    with pytest.raises(ValueError, match="expert tensor-parallel rank"):
        exclusion_reason(**{**expert, "expert_tp_rank": None})


def test_counted_runs_bridge_padding_but_not_excluded_params():
    records = [
        rec("a", 0, 10),
        rec("b", 64, 70),  # gap 10..64 is padding: bridged
        rec("c", 128, 140, why="shared"),
        rec("d", 192, 200),
        rec("e", 256, 300),
    ]
    assert counted_runs(records) == (Span(0, 70), Span(192, 300))


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 8])
def test_sharded_norm_spans_partition_the_counted_elements(dp):
    # two buckets, each a multiple of dp (Megatron pads them), params with padding gaps
    b0, b1 = 512 * dp, 1024 * dp
    records = [
        rec("w0", 0, 100),
        rec("dup", 128, 200, why="shared"),
        rec("w1", 256, b0 - 7),
        rec("w2", b0, b0 + 50, bucket=1),
        rec("w3", b0 + 64, b1 - 1, bucket=1),
    ]
    buckets = [Span(0, b0), Span(b0, b1)]
    per_rank = [rank_spans(records, b1, buckets, dp, r) for r in range(dp)]
    elements = [i for rs in per_rank for s in rs.norm for i in range(s.start, s.end)]
    assert len(elements) == len(set(elements))  # no element counted by two ranks
    want = {i for r in records if r.excluded_because is None for i in range(r.start, r.end)}
    assert want <= set(elements)  # every counted element counted somewhere
    assert not set(range(128, 200)) & set(elements)  # the shared one nowhere
    padding = sum(rs.padding_in_norm for rs in per_rank)
    assert len(elements) - padding == len(want)  # the rest is padding, and is accounted
    assert sum(rs.owned_numel for rs in per_rank) == b1


def test_unsharded_owns_everything():
    rs = rank_spans([rec("a", 0, 5), rec("b", 64, 80, why="shared")], 128)
    assert rs.owned == (Span(0, 128),)
    assert rs.norm == (Span(0, 5),)
    assert rs.padding_in_norm == 0


def test_our_alignment_is_the_one_megatron_core_pads_parameter_starts_to():
    from buffers.plan import ALIGN

    param_layout = pytest.importorskip(
        "megatron.core.optimizer.param_layout", reason="before 0.19 megatron-core pads inline"
    )
    pads = [param_layout.pad_param_start(i) for i in (0, 1, ALIGN - 1, ALIGN, ALIGN + 1)]
    assert pads == [0, ALIGN, ALIGN, ALIGN, 2 * ALIGN]
