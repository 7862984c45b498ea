"""Data-parallel ranks that built different layouts get a clear error, not a hang."""

import os
import types

import pytest
import torch
import torch.distributed as dist

from buffers.spans import Span
from megatron_ext.counted_spans import GradRecord
from megatron_ext.ddp import DistributedDataParallel, LayoutMismatchError, _first_difference
from megatron_ext.layout import BufferKey, BufferLayout, ChunkLayout
from tests.support.spawn import spawn

pytestmark = pytest.mark.mcore


def fake_ddp(
    records, group, *, fp32_records=None, expert_group=None, expert_records=None, buckets=None,
    ddp_groups=True,
):  # fmt: skip
    """A DDP as _check_layouts_agree reads it: a bf16 buffer (none when ``records`` is None),
    optionally an fp32 one and an expert one (over ``expert_group``), and megatron-core's two
    data-parallel groups (None when not ``ddp_groups``: each buffer's own group is used)."""
    expert_group = expert_group if expert_group is not None else group
    bufs, layouts = {}, []
    for dtype, rows, expert in (
        (torch.bfloat16, records, False),
        (torch.float32, fp32_records, False),
        (torch.bfloat16, expert_records, True),
    ):
        if rows is None:
            continue
        key = BufferKey(dtype, dtype, expert)
        on = expert_group if expert else group
        bufs[key] = types.SimpleNamespace(
            param_dtype=dtype,
            grad_dtype=dtype,
            numel=256,
            bucket_indices=[(0, 256)],
            data_parallel_group=on,
            grad_data=torch.zeros(256, dtype=dtype),
        )
        spans = tuple(buckets or (Span(0, 256),))
        layouts.append(BufferLayout(key, 256, spans, tuple(rows), on.size(), on.rank()))
    return types.SimpleNamespace(
        layout=ChunkLayout(tuple(layouts)),
        grad_buffer=bufs.__getitem__,
        intra_dp_cp_group=group if ddp_groups else None,
        intra_expt_dp_group=expert_group if ddp_groups else None,
    )


def worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    for differ in (False, True):
        records = [GradRecord("layers.0.w", 0, 64, 0), GradRecord("layers.0.b", 64, 72, 0)]
        if differ and rank == world - 1:
            records[1] = GradRecord("layers.0.bias_renamed", 64, 72, 0)
        try:
            DistributedDataParallel._check_layouts_agree(fake_ddp(records, dist.group.WORLD))
            msg = "agree"
        except LayoutMismatchError as e:
            msg = str(e)
        with open(os.path.join(out_dir, f"{rank}-{differ}.txt"), "w") as f:
            f.write(msg)
    dist.destroy_process_group()


def test_every_rank_reports_the_first_differing_parameter(tmp_path):
    world = 3
    spawn(worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world)
    same = [(tmp_path / f"{r}-False.txt").read_text() for r in range(world)]
    assert same == ["agree"] * world
    for r in range(world):
        m = (tmp_path / f"{r}-True.txt").read_text()
        assert "parameter 'layers.0.b'" in m and "rank 2 has ('layers.0.bias_renamed'" in m


CASES = (
    "agree",
    "extra_fp32_buffer",
    "extra_expert_buffer",
    "buckets",
    "no_buffer_on_rank_1",
    "buffer_groups_only",
)


def differing_worker(rank, world, init_file, out_dir):
    """Rank 1 differs from rank 0 in one way per case. An extra buffer (fp32 parameters
    kept on one rank only; an expert buffer on one rank only): with one collective per
    buffer, rank 0 would wait for an all-gather rank 1 never makes."""
    import datetime

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )  # fmt: skip
    expert = dist.new_group(list(range(world)))
    rows = [GradRecord("layers.0.w", 0, 64, 0)]
    odd = rank == 1
    for case in CASES:
        kw = dict(expert_group=expert)
        if odd and case == "extra_fp32_buffer":
            kw["fp32_records"] = [GradRecord("router.weight", 0, 32, 0)]
        if odd and case == "extra_expert_buffer":
            kw["expert_records"] = [GradRecord("experts.0.w", 0, 64, 0)]
        if odd and case == "buckets":
            kw["buckets"] = (Span(0, 128), Span(128, 256))
        mine = rows
        if odd and case == "no_buffer_on_rank_1":  # its collectives run on the default device
            mine = None
        if case == "buffer_groups_only":  # no DDP groups: each buffer's group, renamed on 1
            kw["ddp_groups"] = False
            mine = [GradRecord("layers.0.renamed", 0, 64, 0)] if odd else rows
        try:
            DistributedDataParallel._check_layouts_agree(fake_ddp(mine, dist.group.WORLD, **kw))
            msg = "agree"
        except LayoutMismatchError as e:
            msg = str(e)
        except Exception as e:  # noqa: BLE001 - a timeout (the hang) is the failure reported
            msg = f"{type(e).__name__}: {e}"
        with open(os.path.join(out_dir, f"{case}-{rank}.txt"), "w") as f:
            f.write(msg)
        dist.barrier()  # the same collectives on every rank: nothing left pending
    dist.destroy_process_group()


def test_ranks_that_differ_get_a_named_error_not_a_hang(tmp_path):
    world = 2
    spawn(differing_worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world)
    got = {(c, r): (tmp_path / f"{c}-{r}.txt").read_text() for c in CASES for r in range(world)}
    for r in range(world):
        assert got["agree", r] == "agree"
        for case in CASES[1:]:
            m = got[case, r]
            assert m.startswith("gradient-buffer layouts differ"), (case, m)
            assert f"this is rank {r}" in m, (case, m)
        m = got["extra_fp32_buffer", r]
        assert "rank 0 built 1 buffers" in m and "rank 1 built 2" in m and "float32" in m, m
        assert "keep_in_fp32" in m
        m = got["extra_expert_buffer", r]  # on the expert group: none on rank 0
        assert "rank 0 built 0 buffers" in m and "rank 1 built 1" in m, m
        assert "buffer header" in got["buckets", r] and "rank 1 has" in got["buckets", r]
        m = got["no_buffer_on_rank_1", r]
        assert "rank 0 built 1 buffers" in m and "rank 1 built 0" in m, m
        m = got["buffer_groups_only", r]
        assert "parameter 'layers.0.w'" in m and "'layers.0.renamed'" in m, m


def test_first_difference_names_header_and_missing_rows():
    head = ("torch.bfloat16", "torch.bfloat16", 256, ((0, 256),))
    a = [head, ("w", 0, 64, 0)]
    assert "buffer header" in _first_difference([a, [(*head[:2], 512, head[3]), *a[1:]]], 0)
    assert "parameter 'w'" in _first_difference([a, [head]], 1)
