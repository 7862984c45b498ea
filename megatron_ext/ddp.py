"""megatron-core's DDP with per-dtype gradient buffers and fp32 islands."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

import torch

from buffers.plan import ALIGN

from . import seam, wgrad_fusion
from .counted_spans import GradRecord, exclusion_reason
from .fp32 import align_router_inputs, cast_marked_to_fp32
from .layout import BufferKey, BufferLayout, ChunkLayout, buffer_layout, record_params

_MCoreDDP: Any = seam.target("DistributedDataParallel")


class LayoutMismatchError(RuntimeError):
    """Data-parallel ranks computed different gradient-buffer layouts."""


NEEDS_CUDA = (
    "megatron_ext.DistributedDataParallel needs a CUDA GPU (megatron-core's DDP allocates its "
    "gradient buffers on the current CUDA device) and torch sees none; on the CPU, use "
    "buffers.FlatGradBuffers (python -m buffers.demo shows it)"
)


def require_cuda() -> None:
    """Raise one line naming what is needed when torch sees no CUDA GPU.

    megatron-core's own error comes from deep inside its buffer code ("Found no NVIDIA
    driver"), or earlier from an unrelated assertion when no process group is set up.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(NEEDS_CUDA)


class DistributedDataParallel(_MCoreDDP):
    """megatron-core's ``DistributedDataParallel`` plus ``per_dtype_grad_buffers``.

    Same signature as megatron-core's. With ``ddp_config.per_dtype_grad_buffers`` off it is
    megatron-core's DDP unchanged. With it on:

    - parameters marked ``keep_in_fp32`` are cast back to fp32 before the buffers are
      built, so they land in an fp32 island buffer even with ``grad_reduce_in_fp32=False``;
    - parameters matching ``param_name_patterns_for_fp32_local_accumulation`` get their
      fp32 accumulation gradients as views of one contiguous fp32 island per buffer;
    - every buffer's layout is recorded once in :attr:`layout` (a frozen
      :class:`~megatron_ext.layout.ChunkLayout`), and all ranks of each data-parallel group
      check with one small collective that they computed the same one.

    Raises RuntimeError in one line, before megatron-core runs, when torch sees no CUDA GPU,
    or (:class:`~megatron_ext.wgrad_fusion.MissingFusionKernelError`) when a megatron-core
    linear layer of ``module`` fuses weight-gradient accumulation without apex's kernel.
    """

    def __init__(self, config, ddp_config, module: torch.nn.Module, *args, **kwargs) -> None:
        require_cuda()
        wgrad_fusion.check_module(module)
        enabled = bool(getattr(ddp_config, "per_dtype_grad_buffers", False))
        if enabled:
            cast_marked_to_fp32(module)
            align_router_inputs(module)
        super().__init__(config, ddp_config, module, *args, **kwargs)
        self.per_dtype_grad_buffers = enabled
        self.layout: ChunkLayout | None = None
        self._by_key: dict[BufferKey, tuple[object, torch.Tensor | None]] = {}
        if not enabled:
            return
        seam.check_instance("DistributedDataParallel", self)
        names = {p: n for n, p in self.module.named_parameters()}
        layouts = []
        for buf in self.all_grad_buffers():
            seam.check_instance("buffer layout", buf)
            island = self._carve_fp32_island(buf)
            layouts.append(buffer_layout(buf, names, 0 if island is None else island.numel()))
            self._by_key[layouts[-1].key] = (buf, island)
        self.layout = ChunkLayout(tuple(layouts))
        self._check_layouts_agree()

    def grad_buffer(self, key: BufferKey):
        """megatron-core's gradient buffer of ``key``."""
        return self._by_key[key][0]

    def fp32_island(self, key: BufferKey) -> torch.Tensor | None:
        """The fp32 local-accumulation island of buffer ``key``, or None."""
        return self._by_key[key][1]

    def fp32_islands(self) -> list[torch.Tensor]:
        """Every fp32 local-accumulation island (none with the option off)."""
        return [island for _, island in self._by_key.values() if island is not None]

    def all_grad_buffers(self) -> list:
        """Dense buffers, then expert-parallel buffers."""
        return [*self.buffers, *self.expert_parallel_buffers]

    def _carve_fp32_island(self, buf) -> torch.Tensor | None:
        params = [p for b in buf.buckets for p in b.params_with_extra_main_grads]
        if not params:
            return None
        seam.check_instance("fp32 accumulation island", buf)
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += -(-p.main_grad.numel() // ALIGN) * ALIGN
        island = torch.zeros(total, dtype=torch.float32, device=buf.grad_data.device)
        for p, off in zip(params, offsets, strict=True):
            p.main_grad = island[off : off + p.main_grad.numel()].view(p.main_grad.shape)
        # reset() zeroes every entry: one island instead of one tensor per parameter.
        buf.extra_main_grads = [island]
        return island

    def _check_layouts_agree(self) -> None:
        """One small all-gather per data-parallel group (dense, then expert), the same on
        every rank whatever buffers it built, of a digest of all its buffers on that group;
        on a difference, every rank raises :class:`LayoutMismatchError` naming it.

        Per group, not per buffer: a rank with an extra buffer (other fp32 patterns, say)
        would otherwise issue one collective more than its peers and hang them.
        """
        if not torch.distributed.is_initialized() or self.layout is None:
            return
        by_group: dict[int, tuple[Any, list[BufferLayout]]] = {}  # (process group, ...)
        for name in ("intra_dp_cp_group", "intra_expt_dp_group"):
            group = getattr(self, name, None)
            if group is not None:
                by_group.setdefault(id(group), (group, []))
        device = None
        for layout in self.layout.buffers:
            buf = self.grad_buffer(layout.key)
            device = device or buf.grad_data.device
            # megatron-core builds each buffer over one of those two groups; another group
            # (not seen so far) gets a check of its own, after them
            group = buf.data_parallel_group
            by_group.setdefault(id(group), (group, []))[1].append(layout)
        if device is None:  # no buffer here: where the group's collectives run
            cuda = torch.cuda.is_available()
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu"
        for group, layouts in by_group.values():
            if torch.distributed.get_world_size(group) == 1:
                continue
            rows = [layout.rows() for layout in layouts]
            digest = _rows_digest(rows)
            mine = torch.tensor([digest], dtype=torch.int64, device=device)
            gathered = [torch.empty_like(mine) for _ in range(group.size())]
            torch.distributed.all_gather(gathered, mine, group=group)
            if all(int(g) == digest for g in gathered):
                continue
            everyone: list[Any] = [None] * group.size()
            torch.distributed.all_gather_object(everyone, rows, group=group)
            raise LayoutMismatchError(_first_buffer_difference(everyone, group.rank()))


def counted_records(buf, records, tp_group=None, expert_tp_group=None) -> tuple[GradRecord, ...]:
    """``records`` of ``buf`` with each one's exclusion verdict for these process groups."""
    return tuple(
        replace(r, excluded_because=exclusion_reason(**param_flags(p, tp_group, expert_tp_group)))
        for r, p in zip(records, record_params(buf, records), strict=True)
    )


def param_flags(p: torch.Tensor, tp_group=None, expert_tp_group=None) -> dict:
    """The attributes Megatron's norm filter reads, with this rank's ranks in the given groups.

    ``tp_group`` / ``expert_tp_group`` are the groups the optimizer was built with
    (megatron-core sets them from ``pg_collection`` as ``optimizer.tp_group`` and
    ``optimizer.expert_tp_group``). Expert parameters use ``expert_tp_group``; given
    ``tp_group`` alone (megatron-core 0.18 sets no expert group), the expert tensor-parallel
    rank of megatron-core's parallel state, and without that none:
    :func:`~megatron_ext.counted_spans.exclusion_reason` refuses them (falling back to the dense TP
    rank, as megatron-core 0.18 does, is the published ETP != TP undercount). Without
    groups, megatron-core's global parallel state when it is initialised; with neither, only
    a single-process job is accepted (any other would count every tensor-parallel duplicate
    on every rank).
    """
    if tp_group is not None:
        tp_rank = tp_group.rank()
        if expert_tp_group is not None:
            expert_tp_rank = expert_tp_group.rank()
        else:  # megatron-core 0.18 gives its optimizers no expert_tp_group
            expert_tp_rank = _global_expert_tp_rank()
    elif expert_tp_group is not None:
        raise ValueError("expert_tp_group given without tp_group; pass both (pg_collection)")
    else:
        tp_rank, expert_tp_rank = _global_tp_ranks()
    return {
        "shared": bool(getattr(p, "shared", False)),
        "tensor_model_parallel": bool(getattr(p, "tensor_model_parallel", False)),
        "is_expert": not getattr(p, "allreduce", True),
        "tp_rank": tp_rank,
        "expert_tp_rank": expert_tp_rank,
        "gtp_duplicate": _is_gtp_duplicate(p),
    }


def _global_expert_tp_rank() -> int | None:
    ps = seam.target("parallel state")
    return ps.get_expert_tensor_parallel_rank() if ps.model_parallel_is_initialized() else None


def _global_tp_ranks() -> tuple[int, int]:
    ps = seam.target("parallel state")
    if ps.model_parallel_is_initialized():
        return ps.get_tensor_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            "the optimizer has no tp_group / expert_tp_group and megatron-core's parallel "
            "state is not initialised, so which parameters are tensor-parallel duplicates "
            "on this rank is unknown; build the optimizer with megatron_ext."
            "get_megatron_optimizer(..., pg_collection=...) or call "
            "megatron.core.parallel_state.initialize_model_parallel() first"
        )
    return 0, 0


