"""benchmarks/offload_scale.py on the CPU: its FLOP count against Megatron-LM's own function
and the GEMMs written out, its columns' arithmetic, its command line, the driver's rows for
a child that times out, crashes or is stopped, the CPU run that skips every row, and every
kind run for real in processes of their own through megatron-core's DDP and optimizers on
the CPU shim (``tests/support/scale_rows_cpu.py``) at a toy size."""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import offload_overlap, offload_scale

pytestmark = pytest.mark.mcore

ROOT = Path(__file__).resolve().parents[1]
TOY = ["--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "128", "--seq", "16"]
TOY += ["--batch", "2", "--micro-batches", "2", "3", "--steps", "3", "--warmup", "2"]


def flops_by_gemm(layers: int, hidden: int, vocab: int, seq: int, sequences: int) -> float:
    """Forward and backward FLOPs written GEMM by GEMM (2 per multiply-add, backward twice
    the forward): QKV, projection, the MLP's two, QK^T and its product with V over the
    causal half, the logits."""
    h, s = hidden, seq
    per_layer = 2 * s * h * 3 * h + 2 * s * h * h + 2 * s * h * 4 * h + 2 * s * 4 * h * h
    per_layer += (2 * s * s * h + 2 * s * s * h) / 2
    forward = layers * per_layer + 2 * s * h * vocab
    return 3 * forward * sequences


def megatron_lm_flops(layers: int, hidden: int, heads: int, vocab: int, seq: int, n: int):
    """Megatron-LM's ``num_floating_point_operations`` (the megatron-core wheel's
    ``megatron/training``) for a dense GPT of these sizes."""
    training = pytest.importorskip("megatron.training.training")
    args = SimpleNamespace(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        padded_vocab_size=vocab, seq_length=seq, ffn_hidden_size=4 * hidden,
        kv_channels=hidden // heads, num_query_groups=heads, group_query_attention=False,
        num_experts=None, mtp_num_layers=None, moe_ffn_hidden_size=None, moe_latent_size=None,
        moe_shared_expert_intermediate_size=None, moe_router_topk=1, moe_layer_freq=1,
        swiglu=False, multi_latent_attention=False, attention_output_gate=False,
        experimental_attention_variant=None, hybrid_layer_pattern=None,
    )  # fmt: skip
    return training.num_floating_point_operations(args, n)


@pytest.mark.parametrize(("size", "sequences"), [("0.35b", 1), ("2.7b", 16), ("6.7b", 8)])
def test_the_flops_are_megatron_lms_and_the_gemms(size, sequences):
    layers, hidden, heads = offload_scale.SIZES[size]
    got = offload_scale.megatron_flops(layers, hidden, 50304, 2048, sequences)
    assert got == pytest.approx(flops_by_gemm(layers, hidden, 50304, 2048, sequences), rel=1e-12)
    want = megatron_lm_flops(layers, hidden, heads, 50304, 2048, sequences)
    assert got == pytest.approx(want, rel=1e-12)
    # the brief's older count (attention not halved, logits /16): not what Megatron-LM counts
    older = 72 * sequences * 2048 * layers * hidden**2
    older *= 1 + 2048 / (6 * hidden) + 50304 / (16 * layers * hidden)
    assert got != pytest.approx(older, rel=1e-3)


def test_the_sizes_are_gpt3s_shapes_and_their_parameter_counts():
    sizes = offload_scale.SIZES
    assert sizes["1.3b"] == (24, 2048, 16) and sizes["2.7b"] == (32, 2560, 32)
    assert sizes["6.7b"] == (32, 4096, 32) and sizes["13b"] == (40, 5120, 40)
    for name, (layers, hidden, heads) in sizes.items():
        assert hidden % heads == 0
        billions = offload_scale.gpt_params(layers, hidden, 50304, 2048) / 1e9
        # GPT-3 shares its output layer with the word embedding; megatron-core's GPTModel
        # does not by default: V h more (0.05B at 1024, 0.2B at 4096)
        untied = 50304 * hidden / 1e9
        assert billions - untied == pytest.approx(float(name.removesuffix("b")), rel=0.05), name


@pytest.mark.parametrize(
    ("name", "given", "want"),
    [
        ("NVIDIA H100 80GB HBM3", None, 989.0),
        ("NVIDIA H100 PCIe", None, 756.0),
        ("NVIDIA H200", None, 989.0),
        ("NVIDIA A100-SXM4-80GB", None, 312.0),
        ("NVIDIA L4", None, None),
        ("CPU", None, None),
        ("NVIDIA H100 80GB HBM3", 500.0, 500.0),
    ],
)
def test_the_peak_comes_from_the_device_name_unless_given(name, given, want):
    assert offload_scale.peak_tflops(name, given) == want


# torch's message for a CUDA out-of-memory error (c10/cuda/CUDACachingAllocator.cpp)
OOM = (
    "CUDA out of memory. Tried to allocate {req}. GPU 0 has a total capacity of 79.19 GiB of "
    "which 3.06 GiB is free. Including non-PyTorch memory, this process has 76.12 GiB memory "
    "in use. Of the allocated memory {held} is allocated by PyTorch, and 211.48 MiB is "
    "reserved by PyTorch but unallocated."
)


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # with its traceback, as a row's error has one
        return caught


def test_an_out_of_memory_row_has_the_bytes_torch_names():
    exc = torch.cuda.OutOfMemoryError(OOM.format(req="20.00 GiB", held="75.40 GiB"))
    got = offload_scale.failed(_raised(exc))
    assert got["oom"] is True and got["error"].startswith("OutOfMemoryError: CUDA out of")
    assert got["oom_request_bytes"] == 20 * 2**30
    assert got["oom_held_bytes"] == round(75.40 * 2**30)
    got = offload_scale.oom_fields(
        torch.cuda.OutOfMemoryError(OOM.format(req="512.00 MiB", held="1.50 KiB"))
    )
    assert got == {"oom": True, "oom_request_bytes": 2**29, "oom_held_bytes": 1536}
    assert offload_scale.oom_fields(torch.cuda.OutOfMemoryError("out of memory")) == {"oom": True}
    assert offload_scale.oom_fields(RuntimeError(OOM.format(req="1 GiB", held="1 GiB"))) == {}
    assert "oom" not in offload_scale.failed(_raised(RuntimeError("boom")))


def test_host_memory_is_the_process_resident_set_and_its_peak():
    import resource

    before = offload_scale.host_memory()
    block = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB, written
    after = offload_scale.host_memory()
    assert after["VmRSS"] - before["VmRSS"] >= 200 * 2**20
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux
    assert after["VmHWM"] >= after["VmRSS"]
    assert abs(after["VmHWM"] - peak_kib * 1024) <= 64 * 2**20
    del block


def _row(kind: str, micro: int, step_s: float | None, peak: float | None = 2.0, **shape):
    args = offload_scale.parse_args(
        [*TOY, *sum(([f"--{k}", str(v)] for k, v in shape.items()), [])]
    )
    row = offload_scale.row_fields(args, kind, micro) | {"peak_tflops": peak}
    return row if step_s is None else row | {"step_s": step_s}


def test_the_derived_columns_are_the_stated_arithmetic():
    rows: list[dict] = []
    offload_scale.merge(rows, [
        _row("fwd_bwd", 2, 0.5), _row("exact", 2, 0.8), _row("delayed", 3, 0.9, peak=None),
        _row("fwd_bwd", 3, 0.6), _row("stock", 2, None) | {"error": "boom"},
        _row("exact", 2, 0.7, layers=2),  # another shape: no fwd_bwd row to keep against
    ])  # fmt: skip
    by = {(r["kind"], r["micro_batches"], r["layers"]): r for r in rows}
    exact = by["exact", 2, 1]
    tokens = 2 * 2 * 16  # micro-batches x sequences x tokens
    flops = 2 * 2 * (16 * (72 * 64**2 + 6 * 64 * 128) + 6 * 64 * 16**2)
    assert exact["tokens_per_step"] == tokens and exact["flops_per_step"] == flops
    assert exact["tokens_per_s"] == pytest.approx(tokens / 0.8)
    assert exact["model_tflops"] == pytest.approx(flops / 0.8 / 1e12)
    assert exact["mfu"] == pytest.approx(flops / 0.8 / 1e12 / 2.0)
    assert exact["kept"] == pytest.approx(0.5 / 0.8)
    assert by["fwd_bwd", 3, 1]["kept"] == 1.0
    assert by["delayed", 3, 1]["kept"] == pytest.approx(0.6 / 0.9)
    assert "mfu" not in by["delayed", 3, 1]  # no peak known
    assert not {"kept", "tokens_per_s", "mfu"} & set(by["stock", 2, 1])
    assert "kept" not in by["exact", 2, 2] and "tokens_per_s" in by["exact", 2, 2]
    # a later run's row of the same key replaces it, and the derived columns follow
    offload_scale.merge(rows, [_row("fwd_bwd", 2, 0.4)])
    assert len(rows) == 6
    exact = next(r for r in rows if r["kind"] == "exact" and r["layers"] == 1)
    assert exact["kept"] == pytest.approx(0.4 / 0.8)
    offload_scale.merge(rows, [_row("fwd_bwd", 2, None) | {"error": "timed out"}])
    exact = next(r for r in rows if r["kind"] == "exact" and r["layers"] == 1)
    assert "kept" not in exact


def test_the_command_line_takes_a_size_or_a_shape_and_refuses_nonsense(capsys):
    args = offload_scale.parse_args(["--size", "6.7b"])
    assert (args.layers, args.hidden, args.heads) == (32, 4096, 32)
    assert (args.seq, args.batch, args.vocab, args.micro_batches) == (2048, 1, 50304, [8, 16])
    assert args.kinds == list(offload_scale.KINDS) and args.row is None and args.fraction == 1.0
    assert offload_scale.size_label(args) == "6.7b"
    args = offload_scale.parse_args(["--size", "6.7b", "--layers", "2"])
    assert (args.layers, args.hidden, args.heads) == (2, 4096, 32)
    assert offload_scale.size_label(args) == "2x4096"
    for argv, words in (
        (["--hidden", "100", "--heads", "16"], "--heads 16 does not divide --hidden 100"),
        (["--micro-batches", "8", "0"], "--micro-batches [8, 0]: every count"),
        (["--steps", "0"], "--steps 0: at least one"),
        (["--fraction", "0"], "--fraction 0.0: an offload fraction"),
        (["--fraction", "1.5"], "--fraction 1.5: an offload fraction"),
    ):
        with pytest.raises(SystemExit):
            offload_scale.parse_args(argv)
        assert words in capsys.readouterr().err


def test_the_offloaded_kinds_are_offload_overlaps_configurations():
    got = offload_scale.kind_configs(1.0)
    assert set(got) == set(offload_scale.KINDS) - {"fwd_bwd", "deepspeed"}
    theirs = {label: (ov, opts) for label, ov, opts in offload_overlap.configs([1.0])}
    for kind in ("gpu_resident", "stock", "exact", "overlapped", "delayed"):
        label, overrides, options = got[kind]
        assert (overrides, options) == theirs[label] and offload_overlap.kind_of(label) == kind
    assert got["stock"][2] is None
    label, overrides, options = got["delayed_bf16"]
    assert options == got["delayed"][2] and options["offload_delayed_update"] is True
    assert overrides == got["delayed"][1] | {
        "exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16
    }  # fmt: skip
    assert offload_scale.kind_configs(0.5)["exact"][1]["optimizer_offload_fraction"] == 0.5


def test_the_layer_spec_is_checked_before_anything_is_built():
    from benchmarks import train_step

    with pytest.raises(ValueError, match="layer_spec 'tex': use one of"):
        train_step._model(SimpleNamespace(), True, layer_spec="tex")
    assert offload_scale.choose_layer_spec("local") == ("local", "--layer-spec local")
    assert offload_scale.choose_layer_spec("te") == ("te", "--layer-spec te")
    assert offload_scale.choose_layer_spec("auto") == ("local", "no GPU, no transformer-engine")


def test_a_step_without_an_optimizer_is_forward_backward_and_the_sync():
    """offload_overlap.train_step with no optimizer: gradients zeroed, every micro-batch's
    backward (the sync only after the last), the mean loss; nothing stepped."""
    calls = []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor(2.0))

        def forward(self, tokens, position, mask, labels):
            calls.append("forward")
            return (self.w * tokens.float() - labels.float()) ** 2

        def zero_grad_buffer(self):
            calls.append("zero")
            self.w.grad = None

        def no_sync(self):
            calls.append("no_sync")
            return offload_overlap._nothing()

        def finish_grad_sync(self):
            calls.append("sync")

    model = Model()
    micro = [(torch.tensor([[1.0, 2.0]]), None, None, torch.tensor([[0.0, 1.0]])),
             (torch.tensor([[3.0, 1.0]]), None, None, torch.tensor([[1.0, 1.0]]))]  # fmt: skip
    loss = offload_overlap.train_step(model, None, micro)
    assert calls == ["zero", "no_sync", "forward", "forward", "sync"]
    want = ((4.0 + 9.0) / 2 + (25.0 + 1.0) / 2) / 2
    assert float(loss) == pytest.approx(want)
    # d/dw of the mean of means: sum over micro-batches of mean(2 x (w x - y) x) / 2
    grad = ((2 * 2 * 1 + 2 * 3 * 2) / 2 + (2 * 5 * 3 + 2 * 1 * 1) / 2) / 2
    assert float(model.w.grad) == pytest.approx(grad)
    assert float(model.w.detach()) == 2.0


