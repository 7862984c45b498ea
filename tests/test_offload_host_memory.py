"""Host and GPU memory as inputs to the offload (``megatron_ext.offload.host_memory``), on the
CPU: byte counts against ones written out here from the element sizes, the bound on what
megatron-core's own placement offloads, the estimate against the bytes the built host
mirrors hold, the host's memory read from /proc and cgroup files, the refusal, the
``"auto"`` fraction under a stated GPU budget, and the check wired into
``megatron_ext.get_megatron_optimizer`` before megatron-core allocates."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from buffers.spans import Span
from megatron_ext.counted_spans import GradRecord
from megatron_ext.layout import BufferKey, BufferLayout, ChunkLayout
from megatron_ext.offload import host_memory as hm
from megatron_ext.offload.host_memory import (
    HostMemory,
    OffloadMemoryError,
    OffloadSettings,
    ShardBuffer,
)
from tests.support.offload_sim import (
    FP32_SHAPES,
    ISLAND_NAMES,
    SHAPES,
    MirrorChunked,
    MirrorChunkedOnDevice,
    MirrorPlaced,
    make_hdo,
    one_step,
    placement,
    sim,
)

pytestmark = pytest.mark.mcore

BF16, FP32 = torch.bfloat16, torch.float32

# a bf16 buffer (1000 parameter elements, 24 of padding between them, the largest 300, 40
# read in an fp32 island) and a natively fp32 one (64, no padding)
BF = ShardBuffer("bf16", 1000, 24, 300, 40, BF16, BF16, BF16)
F32 = ShardBuffer("fp32", 64, 0, 64, 0, FP32, FP32, FP32)


def parts(staging=0, params=0, grads=0, moments=0, scratch=0) -> dict[str, int]:
    return dict(zip(hm.PARTS, (params, moments, staging, grads, scratch), strict=True))


# Expected bytes at fraction 1 (all 1064 elements offloaded; a mirror holds the padding too:
# 1024 + 64 elements), written out per element from the Note's sizes.
CASES = {
    # staging: bf16 2 x 1024 + island 4 x 40, fp32 4 x 64; host 4 x 1088; moments 8 x 1088;
    # scratch: one fp32 sub-range per buffer, as long as the mirror (under compute_numel)
    "chunked": (
        OffloadSettings(1.0),
        parts(staging=2464, params=4352, moments=8704, scratch=4352),
        2464,
        2464 + 4352 + 4 * 1064,
    ),
    # moments 4 x 1088; the scratch three times (gradients and both moments widened)
    "chunked_bf16_moments": (
        OffloadSettings(1.0, moment_dtypes=(BF16, BF16)),
        parts(staging=2464, params=4352, moments=4352, scratch=3 * 4352),
        2464,
        2464 + 4352 + 4 * 1064,
    ),
    # host fp32 gradients of the bf16 buffer (4 x 1024; the fp32 buffer's are the staging);
    # torch's fp32 moments per parameter (8 x 1064); bf16 moments asked are not kept
    "per_parameter": (
        OffloadSettings(1.0, moment_dtypes=(BF16, BF16), step="per_parameter"),
        parts(staging=2464, params=4352, grads=4096, moments=8512),
        2464,
        2464 + 4352 + 4096 + 4 * 1064,
    ),
    # megatron-core's own: per parameter element 4 host, 4 pinned gradients, 8 moments
    "megatron": (
        OffloadSettings(1.0, step="megatron"),
        parts(params=4256, grads=4256, moments=8512),
        4256,
        4256 + 4256 + 8512,
    ),
    # fp32 both ways: staging 4 x 1088 and host parameters 4 x 1088, both pinned; no island
    "device_convert": (
        OffloadSettings(1.0, convert="device"),
        parts(staging=4352, params=4352, moments=8704, scratch=4352),
        8704,
        8704 + 4 * 1064,
    ),
    # chunks of 100 elements: no sub-range longer (the fp32 buffer's 64 are one)
    "small_chunks": (
        OffloadSettings(1.0, chunk_numel=100),
        parts(staging=2464, params=4352, moments=8704, scratch=4 * 100 + 4 * 64),
        2464,
        2464 + 4352 + 4 * 1064,
    ),
    # the delayed update: the parameters' own staging, 2 x 1024 + 4 x 64
    "split_staging": (
        OffloadSettings(1.0, split_staging=True),
        parts(staging=2464 + 2048 + 256, params=4352, moments=8704, scratch=4352),
        2464 + 2048 + 256,
        2464 + 2048 + 256 + 4352 + 4 * 1064,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_host_bytes_at_fraction_one_are_the_element_sizes(case):
    settings, want, pinned, build = CASES[case]
    got = hm.host_bytes([BF, F32], settings)
    assert dict(got.parts) == want
    assert got.pinned == pinned and got.build == build
    assert got.step == sum(want.values()) and got.needed == max(build, got.step)
    assert got.offloaded == 1064


def test_fp32_gradients_of_bf16_parameters_are_read_in_the_staging():
    """Megatron-LM's fp32 main gradients: the staging is 4 bytes wide and the step reads
    the gradients there (no host copy), even the per-parameter step."""
    wide = dataclasses.replace(BF, grads_dtype=FP32)
    got = hm.host_bytes([wide], OffloadSettings(1.0, step="per_parameter"))
    assert got.parts["pinned staging"] == 4 * 1024 + 4 * 40
    assert got.parts["host gradients"] == 0


def test_below_fraction_one_the_most_expensive_buffers_are_counted_first():
    """Fraction 0.5 of 1064 elements: at most 532 + the largest parameter (300) = 832 are
    offloaded; the fp32 buffer costs more per element (16 against 14), so it is counted
    whole (64) and the bf16 one with 768 (+ its padding)."""
    got = hm.host_bytes([BF, F32], OffloadSettings(0.5))
    assert got.offloaded == 832
    n = 768 + 24
    assert got.parts["pinned staging"] == 2 * n + 4 * 40 + 4 * 64
    assert got.parts["host parameters"] == 4 * n + 4 * 64
    assert got.parts["Adam moments"] == 8 * n + 8 * 64
    assert got.build == 2 * n + 4 * 40 + 4 * 64 + 4 * n + 4 * 64 + 4 * 832
    assert hm.host_bytes([BF, F32], OffloadSettings(0.0)).needed == 0
    # ceil(0.001 x 1064) = 2, and the last parameter may run over by up to the largest
    assert hm.offloaded_numel([BF, F32], 0.001) == 2 + 300
    # each optimizer of a chain applies the fraction to its own parameters
    expert = dataclasses.replace(BF, optimizer="expert")
    # (the fp32 one: 32 + 64, capped at its 64)
    assert hm.offloaded_numel([expert, F32], 0.5) == (500 + 300) + 64


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.5, 0.7, 0.9, 1.0])
@pytest.mark.parametrize("pa", [True, False])
def test_the_bound_holds_for_what_megatron_core_offloads(fraction, pa):
    """megatron-core's own placement over the simulated shard (both param group orders):
    the elements it offloads never exceed :func:`offloaded_numel`, the ones it leaves on the
    GPU never exceed what :func:`gpu_state_bytes` counts."""
    for fp32_first in (False, True):
        bf16, fp32, groups, _, _, shard16 = sim(pa, fp32_first, False, 2, 1)
        chunks = _chunks(bf16, fp32, dp=2, rank=1)
        buffers = hm.shard_buffers(chunks, precision_aware=pa)
        placed = placement(groups, fraction)
        total = sum(p.numel() for g in groups for p in g["params"])
        moved = sum(p.numel() for p in placed[2])
        assert sum(b.param_numel for b in buffers) == total
        assert fraction * total <= moved <= hm.offloaded_numel(buffers, fraction)
        settings = OffloadSettings(fraction, precision_aware=pa)
        bf16_numel = sum(p.numel() for p in shard16.values())
        assert hm.gpu_state_bytes(buffers, settings) >= _megatron_gpu_state(placed, pa, bf16_numel)


def _megatron_gpu_state(placed, pa: bool, bf16_numel: int) -> int:
    """The GPU optimizer state megatron-core's placement leaves: fp32 moments (8 bytes an
    element) of every resident parameter and the fp32 copy (4) of each resident bf16 one;
    without the precision-aware optimizer the fp32 mains of every bf16 element (4) stay."""
    _, gpu_groups, _, _, fp32_copies = placed
    copies = {id(v) for v in fp32_copies.values()}
    state = sum((8 + 4 * (id(p) in copies)) * p.numel() for g in gpu_groups for p in g["params"])
    return state + (0 if pa else 4 * bf16_numel)


def _chunks(bf16, fp32, *, dp, rank, islands=False):
    """The simulated buffers as a model chunk's layouts (what ``shard_buffers`` reads)."""
    layouts = []
    for buf, shapes, dtype in ((bf16, SHAPES, BF16), (fp32, FP32_SHAPES, FP32)):
        numel = buf.param_data.numel()
        records = tuple(
            GradRecord(name, s.start, s.end, 0)
            for name, s in sorted(buf.spans.items(), key=lambda kv: kv[1].start)
        )
        island = sum(buf.spans[n].numel for n in ISLAND_NAMES if n in shapes) if islands else 0
        layouts.append(
            BufferLayout(
                BufferKey(dtype, buf.grad_data.dtype, False),
                numel,
                (Span(0, numel),),
                records,
                dp,
                rank,
                island,
            )  # fmt: skip
        )
    return [types.SimpleNamespace(layout=ChunkLayout(tuple(layouts)))]


