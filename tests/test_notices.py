"""What ``import megatron_ext`` prints: nothing of megatron-core's import-time notices, and
only while it imports megatron-core (a fresh interpreter per case)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from megatron_ext import notices

pytestmark = pytest.mark.mcore

ROOT = Path(__file__).resolve().parents[1]


def python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS",)}
    env["CUDA_VISIBLE_DEVICES"] = ""  # torch's CUDA_HOME line where there is no CUDA runtime
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_importing_the_package_prints_nothing():
    proc = python("import megatron_ext")
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc.stderr


def test_megatron_cores_notices_still_show_to_code_that_imports_it_first():
    proc = python("import megatron.core.optimizer, megatron_ext")
    assert proc.returncode == 0, proc.stderr
    if "transformer_engine" in sys.modules or _installed("transformer_engine", "apex"):
        pytest.skip("transformer-engine or Apex installed: megatron-core has no notice to give")
    assert "Transformer Engine and Apex are not installed" in proc.stderr


def _installed(*names: str) -> bool:
    import importlib.util

    return any(importlib.util.find_spec(n) is not None for n in names)


def test_the_filter_holds_only_inside_the_block_and_only_for_those_notices():
    text = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with notices.import_notices_hidden():
            warnings.warn(text, UserWarning, stacklevel=1)
            warnings.warn("another warning", UserWarning, stacklevel=1)
        warnings.warn(text, UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["another warning", text]
