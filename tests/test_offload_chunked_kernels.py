"""How the chunked step updates a chunk, on the CPU: ``ChunkedAdamW`` against torch's fused
AdamW and fp64, and the compiled kernel through the optimizer (one call per chunk, rounds
that never pack over unread gradients, the torch path where no rounds order a chunk)."""

from __future__ import annotations

import pytest
import torch

from tests.support import offload_internals
from tests.support.offload_sim import (
    MirrorChunkedNative,
    S,
    StockPlaced,
    assert_same_run,
    train,
)

pytestmark = pytest.mark.mcore

FP64 = torch.float64


def test_the_compiled_kernel_runs_once_per_chunk_with_every_family(cpu_streams, monkeypatch):
    """The compiled kernel: one call per chunk, in chunk order, torch's fused AdamW never
    called, the families' hyperparameters (weight decay 0 and 0.1, the lr schedule) and
    the step's thread count handed over."""
    from megatron_ext.offload import host_kernel as native

    native.kernel()  # its probe calls torch's kernel: before the counting starts
    fused = []
    real_fused = torch._fused_adamw_
    monkeypatch.setattr(
        torch, "_fused_adamw_", lambda *a, **k: fused.append(1) or real_fused(*a, **k)
    )
    runs = []
    real_run = native.HostAdamW.run

    def counting(self, tasks, hyper, steps, kinds, threads, *args, **kwargs):
        runs.append((len(tasks), list(hyper), threads))
        return real_run(self, tasks, hyper, steps, kinds, threads, *args, **kwargs)

    monkeypatch.setattr(native.HostAdamW, "run", counting)
    ours = train(MirrorChunkedNative, True, 1.0, 1, chunk=200, compute=64)
    chunks = sum(len(s.chunks) for s in offload_internals.chunked(ours[2]).steppers)
    gpu_calls = 1 if ours[2].gpu_optimizer is not None else 0
    assert len(runs) == chunks and len(fused) == gpu_calls
    lrs_wds = {(h[i], h[i + 3]) for _, h, _ in runs for i in range(0, len(h), 5)}
    assert {wd for _, wd in lrs_wds} == {0.0, 0.1}
    assert {lr for lr, _ in lrs_wds} == {g["lr"] for g in ours[2].param_groups}
    assert {t for _, _, t in runs} == {torch.get_num_threads()}


@pytest.mark.parametrize("chunk", [10**9, 200, 7])
def test_the_compiled_kernel_never_packs_over_gradients_not_yet_read(
    cpu_streams, monkeypatch, chunk
):
    """fp32 gradients of bf16 parameters: the staging holds the gradients (4 bytes an
    element) and the updated parameters are packed into the same bytes (2 an element), so
    element j's new parameter overwrites element j/2's gradient. One kernel call shares its
    tasks among threads in any order; here every call runs its tasks one at a time in
    reverse order (a task of a later parameter packing before an earlier one has read its
    gradients, the order a busy pool can take). Still stock's result bit for bit."""
    from megatron_ext.offload import host_kernel as native

    native.kernel()  # loaded and probed before the reordering starts
    real_run = native.HostAdamW.run
    sizes = []

    def reversed_one_by_one(self, tasks, *args, **kwargs):
        sizes.append(len(tasks))
        for i in reversed(range(len(tasks))):
            real_run(self, (native.Task * 1)(tasks[i]), *args, **kwargs)

    monkeypatch.setattr(native.HostAdamW, "run", reversed_one_by_one)
    stock = train(StockPlaced, True, 1.0, 3, grads_fp32=True)
    ours = train(MirrorChunkedNative, True, 1.0, 3, chunk=chunk, grads_fp32=True)
    bf16_mirror = next(m for m in ours[2].host_mirrors if m.params_dtype == torch.bfloat16)
    assert bf16_mirror.grads_dtype == torch.float32  # packed into the gradients' bytes
    assert bf16_mirror.cpu_grads.data_ptr() == bf16_mirror.staging.data_ptr()
    assert all(s.uses_native for s in offload_internals.chunked(ours[2]).steppers)
    if chunk >= 200:
        assert max(sizes) > 1  # calls of several tasks, whose order was reversed
    assert_same_run(stock, ours)


def test_a_chunk_no_rounds_can_order_takes_the_torch_path(cpu_streams, monkeypatch):
    """Where native.rounds finds no safe order for a chunk's tasks (None), that chunk is
    updated by torch's ops: no kernel call for it, the result stock's bit for bit."""
    from megatron_ext.offload import host_kernel as native

    native.kernel()
    calls = []
    real_run = native.HostAdamW.run
    monkeypatch.setattr(native, "rounds", lambda tasks: None)
    monkeypatch.setattr(
        native.HostAdamW, "run", lambda self, *a, **k: calls.append(1) or real_run(self, *a, **k)
    )
    stock = train(StockPlaced, True, 1.0, 3, grads_fp32=True)
    ours = train(MirrorChunkedNative, True, 1.0, 3, chunk=200, grads_fp32=True)
    assert not calls
    for stepper in offload_internals.chunked(ours[2]).steppers:
        assert stepper.native_updates == 0 and stepper.updated > 0
    assert_same_run(stock, ours)


