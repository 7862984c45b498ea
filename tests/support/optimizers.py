"""megatron-core's optimizers on the CPU, for the flat optimizer layer's tests.

megatron-core's constructors need CUDA. These stand-ins are the real classes made with
``__new__`` and given exactly the attributes that megatron-core's own methods and
``megatron_ext`` read, over fake gradient buffers laid out as megatron-core lays them out
(64-aligned parameters, DP = 1). :func:`megatron_ext.enable_flat_norm` then runs on them
unchanged; so do megatron-core's ``prepare_grads``, ``step_with_ready_grads``,
``_copy_model_grads_to_main_grads`` (distributed optimizer) and ``ChainedOptimizer``'s
constructor and group check.

Process groups are :class:`RankGroup` objects. :func:`record_all_reduce` makes
``torch.distributed.all_reduce`` treat one as a group of that many ranks holding the same
data (SUM multiplies by the size, MAX keeps the value; ``all_gather_object`` and
``get_world_size`` alike) and logs every all-reduce, so which group
a statistic was reduced over shows in the result and in the log. ``group=None`` (the
default group) counts :data:`WORLD_SIZE` ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer, Float16OptimizerWithFloat16Params

from megatron_ext.layout import ChunkLayout, buffer_layout
from tests.support.fakes import megatron_buffer

BF16, FP32 = torch.bfloat16, torch.float32
WORLD_SIZE = 5  # ranks of the default group under record_all_reduce


class RankGroup:
    """A process group stand-in: this rank's place in ``size`` ranks."""

    def __init__(self, size: int, rank: int = 0, name: str = ""):
        self._size, self._rank, self.name = size, rank, name

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def __repr__(self) -> str:
        return f"RankGroup({self.name or self._size})"


def record_all_reduce(monkeypatch) -> list[tuple[object, object]]:
    """Replace ``torch.distributed.all_reduce`` as the module docstring says; returns the
    log of ``(group, op)`` per call."""
    log = []

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        log.append((group, op))
        if op == dist.ReduceOp.SUM:
            tensor.mul_(WORLD_SIZE if group is None else group.size())

    def get_world_size(group=None):
        return WORLD_SIZE if group is None else group.size()

    def all_gather_object(out, obj, group=None):
        out[:] = [obj] * len(out)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "get_world_size", get_world_size)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    return log


@dataclass(frozen=True)
class Spec:
    """One parameter: name, elements, dtype and megatron-core's attributes."""

    name: str
    numel: int
    dtype: torch.dtype = BF16
    tp: bool = False  # tensor_model_parallel: split, counted on every TP rank
    shared: bool = False
    expert: bool = False  # allreduce=False


def make_params(specs, gen) -> list[torch.nn.Parameter]:
    params = []
    for s in specs:
        p = torch.nn.Parameter(torch.randn(s.numel, generator=gen).to(s.dtype))
        p.tensor_model_parallel = s.tp
        if s.shared:
            p.shared = True
        if s.expert:
            p.allreduce = False
        params.append(p)
    return params


