"""Host mirrors on the CPU: the copies of whole blocks, the bytes they hold, and the CPU
optimizer's parameters and gradients as views of them (mirrors built unpinned; pinned
memory needs CUDA, ``tests/gpu/test_offload_gpu.py``)."""

from __future__ import annotations

import pytest
import torch

from buffers.spans import (
    subtract_spans,
    to_local,
)
from megatron_ext.offload.host_mirror import build_buffer_mirror
from megatron_ext.offload.mirror_plan import mirror_layout
from tests.support.offload_sim import (
    MirrorPlaced,
    S,
    make_hdo,
    sim,
)

pytestmark = pytest.mark.mcore


@pytest.mark.parametrize(
    "grad_dtype,param_dtype",
    [
        (torch.bfloat16, torch.bfloat16),  # precision-aware, bf16 grads: converted on the host
        (torch.float32, torch.bfloat16),  # grads in fp32: CPU grads are staging views
        (torch.float32, torch.float32),  # fp32 parameters
    ],
)
def test_mirror_copies_move_whole_blocks(grad_dtype, param_dtype):
    gen = torch.Generator().manual_seed(0)
    numel = 1024
    owned = (S(0, 1024),)
    offloaded = [S(0, 40), S(64, 100), S(320, 400), S(448, 500)]
    resident = [S(128, 300)]
    layout = mirror_layout(owned, offloaded, resident)
    grads = torch.randn(numel, generator=gen).to(grad_dtype)
    params = torch.randn(numel, generator=gen).to(param_dtype)
    before = params.clone()
    m = build_buffer_mirror(
        "test", layout, owned_numel=1024, grads=grads, grads_coords=None, params=params,
        params_coords=None, cpu_dtype=torch.float32, pin=False,
    )  # fmt: skip
    stats = m.stats()
    assert stats["blocks"] == 2
    assert stats["staging_bytes"] == layout.staging_nbytes(grad_dtype, param_dtype)
    assert stats["staging_bytes"] <= stats["owned_bytes"]
    assert stats["d2h_bytes"] == layout.numel * grads.element_size()
    assert (stats["host_grad_bytes"] == 0) == (grad_dtype == torch.float32)
    m.load_params()
    for block in m.blocks:
        block.start_d2h()
    for block in m.blocks:
        block.convert_grads()
    for s in offloaded:
        p, g = m.cpu_views(s)
        assert torch.equal(g, grads[s.start : s.end].float())
        assert torch.equal(p, params[s.start : s.end].float())
        p.add_(1.0)  # "the CPU step"
    # pack the first block back: the second block's gradients must survive in staging
    m.blocks[0].pack_params()
    m.blocks[0].start_h2d()
    for s in offloaded[2:]:
        assert torch.equal(m.cpu_views(s)[1], grads[s.start : s.end].float())
    m.blocks[1].pack_params()
    m.blocks[1].start_h2d()
    for s in offloaded:
        assert torch.equal(
            params[s.start : s.end], (before[s.start : s.end].float() + 1).to(param_dtype)
        )
    untouched = subtract_spans(owned, layout.blocks)
    for s in untouched:
        assert torch.equal(params[s.start : s.end], before[s.start : s.end])


def test_mirror_reads_from_a_local_fp32_mirror_and_writes_to_a_local_device_flat():
    # non-precision-aware: gradients are an fp32 mirror of the owned ranges (end to end),
    # parameters go back into a flat of fp32 main shards laid out like the host mirror
    owned = (S(0, 256), S(512, 768))
    offloaded = [S(0, 40), S(64, 200), S(512, 600)]
    resident = [S(640, 700)]
    layout = mirror_layout(owned, offloaded, resident)
    mirror = torch.arange(512, dtype=torch.float32)
    device_flat = torch.zeros(layout.numel)
    m = build_buffer_mirror(
        "local", layout, owned_numel=512, grads=mirror, grads_coords=owned, params=device_flat,
        params_coords=layout.blocks, cpu_dtype=torch.float32, pin=False,
    )  # fmt: skip
    for block in m.blocks:
        block.start_d2h()
    for s in offloaded:
        (local,) = to_local([s], owned)
        assert torch.equal(m.cpu_views(s)[1], mirror[local.start : local.end])
        m.cpu_views(s)[0].fill_(s.start)
    for block in m.blocks:
        block.pack_params()
        block.start_h2d()
    for s in offloaded:
        local = layout.local(s)
        assert torch.all(device_flat[local.start : local.end] == s.start)


def test_cpu_params_and_grads_are_views_of_the_mirrors(cpu_streams):
    _, _, groups, sources, _, _ = sim(True, False, False, 1, 0)
    hdo = make_hdo(MirrorPlaced, groups, 1.0, True, sources)
    hosts = {m.host_params.untyped_storage().data_ptr() for m in hdo.host_mirrors}
    grads = {m.cpu_grads.untyped_storage().data_ptr() for m in hdo.host_mirrors}
    for cpu in hdo.cpu_copys_map_gpu_param:
        assert cpu.untyped_storage().data_ptr() in hosts
        assert cpu.grad.untyped_storage().data_ptr() in grads
    assert hdo.gpu_optimizer is None
    stats = hdo.host_mirror_stats()
    assert [s["blocks"] for s in stats] == [1, 1]  # fraction 1, one owned range each
    for s in stats:
        assert s["staging_bytes"] <= s["owned_bytes"]
    bf16 = next(s for s in stats if s["buffer"] == "bf16")
    assert bf16["d2h_bytes"] == bf16["staging_bytes"]  # bf16 moves as bf16
    assert bf16["host_grad_bytes"] == 2 * bf16["staging_bytes"]  # one fp32 conversion target


def test_a_parameter_outside_every_buffer_is_an_error(cpu_streams):
    _, _, groups, sources, _, _ = sim(True, False, False, 1, 0)
    with pytest.raises(RuntimeError, match="lie in no flat buffer"):
        make_hdo(MirrorPlaced, groups, 1.0, False, sources[:1])
