"""Per-parameter gradient norms of megatron-core optimizers, in the pass of the total norm.

What one rank reads for its per-parameter norms is exactly what its total norm reads (the
optimizer's flat spans: this rank's shard under the distributed optimizer, the mirror with
a loss scaler), cut at every parameter: one segmented pass per flat buffer. The
optimizer's one all-reduce of the norm carries the per-parameter vector with the total.
Parameters are matched across ranks by name, so names here are global:

* a transformer layer's index is its global layer number (``decoder.layers.5`` on the
  second pipeline stage of a 6-layer, PP=2 model is the model's sixth layer, not its
  third), as in megatron-core's distributed checkpoints;
* a local expert's index is its global expert index (``local_experts.7`` on expert rank 1
  of 2 with 4 local experts is expert 7; also ``weight<i>`` of grouped experts).

A parameter split across tensor-parallel or data-parallel ranks gets the norm of the whole
parameter (its pieces' sums add up); a tensor-parallel duplicate is reported from its
counted copy (rank 0), as the total counts it, and so is a ``shared`` one, which the total
does not count: its copies on other ranks are replicas, not pieces.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

import torch

from buffers import ops
from buffers.options import DEFAULT, BufferOptions
from buffers.param_norms import ParamNorms, ParamStats
from buffers.segments import SpanSegments
from buffers.spans import Span, intersect_spans, to_local

from .counted_spans import SHARED
from .layout import record_params
from .targets import BufferTarget

_LAYER = re.compile(r"(^|\.)layers\.(\d+)$")
_GROUPED_WEIGHT = re.compile(r"^(.*\.)?(weight|bias)(\d+)$")


def global_param_names(module: torch.nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` for ``module``, with global layer and expert indices.

    The rules are in the module docstring. Names that need no change are
    ``named_parameters()``'s.
    """
    layer_prefix: dict[str, str] = {}  # "decoder.layers.2" -> "decoder.layers.5"
    expert_offset: dict[str, tuple[int, int]] = {}  # experts module -> (offset, local count)
    for name, sub in module.named_modules():
        m = _LAYER.search(name)
        number = getattr(sub, "layer_number", None)
        if m and isinstance(number, int) and not getattr(sub, "is_mtp_layer", False):
            layer_prefix[name] = name[: m.start(2)] + str(number - 1)
        count = getattr(sub, "num_local_experts", None)
        group = getattr(sub, "ep_group", None)
        if isinstance(count, int) and group is not None and hasattr(group, "rank"):
            expert_offset[name] = (group.rank() * count, count)
    out = {}
    for name, p in module.named_parameters():
        out[id(p)] = _rename(name, layer_prefix, expert_offset)
    return out


def _rename(name: str, layer_prefix: Mapping, expert_offset: Mapping) -> str:
    parts = name.split(".")
    # Expert indices first (on local names), then the layer prefix.
    for i in range(len(parts) - 1, -1, -1):
        owner = ".".join(parts[:i])
        if owner in expert_offset:
            offset, count = expert_offset[owner]
            rest = parts[i:]
            if len(rest) >= 2 and rest[0] == "local_experts" and rest[1].isdigit():
                rest[1] = str(offset + int(rest[1]))
            else:
                m = _GROUPED_WEIGHT.match(".".join(rest))
                if m and int(m.group(3)) < count:
                    head = m.group(1) or ""
                    rest = f"{head}{m.group(2)}{offset + int(m.group(3))}".split(".")
            parts = parts[:i] + rest
            break
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in layer_prefix:
            return ".".join([layer_prefix[prefix], *parts[i:]])
    return ".".join(parts)