def test_chunked_adamw_refuses_what_is_not_the_mirror():
    from megatron_ext.offload.step import ChunkedAdamW, HostParam, chunk_spans

    host, grads = torch.zeros(100), torch.zeros(100)
    p = host[10:30].view(4, 5)
    opt = torch.optim.AdamW([p], fused=True)
    ChunkedAdamW(host, grads, [HostParam(p, S(10, 30), opt, 0)], [S(0, 50), S(50, 100)])
    with pytest.raises(ValueError, match="not the mirror's view at"):
        ChunkedAdamW(host, grads, [HostParam(p, S(11, 31), opt, 0)], [S(0, 100)])
    with pytest.raises(ValueError, match="not the mirror's view at"):
        ChunkedAdamW(host, grads, [HostParam(torch.zeros(20), S(10, 30), opt, 0)], [S(0, 100)])
    with pytest.raises(ValueError, match="cover every parameter exactly once"):
        ChunkedAdamW(host, grads, [HostParam(p, S(10, 30), opt, 0)], [S(0, 20)])
    with pytest.raises(ValueError, match="cover every parameter exactly once"):
        ChunkedAdamW(host, grads, [HostParam(p, S(10, 30), opt, 0)], [S(0, 25), S(20, 40)])
    other = host[25:35]
    with pytest.raises(ValueError, match="overlap in the mirror"):
        ChunkedAdamW(
            host, grads,
            [HostParam(p, S(10, 30), opt, 0), HostParam(other, S(25, 35), opt, 0)], [S(0, 100)],
        )  # fmt: skip
    with pytest.raises(ValueError, match="flat tensors alike"):
        ChunkedAdamW(host, grads.double(), [], [])
    assert chunk_spans([S(0, 10), S(10, 13)], 4) == (
        (0, S(0, 4)), (0, S(4, 8)), (0, S(8, 10)), (1, S(10, 13)),
    )  # fmt: skip
    with pytest.raises(ValueError, match="positive"):
        chunk_spans([S(0, 10)], 0)
    # inside a parameter, cuts fall at multiples of 64 from its start (torch's kernel then
    # treats every element as in the whole parameter); in gaps and at block ends anywhere
    assert chunk_spans([S(0, 300)], 100, [S(10, 210)]) == (
        (0, S(0, 74)), (0, S(74, 138)), (0, S(138, 238)), (0, S(238, 300)),
    )  # fmt: skip
    # a block that ends inside a parameter off the quantum: no run crosses its end
    assert chunk_spans([S(0, 37), S(37, 80)], 18, [S(0, 80)]) == (
        (0, S(0, 37)), (1, S(37, 64)), (1, S(64, 80)),
    )  # fmt: skip
    small = chunk_spans([S(0, 300)], 1, [S(10, 210)])
    assert [r for _, r in small][9:13] == [S(9, 10), S(10, 74), S(74, 138), S(138, 202)]
    assert small[13][1] == S(202, 210) and small[14][1] == S(210, 211)


def test_chunked_adamw_equals_torch_fused_adamw_per_parameter_in_fp64_terms():
    """Against torch's own AdamW(fused=True), one optimizer per parameter, and an fp64
    AdamW computed here from the formula (fresh random data, two hyperparameter sets)."""
    from megatron_ext.offload.step import ChunkedAdamW, HostParam, chunk_spans

    gen = torch.Generator().manual_seed(0)
    sizes, gaps = [5, 17, 1, 33, 8], [0, 3, 0, 2, 7]
    n = sum(sizes) + sum(gaps)
    host, grads = torch.randn(n, generator=gen), torch.zeros(n)
    ref, opts, entries, f64, at = [], [], [], [], 0
    for i, (size, gap) in enumerate(zip(sizes, gaps, strict=True)):
        at += gap
        view = host[at : at + size]
        twin = torch.nn.Parameter(view.clone())
        wd = 0.1 if i % 2 else 0.0
        cfg = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, fused=True)
        opts.append(torch.optim.AdamW([view], **cfg))
        ref.append((twin, torch.optim.AdamW([twin], **cfg)))
        entries.append(HostParam(view, S(at, at + size), opts[-1], 0))
        f64.append(
            [
                view.double().clone(),
                torch.zeros(size, dtype=FP64),
                torch.zeros(size, dtype=FP64),
                wd,
            ]
        )
        at += size
    runs = chunk_spans([S(0, n)], 9, [e.local for e in entries])
    assert len(runs) > len(entries)
    stepper = ChunkedAdamW(host, grads, entries, [r for _, r in runs])
    for t in range(1, 4):
        grads.copy_(torch.randn(n, generator=gen))
        for e, (twin, opt), x in zip(entries, ref, f64, strict=True):
            g = grads[e.local.start : e.local.end]
            twin.grad = g.clone()
            opt.step()
            p, m, v, wd = x
            p.mul_(1 - 1e-2 * wd)
            m.mul_(0.9).add_(0.1 * g.double())
            v.mul_(0.95).add_(0.05 * g.double() ** 2)
            denom = (v / (1 - 0.95**t)).sqrt() + 1e-8
            p.sub_(1e-2 * (m / (1 - 0.9**t)) / denom)
        stepper.begin()
        for c in range(len(stepper.chunks)):
            stepper.update(c)
        stepper.finish()
        for e, (twin, _), x in zip(entries, ref, f64, strict=True):
            mine = host[e.local.start : e.local.end]
            assert torch.equal(mine, twin.detach())  # torch's kernel, bit for bit
            torch.testing.assert_close(mine.double(), x[0], rtol=1e-6, atol=1e-7)
    untouched = torch.ones(n, dtype=torch.bool)
    for e in entries:
        untouched[e.local.start : e.local.end] = False
    assert torch.equal(
        host[untouched], torch.randn(n, generator=torch.Generator().manual_seed(0))[untouched]
    )
