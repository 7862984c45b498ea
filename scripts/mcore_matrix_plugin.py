"""pytest plugin for scripts/mcore_matrix.sh: check, inside the test run, which megatron-core
the tests import, and print it.

Loaded with ``-p mcore_matrix_plugin`` (scripts/ on PYTHONPATH). Reads two variables the
matrix script sets:

- ``MCORE_MATRIX_EXPECT``: the version megatron-core's ``package_info.__version__`` must
  report (``0.18.2``; for Megatron-LM main, the version its source declares);
- ``MCORE_MATRIX_DIR``: the folder that must hold the imported ``megatron/core`` and
  ``megatron/training`` (the version's cached folder, first on PYTHONPATH so it shadows the
  venv's megatron-core).

A mismatch stops the run before any test (``pytest.UsageError``), so a matrix row can never
report results of the venv's version under another version's name.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest


def _imported() -> tuple[str, Path, Path | None]:
    import megatron.core
    from megatron.core import package_info

    # megatron-core's wheel also ships megatron.training; it must come from the same folder
    # (not from the venv's release, which the namespace package `megatron` would also find).
    spec = importlib.util.find_spec("megatron.training")
    training = Path(spec.origin).resolve().parent if spec and spec.origin else None
    return package_info.__version__, Path(megatron.core.__file__).resolve().parent, training


def pytest_configure(config: pytest.Config) -> None:
    expect = os.environ.get("MCORE_MATRIX_EXPECT")
    folder = os.environ.get("MCORE_MATRIX_DIR")
    if not expect or not folder:
        raise pytest.UsageError(
            "mcore_matrix_plugin needs MCORE_MATRIX_EXPECT and MCORE_MATRIX_DIR"
        )
    version, where, training = _imported()
    want = Path(folder).resolve() / "megatron"
    for name, got in (("core", where), ("training", training)):
        if got is not None and got != want / name:
            raise pytest.UsageError(
                f"megatron.{name} comes from {got}, not from {want / name}: the version under "
                "test does not shadow the venv's (is something else first on sys.path?)"
            )
    if version != expect:
        raise pytest.UsageError(f"megatron-core reports {version}, expected {expect} ({where})")
    config.stash[_KEY] = f"megatron-core {version} from {where}"


_KEY = pytest.StashKey[str]()


def pytest_report_header(config: pytest.Config) -> str:
    return config.stash.get(_KEY, "")


def pytest_sessionstart(session: pytest.Session) -> None:
    # -q hides the report header; say it anyway, it is the point of the run.
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    line = session.config.stash.get(_KEY, "")
    if reporter is not None and line and session.config.get_verbosity() < 0:
        reporter.write_line(f"[mcore-matrix] {line}")
