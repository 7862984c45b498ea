"""benchmarks/offload_overlap.py's CPU-checkable parts: the configurations it measures, the
throughput-kept column, its refusal without CUDA and its plot (the measurements run on a GPU)."""

from __future__ import annotations

import pytest

from benchmarks import offload_overlap
from megatron_ext.offload.threads import usable_cores


def test_every_offloaded_configuration_comes_as_stock_exact_and_delayed():
    rows = offload_overlap.configs([1.0, 0.5])
    labels = [label for label, _, _ in rows]
    assert labels == [
        "gpu_resident",
        "stock_offload_1.0", "exact_offload_1.0", "delayed_offload_1.0",
        "stock_offload_0.5", "exact_offload_0.5", "delayed_offload_0.5",
        "delayed_offload_1.0_all_cores",
    ]  # fmt: skip
    by = {label: (ov, opts) for label, ov, opts in rows}
    assert by["gpu_resident"][0] == {"use_precision_aware_optimizer": True}
    assert by["stock_offload_0.5"][1] is None  # stock: no MegatronOptions, no option
    assert by["exact_offload_0.5"][0]["optimizer_offload_fraction"] == 0.5
    assert by["exact_offload_1.0"][1] == {"offload_step": "chunked"}
    assert by["delayed_offload_1.0"][1]["offload_delayed_update"] is True
    assert not by["exact_offload_1.0"][1].get("offload_delayed_update", False)
    # the default worker leaves the launching thread a core; the last row takes them all
    assert "offload_threads" not in by["delayed_offload_1.0"][1]
    assert by["delayed_offload_1.0_all_cores"][1]["offload_threads"] == usable_cores()


def test_kept_is_the_gpu_resident_time_at_the_same_micro_batch_count_over_its_own():
    rows = [
        {"config": "gpu_resident", "micro_batches": 1, "step_ms": 30.0},
        {"config": "delayed_offload_1.0", "micro_batches": 1, "step_ms": 40.0},
        {"config": "gpu_resident", "micro_batches": 8, "step_ms": 200.0},
        {"config": "delayed_offload_1.0", "micro_batches": 8, "step_ms": 210.0},
        {"config": "stock_offload_1.0", "micro_batches": 8, "error": "boom"},
    ]
    offload_overlap.add_kept(rows)
    assert rows[0]["kept"] == 1.0
    assert rows[1]["kept"] == pytest.approx(0.75)
    assert rows[3]["kept"] == pytest.approx(200 / 210)
    assert "kept" not in rows[4]


def test_it_refuses_without_cuda_and_writes_nothing(tmp_path):
    with pytest.raises(SystemExit, match="needs CUDA.*nothing written"):
        offload_overlap.main(["--device", "cpu", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def test_the_plot_shows_kept_and_the_loss_curves(tmp_path):
    pytest.importorskip("matplotlib")
    args = offload_overlap.parse_args(["--out", str(tmp_path), "--device", "cpu"])
    rows = [
        {"config": "gpu_resident", "micro_batches": 1, "step_ms": 30.0},
        {"config": "delayed_offload_1.0", "micro_batches": 1, "step_ms": 40.0},
    ]
    offload_overlap.add_kept(rows)
    loss = {
        "losses": {"exact": [3.0, 2.0, 1.5], "delayed": [3.0, 2.1, 1.6]},
        "last_relative": 0.05,
        "last_steps": 3,
    }
    offload_overlap._plot({"rows": rows, "loss": loss}, args, "title")
    assert (tmp_path / "offload_overlap.png").stat().st_size > 0
