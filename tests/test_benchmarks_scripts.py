"""Every benchmark script: --help, where it runs from, where it writes; every PNG titled
with device and versions, no blank panel."""

from __future__ import annotations

import argparse
import json
import os
import sys

import pytest
import torch

from tests.support.bench_scripts import OFFLOAD_STEP_TINY, ROOT, load_script

pytestmark = pytest.mark.mcore

# --- every script: --help, where it runs from, where it writes, what it says --------------

SCRIPTS = (
    "norm_clip", "memory", "offload", "offload_step", "clip_step", "train_step", "cpu_norm",
    "offload_overlap", "offload_scale",
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


def _parser(name: str, monkeypatch) -> argparse.ArgumentParser:
    """The argument parser the script ``name`` builds in ``main``, stopped before it parses."""
    script = load_script(name)
    parsers = []

    def record(self, *args, **kwargs):
        parsers.append(self)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", record)
    with pytest.raises(_Parsed):
        script.main(["--help"])
    (parser,) = parsers
    return parser


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_gives_every_options_meaning_and_default(name, monkeypatch):
    parser = _parser(name, monkeypatch)
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
    script.main(["--device", "cpu", "--no-measured"])
    assert (tmp_path / "from_env" / "memory.json").exists()
    script.main(["--device", "cpu", "--no-measured", "--out", str(tmp_path / "from_flag")])
    assert (tmp_path / "from_flag" / "memory.json").exists()
    monkeypatch.delenv("OUT")
    script.main(["--device", "cpu", "--no-measured"])
    assert (tmp_path / "bench-out" / "memory.json").exists()


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_describes_the_script_in_whole_sentences(name, monkeypatch):
    description = _parser(name, monkeypatch).description
    assert description.endswith("."), description


@pytest.mark.parametrize("name", ["cpu_norm", "offload_step"])
def test_every_column_has_a_legend_line(name):
    columns = load_script(name).COLUMNS
    assert len(columns) >= 10 and all(c.meaning for c in columns), [
        c.header for c in columns if not c.meaning
    ]


def _bars(monkeypatch) -> list[tuple[str, int]]:
    """Record every progress bar a script draws: its name and how many steps it moves."""
    common = sys.modules["benchmarks.common"]
    bars = []

    def progress(items, desc):
        bars.append((desc, len(items)))
        return items

    monkeypatch.setattr(common, "progress", progress)
    return bars


def test_cpu_norm_moves_a_bar_at_each_measurement_and_names_its_files(
    tmp_path, monkeypatch, capsys
):
    script = load_script("cpu_norm")
    bars = _bars(monkeypatch)
    argv = ["--device", "cpu", "--out", str(tmp_path), "--numel", "3000", "--small", "8x16"]
    argv += ["--threads", "1,2", "--busy", "0", "--dtypes", "float32", "--rounds", "2"]
    records = script.main([*argv, "--reps", "1", "--warmup", "0"])
    # per inventory and thread count, every (variant, op) measured in each of 2 rounds
    per = {inv: len({(r["variant"], r["op"]) for r in records if r["inventory"] == inv})
           for inv in script.INVENTORIES}  # fmt: skip
    assert bars == [
        (f"cpu_norm {inv} float32 {t} threads 0 busy", 2 * per[inv])
        for inv in script.INVENTORIES
        for t in (1, 2)
    ]
    err = capsys.readouterr().err
    assert f"wrote {tmp_path / 'cpu_norm.json'} and {tmp_path / 'cpu_norm.png'}" in err


def test_offload_step_moves_a_bar_at_each_measurement_and_names_its_files(
    tmp_path, monkeypatch, capsys
):
    script = load_script("offload_step")
    bars = _bars(monkeypatch)
    argv = ["--device", "cpu", "--out", str(tmp_path), *OFFLOAD_STEP_TINY]
    script.main([*argv, "--threads", "1", "2", "--variants", "chunked", "per_parameter"])
    # each variant overlapped and drained, and five floors, in each of 2 rounds
    assert bars == [(f"offload_step {t} threads", 2 * (2 * 2 + 5)) for t in (1, 2)]
    err = capsys.readouterr().err
    wrote = f"wrote {tmp_path / 'offload_step.json'} and {tmp_path / 'offload_step.png'}"
    assert wrote in err and (tmp_path / "offload_step.json").exists()


def test_offload_scale_names_its_files(tmp_path, capsys):
    script = load_script("offload_scale")
    script.main(["--device", "cpu", "--kinds", "fwd_bwd", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    wrote = f"wrote {tmp_path / 'offload_scale.json'} and {tmp_path / 'offload_scale.png'}"
    assert wrote in err and (tmp_path / "offload_scale.json").exists()


# --- every script: arguments and the output folder checked before anything is measured ---

BAD_VALUES = [
    ("norm_clip", ["--rounds", "0"], "--rounds: expected an integer >= 1, got 0"),
    ("norm_clip", ["--reps", "0"], "--reps: expected an integer >= 1, got 0"),
    ("norm_clip", ["--warmup", "-1"], "--warmup: expected an integer >= 0, got -1"),
    ("norm_clip", ["--host-profile", "-1"], "--host-profile: expected an integer >= 0"),
    ("norm_clip", ["--scaling-counts", "80,0"], "--scaling-counts: expected an integer >= 1"),
    ("norm_clip", ["--scaling-bytes", "0"], "--scaling-bytes: expected an integer >= 1"),
    ("offload_step", ["--fraction", "0"], "--fraction: expected a number in (0, 1], got 0"),
    ("offload_step", ["--fraction", "-1"], "--fraction: expected a number in (0, 1], got -1"),
    ("offload_step", ["--fraction", "1.5"], "--fraction: expected a number in (0, 1], got 1.5"),
    ("offload_step", ["--fraction", "nan"], "--fraction: expected a number in (0, 1], got nan"),
    ("offload_step", ["--fraction", "x"], "--fraction: expected a number in (0, 1], got 'x'"),
    ("offload_step", ["--threads", "2", "0"], "--threads: expected an integer >= 1, got 0"),
    ("offload_step", ["--chunk-numel", "0"], "--chunk-numel: expected an integer >= 1, got 0"),
    ("cpu_norm", ["--threads", "1,0"], "--threads: expected an integer >= 1, got 0"),
    ("cpu_norm", ["--busy", "-1"], "--busy: expected an integer >= 0, got -1"),
    ("cpu_norm", ["--numel", "0"], "--numel: expected an integer >= 1, got 0"),
    ("cpu_norm", ["--small", "0x64"], "--small: expected COUNTxELEMENTS"),
    ("cpu_norm", ["--small", "many"], "--small: expected COUNTxELEMENTS"),
    ("cpu_norm", ["--dtypes", "bfloat16,float33"], "--dtypes: ['float33'] not torch dtypes"),
    ("cpu_norm", ["--inventories", "few_large,huge"], "--inventories: unknown ['huge']"),
    ("clip_step", ["--bytes", "0"], "--bytes: expected an integer >= 1, got 0"),
    ("memory", ["--dp", "0"], "--dp: expected an integer >= 1, got 0"),
    ("memory", ["--hidden", "-8"], "--hidden: expected an integer >= 1, got -8"),
    ("offload", ["--fraction", "1.5"], "--fraction: expected a number in (0, 1], got 1.5"),
    ("offload", ["--dp", "0"], "--dp: expected an integer >= 1, got 0"),
    ("offload", ["--bucket-numel", "0"], "--bucket-numel: expected an integer >= 1, got 0"),
    ("offload_overlap", ["--fractions", "1", "0"], "--fractions: expected a number in (0, 1]"),
    ("offload_overlap", ["--micro-batches", "0"], "--micro-batches: expected an integer >= 1"),
    ("offload_overlap", ["--steps", "0"], "--steps: expected an integer >= 1, got 0"),
    ("offload_overlap", ["--lr", "0"], "--lr: expected a number > 0, got 0"),
    ("offload_overlap", ["--min-lr=-1e-5"], "--min-lr: expected a number >= 0, got -1e-5"),
    ("offload_overlap", ["--markov-states", "40000"], "--markov-states: 40000 tokens, more than"),
    ("train_step", ["--rounds", "0"], "--rounds: expected an integer >= 1, got 0"),
    ("train_step", ["--warmup", "-1"], "--warmup: expected an integer >= 0, got -1"),
    ("train_step", ["--hidden", "0"], "--hidden: expected an integer >= 1, got 0"),
]


def _refused_in_one_line(name: str, argv: list[str], capsys) -> str:
    """Run the script on ``argv``; it must stop with one line on stderr and exit status 2
    (nothing printed before it: no title, no measurement). Returns that line."""
    script = load_script(name)
    with pytest.raises(SystemExit) as exc:
        script.main(["--device", "cpu", *argv])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == "" and err.count("\n") == 1, (exc.value.code, err)
    assert err.endswith("(--help lists the options)\n"), err
    return err


@pytest.mark.parametrize(("name", "argv", "named"), BAD_VALUES)
def test_a_bad_value_is_refused_in_one_line_naming_the_option(name, argv, named, tmp_path, capsys):
    err = _refused_in_one_line(name, ["--out", str(tmp_path), *argv], capsys)
    assert f": error: argument {named}" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", SCRIPTS)
def test_an_output_folder_that_cannot_be_written_is_refused_first(name, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = blocker / "results"
    err = _refused_in_one_line(name, ["--out", str(out)], capsys)
    assert f": error: argument --out: {out}: {blocker} is not a folder" in err, err
    assert blocker.read_text() == ""


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
        ("memory", ["--no-measured"], 1, True),
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
