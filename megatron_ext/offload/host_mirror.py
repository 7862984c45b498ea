"""CPU offload through host mirrors, the tensors: one pinned staging tensor per buffer and
the per-block copies between it and the device, built once (:mod:`megatron_ext.offload.hybrid`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from buffers.spans import Span, to_local

from .mirror_plan import MirrorLayout, itemsize


@dataclass
class HostBlock:
    """One block's four copies, as (destination, source) views built once."""

    d2h: tuple[torch.Tensor, torch.Tensor]  # staging (gradient dtype) <- device gradients
    # CPU-dtype gradients <- staging; None: read in place. In a lean mirror the destination
    # is None too: only the chunked step converts, into its scratch (offload.step).
    convert: tuple[torch.Tensor | None, torch.Tensor] | None
    # staging (device parameter dtype) <- host params; None where the host parameters go
    # to the device themselves (converted there: a mirror built with device_convert)
    pack: tuple[torch.Tensor, torch.Tensor] | None
    h2d: tuple[torch.Tensor, torch.Tensor]  # device parameters <- staging or host params
    # (fp32 staging, device island view, CPU gradient view or None in a lean mirror, where
    # it starts in the mirror) of each fp32 local-accumulation parameter in this block: the
    # optimizer reads its gradient in the island (unscaled there), not in the buffer, so
    # the CPU gets it from there, after the block's gradients. With device_convert the
    # staging piece is the gradients' own place in the fp32 staging, and the CPU view None
    # (the copy lands where the optimizer reads it).
    islands: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]] = field(
        default_factory=list
    )

    def start_d2h(self) -> None:
        dst, src = self.d2h
        dst.copy_(src, non_blocking=True)
        for stage, device, _, _ in self.islands:
            stage.copy_(device, non_blocking=True)

    def convert_grads(self) -> None:
        if self.convert is not None:
            dst, src = self.convert
            if dst is None:
                raise RuntimeError(
                    "this host mirror is lean (no fp32 copy of the gradients): only the chunked "
                    "offload step converts them, into its scratch"
                )
            dst.copy_(src)
        for stage, _, cpu, _ in self.islands:
            if cpu is not None:
                cpu.copy_(stage)

    def pack_params(self) -> None:
        if self.pack is not None:
            dst, src = self.pack
            dst.copy_(src)

    def start_h2d(self) -> None:
        dst, src = self.h2d
        dst.copy_(src, non_blocking=True)


