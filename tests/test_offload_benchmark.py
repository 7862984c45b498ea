"""The offload benchmark, tiny, on the CPU."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mcore

ROOT = Path(__file__).resolve().parents[1]


def test_offload_benchmark_runs_on_cpu(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "bench_offload", ROOT / "benchmarks" / "offload.py"
    )
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script
    spec.loader.exec_module(script)
    argv = ["--device", "cpu", "--out", str(tmp_path), "--bytes", "262144", "--warmup", "0"]
    returned = script.main([*argv, "--reps", "1", "--dp", "2"])
    records = json.loads((tmp_path / "offload.json").read_text())
    assert (tmp_path / "offload.png").stat().st_size > 0
    assert records == json.loads(json.dumps(returned, default=str))
    assert {r["variant"] for r in records} == {"per_param", "flat"}
    for r in records:
        assert set(script.RECORD_FIELDS) <= set(r)
        assert r["error"] is None, r
        assert r["time_kind"] == "perf_counter" and "stand in" in r["note"]
        assert r["d2h_s"] > 0 and r["cpu_step_s"] > 0 and r["ceiling_Bps"] > 0
    flat = [r for r in records if r["variant"] == "flat"]
    per_param = [r for r in records if r["variant"] == "per_param"]
    for f, p in zip(flat, per_param, strict=True):
        assert f["d2h_copies"] < p["d2h_copies"]
        assert f["d2h_bytes"] < p["d2h_bytes"]  # bf16 moves as bf16, not fp32
        assert f["pinned_bytes"] <= f["owned_bytes"]
    out = capsys.readouterr()
    assert "stand in" in out.out and out.out.rstrip().splitlines()[-1].strip()
