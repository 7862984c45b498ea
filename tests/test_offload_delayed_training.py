"""The delayed offloaded update inside a real training loop, on the CPU: megatron-core's DDP
and distributed optimizer (``tests/support/cpu_megatron.py``), each step ``zero_grad_buffer``,
``zero_grad``, forward and backward, ``finish_grad_sync``, ``step``, as Megatron's loop and
``benchmarks/offload_overlap.py`` call them, with the host worker running beside the next
forward and backward.

The reference is the exact chunked step on a second, identical stack, fed the gradients the
delayed run computed (copied into its buffers after the delayed run's backward): after each
step, what the delayed run's model holds must equal, bit for bit, what the reference held
one step before (one step late, nothing lost or applied twice)."""

from __future__ import annotations

import pytest
import torch

from tests.support.megatron_mlp import batch
from tests.support.megatron_ranks import run_ranks, to_model
from tests.support.mlp_stack import adam_path, build

pytestmark = pytest.mark.mcore

pytest.importorskip("megatron.core")

STEPS = 6


def _stack(delayed: bool, pa: bool, fraction: float, threads: int | None = None, pin=False):
    import megatron_ext

    options = megatron_ext.MegatronOptions(
        offload_step="chunked",
        offload_delayed_update=delayed,
        offload_delay_warmup=1,
        offload_threads=threads,
        offload_pin_threads=pin,
    )
    return build(
        True,
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=fraction,
        use_precision_aware_optimizer=pa,
        options=options,
    )


def chain_threads_job(rank, world, log, out_dir):
    """A chain of two offloading optimizers (an expert weight has its own): (adapted,
    threads, high) of each, on a host of 16 usable cores."""
    import os

    from megatron_ext.offload import threads as offload_threads

    with pytest.MonkeyPatch.context() as patch, adam_path("torch+offload"):
        patch.setattr(offload_threads, "usable_cores", lambda: 16)
        patch.setattr(os, "cpu_count", lambda: 16)
        patch.delenv("LOCAL_WORLD_SIZE", raising=False)
        out = {}
        for experts, fraction in ((True, 1.0), (False, 1.0), (True, 0.0)):
            import megatron_ext

            _, opt = build(
                True,
                experts=experts,
                optimizer_cpu_offload=True,
                optimizer_offload_fraction=fraction,
                use_precision_aware_optimizer=True,
                options=megatron_ext.MegatronOptions(offload_delayed_update=True),
            )
            out[experts, fraction] = [
                (c.optimizer.thread_tuner.high, c.optimizer.cpu_threads)
                for c in opt.chained_optimizers
                if getattr(c.optimizer, "thread_tuner", None) is not None
            ]
        return out


def test_the_offloading_optimizers_of_a_chain_share_the_cores(tmp_path):
    """Their delayed updates run at once: with an expert weight (two offloading optimizers)
    each worker gets half of the 16 cores, 7 to start with; alone, all 16, 15 to start; an
    optimizer with nothing on the host (fraction 0) runs no host update and takes no share."""
    (out,) = run_ranks(tmp_path, 1, chain_threads_job)
    assert out[True, 1.0] == [(8, 7), (8, 7)]
    assert out[False, 1.0] == [(16, 15)]
    assert out[True, 0.0] == [(16, 15), (16, 15)]


def _threads(opt) -> list[tuple[bool, int | None]]:
    """Per offloading optimizer of the chain: (whether its threads adapt, its threads)."""
    hdos = [c.optimizer for c in opt.chained_optimizers if hasattr(c.optimizer, "thread_tuner")]
    return [(h.thread_tuner is not None, h.cpu_threads) for h in hdos]


