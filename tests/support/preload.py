"""What the tests' rank server imports once (``tests/support/spawn.py``): torch, its
distributed package, megatron-core's modules the CPU tests use, ``megatron_ext`` and the
CPU shim. Every rank forked from that server finds them imported.

A module that fails to import here is left out, silently: the rank that needs it imports it
itself and reports the error where the test can show it, as a freshly started rank would.
"""

from __future__ import annotations

import importlib
import logging
import warnings

MODULES = (
    "pytest",  # every test module a rank unpickles its function from imports it
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.dist_checkpointing",
    "megatron.core.transformer",
    "megatron.core.tensor_parallel",
    "megatron_ext",
    "tests.support.cpu_megatron",
)

LOADED: list[str] = []

# torch logs "No CUDA runtime is found" when megatron-core imports its extension loader
_quiet = logging.getLogger("torch.utils.cpp_extension")
_level = _quiet.level
_quiet.setLevel(logging.ERROR)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core's notices at import, as the ranks ignore them
    for _name in MODULES:
        try:
            importlib.import_module(_name)
        except Exception:  # noqa: BLE001 - the rank's own import reports it
            continue
        LOADED.append(_name)
_quiet.setLevel(_level)