def make_buffer(params, gen, zero_fraction=0.1):
    """One megatron-core gradient buffer over ``params`` (one dtype), filled with fresh
    random gradients (about ``zero_fraction`` of them exactly zero); each parameter's
    ``main_grad`` is its view, as DDP binds it."""
    dtype = params[0].dtype
    index, pos = {}, 0
    for p in params:
        pos = -(-pos // 64) * 64
        index[p] = (pos, pos + p.numel(), 0)
        pos += p.numel()
    numel = -(-pos // 64) * 64
    grad = torch.zeros(numel, dtype=dtype)
    for p, (s, e, _) in index.items():
        g = torch.randn(e - s, generator=gen, dtype=torch.float64) * 3
        g[torch.rand(e - s, generator=gen) < zero_fraction] = 0.0
        grad[s:e] = g.to(dtype)
        p.main_grad = grad[s:e].view(p.shape)
    return megatron_buffer(grad, index, [(0, numel)], RankGroup(1))


class Chunk:
    """What the optimizer layer reads of a :class:`megatron_ext.DistributedDataParallel`:
    its module (for names), its layout and its buffers by key."""

    def __init__(self, named_params: dict[str, torch.nn.Parameter], bufs):
        self.module = torch.nn.Module()
        for name, p in named_params.items():
            self.module.register_parameter(name, p)
        names = {p: n for n, p in named_params.items()}
        layouts = [buffer_layout(b, names) for b in bufs]
        self.layout = ChunkLayout(tuple(layouts))
        self._by_key = {lay.key: b for lay, b in zip(layouts, bufs, strict=True)}

    def grad_buffer(self, key):
        return self._by_key[key]

    def fp32_island(self, key):
        return None


def config(clip=1.0, *, precision_aware=False, zeros=True, threshold=float("inf")):
    """megatron-core's own OptimizerConfig (bf16); precision-aware set after construction
    (its check wants TE's FusedAdam, which the CPU machines lack)."""
    c = OptimizerConfig(
        bf16=True, clip_grad=clip, log_num_zeros_in_grad=zeros, grad_norm_skip_threshold=threshold
    )
    c.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = precision_aware
    return c


class ConstantScaler:
    """megatron-core's grad-scaler interface with a CPU scale (its own allocates on CUDA)."""

    def __init__(self, scale: float):
        self.scale = torch.tensor([scale])
        self.inv_scale = 1.0 / self.scale
        self.updates = []

    def update(self, found_inf: bool) -> None:
        self.updates.append(found_inf)


def _common(child, cfg, group, tp_group, expert_tp_group, scaler):
    child.config = cfg
    child.grad_scaler = scaler
    child.tp_group, child.expert_tp_group = tp_group, expert_tp_group
    child.grad_stats_parallel_group = group
    child.is_stub_optimizer = False
    child.init_state_fn = None
    child.found_inf = torch.zeros(1)
    child._dummy_overflow_buf = None  # megatron-core then copies main params one by one
    child.model_chunks = []


def float16_child(
    params, cfg, group, tp_group, expert_tp_group=None, scaler=None, lr=1.0
) -> Float16OptimizerWithFloat16Params:
    """A ``Float16OptimizerWithFloat16Params`` over ``params``: fp32 main copies of the bf16
    ones, the fp32 ones themselves; torch's SGD (lr=1: a step subtracts the gradient)."""
    child = Float16OptimizerWithFloat16Params.__new__(Float16OptimizerWithFloat16Params)
    low = [p for p in params if p.dtype != FP32]
    high = [p for p in params if p.dtype == FP32]
    mains = [torch.nn.Parameter(p.detach().float()) for p in low]
    child.float16_groups, child.fp32_from_float16_groups = [low], [mains]
    child.fp32_from_fp32_groups = [high]
    child.optimizer = torch.optim.SGD([{"params": [*mains, *high]}], lr=lr)
    _common(child, cfg, group, tp_group, expert_tp_group, scaler)
    return child


def dist_child(
    params, bufs, cfg, group, tp_group, expert_tp_group=None, scaler=None
) -> DistributedOptimizer:
    """A ``DistributedOptimizer`` at DP = 1 over ``bufs``, its ranges from megatron-core's
    own builders; its optimizer's group lists fp32 shards first, as megatron-core's does."""
    child = DistributedOptimizer.__new__(DistributedOptimizer)
    child.buffers = list(bufs)
    child.gbuf_ranges = [DistributedOptimizer._build_gbuf_range_map(b) for b in bufs]
    child.model_param_gbuf_map = DistributedOptimizer._build_model_param_gbuf_map(child.gbuf_ranges)
    child.model_param_group_index_map, _ = DistributedOptimizer._build_optimizer_group_ranges(
        [{"params": list(params)}], child.gbuf_ranges
    )
    pa = cfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    low = [p for p in params if p.dtype != FP32]
    high = [p for p in params if p.dtype == FP32]
    child.model_float16_groups, child.model_fp32_groups = [low], [high]
    child.shard_float16_groups = [[p.detach().view(-1) for p in low]] if pa else [[]]
    child.shard_fp32_from_float16_groups = [[] if pa else [p.detach().float() for p in low]]
    child.shard_fp32_groups = [[p.detach().view(-1) for p in high]]
    mains = child.shard_float16_groups[0] if pa else child.shard_fp32_from_float16_groups[0]
    child.optimizer = SimpleNamespace(
        param_groups=[{"params": [*child.shard_fp32_groups[0], *mains]}], state={}
    )
    child.ddp_config = SimpleNamespace(use_megatron_fsdp=False)
    _common(child, cfg, group, tp_group, expert_tp_group, scaler)
    return child


def chain(children) -> ChainedOptimizer:
    """megatron-core's own ChainedOptimizer over ``children``, with its cached answer that
    no parameter is in a separate grad-norm group (megatron-core computes it on CUDA)."""
    opt = ChainedOptimizer(children)
    opt._has_grad_norm_group_cache = {"mtp": False}
    return opt


def counted(p, tp_rank=0, expert_tp_rank=0) -> bool:
    """First principles: not shared, and a replicated parameter counts on TP rank 0 only
    (the expert TP rank for expert parameters)."""
    if getattr(p, "shared", False):
        return False
    rank = expert_tp_rank if not getattr(p, "allreduce", True) else tp_rank
    return bool(p.tensor_model_parallel) or rank == 0


def sumsq(grads) -> float:
    """fp64 sum of squares."""
    return sum(float(g.double().square().sum()) for g in grads)
