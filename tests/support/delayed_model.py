"""The offload simulation's model and its plainly written reference (test support), for the
delayed and overlapped offloaded steps on the CPU (``tests/test_offload_delayed.py``,
``tests/test_offload_overlap_forward.py``): :class:`Model` holds the simulation's two
buffers at DP=1 by parameter name; :class:`Reference` applies AdamW per parameter, at once
or one step late, over what the device holds, written without the code under test; and the
helpers that compare them and inject a failing host update.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.offload_sim import FP32_SHAPES, SHAPES, MirrorChunked, make_hdo, sim

BF16, FP32 = torch.bfloat16, torch.float32


BETAS, EPS = (0.9, 0.95), 1e-8


class MirrorDelayed(MirrorChunked):
    """The chunked step, its host update one step late after two exact steps."""

    delayed_update = True
    delay_warmup = 2


def lr_at(step: int, group: int) -> float:
    return 3e-3 * (step + 2) * (group + 1)


class Model:
    """The simulation's two buffers at DP=1, by parameter name: where each one's device
    value, gradient and optimizer parameter live."""

    def __init__(self, pa: bool, fraction: float, cls=MirrorDelayed, chunk=40):
        self.pa = pa
        bf16, fp32, groups, sources, bind, shard16 = sim(pa, False, False, 1, 0)
        self.bf16, self.fp32, self.bind, self.shard16 = bf16, fp32, bind, shard16
        self.hdo = make_hdo(cls, groups, fraction, True, sources, chunk=chunk)
        base = fp32.param_data.data_ptr()
        shard32 = {p.data_ptr() - base: p for g in groups for p in g["params"] if p.dtype == FP32}
        self.inner = {n: shard16[n] for n in bf16.shards}
        for n, s in fp32.shards.items():
            self.inner[n] = shard32[s.start * 4]
        # the simulation's groups: weight decay for 2-D parameters (the shards are flat)
        self.group_of = {n: int(len((SHAPES | FP32_SHAPES)[n]) < 2) for n in self.inner}

    def buffer(self, name):
        return self.bf16 if name in self.bf16.shards else self.fp32

    def device(self, name) -> torch.Tensor:
        """What forward reads: the parameter buffer (precision-aware, fp32 parameters) or
        the fp32 main shard megatron-core copies into it after a step."""
        if name in self.bf16.shards and not self.pa:
            return self.shard16[name].detach().reshape(-1)
        s = self.buffer(name).shards[name]
        return self.buffer(name).param_data[s.start : s.end]

    def offloaded(self, name) -> bool:
        return self.inner[name] in self.hdo.gpu_params_map_cpu_copy

    def set_grads(self, grads: dict[str, torch.Tensor], step: int) -> None:
        for n, g in grads.items():
            s = self.buffer(n).shards[n]
            self.buffer(n).grad_data[s.start : s.end] = g
        self.bind()
        for i, group in enumerate(self.hdo.param_groups):
            group["lr"] = lr_at(step, i)


class Reference:
    """AdamW per parameter, applied at once or one step late, over what the device holds."""

    def __init__(self, model: Model, delayed: bool, warmup: int):
        self.delayed, self.warmup, self.taken = delayed, warmup, 0
        self.dev = {n: model.device(n).clone() for n in model.inner}
        self.late = {n: model.offloaded(n) for n in model.inner}
        self.master, self.opt = {}, {}
        for n in model.inner:
            master = torch.nn.Parameter(self.dev[n].float().clone())
            wd = 0.1 if model.group_of[n] == 0 else 0.0
            self.master[n] = master
            self.opt[n] = torch.optim.AdamW(
                [master], lr=1.0, betas=BETAS, eps=EPS, weight_decay=wd, fused=True
            )
        self.group_of = model.group_of
        self.pending: dict[str, torch.Tensor] = {}

    def grads(self, gen: torch.Generator, dtypes: dict[str, torch.dtype]):
        """A stand-in for backward: gradients from what the device holds, plus noise."""
        return {
            n: (0.3 * d.float() + torch.randn(d.numel(), generator=gen)).to(dtypes[n])
            for n, d in self.dev.items()
        }

    def land(self) -> None:
        for n, value in self.pending.items():
            self.dev[n] = value
        self.pending = {}

    def step(self, grads, step: int) -> None:
        self.land()
        delay = self.delayed and self.taken >= self.warmup
        for n, master in self.master.items():
            for g in self.opt[n].param_groups:
                g["lr"] = lr_at(step, self.group_of[n])
            master.grad = grads[n].float()
            self.opt[n].step()
            value = master.detach().to(self.dev[n].dtype, copy=True)
            if delay and self.late[n]:
                self.pending[n] = value
            else:
                self.dev[n] = value
        self.taken += 1


def grad_dtypes(model: Model) -> dict[str, torch.dtype]:
    return {n: model.buffer(n).grad_data.dtype for n in model.inner}


def assert_device(model: Model, ref: Reference, step) -> None:
    for n in model.inner:
        assert torch.equal(model.device(n), ref.dev[n]), (step, n, model.offloaded(n))


def assert_state(model: Model, ref: Reference) -> None:
    for n, p in model.inner.items():
        mine = model.hdo.state[p]
        theirs = ref.opt[n].state[ref.master[n]]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(mine[key].reshape(-1), theirs[key]), (n, key)
        assert float(mine["step"]) == float(theirs["step"]), n


def _grads_of(model: Model, gen: torch.Generator) -> dict[str, torch.Tensor]:
    dtypes = grad_dtypes(model)
    return {
        n: (0.3 * model.device(n).float() + torch.randn(model.device(n).numel(), generator=gen)).to(
            dtypes[n]
        )
        for n in model.inner
    }


def fail_at_the_second_update(monkeypatch):
    """ChunkedAdamW.update raises at its second call from now; returns the real one."""
    from megatron_ext.offload.step import ChunkedAdamW

    real, calls = ChunkedAdamW.update, []

    def failing(self, chunk, copies=None):
        calls.append(chunk)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return real(self, chunk, copies)

    monkeypatch.setattr(ChunkedAdamW, "update", failing)
    return real


def refuses_until_loaded(model: Model, monkeypatch, real, saved) -> None:
    """After a host update failed part way, the optimizer refuses to step; with ``real``
    ChunkedAdamW.update back and ``saved`` loaded, it steps and lands again."""
    from megatron_ext.offload.step import ChunkedAdamW

    with pytest.raises(RuntimeError, match="failed part way .*load the last checkpoint"):
        model.hdo.step()
    monkeypatch.setattr(ChunkedAdamW, "update", real)
    model.hdo.load_state_dict(saved)
    model.hdo.step()
    assert model.hdo.drain()
