"""Combinations megatron-core cannot step are refused when the optimizer is built."""

import types

import pytest
import torch

from megatron_ext.layout import BufferKey
from megatron_ext.refusals import UnsupportedCombinationError, check

pytestmark = pytest.mark.mcore


class _FusedAdam:  # stands for transformer_engine.pytorch.optimizers.FusedAdam
    pass


_FusedAdam.__module__ = "transformer_engine.pytorch.optimizers.fused_adam"


def placed_buffer(dtype, *, island_params=0, params=3):
    ps = [torch.nn.Parameter(torch.zeros(4)) for _ in range(params)]
    buf = types.SimpleNamespace(
        grad_dtype=dtype,
        param_index_map={p: (64 * i, 64 * i + 4, 0) for i, p in enumerate(ps)},
        buckets=[types.SimpleNamespace(params_with_extra_main_grads=ps[:island_params])],
    )
    layout = types.SimpleNamespace(key=BufferKey(dtype, dtype, False))
    island = torch.zeros(64 * island_params) if island_params else None
    return buf, layout, island


def child(placed, *, pa=True, loss_scale=None, fp16=False, inner=None, stub=False):
    return types.SimpleNamespace(
        config=types.SimpleNamespace(
            use_precision_aware_optimizer_no_fp8_or_ds_fp8=pa, loss_scale=loss_scale, fp16=fp16
        ),
        grad_scaler=object() if (loss_scale or fp16) else None,
        buffers=[b for b, _, _ in placed],
        optimizer=inner,
        is_stub_optimizer=stub,
    )


def test_bf16_precision_aware_with_a_loss_scale_is_refused_naming_it():
    placed = [placed_buffer(torch.bfloat16), placed_buffer(torch.float32)]
    with pytest.raises(UnsupportedCombinationError) as e:
        check(child(placed, loss_scale=1024.0), placed)
    msg = str(e.value)
    assert "precision-aware" in msg and "loss_scale=1024.0" in msg and "bf16" in msg
    assert "drop loss_scale" in msg


@pytest.mark.parametrize(
    "case",
    [
        dict(dtype=torch.float16, kw=dict(fp16=True)),  # fp16 has the kernel
        dict(dtype=torch.bfloat16, kw=dict()),  # no scaler
        dict(dtype=torch.bfloat16, kw=dict(loss_scale=8.0, pa=False)),  # unscales fp32 mains
        dict(dtype=torch.float32, kw=dict(loss_scale=8.0)),  # grad_reduce_in_fp32
        dict(dtype=torch.bfloat16, kw=dict(loss_scale=8.0, stub=True)),  # holds nothing
    ],
)
def test_what_megatron_core_can_step_is_accepted(case):
    placed = [placed_buffer(case["dtype"])]
    check(child(placed, **case["kw"]), placed)


def test_bf16_buffer_read_wholly_from_its_island_is_accepted_with_a_loss_scale():
    placed = [placed_buffer(torch.bfloat16, island_params=3)]  # pattern 'all'
    check(child(placed, loss_scale=8.0), placed)
    placed = [placed_buffer(torch.bfloat16, island_params=2)]  # one still read in bf16
    with pytest.raises(UnsupportedCombinationError):
        check(child(placed, loss_scale=8.0), placed)


def test_only_this_optimizers_buffers_count():
    mine, other = placed_buffer(torch.float16), placed_buffer(torch.bfloat16)
    c = child([mine], fp16=True)
    check(c, [mine, other])  # the bf16 buffer belongs to another optimizer of the chain


def test_te_fused_adam_with_fp32_local_accumulation_is_refused():
    placed = [placed_buffer(torch.bfloat16, island_params=1)]
    with pytest.raises(UnsupportedCombinationError) as e:
        check(child(placed, inner=_FusedAdam()), placed)
    msg = str(e.value)
    assert "_FusedAdam" in msg and "param_name_patterns_for_fp32_local_accumulation" in msg
    # the same without TE's optimizer (CPU offload: megatron-core's HybridDeviceOptimizer),
    # without islands, or with fp32 gradients: accepted
    check(child(placed, inner=object()), placed)
    plain = [placed_buffer(torch.bfloat16)]
    check(child(plain, inner=_FusedAdam()), plain)
    fp32 = [placed_buffer(torch.float32, island_params=1)]
    check(child(fp32, inner=_FusedAdam()), fp32)
    every = [placed_buffer(torch.bfloat16, island_params=3)]  # 'all': one dtype per launch
    check(child(every, inner=_FusedAdam()), every)
    check(child(placed, inner=_FusedAdam(), pa=False), placed)


def test_the_error_is_public():
    import megatron_ext

    assert megatron_ext.UnsupportedCombinationError is UnsupportedCombinationError
    assert issubclass(UnsupportedCombinationError, ValueError)
