"""What ``megatron_ext`` needs beyond the torch-only install, checked before anything of it
imports megatron-core: megatron-core itself (the ``megatron`` extra) and the Python it needs.

``buffers`` (``FlatGradBuffers``) needs torch alone; installing the project without extras
(``pip install -e .`` in its checkout) installs that much. Without this check a missing
megatron-core surfaced as a ``ModuleNotFoundError`` deep in the seam's version lookup, and
Python 3.11 as a ``SyntaxError`` in a module written for 3.12.
"""

from __future__ import annotations

import importlib.util
import sys

MIN_PYTHON = (3, 12)  # megatron-core's own Requires-Python
EXTRA = "install the project's megatron extra (in its checkout: pip install -e '.[megatron]')"


def _has_megatron_core() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):  # no "megatron" package at all, or a broken one
        return False


def missing(version_info: tuple[int, ...], has_megatron_core: bool) -> str | None:
    """One line saying what ``megatron_ext`` lacks here and what to do, or None."""
    if tuple(version_info[:2]) < MIN_PYTHON:
        have = ".".join(map(str, version_info[:2]))
        return (
            f"megatron_ext needs Python >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]} (megatron-core's "
            f"minimum); this is Python {have}. buffers.FlatGradBuffers works here without it."
        )
    if not has_megatron_core:
        return (
            "megatron_ext needs megatron-core, which is not installed: "
            f"{EXTRA} (buffers.FlatGradBuffers needs torch alone)."
        )
    return None


class MissingRequirementError(ImportError):
    """``megatron_ext`` imported where megatron-core or the Python it needs is missing."""


def check() -> None:
    """Raise :class:`MissingRequirementError` with :func:`missing`'s line, if any."""
    why = missing(sys.version_info[:3], _has_megatron_core())
    if why is not None:
        raise MissingRequirementError(why, name="megatron.core")
