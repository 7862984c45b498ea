"""What a new user runs first: the training entry point's --help and refusals, the demo's
--help, the Megatron example on a machine without a GPU, and the packages' type hints."""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest

from buffers import demo
from megatron_ext import seam, train, wgrad_fusion

pytestmark = pytest.mark.mcore

ROOT = Path(__file__).resolve().parents[1]
NO_FUSION = "--no-gradient-accumulation-fusion"  # apex's kernel for the fusion is absent here
OUR_FLAGS = (
    "--per-dtype-grad-buffers",
    "--keep-in-fp32-params",
    "--log-per-layer-grad-norm",
    "--offload-step",
    "--offload-delayed-update",
    "--offload-delay-warmup",
    "--offload-pin-threads",
    "--offload-overlap-forward",
    "--offload-threads",
)


def _our_flags_one_line_each(lines: list[str]) -> int:
    """Check that ``lines`` list our flags first, one line each; the index of the last."""
    options = [i for i, line in enumerate(lines) if line.lstrip().startswith("--")]
    first = options[: len(OUR_FLAGS)]
    for i, flag in zip(first, OUR_FLAGS, strict=True):
        label, _, meaning = lines[i].strip().partition("  ")
        assert label.split()[0] == flag and len(meaning.strip()) > 20, lines[i]
        assert not lines[i + 1].startswith(" " * 8), "a flag's help continues on a second line"
    return first[-1]


def test_train_help_lists_our_flags_one_line_each_and_where_megatrons_are(capsys):
    with pytest.raises(SystemExit) as exc:
        train.main(["--help"])
    assert exc.value.code == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].startswith("usage: python -m megatron_ext.train") and err == ""
    last = _our_flags_one_line_each(lines)
    rest = "\n".join(lines[last + 1 :])
    assert len(lines) < 25 and "--tensor-model-parallel-size" not in out  # ours alone
    assert "--help-megatron lists" in rest and "SCRIPT --help lists ours, then them" in rest


def _megatrons_arguments(text: str) -> None:
    assert "Megatron-LM's arguments (megatron.training)" in text
    assert "--tensor-model-parallel-size" in text and "--use-torch-fsdp2" in text
    # megatron-core 0.19.2's own --help raises on a bare "10%)": escaped, it prints
    assert "--moe-paged-stash-buffer-size-factor-cuda" in text or "10%)" not in text


def test_megatrons_arguments_are_listed_when_asked(capsys, tmp_path, monkeypatch):
    pytest.importorskip("megatron.training.arguments")
    with pytest.raises(SystemExit) as exc:
        train.main(["--help-megatron"])
    assert exc.value.code == 0
    _megatrons_arguments(capsys.readouterr().out)
    # SCRIPT --help: ours first, then Megatron-LM's, refusals and the script not run
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("raise SystemExit('the script ran')\n")
    monkeypatch.setattr(train, "install", lambda: (_ for _ in ()).throw(_Ran()))
    for flags in (["--help"], ["--per-dtype-grad-buffers", "--use-torch-fsdp2", "-h"]):
        with pytest.raises(SystemExit) as exc:
            train.main([str(script), *flags])
        assert exc.value.code == 0
        lines = capsys.readouterr().out.splitlines()
        last = _our_flags_one_line_each(lines)
        _megatrons_arguments("\n".join(lines[last + 1 :]))


