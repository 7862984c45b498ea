"""The offloaded step past 32-bit element and byte offsets, on the CPU: a host mirror of more
than 2^32 elements whose tensors are sparse file mappings (only the pages a test touches take
memory), updated through :func:`chunk_spans`, :func:`~megatron_ext.offload.host_mirror.chunk_copies`
and :class:`ChunkedAdamW` (torch's ops and the compiled kernel) at parameters that straddle
element 2^30, 2^31 and 2^32 (bf16 and fp32 byte offsets 2^31, 2^32 and 2^33), checked against
torch's ``AdamW(fused=True)`` and fp64 on copies of the same windows.

A 7B model's shard holds more than 2^31 elements; an offset or index kept in 32 bits
anywhere between the plan and the kernel (a C ``int``, a ctypes argument, an int32 tensor)
would read or write the wrong window here.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from buffers.spans import Span
from megatron_ext.offload import host_kernel
from megatron_ext.offload.host_mirror import build_buffer_mirror, chunk_copies
from megatron_ext.offload.mirror_plan import MirrorLayout
from megatron_ext.offload.step import CUT_QUANTUM, ChunkedAdamW, HostParam, chunk_spans

pytestmark = pytest.mark.mcore

BF16, FP32, FP64 = torch.bfloat16, torch.float32, torch.float64
LR, BETAS, EPS = 1e-3, (0.9, 0.95), 1e-8
# requests of at least this many elements are sparse file mappings (:func:`sparse_zeros`)
LARGE = 2**28


class SparseFiles:
    """Zero-filled CPU tensors as shared mappings of sparse files in ``folder``: the file is
    unlinked at once (the mapping keeps it), and only the pages written take memory."""

    def __init__(self, folder):
        self.folder, self.count = folder, 0

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        path = self.folder / f"sparse{self.count}.bin"
        self.count += 1
        t = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
        path.unlink()
        return t


@pytest.fixture
def sparse_zeros(monkeypatch, tmp_path) -> SparseFiles:
    """``torch.zeros`` / ``torch.zeros_like`` of :data:`LARGE` elements or more return sparse
    mappings (what the host mirror and the flat moments allocate); smaller ones are torch's."""
    files = SparseFiles(tmp_path)
    real_zeros, real_zeros_like = torch.zeros, torch.zeros_like

    def zeros(*size, dtype=None, pin_memory=False, **kwargs):
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
        if math.prod(shape) < LARGE or kwargs or pin_memory:
            return real_zeros(*size, dtype=dtype, pin_memory=pin_memory, **kwargs)
        return files.zeros(math.prod(shape), dtype or torch.get_default_dtype()).view(shape)

    def zeros_like(t, *, dtype=None, **kwargs):
        if t.numel() < LARGE or kwargs:
            return real_zeros_like(t, dtype=dtype, **kwargs)
        return files.zeros(t.numel(), dtype or t.dtype).view(t.shape)

    monkeypatch.setattr(torch, "zeros", zeros)
    monkeypatch.setattr(torch, "zeros_like", zeros_like)
    return files


# the buffer: two blocks (a gap of GPU-resident elements between them), so the second
# block's buffer and mirror coordinates differ; the mirror holds more than 2^32 elements
GAP = 2**16
BLOCKS = (Span(0, 2**31 + 2**20), Span(2**31 + 2**20 + GAP, 2**32 + 2**21 + GAP))
# the parameters, in mirror coordinates: (start, numel, weight decay). Element 2^30 is
# bf16 byte 2^31 and fp32 byte 2^32; element 2^31 is bf16 byte 2^32; odd sizes give every
# parameter torch's scalar tail. The last one lies where a 2^32 truncation of the one
# before it would land.
PARAMS = (
    (2**30 - 301, 1203, 0.1),
    (2**31 - 1037, 2501, 0.0),
    (2**31 + 2**20 - 700, 700, 0.1),  # ends at the first block's end
    (2**32 - 777, 1555, 0.1),
    (2**32 + 2**20 - 3, 4099, 0.0),
    (2**20 - 3, 4099, 0.1),
)


def _mirror_coords(layout: MirrorLayout, start: int) -> int:
    """Buffer coordinates of mirror element ``start``."""
    for block, off in zip(layout.blocks, layout.offsets, strict=True):
        if off <= start < off + block.numel:
            return block.start + start - off
    raise ValueError(start)


