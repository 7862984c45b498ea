"""Per-parameter gradient norms (grad_norm(per_param=True)) against fp64 references.

Every expectation is computed from the raw gradients in fp64 (torch.linalg.vector_norm of
the values copied in), never from the code under test.
"""

import math
import os
import textwrap

import pytest
import torch
import torch.distributed as dist

from buffers import FlatGradBuffers
from buffers.param_norms import GroupIndex, LazyNorms, ParamNorms
from buffers.segments import BLOCK, build_segment_table, torch_segment_stats_
from tests.support.spawn import spawn
from tests.support.triton_interpreter import run_interpreted

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
NORM_TYPES = [2.0, 1.0, 3.0, math.inf]

# Odd sizes, a parameter longer than the CPU chunk, an empty one, some that are smaller than
# one block and some that straddle several blocks; all four dtypes, interleaved.
INVENTORY = [
    ("embed.weight", (3, 1001), BF16),
    ("layers.0.norm.weight", (65,), FP32),
    ("layers.0.attn.qkv", (129, 33), BF16),
    ("layers.0.router", (7,), FP64),
    ("layers.0.mlp.fc1", (1, 1), BF16),
    ("layers.1.norm.weight", (2 * BLOCK + 1,), FP32),
    ("layers.1.attn.qkv", (0,), BF16),
    ("layers.1.mlp.fc1", (1_100_003,), FP32),
    ("layers.1.sink", (5,), FP16),
    ("head.weight", (BLOCK - 3,), FP64),
]


def uncounted(name: str) -> bool:
    return name.endswith("norm.weight") or name == "head.weight"


def build(device, align=64, inventory=INVENTORY, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [
        (n, torch.nn.Parameter(torch.zeros(shape, dtype=dt, device=device)))
        for n, shape, dt in inventory
    ]
    names_of = {id(p): n for n, p in params}
    fgb = FlatGradBuffers(params, align=align, counted=lambda p: not uncounted(names_of[id(p)]))
    grads = {}
    for n, p in params:
        g = (torch.randn(p.shape, generator=gen, dtype=FP64) * 3).to(p.dtype)
        fgb.view(p).copy_(g.to(device))
        grads[n] = g
    return fgb, params, grads


def ref_norm(tensors, p):
    flat = torch.cat([t.double().flatten() for t in tensors] or [torch.zeros(0, dtype=FP64)])
    if flat.numel() == 0:
        return 0.0  # the norm of no elements (vector_norm refuses inf on empty tensors)
    return torch.linalg.vector_norm(flat, p).item()


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-300)


@pytest.mark.parametrize("align", [1, 7, 64])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_every_norm_within_1e6_of_fp64(device, align, norm_type):
    fgb, params, grads = build(device, align, seed=align * 10 + NORM_TYPES.index(norm_type))
    res = fgb.grad_norm(norm_type, per_param=True)
    assert isinstance(res, ParamNorms)
    assert res.names == tuple(n for n, _ in params)
    assert res.norms.device.type == device.type and res.total.device.type == device.type
    assert res.norms.dtype == FP64  # an fp64 buffer is here
    got = res.norms.tolist()
    for (name, _), value in zip(params, got, strict=True):
        want = ref_norm([grads[name]], norm_type)
        assert rel(value, want) <= 1e-6, (name, value, want)
    assert res.counted == tuple(not uncounted(n) for n, _ in params)
    counted_grads = [grads[n] for n, _ in params if not uncounted(n)]
    want_total = ref_norm(counted_grads, norm_type)
    assert rel(res.total.item(), want_total) <= 1e-6
    # The total is the p-norm of the counted per-parameter norms, uncounted ones left out.
    counted = torch.tensor([v for v, c in zip(got, res.counted, strict=True) if c], dtype=FP64)
    assert rel(torch.linalg.vector_norm(counted, norm_type).item(), want_total) <= 1e-6
    # ... and what grad_norm returns, in the same dtype.
    plain = fgb.grad_norm(norm_type)
    assert res.total.dtype == plain.dtype
    assert rel(res.total.item(), plain.item()) <= 1e-6


def test_fresh_values_every_call_and_fp32_without_fp64(device):
    inventory = [(n, s, BF16 if dt == FP64 else dt) for n, s, dt in INVENTORY]
    fgb, params, grads = build(device, inventory=inventory, seed=5)
    gen = torch.Generator().manual_seed(6)
    for _ in range(4):  # on CUDA the third and later calls replay a graph
        res = fgb.grad_norm(per_param=True)
        assert res.norms.dtype == FP32 and res.total.dtype == FP32
        for (name, _), value in zip(params, res.norms.tolist(), strict=True):
            assert rel(value, ref_norm([grads[name]], 2.0)) <= 1e-6, name
        for name, p in params:
            grads[name] = torch.randn(p.shape, generator=gen).to(p.dtype)
            fgb.view(p).copy_(grads[name].to(device))


