"""Loading the benchmark scripts in tests, as ``python benchmarks/<name>.py`` loads them."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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


# offload_step.py at a size the CPU runs in seconds (its tests and the PNG check)
OFFLOAD_STEP_TINY = ["--hidden", "32", "--layers", "2", "--vocab", "300", "--chunk-numel", "700"]
OFFLOAD_STEP_TINY += ["--warmup", "1", "--reps", "2", "--rounds", "2"]


# [Note: memory.py runs once in CI]
# benchmarks/memory.py takes a third of a minute on the CPU, and the main job runs it anyway.
# So CI (.ci/run) keeps the main job's outputs in a folder, with what the job printed on its
# standard output and error (each a pipe, not a terminal) in stdout.txt and stderr.txt, and
# names that folder in MEMORY_BENCH_OUT; the tests of memory.py's run check that run instead
# of running memory.py again. Without the variable they run it themselves.
MEMORY_BENCH_OUT = "MEMORY_BENCH_OUT"


def memory_run_given() -> tuple[Path, str, str] | None:
    """The folder of the memory.py run named by ``MEMORY_BENCH_OUT`` with what that run
    printed on its standard output and error, or None when the variable is not set."""
    given = os.environ.get(MEMORY_BENCH_OUT)
    if not given:
        return None
    out = Path(given)
    return out, (out / "stdout.txt").read_text(), (out / "stderr.txt").read_text()