def _is_gtp_duplicate(p: torch.Tensor) -> bool:
    """megatron-core's GTP-remat duplicate rule, where the installed version has one."""
    rule = seam.optional("GTP duplicate rule")
    return rule is not None and not rule(p)


def _rows_digest(rows) -> int:
    h = hashlib.blake2b(repr(rows).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little", signed=True)


def _first_buffer_difference(everyone: list[list[list[tuple]]], my_rank: int) -> str:
    """``everyone``: per rank, the rows of each of its buffers on one group."""
    counts = [len(buffers) for buffers in everyone]
    if len(set(counts)) > 1:
        odd = next(r for r, c in enumerate(counts) if c != counts[0])
        headers = [[rows[0] for rows in buffers] for buffers in everyone]
        return (
            "gradient-buffer layouts differ across data-parallel ranks: rank 0 built "
            f"{counts[0]} buffers {headers[0]}, rank {odd} built {counts[odd]} {headers[odd]} "
            f"(this is rank {my_rank}). Every rank of a data-parallel group must build the "
            "same model with the same dtypes, fp32 parameters (keep_in_fp32 marks, "
            "--keep-in-fp32-params) and DDP config."
        )
    for i in range(counts[0]):
        per_rank = [buffers[i] for buffers in everyone]
        if any(rows != per_rank[0] for rows in per_rank):
            return _first_difference(per_rank, my_rank)
    return "gradient-buffer layouts differ across data-parallel ranks (digest mismatch)"


def _first_difference(everyone: list[list[tuple]], my_rank: int) -> str:
    ref = everyone[0]
    for rank, rows in enumerate(everyone[1:], start=1):
        for i in range(max(len(ref), len(rows))):
            a = ref[i] if i < len(ref) else None
            b = rows[i] if i < len(rows) else None
            if a != b:
                what = "buffer header" if i == 0 else f"parameter {(a or b or ('?',))[0]!r}"
                return (
                    f"gradient-buffer layouts differ across data-parallel ranks at the {what}: "
                    f"rank 0 has {a}, rank {rank} has {b} (this is rank {my_rank}). Every rank "
                    "of a data-parallel group must build the same model with the same "
                    "parameter order, dtypes, requires_grad flags and DDP config."
                )
    return "gradient-buffer layouts differ across data-parallel ranks (digest mismatch)"
