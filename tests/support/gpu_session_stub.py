"""scripts/gpu_session.sh wired on the CPU: a scratch copy of it with a megatron-core wheel to
install, and a python3 first on PATH that records how each step called it."""

import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def stub_repo(tmp_path: Path, records: str):
    """(root, call log, $OUT, environment) of a scratch repository holding gpu_session.sh.

    Each python3 call appends one line to the call log: ``records`` (shell words expanded in
    the stub, e.g. ``"DEVICE=${MEGATRON_TEST_DEVICE:-}"``), a space and its arguments."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    (root / ".whl").mkdir()
    (root / ".whl" / "megatron_core-0.19.2-py3-none-any.whl").write_bytes(b"w")
    shutil.copy(ROOT / "scripts" / "gpu_session.sh", root / "scripts")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/usr/bin/env bash\necho "{records} $*" >> "$STUB_LOG"\n')
    (bin_dir / "python3").chmod(0o755)
    log, out = tmp_path / "calls", tmp_path / "out"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               STUB_LOG=str(log), OUT=str(out))  # fmt: skip
    return root, log, out, env
