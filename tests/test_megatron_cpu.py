"""megatron-core's real DDP and distributed optimizer on the CPU, at 1 and 2 gloo ranks.

``tests/support/cpu_megatron.py`` redirects megatron-core's CUDA devices, streams, events
and coalesced collectives; everything else is megatron-core's own code and ours: DDP with
``per_dtype_grad_buffers`` and without (stock), the distributed optimizer in bf16 with an
fp32 island (a bf16 parameter marked ``keep_in_fp32``) and a natively fp32 parameter, two
clipped Adam steps. Oracles, per step, on every rank:

- the reduced gradient of every element this rank owns (megatron-core's own range map)
  equals the data-parallel mean of plain torch autograd gradients, rounded as a 2-term
  sum rounds (each rank's gradient times 1/2 is exact; their sum rounds once);
- the step's norm equals the fp64 norm over that mean, within 1e-6;
- after the steps, parameters equal stock's within bf16 rounding, having moved by far more.

Checkpoints go through megatron-core's ``dist_checkpointing`` (``torch_dist``): saved at
DP=2, resumed at DP=2 bit for bit and loaded at DP=1 with every state tensor in place.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

from tests.support.megatron_mlp import (
    BF16,
    CLIP,
    LR,
    MLP,
    H,
    batch,
    clipped_steps,
    initial_params,
    joined,
    loss_of,
    owned_pieces,
    owned_state,
    params_of,
)
from tests.support.megatron_ranks import _no_psutil, run_ranks

pytestmark = pytest.mark.mcore

pytest.importorskip("megatron.core")

STEPS = 2


def expected_grads(params: dict[str, torch.Tensor], world: int, step: int) -> dict:
    """The data-parallel mean megatron-core's DDP should leave, from plain autograd.

    Each rank's gradient (computed here for every rank: the batches are seeded) is scaled by
    1/world in its own dtype (exact for world 1 and 2), then summed in that dtype; a sum of
    two terms rounds once, whatever order the collective adds them in.
    """
    total: dict[str, torch.Tensor] = {}
    for r in range(world):
        leaves = {n: v.detach().clone().requires_grad_() for n, v in params.items()}
        loss_of(leaves, *batch(r, step)).backward()
        for n, v in leaves.items():
            part = v.grad * (1.0 / world)
            total[n] = part if n not in total else total[n] + part
    return total


def build(option: bool, overlap: bool, seed: int = 11):
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_ext

    tcfg = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, bf16=True, params_dtype=BF16
    )
    stack = megatron_ext.build_stack(
        MLP(option, seed),
        tcfg,
        per_dtype_grad_buffers=option,
        ddp=dict(overlap_grad_reduce=overlap, bucket_size=1000 if overlap else None),
        optimizer=dict(optimizer="adam", lr=LR, clip_grad=CLIP, bf16=True),
    )
    return stack.model, stack.optimizer


def train(option: bool, overlap: bool, rank: int, world: int, log) -> dict:
    """STEPS clipped steps; per step the checks' numbers, and the final parameters."""
    model, opt = build(option, overlap)
    steps = []
    for step in range(STEPS):
        model.zero_grad_buffer()
        opt.zero_grad()
        params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
        want = expected_grads(params, world, step)
        log.clear()
        model(*batch(rank, step)).backward()
        model.finish_grad_sync()
        grad_sync = [(e[1], e[4], e[5]) for e in log.of("collective")]
        mismatched = [
            (n, lo, hi)
            for n, lo, hi, got in owned_pieces(model)
            if not torch.equal(got, want[n].reshape(-1)[lo:hi])
        ]
        ref = math.sqrt(sum(g.double().square().sum().item() for g in want.values()))
        log.clear()
        ok, norm, _ = opt.step()
        calls = [e[1:4] for e in log.of("collective")]
        steps.append(dict(ok=bool(ok), norm=float(norm), ref=ref, mismatched=mismatched,
                          calls=calls, grad_sync=grad_sync))  # fmt: skip
    final = {n: p.detach().float().tolist() for n, p in model.module.named_parameters()}
    return dict(steps=steps, params=final)


def training_job(rank, world, log, out_dir, overlap):
    return {str(option): train(option, overlap, rank, world, log) for option in (1, 0)}


# --- checkpoints: megatron-core's sharded_state_dict and dist_checkpointing (torch_dist)

CKPT_FORMAT = "fully_reshardable"  # the distributed optimizer's DP-reshardable layout


