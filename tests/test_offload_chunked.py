"""The chunked offload step through the optimizer, on the CPU: its host bytes, lean
mirrors, rebuilding, stock's bits at any chunk size, the fallback, and its order of copies
and fused calls."""

from __future__ import annotations

import pytest
import torch

from tests.support import offload_internals
from tests.support.offload_sim import (
    MirrorChunked,
    MirrorChunkedNative,
    MirrorChunkedOnDeviceNative,
    MirrorChunkedOnDeviceTorch,
    MirrorChunkedTorch,
    MirrorPlaced,
    StockPlaced,
    assert_same_run,
    train,
)

pytestmark = pytest.mark.mcore


def test_chunked_step_reports_its_host_bytes_and_allocates_once(cpu_streams):
    ours = train(MirrorChunked, True, 1.0, 1, chunk=200, compute=64)
    hdo = ours[2]
    steppers = offload_internals.chunked(hdo).steppers
    stats = hdo.host_mirror_stats()
    ptrs = [(s.exp_avg.data_ptr(), s.exp_avg_sq.data_ptr(), s.scratch.data_ptr()) for s in steppers]
    for row, stepper in zip(stats, steppers, strict=True):
        per_param = sum(8 * e.param.numel() for e in stepper.entries)  # torch's two moments
        assert row["moment_bytes"] == per_param + row["moment_padding_bytes"]
        assert row["moment_padding_bytes"] == 8 * (stepper.host_params.numel() - per_param // 8)
        assert row["scratch_bytes"] == 4 * max(s.numel for c in stepper.subs for s, _ in c)
    hdo.step()
    hdo.step()
    after = [
        (s.exp_avg.data_ptr(), s.exp_avg_sq.data_ptr(), s.scratch.data_ptr()) for s in steppers
    ]
    assert after == ptrs  # the same host tensors every step
    per_param = [m.stats() for m in hdo.host_mirrors]
    for row, plain in zip(stats, per_param, strict=True):
        assert {k: row[k] for k in plain} == plain  # the mirrors' own bytes unchanged


def test_chunked_mirrors_keep_no_host_copy_of_the_gradients(cpu_streams):
    """bf16 gradients: the per-parameter step reads an fp32 host copy of them (4 bytes per
    element); the chunked step converts into its scratch, so its mirror has none."""
    per = train(MirrorPlaced, True, 1.0, 1)[2]
    lean = train(MirrorChunked, True, 1.0, 1, chunk=200, compute=64)[2]
    by_name = {m["buffer"]: m for m in per.host_mirror_stats()}
    for row in lean.host_mirror_stats():
        plain = by_name[row["buffer"]]
        if row["grads_dtype"] == torch.bfloat16:
            assert plain["host_grad_bytes"] == 2 * plain["staging_bytes"] > 0
            assert row["host_grad_bytes"] == 0
        else:  # fp32 gradients are read in the staging by both
            assert row["host_grad_bytes"] == plain["host_grad_bytes"] == 0
        assert row["staging_bytes"] == plain["staging_bytes"]
        assert row["host_param_bytes"] == plain["host_param_bytes"]
    bf16_mirror = next(m for m in lean.host_mirrors if m.grads_dtype == torch.bfloat16)
    assert bf16_mirror.cpu_grads is None
    cpu_streams.compute.synchronize()  # the last step's copies back are done
    with pytest.raises(RuntimeError, match="lean .*only the chunked offload step converts"):
        bf16_mirror.blocks[0].convert_grads()
    lean.chunked_step = False  # the per-parameter step would read no gradients: refused
    with pytest.raises(RuntimeError, match="chunked_step is off.*offload_step='per_parameter'"):
        lean.step()


def test_the_chunked_step_is_rebuilt_when_its_sizes_change(cpu_streams):
    bf16, fp32, hdo, _ = train(MirrorChunked, True, 1.0, 1, chunk=10**9, compute=10**9)
    first = offload_internals.chunked(hdo)
    assert sum(len(c) for s in first.steppers for c in s.subs) == len(first.copies)  # one each
    hdo.compute_numel = 64
    hdo.step()
    now = offload_internals.chunked(hdo)
    assert now.steppers[0] is not first.steppers[0]
    assert sum(len(c) for s in now.steppers for c in s.subs) > len(now.copies)
    hdo.chunk_numel = 200
    hdo.step()
    assert len(offload_internals.chunked(hdo).copies) > len(first.copies)


@pytest.mark.parametrize(
    "chunk,compute", [(1, 1), (7, 10**9), (200, 64), (10**9, 100), (10**9, 10**9)]
)
@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize(
    "pa,grads_fp32",
    [(True, False), (True, True), (False, False)],
    ids=["pa", "pa_fp32grads", "main"],
)
@pytest.mark.parametrize(
    "cls",
    [
        MirrorChunkedNative,
        MirrorChunkedOnDeviceNative,
        MirrorChunkedTorch,
        MirrorChunkedOnDeviceTorch,
    ],
    ids=["host-native", "device-native", "host-torch", "device-torch"],
)
def test_chunked_step_is_stock_bit_for_bit_at_any_chunk_size(
    cpu_streams, cls, pa, grads_fp32, fraction, chunk, compute
):
    """Chunks (copies) and their sub-ranges (convert, update, pack) of any size, the
    gradients and parameters converted on the host or on the device, the chunks updated by
    the compiled kernel (one pass) or by torch's ops; bf16 or fp32 gradient buffers."""
    stock = train(StockPlaced, pa, fraction, 3, grads_fp32=grads_fp32)
    ours = train(cls, pa, fraction, 3, chunk=chunk, compute=compute, grads_fp32=grads_fp32)
    assert offload_internals.chunked(ours[2]) is not None, ours[2].chunked_step_off
    native = cls.offload_kernel == "native"
    for stepper in offload_internals.chunked(ours[2]).steppers:
        assert stepper.uses_native is native
        assert stepper.native_updates == (len(stepper.chunks) if native else 0)
    parts = offload_internals.chunked(ours[2])
    steppers, copies = parts.steppers, parts.copies
    subs = sum(len(c) for s in steppers for c in s.subs)
    assert (subs > len(copies)) == (compute < chunk)
    blocks = sum(len(m.blocks) for m in ours[2].host_mirrors)
    if chunk == 10**9:
        assert len(copies) == blocks
    else:
        assert len(copies) > blocks
    assert_same_run(stock, ours)


def test_chunked_step_falls_back_where_the_cpu_adamw_is_not_fused(cpu_streams):
    ours = train(offload_internals.cpu_adamw_not_fused(MirrorChunked), True, 1.0, 2, chunk=7)
    assert offload_internals.chunked(ours[2]) is None
    assert "not fused" in ours[2].chunked_step_off
    # built with the host gradients the fallback reads
    assert all(m.cpu_grads is not None for m in ours[2].host_mirrors)
    assert all(s.get("exp_avg") is not None for s in ours[2].state.values())


def test_chunked_step_order_and_one_call_per_chunk_and_hyperparameters(cpu_streams, monkeypatch):
    """All device-to-host copies first, then per chunk: wait, update (converting and
    packing), copy back, in chunk order; one fused call per sub-range and distinct
    hyperparameter set."""
    from megatron_ext.offload import host_mirror as hm
    from megatron_ext.offload.step import ChunkedAdamW

    log = []
    for name in ("start_d2h", "convert_grads", "pack_params", "start_h2d"):
        real = getattr(hm.HostBlock, name)

        def traced(self, real=real, name=name):
            log.append((name, id(self)))
            return real(self)

        monkeypatch.setattr(hm.HostBlock, name, traced)
    real_update = ChunkedAdamW.update

    def traced_update(self, i, copies=None):
        log.append(("update", id(copies)))
        return real_update(self, i, copies)

    monkeypatch.setattr(ChunkedAdamW, "update", traced_update)
    calls = []
    real_fused = torch._fused_adamw_

    def counting(params, *args, **kwargs):
        calls.append((len(params), kwargs["weight_decay"], kwargs["lr"]))
        return real_fused(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", counting)
    ours = train(MirrorChunkedTorch, True, 1.0, 1, chunk=200, compute=64)
    copies = offload_internals.chunked(ours[2]).copies
    ids = [id(c) for c in copies]
    n = len(ids)
    assert log[:n] == [("start_d2h", i) for i in ids]
    want = []
    for i in ids:
        want += [("update", i), ("start_h2d", i)]  # it converts and packs itself
    assert log[n:] == want
    # every sub-range (64 elements, chunks of 200): one call per weight-decay value in it
    expected = 0
    for stepper in offload_internals.chunked(ours[2]).steppers:
        for subs in stepper.subs:
            for _, pieces in subs:
                wds = {
                    stepper.entries[k].optimizer.param_groups[0]["weight_decay"] for k, _ in pieces
                }
                expected += len(wds)
    assert len(calls) == expected and {wd for _, wd, _ in calls} == {0.0, 0.1}
