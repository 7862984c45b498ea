"""tests/gpu/megatron_lm_te.py (Megatron-LM with transformer-engine's layers, ours vs stock)
rehearsed on the CPU: the command lines it builds (parsed by Megatron-LM's real argument
parser with megatron_ext.train's flags), the log parsing on lines in Megatron-LM's own
format, a launch of a stand-in run, the failure rows, the table, JSON and PNG."""

import json
import math
import shlex
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import megatron_lm_te as d  # noqa: E402

from tests.support.gpu_session_stub import stub_repo  # noqa: E402
from tests.support.megatron_lm_logs import (  # noqa: E402
    STOCK_OFFLOAD_FAILURE,
    log_line,
    parse,
    pretrain_flags,
    stand_in,
)

pytestmark = pytest.mark.mcore


def test_every_configuration_runs_ours_and_stock_once():
    runs = d.plan(list(d.CONFIGS), 20, [d.NO_FUSION])
    ours = [k for k in runs if k[1] == "ours"]
    stock = [k for k in runs if k[1] == "stock"]
    assert [c for c, _ in ours] == list(d.CONFIGS)
    # the chunked configuration's stock run is the per-parameter one's (stock lacks the flag)
    assert ("router_fp32_pa_offload_chunked", "stock") not in runs and len(stock) == 5
    for (config, arm), run in runs.items():
        flags = pretrain_flags(run.command)
        assert flags[flags.index("--transformer-impl") + 1] == "transformer_engine"
        assert flags[flags.index("--train-iters") + 1] == "20"
        assert d.NO_FUSION in flags
        assert ("--per-dtype-grad-buffers" in flags) == (arm == "ours")
        # ours names its CPU step wherever it offloads; stock takes none of our flags
        assert ("--offload-step" in flags) == ("offload" in config and arm == "ours")
        if config.startswith("router_fp32"):
            assert flags[flags.index("--keep-in-fp32-params") + 1] == r"router\.weight$"
            assert "--moe-router-dtype" in flags
        if "pa" in config.split("_"):
            assert "--use-precision-aware-optimizer" in flags
        if "offload" in config:
            assert "--optimizer-cpu-offload" in flags


def test_the_fusion_flag_follows_apexs_kernel(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert d.fusion_flags() == [d.NO_FUSION]
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if "fused_weight" in name else real(name),
    )
    assert d.fusion_flags() == []


@pytest.mark.parametrize("config", list(d.CONFIGS))
def test_commands_parse_with_megatron_lms_parser(config, monkeypatch):
    from megatron_ext import seam

    if seam.installed_version()[:2] < (0, 19):
        pytest.skip("megatron_ext.train drives megatron-core >= 0.19's training loop")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    for arm in ("ours", "stock"):
        args = parse(pretrain_flags(d.command(config, arm, 20, [d.NO_FUSION])))
        assert args.transformer_impl == "transformer_engine" and args.train_iters == 20
        assert args.per_dtype_grad_buffers == (arm == "ours")
        assert args.gradient_accumulation_fusion is False
        islands = config.startswith("router_fp32")
        assert args.keep_in_fp32_params == ([r"router\.weight$"] if islands else [])
        assert args.use_precision_aware_optimizer == ("pa" in config.split("_"))
        assert args.optimizer_cpu_offload == ("offload" in config)
        # ours: the step the config names with offload; else (stock too) not given (None:
        # MegatronOptions' default, the chunked step)
        step = None
        if arm == "ours" and "offload" in config:
            step = "chunked" if config.endswith("chunked") else "per_parameter"
        assert args.offload_step == step


def test_log_parsing_on_megatron_lms_format():
    text = "\n".join(
        [
            "INFO: building GPT model ...",
            log_line(1, 3, 6.934, 2.345678, zeros=12.0, moe=True),
            "[rank0]: some other line | grad norm: 9.0 |",
            log_line(2, 3, 6.5, math.inf, skipped=1),
            log_line(3, 3, None, math.nan, nan=1),
        ]
    )
    its = d.parse_log(text)
    assert sorted(its) == [1, 2, 3]
    assert its[1] == dict(loss=6.934, grad_norm=2.346, zeros=12.0, skipped=0, nan=0)
    assert its[2]["grad_norm"] == math.inf and its[2]["skipped"] == 1
    assert its[3]["loss"] is None and math.isnan(its[3]["grad_norm"]) and its[3]["nan"] == 1


