"""CPU smoke tests of the benchmark scripts: tiny sizes, documented fields, outputs written."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import statistics
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """Import ``benchmarks/<name>.py`` from its file, as ``python benchmarks/<name>.py`` would."""
    spec = importlib.util.spec_from_file_location(
        f"bench_{name}", ROOT / "benchmarks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def read_outputs(out: Path, name: str) -> list[dict]:
    assert (out / f"{name}.png").stat().st_size > 0
    return json.loads((out / f"{name}.json").read_text())


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


def test_memory_layout_rows(tmp_path):
    script = load_script("memory")
    script.main(["--device", "cpu", "--out", str(tmp_path)])
    records = read_outputs(tmp_path, "memory")
    assert {r["model"] for r in records} == {"deepseek_tp1_pp32_ep8", "dense70b_tp8_pp8"}
    for r in records:
        assert r["kind"] == "layout"
        assert set(script.LAYOUT_FIELDS) <= set(r)
        assert r["ours_bytes"] < r["fp32_bytes"]
        assert r["fp32_minus_ours_gib"] == pytest.approx(
            (r["fp32_bytes"] - r["ours_bytes"]) / 2**30
        )


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


def test_clip_step_rows_and_folded_agreement(tmp_path):
    script = load_script("clip_step")
    argv = ["--device", "cpu", "--out", str(tmp_path), "--bytes", "65536"]
    returned = script.main(argv + ["--warmup", "0", "--reps", "1"])
    records = read_outputs(tmp_path, "clip_step")
    assert records == json.loads(json.dumps(returned))
    assert [r["variant"] for r in records] == list(script.VARIANTS)
    for r in records:
        assert set(script.RECORD_FIELDS) <= set(r)
        assert r["error"] is None and r["time_s"] > 0
    folded = records[-1]
    # the folded clip leaves the same clipped gradients as the explicit one (bf16 rounding)
    assert folded["grad_rel_err"] < 2**-7
    by = {r["variant"]: r for r in records}
    assert by["clip"]["clip_cost_s"] == by["clip"]["time_s"]  # the clip alone: its own time
    assert by["clip+step"]["clip_cost_s"] == by["clip+step"]["time_s"] - by["step"]["time_s"]


def test_percentile_nearest_rank():
    common = load_script("common")
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert common.percentile(values, 0) == 1.0
    assert common.percentile(values, 50) == 3.0
    assert common.percentile(values, 100) == 5.0
    assert common.percentile([7.0], 90) == 7.0


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


def test_burst_host_times_counts_every_call():
    import torch

    common = load_script("common")
    calls = []
    times = common.burst_host_times(lambda: calls.append(1), torch.device("cpu"), 4, 3)
    assert len(times) == 3 and len(calls) == 12 and all(t >= 0 for t in times)


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


# --- every script: --help, where it runs from, where it writes, what it says --------------

SCRIPTS = (
    "norm_clip", "memory", "offload", "offload_step", "clip_step", "train_step", "cpu_norm"
)  # fmt: skip
HELPERS = (
    "common", "inventories", "norm_clip_variants", "norm_clip_measure", "norm_clip_stock",
    "norm_clip_report", "memory_ddp", "isolation",
)  # fmt: skip
NOTICES = ("Transformer Engine and Apex", "absl.logging", "CUDA_HOME")


def test_every_script_and_helper_is_known():
    on_disk = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - {"__init__"}
    assert on_disk == set(SCRIPTS) | set(HELPERS)
    assert tuple(f"{s}.py" for s in SCRIPTS) == load_script("common").SCRIPTS


class _Parsed(Exception):
    pass


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_gives_every_options_meaning_and_default(name, monkeypatch):
    import argparse

    script = load_script(name)
    parsers = []

    def record(self, *args, **kwargs):
        parsers.append(self)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", record)
    with pytest.raises(_Parsed):
        script.main(["--help"])
    (parser,) = parsers
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert {"--device", "--out"} <= {s for a in options for s in a.option_strings}
    for action in options:
        assert action.help and "default" in action.help, (name, action.option_strings)


# Runs each file as ``python path/to/benchmarks/X.py --help`` would (as __main__, from another
# directory, the repository not on sys.path), one after another in one interpreter: one
# start-up of torch and megatron-core instead of one per file.
RUN_EACH_AS_MAIN = """
import contextlib, io, json, runpy, sys
files, results = sys.argv[1:], {}
for path in files:
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    sys.argv = [path, "--help"]
    out, err, code = io.StringIO(), io.StringIO(), None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code
    results[path] = {"code": code, "out": out.getvalue(), "err": err.getvalue()}
    sys.path[:] = saved_path  # the next file must find the repository by itself again
    for name in set(sys.modules) - saved_modules:
        if name == "benchmarks" or name.startswith("benchmarks."):
            del sys.modules[name]
