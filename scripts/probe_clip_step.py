"""Probe (CUDA only): why an explicit clip adds more to a fused AdamW step than it costs alone.

``benchmarks/clip_step.py`` measured (run 22) on the 2 GiB dense inventory: step 8.65 ms,
the clip alone 1.55 ms, clip then step 11.90 ms (+3.25 ms). Here every sequence is timed
with CUDA events between its parts, so each part's device time inside the sequence shows
which one slows down: median ms over 30 calls after 5 warm-up calls. Sequences: each part
alone, clip then step, step then clip, norm then step, a no-op clip (coefficient 1: the norm,
then a scale that exits at once) then step, and the step alone on all-zero gradients (what
the clip with ``max_norm=0`` leaves behind); then "clip, step" timed as the benchmark
times it (``common.device_time``), on the same objects and on freshly built ones. Run on
the GPU machine after ``gpu_session.sh`` installed megatron-core:
``PYTHONPATH=/tmp/site:$PWD python3 scripts/probe_clip_step.py``.
"""

import gc
import statistics
import sys

import torch

sys.path.insert(0, ".")
from benchmarks import clip_step, common, inventories  # noqa: E402

REPS, WARMUP = 30, 5


def timed(parts):
    """Median device ms of each part of the sequence ``parts`` (name -> callable)."""
    names = list(parts)
    samples = {n: [] for n in names}
    for i in range(WARMUP + REPS):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(names) + 1)]
        events[0].record()
        for k, n in enumerate(names):
            parts[n]()
            events[k + 1].record()
        torch.cuda.synchronize()
        if i >= WARMUP:
            for k, n in enumerate(names):
                samples[n].append(events[k].elapsed_time(events[k + 1]))
    return {n: statistics.median(v) for n, v in samples.items()}


def probe_shared(inv, device):
    """Every sequence on one set of buffers and one optimizer."""
    params, fgb, opt = clip_step.build(inv, device)
    clip = clip_step.call_of("clip", fgb, opt)  # coefficient 0: the scale always runs
    noop = clip_step.call_of("clip", fgb, opt, 1e30)  # coefficient 1: the scale exits
    sequences = {
        "step alone": {"step": opt.step},
        "clip alone": {"clip": clip},
        "norm alone": {"norm": fgb.grad_norm},
        "clip, step": {"clip": clip, "step": opt.step},
        "step, clip": {"step": opt.step, "clip": clip},
        "norm, step": {"norm": fgb.grad_norm, "step": opt.step},
        "noop clip, step": {"noop clip": noop, "step": opt.step},
    }
    for label, parts in sequences.items():
        got = timed(parts)
        print(f"{label:18s}", "  ".join(f"{n} {ms:7.3f} ms" for n, ms in got.items()))
    # As benchmarks/clip_step.py times (common.device_time: calls back to back, no sync).
    for label in ("step", "clip+step"):
        ms = common.device_time(clip_step.call_of(label, fgb, opt), device, WARMUP, REPS) * 1e3
        print(f"{label:18s} back to back (device_time) {ms:7.3f} ms")
    for buf in fgb.buffers.values():
        buf.zero_()
    print(f"{'step, zero grads':18s}", f"step {timed({'step': opt.step})['step']:7.3f} ms")
    for p in params:
        p.grad.normal_()
    print(f"{'step, fresh grads':18s}", f"step {timed({'step': opt.step})['step']:7.3f} ms")


def main():
    device = torch.device("cuda")
    inv = inventories.model_stage("dense_gpt", 2 * 2**30)
    print(inventories.describe([inv]))
    probe_shared(inv, device)
    # As the benchmark does: the previous objects gone, fresh ones, "clip, step" timed first.
    gc.collect()
    _, fgb, opt = clip_step.build(inv, device)
    for label in ("clip+step", "step", "clip+step"):
        ms = common.device_time(clip_step.call_of(label, fgb, opt), device, WARMUP, REPS) * 1e3
        print(f"{label:18s} fresh build, back to back (device_time) {ms:7.3f} ms")
    parts = {"clip": clip_step.call_of("clip", fgb, opt), "step": opt.step}
    print(f"{'clip, step':18s} fresh build, parts", timed(parts))


if __name__ == "__main__":
    main()
