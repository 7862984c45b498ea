"""An MoE router whose weight is kept in fp32 beside bf16 activations.

megatron-core's gating (``moe_utils.router_gating_linear``) multiplies the router's input by
its weight as they come. With transformer-engine installed the product is TE's GEMM, which
cuBLAS refuses for a bf16 input and an fp32 weight ("an unsupported value or parameter was
passed to the function": Megatron-LM's ``--moe-router-dtype fp32`` with the router weight
kept in fp32, on an H200 with TE 2.20.2); without TE it rounds the fp32 weight to bf16
unless ``moe_router_dtype`` is fp32. ``megatron_ext.fp32.align_router_inputs`` (called by
our DDP) casts the router's input to the weight's dtype.

CPU tests, megatron-core's real ``TopKRouter`` at one spawned gloo rank through
``tests/support/cpu_megatron.py``; TE's GEMM is a stand-in that refuses mixed operand
dtypes as cuBLAS does and otherwise multiplies in the output dtype. Oracles: fp64 products
of the same bf16 input and fp32 weight.
"""

import pytest
import torch

from tests.support.megatron_ranks import run_ranks

pytestmark = pytest.mark.mcore

H, E, TOKENS = 48, 4, 24


def refusing_gemm(A, B, out_dtype, layout="TN", bias=None, grad=False):
    """TE's ``general_gemm`` as megatron-core's router calls it (D = B A^T for "TN", B A for
    "NN", B^T A for "NT"), refusing operands of two dtypes as cuBLAS does."""
    if A.dtype != B.dtype:
        raise RuntimeError(
            "cuBLAS Error: an unsupported value or parameter was passed to the function"
        )
    a, b = A.to(out_dtype), B.to(out_dtype)
    out = {"TN": lambda: b @ a.t(), "NN": lambda: b @ a, "NT": lambda: b.t() @ a}[layout]()
    return (out if bias is None else out + bias,)


def router(router_dtype):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.router import TopKRouter

    import megatron_ext

    cfg = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E,
        moe_router_topk=2, moe_router_dtype=router_dtype, moe_aux_loss_coeff=0.0,
        add_bias_linear=False,
        bf16=True, params_dtype=torch.bfloat16,
    )  # fmt: skip
    r = TopKRouter(config=cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    megatron_ext.mark_keep_in_fp32(r.weight)
    megatron_ext.cast_marked_to_fp32(r)
    g = torch.Generator().manual_seed(5)
    # fp32 values bf16 cannot hold: a weight rounded through bf16 is off by ~1e-3
    r.weight.data = torch.randn(E, H, generator=g) * (1 + 1 / 3000)
    return r


def gate(r, x):
    """The router's forward on ``x``; the logits its gating produced (kept with their graph)."""
    seen = []
    gating = r.gating

    def recording(inp):
        seen.append(gating(inp))
        return seen[-1]

    r.gating = recording
    r(x)
    return seen[-1]


def router_job(rank, world, log, out_dir, te, router_dtype, aligned):
    from megatron.core.transformer.moe import moe_utils

    from megatron_ext import fp32

    saved = moe_utils.te_general_gemm
    moe_utils.te_general_gemm = refusing_gemm if te else None
    try:
        r = router(router_dtype)
        hooked = fp32.align_router_inputs(r) if aligned else []
        again = fp32.align_router_inputs(r) if aligned else []
        g = torch.Generator().manual_seed(6)
        x = (torch.randn(TOKENS, 1, H, generator=g)).to(torch.bfloat16).requires_grad_()
        try:
            logits = gate(r, x)
        except RuntimeError as e:
            return dict(error_text=str(e), hooked=hooked)
        grad_out = torch.randn(logits.shape, generator=g, dtype=torch.float64)
        (logits.double() * grad_out).sum().backward()
        return dict(
            hooked=hooked, again=again, x=x.detach(), w=r.weight.detach().clone(),
            logits=logits.detach(), grad_out=grad_out, w_grad=r.weight.grad.clone(),
            x_grad=x.grad.clone(),
        )  # fmt: skip
    finally:
        moe_utils.te_general_gemm = saved


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def check_fp32_gating(out: dict) -> None:
    x, w, g = out["x"].double().reshape(TOKENS, H), out["w"].double(), out["grad_out"]
    assert out["w"].dtype == torch.float32
    assert out["logits"].dtype == torch.float32
    assert rel(out["logits"].reshape(TOKENS, E), x @ w.t()) < 1e-6
    assert out["w_grad"].dtype == torch.float32
    assert rel(out["w_grad"], g.reshape(TOKENS, E).t() @ x) < 1e-6
    assert out["x_grad"].dtype == torch.bfloat16  # back in the input's dtype
    want = (g.reshape(TOKENS, E) @ w).reshape(TOKENS, 1, H)
    assert rel(out["x_grad"], want) < 1e-2  # one bf16 rounding


@pytest.mark.parametrize("router_dtype", ["fp32", None])
def test_with_transformer_engine_the_gating_refuses_mixed_dtypes_unless_aligned(
    tmp_path, router_dtype
):
    (stock,) = run_ranks(tmp_path, 1, router_job, True, router_dtype, False)
    assert "unsupported value" in stock["error_text"]
    (ours,) = run_ranks(tmp_path, 1, router_job, True, router_dtype, True)
    assert ours["hooked"] == [""] and ours["again"] == []
    check_fp32_gating(ours)


def test_without_transformer_engine_the_weight_is_no_longer_rounded_to_bf16(tmp_path):
    """moe_router_dtype unset: megatron-core's torch path computes in the input's dtype, so
    the fp32 weight is used rounded to bf16 (logits ~1e-3 off fp64); aligned, in fp32."""
    (stock,) = run_ranks(tmp_path, 1, router_job, False, None, False)
    x, w = stock["x"].double().reshape(TOKENS, H), stock["w"].double()
    assert stock["logits"].dtype == torch.bfloat16
    assert rel(stock["logits"].reshape(TOKENS, E), x @ w.t()) > 1e-4
    (ours,) = run_ranks(tmp_path, 1, router_job, False, None, True)
    check_fp32_gating(ours)


def test_a_router_kept_in_bf16_is_left_alone(tmp_path):
    from megatron_ext import fp32

    class Plain(torch.nn.Module):  # not a megatron-core router, fp32 weight: not touched
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(2))
            fp32.mark_keep_in_fp32(self.weight)

    assert fp32.align_router_inputs(Plain()) == []
    (out,) = run_ranks(tmp_path, 1, unmarked_job)
    assert out == {"hooked": [], "hooks": 0}