print(json.dumps(results))
"""


def test_scripts_run_from_elsewhere_and_helpers_say_what_to_run(tmp_path):
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONWARNINGS")}
    paths = {name: str(ROOT / "benchmarks" / f"{name}.py") for name in SCRIPTS + HELPERS}
    proc = subprocess.run(
        [sys.executable, "-c", RUN_EACH_AS_MAIN, *paths.values()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    for notice in NOTICES:  # megatron-core's harmless notices stay hidden
        assert notice not in proc.stderr, proc.stderr
    results = json.loads(proc.stdout)
    for name, path in paths.items():
        got = results[path]
        if name in SCRIPTS:
            assert got["code"] == 0, (name, got["err"])
            assert got["out"].startswith("usage:") and "--out OUT" in got["out"], name
        else:  # a message, exit status 1
            assert isinstance(got["code"], str), (name, got)
            assert f"benchmarks/{name}.py is a helper module of" in got["code"], name
            assert "--help" in got["code"]
    assert list(tmp_path.iterdir()) == []  # --help writes nothing


def test_out_comes_from_the_flag_then_OUT_then_bench_out(tmp_path, monkeypatch):
    script = load_script("memory")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OUT", str(tmp_path / "from_env"))
    script.main(["--device", "cpu"])
    assert (tmp_path / "from_env" / "memory.json").exists()
    script.main(["--device", "cpu", "--out", str(tmp_path / "from_flag")])
    assert (tmp_path / "from_flag" / "memory.json").exists()
    monkeypatch.delenv("OUT")
    script.main(["--device", "cpu"])
    assert (tmp_path / "bench-out" / "memory.json").exists()


def test_train_step_on_the_cpu_fails_and_writes_nothing(tmp_path):
    script = load_script("train_step")
    with pytest.raises(SystemExit) as exc:
        script.main(["--device", "cpu", "--out", str(tmp_path / "out")])
    assert isinstance(exc.value.code, str) and "needs CUDA" in exc.value.code  # exit status 1
    assert not (tmp_path / "out").exists()


OFFLOAD_STEP_TINY = ["--hidden", "32", "--layers", "2", "--vocab", "300", "--chunk-numel", "700"]
OFFLOAD_STEP_TINY += ["--warmup", "1", "--reps", "2", "--rounds", "2"]


@pytest.mark.parametrize("fraction", ["1.0", "0.5"])
def test_offload_step_cpu_run(tmp_path, capsys, fraction):
    script = load_script("offload_step")
    argv = [
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
        "--fraction",
        fraction,
        "--threads",
        "1",
        "2",
    ]
    returned = script.main(argv + OFFLOAD_STEP_TINY)
    records = read_outputs(tmp_path, "offload_step")
    assert records == json.loads(json.dumps(returned))
    assert {(r["variant"], r["mode"], r["threads"]) for r in records} == {
        (v, m, t) for v in ("per_parameter", "chunked_torch", "chunked", "chunked_device",
                            "chunked_bf16m", "chunked_device_bf16m")
        for m in ("overlapped", "drained") for t in (1, 2)
    }  # fmt: skip
    for r in records:
        assert "error" not in r and r["same_state_as_per_parameter"] is True
        # the compiled kernel (this machine has a compiler) where not asked for torch's ops
        want = {"per_parameter": None, "chunked_torch": "torch"}.get(r["variant"], "native")
        assert r["kernel"] == want, r["variant"]
        assert r["step_s"] == min(r["step_rounds_s"]) and r["cpu_floor_s"] > 0
        assert r["step_over_cpu_floor"] == pytest.approx(r["step_s"] / r["cpu_floor_s"])
        assert r["chunks"] > r["blocks"] >= 1
        drained = [r[f"{p}_s"] for p in script.PHASES]
        if r["mode"] == "drained":
            assert all(v is not None and v >= 0 for v in drained) and r["cpu_update_s"] > 0
            assert (r["gpu_update_s"] == 0) == (fraction == "1.0")  # not timed when absent
        else:
            assert all(v is None for v in drained)
        assert (r["gpu_numel"] > 0) == (fraction == "0.5")
    # fp32 crosses both ways when the device converts: twice a bf16 buffer's bytes
    moved = {r["variant"]: (r["d2h_bytes"], r["h2d_bytes"]) for r in records}
    assert moved["chunked_device"] == tuple(2 * b for b in moved["chunked"])
    assert moved["chunked"] == moved["per_parameter"]
    assert moved["chunked_bf16m"] == moved["chunked"]  # the moments stay on the host
    assert moved["chunked_device_bf16m"] == moved["chunked_device"]
    assert moved["chunked_torch"] == moved["chunked"]
    out = capsys.readouterr()
    assert "no device: copies are host copies" in out.err
    assert "chunked step's CPU update: compiled kernel" in out.err
    assert "leave the same optimizer state: True" in out.out


def test_offload_step_keeps_the_thread_counts_measured_before_it_was_stopped(tmp_path, monkeypatch):
    """The JSON is written after every thread count: a run stopped in its second (here
    the measurement raises, as a time limit's signal would end it) leaves the first's rows."""
    script = load_script("offload_step")
    real, calls = script.measure, []

    def second_stops(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("stopped")
        return real(*args, **kwargs)

    monkeypatch.setattr(script, "measure", second_stops)
    argv = ["--device", "cpu", "--out", str(tmp_path), "--threads", "1", "2"]
    argv += OFFLOAD_STEP_TINY + ["--variants", "per_parameter", "chunked"]
    with pytest.raises(KeyboardInterrupt):
        script.main(argv)
    rows = json.loads((tmp_path / "offload_step.json").read_text())
    assert {(r["variant"], r["threads"]) for r in rows} == {
        ("per_parameter", 1),
        ("chunked", 1),
    }
    assert all(r["fraction"] == 1.0 and r["same_state_as_per_parameter"] for r in rows)


@pytest.mark.parametrize("wide", [False, True])
def test_offload_step_bf16_moment_variants_keep_bf16_moments(wide):
    """One step from the same parameters and fresh state: the bf16-moment variant leaves
    the same host parameters as its fp32-moment twin (the update reads the moments widened
    to fp32) and moments equal to the twin's rounded to bf16, in bf16."""
    script = load_script("offload_step")
    setup = script.Setup(script.gpt_shapes(32, 1, 100), 1.0, 500, torch.device("cpu"))
    mirror = setup.wide if wide else setup.mirror
    name = "chunked_device" if wide else "chunked"
    start = mirror.host_params.clone()
    timer = script.Timer(torch.device("cpu"), False)
    getattr(setup, name)(timer)
    twin = mirror.host_params.clone()
    fp32 = setup.wide_stepper if wide else setup.stepper
    mirror.host_params.copy_(start)
    getattr(setup, f"{name}_bf16m")(timer)
    narrow = setup.wide_bf16m_stepper if wide else setup.bf16m_stepper
    assert torch.equal(mirror.host_params, twin) and not torch.equal(twin, start)
    for k in ("exp_avg", "exp_avg_sq"):
        got, want = getattr(narrow, k), getattr(fp32, k)
        assert got.dtype == torch.bfloat16 and want.dtype == torch.float32
        assert torch.equal(got, want.to(torch.bfloat16)) and got.abs().max() > 0


def test_offload_step_notices_a_chunked_step_that_differs(monkeypatch):
    script = load_script("offload_step")
    from megatron_ext.offload.step import ChunkedAdamW

    setup = script.Setup(script.gpt_shapes(32, 1, 100), 1.0, 500, torch.device("cpu"))
    assert script.same_result(setup) is True
    real = ChunkedAdamW.update
    monkeypatch.setattr(ChunkedAdamW, "update", lambda self, i, c=None: i == 0 or real(self, i, c))
    setup = script.Setup(script.gpt_shapes(32, 1, 100), 1.0, 500, torch.device("cpu"))
    assert script.same_result(setup) is False


def test_offload_step_notices_a_compiled_kernel_that_differs(monkeypatch):
    """The compiled kernel skipping one chunk is seen against the per-parameter step and
    the chunked step on torch's ops."""
    script = load_script("offload_step")
    from megatron_ext.offload import native

    native.kernel()
    real, calls = native.HostAdamW.run, []

    def skipping_the_first(self, *args, **kwargs):
        calls.append(1)
        return None if len(calls) == 1 else real(self, *args, **kwargs)

    monkeypatch.setattr(native.HostAdamW, "run", skipping_the_first)
    setup = script.Setup(script.gpt_shapes(32, 1, 100), 1.0, 500, torch.device("cpu"))
    assert script.same_result(setup) is False and calls


def test_offload_step_measures_only_the_variants_asked_for(tmp_path):
    script = load_script("offload_step")
    argv = ["--device", "cpu", "--out", str(tmp_path), "--variants", "chunked", "chunked_torch"]
    records = script.main(argv + OFFLOAD_STEP_TINY)
    assert {r["variant"] for r in records} == {"chunked", "chunked_torch"}
    assert all(r["cpu_floor_s"] > 0 for r in records)


def test_offload_cpu_run(tmp_path):
    script = load_script("offload")
    argv = ["--device", "cpu", "--out", str(tmp_path), "--bytes", "65536"]
    returned = script.main(argv + ["--warmup", "0", "--reps", "1"])
    records = read_outputs(tmp_path, "offload")
    assert records == json.loads(json.dumps(returned))
    assert {(r["inventory"], r["variant"]) for r in records} == {
        (i, v) for i in ("dense_gpt", "deepseek_moe") for v in script.VARIANTS
    }
    for r in records:
        assert set(script.RECORD_FIELDS) <= set(r)
        assert r["error"] is None and r["note"] == script.CPU_NOTE


def test_tables_end_with_a_legend_of_their_columns(norm_clip_run):
    script, _, records = norm_clip_run
    common = load_script("common")
    table = common.format_table([r | script._table_fields(r) for r in records], script.TABLE)
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
    per_param = [r for r in records if r["op"] == "per_param"]
    assert any("param_norms.py" in line for r in per_param for line in r["host_profile"])
    off = script.main(argv)  # off by default: no field filled
    assert all(r["host_profile"] is None for r in off)
    with pytest.raises(SystemExit):
        script.parse_args(argv + ["--host-profile", "-1"])


# --- every PNG: titled with device and versions, no blank panel ------------------------------


def _capture_figures(monkeypatch) -> list[dict]:
    """Record, for every figure a script saves, its title and whether each panel has data."""
    common = sys.modules["benchmarks.common"]
    original, seen = common.save_figure, []

    def save(fig, out_dir, name, title):
        seen.append({
            "name": name,
            "title": title,
            "panels": [(ax.axison, ax.has_data()) for ax in fig.axes],
        })  # fmt: skip
        return original(fig, out_dir, name, title)

    monkeypatch.setattr(common, "save_figure", save)
    return seen


@pytest.mark.parametrize(
    ("name", "argv", "panels", "megatron"),
    [
        ("memory", [], 1, True),
        ("clip_step", ["--bytes", "65536", "--warmup", "0", "--rounds", "2"], 1, False),
        ("offload", ["--bytes", "65536", "--warmup", "0", "--rounds", "2"], 2, True),
        ("offload_step", OFFLOAD_STEP_TINY, 1, False),
        (
            "norm_clip",
            ["--scale", "0.002", "--warmup", "0", "--rounds", "2", "--variants", "flat,torch"]
            + ["--ops", "norm,clip", "--scaling-counts", "80", "--scaling-bytes", "32768"],
            3,
            True,
        ),
        (  # no clip op, no scaling series: one panel, not three with two blank
            "norm_clip",
            ["--scale", "0.002", "--warmup", "0", "--rounds", "1", "--variants", "flat"]
            + ["--ops", "norm", "--scaling-counts", ""],
            1,
            True,
        ),
    ],
)
def test_every_png_names_device_and_versions_and_has_no_blank_panel(
    name, argv, panels, megatron, tmp_path, monkeypatch
):
    from importlib import metadata

    script = load_script(name)
    seen = _capture_figures(monkeypatch)
    script.main(["--device", "cpu", "--out", str(tmp_path), *argv])
    (fig,) = seen
    assert fig["name"] == name and len(fig["panels"]) == panels, fig
    assert all(on and data for on, data in fig["panels"]), fig  # no blank or text-only panel
    assert fig["title"].startswith("CPU: ") and f"torch {torch.__version__}" in fig["title"]
    assert sys.modules["benchmarks.common"].cpu_name() in fig["title"]
    want = f"megatron-core {metadata.version('megatron-core')}"
    assert (want in fig["title"]) == megatron, fig["title"]
    from PIL import Image

    assert Image.open(tmp_path / f"{name}.png").text["Title"] == fig["title"]


def test_offload_verdict_says_when_rounds_disagree():
    script = load_script("offload")
    rec = dict.fromkeys(script.RECORD_FIELDS) | {
        "inventory": "dense_gpt", "variant": "flat", "d2h_Bps": 9.2e9, "ceiling_Bps": 1e10,
        "ceiling_ratio": 0.92, "ceiling_ratio_rounds": [0.92, 0.5, 0.91], "d2h_spread": 0.8,
        "ceiling_spread": 0.05, "pinned_bytes": 10, "owned_bytes": 20,
    }  # fmt: skip
    (line,) = script.summary([rec])
    assert "92% of the pinned ceiling" in line and "per round 50-92%" in line
    assert "copy spread 80%" in line and "met, but the rounds disagree: 2 of 3 at target" in line
    (line,) = script.summary([rec | {"ceiling_ratio_rounds": [0.95, 0.92]}])
    assert "target 90%: met)" in line
    warning = script.common.spread_warning(script.spreads([rec]), 3)
    assert "dense_gpt flat device-to-host, 80%" in warning


def test_train_step_rows_take_each_phase_from_the_fastest_round():
    script = load_script("train_step")
    rounds = [
        {"config": "distopt", "variant": "ours", "fwd_bwd_ms": 10.0, "norm_clip_ms": 1.0,
         "optimizer_ms": 5.0, "step_ms": 16.0, "peak_gib": 2.0, "grad_norm": 1.5},
        {"config": "distopt", "variant": "ours", "fwd_bwd_ms": 9.0, "norm_clip_ms": 2.0,
         "optimizer_ms": 4.0, "step_ms": 15.0, "peak_gib": 2.5, "grad_norm": 1.25},
    ]  # fmt: skip
    row = script.combine_rounds(rounds)
    assert (row["fwd_bwd_ms"], row["norm_clip_ms"], row["optimizer_ms"]) == (9.0, 1.0, 4.0)
    assert row["step_ms"] == 15.0 and row["step_rounds_ms"] == [16.0, 15.0]
    assert row["step_spread"] == pytest.approx(1 / 15) and row["rounds"] == 2
    assert row["peak_gib"] == 2.5 and row["grad_norm"] == 1.25
    failed = script.combine_rounds([rounds[0], {"config": "distopt", "error": "E: x"}])
    assert failed["error"] == "E: x" and "fwd_bwd_ms" not in failed


def test_train_step_writes_what_it_measured_after_every_measurement(tmp_path):
    """A time limit may kill the run mid-way: after each measurement the JSON on disk holds
    every run measured so far, interleaved rounds combined; a failed run is its row."""
    script = load_script("train_step")
    seen = []

    def measure(i):
        k = sum(1 for j in seen if j == i)
        seen.append(i)
        if i == 2:
            return {"config": "c2", "variant": "stock", "error": "ValueError: no"}
        t = 10.0 + i + k
        return {"config": f"c{i}", "variant": "ours", "fwd_bwd_ms": t, "norm_clip_ms": 1.0,
                "optimizer_ms": 2.0, "step_ms": t + 3.0, "peak_gib": 1.0}  # fmt: skip

    snapshots = []

    def write(rows):
        script.write_json(rows, tmp_path, "train_step")
        on_disk = json.loads((tmp_path / "train_step.json").read_text())
        snapshots.append([(r["config"], r.get("rounds"), r["status"]) for r in on_disk])

    rows = script.measure_rounds(3, 2, measure, write)
    assert seen == [0, 1, 2, 0, 1, 2]  # interleaved
    assert snapshots[0] == [("c0", 1, "ok")]
    assert snapshots[2][2][0] == "c2" and snapshots[2][2][2].startswith("failed")
    assert snapshots[3][0] == ("c0", 2, "ok") and snapshots[3][1] == ("c1", 1, "ok")
    assert len(snapshots) == 6 and [r["rounds"] for r in rows] == [2, 2, 2]
    assert rows[0]["fwd_bwd_ms"] == 10.0 and rows[0]["step_rounds_ms"] == [13.0, 14.0]


def test_train_step_times_the_offload_optimizers_own_step(monkeypatch):
    from types import SimpleNamespace

    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    script = load_script("train_step")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    calls = []
    hdo = HybridDeviceOptimizer.__new__(HybridDeviceOptimizer)
    hdo.step = lambda closure=None: calls.append(closure) or "stepped"
    chain = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=hdo)])
    seconds = script._time_offload_steps(chain)
    assert hdo.step() == "stepped" and hdo.step(None) == "stepped"
    assert calls == [None, None] and len(seconds) == 2 and all(s >= 0 for s in seconds)
    plain = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=object())])
    assert script._time_offload_steps(plain) is None


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


