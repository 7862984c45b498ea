"""A CPU simulation of the distributed optimizer's shard parameters under megatron-core's
``HybridDeviceOptimizer``: two flat buffers (bf16 weights, natively fp32 parameters), their
shard parameters and gradient bindings as megatron-core makes them, placed by its greedy
rule, stock or with host mirrors (the per-parameter or the chunked step), trained with
fresh gradients and an lr schedule. Streams and events are the recording stand-ins of
:mod:`tests.support.streams`, and every host-mirror copy is checked against them.
"""

from __future__ import annotations

import torch
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

from buffers.spans import Span, dp_shard_spans, intersect_spans, merge_spans, to_local
from megatron_ext.offload import HostMirrorHybridOptimizer, OffloadSource
from megatron_ext.offload.host_mirror import HostBlock
from megatron_ext.offload.step import ChunkedAdamW
from tests.support import streams


def S(a, b):
    return Span(a, b)


def trace_host_mirrors(monkeypatch, log: streams.Log) -> None:
    """Every host-mirror copy and host access of the offload code checked against ``log``."""
    hb = streams.host_bytes

    def start_d2h(self):
        dst, src = self.d2h
        log.device_copy(f"d2h of {dst.numel()} elements", hb(dst), to_host=True)
        for stage, _, _, _ in self.islands:
            log.device_copy(f"island d2h of {stage.numel()}", hb(stage), to_host=True)
        real_d2h(self)

    def start_h2d(self):
        log.device_copy(f"h2d of {self.h2d[1].numel()} elements", hb(self.h2d[1]), to_host=False)
        real_h2d(self)

    def reads(block):
        if block.convert is not None:
            log.host_access("reads", hb(block.convert[1]))
        else:
            log.host_access("reads", hb(block.d2h[0]))
        for stage, _, _, _ in block.islands:
            log.host_access("reads", hb(stage))

    def convert_grads(self):
        reads(self)
        real_convert(self)

    def pack_params(self):
        if self.pack is not None:
            log.host_access("writes", hb(self.pack[0]))
        real_pack(self)

    def update(self, chunk, copies=None):
        if copies is not None:
            reads(copies)
            # what goes back: the staging it packs into, or the host parameters themselves
            log.host_access("writes", hb(copies.h2d[1]))
        real_update(self, chunk, copies)

    real_d2h, real_h2d = HostBlock.start_d2h, HostBlock.start_h2d
    real_convert, real_pack = HostBlock.convert_grads, HostBlock.pack_params
    real_update = ChunkedAdamW.update
    monkeypatch.setattr(HostBlock, "start_d2h", start_d2h)
    monkeypatch.setattr(HostBlock, "start_h2d", start_h2d)
    monkeypatch.setattr(HostBlock, "convert_grads", convert_grads)
    monkeypatch.setattr(HostBlock, "pack_params", pack_params)
    monkeypatch.setattr(ChunkedAdamW, "update", update)
    # ours calls back into megatron-core's step (the per-parameter path): the outermost
    # call is the step, whose start and end the log checks
    depth = [0]

    def traced(real):
        def step(self, *args, **kwargs):
            depth[0] += 1
            try:
                if depth[0] > 1:
                    return real(self, *args, **kwargs)
                log.step_begins()
                out = real(self, *args, **kwargs)
                log.step_ends()
                return out
            finally:
                depth[0] -= 1

        return step

    for cls in (HybridDeviceOptimizer, HostMirrorHybridOptimizer):
        monkeypatch.setattr(cls, "step", traced(cls.__dict__["step"]))


def recording_streams(monkeypatch) -> streams.Log:
    """megatron-core's CUDA streams and events replaced by recording stand-ins, and every
    host-mirror copy checked against them (:mod:`tests.support.streams`); the log."""
    log = streams.install(monkeypatch)
    trace_host_mirrors(monkeypatch, log)
    return log


ALIGN = 64
SHAPES = {"w1": (24, 16), "b1": (24,), "w2": (16, 24), "b2": (16,), "ln": (16,)}
FP32_SHAPES = {"sink": (16,), "router": (4, 16)}


