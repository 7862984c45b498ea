"""Per-dtype contiguous gradient buffers with fused, dtype-safe norm and clip."""

from .lists import scale_, total_norm
from .options import BufferOptions
from .param_norms import GroupIndex, LazyNorms, ParamNorms
from .plan import BufferPlan, LayoutPlan, ParamEntry, ParamSlot, plan_layout
from .spans import Span, dp_shard_spans, intersect_spans, merge_spans, subtract_spans, to_local
from .storage import FlatGradBuffers, GradientOutsideBufferError

__all__ = [
    "BufferOptions",
    "BufferPlan",
    "FlatGradBuffers",
    "GradientOutsideBufferError",
    "GroupIndex",
    "LayoutPlan",
    "LazyNorms",
    "ParamEntry",
    "ParamNorms",
    "ParamSlot",
    "Span",
    "dp_shard_spans",
    "intersect_spans",
    "merge_spans",
    "plan_layout",
    "scale_",
    "subtract_spans",
    "to_local",
    "total_norm",
]
