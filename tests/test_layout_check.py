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


def fake_ddp(records, group):
    buf = types.SimpleNamespace(
        param_dtype=torch.bfloat16,
        grad_dtype=torch.bfloat16,
        numel=256,
        bucket_indices=[(0, 256)],
        data_parallel_group=group,
        grad_data=torch.zeros(256, dtype=torch.bfloat16),
    )
    layout = BufferLayout(
        BufferKey(torch.bfloat16, torch.bfloat16, False), 256, (Span(0, 256),), tuple(records),
        group.size(), group.rank(),
    )  # fmt: skip
    return types.SimpleNamespace(layout=ChunkLayout((layout,)), grad_buffer=lambda key: buf)


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


def test_first_difference_names_header_and_missing_rows():
    head = ("torch.bfloat16", "torch.bfloat16", 256, ((0, 256),))
    a = [head, ("w", 0, 64, 0)]
    assert "buffer header" in _first_difference([a, [(*head[:2], 512, head[3]), *a[1:]]], 0)
    assert "parameter 'w'" in _first_difference([a, [head]], 1)
