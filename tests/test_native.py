"""buffers.native: the CPU norm's compiled kernel against fp64, both of its paths, and how it
is built, cached, refused and replaced by torch's ops."""

import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from buffers import FlatGradBuffers, native, ops

KERNEL_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
HAS_CC = shutil.which(os.environ.get("CC") or "cc") is not None
needs_cc = pytest.mark.skipif(not HAS_CC, reason="no C compiler: the kernel cannot be built")


@pytest.fixture
def kernel():
    k = native.kernel()
    assert k is not None, native.describe()
    return k


def paths(k):
    return [False, True] if k.vectorized else [False]


def every_pattern(dtype):
    """All 65536 16-bit patterns as ``dtype`` (NaNs, infinities, subnormals, -0 included)."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


@needs_cc
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [1.0, 2.0])
def test_every_16_bit_pattern_is_widened_exactly_on_both_paths(kernel, dtype, p):
    # Each pattern alone in a piece of 16 (at a lane that moves with the pattern, so every
    # lane of a vector load is read), the other 15 zero: a piece's sum is |x| or x^2, exact
    # in fp64. A wrong widening of any one pattern shows up as that piece.
    x = every_pattern(dtype)
    n = x.numel()
    spread = torch.zeros(n * 16, dtype=dtype)
    spread[torch.arange(n) * 16 + torch.arange(n) % 16] = x
    want = x.double().abs() if p == 1.0 else x.double().square()
    for vec in paths(kernel):
        got = kernel.piece_sums([spread], p, 16, vectorized=vec)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=f"vec={vec}")


def random_views(dtype, seed, lengths=None):
    gen = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = [0, 1, 15, 16, 17, 0, 1000, 33, 4097, 5, 0, 70_001]
    buf = torch.randn(sum(lengths) + 5 * len(lengths), generator=gen)
    buf = (buf * 10.0 ** torch.randint(-4, 4, buf.shape, generator=gen)).to(dtype)
    views, at = [], 0
    for n in lengths:
        at += 5  # gaps, as between a buffer's spans
        views.append(buf[at : at + n])
        at += n
    return views


def fp64_piece_sums(views, p, piece):
    flat = torch.cat([v.double() for v in views])
    terms = flat.abs() if p == 1.0 else flat.square()
    pad = (-terms.numel()) % piece
    return torch.cat([terms, terms.new_zeros(pad)]).view(-1, piece).sum(1)


@needs_cc
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("p", [1.0, 2.0])
@pytest.mark.parametrize("piece", [1, 7, 16, 100, 4099, 1 << 18])
def test_pieces_cross_view_edges_and_match_fp64_on_both_paths(kernel, dtype, p, piece):
    views = random_views(dtype, seed=piece)
    want = fp64_piece_sums(views, p, piece)
    for vec in paths(kernel):
        got = kernel.piece_sums(views, p, piece, vectorized=vec)
        torch.testing.assert_close(got, want, rtol=1e-13, atol=0, msg=f"vec={vec}")


@needs_cc
def test_nan_and_inf_reach_the_sum_on_both_paths(kernel):
    for dtype in KERNEL_DTYPES:
        for bad, check in ((math.nan, math.isnan), (math.inf, math.isinf), (-math.inf, math.isinf)):
            t = torch.randn(5003).to(dtype)
            t[4321] = bad
            for vec in paths(kernel):
                for p in (1.0, 2.0):
                    (got,) = kernel.piece_sums([t], p, 1 << 20, vectorized=vec).tolist()
                    assert check(got), (dtype, bad, vec, p)


@needs_cc
def test_bf16_extremes_keep_fp64_range_until_the_stat_narrows():
    # 1e30 squared is 1e60: fine in fp64, inf in fp32. The kernel's sum holds it; the
    # stat, fp32 for bf16 gradients as documented in ops.local_power_stat, is inf, as
    # torch's fp32 path was before.
    t = torch.full((100,), 1e30, dtype=torch.bfloat16)
    k = native.kernel()
    (got,) = k.piece_sums([t], 2.0, 128).tolist()
    assert got == pytest.approx(100 * t[0].double().item() ** 2, rel=1e-15)
    assert math.isinf(ops.TorchBackend().power_sum([t], 2.0).item())
    tiny = torch.full((64,), 1e-30, dtype=torch.bfloat16)  # squares far below fp32's range
    assert k.piece_sums([tiny], 2.0, 64).item() == pytest.approx(64 * tiny[0].double() ** 2)


@needs_cc
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("p", [1.0, 2.0])
def test_power_sum_same_bits_at_any_thread_count_and_within_1e7_of_fp64(kernel, dtype, p):
    views = random_views(dtype, 9, [3_000_001, 0, 17, 1 << 18, 999])
    calls = []

    def run(tasks):
        calls.append(len(tasks))
        return ops.run_pieces(tasks)

    before = torch.get_num_threads()
    got = {}
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            got[threads] = kernel.power_sum(views, p, run)
    finally:
        torch.set_num_threads(before)
    assert calls[0] == 1 and calls[1] > 1  # one task at one thread; shared out at two
    assert got[1] == got[2] == got[3]
    total = sum(v.numel() for v in views)
    assert got[1] == pytest.approx(fp64_piece_sums(views, p, total).item(), rel=1e-13)


def spy_kernel(monkeypatch):
    calls = []
    real = native.CpuSums.power_sum

    def spy(self, views, p, run):
        calls.append((views[0].dtype, p))
        return real(self, views, p, run)

    monkeypatch.setattr(native.CpuSums, "power_sum", spy)
    return calls


@needs_cc
@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, 0.5])
def test_norms_use_the_kernel_for_p_1_and_2_only_and_match_fp64(monkeypatch, fresh_native, p):
    calls = spy_kernel(monkeypatch)
    gen = torch.Generator().manual_seed(31)
    params = [
        torch.nn.Parameter(torch.randn(n, generator=gen).to(dt))
        for n, dt in ((5000, torch.bfloat16), (301, torch.float32), (77, torch.bfloat16))
    ]
    fb = FlatGradBuffers(params)
    for q in params:
        q.grad.copy_(torch.randn(q.shape, generator=gen) * 7.3)
    want = sum(q.grad.double().abs().pow(p).sum() for q in params).item() ** (1 / p)
    assert fb.grad_norm(norm_type=p).item() == pytest.approx(want, rel=1e-6)
    used = sorted(str(dt) for dt, _ in calls)
    assert used == (["torch.bfloat16", "torch.float32"] if p in (1.0, 2.0) else []), used


@needs_cc
def test_non_contiguous_and_fp64_views_take_torchs_ops(monkeypatch, kernel):
    calls = spy_kernel(monkeypatch)
    gen = torch.Generator().manual_seed(2)
    t = torch.randn(300, 200, generator=gen).bfloat16().t()  # transposed: not contiguous
    got = ops.TorchBackend().power_sum([t], 2.0)
    assert got.item() == pytest.approx(t.double().square().sum().item(), rel=1e-6)
    d = torch.randn(1000, generator=gen, dtype=torch.float64) * 1e200
    assert ops.TorchBackend().power_sum([d], 2.0).item() == pytest.approx(
        d.square().sum().item(), rel=1e-12
    )
    assert calls == []


# --- building, caching, refusing ----------------------------------------------------------


@needs_cc
def test_built_once_then_loaded_from_the_cache_without_a_compiler(fresh_native, monkeypatch):
    first = native.kernel()
    assert first is not None and first.path.parent == fresh_native
    assert [p.name for p in fresh_native.iterdir()] == [first.path.name]  # no temporary left
    monkeypatch.setattr(native, "_LOADED", {})
    monkeypatch.setenv("CC", "cc")  # the same name as before: the same cache entry...
    monkeypatch.setenv("PATH", "")  # ...while no compiler can be found
    again = native.kernel()
    assert again is not None and again.path == first.path


def built_norm_is_right():
    gen = torch.Generator().manual_seed(4)
    q = torch.nn.Parameter(torch.randn(4000, generator=gen).bfloat16())
    fb = FlatGradBuffers([q])
    q.grad.copy_(torch.randn(4000, generator=gen) * 3)
    return fb.grad_norm().item() == pytest.approx(q.grad.double().norm().item(), rel=1e-6)


def test_without_a_compiler_one_warning_and_torchs_ops(fresh_native, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.warns(native.NativeKernelWarning, match="no-such-compiler-here.*not on PATH"):
        assert native.kernel() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second time: no warning
        assert native.kernel() is None
        assert built_norm_is_right()
    assert "no compiled kernel" in native.describe()
    assert not fresh_native.exists() or not any(fresh_native.iterdir())


def test_a_failing_compiler_is_named_with_its_exit_code(fresh_native, monkeypatch):
    monkeypatch.setenv("CC", "false")
    with pytest.warns(native.NativeKernelWarning, match="false failed with exit code 1"):
        assert native.kernel() is None
    assert not fresh_native.exists() or not any(fresh_native.iterdir())  # no partial file left


def test_off_builds_nothing_and_warns_nothing(fresh_native, monkeypatch):
    monkeypatch.setenv("BUFFERS_CPU_KERNEL", "off")
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.kernel() is None
        assert built_norm_is_right()
    assert not fresh_native.exists()
    assert native.describe() == "torch's ops (BUFFERS_CPU_KERNEL=off)"


def test_an_unknown_setting_is_refused_by_name(fresh_native, monkeypatch):
    monkeypatch.setenv("BUFFERS_CPU_KERNEL", "fast")
    with pytest.raises(ValueError, match=r"BUFFERS_CPU_KERNEL='fast'; expected one of"):
        native.kernel()


@needs_cc
def test_an_unusable_cache_folder_builds_in_a_temporary_one(fresh_native, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("BUFFERS_CACHE_DIR", str(blocker / "cache"))  # cannot be created
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        k = native.kernel()
    assert k is not None and blocker not in k.path.parents
    assert built_norm_is_right()


@needs_cc
def test_processes_building_at_once_all_load_it(tmp_path):
    # Each compiles to its own temporary name and renames it into place: none ever loads a
    # half-written file, whichever finishes first.
    env = {**os.environ, "BUFFERS_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("BUFFERS_CPU_KERNEL", None)
    code = "from buffers import native; k = native.kernel(); print(k.path if k else 'none')"
    root = Path(__file__).resolve().parents[1]
    procs = [
        subprocess.Popen(
            [sys.executable, "-W", "error::UserWarning", "-c", code],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [proc.communicate(timeout=120) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), outs
    assert len({out.strip() for out, _ in outs}) == 1
    assert [p.suffix for p in (tmp_path / "cache").iterdir()] == [".so"]


@pytest.mark.parametrize(
    "value, means", [("0", "off"), ("1", "auto"), ("off", "off"), ("auto", "auto")]
)
def test_zero_and_one_as_the_other_switches_take_them(fresh_native, monkeypatch, value, means):
    # BUFFERS_CUDA_GRAPHS and BUFFERS_GRAPH_COLLECTIVES take 0/1; the old words still work
    monkeypatch.setenv("BUFFERS_CPU_KERNEL", value)
    assert native.choice() == means
    if means == "off":
        assert native.describe() == "torch's ops (BUFFERS_CPU_KERNEL=off)"
