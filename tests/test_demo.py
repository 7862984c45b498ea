"""`python -m buffers.demo`: a bad option is a one-line argparse error (exit 2), no traceback."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from buffers import demo

ROOT = Path(__file__).resolve().parents[1]


def refused(argv, capsys) -> str:
    """The error line argparse prints for ``argv``, after checking it exits 2 and nothing ran."""
    with pytest.raises(SystemExit) as info:
        demo.main(argv)
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == ""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[0].startswith("usage: python -m buffers.demo")
    assert lines[-1].startswith("python -m buffers.demo: error: ")
    return lines[-1]


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--max-norm", "-1"], "argument --max-norm: .*>= 0.*got -1"),
        (["--max-norm", "nan"], "argument --max-norm: .*>= 0.*got nan"),
        (["--max-norm", "abc"], "argument --max-norm: 'abc' is not a number"),
        (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
        (["--steps", "-3"], "argument --steps: must be >= 1, got -3"),
        (["--steps", "2.5"], "argument --steps: '2.5' is not a whole number"),
        (["--device", "gpu"], "argument --device: 'gpu' is not a torch device"),
        (["--device", "meta"], "argument --device: 'meta' cannot hold the model"),
    ],
)
def test_a_bad_option_is_one_argparse_error(argv, match, capsys):
    assert re.search(match, refused(argv, capsys))


def test_cuda_without_a_gpu_is_one_argparse_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU machine
    line = refused(["--device", "cuda", "--steps", "1"], capsys)
    assert "argument --device: 'cuda': torch sees no CUDA GPU" in line
    assert "--device cpu" in line


def test_the_command_line_refuses_without_a_traceback():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONWARNINGS")}
    proc = subprocess.run(
        [sys.executable, "-m", "buffers.demo", "--device", "gpu"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr


def test_a_good_command_line_trains_and_matches_fp64(capsys):
    demo.main(["--steps", "2", "--device", "cpu", "--max-norm", "0.5"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    steps = [r for r in rows if len(r) == 5 and r[0].isdigit()]
    assert [r[0] for r in steps] == ["0", "1"]
    for _, _, norm, ref, coeff in steps:
        assert float(norm) == pytest.approx(float(ref), rel=1e-4) and float(norm) > 0
        assert float(coeff) == pytest.approx(min(1.0, 0.5 / float(norm)), rel=1e-4)