def _actual(hdo) -> dict[str, int]:
    """The bytes the built optimizer holds on the host, by part, from the mirrors and the
    optimizers' state (not from the estimate)."""
    stats = hdo.host_mirror_stats()
    out = dict.fromkeys(hm.PARTS, 0)
    for m, s in zip(hdo.host_mirrors, stats, strict=True):
        island = 0 if m.island_staging is None else m.island_staging.numel() * 4
        out["pinned staging"] += s["staging_bytes"] + s["param_staging_bytes"] + island
        out["host parameters"] += s["host_param_bytes"]
        out["host gradients"] += s["host_grad_bytes"]
        out["scratch"] += s.get("scratch_bytes", 0)
    if any("moment_bytes" in row for row in stats):  # the chunked step's flat moments
        out["Adam moments"] = sum(s["moment_bytes"] for s in stats)
    else:
        out["Adam moments"] = sum(
            t.numel() * t.element_size()
            for opt in hdo.cpu_optimizers
            for state in opt.state.values()
            for k, t in state.items()
            if k in ("exp_avg", "exp_avg_sq")
        )
    return out


class _Bf16Moments(MirrorChunked):
    moment_dtypes = (BF16, BF16)


class _Split(MirrorChunked):
    """The chunked step with the parameters' own staging (the delayed update's)."""

    def _build_host_mirrors(self):
        self.delayed_update = True
        try:
            super()._build_host_mirrors()
        finally:
            self.delayed_update = False


