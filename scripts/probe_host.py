"""Probe (CUDA only): where the Megatron path's host time per norm/clip goes.

Host seconds to issue one call (device drained before each; p10, median, p90 of 300) of the
whole ``opt.clip_grad_norm`` through ``megatron_ext``, its pieces (megatron-core's group
lookup, one ``dist.all_reduce`` of a scalar, one clone, one graph replay), and norm and clip
with the all-reduce inside the CUDA graph against between two replays
(``BUFFERS_GRAPH_COLLECTIVES=0``). Run on the GPU machine after ``gpu_session.sh`` installed
megatron-core: ``PYTHONPATH=/tmp/site:$PWD python3 scripts/probe_host.py``. Output in
docs/gpu-test-log.md (run 16). ``probe_host.py models`` times norm and clip on the model
inventories instead, in interleaved rounds (run 22); ``profile``: a cProfile of the Megatron
path's norm and clip; no argument runs ``scaling`` and ``models``.
"""

import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, ".")
from benchmarks import common, inventories  # noqa: E402
from benchmarks.norm_clip import fill_random, make_params  # noqa: E402
from benchmarks.norm_clip_variants import flat_megatron  # noqa: E402


def stats(name, fn, device, reps=300):
    for _ in range(20):
        fn()
    t = common.host_times(fn, device, reps)
    us = sorted(x * 1e6 for x in t)
    print(
        f"{name:40s} p10 {common.percentile(us, 10):7.1f}  med {statistics.median(us):7.1f}"
        f"  p90 {common.percentile(us, 90):7.1f} us"
    )


def probe(count, device):
    """The timings above on one scaling inventory of ``count`` parameters (256 MiB)."""
    inv = inventories.scaling_inventory(count, 256 * 2**20)
    named = make_params(inv, device)
    prep = flat_megatron(named, device)
    fill_random(prep.grads, device)
    print(f"--- {count} parameters ({prep.fields['note']})")
    stats("opt.clip_grad_norm", lambda: prep.clip(1e9), device)
    opt = prep.clip.__closure__[0].cell_contents  # the optimizer
    child = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    stats("child._flat_clip", lambda: child._flat_clip(1e9), device)
    stats("get_grad_stats_parallel_group", child.get_grad_stats_parallel_group, device)
    group = child.get_grad_stats_parallel_group()
    nc = child._flat_norm_clip
    s = torch.zeros((), device=device)
    stats("dist.all_reduce scalar", lambda: dist.all_reduce(s, group=group), device)
    stats("clone scalar", lambda: s.clone(), device)

    os.environ["BUFFERS_GRAPH_COLLECTIVES"] = "0"
    stats("clip, all-reduce between replays", lambda: prep.clip(1e9), device)
    stats("norm, all-reduce between replays", prep.norm, device)
    del os.environ["BUFFERS_GRAPH_COLLECTIVES"]
    stats("norm, all-reduce in the graph", prep.norm, device)
    stats("clip, all-reduce in the graph", lambda: prep.clip(1e9), device)
    stats("replay stat_in", lambda: nc.replay(("stat_in", 2.0), lambda: None), device)
    print("captures", child._flat_norm_clip.replay.captures)


def probe_models(device, rounds=3, reps=200):
    """Host time of norm and clip on the model inventories (norm_clip's sizes), ours flat
    and through megatron_ext, measured in ``rounds`` interleaved rounds: whether a slow row
    is the row or the moment it was measured."""
    from benchmarks.norm_clip import AUTO_BYTES
    from benchmarks.norm_clip_variants import flat

    for name in inventories.MODEL_STAGES:
        inv = inventories.model_stage(name, AUTO_BYTES["cuda"])
        preps = {"flat": flat(make_params(inv, device), device)}
        preps["megatron"] = flat_megatron(make_params(inv, device), device)
        opt = preps["megatron"].clip.__closure__[0].cell_contents
        child = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
        calls = {}
        for label, prep in preps.items():
            fill_random(prep.grads, device)
            calls[f"{label} norm"] = prep.norm
            calls[f"{label} clip"] = lambda prep=prep: prep.clip(1e9)
            calls[f"{label} clip scaling"] = lambda prep=prep: prep.clip(0.0)
        calls["megatron child.get_grad_norm"] = child.get_grad_norm
        print(f"--- {name}: {inv.num_params} parameters, {preps['megatron'].fields['note']}")
        for r in range(rounds):
            print(f"round {r}")
            for label, fn in calls.items():
                stats(label, fn, device, reps)
        del preps, opt, child, calls
        torch.cuda.empty_cache()


def profile_calls(device, calls=2000):
    """cProfile of the Megatron path's norm and clip (graph replays), by own time: where
    the host microseconds per call go. A 256 MiB MoE inventory (a chain of two)."""
    import cProfile
    import pstats

    inv = inventories.model_stage("deepseek_moe", 256 * 2**20)
    prep = flat_megatron(make_params(inv, device), device)
    fill_random(prep.grads, device)
    for label, fn in (("norm", prep.norm), ("clip", lambda: prep.clip(1e9))):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"--- profile: Megatron path {label}, {calls} calls ({prep.fields['note']})")
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)


def main():
    what = sys.argv[1:] or ["scaling", "models"]
    device = torch.device("cuda")
    with (
        tempfile.TemporaryDirectory() as tmp,
        common.single_rank_process_group(f"file://{tmp}/store"),
    ):
        if "scaling" in what:
            for count in (80, 10000):
                probe(count, device)
                torch.cuda.empty_cache()
        if "models" in what:
            probe_models(device)
        if "profile" in what:
            profile_calls(device)


if __name__ == "__main__":
    main()