def test_megatrons_arguments_say_why_they_are_missing(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.training.arguments", None)  # import fails
    with pytest.raises(SystemExit):
        train.main(["--help-megatron"])
    out = capsys.readouterr().out
    assert "Megatron-LM's arguments: not listed, megatron.training does not import" in out


def test_without_a_script_a_usage_line_and_an_error_line(capsys):
    with pytest.raises(SystemExit) as exc:
        train.main([])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 2, err
    usage, error = err.splitlines()
    assert usage.startswith("usage: python -m megatron_ext.train ") and "SCRIPT" in usage
    assert error.startswith("megatron_ext.train: error: no SCRIPT given; --help lists")


def test_a_scripts_parser_lists_our_group_first_and_formats_every_help():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument_group("megatron").add_argument("--lr", help="rate (10%)")
    train.add_arguments(parser)
    text = parser.format_help().split("\n\n", 1)[1]  # after the usage; raised on "10%)"
    assert text.index("--per-dtype-grad-buffers") < text.index("--lr") and "10%)" in text


class _Ran(Exception):
    pass


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--per-dtype-grad-buffers", "--use-torch-fsdp2"], "--use-torch-fsdp2"),
        (["--use-megatron-fsdp", "--per-dtype-grad-buffers"], "--use-megatron-fsdp"),
        (
            ["--per-dtype-grad-buffers", "--num-distributed-optimizer-instances", "2"],
            "--num-distributed-optimizer-instances 2",
        ),
        (["--per-dtype-grad-buffers", "--optimizer=muon"], "--optimizer muon"),
        (["--log-per-layer-grad-norm"], "needs --per-dtype-grad-buffers"),
        (
            ["--offload-step", "per_parameter"],
            "--offload-step per_parameter needs --per-dtype-grad-buffers",
        ),
        (["--offload-delayed-update"], "--offload-delayed-update needs --per-dtype-grad-buffers"),
        (["--offload-threads=8"], "--offload-threads 8 needs --per-dtype-grad-buffers"),
        (
            [
                "--per-dtype-grad-buffers",
                "--optimizer-cpu-offload",
                "--offload-overlap-forward",
                "--log-params-norm",
            ],
            "--offload-overlap-forward with --log-params-norm",
        ),
        (
            [
                "--per-dtype-grad-buffers",
                "--optimizer-cpu-offload",
                "--offload-overlap-forward",
                "--check-weight-hash-across-dp-replicas-interval",
                "10",
            ],
            "with --check-weight-hash-across-dp-replicas-interval 10",
        ),
        # offload flags without CPU offload would do nothing: each named as typed
        *(
            (
                ["--per-dtype-grad-buffers", *flag],
                f"{' '.join(flag)} sets how the CPU-offloaded optimizer steps, and without "
                "--optimizer-cpu-offload nothing is offloaded",
            )
            for flag in (
                ["--offload-delayed-update"],
                ["--offload-overlap-forward"],
                ["--offload-threads", "4"],
                ["--offload-step", "per_parameter"],
                ["--offload-convert", "device"],
                ["--offload-pin-threads"],
                ["--offload-delay-warmup", "3"],
                ["--offload-host-bytes", "4096"],
            )
        ),
        # offload flags that cannot go together, refused before anything is built
        *(
            (["--per-dtype-grad-buffers", "--optimizer-cpu-offload", *flags], named)
            for flags, named in (
                (
                    ["--offload-delayed-update", "--offload-overlap-forward"],
                    "--offload-overlap-forward and --offload-delayed-update are two ways",
                ),
                (["--offload-pin-threads"], "add --offload-delayed-update or drop --offload-pin"),
                (
                    ["--offload-step", "per_parameter", "--offload-convert", "device"],
                    "--offload-convert device needs --offload-step chunked",
                ),
                (
                    ["--offload-step", "per_parameter", "--offload-delayed-update"],
                    "--offload-delayed-update runs the chunked step, not --offload-step "
                    "per_parameter",
                ),
                (
                    ["--offload-step", "per_parameter", "--offload-overlap-forward"],
                    "--offload-overlap-forward runs the chunked step",
                ),
                (
                    ["--offload-fraction", "auto"],
                    "--offload-fraction auto: --offload-fraction auto and "
                    "--offload-gpu-headroom (bytes",
                ),
                (
                    ["--offload-gpu-headroom", "1KiB"],
                    "--offload-gpu-headroom 1024: --offload-fraction auto and",
                ),
                (
                    [
                        "--offload-fraction=auto",
                        "--offload-gpu-headroom=8GiB",
                        "--optimizer-offload-fraction=0.5",
                    ],
                    "--offload-fraction auto chooses the fraction that "
                    "--optimizer-offload-fraction 0.5 sets",
                ),
            )
        ),
    ],
)
def test_unsupported_flags_are_refused_in_one_line_before_the_script_runs(
    flags, named, tmp_path, monkeypatch
):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("raise SystemExit('the script ran')\n")
    monkeypatch.setattr(train, "install", lambda: (_ for _ in ()).throw(_Ran()))
    with pytest.raises(SystemExit) as exc:
        train.main([str(script), "--lr", "1e-3", *flags, "--micro-batch-size", "2", NO_FUSION])
    message = exc.value.code
    assert isinstance(message, str) and "\n" not in message
    assert message.startswith("megatron_ext.train: error: ") and named in message