@dataclass
class BufferMirror:
    """The host side of one flat buffer's offloaded shard."""

    name: str
    layout: MirrorLayout
    staging: torch.Tensor  # uint8: the one pinned allocation; gradients in, parameters out
    host_params: torch.Tensor  # the CPU optimizer's parameters (CPU dtype), laid out as layout
    # the CPU optimizer's gradients: staging itself, or converted; None in a lean mirror
    cpu_grads: torch.Tensor | None
    blocks: list[HostBlock]
    owned_numel: int  # elements of this rank's shard of the buffer
    grads_dtype: torch.dtype  # dtype of what moves device-to-host
    params_dtype: torch.dtype  # dtype of what moves host-to-device
    device_params: torch.Tensor | None = None  # flat device parameters, when built here
    island_staging: torch.Tensor | None = None  # pinned fp32, for the blocks' island copies
    # gradients arrive and parameters leave in the CPU dtype, converted on the device
    device_convert: bool = False
    # uint8, pinned: where parameters leave from when they do not share the gradients'
    # staging bytes (split_staging); None where they do
    param_staging: torch.Tensor | None = None

    def cpu_views(self, span: Span) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(parameter, gradient) host views of buffer elements ``span`` (gradient None in a
        lean mirror)."""
        s = self.layout.local(span)
        grads = None if self.cpu_grads is None else self.cpu_grads[s.start : s.end]
        return self.host_params[s.start : s.end], grads

    def load_params(self) -> None:
        """Fill the host parameters from the device (blocking; at construction)."""
        for block in self.blocks:
            device, host = block.h2d
            if block.pack is not None:
                _, host = block.pack
            host.copy_(device)

    def moved_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """What crosses the bus for a device tensor of ``dtype``."""
        return self.host_params.dtype if self.device_convert else dtype

    def stats(self) -> dict:
        """Sizes: blocks, pinned and host bytes, bytes each way per step, owned bytes."""
        grads = self.cpu_grads
        converted = (
            grads is not None
            and grads.untyped_storage().data_ptr() != self.staging.untyped_storage().data_ptr()
        )
        return {
            "buffer": self.name,
            "blocks": len(self.blocks),
            "owned_bytes": self.owned_numel * itemsize(self.grads_dtype),
            "staging_bytes": self.staging.numel(),
            "pinned": self.staging.is_pinned(),
            "host_param_bytes": self.host_params.numel() * self.host_params.element_size(),
            "host_grad_bytes": grads.numel() * grads.element_size()
            if grads is not None and converted
            else 0,
            "d2h_bytes": self.layout.numel * itemsize(self.moved_dtype(self.grads_dtype)),
            "h2d_bytes": self.layout.numel * itemsize(self.moved_dtype(self.params_dtype)),
            "param_staging_bytes": 0 if self.param_staging is None else self.param_staging.numel(),
            "pinned_bytes": self.staging.numel() * self.staging.is_pinned()
            + (
                0
                if self.param_staging is None
                else self.param_staging.numel() * self.param_staging.is_pinned()
            )
            + (self.host_params.numel() * self.host_params.element_size())
            * self.host_params.is_pinned(),
            "device_convert": self.device_convert,
            "grads_dtype": self.grads_dtype,
            "params_dtype": self.params_dtype,
        }


def add_island_copies(
    mirror: BufferMirror, pieces: Sequence[tuple[Span, torch.Tensor]], *, pin: bool
) -> None:
    """Route the gradients of ``pieces`` (buffer span, its device view in an fp32 island)
    to the CPU from the island: one staging slice each, copied after its block's."""
    if not pieces:
        return
    stage = None
    if not mirror.device_convert:
        stage = torch.zeros(sum(v.numel() for _, v in pieces), dtype=torch.float32, pin_memory=pin)
        mirror.island_staging = stage
    off = 0
    for span, view in pieces:
        if view.numel() != span.numel:
            raise ValueError(f"island view of {view.numel()} elements for {span}")
        local = mirror.layout.local(span)
        block = mirror.blocks[mirror.layout.block_of(span)]
        if stage is None:  # straight into the fp32 staging, where the CPU reads it
            if mirror.cpu_grads is None:
                raise RuntimeError(f"{mirror.name}: a lean mirror has no fp32 staging to read")
            block.islands.append(
                (mirror.cpu_grads[local.start : local.end], view, None, local.start)
            )
            continue
        _, cpu = mirror.cpu_views(span)
        block.islands.append((stage[off : off + span.numel], view, cpu, local.start))
        off += span.numel


def chunk_copies(mirror: BufferMirror, chunks: Sequence[tuple[int, Span]]) -> list[HostBlock]:
    """The copies of each chunk (block index, run in mirror coordinates) of ``mirror``:
    slices of its block's copies, and the pieces of the block's island copies inside it."""
    out = []
    for b, run in chunks:
        block, off = mirror.blocks[b], mirror.layout.offsets[b]
        a, z = run.start - off, run.end - off  # block-local
        if not (0 <= a < z <= mirror.layout.blocks[b].numel):
            raise ValueError(f"chunk {run} lies outside block {b}")

        def cut(pair, a=a, z=z):
            return tuple(None if t is None else t[a:z] for t in pair)

        islands = []
        for stage, device, cpu, at in block.islands:
            lo = at - off
            x, y = max(a, lo), min(z, lo + stage.numel())
            if x < y:
                piece = slice(x - lo, y - lo)
                cpu_piece = None if cpu is None else cpu[piece]
                islands.append((stage[piece], device[piece], cpu_piece, off + x))
        out.append(
            HostBlock(
                d2h=cut(block.d2h),
                convert=None if block.convert is None else cut(block.convert),
                pack=None if block.pack is None else cut(block.pack),
                h2d=cut(block.h2d),
                islands=islands,
            )
        )
    return out


def _device_view(t: torch.Tensor, span: Span, coords: Sequence[Span] | None) -> torch.Tensor:
    if coords is None:
        return t[span.start : span.end]
    local = to_local([span], coords)
    if len(local) != 1 or local[0].numel != span.numel:
        raise ValueError(f"{span} is not one contiguous run of {coords}")
    return t[local[0].start : local[0].end]