def target_segments(
    target: BufferTarget, names: Mapping[int, str]
) -> list[tuple[torch.Tensor, list[tuple[int, int, str, bool]]]]:
    """What the norm of ``target`` reads, cut per parameter.

    Returns ``(tensor, pieces)`` for each tensor the norm reads: the gradient buffer (or the
    mirror when the norm reads it), then the fp32 island when the norm reads its parameters
    there; ``pieces`` is ``(lo, hi, name, counted)`` for every piece of a parameter this rank
    owns, in that tensor's coordinates (uncounted parameters too: they are reported).
    """
    buf = target.buffer
    base = target.mirror if target.norm_reads_mirror else buf.grad_data
    in_island: dict[int, list[Span]] = {}
    for start, _piece, at in target.island_pieces:
        in_island.setdefault(start, []).append(at)
    pieces: list[tuple[int, int, str, bool]] = []
    island_pieces: list[tuple[int, int, str, bool]] = []
    for r, p in zip(target.records, record_params(buf, target.records), strict=True):
        start, end, counted = r.start, r.end, r.excluded_because is None
        # Another rank's copy is reported (SHARED is the one verdict that is not about copies).
        replica = r.excluded_because not in (None, SHARED)
        name = names.get(id(p), f"<unnamed {start}>")
        if start in in_island and end > start and not replica:
            island_pieces.extend((s.start, s.end, name, counted) for s in in_island[start])
            continue
        owned = intersect_spans([r.span], target.spans.owned) if end > start and not replica else ()
        if target.norm_reads_mirror:
            owned = to_local(owned, target.spans.owned)
        if not owned:  # still reported (zero here), so every rank lists the same names
            pieces.append((0, 0, name, counted))
        pieces.extend((s.start, s.end, name, counted) for s in owned)
    if base is None:
        raise AssertionError(f"{target.name}: the norm reads a mirror it does not have")
    out = [(base, pieces)]
    if island_pieces:
        if target.island is None:
            raise AssertionError(f"{target.name}: island pieces without an island")
        out.append((target.island, island_pieces))
    return out


class MegatronParamNorms(ParamStats):
    """Per-parameter stats over the flat targets of one or more optimizers (built once).

    Args:
        targets: the :class:`~megatron_ext.targets.BufferTarget` of every optimizer whose
            norm these reduce together (one optimizer, or a chain's children sharing one
            group).
        names: ``id(parameter) -> global name`` (:func:`global_param_names`).
        device: where results live.
        options: backend choice.

    Norms and total are fp32, as megatron-core's grad norm.
    """

    def __init__(
        self,
        targets: Iterable[BufferTarget],
        names: Mapping[int, str],
        device: torch.device,
        options: BufferOptions = DEFAULT,
    ) -> None:
        index: dict[str, int] = {}
        counted: list[bool] = []
        self._parts: list[SpanSegments] = []
        for t in targets:
            for base, pieces in target_segments(t, names):
                spans = []
                for lo, hi, name, c in pieces:
                    if name not in index:
                        index[name] = len(index)
                        counted.append(c)
                    elif counted[index[name]] != c:
                        raise ValueError(f"parameter {name!r} is both counted and not on one rank")
                    spans.append((lo, hi, index[name]))
                self._parts.append(SpanSegments(base, spans))
        super().__init__(tuple(index), counted, device, options)

    def add_stats(self, out: torch.Tensor, nan: torch.Tensor, p: float) -> None:
        for part in self._parts:
            part.add_(out, nan, p, ops.backend_for(part.base.device, self.options))


def concat_norms(parts: Sequence[ParamNorms]) -> ParamNorms:
    """One :class:`~buffers.param_norms.ParamNorms` from several over disjoint names
    (children of a chain reduced over different groups): the total is the 2-norm of the
    parts' totals, as megatron-core combines its children's norms."""
    if len(parts) == 1:
        return parts[0]
    total = torch.stack([p.total for p in parts]).square().sum().sqrt()
    return ParamNorms(
        total,
        torch.cat([p.norms for p in parts]),
        tuple(n for p in parts for n in p.names),
        tuple(c for p in parts for c in p.counted),
        2.0,
    )
