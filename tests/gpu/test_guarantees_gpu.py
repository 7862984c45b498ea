"""docs/guarantees.md's optimizer matrix at one rank: every cell correct, or refused at build.

{bf16, fp16} x {precision-aware + CPU offload 1.0 / 0.5, precision-aware with TE's FusedAdam,
distributed optimizer, plain optimizer} x {no fp32 local accumulation, a pattern, 'all'} x
{no loss scaler, static, dynamic}: megatron-core gives bf16 a scaler only with a static
``loss_scale`` and fp16 always one (dynamic unless ``loss_scale`` is set), so the scaler
column is bf16 none / static and fp16 static / dynamic. The 2-rank cells are configurations
of ``multirank_worker.py``.

Oracle, per step: fp64 over every parameter's reduced gradient as DDP leaves it (its
``main_grad``: the buffer slice, or the fp32 copy for fp32-local-accumulation parameters)
divided by the loss scale: the unscaled gradients the optimizer steps with. Checked: the
step's norm (1e-6), the zero count, per-parameter norms (1e-6), and the gradients the inner
optimizers (CPU ones included) actually step with: unscaled and clipped by megatron-core's
coefficient from the oracle norm.

Run on the GPU test machine: ``pytest -m cuda tests/gpu/test_guarantees_gpu.py``.
"""

import importlib.util
import math

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HIDDEN = 128
MAX_NORM = 0.05
STEPS = 3
HAVE_TE = importlib.util.find_spec("transformer_engine") is not None

SCALERS = ["bf16-none", "bf16-static", "fp16-static", "fp16-dynamic"]
OPTIMIZERS = {
    "pa_offload_1.0": dict(
        use_distributed_optimizer=True,
        use_precision_aware_optimizer=True,
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=1.0,
    ),
    "pa_offload_0.5": dict(
        use_distributed_optimizer=True,
        use_precision_aware_optimizer=True,
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=0.5,
    ),
    "pa_te_fused_adam": dict(use_distributed_optimizer=True, use_precision_aware_optimizer=True),
    "distopt": dict(use_distributed_optimizer=True),
    "plain": dict(use_distributed_optimizer=False),
}
PATTERNS = {"no_pattern": (), "fc2": ("*fc2*",), "all": ("all",)}


@pytest.fixture(autouse=True)
def _world(megatron_world):
    """Every test here runs inside the session's one-rank NCCL world (conftest.py)."""


class Mixed(torch.nn.Module):
    """Two low-precision linear layers and two parameters kept in fp32."""

    def __init__(self, dtype):
        super().__init__()
        from megatron_ext import mark_keep_in_fp32

        self.fc1 = torch.nn.Linear(HIDDEN, 4 * HIDDEN, dtype=dtype, device="cuda")
        self.fc2 = torch.nn.Linear(4 * HIDDEN, HIDDEN, dtype=dtype, device="cuda")
        self.hc_alpha = mark_keep_in_fp32(
            torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN, device="cuda"))
        )
        self.sink = mark_keep_in_fp32(torch.nn.Parameter(0.1 * torch.randn(HIDDEN, device="cuda")))

    def forward(self, x):
        h = self.fc2(torch.nn.functional.gelu(self.fc1(x.to(self.fc1.weight.dtype))))
        return h.float() * self.hc_alpha + self.sink


def refusal(scaler, opt_kind, pattern):
    """The error a refused cell raises at construction (a regex), or None."""
    dtype, kind = scaler.split("-")
    pa = opt_kind.startswith("pa_")
    if pa and dtype == "bf16" and kind != "none" and pattern != "all":
        return "precision-aware optimizer .* loss scale .* bf16"
    if opt_kind == "pa_te_fused_adam" and pattern == "fc2":
        return "transformer-engine's FusedAdam and fp32 local accumulation"
    return None


class Plain(torch.nn.Module):
    """Low-precision layers only (stock megatron-core cannot offload natively fp32 ones)."""

    def __init__(self, dtype):
        super().__init__()
        self.fc1 = torch.nn.Linear(HIDDEN, 4 * HIDDEN, dtype=dtype, device="cuda")
        self.fc2 = torch.nn.Linear(4 * HIDDEN, HIDDEN, dtype=dtype, device="cuda")

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x.to(self.fc1.weight.dtype)))).float()


def build(scaler, opt_kind, pattern, seed=0, *, option=True, module_cls=None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_ext

    dtype_name, kind = scaler.split("-")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float16
    torch.manual_seed(seed)
    module = (module_cls or Mixed)(dtype)
    tcfg = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        bf16=dtype_name == "bf16",
        fp16=dtype_name == "fp16",
        params_dtype=dtype,
    )
    opts = dict(OPTIMIZERS[opt_kind])
    distributed = opts.pop("use_distributed_optimizer")
    opts.update(
        optimizer="adam",
        lr=1e-3,
        bf16=dtype_name == "bf16",
        fp16=dtype_name == "fp16",
        clip_grad=MAX_NORM,
        log_num_zeros_in_grad=True,
    )
    if kind == "static":
        opts["loss_scale"] = 1024.0
    elif kind == "dynamic":
        opts.update(initial_loss_scale=2.0**12, min_loss_scale=1.0, loss_scale_window=1000)
    stack = megatron_ext.build_stack(
        module,
        tcfg,
        per_dtype_grad_buffers=option,
        distributed_optimizer=distributed,
        ddp=dict(param_name_patterns_for_fp32_local_accumulation=PATTERNS[pattern]),
        optimizer=opts,
        # the per-parameter CPU optimizers, whose step hooks record what each steps with
        # (record_stepped_grads); the chunked step equals them bit for bit
        # (tests/gpu/test_offload_gpu.py)
        options=megatron_ext.MegatronOptions(offload_step="per_parameter") if option else None,
    )
    return stack.model, stack.optimizer


