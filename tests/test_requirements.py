"""megatron-core is an extra: ``buffers`` works without it, ``megatron_ext`` says in one line
what it lacks (megatron-core, or the Python megatron-core needs) and how to get it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_ext import requirements

pytestmark = pytest.mark.mcore
ROOT = Path(__file__).resolve().parents[1]

# A child in which megatron-core cannot be imported, as after `pip install -e .` (no extras)
HIDE_MEGATRON = textwrap.dedent(
    """
    import sys

    class Hidden:
        def find_spec(self, name, path=None, target=None):
            if name == "megatron" or name.startswith("megatron."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, Hidden())
    """
)


@pytest.mark.parametrize(
    ("version", "has_core", "want"),
    [
        ((3, 12, 0), True, None),
        ((3, 13, 5), True, None),
        ((3, 12, 3), False, "megatron_ext needs megatron-core, which is not installed"),
        ((3, 11, 9), True, "needs Python >= 3.12 (megatron-core's minimum); this is Python 3.11"),
        # the Python first: the extra cannot be installed on 3.11 at all
        ((3, 11, 9), False, "this is Python 3.11"),
    ],
)
def test_what_megatron_ext_lacks_is_said_in_one_line(version, has_core, want):
    said = requirements.missing(version, has_core)
    if want is None:
        assert said is None
    else:
        assert want in said and "\n" not in said
        assert "buffers.FlatGradBuffers" in said  # what works without it
    if want and not has_core and version >= (3, 12):
        assert requirements.EXTRA in said


def test_the_check_reads_this_interpreter():
    assert requirements._has_megatron_core()
    requirements.check()  # megatron-core and Python 3.12+ here: nothing raised


def run_child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", HIDE_MEGATRON + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_without_megatron_core_buffers_trains_and_megatron_ext_names_the_extra():
    # the torch path whole: build, backward, clip, step; no megatron module ever imported
    trained = run_child(
        """
        import torch
        from buffers import FlatGradBuffers
        model = torch.nn.Linear(8, 8, dtype=torch.bfloat16)
        model.register_parameter("sink", torch.nn.Parameter(torch.zeros(8)))
        fgb = FlatGradBuffers(model.named_parameters())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fgb.zero_()
        (model(torch.randn(4, 8, dtype=torch.bfloat16)).float().sum() + model.sink.sum()).backward()
        norm = fgb.clip_grad_norm_(1.0)
        opt.step()
        assert torch.isfinite(norm) and norm > 0
        assert not [m for m in sys.modules if m.split(".")[0] == "megatron"]
        print("trained")
        """
    )
    assert trained.returncode == 0, trained.stderr
    assert trained.stdout.strip() == "trained"

    refused = run_child("import megatron_ext")
    assert refused.returncode == 1
    last = refused.stderr.strip().splitlines()[-1]
    assert last == (
        "megatron_ext.requirements.MissingRequirementError: megatron_ext needs megatron-core, "
        f"which is not installed: {requirements.EXTRA} (buffers.FlatGradBuffers needs torch "
        "alone)."
    ), refused.stderr
    assert "pip install -e '.[megatron]'" in requirements.EXTRA


@pytest.mark.parametrize(
    ("args", "code", "said"),
    [
        (["--help"], 0, "Usage: bash scripts/torch_only.sh [-- PYTEST_ARGS]"),
        (["tests/test_spans.py"], 2, "error: unknown argument tests/test_spans.py (see --help)"),
    ],
)
def test_the_torch_only_script_says_how_it_is_used_before_building_anything(
    tmp_path, args, code, said
):
    # a copy, so that a venv it wrongly started to build would show up here
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "torch_only.sh"
    script.write_text((ROOT / "scripts" / "torch_only.sh").read_text())
    proc = subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)  # fmt: skip
    assert proc.returncode == code
    assert said in (proc.stdout if code == 0 else proc.stderr)
    assert not (tmp_path / ".venv-torch-only").exists()
