"""megatron-core optimizers whose norm, clip and zero count read flat buffer spans.

The entry points; the parts, each a module a test can import alone:
:mod:`~megatron_ext.opt_state` (what each optimizer reads, built once),
:mod:`~megatron_ext.flat_optimizer` and :mod:`~megatron_ext.flat_chain` (the methods
given to one optimizer and to a chain), :mod:`~megatron_ext.flat_state` (the state they
read, and [Note: the class swap]), :mod:`~megatron_ext.opt_checkpoint` (checkpoint save and
load repairs).
"""

from __future__ import annotations

import contextlib

from buffers.graphs import NormClip

from . import offload, refusals, seam
from .flat_chain import FlatChainedOptimizer
from .flat_optimizer import FlatNormOptimizer
from .flat_state import FlatNormState
from .global_param_norms import global_param_names
from .megatron_options import MegatronOptions
from .offload import host_memory
from .opt_checkpoint import (
    align_group_order,
    create_state_before_loading,
    place_sub_optimizer_state,
)
from .opt_state import (
    _build_state,
    _check_no_separate_norm_groups,
    _check_supported,
    buffers_device,
    placed_buffers,
)
from .targets import FlatOptimizerState

__all__ = [
    "FlatChainedOptimizer",
    "FlatNormOptimizer",
    "align_group_order",
    "create_state_before_loading",
    "enable_flat_norm",
    "get_megatron_optimizer",
    "place_sub_optimizer_state",
]

DistributedOptimizer = seam.target("DistributedOptimizer")
ChainedOptimizer = seam.target("ChainedOptimizer")


def get_megatron_optimizer(
    config, model_chunks, *args, options: MegatronOptions | None = None, **kwargs
):
    """megatron-core's ``get_megatron_optimizer``, flat norm/clip when the DDP option is on.

    Same signature and return types as megatron-core's. When the model chunks are
    :class:`megatron_ext.DistributedDataParallel` with ``per_dtype_grad_buffers=True``, the
    returned optimizers (each child of the ``ChainedOptimizer`` and the chain itself) compute
    ``get_grad_norm``, ``clip_grad_norm``, ``count_zeros`` and ``step`` from spans of the
    flat buffers computed here, once. Natively fp32 parameters also work with the
    distributed optimizer and CPU offload, which stock megatron-core 0.19 rejects.

    ``options`` (:class:`megatron_ext.MegatronOptions`, only read when the option is on):
    the kernels' backend, CUDA-graph replay, and with CPU offload
    (``optimizer_cpu_offload=True``) whether gradients and parameters move through one
    pinned host mirror per flat buffer (``host_mirrors=True``, the default;
    :mod:`megatron_ext.offload`) or megatron-core's per-parameter copies. With CPU offload
    the host and GPU memory it needs are checked first, and the fraction chosen with
    ``offload_fraction="auto"`` (:func:`megatron_ext.offload.host_memory.check_before_build`):
    ``OffloadMemoryError`` before megatron-core allocates anything.
    """
    flags = [bool(getattr(m, "per_dtype_grad_buffers", False)) for m in model_chunks]
    if not any(flags):
        return seam.target("get_megatron_optimizer")(config, model_chunks, *args, **kwargs)
    if not all(flags):
        raise ValueError(
            "some model chunks have per_dtype_grad_buffers=True and some do not; wrap every "
            "chunk in megatron_ext.DistributedDataParallel with the same ddp_config"
        )
    options = MegatronOptions() if options is None else options
    unread = options.offload_only()
    if unread and not getattr(config, "optimizer_cpu_offload", False):
        raise ValueError(
            f"MegatronOptions({', '.join(unread)}) sets how CPU offload runs, and this "
            "optimizer does not offload (OptimizerConfig.optimizer_cpu_offload=False): add "
            "optimizer_cpu_offload=True, or drop them"
        )
    if getattr(config, "optimizer_cpu_offload", False):
        # the fraction ("auto"), then host and GPU memory, before megatron-core allocates
        config = host_memory.check_before_build(config, model_chunks, options)
    with _fp32_shards_as_leaves():
        opt = seam.target("get_megatron_optimizer")(config, model_chunks, *args, **kwargs)
    return enable_flat_norm(opt, model_chunks, options=options)