@pytest.mark.parametrize(
    "flags",
    [
        ["--per-dtype-grad-buffers", "--use-distributed-optimizer", "--optimizer", "sgd"],
        ["--use-torch-fsdp2"],  # without our flag: stock, not ours to refuse
        ["--per-dtype-grad-buffers", "--num-distributed-optimizer-instances", "two"],
    ],
)
def test_supported_or_unreadable_command_lines_reach_the_script(flags, tmp_path, monkeypatch):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    monkeypatch.setattr(train, "install", lambda: (_ for _ in ()).throw(_Ran()))
    with pytest.raises(_Ran):
        train.main([str(script), *flags, NO_FUSION])


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--offload-threads", "0"], "argument --offload-threads: 0 is not positive"),
        (["--offload-threads=x"], "argument --offload-threads: 'x' is not an integer"),
        (["--offload-step", "fast"], "argument --offload-step: invalid choice: 'fast'"),
        (["--offload-convert", "gpu"], "argument --offload-convert: invalid choice: 'gpu'"),
        (["--offload-delay-warmup", "-1"], "argument --offload-delay-warmup: expected an int"),
        (["--keep-in-fp32-params", "a,x["], "argument --keep-in-fp32-params: 'x[' is not a"),
        (["--per-dtype-grad-buffers=yes"], "argument --per-dtype-grad-buffers: ignored explicit"),
        (["--lr", "1", "--offload-threads"], "argument --offload-threads: expected one argument"),
    ],
)
def test_a_bad_value_of_our_flags_is_one_line_before_the_script_runs(
    flags, named, tmp_path, monkeypatch, capsys
):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("raise SystemExit('the script ran')\n")
    monkeypatch.setattr(train, "install", lambda: (_ for _ in ()).throw(_Ran()))
    with pytest.raises(SystemExit) as exc:
        train.main([str(script), "--per-dtype-grad-buffers", "--lr", "1e-3", *flags, NO_FUSION])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err  # not Megatron-LM's 735-line usage
    assert err.startswith("megatron_ext.train: error: " + named), err


TINY = [  # a small GPT, as Megatron-LM's parser takes it
    *("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"),
    *("--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1"),
    *("--tokenizer-type", "NullTokenizer", "--vocab-size", "1024"),
]


