"""A CPU simulation of the distributed optimizer's shard parameters under megatron-core's
``HybridDeviceOptimizer``: two flat buffers (bf16 weights, natively fp32 parameters), their
shard parameters and gradient bindings as megatron-core makes them (optionally with fp32
local-accumulation islands), placed by megatron-core's own greedy rule, stock or with host
mirrors (the per-parameter or the chunked step), trained with fresh gradients and an lr
schedule. Streams and events are the recording stand-ins of :mod:`tests.support.streams`,
and every host-mirror copy is checked against them.

Two references, neither built from the code under test: megatron-core's optimizer with
nothing of ours (:class:`StockPlaced`, fed its gradients where its torch optimizers read
them), and AdamW written out in fp64 per parameter (:class:`Fp64AdamW`).
"""

from __future__ import annotations

import types

import torch
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from torch.overrides import TorchFunctionMode

from buffers.spans import Span, dp_shard_spans, intersect_spans, merge_spans, to_local
from megatron_ext.layout import buffer_layout
from megatron_ext.offload import HostMirrorHybridOptimizer, OffloadSource
from megatron_ext.offload.chunked import OverlappedUpdate
from megatron_ext.offload.host_mirror import HostBlock
from megatron_ext.offload.step import ChunkedAdamW
from tests.support import offload_internals, streams


def S(a, b):
    return Span(a, b)


def trace_host_mirrors(monkeypatch, log: streams.Log) -> None:
    """Every host-mirror copy and host access of the offload code checked against ``log``."""
    hb = streams.host_bytes

    def traced_step_began(what: str) -> None:
        # every host-mirror copy is issued by a step, or by landing one: a copy before any
        # step began means the step's trace was shadowed, and with it the checks of the
        # step's start and end
        if not log.steps:
            raise streams.OrderError(
                f"{what} issued before any traced optimizer step began: the step is not "
                "traced (see step_classes)"
            )

    def start_d2h(self):
        dst, src = self.d2h
        traced_step_began(f"d2h of {dst.numel()} elements")
        log.device_copy(f"d2h of {dst.numel()} elements", hb(dst), to_host=True)
        for stage, _, _, _ in self.islands:
            log.device_copy(f"island d2h of {stage.numel()}", hb(stage), to_host=True)
        real_d2h(self)

    def start_h2d(self):
        traced_step_began(f"h2d of {self.h2d[1].numel()} elements")
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
                flight = (
                    self.offload.in_flight if isinstance(self, HostMirrorHybridOptimizer) else None
                )
                log.step_ends(overlapped=isinstance(flight, OverlappedUpdate))
                return out
            finally:
                depth[0] -= 1

        # torch.optim.Optimizer wraps ``type(self).step`` in its profiler hook when an
        # instance is built, unless what it finds is marked ``hooked``: marked, no class
        # built during this test gets a wrapper of this trace that outlives it
        step.hooked = True  # type: ignore[attr-defined]
        return step

    for cls in step_classes():
        monkeypatch.setattr(cls, "step", traced(cls.__dict__["step"]))


def step_classes() -> list[type]:
    """Every class of the offload optimizer's family that defines ``step`` itself:
    megatron-core's and ours, and each subclass torch's profiler hook was put on
    (``Optimizer._patch_step_function`` writes it on the first class of a kind that is
    built, where it shadows a trace of the parent's ``step``)."""
    found: list[type] = []
    todo = [HybridDeviceOptimizer]
    while todo:
        cls = todo.pop()
        if "step" in cls.__dict__ and cls not in found:
            found.append(cls)
        todo += cls.__subclasses__()
    return found


def recording_streams(monkeypatch) -> streams.Log:
    """megatron-core's CUDA streams and events replaced by recording stand-ins, and every
    host-mirror copy checked against them (:mod:`tests.support.streams`); the log."""
    log = streams.install(monkeypatch)
    trace_host_mirrors(monkeypatch, log)
    return log


