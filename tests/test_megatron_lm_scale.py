"""tests/gpu/megatron_lm_scale.py (pretrain_gpt.py at a GPT-3 size with the offload flags)
rehearsed on the CPU: its command lines parsed by Megatron-LM's own parser with
megatron_ext.train's flags, the timing parsed from lines in Megatron-LM's format, runs one at
a time with the outputs rewritten after each, its refusals, and scripts/gpu_session.sh's
step."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import megatron_lm_scale as s  # noqa: E402

from tests.support.gpu_session_stub import stub_repo  # noqa: E402
from tests.support.megatron_lm_logs import (  # noqa: E402
    STOCK_OFFLOAD_FAILURE,
    log_line,
    parse,
    pretrain_flags,
    stand_in,
)

pytestmark = pytest.mark.mcore
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("config", list(s.CONFIGS))
@pytest.mark.parametrize("size", ["6.7b", "tiny"])
def test_commands_parse_with_megatron_lms_parser(config, size, monkeypatch):
    from megatron_ext import seam

    if seam.installed_version()[:2] < (0, 19):
        pytest.skip("megatron_ext.train drives megatron-core >= 0.19's training loop")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    args = parse(
        pretrain_flags(s.command(config, size, 2048, 8, 20, ["--no-gradient-accumulation-fusion"]))
    )
    if size == "6.7b":  # GPT-3 6.7B, the base GPT's shape overridden
        assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (32, 4096, 32)
        assert args.seq_length == args.max_position_embeddings == 2048
        assert args.vocab_size == 50304
    else:
        assert (args.num_layers, args.hidden_size, args.seq_length) == (2, 256, 128)
    assert args.micro_batch_size == 1 and args.global_batch_size == 8
    assert args.train_iters == 20 and args.transformer_impl == "transformer_engine"
    assert args.bf16 and args.use_distributed_optimizer and args.log_throughput
    assert args.per_dtype_grad_buffers and args.use_precision_aware_optimizer
    assert args.optimizer_cpu_offload and args.optimizer_offload_fraction == 1.0
    assert args.offload_step == "chunked"
    assert args.keep_in_fp32_params == [r"layer_norm_weight$", r"final_layernorm\.weight$"]
    assert args.offload_delayed_update == config.startswith("delayed")
    import torch

    moments = torch.bfloat16 if config.endswith("bf16") else torch.float32
    assert args.exp_avg_dtype == args.exp_avg_sq_dtype == moments


def test_the_island_patterns_match_te_layer_norms_and_the_final_norm_only():
    import re

    patterns = s.ISLANDS[1].split(",")
    names = {  # megatron-core's GPT with transformer-engine's layer spec
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": True,
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": True,
        "decoder.final_layernorm.weight": True,
        "decoder.layers.0.self_attention.linear_qkv.weight": False,
        "decoder.layers.0.mlp.linear_fc1.layer_norm_bias": False,
        "embedding.word_embeddings.weight": False,
        "output_layer.weight": False,
    }
    for name, island in names.items():
        assert any(re.search(p, name) for p in patterns) == island, name


def test_timing_is_read_from_megatron_lms_lines():
    text = "\n".join(
        [
            "building GPT model ...",
            log_line(1, 3, 10.9, 3.0, ms=9000.0, tflops=12.5),
            log_line(2, 3, 10.1, 2.0, ms=2500.5, tflops=310.2),
            log_line(3, 3, 9.7, 1.0, ms=2400.0),  # without --log-throughput
            " elapsed time per iteration (ms): 5.0 | not an iteration line",
        ]
    )
    assert s.parse_timing(text) == {
        1: dict(ms=9000.0, tflops=12.5),
        2: dict(ms=2500.5, tflops=310.2),
        3: dict(ms=2400.0, tflops=None),
    }


def test_runs_one_at_a_time_and_the_table_holds_medians_after_the_skipped(
    tmp_path, monkeypatch, capsys
):
    timing = [(9000.0, 10.0), (3000.0, 200.0), (2000.0, 300.0), (2200.0, 280.0), (2100.0, 290.0)]
    fine = stand_in(tmp_path, 5, 0, [3.0, 2.0, 1.5, 1.2, 1.0], [11.0, 10.0, 9.5, 9.0, 8.5],
                    timing=timing)  # fmt: skip
    fails = stand_in(tmp_path, 5, 1, [], [], text=STOCK_OFFLOAD_FAILURE)
    order = []

    def command(config, *rest):
        order.append(config)
        return fails if config == "exact" else fine

    monkeypatch.setattr(s, "command", command)
    monkeypatch.setenv("MEGATRON_LM_PATH", str(tmp_path))
    launched = []
    real = s.te.run_group
    monkeypatch.setattr(s.te, "run_group", lambda cmd, env, where, timeout: (
        launched.append((where.name, (s.NAME + ".json") in os.listdir(where.parent))),
        real(cmd, env, where, timeout))[1])  # fmt: skip
    out = tmp_path / "out"
    argv = ["--out", str(out), "--size", "6.7b", "--configs", "delayed,exact", "--iters", "5"]
    assert s.main([*argv, "--skip", "2"]) == 1  # a failed run: exit 1
    printed = capsys.readouterr().out
    assert order == ["delayed", "exact"]
    # one at a time, the outputs written after the first before the second started
    assert launched == [("delayed-ours", False), ("exact-ours", True)]
    assert "[1/2] delayed at 6.7b" in printed and "[2/2] exact at 6.7b" in printed
    blob = json.loads((out / f"{s.NAME}.json").read_text())
    rows = {r["config"]: r for r in blob["rows"]}
    delayed = rows["delayed"]
    assert delayed["status"] == "ok" and delayed["iterations"] == 5
    assert (delayed["loss_first"], delayed["loss_last"]) == (11.0, 8.5)
    assert delayed["ms"] == 2100.0  # median of iterations 3-5
    assert delayed["tflops"] == 290.0
    assert delayed["tokens_per_s"] == pytest.approx(2048 * 8 / 2.1)
    assert delayed["norm_vs_fp64"] == 0.0
    assert rows["exact"]["status"] == "failed" and "non-leaf" in rows["exact"]["error"]
    text = (out / f"{s.NAME}.txt").read_text()
    assert text.startswith("pretrain_gpt.py at 6.7b, sequence 2048, 8 micro-batches")
    assert "exact: ValueError: can't optimize a non-leaf Tensor" in text
    assert text.strip() in printed


def test_dry_run_and_refusals_before_any_run(tmp_path, capsys, monkeypatch):
    assert s.main(["--out", "unused", "--dry-run", "--configs", "delayed,delayed_bf16"]) == 0
    printed = capsys.readouterr().out
    lines = [x for x in printed.splitlines() if not x.startswith("#")]
    assert len(lines) == 2 and all("pretrain_gpt.py" in shlex.split(x) for x in lines)
    assert "--exp-avg-dtype" in lines[1] and "--exp-avg-dtype" not in lines[0]
    for bad, said in [
        (["--configs", "delayed,nothing"], "unknown ['nothing']"),
        (["--configs", ","], "--configs"),
        (["--iters", "0"], "--iters must be > 0"),
        (["--micro-batches", "-1"], "--micro-batches must be > 0"),
        (["--iters", "5", "--skip", "5"], "--skip must be in [0, --iters)"),
        (["--size", "9b"], "invalid choice: '9b'"),
    ]:
        with pytest.raises(SystemExit):
            s.main(["--out", "unused", "--dry-run", *bad])
        assert said in capsys.readouterr().err
    monkeypatch.delenv("MEGATRON_LM_PATH", raising=False)
    with pytest.raises(SystemExit):
        s.main(["--out", str(tmp_path / "never")])
    assert "MEGATRON_LM_PATH" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("args", [None, "--size tiny --configs delayed,exact --iters 5"])
def test_the_gpu_session_step_runs_it_with_its_arguments(tmp_path, args):
    root, log, out, env = stub_repo(tmp_path, "MEGATRON_LM_PATH=${MEGATRON_LM_PATH:-}")
    env.pop("MEGATRON_LM_PATH", None)
    if args:
        env["MEGATRON_LM_SCALE_ARGS"] = args
    proc = subprocess.run(["bash", "scripts/gpu_session.sh", "megatron_lm_scale"], cwd=root,
                          env=env, capture_output=True, text=True)  # fmt: skip
    assert "=== megatron_lm_scale exit 0" in proc.stdout, proc.stdout + proc.stderr
    install, run = log.read_text().splitlines()
    assert "pip install" in install
    assert run.startswith(f"MEGATRON_LM_PATH={root}/.megatron-lm ")
    want = args or "--size 6.7b --configs delayed"
    assert run.endswith(f"tests/gpu/megatron_lm_scale.py --out {out}/megatron_lm_scale {want}")


def test_tiny_keeps_the_base_gpts_sequence_in_its_tokens(tmp_path, monkeypatch):
    timing = [(1000.0, 1.0), (500.0, 2.0)]
    fine = stand_in(tmp_path, 2, 0, [2.0, 1.0], [7.0, 6.0], timing=timing)
    monkeypatch.setattr(s, "command", lambda *a: fine)
    monkeypatch.setenv("MEGATRON_LM_PATH", str(tmp_path))
    out = tmp_path / "out"
    argv = ["--out", str(out), "--size", "tiny", "--configs", "delayed", "--iters", "2"]
    assert s.main([*argv, "--skip", "1", "--micro-batches", "4", "--seq", "4096"]) == 0
    blob = json.loads((out / f"{s.NAME}.json").read_text())
    assert s.TINY_SEQ == 128 and blob["seq"] == 128  # --seq does not reach the tiny GPT
    assert blob["rows"][0]["tokens_per_s"] == pytest.approx(128 * 4 / 0.5)
    assert blob["title"].startswith("pretrain_gpt.py at tiny, sequence 128, 4 micro-batches")
