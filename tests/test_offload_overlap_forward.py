"""The overlapped exact offload step ([Note: the overlapped exact step] in
``megatron_ext/offload/forward_waits.py``) inside a real training loop, on the CPU:
megatron-core's DDP and distributed optimizer (``tests/support/cpu_megatron.py``), each step
``zero_grad_buffer``, ``zero_grad``, forward and backward, ``finish_grad_sync``, ``step``.

The reference is the exact chunked step on a second, identical stack, which computes its own
forward and backward: each step's loss, norm and gradients, and what each model holds, must
equal it bit for bit. The host update of the overlapped run is slowed (a sleep per chunk), so
a forward pass that read a parameter before its chunk came back would read the last step's
value and change the loss; and the first layer's forward must begin before that update ends
(the overlap took place).
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.test_megatron_cpu import BF16, CLIP, LR, rank_device, run_ranks, to_model
from tests.test_megatron_cpu_reshard import adam_path

pytest.importorskip("megatron.core")

H, LAYERS, BATCH, STEPS = 64, 4, 8, 4
SLEEP_S = 0.01  # per chunk of the overlapped run's host update


class Layer(torch.nn.Module):
    """A bf16 weight and bias and, marked keep_in_fp32, an fp32 gate (an island)."""

    def __init__(self, g: torch.Generator):
        super().__init__()
        self.w = torch.nn.Parameter((torch.randn(H, H, generator=g) * 0.2).to(BF16))
        self.b = torch.nn.Parameter((torch.randn(H, generator=g) * 0.2).to(BF16))
        self.gate = torch.nn.Parameter((torch.randn(H, generator=g) + 1).to(BF16))

    def forward(self, x):
        y = torch.tanh(x @ self.w.t() + self.b)
        return (y.float() * self.gate).to(BF16)


class Stack(torch.nn.Module):
    """Layers in order, then a head tied to the first layer's weight (read after that
    layer's forward, by the root module, which holds a natively fp32 scale of its own)."""

    def __init__(self):
        super().__init__()
        import megatron_ext

        g = torch.Generator().manual_seed(3)
        self.layers = torch.nn.ModuleList(Layer(g) for _ in range(LAYERS))
        self.scale = torch.nn.Parameter(torch.randn(H, generator=g))  # fp32
        for layer in self.layers:
            megatron_ext.mark_keep_in_fp32(layer.gate)

    def forward(self, x, t):
        for layer in self.layers:
            x = layer(x)
        y = (x @ self.layers[0].w).float() * self.scale
        return ((y - t) ** 2).sum() / BATCH


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, H, generator=g).to(BF16), torch.randn(BATCH, H, generator=g)


def build(overlap: bool, fraction: float, world: int, gather: bool = False):
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_ext

    module = Stack().to(rank_device())
    tcfg = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, bf16=True, params_dtype=BF16
    )
    ddp_config = megatron_ext.DistributedDataParallelConfig(
        per_dtype_grad_buffers=True,
        use_distributed_optimizer=True,
        overlap_param_gather=gather,
        overlap_grad_reduce=gather,
        bucket_size=4096 if gather else None,
    )
    model = megatron_ext.DistributedDataParallel(tcfg, ddp_config, module)
    ocfg = OptimizerConfig(
        optimizer="adam", lr=LR, clip_grad=CLIP, bf16=True, use_distributed_optimizer=True,
        optimizer_cpu_offload=True, optimizer_offload_fraction=fraction,
        use_precision_aware_optimizer=True, overlap_param_gather=gather,
    )  # fmt: skip
    options = megatron_ext.MegatronOptions(
        offload_overlap_forward=overlap, offload_chunk_numel=1024
    )
    return model, megatron_ext.get_megatron_optimizer(ocfg, [model], options=options)