def test_train_step_stock_crash_is_its_row(monkeypatch):
    """CUDA-only benchmark, but its stock cell's process handling runs here: the injected
    fault fires in the child before anything touches CUDA."""
    import argparse

    from benchmarks import isolation

    script = load_script("train_step")
    monkeypatch.setenv("BENCHMARKS_STOCK_FAULT", "abort:distopt")
    with isolation.Child("train_step-test", timeout_s=120) as child:
        row = script._measure_stock(child, argparse.Namespace(), "distopt", {}, True)
        assert child.crash is not None
    assert (row["config"], row["variant"], row["fp32_islands"]) == ("distopt", "stock", True)
    assert isolation.status(row["error"]) == "crashed (killed by SIGABRT)"
    assert script.combine_rounds([row])["error"] == row["error"]  # the row stays a failure


def test_memory_ddp_stock_failure_is_its_row(monkeypatch):
    from benchmarks import isolation

    script = load_script("memory_ddp")
    monkeypatch.setenv("BENCHMARKS_STOCK_FAULT", "raise:grad_reduce_in_fp32")
    fields = script.measure_stock("grad_reduce_in_fp32", 64, 1)
    assert fields["error"] == "RuntimeError: fault injected by BENCHMARKS_STOCK_FAULT"
    assert isolation.status(fields["error"]) == f"failed ({fields['error']})"
    assert isolation.status(None) == "ok"