def _held(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def delayed_loop_job(rank, world, log, out_dir, pa, fraction, pin=False):
    import os
    import threading

    import megatron_ext
    from megatron_ext.offload.step import ChunkedAdamW

    with adam_path("torch+offload"):  # megatron-core's placement, as on a device
        ours, ours_opt = _stack(True, pa, fraction, pin=pin)
        ref, ref_opt = _stack(False, pa, fraction)
        _, fixed_opt = _stack(True, pa, fraction, threads=3)
    out = [dict(threads=(_threads(ours_opt), _threads(ref_opt), _threads(fixed_opt)))]
    # where each chunk's host update ran: (the thread's name, the CPUs it could run on, as
    # the OS says), and the launching thread's CPUs before the loop
    seen, launcher = [], os.sched_getaffinity(0)
    update = ChunkedAdamW.update

    def observed(self, *a, **k):
        seen.append((threading.current_thread().name, os.sched_getaffinity(0)))
        return update(self, *a, **k)

    ChunkedAdamW.update = observed
    before = _held(ref)
    for s in range(STEPS):
        for model, opt in ((ours, ours_opt), (ref, ref_opt)):
            model.zero_grad_buffer()
            opt.zero_grad()
        ours(*to_model(ours, *batch(0, s))).backward()
        ours.finish_grad_sync()
        for a, b in zip(ours.all_grad_buffers(), ref.all_grad_buffers(), strict=True):
            b.grad_data.copy_(a.grad_data)
        ok, norm, _ = ours_opt.step()
        ref_ok, ref_norm, _ = ref_opt.step()
        held = _held(ours)
        expect = before if s >= 1 else _held(ref)  # step 0: the warm-up, exact
        out.append(
            dict(
                ok=(ok, ref_ok),
                norms=(float(norm), float(ref_norm)),
                differ=sorted(n for n in held if not torch.equal(held[n], expect[n])),
            )
        )
        before = _held(ref)
    megatron_ext.drain_offload(ours_opt)
    ChunkedAdamW.update = update
    last = _held(ours)
    out.append(dict(drained=sorted(n for n in last if not torch.equal(last[n], before[n]))))
    out[0].update(
        seen=seen,
        launcher=(launcher, os.sched_getaffinity(0)),
        pinned=[c.optimizer.worker_cpus for c in ours_opt.chained_optimizers],
    )
    return out


def _two_cpus() -> bool:
    import os

    return hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2


@pytest.mark.parametrize(
    "pin",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                not _two_cpus(), reason="pinning leaves one CPU of two or more (Linux)"
            ),
        ),
    ],
    ids=["unpinned", "pinned"],
)
@pytest.mark.parametrize("fraction", [1.0])
@pytest.mark.parametrize("pa", [True, False], ids=["pa", "main"])
def test_delayed_update_in_a_training_loop_is_the_exact_update_one_step_late(
    tmp_path, pa, fraction, pin
):
    """Pinned (offload_pin_threads) or not, the same bits; pinned, every delayed update
    runs on the rank's CPUs but the first, and the launching thread keeps every CPU."""
    import os

    (steps,) = run_ranks(tmp_path, 1, delayed_loop_job, pa, fraction, pin)
    threads, *per_step, drained = steps
    every = os.sched_getaffinity(0)
    workers = frozenset(sorted(every)[1:]) if pin else None
    assert threads["pinned"] and all(c in (workers, None) for c in threads["pinned"])
    assert workers in threads["pinned"]
    assert threads["launcher"] == (every, every)
    late = [cpus for name, cpus in threads["seen"] if name == "megatron_ext-offload-update"]
    exact = [cpus for name, cpus in threads["seen"] if name != "megatron_ext-offload-update"]
    assert late and exact  # the delayed steps on the worker, the warm-up and the reference not
    assert all(c == (workers or every) for c in late), late
    assert all(c == every for c in exact)
    # the delayed update without a thread count adapts them, from every core but one; an
    # exact step leaves torch's setting; a count given is kept
    from megatron_ext.offload.threads import delayed_update_threads

    ours, exact, fixed = threads["threads"]
    assert ours and all(t == (True, delayed_update_threads()) for t in ours)
    assert exact and all(t == (False, None) for t in exact)
    assert fixed and all(t == (False, 3) for t in fixed)
    for s, r in enumerate(per_step):
        assert r["ok"] == (True, True), s
        assert r["norms"][0] == r["norms"][1], s
        assert r["differ"] == [], f"step {s}: {r['differ']}"
    assert drained["drained"] == []
