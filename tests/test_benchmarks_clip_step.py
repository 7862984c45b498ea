"""clip_step.py at CPU sizes."""

from __future__ import annotations

import json

from tests.support.bench_scripts import load_script, read_outputs


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