def test_cpu_norm_rows_and_accuracy(tmp_path):
    script = load_script("cpu_norm")
    argv = ["--device", "cpu", "--out", str(tmp_path), "--numel", "30000", "--small", "40x64"]
    argv += ["--threads", "1", "--busy", "0,1", "--dtypes", "bfloat16", "--rounds", "2"]
    records = script.main(argv + ["--reps", "1", "--warmup", "0"])
    written = read_outputs(tmp_path, "cpu_norm")
    assert [(w["op"], w["time_s"]) for w in written] == [(r["op"], r["time_s"]) for r in records]
    keys = {(r["inventory"], r["busy"], r["variant"], r["op"]) for r in records}
    ops = {(v, o) for v in ("ours", "ours_torch_ops", "torch") for o in ("norm", "clip")}
    ops.add(("ours", "first"))
    assert keys == {(i, b, v, o) for i in script.INVENTORIES for b in (0, 1) for v, o in ops}
    for r in records:
        assert "error" not in r, r
        assert r["time_s"] > 0 and len(r["time_rounds_s"]) == 2
        assert (r.get("ratio") is not None) == (r["variant"] != "torch")
        if r["op"] == "norm" and r["variant"] != "torch":
            assert abs(r["rel_err"]) < 2e-7  # fp32 accumulation; torch's is bf16's
    assert {r["num_params"] for r in records} == {150, 40}
    # ours_torch_ops runs with the kernel off, and leaves the setting as it found it
    from buffers import native

    before = os.environ.get("BUFFERS_CPU_KERNEL")
    assert script._torch_ops(native.choice)() == "off"
    assert os.environ.get("BUFFERS_CPU_KERNEL") == before


def test_cpu_norm_refuses_cuda_and_bad_small(monkeypatch):
    script = load_script("cpu_norm")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(SystemExit, match="measures the CPU path"):
        script.main(["--device", "cuda"])
    with pytest.raises(SystemExit):
        script.main(["--device", "cpu", "--small", "many"])