ALIGN = 64
SHAPES = {"w1": (24, 16), "b1": (24,), "w2": (16, 24), "b2": (16,), "ln": (16,)}
FP32_SHAPES = {"sink": (16,), "router": (4, 16)}
# parameters whose gradient the optimizer reads in an fp32 island (with ``islands=True``):
# at DP=2 rank 1 (train's), a piece of w2, ln and router: both buffers, both weight-decay
# groups
ISLAND_NAMES = ("w2", "ln", "router")
# The buffer slice of an island parameter holds its gradient times this (a loss scale that
# is not a power of two); the island holds the unscaled fp32 value, which bf16 cannot hold.
ISLAND_SCALE = 1000.0
BETAS, EPS = (0.9, 0.95), 1e-8


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
        self.island: dict[str, torch.Tensor] = {}  # name: fp32 gradient of its shard
        self.shard_params: dict[str, torch.Tensor] = {}  # name: the optimizer's parameter

    def carve_island(self, names) -> None:
        """One fp32 island holding the shard gradients of ``names`` (those this rank owns)."""
        mine = [n for n in names if n in self.shards]
        flat = torch.zeros(sum(self.shards[n].numel for n in mine))
        at = 0
        for n in mine:
            self.island[n] = flat[at : at + self.shards[n].numel]
            at += self.shards[n].numel

    def fill_islands(self) -> None:
        """Each island gradient: its buffer slice unscaled (fp32 values bf16 cannot hold)."""
        for n, view in self.island.items():
            s = self.shards[n]
            view.copy_(self.grad_data[s.start : s.end].double() / ISLAND_SCALE)

    def optimizer_grad(self, name: str) -> torch.Tensor:
        """The gradient megatron-core's optimizer reads for shard ``name``: its island
        view, else its slice of the gradient buffer."""
        if name in self.island:
            return self.island[name]
        s = self.shards[name]
        return self.grad_data[s.start : s.end]


