"""The main job's first section: stock megatron-core's norm of a mixed bf16/fp32 list next to
ours and fp64. The CPU branch for real; the GPU branch's parsing and printing with stand-in
child processes (the real children need CUDA: tests/gpu and the main job on a GPU)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from megatron_ext import mixed_list_demo as demo

pytestmark = pytest.mark.mcore

CPU = torch.device("cpu")
TE_KERNEL = "transformer_engine_torch.multi_tensor_l2norm"
CUDA_ERROR = """Traceback (most recent call last):
  File "x.py", line 1, in <module>
RuntimeError: CUDA error: an illegal memory access was encountered
CUDA kernel errors might be asynchronously reported at some other API call.
Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.

[rank0]:[W1204 ProcessGroupNCCL.cpp:1] Warning: destroy_process_group() was not called
"""


def _proc(reports: list[dict], returncode: int = 0, stderr: str = ""):
    stdout = "".join(json.dumps(r) + "\n" for r in reports)
    return subprocess.CompletedProcess(["child"], returncode, stdout, stderr)


def _row(lines: list[str], order: str) -> list[str]:
    return next(line for line in lines if line.lstrip().startswith(order)).split()


@pytest.mark.parametrize("order", demo.ORDERS)
def test_ours_and_fp64_are_the_true_norm_in_both_orders(order):
    tensors = demo.make_list(order, CPU)
    assert demo.fp64_norm(tensors) == 0.25
    assert demo.ours_norm(tensors) == pytest.approx(0.25, rel=1e-7)


def test_the_emulated_read_gives_the_h200s_wrong_norm_and_stops_at_the_allocation():
    # bf16 first: the fp32 tensor's 512 bytes read as 128 bf16 values, 64 of them 1/64 and 64
    # zero (the low halves): sqrt(128 + 64) / 64 = sqrt(3) / 8 = 0.2165, the H200's figure
    emu = demo.emulate_first_dtype_read(demo.make_list("bf16,fp32", CPU))
    assert emu.norm == pytest.approx(3**0.5 / 8, rel=1e-7) and emu.past_end == 0
    # fp32 first: 128 fp32 values from the bf16 tensor's 256 bytes, half of them past its end
    emu = demo.emulate_first_dtype_read(demo.make_list("fp32,bf16", CPU))
    assert emu.past_end == 64 and 0.2 < emu.norm < 0.25


def test_without_stock_the_output_says_it_cannot_show_the_bug_and_labels_the_rest():
    lines = demo.report(CPU, te_installed=False, stock=None)
    text = "\n".join(lines)
    for order in demo.ORDERS:
        assert _row(lines, order)[1:5] == ["not", "run", "0.250000", "0.250000"]
    assert _row(lines, "bf16,fp32")[5] == "0.216506"
    assert "cannot be shown here" in text and "an emulation, not stock's result" in text
    assert "Recorded on an H200 with TE 2.20.2 (not computed here)" in text


def test_main_on_the_cpu_runs_no_child(monkeypatch, capsys):
    def never(*args, **kwargs):
        raise AssertionError("stock needs CUDA: no child on the CPU")

    monkeypatch.setattr(demo, "run_stock_child", never)
    demo.main(["--device", "cpu"])
    assert "stock megatron-core: not run" in capsys.readouterr().out


def test_stock_results_print_what_the_children_computed_and_how_they_ended():
    te = {"kernel": TE_KERNEL, "fallback": False}
    procs = {
        "bf16,fp32": _proc([te, {**te, "norm": 0.21650634706020355}]),
        # the reversed order can die after reporting its kernel: a result, not the end
        "fp32,bf16": _proc([te], 1, CUDA_ERROR),
    }
    stock = demo.stock_results(lambda order: procs[order])
    assert stock["bf16,fp32"] == demo.StockResult(0.21650634706020355, TE_KERNEL, False)
    assert stock["fp32,bf16"].norm is None
    assert stock["fp32,bf16"].failure == (
        "process ended with status 1: RuntimeError: CUDA error: an illegal memory access "
        "was encountered"
    )
    lines = demo.report(CPU, te_installed=True, stock=stock)
    assert _row(lines, "bf16,fp32")[1:4] == ["0.216506", "0.250000", "0.250000"]
    assert _row(lines, "fp32,bf16")[1] == "failed"
    text = "\n".join(lines)
    assert f"stock fp32,bf16: kernel {TE_KERNEL}; process ended with status 1" in text
    assert "not computed here" not in text and "cannot be shown" not in text


def test_stock_on_megatrons_fallback_is_printed_as_right_and_the_bug_as_not_shown():
    fb = {"kernel": "megatron.core.utils.local_multi_tensor_l2_norm", "fallback": True}
    stock = demo.stock_results(lambda order: _proc([fb, {**fb, "norm": 0.25}]))
    lines = demo.report(CPU, te_installed=False, stock=stock)
    assert all(_row(lines, o)[1] == "0.250000" for o in demo.ORDERS)
    assert "per-tensor torch fallback" in "\n".join(lines)


def test_a_child_that_reports_nothing_is_a_failure_with_its_last_message():
    got = demo.stock_result(_proc([], 1, "Traceback\nModuleNotFoundError: No module named 'x'\n"))
    assert got.norm is None and got.kernel == "unknown"
    assert got.failure.endswith("ModuleNotFoundError: No module named 'x'")


def test_a_hung_child_is_killed_and_reported(monkeypatch):
    def hang(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"], output=b'{"kernel": "k"}\n')

    monkeypatch.setattr(subprocess, "run", hang)
    got = demo.stock_result(demo.run_stock_child("bf16,fp32", "cuda", timeout_s=5))
    assert got.norm is None and got.kernel == "k"
    assert got.failure == "process ended with status -9: killed after 5 s"


def test_the_child_reports_the_kernel_megatron_core_bound_then_stocks_norm(monkeypatch, capsys):
    # The real seam lookups; the process group and stock's CUDA-only function stood in for.
    from megatron_ext import seam

    stock_target = seam.target
    called = []
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: None)
    monkeypatch.setattr(
        seam,
        "target",
        lambda name: (
            called.append(name) or (lambda grads: torch.tensor([0.5]))
            if name == "get_grad_norm_fp32"
            else stock_target(name)
        ),
    )
    demo._stock_child("bf16,fp32", "cpu")
    first, last = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert called == ["get_grad_norm_fp32"]
    fallback = "megatron.core.utils.local_multi_tensor_l2_norm"  # no TE or Apex on the CPU
    assert first == {"kernel": fallback, "fallback": True}
    assert last == {**first, "norm": 0.5}
