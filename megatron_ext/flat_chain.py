"""The flat methods of megatron-core's ``ChainedOptimizer``: one norm over every child."""

from __future__ import annotations

import math
from typing import Any, ClassVar, Protocol

import torch

from buffers.graphs import profiler_range
from buffers.param_norms import ParamNorms

from .flat_optimizer import FlatNormOptimizer, _per_param
from .flat_state import CLIP_RANGE, NORM_RANGE, FlatNormState
from .global_param_norms import concat_norms


class ChainedOptimizerSurface(Protocol):
    """What the flat methods use of megatron-core's ``ChainedOptimizer``
    ([Note: the class swap] in :mod:`megatron_ext.flat_state`)."""

    _flat: FlatNormState
    _flat_base: ClassVar[type[Any]]
    config: Any
    chained_optimizers: list[FlatNormOptimizer]  # each given the flat methods too

    def get_grad_stats_parallel_group(self) -> Any: ...
    def grads_states_parallel_group_is_shared(self) -> bool: ...
    def prepare_grads(self) -> bool: ...
    def step_with_ready_grads(self) -> bool: ...


class FlatChainedOptimizer(ChainedOptimizerSurface):
    """Mixin for ``ChainedOptimizer``: one norm over every child's flat spans."""

    def _active(self) -> list[FlatNormOptimizer]:
        return [c for c in self.chained_optimizers if not getattr(c, "is_stub_optimizer", False)]

    def _flat_reducer(self) -> tuple[Any, bool, object]:
        # Only called where grads_states_parallel_group_is_shared() was just checked, so the
        # first child's group is every child's (the chain's own getter would check again).
        group = self.chained_optimizers[0].get_grad_stats_parallel_group()
        return self._flat.reducer_for(group).args()

    def _flat_clip(self, clip_grad: float) -> torch.Tensor:
        """Norm over every child's spans, then scale: one fused sequence, no sync."""
        with profiler_range(CLIP_RANGE):
            return self._flat.launches.clip_reduced_(clip_grad, 2.0, *self._flat_reducer())

    @torch.no_grad()
    def get_grad_norm(self) -> torch.Tensor:
        children = self.chained_optimizers
        if len(children) == 1:
            return children[0].get_grad_norm()
        if self.grads_states_parallel_group_is_shared():
            # Every child's spans in one sum, one all-reduce: stock's one norm over the union.
            with profiler_range(NORM_RANGE):
                return self._flat.launches.norm_reduced(2.0, *self._flat_reducer())
        # Different groups (non-distributed dense + expert): each child reduces over its
        # own group, in order, as megatron-core does; then combine.
        return torch.stack([c.get_grad_norm() for c in children]).square().sum().sqrt()

    def clip_grad_norm(self, clip_grad: float) -> torch.Tensor:
        """The global norm over every child; then each child's gradients scaled, on device."""
        if len(self.chained_optimizers) == 1:
            return self.chained_optimizers[0].clip_grad_norm(clip_grad)
        if clip_grad > 0.0 and self.grads_states_parallel_group_is_shared():
            return self._flat_clip(clip_grad)
        grad_norm = self.get_grad_norm()
        if clip_grad > 0.0:
            for child in self._active():
                child._flat_scale(grad_norm, clip_grad)
        return grad_norm

    @torch.no_grad()
    def per_param_grad_norms(self) -> ParamNorms:
        """As :meth:`FlatNormOptimizer.per_param_grad_norms`, over every child: one pass
        and one all-reduce when the children share a group, else one per child (as
        :meth:`get_grad_norm`), the total then combined as megatron-core combines norms."""
        children = self.chained_optimizers
        if len(children) == 1:
            return children[0].per_param_grad_norms()
        if self.grads_states_parallel_group_is_shared():
            return _per_param(self, children, children[0].get_grad_stats_parallel_group())
        return concat_norms([c.per_param_grad_norms() for c in children])

    def request_per_param_grad_norms(self) -> None:
        """Make the next :meth:`step` compute every parameter's norm in its norm pass (one
        read, as without) and keep them in ``last_per_param_grad_norms`` (a
        :class:`buffers.ParamNorms`); that step clips by their total."""
        self._flat.per_param_requested = True

    def take_per_param_grad_norms(self) -> ParamNorms | None:
        """The :class:`buffers.ParamNorms` the last requested step kept, or None (no step
        since the request, or it was skipped); clears them and any pending request."""
        kept, self._flat.last_param_norms = self._flat.last_param_norms, None
        self._flat.per_param_requested = False
        return kept

    @property
    def last_per_param_grad_norms(self) -> ParamNorms | None:
        """The :class:`buffers.ParamNorms` the last requested step kept (None: none yet)."""
        return self._flat.last_param_norms

    @last_per_param_grad_norms.setter
    def last_per_param_grad_norms(self, norms: ParamNorms | None) -> None:
        self._flat.last_param_norms = norms

    @torch.no_grad()
    def count_zeros(self) -> torch.Tensor | int:
        children = self.chained_optimizers
        if self.grads_states_parallel_group_is_shared():
            zeros = sum(
                (c._flat_local_zeros() for c in children),
                torch.zeros((), dtype=torch.int64, device=children[0]._flat.launches.device),
            )
            torch.distributed.all_reduce(zeros, group=self.get_grad_stats_parallel_group())
            return zeros
        return sum(c.count_zeros() for c in children if c.config.log_num_zeros_in_grad)

    @torch.no_grad()
    def step(self) -> tuple[bool, torch.Tensor | None, torch.Tensor | int | None]:
        if self.prepare_grads():
            return False, None, None
        children = [c for c in self._active() if c._flat.targets]
        clips = {c.config.clip_grad for c in children}
        requested, self._flat.per_param_requested = self._flat.per_param_requested, False
        if requested:
            # The per-parameter pass is the norm pass: its total clips, as get_grad_norm's.
            per_param = self.per_param_grad_norms()
            self.last_per_param_grad_norms = per_param
            grad_norm = per_param.total
            for child in children:
                if child.config.clip_grad > 0.0:
                    child._flat_scale(grad_norm, child.config.clip_grad)
        elif len(self.chained_optimizers) == 1 and children and children[0].config.clip_grad > 0:
            # One child: norm and clip as one fused sequence around the all-reduce.
            grad_norm = children[0]._flat_clip(children[0].config.clip_grad)
        elif len(clips) == 1 and min(clips) > 0.0 and self.grads_states_parallel_group_is_shared():
            # Several children, one clip value, one group: the same, over all their spans.
            grad_norm = self._flat_clip(clips.pop())
        else:
            grad_norm = self.get_grad_norm()
            for child in children:
                if child.config.clip_grad > 0.0:
                    child._flat_scale(grad_norm, child.config.clip_grad)
        skip = False
        for child in children:
            threshold = child.config.grad_norm_skip_threshold
            if math.isfinite(threshold) and grad_norm.item() > threshold:
                skip = True  # the one host sync, only when a threshold is set (as stock)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        ok = False if skip else self.step_with_ready_grads()
        return ok, grad_norm, num_zeros
