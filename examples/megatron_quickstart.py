"""Per-dtype gradient buffers in a Megatron-Core job: config, DDP, optimizer, a few steps.

Runs on one CUDA GPU with the project installed with its megatron extra (``pip install -e
'.[megatron]'``, or the ``.venv`` the README's set-up commands create): ``python
examples/megatron_quickstart.py``; under
``torchrun --nproc-per-node N`` for N data-parallel ranks (not yet run on several GPUs).
"""

import os
import sys

import torch

NEEDS_CUDA = (
    "examples/megatron_quickstart.py needs a CUDA GPU (megatron-core's DDP and optimizers "
    "run on CUDA, over NCCL) and torch sees none; on the CPU, try python -m buffers.demo"
)


def require_cuda() -> None:
    """Exit with one line, status 1, when torch sees no CUDA GPU (before NCCL is touched)."""
    if not torch.cuda.is_available():
        sys.exit(NEEDS_CUDA)


class Block(torch.nn.Module):
    """bf16 weights with fp32 islands (a hyper-connection scale and an attention-sink bias)."""

    def __init__(self, hidden: int) -> None:
        import megatron_ext

        super().__init__()
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden, dtype=torch.bfloat16, device="cuda")
        self.fc2 = torch.nn.Linear(4 * hidden, hidden, dtype=torch.bfloat16, device="cuda")
        self.hc_alpha = megatron_ext.mark_keep_in_fp32(torch.nn.Parameter(torch.ones(hidden)))
        self.sink = megatron_ext.mark_keep_in_fp32(torch.nn.Parameter(torch.zeros(hidden)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(torch.nn.functional.gelu(self.fc1(x.bfloat16())))
        return h.float() * self.hc_alpha + self.sink


def main() -> None:
    require_cuda()
    # imported after the check: megatron-core's import notices would bury its one line
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_ext

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    torch.distributed.init_process_group(
        "nccl",
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
    )
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    parallel_state.initialize_model_parallel()
    torch.manual_seed(0)

    hidden = 512
    config = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=8,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    # per-dtype buffers and the distributed optimizer are build_stack's defaults; bf16
    # comes from the transformer config
    stack = megatron_ext.build_stack(
        Block(hidden).cuda(),
        config,
        ddp=dict(grad_reduce_in_fp32=False),
        optimizer=dict(
            optimizer="adam",
            lr=1e-3,
            clip_grad=1.0,
            use_precision_aware_optimizer=True,
            optimizer_cpu_offload=True,
            optimizer_offload_fraction=0.5,
        ),
    )
    model, optimizer = stack.model, stack.optimizer
    for buf in model.all_grad_buffers():
        print(f"grad buffer {buf.grad_dtype}: {buf.numel:,} elements")

    x = torch.randn(64, hidden, device="cuda")
    y = torch.randn(64, hidden, device="cuda")
    for step in range(5):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        model.finish_grad_sync()
        ok, grad_norm, _ = optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}  grad norm {grad_norm.item():.4f}  ok {ok}")

    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
