"""Bytes the optimizer holds between steps, ours against stock megatron-core, on the CPU.

megatron-core's DDP and optimizers run on the CPU through ``tests/support/cpu_megatron.py``
(one gloo rank, spawned as ``tests/test_megatron_cpu.py`` spawns them, one process per
build). A bf16 model with an
fp32 island is built twice, with the option and stock, and trained a few clipped Adam steps
without the precision-aware optimizer: both optimizers read fp32 copies of the bf16
gradients. Stock allocates them in the copy step and frees them in
``zero_grad(set_to_none=True)``, which runs before forward: ours must hold no more than
stock through forward and backward, where activations peak.

The measure is the bytes of every distinct tensor storage reachable from Python
(``benchmarks.memory_ddp.live_storage_bytes``),
taken after ``zero_grad`` (what forward and backward start with) and inside the step, after
the copy to main gradients (both sides then hold their fp32 copies). The CPU has no
allocator statistics; tensors only autograd holds are the same on both sides.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.memory_ddp import live_storage_bytes
from tests.support.megatron_ranks import run_ranks

pytestmark = pytest.mark.mcore

pytest.importorskip("megatron.core")

IN, HID, BATCH, STEPS, LR, CLIP = 256, 512, 16, 3, 1e-3, 1.0
BF16 = torch.bfloat16
# What may legitimately differ between the two builds' live bytes: our buffers' 64-element
# alignment against megatron-core's, the norm's few scalars. Far below one fp32 copy of the
# bf16 gradients (IN * HID * 2 * 4 bytes = 1 MiB here): the test checks that.
SLACK = 16 * 1024


class WideMLP(torch.nn.Module):
    """bf16 weights, an fp32 scale (an island: marked for ours, created fp32 for stock)."""

    def __init__(self, option: bool) -> None:
        super().__init__()
        import megatron_ext

        g = torch.Generator().manual_seed(3)
        self.w1 = torch.nn.Parameter((torch.randn(HID, IN, generator=g) * 0.05).to(BF16))
        self.w2 = torch.nn.Parameter((torch.randn(IN, HID, generator=g) * 0.05).to(BF16))
        alpha = torch.randn(IN, generator=g).to(BF16)
        self.alpha = torch.nn.Parameter(alpha if option else alpha.float())
        if option:
            megatron_ext.mark_keep_in_fp32(self.alpha)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x @ self.w1.t()) @ self.w2.t()
        return ((h.float() * self.alpha.float() - t) ** 2).sum() / BATCH


def build(option: bool, **optimizer):
    """The DDP model and optimizer, Adam, clipped, bf16; ``optimizer`` adds config fields."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_ext

    tcfg = TransformerConfig(
        num_layers=1, hidden_size=IN, num_attention_heads=4, bf16=True, params_dtype=BF16
    )
    stack = megatron_ext.build_stack(
        WideMLP(option),
        tcfg,
        per_dtype_grad_buffers=option,
        optimizer=dict(optimizer="adam", lr=LR, clip_grad=CLIP, bf16=True, **optimizer),
    )
    return stack.model, stack.optimizer


def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, IN, generator=g).to(BF16), torch.randn(BATCH, IN, generator=g)


def measured_steps(option: bool) -> dict:
    """Build, then STEPS steps; live bytes after each zero_grad and after each copy step."""
    model, opt = build(option)
    initial = {n: p.detach().float().clone() for n, p in model.module.named_parameters()}
    held, in_step, norms = [], [], []
    g = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        model.zero_grad_buffer()
        opt.zero_grad()
        held.append(live_storage_bytes())
        model(*batch(g)).backward()
        model.finish_grad_sync()
        opt.prepare_grads()
        in_step.append(live_storage_bytes())
        ok, norm, _ = opt.step()  # prepares again: the same copies, into the same memory
        assert ok
        norms.append(float(norm))
    params = {n: p.detach().float().clone() for n, p in model.module.named_parameters()}
    moved = max((params[n] - p).abs().max().item() for n, p in initial.items())
    return dict(held=held, in_step=in_step, norms=norms, params=params, moved=moved)


def _error_of(fn) -> str | None:
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return None


def freed_reads(**optimizer) -> dict:
    """Ours: what norm, zero count and clip do once zero_grad freed the mirror, then after
    the copy step, and after zero_grad(set_to_none=False) (which keeps the mirror)."""
    model, opt = build(True, **optimizer)
    g = torch.Generator().manual_seed(5)
    reads = {
        "norm": opt.get_grad_norm,
        "zeros": opt.count_zeros,
        "clip": lambda: opt.clip_grad_norm(CLIP),
    }
    out = {}
    for when in ("freed", "filled", "zeroed in place"):
        model.zero_grad_buffer()
        opt.zero_grad(set_to_none=when != "zeroed in place")
        model(*batch(g)).backward()
        model.finish_grad_sync()
        if when == "filled":
            opt.prepare_grads()
        out[when] = {name: _error_of(fn) for name, fn in reads.items()}
        opt.step()
    return out


def memory_job(rank, world, log, out_dir, option):
    """One build in a process of its own: nothing of the other build is alive."""
    return measured_steps(bool(option))


def freed_reads_job(rank, world, log, out_dir):
    # A loss scale makes the norm read the mirror (megatron-core unscales only the copies).
    return {"unscaled": freed_reads(), "loss_scaled": freed_reads(loss_scale=1024.0)}


def bytes_of(ours: dict, stock: dict) -> dict:
    return {k: {"ours": ours[k], "stock": stock[k]} for k in ("held", "in_step")}


def test_ours_holds_no_more_than_stock_between_steps(tmp_path):
    (stock,) = run_ranks(tmp_path, 1, memory_job, 0)
    (ours,) = run_ranks(tmp_path, 1, memory_job, 1)
    copy_bytes = 2 * IN * HID * 4  # one fp32 copy of the bf16 gradients (one rank owns all)
    assert copy_bytes > 8 * SLACK  # an extra copy cannot hide in the slack
    # Stock's copies are freed by zero_grad from the second step on (none before the first).
    for step in range(1, STEPS):
        assert ours["held"][step] <= stock["held"][step] + SLACK, (step, bytes_of(ours, stock))
    # Inside the step both hold one fp32 copy of the gradients (and stock's is the larger
    # number of allocations, not of bytes).
    for step in range(STEPS):
        assert ours["in_step"][step] <= stock["in_step"][step] + SLACK, (
            step,
            bytes_of(ours, stock),
        )
        assert ours["in_step"][step] - ours["held"][step] >= copy_bytes
    # The same training: norms and parameters agree (bf16 rounding apart).
    for a, b in zip(ours["norms"], stock["norms"], strict=True):
        assert a == pytest.approx(b, rel=1e-3)
    for name, p in stock["params"].items():
        torch.testing.assert_close(ours["params"][name], p, rtol=1e-2, atol=1e-3)
    assert min(ours["moved"], stock["moved"]) > LR  # Adam moves each element about LR a step


def test_reading_freed_copies_is_an_error_that_says_what_to_call(tmp_path):
    """Once zero_grad freed the mirror, what reads it (the clip always; norm and zero count
    when a loss scale makes them read the unscaled copies) raises, saying what to call,
    instead of reading through a null address; after the copy step, or with
    zero_grad(set_to_none=False), every read works."""
    (out,) = run_ranks(tmp_path, 1, freed_reads_job)
    reads_mirror = {"unscaled": {"clip"}, "loss_scaled": {"norm", "zeros", "clip"}}
    for scaling, by_when in out.items():
        for name, error in by_when["freed"].items():
            if name in reads_mirror[scaling]:
                assert error is not None, (scaling, name)
                assert "freed by zero_grad()" in error and "prepare_grads()" in error
            else:
                assert error is None, (scaling, name, error)
        assert set(by_when["filled"].values()) == {None}, (scaling, by_when)
        assert set(by_when["zeroed in place"].values()) == {None}, (scaling, by_when)