def test_nan_reaches_its_parameter_and_the_total_only_if_counted(device):
    fgb, params, _ = build(device, seed=2)
    by_name = dict(params)
    fgb.view(by_name["layers.1.norm.weight"])[BLOCK] = math.nan  # uncounted
    for p in (2.0, math.inf):
        res = fgb.grad_norm(p, per_param=True)
        norms = res.as_dict()
        assert math.isnan(norms["layers.1.norm.weight"])
        assert all(math.isfinite(v) for n, v in norms.items() if n != "layers.1.norm.weight")
        assert math.isfinite(res.total.item())
    fgb.view(by_name["layers.0.attn.qkv"])[3, 4] = math.nan  # counted
    for p in (2.0, math.inf):
        res = fgb.grad_norm(p, per_param=True)
        assert math.isnan(res.as_dict()["layers.0.attn.qkv"])
        assert math.isnan(res.total.item())


def test_clip_returns_pre_clip_per_param_norms(device):
    fgb, params, grads = build(device, seed=3)
    counted = [grads[n] for n, _ in params if not uncounted(n)]
    total = ref_norm(counted, 2.0)
    res = fgb.clip_grad_norm_(1.0, per_param=True)
    assert rel(res.total.item(), total) <= 1e-6
    assert rel(res.as_dict()["embed.weight"], ref_norm([grads["embed.weight"]], 2.0)) <= 1e-6
    coeff = 1.0 / (total + 1e-6)
    for name, p in params:
        if p.numel():
            tol = {BF16: 2**-7, FP16: 2**-10}.get(p.dtype, 1e-6)
            want = grads[name].double() * coeff
            torch.testing.assert_close(fgb.view(p).double().cpu(), want, rtol=tol, atol=1e-12)
    with pytest.raises(RuntimeError, match="non-finite"):
        fgb.view(params[0][1])[0, 0] = math.inf
        fgb.clip_grad_norm_(1.0, per_param=True, error_if_nonfinite=True)


def test_no_parameters(device):
    fgb = FlatGradBuffers([], device=device)
    for p in (2.0, math.inf):
        res = fgb.grad_norm(p, per_param=True)
        assert res.names == () and res.norms.numel() == 0 and res.total.item() == 0.0


def test_group_aggregation_on_device(device):
    fgb, params, grads = build(device, seed=4)
    res = fgb.grad_norm(per_param=True)
    layers = GroupIndex(res.names, r"^layers\.(\d+)\.", unmatched=None)
    assert layers.groups == ("0", "1")
    kinds = GroupIndex(res.names, lambda n: "attn" if ".attn." in n else None)
    for p in NORM_TYPES:
        res = fgb.grad_norm(p, per_param=True)
        by_layer = res.by_group(layers)
        assert isinstance(by_layer, LazyNorms) and by_layer.tensor.device.type == device.type
        for layer in ("0", "1"):
            members = [grads[n] for n in grads if n.startswith(f"layers.{layer}.")]
            assert rel(by_layer[layer], ref_norm(members, p)) <= 1e-6, (p, layer)
        attn = [grads[n] for n in grads if ".attn." in n]
        assert rel(res.by_group(kinds)["attn"], ref_norm(attn, p)) <= 1e-6
    with pytest.raises(ValueError, match="other parameter names"):
        res.by_group(GroupIndex(res.names[1:], r"layers", unmatched=None))


class CountingStandIn:
    """A CUDA-free stand-in for a device tensor: counts copies to the host."""

    def __init__(self, values):
        self.values = values
        self.copies = 0
        self.device = "stand-in"

    def tolist(self):
        self.copies += 1
        return list(self.values)


def test_lazy_view_copies_once_and_only_when_read():
    t = CountingStandIn([1.0, 2.0, 3.0])
    view = LazyNorms(("a", "b", "c"), t)
    assert list(view) == ["a", "b", "c"] and len(view) == 3 and "b" in view
    assert "not copied" in repr(view)
    assert t.copies == 0 and not view.copied
    assert view["b"] == 2.0 and view["c"] == 3.0 and dict(view) == {"a": 1.0, "b": 2.0, "c": 3.0}
    assert t.copies == 1 and view.copied


