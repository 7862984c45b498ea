"""Span arithmetic (buffers/spans.py): merge, intersect, subtract, shard, translate."""

import pytest

from buffers.spans import (
    Span,
    dp_shard_spans,
    intersect_spans,
    merge_spans,
    subtract_spans,
    to_local,
)

S = Span


def test_span_algebra():
    assert merge_spans([Span(5, 9), Span(0, 3), Span(3, 4), Span(7, 12), Span(2, 2)]) == (
        Span(0, 4),
        Span(5, 12),
    )
    assert intersect_spans([Span(0, 10), Span(20, 30)], [Span(5, 25)]) == (
        Span(5, 10),
        Span(20, 25),
    )
    assert intersect_spans([Span(0, 4)], [Span(4, 8)]) == ()
    with pytest.raises(ValueError):
        Span(3, 2)


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 8])
def test_dp_shards_partition_each_bucket(dp):
    buckets = [Span(0, 24 * dp), Span(24 * dp, 40 * dp)]
    shards = [dp_shard_spans(buckets, dp, r) for r in range(dp)]
    covered = sorted(s for rank in shards for s in rank)
    assert merge_spans(covered) == (Span(0, 40 * dp),)
    assert sum(s.numel for s in covered) == 40 * dp  # no overlap


def test_dp_shard_errors():
    with pytest.raises(ValueError, match="multiple of dp_size=4"):
        dp_shard_spans([Span(0, 10)], 4, 0)
    with pytest.raises(ValueError, match="dp_rank"):
        dp_shard_spans([Span(0, 8)], 2, 2)


def test_subtract_spans():
    assert subtract_spans([S(0, 100)], [S(10, 20), S(50, 60)]) == (S(0, 10), S(20, 50), S(60, 100))
    assert subtract_spans([S(0, 10), S(20, 30)], [S(5, 25)]) == (S(0, 5), S(25, 30))
    assert subtract_spans([S(0, 10)], []) == (S(0, 10),)
    assert subtract_spans([S(0, 10)], [S(0, 10)]) == ()


def test_to_local_concatenates_owned_ranges():
    owned = (Span(10, 20), Span(100, 110))
    assert to_local([Span(12, 18), Span(100, 104)], owned) == (Span(2, 8), Span(10, 14))
    assert to_local(owned, owned) == (Span(0, 20),)
