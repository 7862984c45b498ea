"""``megatron_lm_launcher.py SCRIPT ARGS...``: megatron_ext.train's entry point plus a record.

Per optimizer step, every rank appends one JSON line to ``$MEGATRON_LM_RECORD/rank<R>.jsonl``:
the grad norm and zero count ``optimizer.step()`` returned (what Megatron-LM logs), whether
the step was taken, and an fp64 reference norm of the same gradients read straight from
megatron-core's DDP buffers: every bucket's ``grad_data`` (this rank's shard of it with the
distributed optimizer, which is where the reduce-scatter put the reduced values), squared
and summed in fp64, all-reduced over the buffer's data-parallel group. Padding is zero, and
at TP=PP=1 no gradient is a duplicate, so that is the norm of the full reduced gradient; it
reads megatron-core's buffers, not megatron_ext's spans. On steps where
``--log-per-layer-grad-norm`` asked for per-parameter norms, the row also holds an fp64
norm per logged group, from the same buffers. The recording wraps whatever
``megatron.training`` uses as ``get_megatron_optimizer`` (stock with the flags off).
"""

import json
import os
import sys
from pathlib import Path

import torch

import megatron_ext.train as mt
from megatron_ext import seam


def reference_norm(model_chunks, sharded: bool) -> float:
    total = 0.0
    for chunk in model_chunks:
        for buf in [*chunk.buffers, *chunk.expert_parallel_buffers]:
            group = buf.data_parallel_group
            size, rank = group.size(), group.rank()
            local = torch.zeros((), dtype=torch.float64, device=buf.grad_data.device)
            for bucket in buf.buckets:
                data = bucket.grad_data
                if sharded and size > 1:
                    data = data.view(size, -1)[rank]
                local += data.double().square().sum()
            if sharded and size > 1:
                torch.distributed.all_reduce(local, group=group)
            total += float(local)
    return total**0.5


def reference_per_layer(model_chunks, sharded: bool) -> dict[str, float]:
    """fp64 norm per logged group (mt.layer_of of each parameter's name), from the same
    buffers: each parameter's elements in this rank's shard of each bucket, squared and
    summed in fp64, all-reduced over the data-parallel group (TP = PP = 1 here)."""
    sums: dict[str, torch.Tensor] = {}
    group = None
    for chunk in model_chunks:
        names = {p: n for n, p in chunk.module.named_parameters()}
        for buf in [*chunk.buffers, *chunk.expert_parallel_buffers]:
            group = buf.data_parallel_group
            size, rank = group.size(), group.rank()
            for bucket in buf.buckets:
                lo, n = bucket.offset, bucket.grad_data.numel()
                if sharded and size > 1:
                    lo, n = lo + rank * (n // size), n // size
                for p, (start, end, _) in buf.param_index_map.items():
                    key = mt.layer_of(names[p])
                    sums.setdefault(key, 0.0)  # every rank lists every group, owned or not
                    a, b = max(start, lo), min(end, lo + n)
                    if a < b:
                        sums[key] = sums[key] + buf.grad_data[a:b].double().square().sum()
    keys = sorted(sums)
    vec = torch.stack([torch.as_tensor(sums[k]).double().cuda() for k in keys])
    if sharded and group is not None and group.size() > 1:
        torch.distributed.all_reduce(vec, group=group)
    return {k: float(v) ** 0.5 for k, v in zip(keys, vec.tolist(), strict=True)}


def recording(build, out: Path):
    def build_and_record(config, model_chunks, *args, **kwargs):
        opt = build(config, model_chunks, *args, **kwargs)
        step = opt.step
        rank = torch.distributed.get_rank()
        sharded = bool(getattr(config, "use_distributed_optimizer", False))

        def recorded_step(*a, **kw):
            ref = reference_norm(model_chunks, sharded)
            # --log-per-layer-grad-norm asked this step for per-parameter norms
            per_layer = None
            if getattr(getattr(opt, "_flat", None), "per_param_requested", False):
                per_layer = reference_per_layer(model_chunks, sharded)
            ok, norm, zeros = step(*a, **kw)
            row = {
                "ok": bool(ok),
                "norm": None if norm is None else float(norm),
                "ref": ref,
                "zeros": None if zeros is None else float(zeros),
                "optimizer": type(opt).__name__,
                "per_layer_ref": per_layer,
            }
            with open(out / f"rank{rank}.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            return ok, norm, zeros

        opt.step = recorded_step
        return opt

    return build_and_record


def main() -> None:
    out = Path(os.environ["MEGATRON_LM_RECORD"])
    out.mkdir(parents=True, exist_ok=True)
    enable = mt.enable

    def enable_and_record(args):
        patches = enable(args)
        patches.replace("training optimizer", recording(seam.target("training optimizer"), out))
        return patches

    mt.enable = enable_and_record
    mt.main(sys.argv[1:])


if __name__ == "__main__":
    main()
