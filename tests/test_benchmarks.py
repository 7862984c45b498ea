"""CPU smoke tests of the benchmark scripts: tiny sizes, documented fields, outputs written."""

from __future__ import annotations

import importlib.util
import json
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


def test_norm_clip_host_times_interleave_ops_in_rounds():
    """A slow moment on the machine must not land on one row: every round times every op."""
    script = load_script("norm_clip")
    order = []
    prep = script.Prepared(
        [], lambda: order.append("norm"), lambda max_norm: order.append(max_norm)
    )
    ops = ["norm", "clip"]
    host = script.measure_host(prep, ops, torch.device("cpu"), reps=10, burst=True)
    runs = [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k]
    assert len(runs) == 2 * script.HOST_ROUNDS  # norm, clip, norm, clip, ...
    assert order.count("norm") == order.count(0.0) >= 10
    for op in ops:
        fields = host[op]
        assert 0 < fields["host_time_p10_s"] <= fields["host_time_s"] <= fields["host_time_p90_s"]
        assert fields["host_time_burst_s"] > 0
    no_burst = script.measure_host(prep, ops, torch.device("cpu"), reps=2, burst=False)
    assert no_burst["clip"]["host_time_burst_s"] is None


# --- every script: --help, where it runs from, where it writes, what it says --------------

SCRIPTS = ("norm_clip", "memory", "offload", "clip_step", "train_step")
HELPERS = ("common", "inventories", "norm_clip_variants", "memory_ddp")
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