def _fp64_step(x, g, t, wd, moments):
    """One AdamW step in fp64 (x: [p, m, v]), moments rounded to ``moments`` after it."""
    p, m, v = x
    p.mul_(1 - LR * wd)
    m.mul_(BETAS[0]).add_((1 - BETAS[0]) * g)
    v.mul_(BETAS[1]).add_((1 - BETAS[1]) * g * g)
    denom = (v / (1 - BETAS[1] ** t)).sqrt() + EPS
    p.sub_(LR * (m / (1 - BETAS[0] ** t)) / denom)
    for moment, dtype in zip((m, v), moments, strict=True):
        moment.copy_(moment.to(dtype).double())


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("moments", [(FP32, FP32), (BF16, BF16)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("grads_dtype", [BF16, FP32], ids=["bf16_grads", "fp32_grads"])
def test_the_chunked_step_past_32_bit_offsets_is_torch_adamw(
    sparse_zeros, kernel, moments, grads_dtype
):
    """A mirror of 2^32 + 2^21 elements (bf16 parameters, bf16 or fp32 gradients, the
    staging shared by both as the exact step has it), built by ``build_buffer_mirror``, cut
    by ``chunk_spans``, the chunks holding a parameter copied in, updated and copied back
    over two steps: each parameter equals torch's ``AdamW(fused=True)`` on a copy of its
    window bit for bit (fp32 moments) or fp64 AdamW with moments rounded to bf16 (bf16
    moments); the device parameters are its bf16 rounding; nothing else moved."""
    nb = BLOCKS[-1].end
    device_grads = sparse_zeros.zeros(nb, grads_dtype)
    device_params = sparse_zeros.zeros(nb, BF16)
    layout = MirrorLayout(BLOCKS)
    assert layout.numel > 2**32
    mirror = build_buffer_mirror(
        "bf16", layout, owned_numel=nb, grads=device_grads, grads_coords=None,
        params=device_params, params_coords=None, cpu_dtype=FP32, pin=False, lean=True,
    )  # fmt: skip
    assert mirror.host_params.numel() == layout.numel
    gen = torch.Generator().manual_seed(53)
    entries, twins, f64 = [], [], []
    for start, numel, wd in PARAMS:
        view = mirror.host_params[start : start + numel]
        view.copy_(torch.randn(numel, generator=gen))
        cfg = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=wd, fused=True)
        entries.append(
            HostParam(view, Span(start, start + numel), torch.optim.AdamW([view], **cfg), 0)
        )
        twin = torch.nn.Parameter(view.clone())
        twins.append((twin, torch.optim.AdamW([twin], **cfg)))
        f64.append([view.double(), torch.zeros(numel, dtype=FP64), torch.zeros(numel, dtype=FP64)])
    # host values next to each parameter (padding the step must not touch)
    around = [
        (s, mirror.host_params[s].clone())
        for start, numel, _ in PARAMS
        for s in (start - 1, start + numel)
    ]
    runs = chunk_spans([layout.local(b) for b in layout.blocks], 2**20, [e.local for e in entries])
    stepper = ChunkedAdamW(
        mirror.host_params, mirror.cpu_grads, entries, [r for _, r in runs], 2**16, moments,
        kernel,
    )  # fmt: skip
    copies = chunk_copies(mirror, runs)
    # where each chunk's copies read and write, from the element sizes: block b's staging
    # starts at byte (its first mirror element) * (the wider of the two dtypes), and holds
    # its gradients, later its parameters, each packed from there at their own size; the
    # device tensors are in buffer coordinates
    width = max(grads_dtype.itemsize, BF16.itemsize)
    for (b, run), c in zip(runs, copies, strict=True):
        at = _mirror_coords(layout, run.start)
        base = layout.offsets[b]
        staged = mirror.staging.data_ptr() + base * width
        assert c.d2h[0].data_ptr() == staged + (run.start - base) * grads_dtype.itemsize
        assert c.h2d[1].data_ptr() == staged + (run.start - base) * BF16.itemsize
        assert c.pack[0].data_ptr() == c.h2d[1].data_ptr()
        assert c.d2h[1].data_ptr() == device_grads.data_ptr() + at * grads_dtype.itemsize
        assert c.h2d[0].data_ptr() == device_params.data_ptr() + at * BF16.itemsize
        assert c.pack[1].data_ptr() == mirror.host_params.data_ptr() + run.start * 4
    busy = [
        k
        for k, (_, r) in enumerate(runs)
        if any(r.start < e.local.end and e.local.start < r.end for e in entries)
    ]
    assert len(busy) >= len(PARAMS) and any(runs[k][1].start > 2**32 for k in busy)
    for t in (1, 2):
        for (start, numel, wd), (twin, opt), x in zip(PARAMS, twins, f64, strict=True):
            at = _mirror_coords(layout, start)
            g = (torch.randn(numel, generator=gen) * 10 ** (t - 2)).to(grads_dtype)
            device_grads[at : at + numel] = g
            twin.grad = g.float()
            opt.step()
            _fp64_step(x, g.double(), t, wd, moments)
        # as the exact step runs them: every chunk's gradients copied in, then chunk by
        # chunk the update and the copy back
        stepper.begin()
        for k in busy:
            copies[k].start_d2h()
        for k in busy:
            stepper.update(k, copies[k])
            copies[k].start_h2d()
        stepper.finish()
        assert stepper.uses_native is (kernel == "native")
        assert stepper.native_updates == (len(busy) if kernel == "native" else 0)
        for (start, numel, _), e, (twin, opt), x in zip(PARAMS, entries, twins, f64, strict=True):
            mine = mirror.host_params[start : start + numel]
            at = _mirror_coords(layout, start)
            m, v = (flat[start : start + numel] for flat in (stepper.exp_avg, stepper.exp_avg_sq))
            assert (m.dtype, v.dtype) == moments
            if moments == (FP32, FP32):
                state = opt.state[twin]
                assert torch.equal(mine, twin.detach())
                assert torch.equal(m, state["exp_avg"]) and torch.equal(v, state["exp_avg_sq"])
            else:
                for got, exact in ((m, x[1]), (v, x[2])):
                    apart = got.view(torch.int16).int() - exact.to(BF16).view(torch.int16).int()
                    assert int(apart.abs().max()) <= 1
            torch.testing.assert_close(mine.double(), x[0], rtol=1e-6, atol=LR * 1e-6)
            assert torch.equal(device_params[at : at + numel], mine.to(BF16))
            assert float(e.optimizer.state[e.param]["step"]) == t
        for s, before in around:
            assert torch.equal(mirror.host_params[s], before)
            assert float(stepper.exp_avg[s]) == 0.0 and float(stepper.exp_avg_sq[s]) == 0.0


def test_chunk_spans_past_32_bit_offsets_tile_the_blocks_and_cut_on_the_quantum():
    """Blocks past 2^32 and a parameter of more than 2^31 elements (planning only, nothing
    allocated): the runs tile every block in order, none longer than the chunk but by the
    next allowed cut, and every cut inside a parameter lies a multiple of the quantum from
    its start (first principles, not the planner's own rule)."""
    blocks = (Span(3, 2**31 + 5), Span(2**31 + 5, 2**32 + 2**25 + 7), Span(2**33, 2**33 + 999))
    params = (
        Span(2**31 - 10, 2**31 + 5),  # ends at the first block's end
        Span(2**31 + 77, 2**32 + 2**24 + 1),  # more than 2^31 elements
        Span(2**32 + 2**24 + 1, 2**32 + 2**25 + 7),
        Span(2**33 + 13, 2**33 + 999),
    )
    chunk = 2**24 + 5
    runs = chunk_spans(blocks, chunk, params)
    for i, block in enumerate(blocks):
        mine = [r for b, r in runs if b == i]
        assert mine[0].start == block.start and mine[-1].end == block.end
        assert all(a.end == b.start for a, b in itertools.pairwise(mine))
        assert all(0 < r.numel <= chunk + CUT_QUANTUM for r in mine)
    assert [b for b, _ in runs] == sorted(b for b, _ in runs)
    cuts = {r.end for _, r in runs} - {b.end for b in blocks}
    for cut in cuts:
        for p in params:
            if p.start < cut < p.end:
                assert (cut - p.start) % CUT_QUANTUM == 0, (cut, p)
    big = params[1]
    inside = sorted(c for c in cuts if big.start < c < big.end)
    assert len(inside) >= big.numel // chunk and inside[-1] > 2**32


def test_the_kernel_updates_a_parameter_of_more_than_2_31_elements(sparse_zeros):
    """One parameter of 2^31 + 2^20 + 13 elements starting past element 2^31 of a sparse
    mapping: its tasks tile it (pointers and the tail's start worked out here from the
    element sizes), and the kernel run on the tasks at its start, around its element 2^31
    and at its end (the scalar tail) equals torch's ``AdamW(fused=True)`` on copies of them,
    bit for bit, for every mix of gradient, moment and output dtypes."""
    k = host_kernel.kernel()
    if k is None:
        pytest.skip(f"the compiled kernel is not available: {host_kernel.describe()}")
    n = 2**31 + 2**20 + 13
    at = 2**31 + 3
    gen = torch.Generator().manual_seed(5)
    for grad_dtype, moment_dtype, out_dtype in itertools.product((BF16, FP32), repeat=3):
        flat = {
            name: sparse_zeros.zeros(at + n, dtype)
            for name, dtype in (
                ("param", FP32), ("grad", grad_dtype), ("exp_avg", moment_dtype),
                ("exp_avg_sq", moment_dtype), ("out", out_dtype),
            )
        }  # fmt: skip
        views = {name: t[at : at + n] for name, t in flat.items()}
        tail = n - n % k.build.width
        tasks = host_kernel.tasks_for(
            views["param"], views["grad"], views["exp_avg"], views["exp_avg_sq"],
            views["out"], 0, 0, tail,
        )  # fmt: skip
        size = host_kernel.TASK_NUMEL
        assert len(tasks) == -(-n // size)
        for i, task in enumerate(tasks):
            a = i * size
            assert task.n == min(size, n - a)
            assert task.vec_n == min(max(tail - a, 0), task.n)
            for name in ("param", "grad", "exp_avg", "exp_avg_sq", "out"):
                base = flat[name].data_ptr() + (at + a) * flat[name].element_size()
                assert getattr(task, name) == base
        # the first task, the one from the parameter's element 2^31, the last (its tail)
        chosen = [0, 2**31 // size, len(tasks) - 1]
        assert chosen[1] * size == 2**31 and tasks[chosen[1]].n == size
        for i in chosen:
            a, b = i * size, i * size + tasks[i].n
            p = torch.randn(b - a, generator=gen)
            g = torch.randn(b - a, generator=gen).to(grad_dtype)
            m = (torch.randn(b - a, generator=gen) * 0.1).to(moment_dtype)
            v = (torch.rand(b - a, generator=gen) * 0.1).to(moment_dtype)
            for name, value in zip(
                ("param", "grad", "exp_avg", "exp_avg_sq"), (p, g, m, v), strict=True
            ):
                views[name][a:b] = value
            twin = torch.nn.Parameter(p.clone())
            opt = torch.optim.AdamW(
                [twin], lr=LR, betas=BETAS, eps=EPS, weight_decay=0.1, fused=True
            )
            # torch's state: the moments as stored (bf16 ones widened), one step already taken
            opt.state[twin] = {
                "step": torch.tensor(1.0),
                "exp_avg": m.float(),
                "exp_avg_sq": v.float(),
            }
            twin.grad = g.float()
            opt.step()
            hyper = host_kernel.hyper_array([(LR, BETAS[0], BETAS[1], 0.1, EPS)])
            kinds = (host_kernel.KINDS[moment_dtype],) * 2
            k.run((host_kernel.Task * 1)(tasks[i]), hyper, torch.tensor([2.0]), kinds, 1)
            # a task's copy has torch's tail where the task has it: every task but the last
            # is a multiple of the vector width long, and the last ends where the whole does
            state = opt.state[twin]
            assert torch.equal(views["param"][a:b], twin.detach())
            assert torch.equal(views["exp_avg"][a:b], state["exp_avg"].to(moment_dtype))
            assert torch.equal(views["exp_avg_sq"][a:b], state["exp_avg_sq"].to(moment_dtype))
            assert torch.equal(views["out"][a:b], twin.detach().to(out_dtype))
        del flat, views
