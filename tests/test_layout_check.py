"""Data-parallel ranks that built different layouts get a clear error, not a hang."""

import os
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from buffers.spans import Span
from megatron_ext.ddp import DistributedDataParallel, LayoutMismatchError, _first_difference
from megatron_ext.layout import BufferKey, BufferLayout, ChunkLayout
from megatron_ext.spans import GradRecord


def fake_ddp(records, group, *, fp32_records=None, expert_group=None):
    """A DDP as _check_layouts_agree reads it: a bf16 buffer, optionally an fp32 one, and
    megatron-core's two data-parallel groups (dense, expert)."""
    bufs, layouts = {}, []
    for dtype, rows in ((torch.bfloat16, records), (torch.float32, fp32_records)):
        if rows is None:
            continue
        key = BufferKey(dtype, dtype, False)
        bufs[key] = types.SimpleNamespace(
            param_dtype=dtype,
            grad_dtype=dtype,
            numel=256,
            bucket_indices=[(0, 256)],
            data_parallel_group=group,
            grad_data=torch.zeros(256, dtype=dtype),
        )
        layouts.append(
            BufferLayout(key, 256, (Span(0, 256),), tuple(rows), group.size(), group.rank())
        )
    return types.SimpleNamespace(
        layout=ChunkLayout(tuple(layouts)),
        grad_buffer=bufs.__getitem__,
        intra_dp_cp_group=group,
        intra_expt_dp_group=expert_group if expert_group is not None else group,
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
    mp.spawn(worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world)
    same = [(tmp_path / f"{r}-False.txt").read_text() for r in range(world)]
    assert same == ["agree"] * world
    for r in range(world):
        m = (tmp_path / f"{r}-True.txt").read_text()
        assert "parameter 'layers.0.b'" in m and "rank 2 has ('layers.0.bias_renamed'" in m


def extra_buffer_worker(rank, world, init_file, out_dir):
    """Rank 1 keeps a parameter in fp32 (an extra fp32 buffer): with one collective per
    buffer, rank 0 would wait for a second all-gather rank 1 never makes."""
    import datetime

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )  # fmt: skip
    expert = dist.new_group(list(range(world)))
    rows = [GradRecord("layers.0.w", 0, 64, 0)]
    extra = [GradRecord("router.weight", 0, 32, 0)] if rank == 1 else None
    try:
        ddp = fake_ddp(rows, dist.group.WORLD, fp32_records=extra, expert_group=expert)
        DistributedDataParallel._check_layouts_agree(ddp)
        msg = "agree"
    except LayoutMismatchError as e:
        msg = str(e)
    except Exception as e:  # noqa: BLE001 - a timeout (the hang) is the failure reported
        msg = f"{type(e).__name__}: {e}"
    with open(os.path.join(out_dir, f"extra-{rank}.txt"), "w") as f:
        f.write(msg)
    dist.barrier()  # the same collectives on every rank: nothing left pending
    dist.destroy_process_group()


def test_a_rank_with_an_extra_buffer_gets_a_named_error_not_a_hang(tmp_path):
    world = 2
    mp.spawn(extra_buffer_worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world)
    for r in range(world):
        m = (tmp_path / f"extra-{r}.txt").read_text()
        assert m.startswith("gradient-buffer layouts differ"), m
        assert "rank 0 built 1 buffers" in m and "rank 1 built 2" in m and "float32" in m, m
        assert f"this is rank {r}" in m and "keep_in_fp32" in m


def test_first_difference_names_header_and_missing_rows():
    head = ("torch.bfloat16", "torch.bfloat16", 256, ((0, 256),))
    a = [head, ("w", 0, 64, 0)]
    assert "buffer header" in _first_difference([a, [(*head[:2], 512, head[3]), *a[1:]]], 0)
    assert "parameter 'w'" in _first_difference([a, [head]], 1)