def _sharded(model, opt, loading: bool) -> dict:
    state = {"model": model.module.sharded_state_dict()}
    state["optimizer"] = opt.sharded_state_dict(
        state["model"], is_loading=loading, metadata={"distrib_optim_sharding_type": CKPT_FORMAT}
    )
    return state


def save_job(rank, world, log, out_dir):
    """Two clipped steps, save, then two more: what a resumed run must reproduce."""
    from megatron.core import dist_checkpointing

    _no_psutil()
    model, opt = build(True, overlap=False)
    norms = clipped_steps(model, opt, rank, range(2))
    saved = dict(params=params_of(model), state=owned_state(model, opt))
    dist_checkpointing.save(_sharded(model, opt, loading=False), os.path.join(out_dir, "ckpt"))
    norms += clipped_steps(model, opt, rank, range(2, 4))
    return dict(saved=saved, norms=norms, params=params_of(model), state=owned_state(model, opt))


def resume_job(rank, world, log, out_dir):
    """Build from other initial values, load, and (at the saving shape) continue."""
    from megatron.core import dist_checkpointing

    model, opt = build(True, overlap=False, seed=12)
    before = params_of(model)
    loaded = dist_checkpointing.load(
        _sharded(model, opt, loading=True), os.path.join(out_dir, "ckpt")
    )
    model.module.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    out = dict(before=before, params=params_of(model), state=owned_state(model, opt))
    if world == 2:
        out["norms"] = clipped_steps(model, opt, rank, range(2, 4))
        out["after"] = dict(params=params_of(model), state=owned_state(model, opt))
    return out


def save_and_resume_job(rank, world, log, out_dir):
    return save_job(rank, world, log, out_dir), resume_job(rank, world, log, out_dir)


def assert_same_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, entry in want.items():
        assert got[key].keys() == entry.keys(), key
        for k, v in entry.items():
            assert torch.equal(got[key][k], v), (key, k)


@pytest.fixture(scope="module")
def dp2_checkpoint(tmp_path_factory):
    """A checkpoint saved at DP=2, and each rank's save-and-resume results (one spawn)."""
    tmp_path = tmp_path_factory.mktemp("dp2_checkpoint")
    (tmp_path / "ckpt").mkdir()
    return tmp_path, run_ranks(tmp_path, 2, save_and_resume_job)


def test_checkpoint_round_trip_at_two_ranks_continues_bit_for_bit(dp2_checkpoint):
    """torch_dist, the distributed optimizer's fully-reshardable format, the option on,
    with the fp32 island and the native fp32 parameter: after loading into a model built
    from other values, parameters and every optimizer state tensor equal the saved ones,
    and two more steps equal the uninterrupted run bit for bit (norms too)."""
    _, ranks = dp2_checkpoint
    for s, r in ranks:
        assert any(not torch.equal(r["before"][n], v) for n, v in s["saved"]["params"].items())
        for n, v in s["saved"]["params"].items():
            assert torch.equal(r["params"][n], v), n
        assert_same_state(r["state"], s["saved"]["state"])
        assert r["norms"] == s["norms"][2:]
        for n, v in s["params"].items():
            assert torch.equal(r["after"]["params"][n], v), n
        assert_same_state(r["after"]["state"], s["state"])


def test_checkpoint_saved_at_two_ranks_loads_at_one(dp2_checkpoint):
    """Resharded DP=2 -> DP=1: each parameter's full main value and Adam state equal the
    DP=2 ranks' saved pieces joined (the continuation at DP=1 sums the ranks' gradients
    in another order: not compared here)."""
    tmp_path, ranks = dp2_checkpoint
    (one,) = run_ranks(tmp_path, 1, resume_job)
    saved = [s["saved"] for s, _ in ranks]
    for n, v in saved[0]["params"].items():
        assert torch.equal(one["params"][n], v), n
    want = joined([s["state"] for s in saved])
    numels = {n: v.numel() for n, v in saved[0]["params"].items()}
    assert {name: end for name, _, end in want} == numels  # every element, every parameter
    assert_same_state(one["state"], want)


