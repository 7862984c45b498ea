"""norm_clip.py at CPU sizes: records, rounds, the stock arm's process and its faults, the
tables and the printed summary."""

from __future__ import annotations

import contextlib
import io
import json
import re
import statistics
import sys
from pathlib import Path

import pytest
import torch

from tests.support.bench_scripts import load_script, read_outputs

ROOT = Path(__file__).resolve().parents[1]
FILE = re.compile(r"(\w+\.py):\d+\(")  # a profile line's file:line(function)

pytestmark = pytest.mark.mcore


@pytest.fixture(scope="module")
def norm_clip_run(tmp_path_factory):
    script = load_script("norm_clip")
    out = tmp_path_factory.mktemp("norm_clip")
    argv = ["--device", "cpu", "--out", str(out), "--scale", "0.004", "--warmup", "0"]
    argv += ["--reps", "1", "--scaling-counts", "80,200", "--scaling-bytes", "32768"]
    returned = script.main(argv)
    return script, returned, read_outputs(out, "norm_clip")


def test_norm_clip_records_have_documented_fields(norm_clip_run):
    script, returned, records = norm_clip_run
    assert records == json.loads(json.dumps(returned))
    for r in records:
        assert set(script.RECORD_FIELDS) <= set(r)
    rows = {(r["inventory"], r["variant"], r["op"]) for r in records}
    invs = {"dense_gpt", "deepseek_moe", "scaling_80", "scaling_200"}
    variants = {"megatron", "upstream_fix", "torch", "flat"}
    assert rows == {(i, v, o) for i in invs for v in variants for o in script.OPS}


def test_norm_clip_stock_rows_run_in_their_own_process(norm_clip_run):
    script, _, records = norm_clip_run
    for r in records:
        assert r["isolated"] is (r["variant"] in script.STOCK), r
        assert r["status"] == "ok", r


def test_norm_clip_flat_matches_fp64_reference(norm_clip_run):
    _, _, records = norm_clip_run
    flat = [r for r in records if r["variant"] == "flat"]
    assert flat
    for r in flat:
        assert r["error"] is None
        assert r["rel_err"] <= 1e-5, r
        assert r["time_s"] > 0 and r["host_time_s"] > 0 and r["ratio"] > 0


def test_norm_clip_cpu_rows(norm_clip_run):
    script, _, records = norm_clip_run
    for r in records:
        assert r["host_syncs"] is None  # nothing to count on the CPU
        assert r["time_kind"] == "perf_counter"
        if r["variant"] == "megatron":
            assert r["note"] == "per-parameter algorithm re-implemented for CPU"


def test_norm_clip_registry_hook_adds_a_row(tmp_path, monkeypatch):
    script = load_script("norm_clip")

    def flat_again(named, device):
        prep = script.VARIANTS["flat"](named, device)
        prep.fields = {"variant": "flat", "path": "megatron_spans"}
        return prep

    monkeypatch.setitem(script.VARIANTS, "flat_megatron_spans", flat_again)
    argv = ["--device", "cpu", "--out", str(tmp_path), "--scale", "0.002", "--reps", "1"]
    argv += ["--ops", "norm", "--variants", "flat,flat_megatron_spans", "--scaling-counts", ""]
    records = script.main(argv)
    paths = {(r["inventory"], r["variant"], r["path"]) for r in records}
    assert ("deepseek_moe", "flat", "megatron_spans") in paths
    assert ("deepseek_moe", "flat", None) in paths


def test_norm_clip_host_percentiles_bracket_the_median(norm_clip_run):
    _, _, records = norm_clip_run
    timed = [r for r in records if r["host_time_s"] is not None]
    assert timed
    for r in timed:
        assert r["host_time_p10_s"] <= r["host_time_s"] <= r["host_time_p90_s"]


def test_norm_clip_burst_host_time_only_for_our_rows(norm_clip_run):
    _, _, records = norm_clip_run
    timed = [r for r in records if r["host_time_s"] is not None]
    ours = [r for r in timed if r["variant"] == "flat"]
    assert ours and len(ours) < len(timed)
    for r in timed:
        if r["variant"] == "flat":
            assert r["host_time_burst_s"] > 0
        else:
            assert r["host_time_burst_s"] is None