BUILT = {
    "chunked": (MirrorChunked, OffloadSettings(1.0, compute_numel=64)),
    "bf16_moments": (_Bf16Moments, OffloadSettings(1.0, (BF16, BF16), compute_numel=64)),
    "per_parameter": (MirrorPlaced, OffloadSettings(1.0, step="per_parameter")),
    "device_convert": (
        MirrorChunkedOnDevice,
        OffloadSettings(1.0, convert="device", compute_numel=64),
    ),
    "split_staging": (_Split, OffloadSettings(1.0, split_staging=True, compute_numel=64)),
}


@pytest.mark.parametrize("pa", [True, False], ids=["precision_aware", "fp32_mains"])
@pytest.mark.parametrize("grads_fp32", [False, True], ids=["bf16_grads", "fp32_grads"])
@pytest.mark.parametrize("case", BUILT)
def test_the_estimate_is_what_the_built_mirrors_hold(cpu_streams, case, grads_fp32, pa):
    """At DP=1 and fraction 1 the estimate of every part equals the bytes the host mirrors,
    the flat moments (or torch's per-parameter state) and the scratch hold after a step; at
    DP=2 and fraction 0.5 it bounds them."""
    cls, settings = BUILT[case]
    settings = dataclasses.replace(settings, precision_aware=pa)
    islands = pa  # the simulation's islands are the precision-aware optimizer's
    for dp, rank, fraction in ((1, 0, 1.0), (2, 1, 0.5)):
        bf16, fp32, groups, sources, bind, _ = sim(pa, False, grads_fp32, dp, rank, islands=islands)
        # one chunk per block, sub-ranges of 64: the longest is the estimate's (64)
        hdo = make_hdo(cls, groups, fraction, True, sources, chunk=10**9, compute=64)
        one_step(bf16, fp32, bind, hdo, 0, torch.Generator().manual_seed(1))
        buffers = hm.shard_buffers(
            _chunks(bf16, fp32, dp=dp, rank=rank, islands=islands), precision_aware=pa
        )
        want = hm.host_bytes(buffers, dataclasses.replace(settings, fraction=fraction))
        got = _actual(hdo)
        assert sum(got.values()) > 0
        if fraction == 1.0:
            assert got == dict(want.parts), case
        else:
            for part, value in got.items():
                assert value <= want.parts[part], part


