"""The offloaded step's compiled kernel (megatron_ext/offload/host_adamw.c) against torch's
fused AdamW, bit for bit, and what happens where it cannot be used."""

from __future__ import annotations

import itertools
import shutil
import warnings

import pytest
import torch

from buffers import native as buffers_native
from buffers.spans import Span
from megatron_ext.offload import host_kernel as native
from megatron_ext.offload.step import ChunkedAdamW, HostParam, chunk_spans

pytestmark = pytest.mark.mcore

BF16 = torch.bfloat16
needs_cc = pytest.mark.skipif(
    shutil.which("cc") is None, reason="needs a C compiler (cc) to build the kernel"
)


@pytest.fixture
def kernel():
    k = native.kernel()
    assert k is not None, native.describe()
    return k


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _case(gen, sizes, grad_dtype=torch.float32):
    """Parameters of ``sizes`` with values bf16 cannot hold, over several magnitudes."""
    out = []
    for n in sizes:
        scale = torch.pow(10.0, torch.empty(n).uniform_(-4, 1, generator=gen))
        p = torch.randn(n, generator=gen)
        g = (torch.randn(n, generator=gen) * scale).to(grad_dtype)
        m = torch.randn(n, generator=gen) * scale * 0.3
        v = torch.rand(n, generator=gen) * scale * scale
        out.append((p, g, m, v))
    return out


def _torch_step(case, hyper, steps):
    """torch._fused_adamw_ per parameter (fp32 gradients: bf16 ones widened, exactly)."""
    lr, b1, b2, wd, eps = hyper
    result = []
    for (p, g, m, v), step in zip(case, steps, strict=True):
        p, m, v = p.clone(), m.clone(), v.clone()
        torch._fused_adamw_(
            [p], [g.float()], [m], [v], [], [torch.tensor(float(step))], amsgrad=False,
            lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps, maximize=False,
            grad_scale=None, found_inf=None,
        )  # fmt: skip
        result.append((p, m, v))
    return result


def _kernel_step(
    k,
    case,
    hyper,
    steps,
    threads=1,
    vectorized=None,
    task_numel=native.TASK_NUMEL,
    shift=0,
    stream=None,
):
    """The kernel over the same parameters (one task list, every parameter an entry), its
    new parameters also rounded to bf16 into ``out``; ``shift``: ``out`` that many elements
    past an aligned start (1: no vector store of it aligned, the non-temporal ones off)."""
    width = k.build.width
    got, tasks = [], []
    for i, (p, g, m, v) in enumerate(case):
        p, m, v = p.clone(), m.clone(), v.clone()
        out = torch.empty(p.numel() + shift, dtype=BF16)[shift:]
        n = p.numel()
        tasks += native.tasks_for(p, g, m, v, out, i, 0, n - n % width, task_numel)
        got.append((p, m, v, out))
    array = (native.Task * len(tasks))(*tasks)
    k.run(
        array,
        native.hyper_array([hyper]),
        torch.tensor([float(s) for s in steps]),
        (2, 2),
        threads,
        vectorized=vectorized,
        stream=stream,
    )
    return got


HYPERS = {
    "adamw": (1e-3, 0.9, 0.999, 0.01, 1e-8),
    "no_decay": (3e-2, 0.9, 0.95, 0.0, 1e-6),
    "beta1_below_half": (2.5e-1, 0.3, 0.9, 0.5, 1e-3),
}


