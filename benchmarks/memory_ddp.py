"""Measured memory of megatron-core DDP + distributed optimizer, three configurations.

One rank. The model is a stack of bf16 ``Linear`` layers with a few fp32 parameters (a
hyper-connection-like weight per layer and a sink vector). Each configuration builds the
model, wraps it with ``megatron_ext.DistributedDataParallel``, builds the optimizer with
``megatron_ext.get_megatron_optimizer`` (both through ``megatron_ext.build_stack``) and runs
:data:`STEPS` training steps (the first creates the optimizer's state), in a process of its
own (``benchmarks/isolation.py``): nothing of another configuration is alive there, and a
CUDA error in megatron-core's norm is that row's error, not the end of the run.

What is measured, in the last step:

- ``held``: what forward and backward start with, after ``zero_grad``: parameters,
  gradient buffers, optimizer state, and whatever else the optimizer keeps between steps.
- ``in_step``: after the optimizer's copy to main gradients (its fp32 copies are alive).
- on CUDA only: peak allocated over everything, and the peaks of forward+backward and of
  the optimizer step (copy, norm, clip, inner step), each its phase's own.

On CUDA from the caching allocator; on the CPU (megatron-core through the test shim
``tests/support/cpu_megatron.py``, small sizes) as the bytes of every tensor storage
reachable from Python (:func:`live_storage_bytes`: tensors only autograd holds, the
activations, are not seen) and with no peaks: the CPU keeps no allocator statistics.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, find the repo

import torch

from benchmarks import common, isolation

CHILD_MODULE = "benchmarks.memory_ddp"  # how a child process imports this file
# name -> (per_dtype_grad_buffers, grad_reduce_in_fp32); stock: the option off
CONFIGS = {
    "on": (True, False),
    "off": (False, False),
    "grad_reduce_in_fp32": (False, True),
}
MEASURED_FIELDS = (
    "kind", "model", "device", "config", "per_dtype_grad_buffers", "grad_reduce_in_fp32",
    "hidden", "layers", "num_params", "numel", "peak_allocated_bytes", "peak_allocated_gib",
    "held_bytes", "held_gib", "in_step_bytes", "in_step_gib", "peak_fwd_bwd_bytes",
    "peak_fwd_bwd_gib", "peak_optimizer_step_bytes", "peak_optimizer_step_gib",
    "grad_buffer_bytes", "grad_buffer_gib", "error", "error_at",
)  # fmt: skip
# Measured on CUDA only (None on the CPU, which keeps no allocator statistics).
GPU_ONLY = ("peak_allocated", "peak_fwd_bwd", "peak_optimizer_step")
TOKENS = 1024
STEPS = 2  # the first creates the optimizer's state; the last is measured


class MixedLinearStack(torch.nn.Module):
    """bf16 ``Linear`` layers with fp32 parameters in between, as mixed-dtype models have."""

    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        # "cuda" on the CPU too: the test shim puts megatron-core's CUDA tensors there.
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


def live_storage_bytes() -> int:
    """Bytes of every distinct CPU tensor storage reachable from Python objects."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
            continue
        storage = obj.untyped_storage()
        if storage.data_ptr():
            storages[storage.data_ptr()] = max(
                storages.get(storage.data_ptr(), 0), storage.nbytes()
            )
    return sum(storages.values())