def build_buffer_mirror(
    name: str,
    layout: MirrorLayout,
    *,
    owned_numel: int,
    grads: torch.Tensor,
    grads_coords: Sequence[Span] | None,
    params: torch.Tensor,
    params_coords: Sequence[Span] | None,
    cpu_dtype: torch.dtype,
    pin: bool,
    lean: bool = False,
    device_convert: bool = False,
    split_staging: bool = False,
) -> BufferMirror:
    """Allocate one buffer's host mirror and build its per-block copies.

    Args:
        name: the buffer's readable name.
        layout: its blocks.
        owned_numel: elements of this rank's shard of the buffer (for the report).
        grads: the device tensor holding the gradients the optimizer reads.
        grads_coords: None when ``grads`` is in buffer coordinates; else the spans laid end
            to end in it (an fp32 mirror of the owned ranges, say).
        params: the device tensor the updated parameters go back to.
        params_coords: as ``grads_coords``, for ``params``.
        cpu_dtype: the CPU optimizer's parameter dtype.
        pin: allocate the staging tensor in pinned memory (needs CUDA).
        lean: no host copy of the gradients in the CPU dtype where they arrive in another
            (only the chunked step, which converts into its scratch, can read them).
        device_convert: gradients cross to the host, and parameters back, in the CPU
            dtype, converted on the device (bf16 to fp32 exactly; fp32 to bf16 rounding to
            nearest even, as the host does): the staging holds fp32 gradients the CPU
            optimizer reads in place, and the pinned host parameters are the copies' source,
            so the host only runs the optimizer (no conversion or packing passes) at the
            cost of twice the bus bytes and pinned memory for a bf16 buffer.

    Returns:
        The :class:`BufferMirror`.
    """
    if device_convert:
        return _device_convert_mirror(
            name, layout, owned_numel, grads, grads_coords, params, params_coords, cpu_dtype, pin
        )
    width = max(itemsize(grads.dtype), itemsize(params.dtype))
    staging = torch.zeros(layout.numel * width, dtype=torch.uint8, pin_memory=pin)
    host_params = torch.zeros(layout.numel, dtype=cpu_dtype)
    in_place = grads.dtype == cpu_dtype and itemsize(cpu_dtype) == width
    cpu_grads: torch.Tensor | None
    if in_place:
        cpu_grads = staging.view(cpu_dtype)
    else:
        cpu_grads = None if lean else torch.zeros(layout.numel, dtype=cpu_dtype)
    param_staging = None
    if split_staging:
        param_staging = torch.zeros(
            layout.numel * params.element_size(), dtype=torch.uint8, pin_memory=pin
        )
    blocks = []
    for span, off in zip(layout.blocks, layout.offsets, strict=True):
        base, n = off * width, span.numel
        grad_stage = staging[base : base + n * grads.element_size()].view(grads.dtype)
        if param_staging is None:
            param_stage = staging[base : base + n * params.element_size()].view(params.dtype)
        else:
            at = off * params.element_size()
            param_stage = param_staging[at : at + n * params.element_size()].view(params.dtype)
        blocks.append(
            HostBlock(
                d2h=(grad_stage, _device_view(grads, span, grads_coords)),
                convert=None
                if in_place
                else (None if cpu_grads is None else cpu_grads[off : off + n], grad_stage),
                pack=(param_stage, host_params[off : off + n]),
                h2d=(_device_view(params, span, params_coords), param_stage),
            )
        )
    return BufferMirror(
        name, layout, staging, host_params, cpu_grads, blocks, owned_numel, grads.dtype,
        params.dtype, param_staging=param_staging,
    )  # fmt: skip


def _device_convert_mirror(
    name, layout, owned_numel, grads, grads_coords, params, params_coords, cpu_dtype, pin
) -> BufferMirror:
    """:func:`build_buffer_mirror` with ``device_convert``."""
    staging = torch.zeros(layout.numel * itemsize(cpu_dtype), dtype=torch.uint8, pin_memory=pin)
    cpu_grads = staging.view(cpu_dtype)
    host_params = torch.zeros(layout.numel, dtype=cpu_dtype, pin_memory=pin)
    blocks = [
        HostBlock(
            d2h=(cpu_grads[off : off + span.numel], _device_view(grads, span, grads_coords)),
            convert=None,
            pack=None,
            h2d=(_device_view(params, span, params_coords), host_params[off : off + span.numel]),
        )
        for span, off in zip(layout.blocks, layout.offsets, strict=True)
    ]
    return BufferMirror(
        name, layout, staging, host_params, cpu_grads, blocks, owned_numel, grads.dtype,
        params.dtype, device_convert=True,
    )  # fmt: skip