@pytest.mark.parametrize("world,overlap", [(1, False), (2, True)])
def test_ddp_and_distributed_optimizer_on_cpu(tmp_path, world, overlap):
    init = initial_params(keep_alpha_bf16=False)
    for got in run_ranks(tmp_path, world, training_job, overlap):
        ours, stock = got["1"], got["0"]
        for run in (ours, stock):
            for step in run["steps"]:
                assert step["ok"]
                assert step["mismatched"] == [], step["mismatched"]
                assert step["norm"] == pytest.approx(step["ref"], rel=1e-6)
                assert step["ref"] > CLIP  # every step clips
                # megatron-core's gradient reduction: one reduce-scatter per bucket, async
                # with overlap_grad_reduce, on the current stream (one optimizer instance);
                # the same calls on every torch (torch 2.11 re-dispatches reduce_scatter_tensor
                # through the shim's function mode: one call still, see the test below)
                kinds = {tuple(c) for c in step["grad_sync"]}
                assert kinds == {("reduce_scatter_tensor", "default", overlap)}, kinds
        # the same collectives as stock in each optimizer step after the first (stock's
        # first also all-reduces, once, whether any rank has grad-norm groups)
        assert [s["calls"] for s in ours["steps"][1:]] == [s["calls"] for s in stock["steps"][1:]]
        assert ours["steps"][1]["calls"]  # the norm's all-reduce at least
        for name, value in ours["params"].items():
            a, b = torch.tensor(value), torch.tensor(stock["params"][name])
            assert torch.allclose(a, b, rtol=2**-7, atol=1e-6), name
            moved = (a - init[name].float()).abs().max().item()
            assert moved > LR / 2, name  # far beyond the tolerance above


def collectives_job(rank, world, log, out_dir):
    """Each collective megatron-core calls, once, as it calls it: through
    ``torch.distributed`` and through the functions param_and_grad_buffer bound at import."""
    import megatron.core.distributed.param_and_grad_buffer as pgb

    log.clear()
    dist.all_reduce(torch.ones(4))
    dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * world))
    pgb.dist_reduce_scatter_func(torch.empty(2), torch.ones(2 * world), async_op=True)
    dist.all_gather_into_tensor(torch.empty(2 * world), torch.ones(2))
    return [e[1] + ("/async" if e[5] else "") for e in log.of("collective")]


@pytest.mark.parametrize("world", [1, 2])
def test_the_shim_records_each_collective_once_whichever_way_torch_dispatches_it(tmp_path, world):
    # torch re-enters a collective through the shim's function mode with its module-level
    # name (all_reduce on every torch, reduce_scatter_tensor and all_gather_into_tensor on
    # 2.11): that is torch's dispatch, not a second collective
    for got in run_ranks(tmp_path, world, collectives_job):
        assert got == [
            "all_reduce",
            "reduce_scatter_tensor",
            "reduce_scatter_tensor/async",
            "all_gather_into_tensor",
        ]


def test_the_shims_cuda_copy_of_a_host_tensor_is_a_copy():
    """As on the device: writing the copy leaves the host tensor (a loaded checkpoint
    shard, say) as it was; a tensor already "on the device" is its own .cuda()."""
    from tests.support.cpu_megatron import cpu_megatron

    host = torch.arange(4.0)
    with cpu_megatron():
        dev = host.cuda()
        dev.add_(1)
        view = dev[1:]
        assert dev.cuda() is dev and view.cuda() is view
        made = torch.zeros(2, device="cuda")
        assert made.cuda() is made
        moved = host.to("cuda")
        assert moved.cuda() is moved
    assert host.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert dev.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_the_shim_records_streams_events_and_devices():
    from tests.support.cpu_megatron import cpu_megatron

    before = torch.cuda.Stream
    with cpu_megatron() as log:
        side = torch.cuda.Stream(device=torch.cuda.current_device())
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            event = torch.cuda.Event()
            event.record()
            buf = torch.zeros(4, dtype=BF16, device=torch.cuda.current_device())
        torch.cuda.current_stream().wait_event(event)
        assert buf.device.type == "cpu" and buf.cuda() is buf
        assert buf.type() == "torch.cuda.BFloat16Tensor"
        assert torch.ones(2, device="cuda").device.type == "cpu"
        assert buf.to(torch.cuda.current_device()).device.type == "cpu"
    assert torch.cuda.Stream is before
    assert buf.type() == "torch.BFloat16Tensor"
    name = side.name
    assert log.entries == [
        ("wait_stream", name, "default"),
        ("record", event.name, name),
        ("wait_event", "default", event.name),
        ("cuda_copy", (4,), BF16, "default"),
    ]