@needs_cc
@pytest.mark.parametrize("grad_dtype", [torch.float32, BF16], ids=["fp32_grads", "bf16_grads"])
@pytest.mark.parametrize("hyper", HYPERS, ids=list(HYPERS))
def test_the_kernel_equals_torchs_fused_adamw_bit_for_bit(kernel, hyper, grad_dtype):
    """Parameters, both moments and the bf16-rounded parameters, every element, at odd
    sizes (each with its own tail), different steps per parameter, one and three threads,
    the AVX2 path and the portable one."""
    gen = torch.Generator().manual_seed(7)
    sizes = [1, 7, 8, 15, 16, 17, 24, 31, 33, 47, 100, 1000, 4099, 70000]
    case = _case(gen, sizes, grad_dtype)
    steps = [1, 2, 5, 10, 100, 1000, 3, 4, 7, 20, 9, 11, 13, 30]
    want = _torch_step(case, HYPERS[hyper], steps)
    # every vector path this CPU runs (AVX-512, AVX2, portable: the widest by default), the
    # packed parameters' staging aligned (AVX-512: non-temporal stores) and not, those
    # stores asked for and not
    paths = range(kernel.vectorized, -1, -1)
    for threads, vectorized, shift, stream in itertools.product(
        (1, 3), paths, (0, 1), (True, False)
    ):
        got = _kernel_step(
            kernel, case, HYPERS[hyper], steps, threads, vectorized, 256, shift, stream
        )
        for (p, m, v, out), (wp, wm, wv) in zip(got, want, strict=True):
            for a, b in ((p, wp), (m, wm), (v, wv), (out, wp.to(BF16))):
                assert torch.equal(_bits(a), _bits(b)), (
                    threads, vectorized, shift, stream, p.numel()
                )  # fmt: skip


@needs_cc
def test_every_other_candidate_arithmetic_differs_from_torchs_somewhere(kernel):
    """The probe's choice is not one of several that agree by luck: on this data every
    other (variant, width) changes some element, so a slip in either formula is seen."""
    gen = torch.Generator().manual_seed(8)
    case = _case(gen, [16 * 50 + 13, 16 * 7 + 5])
    hyper, steps = HYPERS["beta1_below_half"], [3, 3]
    want = _torch_step(case, hyper, steps) + _torch_step(case, HYPERS["adamw"], steps)
    chosen = kernel.build
    for width, variant in itertools.product(native.WIDTHS, native.VARIANTS):
        if (width, variant) == (chosen.width, chosen.variant):
            continue
        kernel.build = native.Build(variant, width, chosen.vectorized)
        try:
            got = _kernel_step(kernel, case, hyper, steps) + _kernel_step(
                kernel, case, HYPERS["adamw"], steps
            )
        finally:
            kernel.build = chosen
        same = all(
            torch.equal(_bits(a), _bits(b))
            for (p, m, v, _), w in zip(got, want, strict=True)
            for a, b in zip((p, m, v), w, strict=True)
        )
        assert not same, (width, variant)


@needs_cc
def test_rounding_to_bf16_matches_torch_at_ties_subnormals_and_specials(kernel):
    """The packed parameters: round to nearest even as torch's conversion, at exact ties,
    just around them, subnormals, the largest values, infinities; NaN stays NaN."""
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x3F808001, 0x3F817FFF], dtype=torch.int32)
    special = torch.tensor(
        [0.0, -0.0, 1e-40, -3e-39, 3.3895e38, -3.4e38, float("inf"), -float("inf"), 1.0],
        dtype=torch.float32,
    )
    gen = torch.Generator().manual_seed(9)
    values = torch.cat([ties.view(torch.float32), special, torch.randn(1000, generator=gen)])
    nan = torch.tensor([float("nan")] * 9)
    params = torch.cat([values, nan])
    levels = range(kernel.vectorized, -1, -1)
    for vectorized, shift, stream in itertools.product(levels, (0, 1), (True, False)):
        out = torch.empty(params.numel() + shift, dtype=BF16)[shift:]
        array = (native.Task * 1)(native.pack_task(params, out))
        kernel.run(
            array, native.hyper_array([]), torch.zeros(1), (2, 2), 1, None, vectorized, stream
        )
        n = values.numel()
        assert torch.equal(_bits(out[:n]), _bits(values.to(BF16)))
        assert torch.isnan(out[n:]).all()