def test_norm_clip_rounds_interleave_the_floor_and_every_row():
    """A slow moment on the machine must not land on one row: every round times the floor's
    copy and every (variant, op) in turn, and each reports its fastest round."""
    script = load_script("norm_clip")
    common = sys.modules["benchmarks.common"]
    order = []

    def prep(name):
        return script.Prepared(
            [], lambda: order.append((name, "norm")), lambda m: order.append((name, m))
        )

    class Floor(common.CopyFloor):
        def measure(self, warmup, reps):
            order.append("copy")
            return super().measure(warmup, reps)

    preps = {"flat": prep("flat"), "torch": prep("torch")}
    keys = [(v, op) for v in preps for op in ("norm", "clip")]
    floor = Floor(1024, torch.device("cpu"))
    results, errors = script.time_rounds(preps, keys, floor, torch.device("cpu"), 0, 6, 3)
    assert not errors and set(results) == {script.COPY, *keys}
    # the rounds: copy, flat norm, flat clip, torch norm, torch clip; then again
    starts = [i for i, k in enumerate(order) if k == "copy"]
    assert len(starts) == 3
    firsts = [[k for j, k in enumerate(order[s:]) if j == 0 or order[s + j - 1] != k][:5]
              for s in starts]  # fmt: skip
    assert all(f == ["copy", ("flat", "norm"), ("flat", 0.0), ("torch", "norm"),
                     ("torch", 0.0)] for f in firsts)  # fmt: skip
    for key in keys:
        assert len(results[key]) == 3
        fields = script.timed_fields(results[key])
        assert fields["time_s"] == min(r["time"] for r in results[key])
        assert fields["time_rounds_s"] == [r["time"] for r in results[key]]
        # host time: the same statistic as the time (on the CPU, the same call)
        assert fields["host_time_s"] == min(statistics.median(r["host"]) for r in results[key])
        assert 0 < fields["host_time_p10_s"] <= fields["host_time_s"] <= fields["host_time_p90_s"]
        assert (fields["host_time_burst_s"] is not None) == (key[0] == "flat")


def test_norm_clip_warns_when_rounds_spread_and_ratios_use_this_runs_fastest_copy(
    tmp_path, monkeypatch, capsys
):
    script = load_script("norm_clip")
    common = sys.modules["benchmarks.common"]
    copies = iter([4e-3, 1e-3, 2e-3])  # the copy's three rounds: the fastest is the floor
    monkeypatch.setattr(common.CopyFloor, "measure", lambda self, w, r: next(copies))
    argv = ["--device", "cpu", "--out", str(tmp_path), "--scale", "0.002", "--reps", "3"]
    argv += ["--rounds", "3", "--ops", "norm", "--variants", "flat", "--scaling-counts", ""]
    monkeypatch.setattr(
        script, "build_inventories", lambda args, device: [script.inventories.model_stage(
            "dense_gpt", 65536)]
    )  # fmt: skip
    (rec,) = script.main(argv)
    assert rec["floor_spread"] == pytest.approx(3.0) and rec["rounds"] == 3
    assert rec["bandwidth_Bps"] == pytest.approx(2 * rec["bytes"] / 1e-3, rel=1e-3)
    assert rec["ratio"] == pytest.approx(rec["time_s"] / rec["floor_s"])
    assert rec["time_s"] == min(rec["time_rounds_s"]) and len(rec["time_rounds_s"]) == 3
    out = capsys.readouterr().out.splitlines()
    # one line on noise, from this run's two measurements: the row and the copy (300%)
    spreads = {"dense_gpt flat norm": rec["time_spread"], "dense_gpt copy (floor)": 3.0}
    assert out[0] == common.noise_line(spreads, 3, torch.device("cpu"))


def test_tables_end_with_a_legend_of_their_columns(norm_clip_run):
    script, _, records = norm_clip_run
    common = load_script("common")
    table = common.format_table([r | script.table_fields(r) for r in records], script.TABLE)
    legend = table.split("\ncolumns:\n", 1)[1]
    for header in ("ratio", "burst us", "syncs", "rel err", "floor ms", "variant"):
        assert f"  {header}: " in legend, header
    assert "fp64" in legend and "transformer-engine" in legend


def test_cpu_megatron_rows_are_labelled_as_a_reimplementation(norm_clip_run):
    script, _, records = norm_clip_run
    labels = {script.row_label(r) for r in records if r["variant"] == "megatron"}
    assert labels == {"megatron/cpu_reimpl"}  # the table's and the plot's label


def test_norm_clip_host_profile_names_our_functions(tmp_path):
    script = load_script("norm_clip")
    argv = ["--device", "cpu", "--out", str(tmp_path), "--scale", "0.002", "--reps", "1"]
    argv += ["--ops", "norm,per_param", "--variants", "flat", "--scaling-counts", ""]
    records = script.main(argv + ["--host-profile", "3"])
    assert records and all(len(r["host_profile"]) > 0 for r in records)
    # which of our functions lead depends on the machine's timings: any module of the package
    # named in every record's profile (a profile of something else names none)
    ours = {f.name for f in (ROOT / "buffers").glob("*.py")} - {"__init__.py"}
    for r in records:
        named = {m.group(1) for line in r["host_profile"] for m in [FILE.search(line)] if m}
        assert named & ours, (r["op"], r["host_profile"])
    off = script.main(argv)  # off by default: no field filled
    assert all(r["host_profile"] is None for r in off)
    with pytest.raises(SystemExit):
        script.parse_args(argv + ["--host-profile", "-1"])


