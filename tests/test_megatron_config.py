"""The DDP config option and the pure-Python parts of megatron_ext, on the CPU."""

import pytest
import torch

import megatron_ext

pytestmark = pytest.mark.mcore


def test_option_defaults_off_and_is_a_megatron_config():
    from megatron.core.distributed import DistributedDataParallelConfig as Stock

    cfg = megatron_ext.DistributedDataParallelConfig()
    assert isinstance(cfg, Stock) and cfg.per_dtype_grad_buffers is False
    on = megatron_ext.DistributedDataParallelConfig(
        per_dtype_grad_buffers=True, use_distributed_optimizer=True
    )
    assert on.per_dtype_grad_buffers and on.use_distributed_optimizer


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(use_megatron_fsdp=True), "Megatron-FSDP"),
        (dict(num_distributed_optimizer_instances=2, use_distributed_optimizer=True), "instances"),
    ],
)
def test_unsupported_combinations_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        megatron_ext.DistributedDataParallelConfig(per_dtype_grad_buffers=True, **bad)


def test_mark_keep_in_fp32_and_cast_back():
    lin = torch.nn.Linear(4, 4)
    megatron_ext.mark_keep_in_fp32(lin.bias)
    lin.bfloat16()
    assert megatron_ext.cast_marked_to_fp32(lin) == ["bias"]
    assert lin.bias.dtype == torch.float32 and lin.weight.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="floating-point"):
        megatron_ext.mark_keep_in_fp32(torch.zeros(2, dtype=torch.int64))


def test_option_off_returns_stock_optimizer_factory_result(monkeypatch):
    import megatron.core.optimizer as mopt

    sentinel = object()
    monkeypatch.setattr(mopt, "get_megatron_optimizer", lambda *a, **k: sentinel)
    chunk = type("Chunk", (), {"per_dtype_grad_buffers": False})()
    assert megatron_ext.get_megatron_optimizer(object(), [chunk]) is sentinel
    mixed = [chunk, type("Chunk", (), {"per_dtype_grad_buffers": True})()]
    with pytest.raises(ValueError, match="same ddp_config"):
        megatron_ext.get_megatron_optimizer(object(), mixed)


@pytest.fixture
def gloo_world(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("order", [1, -1])
def test_install_replaces_everywhere_and_uninstall_restores(gloo_world, order):
    import megatron.core.optimizer.clip_grads as cg
    import megatron.core.optimizer.optimizer as mopt

    originals = (cg.get_grad_norm_fp32, cg.clip_grad_by_total_norm_fp32)
    grads = [torch.full((128,), 1 / 64, dtype=torch.bfloat16), torch.full((128,), 1 / 64)][::order]
    replaced = megatron_ext.install()
    try:
        assert {
            "megatron.core.optimizer.clip_grads.get_grad_norm_fp32",
            "megatron.core.optimizer.optimizer.get_grad_norm_fp32",
            "megatron.core.optimizer.optimizer.clip_grad_by_total_norm_fp32",
        } <= set(replaced)
        assert megatron_ext.install() == replaced  # idempotent
        norm = mopt.get_grad_norm_fp32(grads)
        assert norm.item() == 0.25
        params = [torch.nn.Parameter(torch.zeros(128, dtype=g.dtype)) for g in grads]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        mopt.clip_grad_by_total_norm_fp32(params, 0.125, norm)
        for p in params:  # coefficient 0.125 / (0.25 + 1e-6): every gradient about halved
            torch.testing.assert_close(
                p.grad.double(),
                torch.full((128,), 0.5 / 64, dtype=torch.float64),
                rtol=2**-7,
                atol=0,
            )
    finally:
        megatron_ext.uninstall()
    assert (cg.get_grad_norm_fp32, cg.clip_grad_by_total_norm_fp32) == originals
    assert mopt.get_grad_norm_fp32 is originals[0]
