"""The benchmarks without their [bench] extra (tqdm, matplotlib) and outside a terminal."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import common
from tests.support.bench_scripts import memory_run_given

pytestmark = pytest.mark.mcore

ROOT = Path(__file__).resolve().parents[1]
NORM_CLIP_SMOKE = ["--device", "cpu", "--scale", "0.004", "--warmup", "0", "--reps", "1"]
NORM_CLIP_SMOKE += ["--scaling-counts", "80", "--scaling-bytes", "32768", "--variants", "flat"]


def _run(script: str, argv: list[str], tmp_path: Path, blocked: tuple[str, ...] = ()):
    """Run ``benchmarks/<script>`` in a fresh process, stderr a pipe (not a terminal), with
    the modules in ``blocked`` failing to import as when they are not installed."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    lines = ["import sys"] + [f"sys.modules[{name!r}] = None" for name in blocked]
    (site / "sitecustomize.py").write_text("\n".join(lines) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OUT")}
    env["PYTHONPATH"] = f"{site}{os.pathsep}{ROOT}"
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_benchmark_runs_without_tqdm_and_matplotlib_and_says_so_once(tmp_path):
    out = tmp_path / "out"
    proc = _run("norm_clip.py", NORM_CLIP_SMOKE + ["--out", str(out)], tmp_path,
                blocked=("tqdm", "matplotlib"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if "not installed" in line]
    assert notes[0].startswith("note: tqdm and matplotlib not installed"), proc.stderr
    assert "no progress bar" in notes[0] and "no PNG" in notes[0] and "[bench]" in notes[0]
    # the note, and the one line naming the files written
    assert len(notes) == 2 and common.NO_PNG in notes[1], notes
    rows = json.loads((out / "norm_clip.json").read_text())
    assert {r["variant"] for r in rows} == {"flat"} and all(r["time_s"] for r in rows)
    assert (out / "norm_clip.txt").is_file() and not (out / "norm_clip.png").exists()


def test_without_a_terminal_the_progress_bar_prints_nothing(tmp_path):
    """memory.py's bars (its layouts', its measured configurations'): here, or in CI the main
    job's run ([Note: memory.py runs once in CI] in tests/support/bench_scripts.py)."""
    pytest.importorskip("tqdm")
    given = memory_run_given()
    if given:
        out, _, stderr = given
    else:
        out = tmp_path / "out"
        proc = _run("memory.py", ["--out", str(out)], tmp_path)
        assert proc.returncode == 0, proc.stderr
        stderr = proc.stderr
    assert f"wrote {out / 'memory.json'}" in stderr  # the run whose stderr this is
    assert "memory layouts" not in stderr and "ddp:" not in stderr and "\r" not in stderr, stderr
    assert "not installed" not in stderr


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "pipe"])
def test_the_bar_is_drawn_only_on_a_terminal(terminal, monkeypatch):
    pytest.importorskip("tqdm")
    stderr = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    bar = common.progress(range(3), "steps")
    assert list(bar) == [0, 1, 2]
    bar.set_postfix_str("done")
    drawn = stderr.getvalue()
    assert ("steps" in drawn and "3/3" in drawn) if terminal else drawn == "", drawn


def test_without_matplotlib_the_plotting_code_runs_and_no_png_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(common, "_told_missing", False)
    fig, axes = common.new_figure(2)
    for ax in axes:  # what the scripts' plots call
        ax.bar([0, 1], [1.0, 2.0], 0.4, label="x")
        ax.set_yscale("log")
        assert list(ax.get_xticklabels()) == []
    assert common.save_figure(fig, tmp_path, "plot", "title") == common.NO_PNG
    assert list(tmp_path.iterdir()) == []


def test_a_figure_title_is_wrapped_to_the_figure_width_and_kept_whole_in_the_png(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    from benchmarks import common

    title = "NVIDIA H100 80GB HBM3, host a 16-core Xeon | torch 2.11.0+cu130 | " * 3
    lines = common.wrap_title(title.strip(), 6.0).split("\n")
    assert len(lines) > 1 and all(len(line) <= 84 for line in lines)
    assert " ".join(lines) == " ".join(title.split())
    assert common.wrap_title("short", 6.0) == "short"
    fig, _ = common.new_figure(1)
    path = common.save_figure(fig, tmp_path, "t", title.strip())
    assert Image.open(path).info["Title"] == title.strip()