def test_the_first_error_line_names_the_failure():
    assert d.first_error(STOCK_OFFLOAD_FAILURE) == "ValueError: can't optimize a non-leaf Tensor"
    refused = "megatron_ext.train: gradient_accumulation_fusion needs apex's ...: add --no-x"
    assert d.first_error(f"loading\n{refused}\n") == refused
    assert d.first_error("all fine\n") is None


def test_launch_runs_a_command_and_reads_its_log_and_record(tmp_path):
    cmd = stand_in(tmp_path, 3, 0, [2.5, 2.0, 1.5], [7.0, 6.5, 6.0])
    run = d.launch(d.Run("dense", "ours", cmd), tmp_path / "out", timeout=60)
    assert run.rc == 0 and run.status == "ok" and run.error is None
    assert [run.iterations[i]["loss"] for i in (1, 2, 3)] == [7.0, 6.5, 6.0]
    assert [r["norm"] for r in run.record] == [2.5, 2.0, 1.5]
    assert (tmp_path / "out" / "dense-ours" / "output.log").is_file()
    cmd = stand_in(tmp_path, 3, 1, [], [], text=STOCK_OFFLOAD_FAILURE)
    failed = d.launch(d.Run("router_fp32_pa_offload", "stock", cmd), tmp_path / "out", 60)
    assert failed.status == "failed" and "non-leaf" in failed.error and failed.record == []


