"""benchmarks/common.py's statistics and rounds: percentiles, bursts, interleaving, spread."""

from __future__ import annotations

import pytest
import torch

from tests.support.bench_scripts import load_script


def test_percentile_nearest_rank():
    common = load_script("common")
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert common.percentile(values, 0) == 1.0
    assert common.percentile(values, 50) == 3.0
    assert common.percentile(values, 100) == 5.0
    assert common.percentile([7.0], 90) == 7.0


def test_burst_host_times_counts_every_call():
    import torch

    common = load_script("common")
    calls = []
    times = common.burst_host_times(lambda: calls.append(1), torch.device("cpu"), 4, 3)
    assert len(times) == 3 and len(calls) == 12 and all(t >= 0 for t in times)


def test_interleave_keeps_a_failing_measure_out_of_later_rounds():
    common = load_script("common")
    calls = []

    def bad(r):
        calls.append(r)
        raise ValueError("boom")

    results, errors = common.interleave({"ok": lambda r: r * 2, "bad": bad}, 3)
    assert results == {"ok": [0, 2, 4]} and calls == [0] and isinstance(errors["bad"], ValueError)


def test_spread_warning_only_past_twenty_percent():
    common = load_script("common")
    assert common.spread([1.0, 1.2, 1.1]) == pytest.approx(0.2)
    assert common.spread_warning({"a": 0.2, "b": 0.05}, 5) is None
    line = common.spread_warning({"a": 0.21, "b": 0.05, "c": 3.0}, 5)
    assert line.startswith("warning: 2 of 3 measurements spread more than 20%")
    assert "(worst: c, 300%)" in line and "\n" not in line
    fields = common.round_fields("time", [3.0, 2.0, 2.5])
    assert fields == {"time_s": 2.0, "time_spread": 0.5, "time_rounds_s": [3.0, 2.0, 2.5]}


def test_noise_line_gives_the_median_and_worst_spread_and_the_ratio_that_is_noise():
    common = load_script("common")
    cpu = torch.device("cpu")
    line = common.noise_line({"a": 0.1, "b": 0.3, "c": 3.0}, 5, cpu)
    # median 30%: each side of a ratio may be 1.3x off, so ratios under 1.3**2 = 1.69x
    assert line == (
        "CPU timings on a shared machine: median spread 30%, worst 300%; "
        "treat ratios under 1.7x as noise"
    )
    assert "worst >999%" in common.noise_line({"a": 0.01, "b": 309.82}, 5, cpu)
    assert common.noise_line({"a": 0.01, "b": 0.02}, 5, cpu).endswith("under 1.1x as noise")
    assert "no spread was measured" in common.noise_line({"a": 0.0}, 1, cpu)
    worst = common.noise_line({"a": 306.98, "b": 400.0}, 5, cpu)  # still one short line
    assert worst.endswith("median spread >999%, worst >999%; every ratio is noise")
    assert len(worst) <= 100