@contextlib.contextmanager
def _fp32_shards_as_leaves():
    """Make the distributed optimizer's fp32 parameter shards detached views (leaves).

    megatron-core 0.19 slices fp32 parameters without ``detach()``; with CPU offload the
    rebuilt ``HybridDeviceOptimizer`` then raises "can't optimize a non-leaf Tensor". A
    detached view shares the same storage, so updates still land in the model's buffer.
    Scoped to the construction call, and restored after it.
    """
    original = DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]

    def build(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config):
        groups = original.__func__(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
        for shard_group, group_range in zip(groups[3], opt_group_ranges, strict=True):
            swap = {}
            for i, shard in enumerate(shard_group):
                if shard is not None and not shard.is_leaf:
                    leaf = shard.detach()
                    leaf.__dict__.update(shard.__dict__)  # Megatron's tensor-parallel attributes
                    shard_group[i] = leaf
                    swap[id(shard)] = leaf
            params = group_range["orig_group"]["params"]
            group_range["orig_group"]["params"] = [swap.get(id(p), p) for p in params]
        return groups

    DistributedOptimizer._build_model_and_main_param_groups = classmethod(build)
    try:
        yield
    finally:
        DistributedOptimizer._build_model_and_main_param_groups = original


def enable_flat_norm(opt, model_chunks, *, options: MegatronOptions | None = None):
    """Give ``opt`` (a ChainedOptimizer or one child) flat norm/clip; returns it.

    ``options.host_mirrors``: CPU-offloaded distributed optimizers also get flat host
    mirrors (:func:`megatron_ext.offload.attach_host_mirrors`).
    """
    options = MegatronOptions() if options is None else options
    if isinstance(opt, ChainedOptimizer):
        seam.check_instance("ChainedOptimizer", opt)
    children = opt.chained_optimizers if isinstance(opt, ChainedOptimizer) else [opt]
    placed = placed_buffers(model_chunks)
    device = buffers_device(placed)
    _check_no_separate_norm_groups(opt)
    names: dict[int, str] = {}  # global names, for per-parameter norms
    for m in model_chunks:
        names.update(global_param_names(m.module))
    # the children whose host updates run at once (the delayed update): they share the cores
    offloading = sum(offload.offloads_to_host(c) for c in children)
    for child in children:
        if isinstance(child, DistributedOptimizer) and not getattr(
            child, "is_stub_optimizer", False
        ):
            align_group_order(child)
        _check_supported(child)
        refusals.check(child, placed)
        spans = _build_state(child, placed, options)
        # Norm and scale launches over these fixed spans, replayed as CUDA graphs.
        launches = NormClip(spans.norm_groups, spans.scale_groups, device, options)
        _give_flat_methods(child, FlatNormState(spans, names, launches))
        if options.host_mirrors:
            offload.attach_host_mirrors(
                child,
                chunked_step=options.offload_step == "chunked",
                chunk_numel=options.offload_chunk_numel,
                threads=options.offload_threads,
                convert_on_device=options.offload_convert == "device",
                delayed_update=options.offload_delayed_update,
                delay_warmup=options.offload_delay_warmup,
                sharing=max(1, offloading),
                pin_threads=options.offload_pin_threads,
                overlap_forward=options.offload_overlap_forward,
                model_chunks=model_chunks,
            )
    if isinstance(opt, ChainedOptimizer):
        over_children: NormClip | None = None  # a chain of one hands everything to its child
        if len(children) > 1:
            # Every child's spans in one sequence, for a norm and clip over a shared group:
            # one replay in all (the same kernels per buffer as the children's; tables shared).
            over_children = NormClip(
                [g for c in children for g in c._flat.spans.norm_groups],
                [g for c in children for g in c._flat.spans.scale_groups],
                device,
                options,
            )
        chain_state = FlatNormState(FlatOptimizerState([], None), names, over_children)
        _give_flat_methods(opt, chain_state)
    return opt


def _give_flat_methods(opt, state: FlatNormState) -> None:
    """Attach ``state`` and swap ``opt``'s class for its flat subclass ([Note: the class
    swap] in :mod:`megatron_ext.flat_state`, which lists what else is set on megatron-core's
    objects; the seam's table lists every attribute)."""
    opt._flat = state
    opt.__class__ = _flat_class(type(opt))


_CLASSES: dict[type, type] = {}


def _flat_class(cls: type) -> type:
    """A subclass of ``cls`` with the flat methods (cached; isinstance(x, cls) still holds).

    The methods are copied into a direct subclass rather than mixed in as a second base:
    only single inheritance keeps the instance layout that ``__class__`` assignment needs.
    Only the mixin's methods and properties are copied, not what its protocol base adds
    to its namespace (``_is_protocol``, the ABC registry).
    """
    mixin = FlatChainedOptimizer if issubclass(cls, ChainedOptimizer) else FlatNormOptimizer
    if getattr(cls, "_flat_base", None) is not None:
        return cls
    if cls not in _CLASSES:
        methods = {
            k: v
            for k, v in vars(mixin).items()
            if not k.startswith("__") and (callable(v) or isinstance(v, property))
        }
        methods.update(_flat_base=cls, __doc__=mixin.__doc__)
        _CLASSES[cls] = type(f"Flat{cls.__name__}", (cls,), methods)
    return _CLASSES[cls]