def test_a_run_past_its_time_is_a_failed_row(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    run = d.launch(d.Run("dense", "stock", [sys.executable, str(script)]), tmp_path, timeout=2)
    assert run.rc == "timeout" and run.status == "failed"
    assert run.error.startswith("timed out after 2 s")


def test_table_json_and_png_with_stock_failing_and_non_finite(tmp_path):
    configs = ["dense", "router_fp32_pa", "router_fp32_pa_offload"]
    runs = d.plan(configs, 3, [d.NO_FUSION])
    out = tmp_path / "out"
    fine = stand_in(tmp_path, 3, 0, [2.5, 2.0, 1.5], [7.0, 6.5, 6.0])
    close = stand_in(tmp_path, 3, 0, [2.5, 2.0, 1.5], [7.0, 6.5, 6.003])
    inf = stand_in(tmp_path, 3, 0, [math.inf] * 3, [7.0, 6.9, 6.8])
    fails = stand_in(tmp_path, 3, 1, [], [], text=STOCK_OFFLOAD_FAILURE)
    commands = {("dense", "ours"): fine, ("dense", "stock"): close,
                ("router_fp32_pa", "ours"): fine, ("router_fp32_pa", "stock"): inf,
                ("router_fp32_pa_offload", "ours"): fine,
                ("router_fp32_pa_offload", "stock"): fails}  # fmt: skip
    for key, run in runs.items():
        run.command = commands[key]
        d.launch(run, out, timeout=60)
    text = d.write(runs, configs, out, [d.NO_FUSION])
    print(text)
    rows = {
        (r["config"], r["arm"]): r for r in json.loads((out / f"{d.NAME}.json").read_text())["rows"]
    }
    assert rows[("dense", "ours")]["loss_vs_stock"] == pytest.approx(0.003 / 6.003)
    assert rows[("dense", "ours")]["norm_vs_stock"] == 0.0
    assert rows[("router_fp32_pa", "stock")]["status"] == "non-finite norm"
    assert "loss_vs_stock" not in rows[("router_fp32_pa", "ours")]
    failed = rows[("router_fp32_pa_offload", "stock")]
    assert failed["status"] == "failed" and "non-leaf" in failed["error"]
    assert "router_fp32_pa_offload (stock): ValueError: can't optimize a non-leaf Tensor" in text
    assert (out / f"{d.NAME}.txt").read_text().strip() == text
    assert (out / f"{d.NAME}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_dry_run_and_its_refusals(capsys, monkeypatch):
    assert d.main(["--out", "unused", "--dry-run", "--configs", "dense"]) == 0
    printed = capsys.readouterr().out
    commands = [line for line in printed.splitlines() if not line.startswith("#")]
    assert len(commands) == 2 and "pretrain_gpt.py" in shlex.split(commands[0])
    with pytest.raises(SystemExit):
        d.main(["--out", "unused", "--dry-run", "--configs", "dense,nothing"])
    assert "unknown ['nothing']" in capsys.readouterr().err
    monkeypatch.delenv("MEGATRON_LM_PATH", raising=False)
    with pytest.raises(SystemExit):
        d.main(["--out", "unused"])
    assert "MEGATRON_LM_PATH" in capsys.readouterr().err


def test_gpu_session_steps_run_both_with_their_outputs(tmp_path):
    """scripts/gpu_session.sh's te_layers and megatron_lm_te steps, with a python3 that
    records its arguments: what each step runs, where its output goes; the tests step
    leaves the TE layer cells to their own step."""
    import subprocess

    records = "TE_LAYERS_OUT=${TE_LAYERS_OUT:-} MEGATRON_LM_PATH=${MEGATRON_LM_PATH:-}"
    root, log, out, env = stub_repo(tmp_path, records)
    env["MEGATRON_LM_TE_ARGS"] = "--configs dense,router_fp32"
    env.pop("MEGATRON_LM_PATH", None)
    steps = ["tests", "te_layers", "megatron_lm_te"]
    proc = subprocess.run(["bash", "scripts/gpu_session.sh", *steps], cwd=root, env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert all(f"=== {s} exit 0" in proc.stdout for s in steps), proc.stdout + proc.stderr
    install, tests, layers, lm = log.read_text().splitlines()
    assert "pip install" in install
    assert "--ignore=tests/gpu/test_te_layers_gpu.py" in tests
    assert layers.startswith(f"TE_LAYERS_OUT={out}/te_layers ")
    assert "-m pytest" in layers and layers.endswith("tests/gpu/test_te_layers_gpu.py")
    assert f"MEGATRON_LM_PATH={root}/.megatron-lm " in lm
    assert lm.endswith(f"tests/gpu/megatron_lm_te.py --out {out}/megatron_lm_te --configs "
                       "dense,router_fp32")  # fmt: skip


def test_main_runs_every_planned_run_and_writes_as_each_ends(tmp_path, monkeypatch, capsys):
    fine = stand_in(tmp_path, 3, 0, [2.5, 2.0, 1.5], [7.0, 6.5, 6.0])
    fails = stand_in(tmp_path, 3, 1, [], [], text=STOCK_OFFLOAD_FAILURE)
    monkeypatch.setenv("MEGATRON_LM_PATH", str(tmp_path))
    monkeypatch.setattr(
        d, "command", lambda config, arm, iters, fusion: fails if "offload" in config else fine
    )
    out = tmp_path / "out"
    argv = ["--out", str(out), "--configs", "dense,router_fp32_pa_offload", "--jobs", "2"]
    assert d.main(argv) == 1  # ours' offload run failed
    printed = capsys.readouterr().out
    assert "router_fp32_pa_offload (ours): failed ValueError" in printed
    rows = json.loads((out / f"{d.NAME}.json").read_text())["rows"]
    assert [(r["config"], r["arm"], r["status"]) for r in rows] == [
        ("dense", "ours", "ok"),
        ("dense", "stock", "ok"),
        ("router_fp32_pa_offload", "ours", "failed"),
        ("router_fp32_pa_offload", "stock", "failed"),
    ]
    monkeypatch.setattr(d, "command", lambda config, arm, iters, fusion: fine)
    assert d.main(argv) == 0