def sim(pa, fp32_first, grads_fp32, dp, rank, *, torch_grads=False, islands=False):
    """Two buffers, shard parameters and their gradient bindings, as megatron-core has them.

    Args:
        torch_grads: natively fp32 shards also get their precision-aware gradient as
            ``.grad``, where a torch optimizer reads it (megatron-core binds none: its GPU
            optimizer skips them; the reference run is given them this way).
        islands: the shards of :data:`ISLAND_NAMES` read their gradients in fp32 islands
            (precision-aware only, as megatron-core has them without an fp32 mirror).
    """
    bf16 = SimBuffer(
        SHAPES, torch.bfloat16, torch.float32 if grads_fp32 else torch.bfloat16, dp, rank
    )
    fp32 = SimBuffer(FP32_SHAPES, torch.float32, torch.float32, dp, rank)
    if islands:
        if not pa:
            raise ValueError("islands=True simulates the precision-aware optimizer (pa=True)")
        for buf in (bf16, fp32):
            buf.carve_island(ISLAND_NAMES)
    mirror = None
    if pa:
        shard16 = {n: bf16.param_data[s.start : s.end] for n, s in bf16.shards.items()}
    else:
        # fp32 main shards (separate tensors) whose .grad is an fp32 mirror of the shard
        shard16 = {n: bf16.param_data[s.start : s.end].float() for n, s in bf16.shards.items()}
        mirror = torch.zeros(sum(o.numel for o in bf16.owned))
    shard32 = {n: fp32.param_data[s.start : s.end] for n, s in fp32.shards.items()}
    bf16.shard_params, fp32.shard_params = shard16, shard32
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

    def island_of(buf):
        return tuple((buf.shards[n], view) for n, view in buf.island.items())

    sources = (
        OffloadSource(
            "bf16", bf16.owned, mirror if mirror is not None else bf16.grad_data,
            bf16.owned if mirror is not None else None, bf16.param_data,
            {shard16[n]: bf16.shards[n] for n in shard16}, island_of(bf16),
        ),
        OffloadSource(
            "fp32", fp32.owned, fp32.grad_data, None, fp32.param_data,
            {shard32[n]: fp32.shards[n] for n in shard32}, island_of(fp32),
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
        for buf in (bf16, fp32):
            buf.fill_islands()
        for n, p in shard16.items():
            if pa:
                p.decoupled_grad = bf16.optimizer_grad(n)
            else:
                (local,) = to_local([bf16.shards[n]], bf16.owned)
                p.grad = mirror[local.start : local.end]
        for n, p in shard32.items():
            view = fp32.optimizer_grad(n)
            if pa:
                p.decoupled_grad = view
                if torch_grads:
                    p.grad = view
            else:
                p.grad = view

    return bf16, fp32, groups, sources, bind_grads, shard16


class _OnTheDevice(TorchFunctionMode):
    """CPU tensors that read as CUDA ones: ``originals``, and whatever is computed from them
    without a ``.cpu()``; ``.cpu()`` of one copies, ``pin_memory()`` is the identity. Under
    it, megatron-core's own placement (which offloads only parameters on a CUDA device) runs
    on CPU tensors as it would on the device."""

    def __init__(self, originals):
        super().__init__()
        self.device = {id(t): t for t in originals}  # kept alive: ids are not reused

    def on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self.device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is torch._C.TensorBase.is_cuda:
            return self.on_device(args[0])
        if func is torch._C.TensorBase.cpu:
            return args[0].clone() if self.on_device(args[0]) else args[0]
        if func is torch._C.TensorBase.pin_memory:
            return args[0]
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and any(self.on_device(a) for a in args):
            self.device[id(out)] = out
        return out


def on_the_device(groups) -> _OnTheDevice:
    """Every parameter of ``groups`` on the "device" (:class:`_OnTheDevice`), in a ``with``."""
    return _OnTheDevice([p for g in groups for p in g["params"]])


# megatron-core's own placement, as imported (a test may replace the method with placement)
_MEGATRON_PLACEMENT = HybridDeviceOptimizer.__dict__["_get_sub_optimizer_param_groups"]
if _MEGATRON_PLACEMENT.__module__ != HybridDeviceOptimizer.__module__:
    raise RuntimeError(
        "tests.support.offload_sim was first imported with HybridDeviceOptimizer's placement "
        "replaced; import it before replacing the method"
    )


def placement(groups, fraction, param_update_in_fp32=True):
    """megatron-core's own ``_get_sub_optimizer_param_groups`` over ``groups``, every
    parameter on the "device" (:func:`on_the_device`)."""
    # pin_cpu_params: read by megatron-core after 0.19 (the fp32 CPU copies pinned); the
    # simulation's host copies are never pinned
    hdo = types.SimpleNamespace(
        param_groups=groups, param_update_in_fp32=param_update_in_fp32, pin_cpu_params=False
    )
    with on_the_device(groups):
        return _MEGATRON_PLACEMENT(hdo, fraction)


class StockPlaced(HybridDeviceOptimizer):
    """The reference: megatron-core's optimizer, nothing of ours; its own placement, run
    with every parameter on the "device". Build its simulation with ``torch_grads=True``
    where it should train natively fp32 parameters that stay on the GPU (megatron-core
    gives their torch optimizer no gradient: ``test_gpu_resident_fp32_params_train...``)."""

    def _get_sub_optimizer_param_groups(self, offload_fraction):
        with on_the_device(self.param_groups):
            return super()._get_sub_optimizer_param_groups(offload_fraction)


class MirrorPlaced(HostMirrorHybridOptimizer):
    """Host mirrors; megatron-core's placement as for :class:`StockPlaced`."""

    def _get_sub_optimizer_param_groups(self, offload_fraction):
        with on_the_device(self.param_groups):
            return super()._get_sub_optimizer_param_groups(offload_fraction)


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
        offload_internals.set_sources(hdo, sources)
    HybridDeviceOptimizer.__init__(
        hdo, groups, offload_fraction=fraction, cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=gpu_cls or torch.optim.AdamW, param_update_in_fp32=True,
        pin_cpu_grads=False, overlap_cpu_optimizer_d2h_h2d=overlap, lr=1e-2, betas=BETAS,
        eps=EPS, fused=True,
    )  # fmt: skip
    return hdo


def distopt_shaped(pa, dp, rank):
    """A DistributedOptimizer's attributes that attach_host_mirrors reads, over _Buffers,
    with its flat targets built by megatron_ext.targets and a megatron-core
    HybridDeviceOptimizer (placed as above) inside: the glue, on the CPU."""
    from types import SimpleNamespace

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_ext.targets import FlatOptimizerState, buffer_target

    group = SimpleNamespace(size=lambda: dp, rank=lambda: rank)
    child = DistributedOptimizer.__new__(DistributedOptimizer)
    child.config = SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=pa)
    child.is_stub_optimizer = False
    child.buffers, targets, ranges = [], [], {}
    child.model_param_gbuf_map = {}
    models, shards = {}, {}
    for index, (shapes, dtype) in enumerate(
        ((SHAPES, torch.bfloat16), (FP32_SHAPES, torch.float32))
    ):
        b = SimBuffer(shapes, dtype, dtype, dp, rank)
        index_map = {}
        for name, span in b.spans.items():
            model = b.param_data[span.start : span.end].view(shapes[name])
            index_map[model] = (span.start, span.end, 0)
            child.model_param_gbuf_map[model] = (index, (dtype, dtype), 0)
            piece = b.shards.get(name)
            if piece is None:
                continue
            ranges[model] = {
                "param": SimpleNamespace(start=piece.start - span.start, end=piece.end - span.start)
            }
            shard = b.param_data[piece.start : piece.end]
            if dtype == torch.bfloat16 and not pa:
                shard = shard.float()  # an fp32 main shard
            models[model], shards[model] = dtype, shard
        buf = SimpleNamespace(
            param_index_map=index_map, grad_data=b.grad_data, param_data=b.param_data,
            numel=b.grad_data.numel(), bucket_indices=[(0, b.grad_data.numel())],
            data_parallel_group=group, grad_dtype=dtype, param_dtype=dtype,
        )  # fmt: skip
        needs_mirror = not pa and dtype != torch.float32
        layout = buffer_layout(buf, {m: n for m, n in zip(index_map, b.spans, strict=True)})
        targets.append(
            buffer_target(buf, layout, layout.records, sharded=True, needs_mirror=needs_mirror)
        )
        child.buffers.append(buf)
    child._get_model_param_range_map = ranges.__getitem__
    offload_internals.set_flat_state(child, FlatOptimizerState(targets, None))
    halves = [[m for m in models if models[m] == dt] for dt in (torch.bfloat16, torch.float32)]
    child.model_float16_groups, child.model_fp32_groups = [halves[0]], [halves[1]]
    shard16 = [[shards[m] for m in halves[0]]]
    child.shard_float16_groups = shard16 if pa else [[None] * len(halves[0])]
    child.shard_fp32_from_float16_groups = [[None] * len(halves[0])] if pa else shard16
    child.shard_fp32_groups = [[shards[m] for m in halves[1]]]
    groups = [{"params": [*child.shard_fp32_groups[0], *shard16[0]], "weight_decay": 0.0}]
    child.optimizer = make_hdo(StockPlaced, groups, 0.5, False)
    return child


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
    grads_fp32=False, islands=False,
):  # fmt: skip
    """``steps`` steps of ``cls`` over the two-buffer model at DP=2, rank 1 (fp32 gradient
    buffers for the bf16 parameters with ``grads_fp32``, fp32 islands with ``islands``):
    (bf16, fp32, optimizer, shards). :class:`StockPlaced` is given the gradients of natively
    fp32 parameters as ``.grad`` too (``sim``'s ``torch_grads``)."""
    stock = issubclass(cls, StockPlaced)
    bf16, fp32, groups, sources, bind, shard16 = sim(
        pa, False, grads_fp32, 2, 1, torch_grads=stock, islands=islands
    )
    hdo = make_hdo(cls, groups, fraction, overlap, None if stock else sources, chunk, compute)
    gen = torch.Generator().manual_seed(11)
    for step in range(steps):
        if reload_at == step:
            hdo.load_state_dict(hdo.state_dict())
        one_step(bf16, fp32, bind, hdo, step, gen)
    return bf16, fp32, hdo, shard16


