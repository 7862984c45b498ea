"""Demo: train a small mixed bf16/fp32 model with FlatGradBuffers and print what it does.

Run: ``python -m buffers.demo [--steps N] [--device cpu|cuda] [--max-norm X]``.
"""

from __future__ import annotations

import argparse

import torch

from buffers import FlatGradBuffers


class MixedModel(torch.nn.Module):
    """bf16 weights with a few parameters kept in fp32, as DeepSeek-V4-style models do."""

    def __init__(self, hidden: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(hidden, hidden, dtype=torch.bfloat16) for _ in range(layers)
        )
        # fp32 islands: a hyper-connection mixing weight per layer and an attention-sink-like
        # bias, registered between bf16 parameters on purpose.
        self.hc_alpha = torch.nn.Parameter(torch.full((layers, hidden), 0.5))
        self.sink = torch.nn.Parameter(torch.zeros(hidden))
        self.head = torch.nn.Linear(hidden, 1, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            mixed = x + (self.hc_alpha[i] * x.float()).to(x.dtype)
            x = torch.tanh(layer(mixed))
        return self.head(x + self.sink.to(x.dtype)).float()


def reference_norm(model: torch.nn.Module) -> float:
    return sum(p.grad.double().square().sum() for p in model.parameters()).sqrt().item()


def build_parser() -> argparse.ArgumentParser:
    """The demo's command line; every option's help says what it does and its default."""
    ap = argparse.ArgumentParser(prog="python -m buffers.demo", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--steps", type=int, default=5, help="training steps to run (default: %(default)s)"
    )
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the model and its gradient buffers live, e.g. cpu or cuda (default: cuda "
        "when torch sees a GPU, else cpu; here %(default)s)",
    )
    ap.add_argument(
        "--max-norm",
        type=float,
        default=1.0,
        help="clip the total gradient norm to this value every step; inf never clips "
        "(default: %(default)s)",
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    torch.manual_seed(0)
    device = torch.device(args.device)
    model = MixedModel().to(device)
    fgb = FlatGradBuffers(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    print(f"device: {device}")
    for dtype, buf in fgb.buffers.items():
        print(f"buffer {str(dtype):15s} {buf.numel():>9,d} elements {buf.nbytes:>10,d} bytes")
    print(f"total gradient bytes: {fgb.nbytes:,d}\n")
    print(f"{'step':>4} {'loss':>10} {'norm':>10} {'fp64 ref':>10} {'clip coeff':>10}")

    x = torch.randn(64, 256, device=device, dtype=torch.bfloat16)
    y = torch.randn(64, 1, device=device)
    for step in range(args.steps):
        fgb.zero_()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        ref = reference_norm(model)
        norm = fgb.clip_grad_norm_(args.max_norm)
        coeff = min(1.0, args.max_norm / (norm.item() + 1e-6))
        opt.step()
        print(f"{step:>4} {loss.item():>10.5f} {norm.item():>10.5f} {ref:>10.5f} {coeff:>10.5f}")


if __name__ == "__main__":
    main()
