"""buffers.ops: the torch backend's sums against fp64, argument checks, the stat's dtype."""

import math
import warnings

import pytest
import torch
import torch.distributed as dist

from buffers import native, ops

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def cpu_path(request, monkeypatch):
    """Every test here on both CPU paths: the compiled kernel (buffers.native: p = 1, 2 over
    bf16/fp16/fp32) and torch's ops in pieces (everything else, and all of it when the
    kernel is off)."""
    if request.param == "torch":
        monkeypatch.setenv("BUFFERS_CPU_KERNEL", "off")
    else:
        monkeypatch.delenv("BUFFERS_CPU_KERNEL", raising=False)
        if native.kernel() is None:
            pytest.skip(f"the CPU kernel is not available here: {native.describe()}")
    return request.param


def random_views(n_views: int, max_len: int, dtype: torch.dtype, seed: int):
    """Disjoint 1-D slices of one random buffer, as a flat buffer's spans are."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len, (n_views,), generator=gen).tolist()
    buf = torch.randn(sum(lengths) + 3 * n_views, generator=gen).to(dtype)
    views, at = [], 0
    for n in lengths:
        at += 3  # gaps between spans, as between a buffer's counted spans
        views.append(buf[at : at + n])
        at += n
    return views


def fp64_power_sum(views, p: float) -> float:
    flat = torch.cat([v.double().reshape(-1) for v in views])
    if p == math.inf:
        return flat.abs().max().item()
    return flat.abs().pow(p).sum().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("seed", [0, 1])
def test_power_sum_across_chunk_edges_vs_fp64(monkeypatch, dtype, p, seed):
    # Small chunks, so spans start and end at every position relative to a chunk edge.
    monkeypatch.setitem(ops._CHUNK, "cpu", 97)
    views = random_views(12, 700, dtype, seed)
    got = ops.TorchBackend().power_sum(views, p)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert got.item() == pytest.approx(fp64_power_sum(views, p), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("p", [2.0, 1.0])
def test_power_sum_of_millions_of_elements_stays_within_1e6(dtype, p):
    # fp32 accumulation in one long run (vector_norm's) is off by ~1e-4 at this length.
    gen = torch.Generator().manual_seed(11)
    views = [torch.randn(3_000_000, generator=gen).to(dtype), torch.randn(5, generator=gen)]
    views[1] = views[1].to(dtype)
    got = ops.TorchBackend().power_sum(views, p).item()
    assert got == pytest.approx(fp64_power_sum(views, p), rel=1e-6)


def test_power_sum_of_empty_views_is_zero():
    empty = torch.zeros(0, dtype=torch.bfloat16)
    assert ops.TorchBackend().power_sum([empty, empty], 2.0).item() == 0.0


def test_power_sum_propagates_nan_and_inf():
    be = ops.TorchBackend()
    for bad, want in ((math.nan, math.isnan), (math.inf, math.isinf)):
        t = torch.randn(5000, dtype=torch.bfloat16)
        t[4321] = bad
        for p in (2.0, 1.0, math.inf):
            assert want(be.power_sum([t[:10], t[10:]], p).item()), (bad, p)


def test_local_power_stat_keeps_fp64_when_a_group_is_fp64():
    gen = torch.Generator().manual_seed(3)
    big = (torch.randn(100, generator=gen, dtype=torch.float64) * 1e100).abs() + 1e100
    small = torch.randn(50, generator=gen).bfloat16()
    stat = ops.local_power_stat([[small], [big], []], 2.0, torch.device("cpu"))
    assert stat.dtype == torch.float64
    want = big.square().sum() + small.double().square().sum()
    assert stat.item() == pytest.approx(want.item(), rel=1e-12)
    fp32_only = ops.local_power_stat([[small], []], 2.0, torch.device("cpu"))
    assert fp32_only.dtype == torch.float32


def test_scale_skips_the_pass_when_the_coefficient_is_one():
    t = torch.randn(1000, dtype=torch.bfloat16)
    t[7] = math.nan
    before = t.view(torch.int16).clone()
    ops.TorchBackend().scale_([t], torch.tensor(1.0))
    assert torch.equal(t.view(torch.int16), before)  # bit for bit, NaN payloads too
    ops.TorchBackend().scale_([t], torch.tensor(0.5))
    assert torch.equal(t[:7].double(), before.view(torch.bfloat16)[:7].double() * 0.5)


@pytest.mark.parametrize("good", [0.0, 0, 1e-30, 5, math.inf, torch.tensor(2.5)])
def test_check_max_norm_accepts(good):
    assert ops.check_max_norm(good) == float(good)


@pytest.mark.parametrize("bad", [-1.0, -1e-30, math.nan, -math.inf, torch.tensor(-2.0)])
def test_check_max_norm_refuses_negative_and_nan(bad):
    with pytest.raises(ValueError, match="max_norm must be a number >= 0"):
        ops.check_max_norm(bad)


@pytest.fixture
def one_rank_gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("p", [2.0, math.inf])
def test_all_reduce_stat_keeps_each_stats_dtype(one_rank_gloo, p):
    for dtype, value in ((torch.float64, 1e300), (torch.float32, 3.0)):
        got = ops.all_reduce_stat(torch.tensor(value, dtype=dtype), p, one_rank_gloo)
        assert got.dtype == dtype and got.item() == value


# --- the CPU path: cache-sized pieces on one thread, fp32 accuracy -----------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("p", [2.0, 1.0])
def test_cpu_power_sum_of_few_long_and_many_short_views_within_2e7_of_fp64(dtype, p):
    # Values drawn in fp32 (most of which bf16/fp16 cannot hold exactly; the tensors store
    # their rounded values, which the fp64 reference reads), spread over six decades.
    gen = torch.Generator().manual_seed(23)
    lengths = [1_500_000, 700_001, *torch.randint(1, 300, (2000,), generator=gen).tolist()]
    views = [
        (torch.randn(n, generator=gen) * 10.0 ** torch.randint(-3, 3, (n,), generator=gen)).to(
            dtype
        )
        for n in lengths
    ]
    got = ops.TorchBackend().power_sum(views, p)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(fp64_power_sum(views, p), rel=2e-7)


def test_cpu_power_sum_same_at_any_thread_count_and_restores_it():
    gen = torch.Generator().manual_seed(5)
    views = [torch.randn(1_200_000, generator=gen).bfloat16(), torch.randn(77, generator=gen)]
    views[1] = views[1].bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = ops.TorchBackend().power_sum(views, 2.0)
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        one = ops.TorchBackend().power_sum(views, 2.0)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # one thread either way: the same bits
    assert one.item() == pytest.approx(fp64_power_sum(views, 2.0), rel=2e-7)


def test_single_thread_restores_the_thread_count_after_an_error():
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("single_thread() changes the thread count only with OpenMP")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(RuntimeError, match="boom"), ops.single_thread():
            assert torch.get_num_threads() == 1
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_cpu_scale_reaches_non_contiguous_and_sliced_tensors(monkeypatch):
    monkeypatch.setitem(ops._CHUNK, "cpu", 97)  # long tensors are cut into pieces
    gen = torch.Generator().manual_seed(9)
    tensors = [
        torch.randn(40, 30, generator=gen).t(),  # non-contiguous: scaled whole, in place
        torch.randn(1000, generator=gen).bfloat16(),
        *(torch.randn(n, generator=gen) for n in (1, 5, 64)),
    ]
    want = [t.double() * 0.25 for t in tensors]
    ops.TorchBackend().scale_(tensors, torch.tensor(0.25))
    for got, w in zip(tensors, want, strict=True):
        assert torch.equal(got.double(), w)  # x * 0.25 is exact in every dtype here


def test_run_pieces_keeps_order_raises_a_tasks_error_and_works_after_fork():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert ops.run_pieces([lambda i=i: i * i for i in range(50)]) == [i * i for i in range(50)]

        def bad() -> None:
            raise ValueError("task 7")

        tasks = [lambda: None] * 7 + [bad] + [lambda: None] * 7
        with pytest.raises(ValueError, match="task 7"):
            ops.run_pieces(tasks)
        # A forked child has none of the parent's helper threads: it must not wait for them.
        ctx = __import__("multiprocessing").get_context("fork")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: on purpose
            with ctx.Pool(1) as pool:
                got = pool.apply_async(_norm_at_two_threads).get(timeout=60)
        views = [torch.arange(1, 2_000_001, dtype=torch.float32) / 1e6]
        assert got == ops.TorchBackend().power_sum(views, 2.0).item()
    finally:
        torch.set_num_threads(before)


def _norm_at_two_threads() -> float:
    # torch's own multi-threaded ops can hang in a child forked after OpenMP ran (GNU
    # OpenMP): the input is made at one thread; run_pieces' ops all run on one thread.
    torch.set_num_threads(1)
    views = [torch.arange(1, 2_000_001, dtype=torch.float32) / 1e6]
    torch.set_num_threads(2)
    return ops.TorchBackend().power_sum(views, 2.0).item()