def fresh_grads(bf16, fp32, gen) -> None:
    """The next step's gradients in both buffers (randn, rounded to the buffer's dtype)."""
    bf16.grad_data.copy_(torch.randn(bf16.grad_data.numel(), generator=gen))
    fp32.grad_data.copy_(torch.randn(fp32.grad_data.numel(), generator=gen))


def lr_at(step: int, group: int) -> float:
    """The lr schedule :func:`one_step` sets: per step, per param group."""
    return 3e-3 * (step + 2) * (group + 1)


def one_step(bf16, fp32, bind, hdo, step, gen):
    """Fresh gradients, an lr schedule per group, one step."""
    fresh_grads(bf16, fp32, gen)
    bind()
    for i, g in enumerate(hdo.param_groups):
        g["lr"] = lr_at(step, i)
    hdo.step()


class Fp64AdamW:
    """AdamW from its formula (torch's: decoupled weight decay, bias-corrected moments, eps
    outside the square root), in fp64, one flat parameter at a time, keyed by name."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self.params = {n: p.detach().double().reshape(-1).clone() for n, p in params.items()}
        self.exp_avg = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.exp_avg_sq = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.steps = 0

    def step(self, grads: dict, lr: dict, weight_decay: dict) -> None:
        self.steps += 1
        t, (b1, b2) = self.steps, BETAS
        for n, p in self.params.items():
            g = grads[n].double().reshape(-1)
            p.mul_(1 - lr[n] * weight_decay[n])
            m = self.exp_avg[n].mul_(b1).add_((1 - b1) * g)
            v = self.exp_avg_sq[n].mul_(b2).add_((1 - b2) * g * g)
            p.sub_(lr[n] * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + EPS))


def fp64_run(pa, steps, grads_fp32=False, islands=False) -> Fp64AdamW:
    """:func:`train`'s run (the same gradients, each as megatron-core's optimizer reads it;
    the same hyperparameters), stepped by :class:`Fp64AdamW` alone."""
    bf16, fp32, _, _, bind, _ = sim(pa, False, grads_fp32, 2, 1, islands=islands)
    names = {n: buf for buf in (bf16, fp32) for n in buf.shards}
    decay = {n: len((SHAPES | FP32_SHAPES)[n]) > 1 for n in names}
    ref = Fp64AdamW({n: buf.shard_params[n] for n, buf in names.items()})
    gen = torch.Generator().manual_seed(11)
    for step in range(steps):
        fresh_grads(bf16, fp32, gen)
        bind()
        ref.step(
            {n: buf.optimizer_grad(n) for n, buf in names.items()},
            {n: lr_at(step, 0 if decay[n] else 1) for n in names},
            {n: 0.1 if decay[n] else 0.0 for n in names},
        )
    return ref


def assert_adamw_in_fp64_terms(run, ref: Fp64AdamW) -> None:
    """Every shard's parameter, fp32 master weights and moments (the optimizer's ``state``)
    against :class:`Fp64AdamW`: fp32 values to a few fp32 roundings per step; parameters
    kept in bf16 to their rounding (half a bf16 unit, 2^-8 relative)."""
    bf16, fp32, hdo, _ = run
    seen = 0
    for buf in (bf16, fp32):
        for n, p in buf.shard_params.items():
            state = hdo.state[p]
            assert float(state["step"]) == ref.steps, n
            close = dict(rtol=1e-5, atol=1e-7)
            for key, want in (
                ("master_param", ref.params[n]),
                ("exp_avg", ref.exp_avg[n]),
                ("exp_avg_sq", ref.exp_avg_sq[n]),
            ):
                got = state[key].double().reshape(-1)
                torch.testing.assert_close(got, want, **close, msg=f"{n} {key}")
            got = p.detach().double().reshape(-1)
            if p.dtype == torch.bfloat16:
                close = dict(rtol=2**-8 + 1e-5, atol=1e-7)
            torch.testing.assert_close(got, ref.params[n], **close, msg=n)
            seen += 1
    assert seen == len(ref.params)


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
