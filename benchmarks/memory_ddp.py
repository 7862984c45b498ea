"""Measured peak memory of megatron-core DDP + distributed optimizer, three configurations.

CUDA only, one GPU, one rank. The model is a stack of bf16 ``Linear`` layers with a few
fp32 parameters (a hyper-connection-like weight per layer and a sink vector). Each
configuration builds the model, wraps it with ``megatron_ext.DistributedDataParallel``,
builds the optimizer with ``megatron_ext.get_megatron_optimizer`` (both through
``megatron_ext.build_stack``) and runs one training step; the record holds the peak
allocated memory over all of that. Stock's configurations (``off``,
``grad_reduce_in_fp32``) each run in a process of their own (``benchmarks/isolation.py``):
a CUDA error in megatron-core's norm there is that row's error, not the end of the run.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, find the repo

import torch

from benchmarks import common, isolation

INIT_METHOD = "tcp://127.0.0.1:29533"
CHILD_MODULE = "benchmarks.memory_ddp"  # how a child process imports this file
# name -> (per_dtype_grad_buffers, grad_reduce_in_fp32); stock: the option off
CONFIGS = {
    "on": (True, False),
    "off": (False, False),
    "grad_reduce_in_fp32": (False, True),
}
MEASURED_FIELDS = (
    "kind", "model", "config", "per_dtype_grad_buffers", "grad_reduce_in_fp32", "hidden",
    "layers", "num_params", "numel", "peak_allocated_bytes", "peak_allocated_gib",
    "grad_buffer_bytes", "grad_buffer_gib", "error", "error_at",
)  # fmt: skip
TOKENS = 1024


class MixedLinearStack(torch.nn.Module):
    """bf16 ``Linear`` layers with fp32 parameters in between, as mixed-dtype models have."""

    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        kw = {"bias": False, "dtype": torch.bfloat16, "device": "cuda"}
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(hidden, hidden, **kw) for _ in range(layers)
        )
        self.hc_alpha = torch.nn.Parameter(torch.full((layers, hidden), 0.5, device="cuda"))
        self.sink = torch.nn.Parameter(torch.zeros(hidden, device="cuda"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x + (self.hc_alpha[i] * x.float()).to(x.dtype))
        return x + self.sink.to(x.dtype)


def _grad_buffer_bytes(model) -> int:
    buffers = [*model.buffers, *model.expert_parallel_buffers]
    islands = getattr(model, "fp32_islands", list)()
    return sum(t.numel() * t.element_size() for t in [*(b.grad_data for b in buffers), *islands])


def _train_step(model, optimizer, hidden: int) -> None:
    model.zero_grad_buffer()
    optimizer.zero_grad()
    x = torch.randn(TOKENS, hidden, device="cuda", dtype=torch.bfloat16)
    model(x).float().square().mean().backward()
    model.finish_grad_sync()
    optimizer.step()


def _release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _load_api() -> SimpleNamespace:
    """The parts of ``megatron_ext`` this measurement uses; ImportError when one is missing."""
    from megatron_ext import build_stack, mark_keep_in_fp32

    return SimpleNamespace(build_stack=build_stack, mark_keep_in_fp32=mark_keep_in_fp32)


def _measure_config(api, per_dtype: bool, fp32_reduce: bool, hidden: int, layers: int) -> dict:
    from megatron.core.transformer import TransformerConfig

    _release()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    module = MixedLinearStack(hidden, layers)
    for p in (module.hc_alpha, module.sink):
        api.mark_keep_in_fp32(p)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=4,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    stack = api.build_stack(
        module,
        config,
        per_dtype_grad_buffers=per_dtype,
        ddp=dict(grad_reduce_in_fp32=fp32_reduce),
        optimizer=dict(lr=1e-3, bf16=True, clip_grad=1.0),
    )
    model, optimizer = stack.model, stack.optimizer
    _train_step(model, optimizer, hidden)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    grads = _grad_buffer_bytes(model)
    return {
        "peak_allocated_bytes": peak,
        "peak_allocated_gib": common.gib(peak),
        "grad_buffer_bytes": grads,
        "grad_buffer_gib": common.gib(grads),
        "num_params": sum(1 for _ in module.parameters()),
        "numel": sum(p.numel() for p in module.parameters()),
    }


def measure_stock(name: str, hidden: int, layers: int) -> dict:
    """The stock configuration ``name``'s fields, measured in a process of its own.

    Returns:
        What :func:`_measure_config` returns, or ``error`` / ``error_at`` when it raised
        there or the process died (``crashed: ...``).
    """
    with isolation.Child(f"memory_ddp-{name}") as child:
        try:
            return child.call(f"{CHILD_MODULE}:_child_measure", name, hidden, layers)
        except isolation.ChildCrashed as exc:
            return {"error": f"crashed: {exc}", "error_at": "its own process"}
        except isolation.ChildFailed as exc:
            return exc.fields


def _child_measure(state: dict, name: str, hidden: int, layers: int) -> dict:
    isolation.fire(isolation.injected_fault(name))
    from megatron.core import parallel_state

    per_dtype, fp32_reduce = CONFIGS[name]
    torch.cuda.set_device(0)
    with contextlib.ExitStack() as stack:
        store = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "store"
        stack.enter_context(common.single_rank_process_group(f"file://{store}"))
        parallel_state.initialize_model_parallel()
        stack.callback(parallel_state.destroy_model_parallel)
        return _measure_config(_load_api(), per_dtype, fp32_reduce, hidden, layers)


def measure_peak_memory(hidden: int, layers: int) -> list[dict]:
    """Peak allocated memory per configuration in :data:`CONFIGS`, on CUDA device 0.

    Args:
        hidden: the Linear layers' width.
        layers: how many Linear layers.

    Returns:
        One ``kind="measured"`` record per configuration (with ``error`` where one failed);
        empty when ``megatron_ext`` does not provide the integration yet.
    """
    try:
        api = _load_api()
    except ImportError as exc:
        print(f"megatron_ext integration not available ({exc})")
        return []
    from megatron.core import parallel_state

    records = []
    torch.cuda.set_device(0)
    with common.single_rank_process_group(INIT_METHOD):
        parallel_state.initialize_model_parallel()
        try:
            for name, (per_dtype, fp32_reduce) in common.progress(list(CONFIGS.items()), "ddp"):
                rec = dict.fromkeys(MEASURED_FIELDS) | {
                    "kind": "measured",
                    "model": "mixed_linear_stack",
                    "config": name,
                    "per_dtype_grad_buffers": per_dtype,
                    "grad_reduce_in_fp32": fp32_reduce,
                    "hidden": hidden,
                    "layers": layers,
                }
                try:
                    if per_dtype:
                        rec |= _measure_config(api, per_dtype, fp32_reduce, hidden, layers)
                    else:
                        rec |= measure_stock(name, hidden, layers)
                except Exception as exc:  # record it and measure the next configuration
                    rec |= common.error_fields(exc)
                records.append(rec)
                _release()
        finally:
            parallel_state.destroy_model_parallel()
    return records


if __name__ == "__main__":
    sys.exit(common.not_a_script(__file__, ("memory.py",)))
