"""megatron-core's DDP and optimizers over a model of bf16 layers and natively fp32
parameters, on one CUDA GPU (test support for ``tests/gpu/test_megatron_gpu.py`` and
``tests/gpu/test_megatron_memory_gpu.py``): the model, each optimizer kind of ``KINDS``
built with or without ``per_dtype_grad_buffers``, data, a backward pass and the fp64 norm
of the reduced gradients.
"""

import math

import torch

HIDDEN = 256


MAX_NORM = 0.05  # small enough that clipping is active on these gradients


class Mixed(torch.nn.Module):
    """bf16 linear layers plus natively fp32 parameters, registered before or after them."""

    def __init__(self, fp32_first: bool, all_fp32: bool = False):
        super().__init__()
        from megatron_ext import mark_keep_in_fp32

        dt = torch.float32 if all_fp32 else torch.bfloat16
        if fp32_first:
            self.sink = torch.nn.Parameter(torch.randn(HIDDEN, device="cuda") * 0.1)
        self.fc1 = torch.nn.Linear(HIDDEN, 4 * HIDDEN, dtype=dt, device="cuda")
        self.fc2 = torch.nn.Linear(4 * HIDDEN, HIDDEN, dtype=dt, device="cuda")
        self.hc_alpha = torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN, device="cuda"))
        if not fp32_first:
            self.sink = torch.nn.Parameter(torch.randn(HIDDEN, device="cuda") * 0.1)
        mark_keep_in_fp32(self.sink)
        mark_keep_in_fp32(self.hc_alpha)

    def forward(self, x):
        h = self.fc2(torch.nn.functional.gelu(self.fc1(x.to(self.fc1.weight.dtype))))
        return h.float() * self.hc_alpha + self.sink


KINDS = {
    "distopt": dict(use_distributed_optimizer=True),
    # several buckets per buffer: spans and fp32 mirrors cross bucket boundaries
    "distopt_buckets": dict(
        use_distributed_optimizer=True, ddp=dict(overlap_grad_reduce=True, bucket_size=40_000)
    ),
    "distopt_offload_0.5": dict(
        use_distributed_optimizer=True, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5
    ),
    "distopt_pa_offload_1.0": dict(
        use_distributed_optimizer=True,
        use_precision_aware_optimizer=True,
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=1.0,
    ),
    "distopt_pa_offload_0.5": dict(
        use_distributed_optimizer=True,
        use_precision_aware_optimizer=True,
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=0.5,
    ),
    "distopt_pa_offload_0.0": dict(
        use_distributed_optimizer=True,
        use_precision_aware_optimizer=True,
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=0.0,
    ),
    # fc2 as expert parameters (allreduce=False): expert buffers and a second child
    # optimizer, so the norm and clip run over a chain of two over one shared group
    "distopt_experts": dict(use_distributed_optimizer=True, experts=True),
    "float16": dict(use_distributed_optimizer=False),
    "fp32": dict(use_distributed_optimizer=False, bf16=False),
}


def build(kind, option, fp32_first=False, patterns=(), seed=0):
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_ext

    opts = dict(KINDS[kind])
    bf16 = opts.pop("bf16", True)
    ddp_overrides = opts.pop("ddp", {})
    experts = opts.pop("experts", False)
    torch.manual_seed(seed)
    module = Mixed(fp32_first, all_fp32=not bf16)
    if experts:
        for p in module.fc2.parameters():
            p.allreduce = False  # megatron-core's mark of an expert-parallel parameter
    tcfg = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    stack = megatron_ext.build_stack(
        module,
        tcfg,
        per_dtype_grad_buffers=option,
        distributed_optimizer=opts.pop("use_distributed_optimizer"),
        ddp=dict(param_name_patterns_for_fp32_local_accumulation=patterns, **ddp_overrides),
        optimizer=dict(optimizer="adam", lr=1e-3, bf16=bf16, clip_grad=MAX_NORM, **opts),
    )
    return stack.model, stack.optimizer


def data(seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(32, HIDDEN, device="cuda", generator=g)
    y = torch.randn(32, HIDDEN, device="cuda", generator=g)
    return x, y


def backward(model, opt, x, y):
    model.zero_grad_buffer()
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    model.finish_grad_sync()
    return loss.item()


def reference_norm(model):
    sq = sum(p.main_grad.double().square().sum() for p in model.module.parameters())
    return math.sqrt(sq.item())
