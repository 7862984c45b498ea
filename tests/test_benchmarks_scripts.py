"""Every benchmark script: --help, where it runs from, where it writes; every PNG titled
with device and versions, no blank panel."""

from __future__ import annotations

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
