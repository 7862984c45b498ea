"""CPU smoke tests of the benchmark scripts: tiny sizes, documented fields, outputs written."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.bench_scripts import load_script, memory_run_given, read_outputs

pytestmark = pytest.mark.mcore


def test_memory_layout_and_measured_rows(tmp_path, capsys):
    """``benchmarks/memory.py --device cpu``'s rows and tables: of a run made here, or of the
    main job's in CI ([Note: memory.py runs once in CI] in tests/support/bench_scripts.py)."""
    script = load_script("memory")
    given = memory_run_given()
    if given:
        out, printed, _ = given
    else:
        out = tmp_path
        script.main(["--device", "cpu", "--out", str(tmp_path)])
        printed = capsys.readouterr().out
    records = read_outputs(out, "memory")
    measured = {r["config"]: r for r in records if r["kind"] == "measured"}
    layout = [r for r in records if r["kind"] == "layout"]
    # Each configuration, in its own process, through its optimizer steps: on the CPU the
    # bytes held between steps and inside the step; the peaks are GPU-only, and say so.
    assert set(measured) == {"on", "off", "grad_reduce_in_fp32"}
    for r in measured.values():
        assert r["error"] is None and r["device"] == "cpu", r
        assert set(r) == set(script.memory_ddp.MEASURED_FIELDS)
        assert r["peak_allocated_bytes"] is None and r["peak_optimizer_step_gib"] is None
        assert r["in_step_bytes"] >= r["held_bytes"] > r["grad_buffer_bytes"] > 0
    on, off = measured["on"], measured["off"]
    for r in (on, off):  # bf16 gradients: inside the step, fp32 copies of them are alive
        assert r["in_step_bytes"] - r["held_bytes"] >= 4 * r["hidden"] ** 2 * r["layers"]
    # Ours holds no more than stock, up to alignment padding and the norm's scalars: far
    # less than the fp32 copy of the gradients a mirror kept between steps would add.
    slack = 16 * 1024
    assert 4 * on["hidden"] ** 2 * on["layers"] > 8 * slack
    assert on["held_bytes"] <= off["held_bytes"] + slack
    assert on["in_step_bytes"] <= off["in_step_bytes"] + slack
    title, table = (out / "memory.txt").read_text().split("\n\n", 1)  # the tables it prints
    assert title.startswith("CPU: ") and "GPU peak GiB" in table and "GPU only" in table
    assert table in printed
    assert {r["model"] for r in layout} == {"deepseek_tp1_pp32_ep8", "dense70b_tp8_pp8"}
    for r in layout:
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
    rounds[0] |= {"held_gib": 1.0, "peak_fwd_bwd_gib": 1.9, "peak_optimizer_gib": 1.2}
    rounds[1] |= {"held_gib": 1.1, "peak_fwd_bwd_gib": 1.8, "peak_optimizer_gib": 1.3}
    row = script.combine_rounds(rounds)
    assert (row["held_gib"], row["peak_fwd_bwd_gib"], row["peak_optimizer_gib"]) == (1.1, 1.9, 1.3)
    assert (row["fwd_bwd_ms"], row["norm_clip_ms"], row["optimizer_ms"]) == (9.0, 1.0, 4.0)
    assert row["step_ms"] == 15.0 and row["step_rounds_ms"] == [16.0, 15.0]
    assert row["step_spread"] == pytest.approx(1 / 15) and row["rounds"] == 2
    assert row["peak_gib"] == 2.5 and row["grad_norm"] == 1.25
    failed = script.combine_rounds([rounds[0], {"config": "distopt", "error": "E: x"}])
    assert failed["error"] == "E: x" and "fwd_bwd_ms" not in failed


def test_train_step_runs_the_configurations_asked_for():
    script = load_script("train_step")
    picked = script.selected_runs("distopt,offload_0.5")
    assert [(r.label, r.option) for r in picked] == [
        ("offload_0.5", True), ("offload_0.5", False), ("distopt", True), ("distopt", False)
    ]  # fmt: skip
    assert script.selected_runs("") == script.runs()
    with pytest.raises(SystemExit, match="no configuration named nope; the names are"):
        script.selected_runs("distopt,nope")