# --- the driver, with children that stand in for the rows ------------------------------


def _stub_children(monkeypatch, code: str) -> None:
    """Every child runs ``code`` (python) with the out folder as sys.argv[1] and the
    argument list as sys.argv[2:]."""
    monkeypatch.setattr(
        offload_scale,
        "child_command",
        lambda argv, kind, out: [sys.executable, "-c", code, str(out), *argv, "--row", kind],
    )


ONE_ROW_THEN = """
import json, sys
from pathlib import Path
out, kind = Path(sys.argv[1]), sys.argv[sys.argv.index("--row") + 1]
out.mkdir(parents=True, exist_ok=True)
(out / "offload_scale.json").write_text(json.dumps([{rows}[kind]]))
print("RuntimeError: the second row failed hard", flush=True)
{then}
"""


def one_row_then(then: str) -> str:
    """A child (no torch imported: it starts at once) that writes its kind's row at two
    micro-batches, 0.25 s a step, then does ``then``."""
    args = offload_scale.parse_args(TOY)
    rows = {
        kind: offload_scale.row_fields(args, kind, 2) | {"step_s": 0.25}
        for kind in offload_scale.KINDS
    }
    return ONE_ROW_THEN.format(rows=repr(rows), then=then)


@pytest.mark.parametrize(
    ("then", "why"),
    [
        (
            "import time; time.sleep(60)",
            "timed out: the process ran past --row-timeout 3 s and was killed",
        ),
        (
            "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
            "crashed: killed by SIGKILL (the host's out-of-memory killer, if not a time "
            "limit): RuntimeError: the second row failed hard",
        ),
        ("sys.exit(3)", "crashed: exited with 3: RuntimeError: the second row failed hard"),
        ("", "the process ended without writing this row"),
    ],
)
def test_a_child_that_hangs_or_dies_leaves_its_rows_and_a_row_saying_why(
    tmp_path, monkeypatch, capsys, then, why
):
    _stub_children(monkeypatch, one_row_then(then))
    rows = offload_scale.main(
        [*TOY, "--device", "cuda", "--out", str(tmp_path), "--kinds", "exact", "fwd_bwd",
         "--row-timeout", "3"]
    )  # fmt: skip
    assert [(r["kind"], r["micro_batches"]) for r in rows] == [
        ("exact", 2), ("exact", 3), ("fwd_bwd", 2), ("fwd_bwd", 3)
    ]  # fmt: skip
    assert rows[0]["step_s"] == 0.25 and rows[0]["kept"] == 1.0  # fwd_bwd's at 2 is 0.25 too
    assert rows[1]["error"] == why and rows[3]["error"] == why
    assert json.loads((tmp_path / "offload_scale.json").read_text()) == rows
    assert not (tmp_path / "offload_scale-rows").exists()  # the children's files merged
    assert "RuntimeError: the second row failed hard" in capsys.readouterr().err  # echoed