def test_result_holds_device_tensors_until_read(device):
    fgb, _params, _ = build(device, seed=8)  # buffers hold parameters weakly: keep them
    res = fgb.grad_norm(per_param=True)
    view = res.as_dict()
    assert isinstance(view.tensor, torch.Tensor) and view.tensor is res.norms
    assert not view.copied
    _ = view["embed.weight"]
    assert view.copied


def test_segment_table_random_layouts_against_fp64():
    """Random slot layouts (gaps of zeros, many slots per block, one long slot)."""
    gen = torch.Generator().manual_seed(9)
    for trial in range(25):
        align = [1, 2, 3, 16, 64, 100][trial % 6]
        n = int(torch.randint(1, 40, (), generator=gen))
        sizes = torch.randint(0, 3 * BLOCK if trial % 3 else 50, (n,), generator=gen).tolist()
        slots, off = [], 0
        for i, size in enumerate(sizes):
            slots.append((off, size, i))
            off = -(-(off + size) // align) * align
        numel = max(-(-off // align) * align, align)
        dtype = [BF16, FP32, FP64][trial % 3]
        buf = torch.zeros(numel, dtype=dtype)
        for o, size, _ in slots:
            buf[o : o + size] = torch.randn(size, generator=gen).to(dtype)
        table = build_segment_table(numel, slots, n, torch.device("cpu"))
        for p in NORM_TYPES:
            out = torch.zeros(n + 1, dtype=FP64)
            nan = torch.zeros(n + 1, dtype=FP64)
            torch_segment_stats_(buf, table, p, out, nan)
            for o, size, i in slots:
                x = buf[o : o + size].double()
                if not size:
                    want = 0.0
                elif p == math.inf:
                    want = x.abs().max().item()
                else:
                    want = x.abs().pow(p).sum().item()
                assert rel(out[i].item(), want) <= 1e-6, (trial, p, i)


@pytest.mark.parametrize("p", [2.0, math.inf])
def test_the_cpu_pass_shares_its_chunks_and_runs_every_op_on_one_thread(monkeypatch, p):
    """On the CPU the segmented pass hands its chunks to run_pieces, one task each, and
    every op of it (the chunks' and the reductions of their results) runs at one torch
    thread whatever torch's count, so no op waits for threads a busy machine holds
    (``benchmarks/cpu_norm.py``'s per_param rows); the count is restored after. The sums
    are the in-order pass's bits at two threads and at one, within 1e-6 of fp64."""
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch's thread count is per calling thread only with OpenMP")
    from buffers import ops, segments

    monkeypatch.setitem(segments._CHUNK, "cpu", 4 * BLOCK)  # several chunks, a short last one
    gen = torch.Generator().manual_seed(31)
    sizes = [3 * BLOCK + 5, 17, 9 * BLOCK, 0, BLOCK - 1, 2 * BLOCK + 40]
    slots, off = [], 0
    for i, size in enumerate(sizes):
        slots.append((off, size, i))
        off = -(-(off + size) // 64) * 64
    buf = torch.zeros(off, dtype=BF16)
    for o, size, _ in slots:
        buf[o : o + size] = torch.randn(size, generator=gen).to(BF16)
    table = build_segment_table(off, slots, len(sizes), torch.device("cpu"))

    threads_at = []  # (which op, torch's thread count when it ran)
    tasks_given = []

    def noted(what, real):
        def call(*args):
            threads_at.append((what, torch.get_num_threads()))
            return real(*args)

        return call

    monkeypatch.setattr(segments, "_power_", noted("chunk", segments._power_))
    monkeypatch.setattr(segments, "_add_to", noted("add", segments._add_to))
    real_run = ops.run_pieces
    monkeypatch.setattr(
        ops, "run_pieces", lambda tasks: tasks_given.append(len(tasks)) or real_run(tasks)
    )

    def stats(threads: int, in_order: bool = False) -> torch.Tensor:
        out = torch.zeros(len(sizes) + 1, dtype=FP64)
        nan = torch.zeros(len(sizes) + 1, dtype=FP64)
        torch.set_num_threads(threads)
        if in_order:
            torch_segment_stats_(buf, table, p, out, nan)
        else:
            ops.TorchBackend().segment_stats_(buf, table, p, out, nan)
        assert torch.get_num_threads() == threads
        return out

    before = torch.get_num_threads()
    try:
        two = stats(2)
        chunks = -(-off // (4 * BLOCK))
        assert chunks > 2 and tasks_given == [chunks]
        assert sorted(set(threads_at)) == [("add", 1), ("chunk", 1)]
        one, in_order = stats(1), stats(2, in_order=True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(two, one) and torch.equal(two, in_order)
    for o, size, i in slots:
        x = buf[o : o + size].double().abs()
        want = (x.max().item() if size else 0.0) if p == math.inf else x.square().sum().item()
        assert rel(two[i].item(), want) <= 1e-6, i


TRITON_SCRIPT = textwrap.dedent(
    """
    import math, torch
    from buffers import ops, triton_kernels as tk
    from buffers.segments import build_segment_table
    gen = torch.Generator().manual_seed(12)
    backend = ops.TritonBackend()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        sizes = [tk.TILE + 7, 1, 0, 57, 3 * tk.TILE + 33, 16, 5]
        slots, off = [], 0
        for i, n in enumerate(sizes):
            slots.append((off, n, i))
            off = -(-(off + n) // 64) * 64 + (3 if i == 3 else 0)  # one unaligned start
        buf = torch.zeros(off + 64, dtype=dtype)
        for o, n, _ in slots:
            buf[o:o + n] = torch.randn(n, generator=gen).to(dtype)
        buf[-1] = 1e3  # outside every slot: must not be read
        table = build_segment_table(buf.numel(), slots, len(slots), buf.device)
        backend.prepare_segments(buf, table)
        for _ in range(2):  # the second call reuses the cached tiles
            out = torch.zeros(len(slots) + 1, dtype=torch.float64)
            backend.segment_stats_(buf, table, 2.0, out, out)
            for o, n, i in slots:
                want = buf[o:o + n].double().square().sum().item()
                assert math.isclose(out[i].item(), want, rel_tol=1e-6, abs_tol=0), (dtype, i)
            assert out[-1].item() == 0.0
        # Spans of several tiles, their partials read two at a time: the per-span loop.
        tiles = tk.TileTable(buf, [(o, o + n) for o, n, _ in slots])
        sums = tiles.span_sumsq(buf, rows=2)
        assert sums.dtype == torch.float64 and sums.numel() == len(slots)
        for o, n, i in slots:
            want = buf[o:o + n].double().square().sum().item()
            assert math.isclose(sums[i].item(), want, rel_tol=1e-6, abs_tol=0), (dtype, i)
        buf[slots[4][0] + 5] = math.nan
        out = torch.zeros(len(slots) + 1, dtype=torch.float64)
        backend.segment_stats_(buf, table, 2.0, out, out)
        assert math.isnan(out[4].item()) and math.isfinite(out[0].item())
    print("segmented kernel ok")
    """
)


def test_segmented_triton_kernel_under_interpreter():
    pytest.importorskip("triton")
    res = run_interpreted(TRITON_SCRIPT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "segmented kernel ok" in res.stdout


# Per world size, each rank's (name, numel, dtype, counted). "shared.*" are split across
# ranks (disjoint elements of one parameter, summed); "dup" is the same gradient on ranks 0
# and 1, counted on rank 0 only; "free" is counted nowhere; rank 1 of 3 holds nothing.
RANK_INVENTORIES = {
    2: [
        [("shared.w", 300, BF16, True), ("a", 65, FP32, True), ("dup", 40, FP32, True),
         ("free", 9, FP32, False)],
        [("b", 129, BF16, True), ("dup", 40, FP32, False), ("shared.w", 77, BF16, True),
         ("free", 4, FP32, False)],
    ],
    3: [
        [("shared.w", 300, BF16, True), ("a", 65, FP32, True), ("c", 3, FP64, True),
         ("dup", 40, FP32, True)],
        [],
        [("shared.w", 1000, BF16, True), ("dup", 40, FP32, False), ("d", 7, BF16, False)],
    ],
}  # fmt: skip


def rank_grads(world, rank):
    gen = torch.Generator().manual_seed(100 * world + rank)
    out = {}
    for name, n, dt, _ in RANK_INVENTORIES[world][rank]:
        g = torch.randn(n, generator=torch.Generator().manual_seed(7) if name == "dup" else gen)
        out[name] = g.to(dt)
    return out


def dist_worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    calls = {"all_reduce": 0, "all_gather_object": 0}
    for fn in list(calls):
        original = getattr(dist, fn)

        def counted(*a, _fn=fn, _orig=original, **k):
            calls[_fn] += 1
            return _orig(*a, **k)

        setattr(dist, fn, counted)
    inv = RANK_INVENTORIES[world][rank]
    grads = rank_grads(world, rank)
    params = [(n, torch.nn.Parameter(torch.zeros(k, dtype=dt))) for n, k, dt, _ in inv]
    counted_by_id = {id(p): c for (_, p), (_, _, _, c) in zip(params, inv, strict=True)}
    fgb = FlatGradBuffers(params, counted=lambda p: counted_by_id[id(p)])
    for n, p in params:
        fgb.view(p).copy_(grads[n])
    out = {"per_call": []}
    for p in (2.0, 2.0, math.inf, 1.0):
        before = dict(calls)
        res = fgb.grad_norm(p, group=dist.group.WORLD, per_param=True)
        out["per_call"].append({k: calls[k] - before[k] for k in calls})
        out[p] = {"names": res.names, "counted": res.counted, "norms": res.norms.tolist(),
                  "total": res.total.item()}  # fmt: skip
    if rank == world - 1 and params:
        fgb.view(params[0][1])[0] = math.nan
    out["nan"] = {
        p: fgb.grad_norm(p, group=dist.group.WORLD, per_param=True).norms.tolist()
        for p in (2.0, math.inf)
    }
    torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_one_all_reduce_per_call(tmp_path, world):
    spawn(dist_worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world)
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    # fp64 reference by name from the raw gradients of every rank.
    pieces: dict[str, list] = {}
    counted_any: dict[str, bool] = {}
    for r in range(world):
        grads = rank_grads(world, r)
        for name, _, _, c in RANK_INVENTORIES[world][r]:
            counted_any[name] = counted_any.get(name, False) or c
            pieces.setdefault(name, []).append((grads[name], c))
    for p in (2.0, math.inf, 1.0):
        want = {}
        for name, ps in pieces.items():
            # Counted copies only, when there is one; else every copy (they are disjoint).
            used = [g for g, c in ps if c] if counted_any[name] else [g for g, _ in ps]
            want[name] = ref_norm(used, p)
        total = ref_norm([g for ps in pieces.values() for g, c in ps if c], p)
        for res in results:
            got = res[p]
            assert sorted(got["names"]) == sorted(pieces)
            assert dict(zip(got["names"], got["counted"], strict=True)) == counted_any
            for name, value in zip(got["names"], got["norms"], strict=True):
                assert rel(value, want[name]) <= 1e-6, (p, name, value, want[name])
            assert rel(got["total"], total) <= 1e-6
            # Every rank, the same vector (fp64 on a rank holding fp64 buffers, else fp32).
            assert got["names"] == results[0][p]["names"]
            f32 = [torch.tensor(r[p]["norms"], dtype=FP32) for r in (res, results[0])]
            assert torch.equal(*f32)
    for res in results:
        # The names are gathered once (first call); every call is exactly one all-reduce.
        assert res["per_call"][0] == {"all_reduce": 1, "all_gather_object": 1}
        assert all(c == {"all_reduce": 1, "all_gather_object": 0} for c in res["per_call"][1:])
        names = results[0][2.0]["names"]
        nan_name = RANK_INVENTORIES[world][world - 1][0][0]
        for p in (2.0, math.inf):
            for name, value in zip(names, res["nan"][p], strict=True):
                assert math.isnan(value) == (name == nan_name), (p, name)


def test_names_a_pattern_does_not_match_are_an_error_unless_said_what_to_do():
    names = ("layers.0.w", "layers.1.w", "embedding.w", "final_norm.w")
    with pytest.raises(ValueError, match=r"'embedding\.w' \(and 'final_norm\.w'\).*unmatched="):
        GroupIndex(names, r"^layers\.(\d+)\.")
    collected = GroupIndex(names, r"^layers\.(\d+)\.", unmatched="other")
    assert collected.groups == ("0", "1", "other")
    dropped = GroupIndex(names, r"^layers\.(\d+)\.", unmatched=None)
    assert dropped.groups == ("0", "1")
    # a function says None on purpose: those names are in no group, unless unmatched names one
    rule = lambda n: n.split(".")[1] if n.startswith("layers.") else None  # noqa: E731
    assert GroupIndex(names, rule).groups == ("0", "1")
    assert GroupIndex(names, rule, unmatched="rest").groups == ("0", "1", "rest")
    norms = torch.tensor([3.0, 4.0, 12.0, 5.0])
    got = GroupIndex(names, r"^layers\.(\d+)\.", unmatched="other").aggregate(norms)
    assert got.tolist() == [3.0, 4.0, 13.0]
    with pytest.raises(TypeError, match="unmatched"):
        GroupIndex(names, r"^layers\.(\d+)\.", unmatched=1)