def test_train_step_phase_peaks_are_each_phases_own_and_the_peak_is_everything(monkeypatch):
    """CUDA's peak counters, faked: a phase's peak excludes what came before it, the whole
    measurement's peak does not lose a phase to the resets between them."""
    script = load_script("train_step")
    mem = {"now": 5, "peak": 9}  # allocated before the measurement; an earlier peak

    def alloc(n):
        mem["now"] += n
        mem["peak"] = max(mem["peak"], mem["now"])

    def reset():
        mem["peak"] = mem["now"]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: mem["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: mem["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: reset())
    monkeypatch.setattr(script, "gib", lambda b: b)
    peaks = script._Peaks()
    alloc(100)  # the build
    alloc(-60)
    assert peaks.phase("fwd_bwd", lambda: (alloc(30), alloc(-30), "out")[-1]) == "out"
    peaks.phase("optimizer", lambda: (alloc(20), alloc(-20)))
    fields = peaks.fields()
    assert fields["baseline_gib"] == 5 and fields["peak_gib"] == 105  # the build's, not 9
    assert fields["peak_fwd_bwd_gib"] == 45 + 30 and fields["peak_optimizer_gib"] == 45 + 20


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
    row = script.measure_in_fresh_process(argparse.Namespace(), script.Run(False, "distopt", {}))
    assert (row["config"], row["variant"], row["fp32_islands"]) == ("distopt", "stock", True)
    assert isolation.status(row["error"]) == "crashed (killed by SIGABRT)"
    assert script.combine_rounds([row])["error"] == row["error"]  # the row stays a failure


def test_train_step_measures_every_run_in_a_process_of_its_own(monkeypatch):
    """A peak is one configuration's only if nothing else ran in its process: each
    measurement, ours too, starts a child and stops it; the next gets a new one."""
    import argparse

    from benchmarks import isolation

    script = load_script("train_step")
    started, calls = [], []

    class Recording(isolation.Child):
        def __init__(self, name, *a, **kw):
            started.append(self)
            self.name, self.crash, self.failed, self.closed = name, None, False, False

        def call(self, ref, *args):
            calls.append((self, ref, args[1:]))
            return {"config": args[2], "variant": "ours" if args[1] else "stock", "peak_gib": 1.0}

        def close(self):
            self.closed = True

    monkeypatch.setattr(isolation, "Child", Recording)
    todo = script.runs()
    rows = [script.measure_in_fresh_process(argparse.Namespace(), r) for r in todo[:3]]
    assert len(started) == 3 and all(c.closed for c in started)
    assert [c for c, _, _ in calls] == started  # one call per process
    assert [a for _, _, a in calls] == [
        (r.option, r.label, r.overrides, r.fp32_islands) for r in todo[:3]
    ]
    assert [(r["config"], r["variant"]) for r in rows] == [
        (todo[0].label, "ours"), (todo[1].label, "stock"), (todo[2].label, "ours")
    ]  # fmt: skip
    labels = [(r.label, r.option, r.fp32_islands) for r in todo]
    assert len(set(labels)) == len(labels)  # every run is its own row
    assert ("distopt", True, True) in labels and ("distopt", False, True) in labels


def test_memory_ddp_stock_failure_is_its_row(monkeypatch):
    from benchmarks import isolation

    script = load_script("memory_ddp")
    monkeypatch.setenv("BENCHMARKS_STOCK_FAULT", "raise:grad_reduce_in_fp32")
    fields = script.measure_in_fresh_process("grad_reduce_in_fp32", 64, 1)
    assert fields["error"] == "RuntimeError: fault injected by BENCHMARKS_STOCK_FAULT"
    assert isolation.status(fields["error"]) == f"failed ({fields['error']})"
    assert isolation.status(None) == "ok"
