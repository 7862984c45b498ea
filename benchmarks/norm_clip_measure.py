"""benchmarks/norm_clip.py's measurement: one row's parameters, accuracy check and timed
round, and the status a record ends with (the driver, ``norm_clip.py``, says what runs when)."""

from __future__ import annotations

import gc
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, find the repo

import torch

from benchmarks import common, isolation
from benchmarks.inventories import Inventory
from benchmarks.norm_clip_variants import NamedParams, Prepared

# op -> (max_norm, passes over the bytes at the floor). max_norm 0 makes the coefficient 0
# on every timed call, so every call really scales (a small positive max_norm does not: once
# clipped, rounded gradients can fall just under it and the coefficient clamps to 1). A huge
# max_norm clamps it to 1: the no-op case.
OPS: dict[str, tuple[float | None, int]] = {
    "norm": (None, 1),
    "clip": (0.0, 3),
    "clip_noop": (1e30, 1),
    "per_param": (None, 1),
}
BURSTS_PER_ROUND = 3
# A norm further than this from the fp64 reference is wrong: above bf16's rounding (2**-8,
# what per-tensor bf16 norms are off by), far below a misread list (TE's 0.2165 for 0.25).
WRONG_NORM_REL_ERR = 1e-2
SEED = 1234


def make_params(inv: Inventory, device: torch.device) -> NamedParams:
    """Parameters with the inventory's names, shapes and dtypes, and no weight storage."""
    return [
        (e.name, torch.nn.Parameter(torch.empty(1, dtype=e.dtype, device=device).expand(e.shape)))
        for e in inv.entries
    ]


def fill_random(grads: list[torch.Tensor], device: torch.device) -> None:
    """Fresh normal values in every gradient, in its dtype; the same for every variant."""
    gen = torch.Generator(device=device).manual_seed(SEED)
    for g in grads:
        g.normal_(generator=gen)


def reference_norm(grads: list[torch.Tensor]) -> float:
    """The L2 norm of the gradients' values, accumulated in fp64."""
    total = sum(torch.linalg.vector_norm(g, dtype=torch.float64).square() for g in grads)
    return float(torch.as_tensor(total).sqrt())


def check(prep: Prepared, op: str, device: torch.device) -> dict:
    """Accuracy of one call on fresh values."""
    call = op_call(prep, op)
    fill_random(prep.grads, device)
    ref = reference_norm(prep.grads)
    extra = {}
    if op == "per_param":
        norms = call().double()
        if prep.per_param_order is not None:
            norms = norms.index_select(0, prep.per_param_order)
        want = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in prep.grads])
        norm = float(torch.linalg.vector_norm(norms))
        extra["per_param_rel_err"] = float(((norms - want).abs() / want).max())
    else:
        norm = float(call())
    return extra | {
        "norm": norm,
        "norm_ref": ref,
        "rel_err": abs(norm - ref) / ref,
    }


def op_call(prep: Prepared, op: str):
    if op == "per_param":
        if prep.per_param is None:
            raise NotImplementedError("this row has no per-parameter norms")
        return prep.per_param
    max_norm = OPS[op][0]
    return prep.norm if max_norm is None else (lambda: prep.clip(max_norm))


def measure_call(call, device: torch.device, warmup: int, per: int, burst: bool) -> dict:
    """One round of one row: its device time, host times and (``burst``) burst host times."""
    return {
        "time": common.device_time(call, device, warmup, per),
        "host": common.host_times(call, device, per),
        "burst": common.burst_host_times(call, device, bursts=BURSTS_PER_ROUND) if burst else None,
    }


def failure_fields(exc: BaseException) -> dict:
    """A failed cell's ``error``, ``error_at`` and ``status``: ``crashed (...)`` when its
    process died, else ``failed (...)`` with the exception's first line."""
    if isinstance(exc, isolation.ChildCrashed):
        return {
            "error": f"crashed: {exc}",
            "error_at": "its own process",
            "status": f"crashed ({exc})",
        }
    fields = exc.fields if isinstance(exc, isolation.ChildFailed) else common.error_fields(exc)
    return fields | {"status": f"failed ({fields['error'].splitlines()[0]})"}


def norm_status(rec: dict) -> str:
    """``ok``, ``wrong norm (rel err X)`` past :data:`WRONG_NORM_REL_ERR` (or not finite),
    the failure's status, or ``not checked``."""
    if rec.get("status"):
        return rec["status"]
    if rec["error"] is not None:
        return f"failed ({rec['error'].splitlines()[0]})"
    errs = [rec[k] for k in ("rel_err", "per_param_rel_err") if rec.get(k) is not None]
    if not errs:
        return "not checked"
    worst = max(e if math.isfinite(e) else math.inf for e in errs)
    return f"wrong norm (rel err {worst:.1e})" if worst > WRONG_NORM_REL_ERR else "ok"


def host_fields(per_round: list[list[float]]) -> dict:
    """Host time the way device time is reported, the fastest round's median (so on the
    CPU, where both time the same call, they agree), and the 10th and 90th percentiles over
    every round's calls (how noisy the machine was)."""
    times = [t for r in per_round for t in r]
    return {
        "host_time_s": min(statistics.median(r) for r in per_round),
        "host_time_p10_s": common.percentile(times, 10),
        "host_time_p90_s": common.percentile(times, 90),
    }


def timed_fields(per_round: list[dict]) -> dict:
    bursts = [b for r in per_round for b in (r["burst"] or ())]
    return (
        common.round_fields("time", [r["time"] for r in per_round])
        | host_fields([r["host"] for r in per_round])
        | {"host_time_burst_s": statistics.median(bursts) if bursts else None}
    )


def release(device: torch.device) -> None:
    """Free the previous variant's gradients before the next one allocates its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(common.not_a_script(__file__, ("norm_clip.py",)))
