"""Functions for tests of ``benchmarks/isolation.py`` to run in its child process."""

from __future__ import annotations

import os
import sys


def remember(state: dict, key: str, value) -> int:
    state[key] = value
    return os.getpid()


def recall(state: dict, key: str):
    return state[key]


def boom(state: dict) -> None:
    raise ValueError("boom in the child")


def abort_loudly(state: dict) -> None:
    print("starting the native call", file=sys.stderr)
    print("terminate called: CUDA error: an illegal memory access was encountered", file=sys.stderr)
    sys.stderr.flush()
    os.abort()
