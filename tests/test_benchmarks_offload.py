"""offload_step.py and offload.py at CPU sizes."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.bench_scripts import OFFLOAD_STEP_TINY, load_script, read_outputs

pytestmark = pytest.mark.mcore


@pytest.mark.parametrize("fraction", ["1.0", "0.5"])
def test_offload_step_cpu_run(tmp_path, capsys, fraction):
    script = load_script("offload_step")
    argv = [
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
        "--fraction",
        fraction,
        "--threads",
        "1",
        "2",
    ]
    returned = script.main(argv + OFFLOAD_STEP_TINY)
    records = read_outputs(tmp_path, "offload_step")
    assert records == json.loads(json.dumps(returned))
    assert {(r["variant"], r["mode"], r["threads"]) for r in records} == {
        (v, m, t) for v in ("per_parameter", "chunked_torch", "chunked", "chunked_device",
                            "chunked_bf16m", "chunked_device_bf16m")
        for m in ("overlapped", "drained") for t in (1, 2)
    }  # fmt: skip
    for r in records:
        assert "error" not in r and r["same_state_as_per_parameter"] is True
        # the compiled kernel (this machine has a compiler) where not asked for torch's ops
        want = {"per_parameter": None, "chunked_torch": "torch"}.get(r["variant"], "native")
        assert r["kernel"] == want, r["variant"]
        assert r["step_s"] == min(r["step_rounds_s"]) and r["cpu_floor_s"] > 0
        assert r["step_over_cpu_floor"] == pytest.approx(r["step_s"] / r["cpu_floor_s"])
        assert r["chunks"] > r["blocks"] >= 1
        drained = [r[f"{p}_s"] for p in script.PHASES]
        if r["mode"] == "drained":
            assert all(v is not None and v >= 0 for v in drained) and r["cpu_update_s"] > 0
            assert (r["gpu_update_s"] == 0) == (fraction == "1.0")  # not timed when absent
        else:
            assert all(v is None for v in drained)
        assert (r["gpu_numel"] > 0) == (fraction == "0.5")
    # fp32 crosses both ways when the device converts: twice a bf16 buffer's bytes
    moved = {r["variant"]: (r["d2h_bytes"], r["h2d_bytes"]) for r in records}
    assert moved["chunked_device"] == tuple(2 * b for b in moved["chunked"])
    assert moved["chunked"] == moved["per_parameter"]
    assert moved["chunked_bf16m"] == moved["chunked"]  # the moments stay on the host
    assert moved["chunked_device_bf16m"] == moved["chunked_device"]
    assert moved["chunked_torch"] == moved["chunked"]
    out = capsys.readouterr()
    assert "no device: copies are host copies" in out.err
    assert "chunked step's CPU update: compiled kernel" in out.err
    assert "leave the same optimizer state: True" in out.out


def test_offload_step_keeps_the_thread_counts_measured_before_it_was_stopped(tmp_path, monkeypatch):
    """The JSON is written after every thread count: a run stopped in its second (here
    the measurement raises, as a time limit's signal would end it) leaves the first's rows."""
    script = load_script("offload_step")
    real, calls = script.measure, []

    def second_stops(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("stopped")
        return real(*args, **kwargs)

    monkeypatch.setattr(script, "measure", second_stops)
    argv = ["--device", "cpu", "--out", str(tmp_path), "--threads", "1", "2"]
    argv += OFFLOAD_STEP_TINY + ["--variants", "per_parameter", "chunked"]
    with pytest.raises(KeyboardInterrupt):
        script.main(argv)
    rows = json.loads((tmp_path / "offload_step.json").read_text())
    assert {(r["variant"], r["threads"]) for r in rows} == {
        ("per_parameter", 1),
        ("chunked", 1),
    }
    assert all(r["fraction"] == 1.0 and r["same_state_as_per_parameter"] for r in rows)


@pytest.mark.parametrize("wide", [False, True])
def test_offload_step_bf16_moment_variants_keep_bf16_moments(wide):
    """One step from the same parameters and fresh state: the bf16-moment variant leaves
    the same host parameters as its fp32-moment twin (the update reads the moments widened
    to fp32) and moments equal to the twin's rounded to bf16, in bf16."""
    script = load_script("offload_step")
    setup = script.Setup(script.gpt_shapes(32, 1, 100), 1.0, 500, torch.device("cpu"))
    mirror = setup.wide if wide else setup.mirror
    name = "chunked_device" if wide else "chunked"
    start = mirror.host_params.clone()
    timer = script.Timer(torch.device("cpu"), False)
    getattr(setup, name)(timer)
    twin = mirror.host_params.clone()
    fp32 = setup.wide_stepper if wide else setup.stepper
    mirror.host_params.copy_(start)
    getattr(setup, f"{name}_bf16m")(timer)
    narrow = setup.wide_bf16m_stepper if wide else setup.bf16m_stepper
    assert torch.equal(mirror.host_params, twin) and not torch.equal(twin, start)
    for k in ("exp_avg", "exp_avg_sq"):
        got, want = getattr(narrow, k), getattr(fp32, k)
        assert got.dtype == torch.bfloat16 and want.dtype == torch.float32
        assert torch.equal(got, want.to(torch.bfloat16)) and got.abs().max() > 0


def test_offload_step_notices_a_chunked_step_that_differs(monkeypatch):
    script = load_script("offload_step")
    from megatron_ext.offload.step import ChunkedAdamW

    setup = script.Setup(script.gpt_shapes(32, 1, 100), 1.0, 500, torch.device("cpu"))
    assert script.same_result(setup) is True
    real = ChunkedAdamW.update
    monkeypatch.setattr(ChunkedAdamW, "update", lambda self, i, c=None: i == 0 or real(self, i, c))
    setup = script.Setup(script.gpt_shapes(32, 1, 100), 1.0, 500, torch.device("cpu"))
    assert script.same_result(setup) is False


def test_offload_step_notices_a_compiled_kernel_that_differs(monkeypatch):
    """The compiled kernel skipping one chunk is seen against the per-parameter step and
    the chunked step on torch's ops."""
    script = load_script("offload_step")
    from megatron_ext.offload import host_kernel as native

    native.kernel()
    real, calls = native.HostAdamW.run, []

    def skipping_the_first(self, *args, **kwargs):
        calls.append(1)
        return None if len(calls) == 1 else real(self, *args, **kwargs)

    monkeypatch.setattr(native.HostAdamW, "run", skipping_the_first)
    setup = script.Setup(script.gpt_shapes(32, 1, 100), 1.0, 500, torch.device("cpu"))
    assert script.same_result(setup) is False and calls


def test_offload_step_measures_only_the_variants_asked_for(tmp_path):
    script = load_script("offload_step")
    argv = ["--device", "cpu", "--out", str(tmp_path), "--variants", "chunked", "chunked_torch"]
    records = script.main(argv + OFFLOAD_STEP_TINY)
    assert {r["variant"] for r in records} == {"chunked", "chunked_torch"}
    assert all(r["cpu_floor_s"] > 0 for r in records)


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


def test_offload_verdict_says_when_rounds_disagree():
    script = load_script("offload")
    rec = dict.fromkeys(script.RECORD_FIELDS) | {
        "inventory": "dense_gpt", "variant": "flat", "d2h_Bps": 9.2e9, "ceiling_Bps": 1e10,
        "ceiling_ratio": 0.92, "ceiling_ratio_rounds": [0.92, 0.5, 0.91], "d2h_spread": 0.8,
        "ceiling_spread": 0.05, "pinned_bytes": 10, "owned_bytes": 20,
    }  # fmt: skip
    (line,) = script.summary([rec])
    assert "92% of the pinned ceiling" in line and "per round 50-92%" in line
    assert "copy spread 80%" in line and "met, but the rounds disagree: 2 of 3 at target" in line
    (line,) = script.summary([rec | {"ceiling_ratio_rounds": [0.95, 0.92]}])
    assert "target 90%: met)" in line
    warning = script.common.spread_warning(script.spreads([rec]), 3)
    assert "dense_gpt flat device-to-host, 80%" in warning