def unmarked_job(rank, world, log, out_dir):
    from megatron_ext import fp32

    r = router("fp32")
    r.weight.keep_in_fp32 = False
    hooked = fp32.align_router_inputs(r)
    return {"hooked": hooked, "hooks": len(r._forward_pre_hooks)}


def ddp_job(rank, world, log, out_dir, option):
    """megatron_ext's DistributedDataParallel over a module holding a router whose weight is
    marked: the hook is there with the option on (the weight is fp32) and not with it off."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    import megatron_ext

    holder = torch.nn.Module()
    holder.router = router("fp32")
    holder.router.weight.data = holder.router.weight.data.bfloat16()
    tcfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, bf16=True)
    dcfg = megatron_ext.DistributedDataParallelConfig(per_dtype_grad_buffers=option)
    assert isinstance(dcfg, DistributedDataParallelConfig)
    megatron_ext.DistributedDataParallel(tcfg, dcfg, holder)
    return {
        "dtype": str(holder.router.weight.dtype),
        "hooks": len(holder.router._forward_pre_hooks),
    }


@pytest.mark.parametrize("option", [True, False])
def test_our_ddp_aligns_the_routers_it_keeps_in_fp32(tmp_path, option):
    (out,) = run_ranks(tmp_path, 1, ddp_job, option)
    if option:
        assert out == {"dtype": "torch.float32", "hooks": 1}
    else:
        assert out == {"dtype": "torch.bfloat16", "hooks": 0}


def float16_job(rank, world, log, out_dir):
    """megatron_ext's Float16Module (what --keep-in-fp32-params installs, with or without
    --per-dtype-grad-buffers) leaves the marked router weight fp32 and aligns its input."""
    from megatron.core.transformer import TransformerConfig

    import megatron_ext

    holder = torch.nn.Module()
    holder.router = router("fp32")
    tcfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, bf16=True)
    wrapped = megatron_ext.Float16Module(tcfg, holder)
    r = wrapped.module.router
    return {"dtype": str(r.weight.dtype), "hooks": len(r._forward_pre_hooks)}


def test_our_float16_module_aligns_the_routers_it_keeps_in_fp32(tmp_path):
    (out,) = run_ranks(tmp_path, 1, float16_job)
    assert out == {"dtype": "torch.float32", "hooks": 1}


def test_the_hook_casts_the_input_however_it_is_passed_and_nothing_else():
    """The pre-hook on its own: the input cast to the weight's dtype when passed by position
    or as ``input=``; other arguments, an input already in the weight's dtype and an
    integer tensor left alone."""
    from megatron_ext.fp32 import _input_to_weight_dtype

    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(3))

        def forward(self, input, mask=None):
            return input, mask

    gate = Gate()
    gate.register_forward_pre_hook(_input_to_weight_dtype, with_kwargs=True)
    x = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
    mask = torch.tensor([1.0, 0.0], dtype=torch.bfloat16)
    for got, m in (gate(x, mask), gate(input=x, mask=mask)):
        assert got.dtype == torch.float32 and torch.equal(got, x.float())
        assert m is mask  # only the input is cast
    same = torch.ones(3)
    assert gate(same)[0] is same and gate(input=same)[0] is same
    ints = torch.arange(3)
    assert gate(ints)[0] is ints