# --- stock arms in their own processes: a crash or a wrong norm is a row ---------------------

# Each cell's fault: the stock arm raises at dense_gpt, aborts (as a native crash would) at
# deepseek_moe, returns 1.5 times the norm at scaling_80 and is right at scaling_200.
FAULTS = "raise:dense_gpt,abort:deepseek_moe,wrong_norm:scaling_80"


@pytest.fixture(scope="module")
def faulty_stock_run(tmp_path_factory):
    script = load_script("norm_clip")
    out = tmp_path_factory.mktemp("faulty")
    argv = ["--device", "cpu", "--out", str(out), "--scale", "0.002", "--warmup", "0"]
    argv += ["--reps", "1", "--rounds", "1", "--ops", "norm,clip", "--variants", "megatron,flat"]
    argv += ["--scaling-counts", "80,200", "--scaling-bytes", "32768"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BENCHMARKS_STOCK_FAULT", FAULTS)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            script.main(argv)
    records = read_outputs(out, "norm_clip")
    by = {(r["inventory"], r["variant"], r["op"]): r for r in records}
    return by, printed.getvalue(), (out / "norm_clip.txt").read_text()


def test_a_crashing_stock_arm_is_a_row_and_the_run_goes_on(faulty_stock_run):
    by, printed, full = faulty_stock_run
    assert len(by) == 4 * 2 * 2  # every inventory, variant and op has its row
    for op in ("norm", "clip"):
        crashed = by[("deepseek_moe", "megatron", op)]
        assert crashed["status"] == "crashed (killed by SIGABRT)", crashed
        assert crashed["isolated"] is True and crashed["time_s"] is None
        failed = by[("dense_gpt", "megatron", op)]
        assert failed["status"] == "failed (RuntimeError: fault injected by BENCHMARKS_STOCK_FAULT)"
        # a fresh process after each: the last inventory's stock rows are measured and right
        assert by[("scaling_200", "megatron", op)]["status"] == "ok"
        assert by[("scaling_200", "megatron", op)]["time_s"] > 0
        for inv in ("dense_gpt", "deepseek_moe", "scaling_80", "scaling_200"):
            ours = by[(inv, "flat", op)]
            assert ours["status"] == "ok" and ours["isolated"] is False and ours["time_s"] > 0
    assert "megatron/cpu_reimpl at deepseek_moe: crashed (killed by SIGABRT)" in printed
    summary_row = next(ln for ln in printed.splitlines() if ln.lstrip().startswith("deepseek_moe"))
    assert summary_row.split()[3] == "crashed"
    assert "crashed (killed by SIGABRT)" in full and "failed (RuntimeError: fault injected" in full


def test_a_wrong_stock_norm_is_reported_as_such(faulty_stock_run):
    by, printed, _ = faulty_stock_run
    for op in ("norm", "clip"):
        wrong, ours = by[("scaling_80", "megatron", op)], by[("scaling_80", "flat", op)]
        # ours agrees with the fp64 reference (checked against fp64 above); stock is 1.5x it
        assert ours["norm"] == pytest.approx(ours["norm_ref"], rel=1e-6)
        assert wrong["norm"] == pytest.approx(1.5 * ours["norm"], rel=1e-6)
        assert wrong["status"] == "wrong norm (rel err 5.0e-01)"
    assert "megatron/cpu_reimpl at scaling_80: wrong norm (rel err 5.0e-01)" in printed


def test_the_stock_process_keeps_state_and_reports_errors_and_crashes():
    from benchmarks import isolation  # by its name: the child imports what it runs by name

    with isolation.Child("test-child", timeout_s=120) as child:
        pid = child.call("tests.support.isolated_calls:remember", "k", [1, 2.5])
        assert pid != __import__("os").getpid()
        assert child.call("tests.support.isolated_calls:recall", "k") == [1, 2.5]
        with pytest.raises(isolation.ChildFailed) as failed:
            child.call("tests.support.isolated_calls:boom")
        assert failed.value.fields["error"] == "ValueError: boom in the child"
        assert "isolated_calls.py" in failed.value.fields["error_at"]
        assert not child.usable  # a CUDA error would have poisoned it: callers replace it
        assert child.call("tests.support.isolated_calls:recall", "k") == [1, 2.5]
        with pytest.raises(isolation.ChildCrashed) as crashed:
            child.call("tests.support.isolated_calls:abort_loudly")
        want = "killed by SIGABRT: terminate called: CUDA error: an illegal memory access"
        assert str(crashed.value).startswith(want)
        with pytest.raises(isolation.ChildCrashed):  # dead: says so at once, no hang
            child.call("tests.support.isolated_calls:recall", "k")


def test_fault_injection_names_a_kind_it_knows(monkeypatch):
    isolation = load_script("isolation")
    monkeypatch.setenv("BENCHMARKS_STOCK_FAULT", "abort:a, wrong_norm")
    assert isolation.injected_fault("a") == "abort"
    assert isolation.injected_fault("b") == "wrong_norm"  # no tag: every cell
    monkeypatch.setenv("BENCHMARKS_STOCK_FAULT", "explode:a")
    with pytest.raises(ValueError, match="unknown fault 'explode'"):
        isolation.injected_fault("a")
    monkeypatch.delenv("BENCHMARKS_STOCK_FAULT")
    assert isolation.injected_fault("a") is None


# --- the printed summary: 100 columns, about 30 rows ------------------------------------------

DEFAULT_INVENTORIES = ("dense_gpt", "deepseek_moe") + tuple(
    f"scaling_{n}" for n in (80, 300, 1000, 3000, 10000)
)


def _fake_records(labels: list[tuple[str, str | None]], ops) -> list[dict]:
    """Records of every default inventory, variant and op, with random times; the stock
    arm crashed at deepseek_moe with a long native error line."""
    gen = torch.Generator().manual_seed(7)
    records = []
    for inv in DEFAULT_INVENTORIES:
        for variant, path in labels:
            for op in ops:
                t = float(torch.rand((), generator=gen)) * 1e-2 + 1e-5
                rec = {"inventory": inv, "variant": variant, "path": path, "op": op}
                rec |= {"time_s": t, "ratio": t / 1e-4, "rel_err": 3e-8, "status": "ok"}
                if variant == "megatron" and inv == "deepseek_moe":
                    msg = "killed by SIGABRT: terminate called: " + "CUDA error: illegal " * 9
                    rec |= {"time_s": None, "ratio": None, "status": f"crashed ({msg})"}
                records.append(rec)
    return records


@pytest.mark.parametrize(
    "labels",
    [
        [("megatron", "cpu_reimpl"), ("upstream_fix", None), ("torch", None), ("flat", None)],
        [("megatron", None), ("upstream_fix", None), ("torch", None), ("flat", None)]
        + [("flat", "megatron_spans")],  # CUDA's rows
    ],
)
def test_norm_clip_summary_fits_100_columns_and_about_30_rows(labels, tmp_path):
    script = load_script("norm_clip")
    records = _fake_records(labels, list(script.OPS))
    noise = script.common.noise_line({"a": 0.4, "b": 309.82}, 5, torch.device("cpu"))
    text = script.summary(records, noise, tmp_path / "norm_clip.txt")
    lines = text.splitlines()
    assert max(len(ln) for ln in lines) <= 100, max(lines, key=len)
    assert len(lines) <= 40
    assert lines[0] == noise
    rows = [ln for ln in lines if ln.split() and ln.split()[0] in DEFAULT_INVENTORIES]
    assert len(rows) == len(DEFAULT_INVENTORIES) * len(script.OPS)  # 28: one per cell
    # a peer's cell is its time over ours, to one decimal; the crashed cell says so
    by = {(r["inventory"], r["op"], r["variant"], r["path"]): r for r in records}
    ours = by[("dense_gpt", "clip", "flat", None)]["time_s"]
    torch_time = by[("dense_gpt", "clip", "torch", None)]["time_s"]
    row = next(ln.split() for ln in rows if ln.split()[:2] == ["dense_gpt", "clip"])
    header = next(ln.split() for ln in lines if ln.split()[:2] == ["inventory", "op"])
    want = torch_time / ours
    shown = f"{want:.2f}x" if want < 0.1 else f"{want:.1f}x"
    assert row[header.index("torch") - 1] == shown  # "ours ms" is 2 words, the cells 1
    moe = next(ln.split() for ln in rows if ln.split()[:2] == ["deepseek_moe", "norm"])
    assert moe[3] == "crashed"
    assert any(ln.startswith("megatron") and "deepseek_moe: crashed (killed by SIGABRT" in ln
               for ln in lines)  # fmt: skip
    assert lines[-1] == f"full table: {tmp_path / 'norm_clip.txt'}"
