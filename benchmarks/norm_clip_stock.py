"""benchmarks/norm_clip.py's stock arm in a process of its own: the parent's handle on it
(:class:`StockArm`), the calls the child runs (``_child_*``, through
:mod:`benchmarks.isolation`) and the faults a test can inject there."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, find the repo

import torch

from benchmarks import common, isolation
from benchmarks.inventories import Inventory
from benchmarks.norm_clip_measure import check, make_params, measure_call, op_call, release
from benchmarks.norm_clip_variants import VARIANTS, Prepared

CHILD_MODULE = "benchmarks.norm_clip_stock"  # how the child imports this file


class StockArm:
    """A variant built and run in a child process (:class:`isolation.Child`); the parent
    holds nothing of it but the fields, and says what to run when.

    Raises (every method): :class:`isolation.ChildFailed` when the call raised there,
    :class:`isolation.ChildCrashed` when the child died.
    """

    def __init__(self, child: isolation.Child, inv: Inventory, label: str, device) -> None:
        self.child = child
        self.fields = child.call(f"{CHILD_MODULE}:_child_build", inv, label, str(device))

    def check(self, op: str) -> dict:
        return self.child.call(f"{CHILD_MODULE}:_child_check", op)

    def measure(self, op: str, warmup: int, per: int) -> dict:
        return self.child.call(f"{CHILD_MODULE}:_child_measure", op, warmup, per)

    def syncs(self, op: str) -> int | None:
        return self.child.call(f"{CHILD_MODULE}:_child_syncs", op)

    def profile(self, op: str, calls: int) -> list[str]:
        return self.child.call(f"{CHILD_MODULE}:_child_profile", op, calls)

    def release(self) -> None:
        with contextlib.suppress(isolation.ChildFailed, isolation.ChildCrashed):
            self.child.call(f"{CHILD_MODULE}:_child_release")


def _with_fault(prep: Prepared, kind: str | None) -> Prepared:
    """``prep`` with the fault ``isolation.FAULT_ENV`` injects into its calls, if any."""
    if kind is None:
        return prep

    def wrap(fn):
        if fn is None:
            return None

        def faulty(*args):
            isolation.fire(kind)  # abort or raise; a wrong norm is returned below
            return fn(*args) * isolation.WRONG_NORM_FACTOR

        return faulty

    return dataclasses.replace(
        prep, norm=wrap(prep.norm), clip=wrap(prep.clip), per_param=wrap(prep.per_param)
    )


def _child_build(state: dict, inv: Inventory, label: str, device_name: str) -> dict:
    device = torch.device(device_name)
    if device.type == "cuda" and "group" not in state:
        # megatron's norm all-reduces over the default group: this process needs its own
        torch.cuda.set_device(device)
        state["group"] = contextlib.ExitStack()
        store = Path(state["group"].enter_context(tempfile.TemporaryDirectory())) / "store"
        state["group"].enter_context(common.single_rank_process_group(f"file://{store}"))
    prep = VARIANTS[label](make_params(inv, device), device)
    state["prep"], state["device"] = _with_fault(prep, isolation.injected_fault(inv.name)), device
    return prep.fields


def _child_check(state: dict, op: str) -> dict:
    return check(state["prep"], op, state["device"])


def _child_measure(state: dict, op: str, warmup: int, per: int) -> dict:
    return measure_call(op_call(state["prep"], op), state["device"], warmup, per, burst=False)


def _child_syncs(state: dict, op: str) -> int | None:
    return common.count_host_syncs(op_call(state["prep"], op), state["device"])


def _child_profile(state: dict, op: str, calls: int) -> list[str]:
    return common.host_profile(op_call(state["prep"], op), state["device"], calls)


def _child_release(state: dict) -> None:
    state.pop("prep", None)
    release(state["device"])


if __name__ == "__main__":
    sys.exit(common.not_a_script(__file__, ("norm_clip.py",)))