@pytest.mark.skipif(
    seam.installed_version()[:2] < train.FIRST_VERSION,
    reason="megatron_ext.train refuses megatron-core before 0.19 at start-up, before the script",
)
@pytest.mark.parametrize("gpu", [False, True])
def test_without_a_gpu_the_script_is_refused_before_megatron_prints_its_arguments(
    gpu, tmp_path, monkeypatch, capsys
):
    # what pretrain_gpt.py does first; next comes pretrain(), whose initialize_megatron
    # asserts CUDA after Megatron-LM printed every argument
    from megatron.training import global_vars

    script = tmp_path / "pretrain_gpt.py"
    script.write_text(
        "from megatron.training.arguments import parse_and_validate_args\n"
        "parse_and_validate_args(args_defaults={'tokenizer_type': 'GPT2BPETokenizer'})\n"
        "raise SystemExit('parsed')\n"
    )
    monkeypatch.setattr(train.torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    monkeypatch.setattr(sys, "path", sys.path[:])
    monkeypatch.setenv("RANK", "0")
    before = seam.target("training args")
    try:
        with warnings.catch_warnings(), pytest.raises(SystemExit) as exc:
            warnings.simplefilter("ignore")
            train.main([str(script), *TINY, NO_FUSION])
    finally:
        global_vars.unset_global_variables()
    assert seam.target("training args") is before  # restored
    out = capsys.readouterr().out
    if gpu:  # the same script parses, and Megatron-LM prints its arguments
        assert exc.value.code == "parsed" and "----- arguments -----" in out
    else:
        assert exc.value.code == f"megatron_ext.train: error: {train.NEEDS_CUDA}"
        assert "arguments" not in out, out[:2000]


@pytest.mark.parametrize("ours", [["--per-dtype-grad-buffers"], []], ids=["ours", "stock"])
def test_fusion_without_apexs_kernel_is_refused_in_one_line_naming_the_flag(
    ours, tmp_path, monkeypatch
):
    # Megatron-LM's default; megatron-core's output layer would raise at construction
    monkeypatch.setattr(wgrad_fusion, "fusion_kernel_available", lambda: False)
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("raise SystemExit('the script ran')\n")
    monkeypatch.setattr(train, "install", lambda: (_ for _ in ()).throw(_Ran()))
    with pytest.raises(SystemExit) as exc:
        train.main([str(script), "--transformer-impl", "transformer_engine", *ours])
    message = exc.value.code
    assert isinstance(message, str) and "\n" not in message
    assert message.startswith("megatron_ext.train: error: ")
    assert "fused_weight_gradient_mlp_cuda" in message and f"add {NO_FUSION}" in message
    # with the kernel installed the same line reaches the script
    monkeypatch.setattr(wgrad_fusion, "fusion_kernel_available", lambda: True)
    with pytest.raises(_Ran):
        train.main([str(script), "--transformer-impl", "transformer_engine", *ours])


def test_the_fusion_kernel_is_looked_up_by_the_name_megatron_core_imports():
    # megatron-core's own availability flag, read from its module: the oracle
    from megatron.core.tensor_parallel import layers

    assert wgrad_fusion.fusion_kernel_available() is layers._grad_accum_fusion_available


def test_demo_help_describes_every_option():
    parser = demo.build_parser()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert {"--steps", "--device", "--max-norm"} <= {s for a in options for s in a.option_strings}
    for action in options:
        assert action.help and "default" in action.help, action.option_strings
    assert parser.prog == "python -m buffers.demo"


def test_megatron_quickstart_without_a_gpu_says_so_in_one_line():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONWARNINGS")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, also on a machine that has one
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "megatron_quickstart.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "needs a CUDA GPU" in proc.stderr, proc.stderr


def test_the_wheel_ships_every_module_py_typed_and_the_kernels_source(tmp_path):
    for package in ("buffers", "megatron_ext"):
        assert (ROOT / package / "py.typed").is_file(), package
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("buffers", "megatron_ext"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + [str(src), "-w", str(tmp_path / "dist")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "buffers/py.typed",
        "megatron_ext/py.typed",
        "buffers/cpu_sums.c",
        "megatron_ext/offload/host_adamw.c",
    } <= names
    # every module ships, subpackages' too (setuptools lists packages explicitly)
    sources = {
        str(f.relative_to(ROOT))
        for package in ("buffers", "megatron_ext")
        for f in (ROOT / package).rglob("*.py")
    } | {
        str(f.relative_to(ROOT))
        for package in ("buffers", "megatron_ext")
        for f in (ROOT / package).rglob("*.c")
    }
    assert "megatron_ext/offload/hybrid.py" in sources
    assert sources - names == set()


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_main_job_help_prints_its_usage_and_runs_nothing(flag, tmp_path):
    # a copy of the script whose set-up step leaves a mark: --help must stop before it
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "main.sh", tmp_path / "scripts" / "main.sh")
    mark = tmp_path / "set-up-ran"
    (tmp_path / "scripts" / "setup_env.sh").write_text(f"touch {mark}; exit 3\n")
    proc = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "main.sh"), "--steps", "2", flag],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert not mark.exists()
    usage = proc.stdout
    assert usage.startswith("usage: bash scripts/main.sh")
    for part in ("megatron_ext.mixed_list_demo", "buffers.demo", "norm_clip.py", "memory.py"):
        assert part in usage, part
    assert "bench-out/" in usage and "$OUT" in usage
    # every option of the demo, which receives the job's arguments, is listed
    demo_options = {
        s for a in demo.build_parser()._actions if a.dest != "help" for s in a.option_strings
    }
    assert demo_options and all(f"  {s} " in usage for s in demo_options), usage


