"""CPU offload through host mirrors, what a mirror is built from: per flat gradient buffer of a
distributed optimizer, this rank's shard, the inner optimizer's parameters in it and where
its gradients live (:func:`offload_sources`), and the mirror built from that
(:func:`source_mirror`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from buffers.spans import Span

from .host_mirror import add_island_copies, build_buffer_mirror
from .mirror_plan import MirrorLayout, mirror_layout


@dataclass
class OffloadSource:
    """What the host mirror of one buffer is built from (taken from the optimizer once)."""

    name: str
    owned: tuple[Span, ...]  # this rank's ranges (buffer coordinates)
    grads: torch.Tensor  # what the optimizer's gradients are views of
    grads_coords: tuple[Span, ...] | None  # None: buffer coordinates; else owned, end to end
    param_data: torch.Tensor  # the DDP parameter buffer
    spans: dict[torch.Tensor, Span]  # every inner-optimizer parameter of this buffer
    # (owned piece, its view in the fp32 island) of each parameter whose gradient the
    # optimizer reads in the buffer's fp32 local-accumulation island
    island: tuple[tuple[Span, torch.Tensor], ...] = ()


def source_mirror(
    source: OffloadSource,
    offloaded,
    *,
    pin: bool,
    lean: bool = False,
    device_convert: bool = False,
    split_staging: bool = False,
):
    """The host mirror of one buffer's offloaded parameters, or None when it has none.

    ``offloaded``: the inner parameters the CPU updates (``gpu_params_map_cpu_copy``).
    Returns ``(mirror, [(parameter, span)])``, the mirror's parameters loaded from the device.
    """
    mine = [(p, s) for p, s in source.spans.items() if p in offloaded]
    if not mine:
        return None
    resident = [s for p, s in source.spans.items() if p not in offloaded]
    layout = mirror_layout(source.owned, [s for _, s in mine], resident)
    params, params_coords, device_params = _device_params(source, layout, mine)
    mirror = build_buffer_mirror(
        source.name,
        layout,
        owned_numel=sum(s.numel for s in source.owned),
        grads=source.grads,
        grads_coords=source.grads_coords,
        params=params,
        params_coords=params_coords,
        cpu_dtype=_one_dtype(offloaded[p] for p, _ in mine),
        pin=pin,
        lean=lean,
        device_convert=device_convert,
        split_staging=split_staging,
    )
    mirror.device_params = device_params
    known = set(source.spans.values())
    stray = [span for span, _ in source.island if span not in known]
    if stray:
        raise RuntimeError(
            f"{source.name}: the fp32-accumulation gradient at {stray[0]} matches no parameter "
            "of the optimizer; pass host_mirrors=False to get_megatron_optimizer"
        )
    offloaded_spans = {s for _, s in mine}
    add_island_copies(mirror, [x for x in source.island if x[0] in offloaded_spans], pin=pin)
    mirror.load_params()
    return mirror, mine


def _one_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise RuntimeError(f"one buffer's offloaded parameters have several dtypes: {dtypes}")
    return dtypes.pop()


def _is_view_of(p: torch.Tensor, base: torch.Tensor, span: Span) -> bool:
    return bool(
        p.dtype == base.dtype
        and p.device == base.device
        and p.is_contiguous()
        and p.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        and p.storage_offset() == base.storage_offset() + span.start
    )


def _device_params(source: OffloadSource, layout: MirrorLayout, mine):
    """Where one buffer's updated parameters go back to: (tensor, coords, built here).

    The inner optimizer's parameters are either views of the DDP parameter buffer
    (precision-aware shards, fp32 parameters) or separate fp32 main shards of bf16
    parameters; those are moved into one flat device tensor laid out like the mirror, so
    each block still goes back with one copy.
    """
    views = [_is_view_of(p, source.param_data, s) for p, s in mine]
    if all(views):
        return source.param_data, None, None
    if any(views):
        raise RuntimeError(
            f"{source.name}: some offloaded parameters are views of the parameter buffer "
            "and some are not; host mirrors need one kind per buffer"
        )
    flat = torch.zeros(layout.numel, dtype=_one_dtype(p for p, _ in mine), device=mine[0][0].device)
    for p, s in mine:
        local = layout.local(s)
        view = flat[local.start : local.end]
        view.copy_(p.detach().reshape(-1))
        p.data = view.view(p.shape)
    return flat, layout.blocks, flat


def offload_sources(child) -> tuple[OffloadSource, ...]:
    """Per gradient buffer of a distributed optimizer: its shard and inner parameters.

    Needs ``child._flat`` (:func:`megatron_ext.optimizer.enable_flat_norm`): its targets
    say which ranges this rank owns and whether the optimizer's gradients are views of the
    grad buffer or of an fp32 mirror of the owned ranges.
    """
    decoupled = bool(child.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    mains16 = child.shard_float16_groups if decoupled else child.shard_fp32_from_float16_groups
    pairs = [
        *zip(_chain(child.model_float16_groups), _chain(mains16), strict=True),
        *zip(_chain(child.model_fp32_groups), _chain(child.shard_fp32_groups), strict=True),
    ]
    per_buffer: dict[int, dict[torch.Tensor, Span]] = {}
    for model_param, shard in pairs:
        if shard is None:
            raise NotImplementedError(
                "host mirrors do not support quantized (fp8/fp4) parameters; pass "
                "host_mirrors=False to megatron_ext.get_megatron_optimizer"
            )
        index = child.model_param_gbuf_map[model_param][0]
        start = child.buffers[index].param_index_map[model_param][0]
        r = child._get_model_param_range_map(model_param)["param"]
        per_buffer.setdefault(index, {})[shard] = Span(start + r.start, start + r.end)
    sources = []
    for i, (buf, target) in enumerate(zip(child.buffers, child._flat.targets, strict=True)):
        mirrored = target.mirror is not None
        sources.append(
            OffloadSource(
                name=target.name,
                owned=target.spans.owned,
                grads=target.mirror if mirrored else buf.grad_data,
                grads_coords=target.spans.owned if mirrored else None,
                param_data=buf.param_data,
                spans=per_buffer.get(i, {}),
                island=tuple(
                    (piece, target.island[at.start : at.end])
                    for _, piece, at in target.island_pieces
                ),
            )
        )
    return tuple(sources)


def _chain(groups):
    return [p for g in groups for p in g]