def _held(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def _grads(model) -> list[torch.Tensor]:
    return [b.grad_data.clone() for b in model.all_grad_buffers()]


def overlap_loop_job(rank, world, log, out_dir, fraction, gather):
    import threading

    import megatron_ext
    from megatron_ext.offload.step import ChunkedAdamW

    with adam_path("torch+offload"):  # megatron-core's placement, as on a device
        ours, ours_opt = build(True, fraction, world, gather)
        ref, ref_opt = build(False, fraction, world, gather)
    update = ChunkedAdamW.update
    ended: list[float] = []  # when each chunk of an overlapped update ended

    def slowed(self, *a, **k):
        if threading.current_thread().name == "megatron_ext-offload-update":
            time.sleep(SLEEP_S)
            out = update(self, *a, **k)
            ended.append(time.perf_counter())
            return out
        return update(self, *a, **k)

    began: list[float] = []  # when each forward pass of the first layer began
    ours.module.layers[0].register_forward_pre_hook(lambda m, a: began.append(time.perf_counter()))
    ChunkedAdamW.update = slowed
    out = []
    try:
        for s in range(STEPS):
            row = {}
            for name, model, opt in (("ours", ours, ours_opt), ("ref", ref, ref_opt)):
                model.zero_grad_buffer()
                opt.zero_grad()
                loss = model(*to_model(model, *batch(rank, s)))
                loss.backward()
                model.finish_grad_sync()
                grads = _grads(model)
                ok, norm, _ = opt.step()
                row[name] = (loss.detach().clone(), grads, ok, float(norm))
            (hdo,) = [c.optimizer for c in ours_opt.chained_optimizers]
            row["in_flight"] = hdo._in_flight is not None
            row["chunks"] = len(hdo._chunked.copies)
            out.append(row)
        megatron_ext.drain_offload(ours_opt)
        # the forward of the step after the last: only once its update has ended
        loss = ours(*to_model(ours, *batch(rank, STEPS)))
        ref_loss = ref(*to_model(ref, *batch(rank, STEPS)))
        out.append(
            dict(
                final=(loss.detach(), ref_loss.detach()),
                held=(_held(ours), _held(ref)),
                began=began,
                ended=ended,
            )
        )
    finally:
        ChunkedAdamW.update = update
    return out


def _check(rows) -> None:
    *steps, last = rows
    for s, row in enumerate(steps):
        (loss, grads, ok, norm), (rloss, rgrads, rok, rnorm) = row["ours"], row["ref"]
        assert torch.equal(loss, rloss), (s, loss, rloss)
        assert all(torch.equal(a, b) for a, b in zip(grads, rgrads, strict=True)), s
        assert (ok, norm) == (rok, rnorm), s
        assert row["in_flight"], s  # the step returned with its host update running
    assert torch.equal(*last["final"])
    ours, ref = last["held"]
    assert ours.keys() == ref.keys()
    differ = [n for n in ours if not torch.equal(ours[n], ref[n])]
    assert not differ, differ


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_the_overlapped_step_gives_the_exact_steps_bits_and_overlaps_the_forward(
    tmp_path, fraction
):
    (rows,) = run_ranks(tmp_path, 1, overlap_loop_job, fraction, False)
    _check(rows)
    # every forward after the first began while the last step's host update still ran:
    # before the last chunk of the update launched at the step before ended
    *steps, last = rows
    n = steps[0]["chunks"]
    assert n > LAYERS and all(r["chunks"] == n for r in steps)
    assert len(last["ended"]) == STEPS * n and len(last["began"]) == STEPS + 1
    for s in range(1, STEPS):
        assert last["began"][s] < last["ended"][s * n - 1], s
    # after drain_offload, the forward began once the last update had ended
    assert last["began"][STEPS] > last["ended"][-1]


@pytest.mark.parametrize("gather", [False, True], ids=["gather_in_step", "gather_in_forward"])
def test_two_ranks_gather_each_bucket_after_its_chunks(tmp_path, gather):
    for rows in run_ranks(tmp_path, 2, overlap_loop_job, 1.0, gather):
        _check(rows)
