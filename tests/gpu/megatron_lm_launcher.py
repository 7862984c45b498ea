"""``megatron_lm_launcher.py SCRIPT ARGS...``: megatron_ext.train's entry point plus a record.

Per optimizer step, every rank appends one JSON line to ``$MEGATRON_LM_RECORD/rank<R>.jsonl``:
the grad norm and zero count ``optimizer.step()`` returned (what Megatron-LM logs), whether
the step was taken, and an fp64 reference norm of the same gradients read straight from
megatron-core's DDP buffers: every bucket's ``grad_data`` (this rank's shard of it with the
distributed optimizer, which is where the reduce-scatter put the reduced values), squared
and summed in fp64, all-reduced over the buffer's data-parallel group. Padding is zero, and
at TP=PP=1 no gradient is a duplicate, so that is the norm of the full reduced gradient; it
reads megatron-core's buffers, not megatron_ext's spans. The recording wraps whatever
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


def recording(build, out: Path):
    def build_and_record(config, model_chunks, *args, **kwargs):
        opt = build(config, model_chunks, *args, **kwargs)
        step = opt.step
        rank = torch.distributed.get_rank()
        sharded = bool(getattr(config, "use_distributed_optimizer", False))

        def recorded_step(*a, **kw):
            ref = reference_norm(model_chunks, sharded)
            ok, norm, zeros = step(*a, **kw)
            row = {
                "ok": bool(ok),
                "norm": None if norm is None else float(norm),
                "ref": ref,
                "zeros": None if zeros is None else float(zeros),
                "optimizer": type(opt).__name__,
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