def test_a_stopped_run_ends_its_child_and_says_which_rows_it_did_not_measure(tmp_path, monkeypatch):
    """SIGTERM (an outer time limit) in the middle of the first kind: its child is killed,
    the row it wrote stays, every other row says the run was stopped, the JSON has them."""
    _stub_children(monkeypatch, one_row_then("import time; time.sleep(60)"))
    pids = []
    real_popen = offload_scale.subprocess.Popen

    def popen(*a, **k):
        proc = real_popen(*a, **k)
        pids.append(proc)
        threading.Timer(4.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        return proc

    monkeypatch.setattr(offload_scale.subprocess, "Popen", popen)
    before = signal.getsignal(signal.SIGTERM)
    rows = offload_scale.main(
        [*TOY, "--device", "cuda", "--out", str(tmp_path), "--kinds", "exact", "delayed"]
    )
    assert signal.getsignal(signal.SIGTERM) is before  # the driver's handler is gone
    assert len(pids) == 1 and pids[0].returncode == -signal.SIGKILL  # killed, not waited for
    assert [(r["kind"], r["micro_batches"]) for r in rows] == [
        ("exact", 2), ("exact", 3), ("delayed", 2), ("delayed", 3)
    ]  # fmt: skip
    assert rows[0]["step_s"] == 0.25
    for row in rows[1:]:
        assert row["error"] == (
            "not measured: the run was stopped (SIGTERM) before this row ended"
        ), row
    assert json.loads((tmp_path / "offload_scale.json").read_text()) == rows


def test_on_the_cpu_every_row_says_it_was_skipped(tmp_path, capsys):
    rows = offload_scale.main([*TOY, "--device", "cpu", "--out", str(tmp_path)])
    assert [(r["kind"], r["micro_batches"]) for r in rows] == [
        (k, m) for k in offload_scale.KINDS for m in (2, 3)
    ]
    assert all(r["error"] == offload_scale.SKIPPED_ON_CPU for r in rows)
    assert json.loads((tmp_path / "offload_scale.json").read_text()) == rows
    assert (tmp_path / "offload_scale.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "skipped on the CPU" in out and "s * (72 L h^2 + 6 h V) + 6 L h s^2" in out


def test_merge_reads_earlier_runs_and_kinds_none_only_reports(tmp_path):
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps([_row("fwd_bwd", 2, 0.5), _row("exact", 2, 1.0)]))
    rows = offload_scale.main(
        [*TOY, "--device", "cuda", "--out", str(tmp_path / "o"), "--kinds", "--merge",
         str(earlier)]
    )  # fmt: skip
    assert [r["kind"] for r in rows] == ["fwd_bwd", "exact"]
    assert rows[1]["kept"] == pytest.approx(0.5)
    assert json.loads((tmp_path / "o" / "offload_scale.json").read_text()) == rows


# --- every kind for real, each in its own process, on the CPU shim ----------------------


def test_every_kind_runs_in_a_process_of_its_own_on_the_cpu_shim(tmp_path, monkeypatch, capsys):
    """The driver starts each kind's ``--row`` process (under the CPU shim): every kind
    but DeepSpeed (where it is not installed) trains; each row's columns are the stated
    arithmetic of its step times; the memory columns are this process's; ours report
    their host state, bf16 moments half the fp32 ones; the JSON grew row by row."""
    wrapper = ROOT / "tests" / "support" / "scale_rows_cpu.py"
    monkeypatch.setattr(
        offload_scale,
        "child_command",
        lambda argv, kind, out: [sys.executable, str(wrapper), *argv, "--row", kind,
                                 "--out", str(out)],
    )  # fmt: skip
    written = []
    real_write = offload_scale.write_json

    def write(rows, out, name):
        written.append(len([r for r in rows if "step_s" in r or "error" in r]))
        return real_write(rows, out, name)

    monkeypatch.setattr(offload_scale, "write_json", write)
    rows = offload_scale.main(
        [*TOY, "--device", "cuda", "--out", str(tmp_path), "--peak-tflops", "0.5"]
    )
    err = capsys.readouterr().err
    by = {(r["kind"], r["micro_batches"]): r for r in rows}
    assert list(by) == [(k, m) for k in offload_scale.KINDS for m in (2, 3)]
    try:
        import deepspeed  # noqa: F401

        deepspeed_ran = True
    except ImportError:
        deepspeed_ran = False
    for micro in (2, 3):
        assert "error" not in by["fwd_bwd", micro], by["fwd_bwd", micro]
    fwd_bwd = {m: by["fwd_bwd", m]["step_s"] for m in (2, 3)}
    params = offload_scale.gpt_params(1, 64, 128, 16)
    for (kind, micro), row in by.items():
        if kind == "deepspeed" and not deepspeed_ran:
            assert row["error"].startswith("RuntimeError: deepspeed is not installed"), row
            continue
        assert "error" not in row, row
        assert row["layer_spec"] == "local" and row["run"].startswith("CPU: ")
        assert row["params_built"] == params, kind
        assert len(row["step_all_s"]) == 3 and row["step_s"] == statistics.median(row["step_all_s"])
        tokens = micro * 2 * 16
        flops = flops_by_gemm(1, 64, 128, 16, micro * 2)
        assert row["tokens_per_s"] == pytest.approx(tokens / row["step_s"])
        assert row["model_tflops"] == pytest.approx(flops / row["step_s"] / 1e12)
        assert row["mfu"] == pytest.approx(flops / row["step_s"] / 1e12 / 0.5)
        assert row["kept"] == pytest.approx(fwd_bwd[micro] / row["step_s"])
        assert row["build_s"] > 0 and ("first_step_s" in row) is (micro == 2)
        assert row["host_peak_bytes"] >= row["host_rss_built_bytes"] > 100 * 2**20
        assert "gpu_peak_bytes" not in row  # no GPU: no device figures, not zeros
        assert torch.isfinite(torch.tensor(row["loss"]))
        ours = kind in ("exact", "overlapped", "delayed", "delayed_bf16")
        assert ("host_state_bytes" in row) is ours, kind
        assert ("worker_s" in row) is (kind in ("overlapped", "delayed", "delayed_bf16")), kind
        if ours:
            assert row["pinned_bytes"] == 0  # no CUDA: the mirrors are not pinned
            assert row["host_state_bytes"] > row["moment_bytes"] > 0
        if kind == "deepspeed":
            assert row["optimizer_class"] == "DeepSpeedZeroOptimizer/DeepSpeedCPUAdam"
            assert row["optimizer_steps"] == 5 * (1 + (micro == 3))  # one per step
    for micro in (2, 3):
        fp32, bf16 = by["delayed", micro], by["delayed_bf16", micro]
        assert bf16["moment_bytes"] * 2 == fp32["moment_bytes"]
    assert "exact x3: step 5/5" in err and "deepspeed: starting its process" in err
    assert written == sorted(written) and len(set(written)) > len(offload_scale.KINDS)
    assert json.loads((tmp_path / "offload_scale.json").read_text()) == rows
    assert (tmp_path / "offload_scale.png").stat().st_size > 0


def test_the_gpu_figures_are_torchs_peaks_and_its_pinned_allocators(monkeypatch):
    """With CUDA (stood in for): the device's peaks and the pinned allocator's current and
    peak bytes; without its statistics (an older torch, or an error), the peaks alone."""
    assert offload_scale.device_memory() == {}  # no GPU here
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda *a: 5)
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda *a: 7)
    held = {"allocated_bytes.current": 11, "allocated_bytes.peak": 13, "active_bytes.peak": 1}
    monkeypatch.setattr(cuda, "host_memory_stats", lambda: held, raising=False)
    assert offload_scale.device_memory() == {
        "gpu_peak_bytes": 5, "gpu_reserved_peak_bytes": 7,
        "pinned_alloc_bytes": 11, "pinned_alloc_peak_bytes": 13,
    }  # fmt: skip

    def refuses():
        raise RuntimeError("no pinned allocator")

    monkeypatch.setattr(cuda, "host_memory_stats", refuses)
    assert offload_scale.device_memory() == {"gpu_peak_bytes": 5, "gpu_reserved_peak_bytes": 7}
    monkeypatch.delattr(cuda, "host_memory_stats")
    assert offload_scale.device_memory() == {"gpu_peak_bytes": 5, "gpu_reserved_peak_bytes": 7}


def test_auto_takes_te_on_a_gpu_where_it_imports(monkeypatch):
    import builtins
    import importlib

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    spec, why = offload_scale.choose_layer_spec("auto")  # no transformer-engine here
    assert spec == "local" and why.startswith("transformer-engine does not import (")
    real_import = builtins.__import__

    def fake_te(name, *args, **kwargs):
        if name == "transformer_engine.pytorch":
            return importlib.import_module("json")  # any module: it imported
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_te)
    assert offload_scale.choose_layer_spec("auto") == ("te", "transformer-engine imports")
