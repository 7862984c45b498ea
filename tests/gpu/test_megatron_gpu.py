"""Megatron-Core DDP + optimizers with per_dtype_grad_buffers, on one CUDA GPU.

Run on the GPU test machine: ``pytest -m cuda tests/gpu``. Megatron's DDP and optimizers
only run on CUDA, so these cannot run in CPU CI.
"""

import pytest
import torch

from tests.support.gpu_mixed_stack import (
    HIDDEN,
    KINDS,
    MAX_NORM,
    Mixed,
    backward,
    build,
    data,
    reference_norm,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def _world(megatron_world):
    """Every test here runs inside the session's one-rank NCCL world (conftest.py)."""


# Stock megatron-core 0.19.2 cannot build these with natively fp32 parameters.
STOCK_FAILS = {k for k, v in KINDS.items() if v.get("optimizer_cpu_offload")}


def optimizer_grads(opt):
    out = []
    for child in opt.chained_optimizers:
        attr = (
            "decoupled_grad"
            if child.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            else "grad"
        )
        for p in child.get_parameters():
            g = getattr(p, attr, None)
            if g is not None:
                out.append(g)
    return out


def padding_is_zero(model):
    for buf in model.all_grad_buffers():
        mask = torch.ones(buf.numel, dtype=torch.bool, device="cuda")
        for start, end, _ in buf.param_index_map.values():
            mask[start:end] = False
        if buf.grad_data[mask].ne(0).any():
            return False
    return True


@pytest.mark.parametrize("fp32_first", [False, True], ids=["fp32_last", "fp32_first"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_norm_clip_and_training_with_option(kind, fp32_first):
    import megatron_ext

    model, opt = build(kind, True, fp32_first)
    assert type(opt).__name__ == "FlatChainedOptimizer"
    assert len(opt.chained_optimizers) == (2 if KINDS[kind].get("experts") else 1)
    if kind == "distopt_buckets":
        assert max(len(b.buckets) for b in model.all_grad_buffers()) > 1
    audit = megatron_ext.audit_norm_ownership([model], opt)
    assert audit.pieces == len(list(model.module.parameters()))
    table = megatron_ext.explain_norm([model], opt)
    assert "counted" in table and "hc_alpha" in table
    dtypes = {buf.grad_dtype for buf in model.all_grad_buffers()}
    if kind != "fp32":
        assert dtypes == {torch.bfloat16, torch.float32}  # bf16 buffer + fp32 island
    x, y = data()
    losses = []
    for _ in range(3):  # eager, then captured, then replayed as a CUDA graph
        losses.append(backward(model, opt, x, y))
        ref = reference_norm(model)
        assert not opt.prepare_grads()
        before = [g.detach().double().clone() for g in optimizer_grads(opt)]
        norm = opt.clip_grad_norm(MAX_NORM)
        assert isinstance(norm, torch.Tensor) and norm.device.type == "cuda"
        assert norm.item() == pytest.approx(ref, rel=1e-5)
        coeff = MAX_NORM / (ref + 1e-6)
        assert coeff < 1
        after = optimizer_grads(opt)
        assert len(after) == len(before) > 0
        for b, a in zip(before, after, strict=True):
            tol = 2**-7 if a.dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(a.double(), b * coeff, rtol=tol, atol=1e-12)
        assert padding_is_zero(model)
        assert opt.step_with_ready_grads()
    for _ in range(6):
        losses.append(backward(model, opt, x, y))
        ref = reference_norm(model)
        ok, grad_norm, _ = opt.step()
        assert ok and grad_norm.item() == pytest.approx(ref, rel=1e-5)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("kind", sorted(set(KINDS) - STOCK_FAILS))
def test_matches_stock_where_stock_runs(kind):
    model, opt = build(kind, True)
    stock_model, stock_opt = build(kind, False)
    assert type(stock_opt).__name__ == "ChainedOptimizer"  # option off: untouched stock
    x, y = data()
    backward(model, opt, x, y)
    backward(stock_model, stock_opt, x, y)
    ref = reference_norm(model)
    ok, ours, _ = opt.step()
    stock_ok, stock, _ = stock_opt.step()
    assert ok and stock_ok
    assert float(ours) == pytest.approx(float(stock), rel=1e-5)
    assert float(ours) == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("kind", sorted(STOCK_FAILS))
def test_stock_fails_where_option_trains(kind):
    with pytest.raises(ValueError, match="non-leaf"):
        build(kind, False)
    build(kind, True)  # and ours builds (it trains in the test above)


@pytest.mark.parametrize(
    "kind", ["distopt", "float16", "distopt_pa_offload_0.5", "distopt_experts"]
)
def test_same_collectives_as_stock(kind, monkeypatch):
    import torch.distributed as dist

    calls = []
    real = dist.all_reduce

    def counting(tensor, *a, **k):
        calls.append((tensor.dtype, tensor.numel()))
        return real(tensor, *a, **k)

    def count(model, opt):
        x, y = data()
        backward(model, opt, x, y)
        opt.step()  # megatron-core caches a one-time flag all-reduce at its first step
        backward(model, opt, x, y)
        calls.clear()
        monkeypatch.setattr(dist, "all_reduce", counting)
        opt.step()
        monkeypatch.setattr(dist, "all_reduce", real)
        return [c[0] for c in calls]

    ours = count(*build(kind, True))
    if kind in STOCK_FAILS:
        assert ours == [torch.float32]  # the norm's one SUM all-reduce
        return
    assert ours == count(*build(kind, False))


def test_no_host_sync_in_norm_and_clip():
    model, opt = build("distopt_pa_offload_0.5", True)
    x, y = data()
    backward(model, opt, x, y)
    opt.prepare_grads()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.get_grad_norm()
        opt.clip_grad_norm(MAX_NORM)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_fp32_local_accumulation_lives_in_one_island():
    model, opt = build("distopt", True, patterns=("fc1.*",))
    islands = model.fp32_islands()
    assert len(islands) == 1
    assert sum(b.island_numel for b in model.layout.buffers) == islands[0].numel()
    island = islands[0]
    for p in (model.module.fc1.weight, model.module.fc1.bias):
        assert p.main_grad.dtype == torch.float32
        assert p.main_grad.untyped_storage().data_ptr() == island.untyped_storage().data_ptr()
    x, y = data()
    backward(model, opt, x, y)
    ref = reference_norm(model)
    opt.prepare_grads()
    assert opt.get_grad_norm().item() == pytest.approx(ref, rel=1e-5)


def test_float16_module_keeps_marked_params_fp32_unrounded():
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_ext

    torch.manual_seed(0)
    inner = Mixed(fp32_first=False, all_fp32=True)
    want = inner.hc_alpha.detach().clone()
    cfg = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, bf16=True)
    wrapped = megatron_ext.Float16Module(cfg, inner)
    assert wrapped.module.fc1.weight.dtype == torch.bfloat16
    assert wrapped.module.hc_alpha.dtype == torch.float32
    assert torch.equal(wrapped.module.hc_alpha.detach(), want)


def test_install_makes_stock_list_functions_dtype_safe():
    import megatron.core.optimizer.clip_grads as cg
    import megatron.core.optimizer.optimizer as mopt

    import megatron_ext

    grads = [
        torch.full((128,), 1 / 64, dtype=torch.bfloat16, device="cuda"),
        torch.full((128,), 1 / 64, dtype=torch.float32, device="cuda"),
    ]
    original = cg.get_grad_norm_fp32
    replaced = megatron_ext.install()
    try:
        assert "megatron.core.optimizer.optimizer.get_grad_norm_fp32" in replaced
        assert float(mopt.get_grad_norm_fp32(grads)) == 0.25
        assert float(mopt.get_grad_norm_fp32(grads[::-1])) == 0.25
    finally:
        megatron_ext.uninstall()
    assert cg.get_grad_norm_fp32 is original and mopt.get_grad_norm_fp32 is original