def record_stepped_grads(opt) -> list[float]:
    """Step pre-hooks on every inner optimizer (CPU sub-optimizers included) that record the
    fp64 sum of squares and the zeros of the gradients each steps with, read when it steps
    (host mirrors reuse the staging bytes for parameters afterwards). Returns the list they
    append ``(sum of squares, zeros)`` to."""
    sums: list[tuple[float, int]] = []
    for child in opt.chained_optimizers:
        inner = child.optimizer
        if hasattr(inner, "cpu_optimizers"):  # megatron-core's HybridDeviceOptimizer
            optimizers = [*inner.cpu_optimizers, inner.gpu_optimizer]
            attr = "grad"
        else:
            optimizers = [inner]
            decoupled = child.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            attr = "decoupled_grad" if decoupled else "grad"
        for o in optimizers:
            if o is None:
                continue

            def hook(o, args, kwargs, attr=attr):
                total, zeros = 0.0, 0
                for g in o.param_groups:
                    for p in g["params"]:
                        grad = getattr(p, attr, None)
                        if grad is not None:
                            total += grad.double().square().sum().item()
                            zeros += int((grad == 0).sum())
                sums.append((total, zeros))

            o.register_step_pre_hook(hook)
    return sums


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("opt_kind", list(OPTIMIZERS))
@pytest.mark.parametrize("scaler", SCALERS)
def test_cell(scaler, opt_kind, pattern):
    if opt_kind == "pa_te_fused_adam" and not HAVE_TE:
        pytest.skip("needs transformer-engine (megatron-core's precision-aware FusedAdam)")
    refused = refusal(scaler, opt_kind, pattern)
    if refused is not None:
        from megatron_ext.refusals import UnsupportedCombinationError

        with pytest.raises(UnsupportedCombinationError, match=refused):
            build(scaler, opt_kind, pattern)
        return
    model, opt = build(scaler, opt_kind, pattern)
    names = {p: n for n, p in model.module.named_parameters()}
    stepped = record_stepped_grads(opt)
    g = torch.Generator(device="cuda").manual_seed(1)
    for step in range(STEPS):
        x = torch.randn(32, HIDDEN, device="cuda", generator=g)
        y = torch.randn(32, HIDDEN, device="cuda", generator=g)
        model.zero_grad_buffer()
        opt.zero_grad()
        scale = float(opt.get_loss_scale())
        loss = torch.nn.functional.mse_loss(model(x), y)
        (loss * scale).backward()
        model.finish_grad_sync()
        truth = {n: p.main_grad.double() / scale for p, n in names.items()}
        ref = math.sqrt(sum(t.square().sum().item() for t in truth.values()))
        if step == 1:
            opt.request_per_param_grad_norms()
        del stepped[:]
        ok, norm, num_zeros = opt.step()
        assert ok, f"step {step} skipped"
        assert abs(float(norm) - ref) <= 1e-6 * ref, (step, float(norm), ref)
        coeff = min(1.0, MAX_NORM / (ref + 1e-6))
        assert coeff < 1.0  # clipping is active
        assert stepped, "no inner optimizer stepped"
        got = math.sqrt(sum(t for t, _ in stepped))
        # megatron-core counts zeros after the clip (fp16 gradients underflow there too):
        # those of what the optimizers step with
        assert int(num_zeros) == sum(z for _, z in stepped), (step, int(num_zeros), stepped)
        assert abs(got - ref * coeff) <= 4e-3 * ref * coeff, (step, got, ref * coeff)
        if step == 1:
            pn = opt.take_per_param_grad_norms().as_dict()
            assert set(pn) == set(truth)
            for n, t in truth.items():
                want = t.square().sum().sqrt().item()
                assert abs(pn[n] - want) <= 1e-6 * want, (n, pn[n], want)


STOCK_FAILURES = [
    # megatron-core unscales bf16 decoupled gradients with a kernel torch lacks for bf16
    ("bf16-static", "pa_offload_1.0", "no_pattern"),
    ("bf16-static", "pa_offload_0.5", "fc2"),
    # transformer-engine's FusedAdam gets fp32 and bf16 gradients in one launch
    ("bf16-none", "pa_te_fused_adam", "fc2"),
    ("fp16-dynamic", "pa_te_fused_adam", "fc2"),
]


@pytest.mark.parametrize("cell", STOCK_FAILURES, ids="/".join)
def test_what_is_refused_fails_in_stock_at_the_first_step(cell):
    """Each refusal stands for a stock failure: stock megatron-core (option off) builds the
    same cell and fails at the first step (a model without natively fp32 parameters, which
    stock cannot offload at all)."""
    scaler, opt_kind, pattern = cell
    if opt_kind == "pa_te_fused_adam" and not HAVE_TE:
        pytest.skip("needs transformer-engine (megatron-core's precision-aware FusedAdam)")
    assert refusal(scaler, opt_kind, pattern) is not None
    model, opt = build(scaler, opt_kind, pattern, option=False, module_cls=Plain)
    x = torch.randn(32, HIDDEN, device="cuda")
    model.zero_grad_buffer()
    opt.zero_grad()
    (model(x).square().mean() * float(opt.get_loss_scale())).backward()
    model.finish_grad_sync()
    with pytest.raises(Exception) as e:  # noqa: PT011 - whichever error stock raises
        opt.step()
        torch.cuda.synchronize()
    print(cell, type(e.value).__name__, str(e.value)[:300])