def test_our_flags_are_added_without_a_warning():
    # pyproject hides argparse's "'type' is deprecated" from Megatron-LM's parser; not ours
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train.add_arguments(argparse.ArgumentParser(allow_abbrev=False))


def _main_job_copy(tmp_path: Path) -> tuple[Path, Path]:
    """main.sh in a scratch tree whose set-up names this interpreter and leaves a mark."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "main.sh", tmp_path / "scripts" / "main.sh")
    mark = tmp_path / "set-up-ran"
    (tmp_path / "scripts" / "setup_env.sh").write_text(
        f"touch {mark}; PY={sys.executable}; export PY\n"
    )
    return tmp_path / "scripts" / "main.sh", mark


@pytest.mark.parametrize(
    ("args", "problem", "set_up"),
    [
        (["--stpes", "3"], "unrecognized argument: --stpes", False),
        (["--steps"], "argument --steps: expected one value", False),
        (["--steps", "3", "--device", "tpu"], "argument --device: 'tpu' is not a torch", True),
        (["--max-norm=-1"], "argument --max-norm: max_norm must be a number >= 0", True),
    ],
)
def test_main_job_refuses_bad_arguments_with_its_own_usage_before_any_part_runs(
    args, problem, set_up, tmp_path
):
    script, mark = _main_job_copy(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        ["bash", str(script), *args], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("usage: bash scripts/main.sh"), proc.stderr
    assert lines[-1].startswith("bash scripts/main.sh: error: ") and problem in lines[-1]
    assert "buffers.demo" not in lines[0]
    # a misspelt option is refused before the set-up (which may download torch)
    assert mark.exists() == set_up


def _lists_the_entry_points(text: str) -> None:
    assert text.startswith("usage: python -m megatron_ext [--help]\n"), text
    for command in ("python -m megatron_ext.train SCRIPT", "python -m buffers.demo"):
        assert command in text, text


def test_python_m_megatron_ext_lists_the_entry_points():
    # the command line itself, once, in a fresh interpreter
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext", "--help"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "No module named" not in proc.stderr
    _lists_the_entry_points(proc.stdout)


@pytest.mark.parametrize(("args", "code"), [(["-h"], 0), ([], 0), (["pretrain_gpt.py"], 2)])
def test_megatron_ext_main_lists_the_entry_points_and_refuses_other_arguments(
    args, code, capsys, monkeypatch
):
    # its other arguments in this process: what `python -m megatron_ext ARGS` runs
    main = importlib.import_module("megatron_ext.__main__").main
    monkeypatch.setattr(sys, "argv", ["megatron_ext", *args])
    assert main() == code
    out, err = capsys.readouterr()
    _lists_the_entry_points(out if code == 0 else err)
    assert (out == "") == (code != 0) and (err == "") == (code == 0)
    if code:
        assert "unrecognized arguments: pretrain_gpt.py" in err


def test_train_help_lists_the_values_of_flags_that_take_a_choice(capsys):
    with pytest.raises(SystemExit):
        train.main(["--help"])
    out = capsys.readouterr().out
    assert "--offload-step {per_parameter,chunked} " in out
    assert "--offload-convert {host,device} " in out


def test_the_training_loop_without_cuda_is_refused_in_one_line(tmp_path):
    # what pretrain() does first: Megatron-LM's own initialize_megatron, which asserts CUDA
    (tmp_path / "script.py").write_text(
        "from megatron.training.initialize import initialize_megatron\ninitialize_megatron()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext.train", str(tmp_path / "script.py"), NO_FUSION],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("megatron_ext.train: error: ") and "needs a CUDA GPU" in last


@pytest.mark.skipif(
    seam.installed_version()[:2] < train.FIRST_VERSION,
    reason="megatron_ext.train refuses megatron-core before 0.19 at start-up, before the script",
)
def test_other_assertions_of_the_script_keep_their_traceback(tmp_path):
    (tmp_path / "script.py").write_text("assert False, 'a check of the script'\n")
    with pytest.raises(AssertionError, match="a check of the script"):
        train.main([str(tmp_path / "script.py"), NO_FUSION])


def _test_command_copy(tmp_path: Path) -> Path:
    """scripts/test.sh and its set-up in a scratch tree with one passing test."""
    (tmp_path / "scripts").mkdir()
    for name in ("test.sh", "setup_env.sh", "test_workers.sh"):
        shutil.copy(ROOT / "scripts" / name, tmp_path / "scripts" / name)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_one.py").write_text("def test_one():\n    assert 2 + 2 == 4\n")
    return tmp_path / "scripts" / "test.sh"


def test_the_test_command_uses_the_python_it_is_given_as_it_is(tmp_path):
    script = _test_command_copy(tmp_path)
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(script), "-p", "no:cacheprovider", "tests/test_one.py"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "1 passed" in proc.stdout and f"using PYTHON={sys.executable} as it is" in proc.stderr
    assert not (tmp_path / ".venv").exists()  # nothing created, nothing installed


@pytest.mark.parametrize("workers", [None, "0", "3", "x"])
def test_the_test_command_runs_its_workers(tmp_path, workers):
    script = _test_command_copy(tmp_path)
    seen = tmp_path / "seen"
    (tmp_path / "tests" / "test_one.py").write_text(
        "import os\n"
        "def test_one():\n"
        f"    with open({str(seen)!r}, 'a') as f:\n"
        "        f.write(os.environ.get('PYTEST_XDIST_WORKER_COUNT', 'none') + '\\n')\n"
    )
    # this test may itself run in a worker: what the child sees must be its own
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    env["PYTHON"] = sys.executable
    env.pop("TEST_WORKERS", None)
    if workers is not None:
        env["TEST_WORKERS"] = workers
    proc = subprocess.run(
        ["bash", str(script), "-p", "no:cacheprovider", "tests/test_one.py"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )  # fmt: skip
    if workers == "x":
        assert proc.returncode == 2 and not seen.exists()
        assert proc.stderr.splitlines()[-1] == (
            "error: TEST_WORKERS=x is not a number of worker processes (0: none)"
        )
        return
    assert proc.returncode == 0, proc.stderr
    want = {None: str(min(len(os.sched_getaffinity(0)), 4)), "0": "none", "3": "3"}[workers]
    assert seen.read_text() == want + "\n"


def test_the_test_command_names_what_the_given_python_lacks(tmp_path):
    script = _test_command_copy(tmp_path)
    # an interpreter without hypothesis and megatron-core: this one with them blocked
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(
        "import sys\nsys.modules['hypothesis'] = None\nsys.modules['megatron'] = None\n"
    )
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={block} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    proc = subprocess.run(
        ["bash", str(script), "tests/test_one.py"],
        capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHON": str(python)},
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: PYTHON={python} lacks: megatron-core hypothesis"), line
    assert not (tmp_path / ".venv").exists()
