"""megatron-core's CPU offload through host mirrors or its per-parameter path, on one CUDA
GPU (test support for ``tests/gpu/test_offload_gpu.py`` and
``tests/gpu/test_offload_delayed_gpu.py``): the model of bf16 layers and natively fp32
parameters, its stack built with the offload options, gradients made on one stack and
copied into another, and the comparison of two stacks' parameters and optimizer state.
"""

import torch

HIDDEN = 128


MAX_NORM = 0.05  # clipping active: the scaled gradients are what moves to the host


class Net(torch.nn.Module):
    """bf16 layers (2-D weights, biases, a norm) and natively fp32 parameters first or last."""

    def __init__(self, fp32_first: bool, with_fp32: bool = True):
        super().__init__()
        from megatron_ext import mark_keep_in_fp32

        def add_fp32():
            self.sink = torch.nn.Parameter(0.1 * torch.randn(HIDDEN, device="cuda"))
            self.router = torch.nn.Parameter(0.1 * torch.randn(8, HIDDEN, device="cuda"))
            mark_keep_in_fp32(self.sink)
            mark_keep_in_fp32(self.router)

        kw = dict(dtype=torch.bfloat16, device="cuda")
        self.with_fp32 = with_fp32
        if with_fp32 and fp32_first:
            add_fp32()
        self.fc1 = torch.nn.Linear(HIDDEN, 2 * HIDDEN, **kw)
        self.norm = torch.nn.LayerNorm(2 * HIDDEN, **kw)
        self.fc2 = torch.nn.Linear(2 * HIDDEN, HIDDEN, **kw)
        if with_fp32:
            self.hc_alpha = torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN, device="cuda"))
            mark_keep_in_fp32(self.hc_alpha)
        if with_fp32 and not fp32_first:
            add_fp32()

    def forward(self, x):
        h = self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x.bfloat16())))).float()
        if not self.with_fp32:
            return h
        gate = torch.sigmoid(x @ self.router.t()).mean(-1, keepdim=True)
        return h * self.hc_alpha * gate + self.sink


def build(*, fraction, pa, overlap, fp32_first=False, grads_fp32=False, host_mirrors=True,
          with_fp32=True, offload_step="per_parameter", chunk=None, compute=None,
          convert="host", delayed=False):  # fmt: skip
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_ext

    torch.manual_seed(0)
    module = Net(fp32_first, with_fp32)
    tcfg = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    stack = megatron_ext.build_stack(
        module,
        tcfg,
        ddp=dict(grad_reduce_in_fp32=grads_fp32),
        optimizer=dict(
            optimizer="adam",
            lr=1e-2,
            weight_decay=0.1,
            bf16=True,
            clip_grad=MAX_NORM,
            use_precision_aware_optimizer=pa,
            optimizer_cpu_offload=True,
            optimizer_offload_fraction=fraction,
            overlap_cpu_optimizer_d2h_h2d=overlap,
        ),
        options=megatron_ext.MegatronOptions(
            host_mirrors=host_mirrors,
            offload_step=offload_step,
            offload_convert=convert if host_mirrors else "host",
            offload_delayed_update=delayed,
            offload_delay_warmup=0,
            **({} if chunk is None else {"offload_chunk_numel": chunk}),
        ),
    )
    if compute is not None:
        for hdo in hdos(stack.optimizer):
            hdo.compute_numel = compute  # read when the chunked step is first built
    return stack.model, stack.optimizer


def hdos(opt):
    return [c.optimizer for c in opt.chained_optimizers]


def batch(step):
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    return (
        torch.randn(32, HIDDEN, device="cuda", generator=g),
        torch.randn(32, HIDDEN, device="cuda", generator=g),
    )


def make_grads(model, opt, step):
    model.zero_grad_buffer()
    opt.zero_grad()
    x, y = batch(step)
    torch.nn.functional.mse_loss(model(x), y).backward()
    model.finish_grad_sync()


def copy_grads(src_model, dst_model, dst_opt):
    dst_model.zero_grad_buffer()
    dst_opt.zero_grad()
    for a, b in zip(src_model.all_grad_buffers(), dst_model.all_grad_buffers(), strict=True):
        assert a.grad_data.shape == b.grad_data.shape and a.grad_data.dtype == b.grad_data.dtype
        b.grad_data.copy_(a.grad_data)


def assert_same(ours, ref, what):
    (model, opt), (ref_model, ref_opt) = ours, ref
    for a, b in zip(model.all_grad_buffers(), ref_model.all_grad_buffers(), strict=True):
        assert torch.equal(a.param_data, b.param_data), f"{what}: {a.param_dtype} params differ"
    for child, ref_child in zip(opt.chained_optimizers, ref_opt.chained_optimizers, strict=True):
        mains = [p for g in child.shard_fp32_from_float16_groups for p in g if p is not None]
        ref_mains = [
            p for g in ref_child.shard_fp32_from_float16_groups for p in g if p is not None
        ]
        for p, q in zip(mains, ref_mains, strict=True):
            assert torch.equal(p, q), f"{what}: fp32 main shard differs"
        hdo, ref_hdo = child.optimizer, ref_child.optimizer
        params = [p for g in hdo.param_groups for p in g["params"]]
        ref_params = [p for g in ref_hdo.param_groups for p in g["params"]]
        assert [p in hdo.gpu_params_map_cpu_copy for p in params] == [
            p in ref_hdo.gpu_params_map_cpu_copy for p in ref_params
        ], f"{what}: different placement"
        for i, (p, q) in enumerate(zip(params, ref_params, strict=True)):
            state, ref_state = hdo.state[p], ref_hdo.state[q]
            assert state.keys() == ref_state.keys(), f"{what}: param {i} state keys"
            assert {"exp_avg", "exp_avg_sq"} <= state.keys(), f"{what}: param {i} not stepped"
            for key, value in state.items():
                assert torch.equal(value.cpu(), ref_state[key].cpu()), f"{what}: {i} {key}"
