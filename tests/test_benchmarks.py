"""CPU smoke tests of the benchmark scripts: tiny sizes, documented fields, outputs written."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.bench_scripts import load_script, read_outputs


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


def test_train_step_on_the_cpu_fails_and_writes_nothing(tmp_path):
    script = load_script("train_step")
    with pytest.raises(SystemExit) as exc:
        script.main(["--device", "cpu", "--out", str(tmp_path / "out")])
    assert isinstance(exc.value.code, str) and "needs CUDA" in exc.value.code  # exit status 1
    assert not (tmp_path / "out").exists()


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
