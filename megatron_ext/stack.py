"""One call that builds the DDP model and its optimizer, with both configs agreeing."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import seam
from .config import DistributedDataParallelConfig
from .ddp import DistributedDataParallel
from .megatron_options import MegatronOptions
from .optimizer import get_megatron_optimizer

_MCoreDDPConfig: Any = seam.target("DistributedDataParallelConfig")
OptimizerConfig: Any = seam.target("OptimizerConfig")  # megatron-core ships no type hints

# Set by build_stack's own arguments, so that the DDP config and the optimizer config cannot
# disagree (megatron-core's distributed optimizer needs both on or both off).
_DDP_ARGUMENTS = {
    "per_dtype_grad_buffers": "per_dtype_grad_buffers",
    "use_distributed_optimizer": "distributed_optimizer",
}
_OPTIMIZER_ARGUMENTS = {"use_distributed_optimizer": "distributed_optimizer"}


@dataclass(frozen=True)
class Stack:
    """What :func:`build_stack` built.

    Attributes:
        model: the module wrapped in :class:`megatron_ext.DistributedDataParallel`.
        optimizer: what :func:`megatron_ext.get_megatron_optimizer` returned for ``[model]``.
        ddp_config: the DDP config ``model`` was built with.
        optimizer_config: megatron-core's ``OptimizerConfig`` ``optimizer`` was built with.
    """

    model: DistributedDataParallel
    optimizer: Any
    ddp_config: Any
    optimizer_config: Any


def build_stack(
    module: torch.nn.Module,
    transformer_config: Any,
    *,
    per_dtype_grad_buffers: bool = True,
    distributed_optimizer: bool = True,
    ddp: Mapping[str, Any] | DistributedDataParallelConfig | None = None,
    optimizer: Mapping[str, Any] | Any | None = None,  # Any: an OptimizerConfig
    options: MegatronOptions | None = None,
) -> Stack:
    """Wrap ``module`` in DDP and build its optimizer, per-dtype gradient buffers by default.

    The three calls of the README's Megatron section in one:
    :class:`megatron_ext.DistributedDataParallelConfig`, then
    :class:`megatron_ext.DistributedDataParallel` ``(transformer_config, ddp_config,
    module)``, then :func:`megatron_ext.get_megatron_optimizer` ``(optimizer_config,
    [model], options=options)``. With ``per_dtype_grad_buffers=False`` those classes run
    megatron-core's code unchanged (stock buffers, megatron-core's optimizer factory and
    return types), which makes this the one builder for both sides of a comparison.

    Args:
        module: the model chunk to wrap (parameters already on the GPU).
        transformer_config: megatron-core's ``TransformerConfig`` for ``module``.
        per_dtype_grad_buffers: the DDP option; False builds stock megatron-core buffers.
        distributed_optimizer: ``use_distributed_optimizer`` of both configs (on by
            default here, off in megatron-core's configs).
        ddp: other DDP config fields by name (``grad_reduce_in_fp32``, ``bucket_size``,
            ``overlap_grad_reduce``, ...), or a ready DDP config whose
            ``per_dtype_grad_buffers`` and ``use_distributed_optimizer`` match the two
            arguments above (megatron-core's own class only with the option off). None:
            megatron-core's defaults.
        optimizer: megatron-core ``OptimizerConfig`` fields by name (``lr``, ``clip_grad``,
            ``use_precision_aware_optimizer``, ``optimizer_cpu_offload``,
            ``optimizer_offload_fraction``, ...), or a ready ``OptimizerConfig`` whose
            ``use_distributed_optimizer`` matches ``distributed_optimizer``. From a mapping,
            ``bf16`` and ``fp16`` default to ``transformer_config``'s, as Megatron-LM sets
            both from one argument. None: that and megatron-core's defaults.
        options: :class:`megatron_ext.MegatronOptions` for the flat norm, clip and CPU
            offload; only with ``per_dtype_grad_buffers=True``.

    Returns:
        A :class:`Stack` of the model, the optimizer and the two configs.

    Raises:
        ValueError: a field set twice (in ``ddp``/``optimizer`` and by an argument above),
            a field megatron-core's config does not have, a ready config that disagrees
            with the arguments, or ``options`` without ``per_dtype_grad_buffers``. Raised
            before anything is allocated.
        TypeError: ``ddp`` or ``optimizer`` is neither a mapping nor a config.
        RuntimeError: torch sees no CUDA GPU (megatron-core's DDP and optimizers run on
            CUDA only), raised after the checks above and before megatron-core runs.
    """
    if options is not None and not per_dtype_grad_buffers:
        raise ValueError(
            "options apply to per-dtype gradient buffers only; pass options=None with "
            "per_dtype_grad_buffers=False"
        )
    ddp_config = _ddp_config(ddp, per_dtype_grad_buffers, distributed_optimizer)
    optimizer_config = _optimizer_config(optimizer, transformer_config, distributed_optimizer)
    model = DistributedDataParallel(transformer_config, ddp_config, module)
    built = get_megatron_optimizer(optimizer_config, [model], options=options)
    return Stack(model, built, ddp_config, optimizer_config)


def _ddp_config(ddp, per_dtype_grad_buffers: bool, distributed_optimizer: bool):
    arguments = {
        "per_dtype_grad_buffers": per_dtype_grad_buffers,
        "use_distributed_optimizer": distributed_optimizer,
    }
    if isinstance(ddp, _MCoreDDPConfig):
        if per_dtype_grad_buffers and not isinstance(ddp, DistributedDataParallelConfig):
            raise ValueError(
                "ddp is megatron-core's own DDP config, which has no per_dtype_grad_buffers; "
                "pass a megatron_ext.DistributedDataParallelConfig, or per_dtype_grad_buffers"
                "=False for stock buffers"
            )
        have = {
            "per_dtype_grad_buffers": getattr(ddp, "per_dtype_grad_buffers", False),
            "use_distributed_optimizer": ddp.use_distributed_optimizer,
        }
        _check_agrees("ddp", have, arguments, _DDP_ARGUMENTS)
        return ddp
    fields = _fields("ddp", ddp, DistributedDataParallelConfig, _DDP_ARGUMENTS)
    return DistributedDataParallelConfig(**arguments, **fields)


def _optimizer_config(optimizer, transformer_config, distributed_optimizer: bool):
    arguments = {"use_distributed_optimizer": distributed_optimizer}
    if isinstance(optimizer, OptimizerConfig):
        seam.check_instance("OptimizerConfig", optimizer)
        have = {"use_distributed_optimizer": optimizer.use_distributed_optimizer}
        _check_agrees("optimizer", have, arguments, _OPTIMIZER_ARGUMENTS)
        return optimizer
    fields = _fields("optimizer", optimizer, OptimizerConfig, _OPTIMIZER_ARGUMENTS)
    precision = {
        "bf16": bool(getattr(transformer_config, "bf16", False)),
        "fp16": bool(getattr(transformer_config, "fp16", False)),
    }
    return OptimizerConfig(**arguments, **(precision | fields))


def _fields(name: str, given, config_class, arguments: dict[str, str]) -> dict[str, Any]:
    """``given`` (a mapping or None) as config fields, after checking every name."""
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise TypeError(
            f"{name} must be a mapping of {config_class.__name__} fields or a "
            f"{config_class.__name__}, not {type(given).__name__}"
        )
    for field, argument in arguments.items():
        if field in given:
            raise ValueError(
                f"{name}[{field!r}] is set by build_stack's {argument}= argument; pass "
                f"{argument}={given[field]!r} instead"
            )
    known = {f.name for f in dataclasses.fields(config_class) if f.init}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(
            f"{name} has {', '.join(map(repr, unknown))}, which {config_class.__module__}."
            f"{config_class.__name__} does not take; check the field names"
        )
    return dict(given)


def _check_agrees(
    name: str, have: dict[str, Any], want: dict[str, Any], arguments: dict[str, str]
) -> None:
    for field, value in want.items():
        if have[field] != value:
            raise ValueError(
                f"{name} has {field}={have[field]!r} but build_stack was given "
                f"{arguments[field]}={value!r}; make them agree"
            )