class SimBuffer:
    """A flat parameter buffer and its gradient buffer, parameters as views (like DDP's)."""

    def __init__(self, shapes, param_dtype, grad_dtype, dp, rank):
        self.spans, start = {}, 0
        for name, shape in shapes.items():
            n = torch.Size(shape).numel()
            self.spans[name] = S(start, start + n)
            start = -(-(start + n) // ALIGN) * ALIGN
        numel = -(-start // (dp * 8)) * dp * 8
        self.param_data = torch.zeros(numel, dtype=param_dtype)
        self.grad_data = torch.zeros(numel, dtype=grad_dtype)
        self.owned = merge_spans(dp_shard_spans([S(0, numel)], dp, rank))
        gen = torch.Generator().manual_seed(7)
        for s in self.spans.values():
            self.param_data[s.start : s.end] = torch.randn(s.numel, generator=gen)
        # this rank's shard of each parameter
        self.shards = {
            name: piece
            for name, s in self.spans.items()
            for piece in intersect_spans([s], self.owned)
        }


def sim(pa, fp32_first, grads_fp32, dp, rank):
    """Two buffers, shard parameters and their gradient bindings, as megatron-core has them."""
    bf16 = SimBuffer(
        SHAPES, torch.bfloat16, torch.float32 if grads_fp32 else torch.bfloat16, dp, rank
    )
    fp32 = SimBuffer(FP32_SHAPES, torch.float32, torch.float32, dp, rank)
    mirror = None
    if pa:
        shard16 = {n: bf16.param_data[s.start : s.end] for n, s in bf16.shards.items()}
    else:
        # fp32 main shards (separate tensors) whose .grad is an fp32 mirror of the shard
        shard16 = {n: bf16.param_data[s.start : s.end].float() for n, s in bf16.shards.items()}
        mirror = torch.zeros(sum(o.numel for o in bf16.owned))
    shard32 = {n: fp32.param_data[s.start : s.end] for n, s in fp32.shards.items()}
    # megatron-core's groups: weight decay for 2-D params only; fp32 shards first in each
    # (the other order gives the greedy placement at fraction 0.5 other parameters)
    first, second = (shard32, shard16) if fp32_first else (shard16, shard32)
    groups = []
    for decay in (True, False):
        params = [
            p
            for shards in (first, second)
            for name, p in shards.items()
            if (len((SHAPES | FP32_SHAPES)[name]) > 1) == decay
        ]
        # the keys megatron-core pairs saved and current groups by (0.18 requires them all)
        groups.append(
            {
                "params": params,
                "weight_decay": 0.1 if decay else 0.0,
                "wd_mult": float(decay),
                "lr_mult": 1.0,
                "is_expert_parallel": False,
                "is_decoupled_lr": False,
            }
        )
    sources = (
        OffloadSource(
            "bf16", bf16.owned, mirror if mirror is not None else bf16.grad_data,
            bf16.owned if mirror is not None else None, bf16.param_data,
            {shard16[n]: bf16.shards[n] for n in shard16},
        ),
        OffloadSource(
            "fp32", fp32.owned, fp32.grad_data, None, fp32.param_data,
            {shard32[n]: fp32.shards[n] for n in shard32},
        ),
    )  # fmt: skip

    def bind_grads():
        if mirror is not None:
            for dst, src in zip(
                torch.split(mirror, [o.numel for o in bf16.owned]),
                [bf16.grad_data[o.start : o.end] for o in bf16.owned],
                strict=True,
            ):
                dst.copy_(src)
        for n, p in shard16.items():
            s = bf16.shards[n]
            if pa:
                p.decoupled_grad = bf16.grad_data[s.start : s.end]
            else:
                (local,) = to_local([s], bf16.owned)
                p.grad = mirror[local.start : local.end]
        for n, p in shard32.items():
            s = fp32.shards[n]
            view = fp32.grad_data[s.start : s.end]
            if pa:
                p.decoupled_grad = view
            else:
                p.grad = view

    return bf16, fp32, groups, sources, bind_grads, shard16


def placement(groups, fraction):
    """megatron-core's ``_get_sub_optimizer_param_groups``, every parameter "on the GPU"."""
    total = sum(p.numel() for g in groups for p in g["params"])
    done = 0
    cpu_groups, gpu_groups, to_cpu, to_gpu, fp32 = [], [], {}, {}, {}
    for group in groups:
        cg, gg = {**group, "params": []}, {**group, "params": []}
        for orig in group["params"]:
            param, moved = orig, False
            if done < total * fraction:
                param, moved = orig.detach().clone(), True
                done += param.numel()
            if param.dtype != torch.float32:
                param = param.detach().clone().float()
                fp32[orig] = param
            if moved:
                to_cpu[orig], to_gpu[param] = param, orig
            (cg if moved else gg)["params"].append(param)
        cpu_groups += [cg] if cg["params"] else []
        gpu_groups += [gg] if gg["params"] else []
    return cpu_groups, gpu_groups, to_cpu, to_gpu, fp32


class StockPlaced(HybridDeviceOptimizer):
    """megatron-core's optimizer, unchanged but for the placement above."""

    def _get_sub_optimizer_param_groups(self, offload_fraction):
        return placement(self.param_groups, offload_fraction)


class StockPlacedFp32Fixed(StockPlaced):
    """The per-parameter reference: megatron-core's path, plus the one fix host mirrors make.

    With precision-aware gradients (``.decoupled_grad``), megatron-core gives a natively
    fp32 parameter that stays on the GPU no ``.grad``, so its torch GPU optimizer skips it;
    host mirrors bind ``.grad = .decoupled_grad`` (:func:`bind_native_grads`).
    """

    def _set_sub_optimizer_grads(self):
        bind_native_grads(self)
        super()._set_sub_optimizer_grads()


def bind_native_grads(hdo):
    for g in hdo.gpu_param_groups:
        for p in g["params"]:
            grad = getattr(p, "decoupled_grad", None)
            if p not in hdo.fp32_param_to_orig_param and grad is not None:
                p.grad = grad


class MirrorPlaced(HostMirrorHybridOptimizer):
    """Host mirrors; the placement above wherever megatron-core's would run (a reload)."""

    def _get_sub_optimizer_param_groups(self, offload_fraction):
        return placement(self.param_groups, offload_fraction)


class MirrorChunked(MirrorPlaced):
    """Host mirrors with the chunked step, in chunks that cut parameters (and blocks)."""

    chunked_step = True
    chunk_numel = 40


class MirrorChunkedTorch(MirrorChunked):
    """The chunked step on torch's ops (convert, torch._fused_adamw_, pack per sub-range)."""

    offload_kernel = "torch"


class MirrorChunkedNative(MirrorChunked):
    """The chunked step on the compiled kernel (an error where it is not available)."""

    offload_kernel = "native"


class MirrorPlacedOnDevice(MirrorPlaced):
    """Host mirrors converting on the "device" (fp32 both ways), the per-parameter step."""

    convert_on_device = True


class MirrorChunkedOnDevice(MirrorChunked):
    """Host mirrors converting on the "device" (fp32 both ways), the chunked step."""

    convert_on_device = True


class MirrorChunkedOnDeviceTorch(MirrorChunkedOnDevice):
    offload_kernel = "torch"


class MirrorChunkedOnDeviceNative(MirrorChunkedOnDevice):
    offload_kernel = "native"


def make_hdo(cls, groups, fraction, overlap, sources=None, chunk=None, compute=None, gpu_cls=None):
    """``cls`` over ``groups``; ``gpu_cls``: the GPU optimizer (torch's AdamW by default)."""
    hdo = cls.__new__(cls)
    if chunk is not None:
        hdo.chunk_numel = chunk
    if compute is not None:
        hdo.compute_numel = compute
    if sources is not None:
        # placed from hdo.param_groups (megatron-core's defaults, fused=True, filled in), as
        # attach_host_mirrors reuses megatron-core's placement
        hdo._offload_sources = sources
    HybridDeviceOptimizer.__init__(
        hdo, groups, offload_fraction=fraction, cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=gpu_cls or torch.optim.AdamW, param_update_in_fp32=True,
        pin_cpu_grads=False, overlap_cpu_optimizer_d2h_h2d=overlap, lr=1e-2, betas=(0.9, 0.95),
        eps=1e-8, fused=True,
    )  # fmt: skip
    return hdo


def assert_same_state(stock, mine):
    a = [p for g in stock.param_groups for p in g["params"]]
    b = [p for g in mine.param_groups for p in g["params"]]
    assert len(a) == len(b)
    for pa_, pb in zip(a, b, strict=True):
        sa, sb = stock.state[pa_], mine.state[pb]
        assert sa.keys() == sb.keys() and {"exp_avg", "exp_avg_sq"} <= sa.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key
    assert [p in stock.gpu_params_map_cpu_copy for p in a] == [
        p in mine.gpu_params_map_cpu_copy for p in b
    ]


def train(
    cls, pa, fraction, steps, chunk=None, overlap=True, reload_at=None, compute=None,
    grads_fp32=False,
):  # fmt: skip
    """``steps`` steps of ``cls`` over the two-buffer model at DP=2, rank 1 (fp32 gradient
    buffers for the bf16 parameters with ``grads_fp32``): (bf16, fp32, optimizer, shards)."""
    bf16, fp32, groups, sources, bind, shard16 = sim(pa, False, grads_fp32, 2, 1)
    hdo = make_hdo(
        cls,
        groups,
        fraction,
        overlap,
        None if issubclass(cls, StockPlaced) else sources,
        chunk,
        compute,
    )
    gen = torch.Generator().manual_seed(11)
    for step in range(steps):
        if reload_at == step:
            hdo.load_state_dict(hdo.state_dict())
        one_step(bf16, fp32, bind, hdo, step, gen)
    return bf16, fp32, hdo, shard16


def one_step(bf16, fp32, bind, hdo, step, gen):
    """Fresh gradients, an lr schedule per group, one step."""
    bf16.grad_data.copy_(torch.randn(bf16.grad_data.numel(), generator=gen))
    fp32.grad_data.copy_(torch.randn(fp32.grad_data.numel(), generator=gen))
    bind()
    for i, g in enumerate(hdo.param_groups):
        g["lr"] = 3e-3 * (step + 2) * (i + 1)
    hdo.step()


def train_switching(first, second, pa, fraction, steps, switch_at):
    """train's run, checkpointed after ``switch_at`` steps of ``first`` and resumed in a
    fresh ``second`` optimizer over fresh buffers (model parameters copied, optimizer state
    through state_dict / load_state_dict)."""
    gen = torch.Generator().manual_seed(11)
    run = None
    for step in range(steps):
        if step in (0, switch_at):
            cls = first if step == 0 else second
            bf16, fp32, groups, sources, bind, shard16 = sim(pa, False, False, 2, 1)
            hdo = make_hdo(cls, groups, fraction, True, sources, 200, 64)
            if run is not None:  # the checkpoint: model parameters, then optimizer state
                bf16.param_data.copy_(run[0].param_data)
                fp32.param_data.copy_(run[1].param_data)
                for dst, src in zip(shard16.values(), run[3].values(), strict=True):
                    dst.copy_(src)
                hdo.load_state_dict(run[2].state_dict())
            run = (bf16, fp32, hdo, shard16)
        one_step(bf16, fp32, bind, hdo, step, gen)
    return run


def assert_same_run(a, b):
    assert torch.equal(a[0].param_data, b[0].param_data)
    assert torch.equal(a[1].param_data, b[1].param_data)
    for x, y in zip(a[3].values(), b[3].values(), strict=True):
        assert torch.equal(x, y)
    assert_same_state(a[2], b[2])
