"""cpu_norm.py at CPU sizes."""

from __future__ import annotations

import os

import pytest
import torch

from tests.support.bench_scripts import load_script, read_outputs


def test_cpu_norm_rows_and_accuracy(tmp_path):
    script = load_script("cpu_norm")
    argv = ["--device", "cpu", "--out", str(tmp_path), "--numel", "30000", "--small", "40x64"]
    argv += ["--threads", "1", "--busy", "0,1", "--dtypes", "bfloat16", "--rounds", "2"]
    records = script.main(argv + ["--reps", "1", "--warmup", "0"])
    written = read_outputs(tmp_path, "cpu_norm")
    assert [(w["op"], w["time_s"]) for w in written] == [(r["op"], r["time_s"]) for r in records]
    keys = {(r["inventory"], r["busy"], r["variant"], r["op"]) for r in records}
    ops = {(v, o) for v in ("ours", "ours_torch_ops", "torch") for o in ("norm", "clip")}
    ops |= {("ours", "first"), ("ours", "per_param"), ("torch", "per_param")}
    zero = {("many_small", b, v, "zero_backward") for b in (0, 1) for v in ("ours", "torch")}
    zero |= {("many_small", b, "ours", "check") for b in (0, 1)}
    assert keys == {(i, b, v, o) for i in script.INVENTORIES for b in (0, 1) for v, o in ops} | zero
    for r in records:
        assert "error" not in r, r
        assert r["time_s"] > 0 and len(r["time_rounds_s"]) == 2
        assert (r.get("ratio") is not None) == (r["variant"] != "torch")
        assert ("rel_err" in r) == (r["op"] in ("norm", "per_param")), r
        if r["op"] == "norm" and r["variant"] != "torch":
            assert abs(r["rel_err"]) < 2e-7  # fp32 accumulation; torch's is bf16's
        if r["op"] == "per_param":  # the worst parameter's, both in fp32
            assert 0 <= r["rel_err"] < 1e-6, r
    assert {r["num_params"] for r in records} == {150, 40}
    by_key = {(r["inventory"], r["busy"], r["variant"], r["op"]): r for r in records}
    for busy in (0, 1):  # the check's ratio is to ours' own norm, not to torch's
        check = by_key["many_small", busy, "ours", "check"]
        norm = by_key["many_small", busy, "ours", "norm"]
        assert check["ratio"] == check["time_s"] / norm["time_s"]
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