# ---- what the host has -------------------------------------------------------------------


def _host(tmp_path, meminfo_kb=None, cgroup=None, v1=None):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    if meminfo_kb is not None:
        (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {meminfo_kb} kB\n")
    if cgroup is not None:  # v2: {relative dir: (memory.max, memory.current, inactive_file)}
        (proc / "self" / "cgroup").write_text("0::/job/rank\n")
        for rel, (limit, current, inactive) in cgroup.items():
            d = root / rel
            d.mkdir(parents=True, exist_ok=True)
            (d / "memory.max").write_text(f"{limit}\n")
            (d / "memory.current").write_text(f"{current}\n")
            (d / "memory.stat").write_text(f"anon 5\ninactive_file {inactive}\nactive_file 7\n")
    if v1 is not None:
        (proc / "self" / "cgroup").write_text("5:cpu:/x\n4:memory:/job\n")
        d = root / "memory" / "job"
        d.mkdir(parents=True)
        (d / "memory.limit_in_bytes").write_text(f"{v1[0]}\n")
        (d / "memory.usage_in_bytes").write_text(f"{v1[1]}\n")
    return dict(proc=proc, cgroup_root=root)


def test_host_available_is_the_tightest_of_meminfo_and_cgroup_limits(tmp_path):
    gib = 2**30
    only_meminfo = _host(tmp_path / "a", meminfo_kb=64 * 2**20)
    got = hm.host_available(ranks=1, **only_meminfo)
    assert got.available == 64 * gib and "MemAvailable" in got.source
    assert hm.host_available(ranks=4, **only_meminfo).available == 16 * gib
    # v2: the parent's limit is the tight one (less its usage, page cache it can reclaim
    # counted as free); "max" is no limit
    v2 = _host(
        tmp_path / "b",
        meminfo_kb=64 * 2**20,
        cgroup={"job": (40 * gib, 30 * gib, 4 * gib), "job/rank": ("max", 1 * gib, 0)},
    )
    got = hm.host_available(ranks=2, **v2)
    assert got.available == 14 * gib // 2 and "cgroup limit 40.0 GiB" in got.source
    assert "2 ranks" in got.source
    loose = _host(tmp_path / "c", meminfo_kb=8 * 2**20, cgroup={"job": (40 * gib, 1, 0)})
    assert hm.host_available(ranks=1, **loose).available == 8 * gib
    v1 = _host(tmp_path / "d", meminfo_kb=64 * 2**20, v1=(20 * gib, 5 * gib))
    assert hm.host_available(ranks=1, **v1).available == 15 * gib
    unlimited_v1 = _host(tmp_path / "e", meminfo_kb=64 * 2**20, v1=(2**63 - 4096, 5 * gib))
    assert hm.host_available(ranks=1, **unlimited_v1).available == 64 * gib
    with pytest.raises(OffloadMemoryError, match="offload_host_bytes"):
        hm.host_available(ranks=1, **_host(tmp_path / "f"))
    with pytest.raises(ValueError, match="ranks=0"):
        hm.host_available(ranks=0, **only_meminfo)


def test_host_available_divides_among_local_world_size(tmp_path, monkeypatch):
    where = _host(tmp_path, meminfo_kb=30 * 2**20)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert hm.host_available(**where).available == 10 * 2**30
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert hm.host_available(**where).available == 30 * 2**30


def test_this_host_has_some_memory_available():
    got = hm.host_available(ranks=1)
    assert got.available > 0 and got.source


# ---- the refusal ---------------------------------------------------------------------------


def test_the_check_passes_at_the_budget_and_refuses_one_byte_under_it():
    settings = OffloadSettings(1.0)
    need = hm.host_bytes([BF, F32], settings).needed
    assert hm.check_host_memory([BF, F32], settings, HostMemory(need, "stated")).needed == need
    with pytest.raises(OffloadMemoryError) as err:
        hm.check_host_memory([BF, F32], settings, HostMemory(need - 1, "stated budget"))
    message = str(err.value)
    assert "\n" not in message
    assert f"needs {need / 2**30:.1f} GiB" in message and "(stated budget)" in message
    assert "optimizer_offload_fraction=1" in message and "bf16" in message
    # the fraction it names fits, the next one up does not, at any budget
    for budget in range(500, need, 997):
        with pytest.raises(OffloadMemoryError) as err:
            hm.check_host_memory([BF, F32], settings, HostMemory(budget, "stated"))
        text = str(err.value).split("lower optimizer_offload_fraction to ")[1]
        named = float(text.split(" ")[0])
        at = dataclasses.replace(settings, fraction=named)
        assert hm.host_bytes([BF, F32], at).needed <= budget
        above = dataclasses.replace(settings, fraction=round(named + 0.01, 2))
        assert hm.host_bytes([BF, F32], above).needed > budget
    # bf16 moments: what they would need, or not offered where they are kept already
    narrow = hm.host_bytes([BF, F32], OffloadSettings(1.0, (BF16, BF16))).needed
    assert f"{narrow / 2**30:.1f} GiB)" in message
    bf16_settings = OffloadSettings(1.0, (BF16, BF16))
    with pytest.raises(OffloadMemoryError) as err:
        hm.check_host_memory([BF, F32], bf16_settings, HostMemory(narrow - 1, "stated"))
    assert "keep the Adam moments in bf16" not in str(err.value)
    with pytest.raises(OffloadMemoryError, match="and the chunked step"):
        hm.check_host_memory(
            [BF, F32], OffloadSettings(1.0, step="megatron"), HostMemory(100, "stated")
        )


def test_settings_are_checked():
    for bad, match in (
        (dict(fraction=1.5), "fraction=1.5"),
        (dict(fraction=0.5, step="fast"), "step='fast'"),
        (dict(fraction=0.5, convert="gpu"), "convert='gpu'"),
        (dict(fraction=0.5, moment_dtypes=(torch.float16, FP32)), "torch.float16"),
    ):
        with pytest.raises(ValueError, match=match):
            OffloadSettings(**bad)


# ---- the GPU side and "auto" ---------------------------------------------------------------


def test_gpu_state_bytes_are_the_element_sizes():
    """Precision-aware: per resident element fp32 moments (8) and an fp32 main copy of a
    bf16 parameter (4); without it every bf16 element keeps its fp32 main on the GPU (4)
    and a resident one adds its moments (8)."""
    pa = OffloadSettings(0.0)
    assert hm.gpu_state_bytes([BF, F32], pa) == 12 * 1000 + 8 * 64
    assert hm.gpu_state_bytes([BF, F32], dataclasses.replace(pa, fraction=1.0)) == 0
    mains = OffloadSettings(0.0, precision_aware=False)
    assert hm.gpu_state_bytes([BF, F32], mains) == 4 * 1000 + 8 * 1064
    assert hm.gpu_state_bytes([BF, F32], dataclasses.replace(mains, fraction=1.0)) == 4 * 1000
    # 0.5: 532 offloaded at least, 532 resident at most, the bf16 ones (12 each) first
    assert hm.gpu_state_bytes([BF, F32], OffloadSettings(0.5)) == 12 * 532
    # device conversion: two fp32 chunk temporaries
    on_device = OffloadSettings(0.5, convert="device", chunk_numel=100)
    assert hm.gpu_state_bytes([BF, F32], on_device) == 12 * 532 + 2 * 4 * 100


def test_auto_fraction_is_the_smallest_that_fits_a_stated_budget():
    """A budget of 6000 bytes: at most 500 resident bf16 elements (12 bytes each), so
    ceil(1064 f) >= 564: f = 0.53 (1064 x 0.52 = 553.3 leaves 510)."""
    settings = OffloadSettings(0.0)
    assert hm.auto_offload_fraction([BF, F32], settings, 6000) == 0.53
    assert hm.auto_offload_fraction([BF, F32], settings, 12 * 1000 + 8 * 64) == 0.0
    assert hm.auto_offload_fraction([BF, F32], settings, 0) == 1.0
    with pytest.raises(OffloadMemoryError, match="even at 1.0"):
        hm.auto_offload_fraction([BF, F32], OffloadSettings(0.0, precision_aware=False), 3999)
    # megatron-core's own placement at the fraction chosen leaves no more than that budget
    bf16, fp32, groups, *_ = sim(True, False, False, 1, 0)
    buffers = hm.shard_buffers(_chunks(bf16, fp32, dp=1, rank=0), precision_aware=True)
    budget = 8 * 1024
    fraction = hm.auto_offload_fraction(buffers, settings, budget)
    assert 0 < fraction < 1
    assert _megatron_gpu_state(placement(groups, fraction), True, 0) <= budget
    below = round(fraction - 0.01, 2)
    assert hm.gpu_state_bytes(buffers, dataclasses.replace(settings, fraction=below)) > budget


def test_shard_buffers_read_the_layouts_shard():
    """DP=2, rank 1 of a 256-element bucket: elements 128-255. Parameters at 0-100,
    120-150, 160-200, 230-250: pieces 128-150, 160-200, 230-250 (82 elements) inside a hull
    of 122 (padding 40); the island capped at the pieces."""
    records = tuple(
        GradRecord(n, a, b, 0)
        for n, a, b in (("a", 0, 100), ("b", 120, 150), ("c", 160, 200), ("d", 230, 250))
    )
    layout = BufferLayout(BufferKey(BF16, FP32, True), 256, (Span(0, 256),), records, 2, 1, 500)
    chunk = types.SimpleNamespace(layout=ChunkLayout((layout,)))
    (got,) = hm.shard_buffers([chunk], precision_aware=True)
    assert (got.param_numel, got.padding_numel, got.largest_param) == (82, 40, 40)
    assert got.island_numel == 82 and got.optimizer == "expert"
    assert (got.model_dtype, got.grads_dtype, got.params_dtype) == (BF16, FP32, BF16)
    (mains,) = hm.shard_buffers([chunk], precision_aware=False)
    assert (mains.grads_dtype, mains.params_dtype) == (FP32, FP32)
    (whole,) = hm.shard_buffers([chunk], precision_aware=True, distributed=False)
    assert (whole.param_numel, whole.padding_numel) == (190, 60)  # every piece, 0-250


# ---- wired into get_megatron_optimizer ------------------------------------------------------


def _offload_config(**fields):
    from megatron.core.optimizer import OptimizerConfig

    base = dict(
        optimizer="adam", lr=1e-3, bf16=True, use_distributed_optimizer=True,
        use_precision_aware_optimizer=True, optimizer_cpu_offload=True,
        optimizer_offload_fraction=1.0,
    )  # fmt: skip
    return OptimizerConfig(**(base | fields))


def _fake_chunk():
    """A model chunk as get_megatron_optimizer reads it before megatron-core runs: the
    option and the layouts (one bf16 buffer of 1000 elements at DP=1)."""
    records = (GradRecord("w", 0, 1000, 0),)
    layout = BufferLayout(BufferKey(BF16, BF16, False), 1000, (Span(0, 1000),), records, 1, 0)
    return types.SimpleNamespace(per_dtype_grad_buffers=True, layout=ChunkLayout((layout,)))


class _Reached(Exception):
    pass


@pytest.fixture
def stock_builder(monkeypatch):
    """megatron-core's get_megatron_optimizer replaced by one that records its config and
    stops (what runs after it needs a built model)."""
    from megatron_ext import seam

    seen = []
    real = seam.target

    def target(name):
        if name == "get_megatron_optimizer":

            def stock(config, *args, **kwargs):
                seen.append(config)
                raise _Reached

            return stock
        return real(name)

    monkeypatch.setattr(seam, "target", target)
    return seen


def test_get_megatron_optimizer_refuses_before_megatron_core_allocates(stock_builder, monkeypatch):
    """1000 bf16 elements at fraction 1, chunked, fp32 moments: staging 2 + host 4 + moments 8
    bytes an element and a 4000-byte scratch: 18000 bytes. One byte less refuses before the
    stock builder runs; the exact budget reaches it."""
    import megatron_ext

    monkeypatch.setattr(hm, "gpu_free_bytes", lambda: None)
    config = _offload_config()
    tight = megatron_ext.MegatronOptions(offload_host_bytes=18000 - 1)
    with pytest.raises(OffloadMemoryError, match="needs 0.0 GiB"):
        megatron_ext.get_megatron_optimizer(config, [_fake_chunk()], options=tight)
    assert stock_builder == []
    exact = megatron_ext.MegatronOptions(offload_host_bytes=18000)
    with pytest.raises(_Reached):
        megatron_ext.get_megatron_optimizer(config, [_fake_chunk()], options=exact)
    assert stock_builder == [config]
    # no offload: no check at all
    checked, real_check = [], hm.check_before_build
    monkeypatch.setattr(hm, "check_before_build", lambda *a: checked.append(a))
    with pytest.raises(_Reached):
        megatron_ext.get_megatron_optimizer(
            _offload_config(optimizer_cpu_offload=False, use_precision_aware_optimizer=False),
            [_fake_chunk()],
        )
    assert checked == [] and len(stock_builder) == 2
    monkeypatch.setattr(hm, "check_before_build", real_check)
    # host mirrors off: megatron-core's own copies (16 bytes an element)
    stock = megatron_ext.MegatronOptions(host_mirrors=False, offload_host_bytes=16000 - 1)
    with pytest.raises(OffloadMemoryError, match="and the chunked step"):
        megatron_ext.get_megatron_optimizer(config, [_fake_chunk()], options=stock)


def test_get_megatron_optimizer_picks_the_auto_fraction_and_checks_the_gpu(
    stock_builder, monkeypatch
):
    """A stated GPU: 10000 bytes free, 4000 kept for activations: 6000 for the state, 500
    resident bf16 elements of 1000 (12 bytes each): fraction 0.5, on a copy of the config."""
    import megatron_ext

    monkeypatch.setattr(hm, "gpu_free_bytes", lambda: 10000)
    config = _offload_config(optimizer_offload_fraction=0.0)
    auto = megatron_ext.MegatronOptions(
        offload_fraction="auto", offload_gpu_headroom=4000, offload_host_bytes=10**9
    )
    with pytest.raises(_Reached):
        megatron_ext.get_megatron_optimizer(config, [_fake_chunk()], options=auto)
    (built,) = stock_builder
    assert built is not config and built.optimizer_offload_fraction == 0.5
    assert config.optimizer_offload_fraction == 0.0
    # a fixed fraction whose resident state exceeds the free memory: refused, naming the
    # fraction that would fit (10000 / 12 = 833 resident: 0.17)
    fixed = megatron_ext.MegatronOptions(offload_host_bytes=10**9)
    with pytest.raises(OffloadMemoryError, match="raise the fraction to 0.17"):
        megatron_ext.get_megatron_optimizer(
            _offload_config(optimizer_offload_fraction=0.1), [_fake_chunk()], options=fixed
        )
    monkeypatch.setattr(hm, "gpu_free_bytes", lambda: None)
    with pytest.raises(OffloadMemoryError, match="no CUDA device"):
        megatron_ext.get_megatron_optimizer(config, [_fake_chunk()], options=auto)


def test_options_check_the_memory_fields():
    import megatron_ext

    for bad, match in (
        (dict(offload_fraction="half"), "offload_fraction='half'"),
        (dict(offload_fraction="auto"), "go together"),
        (dict(offload_gpu_headroom=5), "go together"),
        (dict(offload_fraction="auto", offload_gpu_headroom=-1), "offload_gpu_headroom=-1"),
        (dict(offload_host_bytes=1.5), "offload_host_bytes=1.5"),
        (dict(offload_host_bytes=True), "offload_host_bytes=True"),
    ):
        with pytest.raises(ValueError, match=match):
            megatron_ext.MegatronOptions(**bad)


def test_settings_are_read_from_the_config_and_the_options():
    import megatron_ext

    bf16 = dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
    config = _offload_config(optimizer_offload_fraction=0.25, **bf16)
    got = hm.settings_for(config, megatron_ext.MegatronOptions())
    assert got == OffloadSettings(
        0.25, (BF16, BF16), "chunked", "host", False, precision_aware=True
    )
    delayed = megatron_ext.MegatronOptions(
        offload_delayed_update=True, offload_convert="device", offload_chunk_numel=77
    )
    got = hm.settings_for(config, delayed)
    assert (got.split_staging, got.convert, got.chunk_numel) == (True, "device", 77)
    per_param = hm.settings_for(config, megatron_ext.MegatronOptions(offload_step="per_parameter"))
    assert per_param.step == "per_parameter" and per_param.moment_dtypes == (FP32, FP32)
    stock = hm.settings_for(config, megatron_ext.MegatronOptions(host_mirrors=False))
    assert stock.step == "megatron"
    plain = _offload_config(use_precision_aware_optimizer=False, use_distributed_optimizer=False)
    got = hm.settings_for(plain, megatron_ext.MegatronOptions())
    assert got.step == "megatron" and got.precision_aware is False


def test_the_gpu_check_passes_at_the_free_memory(stock_builder, monkeypatch):
    """Fraction 0.5 of 1000 bf16 elements: 500 resident, 12 bytes each: 6000 bytes."""
    import megatron_ext

    options = megatron_ext.MegatronOptions(offload_host_bytes=10**9)
    config = _offload_config(optimizer_offload_fraction=0.5)
    monkeypatch.setattr(hm, "gpu_free_bytes", lambda: 6000)
    with pytest.raises(_Reached):
        megatron_ext.get_megatron_optimizer(config, [_fake_chunk()], options=options)
    monkeypatch.setattr(hm, "gpu_free_bytes", lambda: 5999)
    with pytest.raises(OffloadMemoryError, match="needs 0.0 GiB, but 0.0 GiB is free"):
        megatron_ext.get_megatron_optimizer(config, [_fake_chunk()], options=options)
    assert len(stock_builder) == 1


# ---- megatron-core's real DDP and distributed optimizer (tests/support/cpu_megatron.py) -----


def built_offload_job(rank, world, log, out_dir):
    """Per offload path: the estimate from the model's layouts, before the optimizer is
    built, and the bytes its host mirrors, moments and scratch hold after one step."""
    from tests.support.megatron_mlp import clipped_steps
    from tests.support.mlp_stack import adam_path, build, path_options

    out = {}
    for path in ("torch+offload1.0+chunked", "torch+offload1.0", "torch+offload0.5+chunked"):
        with adam_path(path):
            given = path_options(path)
            model, opt = build(True, **given)
            clipped_steps(model, opt, rank, [0])
            config = opt.chained_optimizers[0].config
            buffers = hm.shard_buffers([model], precision_aware=True)
            want = hm.host_bytes(buffers, hm.settings_for(config, given["options"]))
            got = dict.fromkeys(hm.PARTS, 0)
            for child in opt.chained_optimizers:
                for part, value in _actual(child.optimizer).items():
                    got[part] += value
            out[path] = (dict(want.parts), got)
    return out


def test_the_estimate_from_megatron_layouts_is_what_the_built_mirrors_hold(tmp_path):
    """megatron-core's DDP and distributed optimizer on the CPU (one rank; bf16 weights and
    a natively fp32 parameter; islands are the simulation's test above), offloaded through
    host mirrors: at fraction 1 every part of the estimate made from the layouts before the
    build equals what the mirrors hold after a step (the chunked and the per-parameter
    step); at 0.5 it bounds it."""
    from tests.support.megatron_ranks import run_ranks

    (result,) = run_ranks(tmp_path, 1, built_offload_job)
    assert len(result) == 3
    for path, (want, got) in result.items():
        assert sum(got.values()) > 0, path
        if "offload1.0" in path:
            assert got == want, path
        else:
            assert all(got[p] <= want[p] for p in hm.PARTS) and got != want, path
