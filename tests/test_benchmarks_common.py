"""benchmarks/common.py's statistics and rounds: percentiles, bursts, interleaving, spread;
its argument types and the output folder's check."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

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


@pytest.mark.parametrize(
    ("kind", "good", "bad"),
    [
        ("positive_int", {"1": 1, "12": 12}, ["0", "-3", "1.5", "x", ""]),
        ("non_negative_int", {"0": 0, "7": 7}, ["-1", "2.0", "x"]),
        ("fraction", {"1": 1.0, "0.25": 0.25, "1e-3": 1e-3}, ["0", "-1", "1.5", "nan", "inf", "x"]),
        ("positive_float", {"3e-4": 3e-4, "2": 2.0}, ["0", "-1e-5", "nan", "inf", "x"]),
        ("non_negative_float", {"0": 0.0, "0.1": 0.1}, ["-1e-9", "nan", "inf", "x"]),
    ],
)
def test_argument_types_take_their_range_and_refuse_the_rest(kind, good, bad):
    parse = getattr(load_script("common"), kind)
    for text, value in good.items():
        got = parse(text)
        assert got == value and type(got) is type(value), (text, got)
    for text in bad:
        said = f"got ({re.escape(repr(text))}|{re.escape(text)})$"  # as typed, or its value
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            parse(text)


def test_comma_separated_ints_each_in_range():
    parse = load_script("common").ints_at_least(1)
    assert parse("1,2, 8,") == [1, 2, 8] and parse("") == []
    for text in ("1,0", "x", "2,-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_an_output_folder_is_checked_without_creating_it(tmp_path):
    common = load_script("common")
    deep = tmp_path / "a" / "b"
    assert common.unwritable(deep) is None and not (tmp_path / "a").exists()
    assert list(tmp_path.iterdir()) == []  # the scratch file is gone too
    assert common.unwritable(tmp_path) is None
    assert common.unwritable(Path("relative-out")) is None  # under the current folder
    (tmp_path / "f").write_text("")
    assert (
        common.unwritable(tmp_path / "f" / "x")
        == f"{tmp_path / 'f' / 'x'}: {tmp_path / 'f'} is not a folder"
    )
    assert "is not a folder" in common.unwritable(tmp_path / "f")


def test_an_output_folder_where_no_file_can_be_created_is_named(tmp_path, monkeypatch):
    common = load_script("common")

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(common.tempfile, "TemporaryFile", refuse)
    why = common.unwritable(tmp_path / "out")
    assert why == f"{tmp_path / 'out'}: cannot create a file in {tmp_path} (Permission denied)"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="Linux's /proc")
def test_a_folder_of_the_kernels_is_not_writable():
    assert "cannot create a file in /proc" in load_script("common").unwritable(Path("/proc/x"))


def test_the_parser_names_out_or_OUT_in_its_one_line(tmp_path, monkeypatch, capsys):
    common = load_script("common")
    (tmp_path / "f").write_text("")
    bad = tmp_path / "f" / "out"
    monkeypatch.setenv("OUT", str(bad))
    for argv, named in (([], "$OUT"), (["--out", str(bad)], "--out")):
        with pytest.raises(SystemExit) as exc:
            common.base_parser("a benchmark").parse_args(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1, err
        assert f"error: argument {named}: {bad}: {tmp_path / 'f'} is not a folder" in err
    monkeypatch.setenv("OUT", str(tmp_path / "fine"))
    assert common.base_parser("a benchmark").parse_args([]).out == tmp_path / "fine"
    # --help before any check: it writes nothing and exits 0
    with pytest.raises(SystemExit) as exc:
        common.base_parser("a benchmark").parse_args(["--help", "--out", str(bad)])
    assert exc.value.code == 0


def test_interleave_moves_a_bar_at_every_call_only_when_named(monkeypatch):
    common = load_script("common")
    bars = []

    def progress(items, desc):
        bars.append((desc, list(items)))
        return items

    monkeypatch.setattr(common, "progress", progress)
    calls = []
    measures = {k: (lambda r, k=k: calls.append((r, k)) or r) for k in ("a", "b")}
    results, errors = common.interleave(measures, 3, "bench")
    assert bars == [("bench", [(r, k) for r in range(3) for k in ("a", "b")])]
    assert calls == bars[0][1] and results == {"a": [0, 1, 2], "b": [0, 1, 2]} and not errors
    common.interleave(measures, 2)
    assert len(bars) == 1  # no name, no bar


def test_the_parser_shows_the_docstrings_first_paragraph_whole():
    common = load_script("common")
    doc = "A benchmark: the first\nparagraph, on two lines.\n\nDetails that --help leaves out.\n"
    assert common.base_parser(doc).description == "A benchmark: the first paragraph, on two lines."
    assert common.base_parser("One line.").description == "One line."