class _Meter:
    """Bytes at named points and, on CUDA, peaks per phase and overall, net of the bytes
    allocated before the build (the process group's)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.points: dict[str, int] = {}
        self.peaks: dict[str, int] = {}
        _release()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.before = self._now()
        self.overall = 0

    def _now(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else live_storage_bytes()

    def _fold(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.overall = max(self.overall, torch.cuda.max_memory_allocated())

    def point(self, name: str) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.points[name] = self._now() - self.before

    def phase(self, name: str, fn) -> None:
        """Run ``fn``; on CUDA its own peak is ``peaks[name]`` (the last call's)."""
        self._fold()  # a reset would lose the peak so far
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        fn()
        if self.cuda:
            torch.cuda.synchronize()
            self.peaks[name] = torch.cuda.max_memory_allocated() - self.before
            self._fold()

    def fields(self) -> dict:
        self._fold()
        out = dict(self.points)
        if self.cuda:
            out |= self.peaks | {"peak_allocated": self.overall - self.before}
        return {
            f"{k}_{unit}": (None if v is None else v if unit == "bytes" else common.gib(v))
            for k, v in (dict.fromkeys(GPU_ONLY) | out).items()
            for unit in ("bytes", "gib")
        }


def _fwd_bwd(model, x: torch.Tensor) -> None:
    model(x).float().square().mean().backward()
    model.finish_grad_sync()


def _optimizer_step(optimizer, meter: _Meter | None) -> None:
    optimizer.prepare_grads()
    if meter is not None:
        meter.point("in_step")
    optimizer.step()  # prepares again: the same copies, into the same memory


def _steps(model, optimizer, hidden: int, meter: _Meter) -> None:
    for step in range(STEPS):
        last = step == STEPS - 1
        model.zero_grad_buffer()
        optimizer.zero_grad()
        if last:
            meter.point("held")
        x = torch.randn(TOKENS, hidden, device="cuda", dtype=torch.bfloat16)
        meter.phase("peak_fwd_bwd", functools.partial(_fwd_bwd, model, x))
        meter.phase(
            "peak_optimizer_step",
            functools.partial(_optimizer_step, optimizer, meter if last else None),
        )


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _load_api() -> SimpleNamespace:
    """The parts of ``megatron_ext`` this measurement uses; ImportError when one is missing."""
    from megatron_ext import build_stack, mark_keep_in_fp32

    return SimpleNamespace(build_stack=build_stack, mark_keep_in_fp32=mark_keep_in_fp32)


def _measure_config(
    api, per_dtype: bool, fp32_reduce: bool, hidden: int, layers: int, cuda: bool = True
) -> dict:
    from megatron.core.transformer import TransformerConfig

    meter = _Meter(cuda)
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
    _steps(model, optimizer, hidden, meter)
    grads = _grad_buffer_bytes(model)
    return meter.fields() | {
        "grad_buffer_bytes": grads,
        "grad_buffer_gib": common.gib(grads),
        "num_params": sum(1 for _ in module.parameters()),
        "numel": sum(p.numel() for p in module.parameters()),
    }


def measure_in_fresh_process(name: str, hidden: int, layers: int, device: str = "cuda") -> dict:
    """The configuration ``name``'s fields, measured in a process of its own.

    Returns:
        What :func:`_measure_config` returns, or ``error`` / ``error_at`` when it raised
        there or the process died (``crashed: ...``).
    """
    with isolation.Child(f"memory_ddp-{name}") as child:
        try:
            return child.call(f"{CHILD_MODULE}:_child_measure", name, hidden, layers, device)
        except isolation.ChildCrashed as exc:
            return {"error": f"crashed: {exc}", "error_at": "its own process"}
        except isolation.ChildFailed as exc:
            return exc.fields


def _child_measure(state: dict, name: str, hidden: int, layers: int, device: str) -> dict:
    per_dtype, fp32_reduce = CONFIGS[name]
    if not per_dtype:  # the fault injection tests' stand-in for stock's crashes
        isolation.fire(isolation.injected_fault(name))
    from megatron.core import parallel_state

    cuda = device == "cuda"
    with contextlib.ExitStack() as stack:
        if cuda:
            torch.cuda.set_device(0)
        else:  # megatron-core's CUDA calls on the CPU (its DDP and optimizers need CUDA)
            from tests.support.cpu_megatron import cpu_megatron

            stack.enter_context(cpu_megatron())
        store = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "store"
        backend = "nccl" if cuda else "gloo"
        stack.enter_context(common.single_rank_process_group(f"file://{store}", backend))
        parallel_state.initialize_model_parallel()
        stack.callback(parallel_state.destroy_model_parallel)
        return _measure_config(_load_api(), per_dtype, fp32_reduce, hidden, layers, cuda)


def measure_memory(hidden: int, layers: int, device: str = "cuda") -> list[dict]:
    """Memory per configuration in :data:`CONFIGS`, each in a process of its own.

    Args:
        hidden: the Linear layers' width.
        layers: how many Linear layers.
        device: ``"cuda"`` (device 0, allocator statistics) or ``"cpu"`` (megatron-core
            through the test shim; live tensor bytes, no peaks).

    Returns:
        One ``kind="measured"`` record per configuration (with ``error`` where one failed).
    """
    records = []
    for name, (per_dtype, fp32_reduce) in common.progress(list(CONFIGS.items()), "ddp"):
        rec = dict.fromkeys(MEASURED_FIELDS) | {
            "kind": "measured",
            "model": "mixed_linear_stack",
            "device": device,
            "config": name,
            "per_dtype_grad_buffers": per_dtype,
            "grad_reduce_in_fp32": fp32_reduce,
            "hidden": hidden,
            "layers": layers,
        }
        records.append(rec | measure_in_fresh_process(name, hidden, layers, device))
    return records


if __name__ == "__main__":
    sys.exit(common.not_a_script(__file__, ("memory.py",)))
