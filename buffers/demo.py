"""Demo: train a small mixed bf16/fp32 model with FlatGradBuffers and print what it does.

Run: ``python -m buffers.demo [--steps N] [--device cpu|cuda] [--max-norm X]``.
"""

from __future__ import annotations

import argparse

import torch

from buffers import FlatGradBuffers
from buffers.ops import check_max_norm


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
    sums = []
    for name, p in model.named_parameters():
        if p.grad is None:
            raise ValueError(f"parameter {name!r} has no gradient: run backward first")
        sums.append(p.grad.double().square().sum())
    return sum(sums[1:], sums[0]).sqrt().item()


def _steps(text: str) -> int:
    try:
        steps = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if steps < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {steps}")
    return steps


def _max_norm(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    try:
        return check_max_norm(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _device_problem(name: str) -> str | None:
    """Why the demo cannot train on ``name``, or None when it can."""
    try:
        device = torch.device(name)
    except RuntimeError:
        return f"{name!r} is not a torch device (examples: cpu, cuda, cuda:1)"
    if device.type == "cuda" and not torch.cuda.is_available():
        return f"{name!r}: torch sees no CUDA GPU on this machine; use --device cpu"
    try:
        torch.zeros(1, device=device).cpu()  # a device that holds no data (meta) fails here
    except (RuntimeError, AssertionError, NotImplementedError) as e:
        return f"{name!r} cannot hold the model here ({str(e).splitlines()[0]})"
    return None


def build_parser() -> argparse.ArgumentParser:
    """The demo's command line; every option's help says what it does and its default."""
    ap = argparse.ArgumentParser(prog="python -m buffers.demo", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--steps",
        type=_steps,
        default=5,
        help="training steps to run, >= 1 (default: %(default)s)",
    )
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the model and its gradient buffers live, e.g. cpu or cuda (default: cuda "
        "when torch sees a GPU, else cpu; here %(default)s)",
    )
    ap.add_argument(
        "--max-norm",
        type=_max_norm,
        default=1.0,
        help="clip the total gradient norm to this value every step, >= 0; inf never clips "
        "(default: %(default)s)",
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = _device_problem(args.device)
    if problem is not None:
        parser.error(f"argument --device: {problem}")

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
