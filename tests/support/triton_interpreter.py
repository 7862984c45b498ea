"""Run a test script in a fresh Python with Triton's CPU interpreter on."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(script: str) -> subprocess.CompletedProcess:
    """``python -c script`` from the repository root with ``TRITON_INTERPRET=1`` (the
    variable must be set before Triton is imported, hence a fresh process)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )
