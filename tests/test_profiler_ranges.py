"""Norm and clip show in a profile by name, as FSDP2's phases do ("FSDP::..."): a CPU
profile of FlatGradBuffers and of a flat megatron-core optimizer finds every range."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from buffers import FlatGradBuffers
from megatron_ext import enable_flat_norm
from tests.support.optimizers import (
    FP32,
    Chunk,
    RankGroup,
    Spec,
    chain,
    config,
    float16_child,
    make_buffer,
    make_params,
    record_all_reduce,
)

pytestmark = pytest.mark.mcore


def ranges_of(fn) -> list[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if "::" in e.name and e.name.split("::")[0] in (
        "buffers", "megatron_ext")]  # fmt: skip


def flat_buffers():
    gen = torch.Generator().manual_seed(3)
    params = [
        torch.nn.Parameter(torch.randn(300, generator=gen).to(torch.bfloat16)),
        torch.nn.Parameter(torch.randn(70, generator=gen)),
    ]
    fgb = FlatGradBuffers(params)
    for p in params:
        p.grad.copy_(torch.randn(p.shape, generator=gen))
    return fgb, params  # the buffers hold their parameters weakly


def test_flat_grad_buffers_norm_and_clip_are_named_ranges():
    fgb, _params = flat_buffers()
    assert ranges_of(fgb.grad_norm) == ["buffers::grad_norm"]
    assert ranges_of(lambda: fgb.grad_norm(per_param=True)) == ["buffers::grad_norm"]
    assert ranges_of(lambda: fgb.clip_grad_norm_(0.5)) == ["buffers::clip"]
    # a norm checked for non-finite values, then the scale by it: two ranges
    got = ranges_of(lambda: fgb.clip_grad_norm_(0.5, error_if_nonfinite=True))
    assert got == ["buffers::grad_norm", "buffers::clip"]


def test_a_flat_megatron_optimizers_norm_and_clip_are_named_ranges(monkeypatch):
    record_all_reduce(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    specs = [Spec("w", 300, tp=True), Spec("b", 130), Spec("sink", 40, FP32)]
    params = make_params(specs, gen)
    named = {s.name: p for s, p in zip(specs, params, strict=True)}
    bufs = [make_buffer([p for p in params if p.dtype == dt], gen) for dt in (torch.bfloat16, FP32)]
    child = float16_child(params, config(0.5), RankGroup(2), RankGroup(1))
    opt = enable_flat_norm(chain([child]), [Chunk(named, bufs)])
    norm = ranges_of(opt.get_grad_norm)
    assert norm == ["megatron_ext::grad_norm", "buffers::grad_norm"]
    clip = ranges_of(lambda: opt.clip_grad_norm(0.5))
    assert clip == ["megatron_ext::clip", "buffers::clip"]
    step = ranges_of(opt.step)
    assert step[:2] == ["megatron_ext::clip", "buffers::clip"]