def _stepper(sizes, chunk, compute, gen, kernel, moments):
    """A mirror of ``sizes`` parameters (64-element aligned starts, padding between) with
    two families, stepped by a ChunkedAdamW over fp32 gradients."""
    starts, pos = [], 0
    for n in sizes:
        starts.append(pos)
        pos += -(-n // 64) * 64 + 64
    host = torch.randn(pos, generator=gen)
    grads = torch.zeros(pos)
    params = [host[s : s + n] for s, n in zip(starts, sizes, strict=True)]
    groups = [
        {"params": params[0::2], "weight_decay": 0.1},
        {"params": params[1::2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    entries = [
        HostParam(p, Span(s, s + p.numel()), opt, i % 2)
        for i, (p, s) in enumerate(zip(params, starts, strict=True))
    ]
    runs = chunk_spans([Span(0, pos)], chunk, [e.local for e in entries])
    stepper = ChunkedAdamW(
        host, grads, entries, [r for _, r in runs], compute, moments, kernel=kernel
    )
    return host, grads, stepper


@needs_cc
@pytest.mark.parametrize("isa", [2, 1, 0], ids=native.ISAS)
@pytest.mark.parametrize("moments", ["fp32", "bf16"])
@pytest.mark.parametrize("chunk,compute", [(10**9, 10**9), (300, 64), (1, 1)])
def test_chunked_adamw_gives_the_same_bits_with_either_kernel(
    chunk, compute, moments, isa, monkeypatch
):
    """ChunkedAdamW over one mirror, the compiled kernel (each vector path) and torch's
    ops, five steps with an lr schedule, two families, padding between parameters:
    parameters, moments and step counters equal bit for bit (bf16 moments rounded the same
    way)."""
    loaded = native.kernel()
    assert loaded is not None, native.describe()
    if isa > loaded.vectorized:
        pytest.skip(f"this CPU has no {native.ISAS[isa]} path")
    monkeypatch.setattr(loaded, "vectorized", isa)
    dtypes = (BF16, BF16) if moments == "bf16" else (torch.float32, torch.float32)
    sizes = [700, 64, 1, 333, 17, 4096]
    runs = {}
    for kernel in ("native", "torch"):
        gen = torch.Generator().manual_seed(4)
        host, grads, stepper = _stepper(sizes, chunk, compute, gen, kernel, dtypes)
        for t in range(5):
            grads.copy_(torch.randn(grads.numel(), generator=gen) * 10.0 ** (t - 2))
            for g in stepper.entries[0].optimizer.param_groups:
                g["lr"] = 1e-2 * (t + 1)
            stepper.begin()
            for c in range(len(stepper.chunks)):
                stepper.update(c)
            stepper.finish()
        assert stepper.uses_native is (kernel == "native")
        runs[kernel] = (host, stepper.exp_avg, stepper.exp_avg_sq, stepper.steps)
    for a, b in zip(runs["native"], runs["torch"], strict=True):
        assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


@needs_cc
def test_a_probe_that_finds_no_match_falls_back_to_torchs_ops_with_one_warning(
    fresh_native, monkeypatch
):
    """If no candidate reproduces torch's kernel here (a torch built otherwise), the
    chunked step runs on torch's ops, one warning says why; kernel='native' refuses."""
    chosen = native.probe(native.HostAdamW(native._native.build_library(
        native.SOURCE, "host_adamw", native.FLAGS, native.LIBS
    )))  # fmt: skip
    assert chosen is not None
    monkeypatch.setattr(
        native, "VARIANTS", tuple(v for v in native.VARIANTS if v != chosen.variant)
    )
    with pytest.warns(native.HostAdamWWarning, match="does not reproduce torch's fused AdamW"):
        assert native.kernel() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        assert native.kernel() is None
    gen = torch.Generator().manual_seed(4)
    _, grads, stepper = _stepper([100, 33], 64, 64, gen, "auto", (torch.float32,) * 2)
    grads.normal_(generator=gen)
    stepper.begin()
    assert stepper.uses_native is False
    _, _, refusing = _stepper([100, 33], 64, 64, gen, "native", (torch.float32,) * 2)
    with pytest.raises(RuntimeError, match="kernel='native'.*not available.*kernel='auto'"):
        refusing.begin()


def test_without_a_compiler_the_chunked_step_runs_on_torchs_ops(fresh_native, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.warns(native.HostAdamWWarning, match="no-such-compiler-here.*not on PATH"):
        assert native.kernel() is None
    assert "torch's ops" in native.describe()
    gen = torch.Generator().manual_seed(4)
    _, grads, stepper = _stepper([100, 33], 64, 64, gen, "auto", (torch.float32,) * 2)
    grads.normal_(generator=gen)
    stepper.begin()
    for c in range(len(stepper.chunks)):
        stepper.update(c)
    stepper.finish()
    assert stepper.uses_native is False and stepper.updated > 0


def test_off_builds_nothing_and_warns_nothing(fresh_native, monkeypatch):
    monkeypatch.setenv("BUFFERS_CPU_KERNEL", "off")
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.kernel() is None
    assert "BUFFERS_CPU_KERNEL=off" in native.describe()
    assert not fresh_native.exists() or not any(fresh_native.iterdir())


def test_an_unknown_kernel_choice_is_refused():
    with pytest.raises(ValueError, match="kernel='fast'; expected one of"):
        ChunkedAdamW(torch.zeros(4), torch.zeros(4), [], [], kernel="fast")


@needs_cc
def test_built_into_the_shared_cache_once(fresh_native):
    first = native.kernel()
    assert first is not None and first.path.parent == fresh_native
    names = sorted(p.name for p in fresh_native.iterdir())
    assert names == [first.path.name]  # no temporary left, its own name beside the norm's
    assert first.path.name.startswith("host_adamw-")
    assert buffers_native.cache_dir() == fresh_native


def _in_forked_child(queue) -> None:
    torch.set_num_threads(1)  # torch's own OpenMP threads cannot be used after a fork
    k = native.kernel()
    gen = torch.Generator().manual_seed(10)
    case = _case(gen, [5000, 77])
    want = _torch_step(case, HYPERS["adamw"], [2, 2])
    got = _kernel_step(k, case, HYPERS["adamw"], [2, 2], threads=3, task_numel=256)
    queue.put(
        all(
            torch.equal(_bits(a), _bits(b))
            for (p, m, v, _), w in zip(got, want, strict=True)
            for a, b in zip((p, m, v), w, strict=True)
        )
    )


@needs_cc
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_runs_the_kernel_with_threads_of_its_own(kernel):
    """The parent's worker threads do not exist in a child made by fork(): the child
    starts its own (or works alone) and neither hangs nor computes otherwise."""
    import multiprocessing as mp

    gen = torch.Generator().manual_seed(10)
    _kernel_step(kernel, _case(gen, [5000]), HYPERS["adamw"], [1], threads=3, task_numel=256)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_in_forked_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    assert queue.get(timeout=5) is True


def _tasks(param, grad, out, sizes):
    """One task per run of ``sizes`` elements, laid end to end (no tail formula)."""
    tasks, a = [], 0
    for n in sizes:
        b = a + n
        m1, m2 = torch.zeros(n), torch.zeros(n)
        tasks += native.tasks_for(param[a:b], grad[a:b], m1, m2, out[a:b], 0, 0, n, n)
        a = b
    return tasks


def _round_of(rounds, tasks):
    where = {t.param: r for r, round_ in enumerate(rounds) for t in round_}
    return [where[t.param] for t in tasks]


def test_rounds_keep_packed_parameters_off_gradients_not_yet_read():
    """fp32 gradients and bf16 outputs in the same bytes: elements [a, b) pack over the
    gradients of [a/2, b/2), so a task must wait for the tasks owning those (and only
    them); bf16 gradients packed in place, or outputs elsewhere, need one round."""
    staging = torch.zeros(64 * 4, dtype=torch.uint8)
    param = torch.zeros(64)
    grad, out = staging.view(torch.float32), staging.view(torch.bfloat16)
    # element ranges [0,8) [8,16) [16,32) [32,40) [40,64): packs over grads of
    # [0,4) [4,8) [8,16) [16,20) [20,32)
    tasks = _tasks(param, grad, out, [8, 8, 16, 8, 24])
    rounds = native.rounds(tasks)
    assert _round_of(rounds, tasks) == [0, 1, 2, 3, 3]
    in_place = staging[: 64 * 2].view(torch.bfloat16)
    tasks = _tasks(param, in_place, in_place, [8, 8, 16, 8, 24])
    assert _round_of(native.rounds(tasks), tasks) == [0] * 5
    tasks = _tasks(param, grad, torch.zeros(64, dtype=torch.bfloat16), [8, 8, 16, 8, 24])
    assert _round_of(native.rounds(tasks), tasks) == [0] * 5
    # a pack-only task (a gap between parameters) waits too: [40,64) over [20,32)'s
    gaps = [native.pack_task(param[40:64], out[40:64])]
    grad_tasks = _tasks(param, grad, out, [8, 8, 16, 8])
    both = grad_tasks + gaps
    assert _round_of(native.rounds(both), both) == [0, 1, 2, 3, 3]


def test_rounds_refuse_what_no_order_makes_safe():
    staging = torch.zeros(64 * 4, dtype=torch.uint8)
    param = torch.zeros(64)
    grad, out = staging.view(torch.float32), staging.view(torch.bfloat16)
    forward = _tasks(param, grad, out, [16, 16])
    assert native.rounds(forward) is not None
    # the later task listed first: it would pack over gradients of one listed after it
    assert native.rounds(forward[::-1]) is None
    # a task packing ahead of its own reads: bf16 out over bf16 grads one element on
    ahead = native.tasks_for(param[:8], out[:8], torch.zeros(8), torch.zeros(8), out[1:9], 0, 0, 8)
    assert native.rounds(ahead) is None
    # wider output than gradient over the same bytes: fp32 out over bf16 grads
    wide = native.tasks_for(param[:8], out[:8], torch.zeros(8), torch.zeros(8), grad[:8], 0, 0, 8)
    assert native.rounds(wide) is None


def test_rounds_find_every_read_a_task_packs_over_when_reads_overlap():
    """Reads that overlap (one task's gradients inside another's) leave the ends of the
    sorted reads out of order: the search must still find the long read that a pack lands
    on beyond the short one."""
    staging = torch.zeros(64 * 4, dtype=torch.uint8)
    param = torch.zeros(64)
    grad, out = staging.view(torch.float32), staging.view(torch.bfloat16)
    m = [torch.zeros(64) for _ in range(2)]
    # A reads fp32 elements [0, 64) (bytes 0-256), B reads [4, 8) (bytes 16-32)
    a = native.tasks_for(param[:64], grad[:64], m[0], m[1], None, 0, 0, 64)
    b = native.tasks_for(param[:4], grad[4:8], m[0][:4], m[1][:4], None, 0, 0, 4)
    # C packs into bf16 elements [20, 24): bytes 40-48, inside A's read only
    c = [native.pack_task(param[20:24], out[20:24])]
    tasks = a + b + c
    assert _round_of(native.rounds(tasks), tasks) == [0, 0, 1]


def _pool_cpus() -> list[set[int]]:
    """The CPUs each of the kernel's pool threads ("adamw-host") may run on, as the
    kernel's own /proc says."""
    import os

    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "adamw-host":
                    continue
            out.append(os.sched_getaffinity(int(tid)))
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            continue
    return out


def _run_pinned(kernel, cpus: set[int] | None) -> None:
    """A kernel call with helpers, from a new thread on ``cpus`` (None: unpinned)."""
    import os
    import threading

    errors = []

    def body():
        try:
            if cpus is not None:
                os.sched_setaffinity(0, cpus)  # this thread only (Linux)
            gen = torch.Generator().manual_seed(11)
            _kernel_step(kernel, _case(gen, [9000]), HYPERS["adamw"], [1], 4, task_numel=256)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            errors.append(e)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert not errors, errors


def _settle(want: set[int]) -> list[set[int]]:
    """The pool threads' CPUs once each has woken (a helper whose job ended before it woke
    applies the caller's CPUs on waking), within 5 s."""
    import time

    deadline = time.monotonic() + 5
    while True:
        cpus = _pool_cpus()
        if all(c == want for c in cpus) or time.monotonic() > deadline:
            return cpus
        time.sleep(0.01)


@needs_cc
@pytest.mark.skipif(
    not hasattr(__import__("os"), "sched_setaffinity")
    or len(__import__("os").sched_getaffinity(0)) < 2,
    reason="needs Linux's per-thread CPU affinity and two usable CPUs",
)
def test_the_pool_threads_run_where_the_calling_thread_may(kernel):
    """Helpers created by an unpinned thread follow a caller pinned to one CPU, then one
    pinned to another, then an unpinned one again: the delayed update's worker keeps its
    helpers off the core it leaves to the thread that launches the GPU's work."""
    import os

    every = os.sched_getaffinity(0)
    first, second = sorted(every)[:2]
    _run_pinned(kernel, None)  # the pool exists, created where every CPU is allowed
    assert _pool_cpus(), "no pool thread named adamw-host"
    assert _settle(every) and all(c == every for c in _pool_cpus())
    _run_pinned(kernel, {second})
    assert _settle({second}) == [{second}] * len(_pool_cpus())
    _run_pinned(kernel, {first})
    assert _settle({first}) == [{first}] * len(_pool_cpus())
    _run_pinned(kernel, None)
    assert _settle(every) == [every] * len(_pool_cpus())


def test_the_vector_path_can_be_narrowed_and_a_bad_name_is_refused(monkeypatch):
    monkeypatch.delenv("BUFFERS_HOST_ADAMW_ISA", raising=False)
    assert native.isa_cap() == 2
    for name, level in (("AVX2", 1), ("portable", 0), (" avx512 ", 2), ("", 2)):
        monkeypatch.setenv("BUFFERS_HOST_ADAMW_ISA", name)
        assert native.isa_cap() == level
    monkeypatch.setenv("BUFFERS_HOST_ADAMW_ISA", "sse")
    with pytest.raises(ValueError, match="BUFFERS_HOST_ADAMW_ISA='sse'; expected one of"):
        native.isa_cap()
    monkeypatch.delenv("BUFFERS_HOST_ADAMW_STREAM", raising=False)
    assert native.streaming() is True
    for value, want in (("0", False), ("1", True), (" ", True)):
        monkeypatch.setenv("BUFFERS_HOST_ADAMW_STREAM", value)
        assert native.streaming() is want
    monkeypatch.setenv("BUFFERS_HOST_ADAMW_STREAM", "yes")
    with pytest.raises(ValueError, match="BUFFERS_HOST_ADAMW_STREAM='yes'; expected 1"):
        native.streaming()


@needs_cc
def test_a_narrowed_kernel_runs_the_narrower_path_and_says_so(kernel, monkeypatch):
    """The cap applies when the kernel loads; describe() names the path that runs."""
    monkeypatch.setenv("BUFFERS_HOST_ADAMW_ISA", "avx2")
    monkeypatch.setenv("BUFFERS_HOST_ADAMW_STREAM", "0")
    narrowed = native.HostAdamW(kernel.path)
    assert narrowed.vectorized == min(kernel.vectorized, 1) and narrowed.stream is False
    assert native.ISAS[kernel.build.vectorized] in native.describe()
