"""The flat methods of one megatron-core optimizer: norm, clip and zero count from spans."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import torch

from buffers import ops
from buffers.graphs import profiler_range
from buffers.param_norms import ParamNorms

from . import opt_checkpoint
from .flat_state import CLIP_RANGE, NORM_RANGE, FlatNormState
from .global_param_norms import MegatronParamNorms


class MegatronOptimizerSurface(Protocol):
    """What the flat methods use of the megatron-core optimizer they are given to
    ([Note: the class swap] in :mod:`megatron_ext.flat_state`)."""

    _flat: FlatNormState
    # megatron-core's class of the instance: the methods the flat ones fall back on
    _flat_base: ClassVar[type[Any]]
    config: Any  # megatron-core's OptimizerConfig

    def get_grad_stats_parallel_group(self) -> Any: ...


class FlatNormOptimizer(MegatronOptimizerSurface):
    """Mixin for one megatron-core optimizer: norm, clip and zero count from flat spans."""

    def _copy_model_grads_to_main_grads(self):
        if self._flat.bindings is None:
            return self._flat_base._copy_model_grads_to_main_grads(self)
        self._flat.spans.fill_mirrors()
        for tensor, attr, view in self._flat.bindings:
            setattr(tensor, attr, view)

    def zero_grad(self, set_to_none: bool = True):
        self._flat_base.zero_grad(self, set_to_none)
        if set_to_none:  # where stock frees its fp32 copies ([Note: the mirror lives ...])
            self._flat.spans.release_mirrors()

    def _flat_local_zeros(self) -> torch.Tensor:
        self._flat.spans.check_mirrors_filled(scaling=False)
        spans = self._flat.spans
        return ops.count_zeros_groups(spans.norm_groups, spans.padding, self._flat.launches.device)

    def _flat_scale(self, total_norm: torch.Tensor, max_norm: float) -> None:
        self._flat.spans.check_mirrors_filled(scaling=True)
        with profiler_range(CLIP_RANGE):
            self._flat.launches.scale_by_norm_(total_norm, max_norm)

    def _flat_reducer(self, group=None) -> tuple[Any, bool, object]:
        """(the all-reduce of a stat over ``group``, default this optimizer's, whether a
        graph holds it, its key): :meth:`FlatNormState.reducer_for`'s arguments."""
        _check_mirrors_filled(self, scaling=False)  # what the stat reads
        if group is None:
            group = self.get_grad_stats_parallel_group()
        return self._flat.reducer_for(group).args()

    @torch.no_grad()
    def get_grad_norm(self) -> torch.Tensor:
        with profiler_range(NORM_RANGE):
            return self._flat.launches.norm_reduced(2.0, *self._flat_reducer())

    def _flat_clip(self, clip_grad: float) -> torch.Tensor:
        """Norm over this optimizer's group (a chain's: every child's spans), then scale:
        one fused sequence, no sync."""
        _check_mirrors_filled(self, scaling=True)
        with profiler_range(CLIP_RANGE):
            return self._flat.launches.clip_reduced_(clip_grad, 2.0, *self._flat_reducer())

    def clip_grad_norm(self, clip_grad: float) -> torch.Tensor:
        if clip_grad > 0.0:
            return self._flat_clip(clip_grad)
        return self.get_grad_norm()

    def count_zeros(self) -> torch.Tensor:
        zeros = self._flat_local_zeros()
        torch.distributed.all_reduce(zeros, group=self.get_grad_stats_parallel_group())
        return zeros

    @torch.no_grad()
    def per_param_grad_norms(self) -> ParamNorms:
        """Every parameter's gradient norm and the total, from one pass, one all-reduce.

        Returns a :class:`buffers.ParamNorms`: ``total`` (what :meth:`get_grad_norm`
        returns, up to summation order), ``norms`` (a device vector), ``names`` (global:
        :mod:`megatron_ext.global_param_norms`) and ``counted``; ``.as_dict()`` is
        ``{name: norm}``, copied to the host only when read; ``.by_group(index)`` folds
        them into layers or module types on the device. Reads what the norm reads (call
        it where :meth:`get_grad_norm` would be called: after the gradients are reduced,
        before clipping), over the same process group. No host sync.
        """
        return _per_param(self, [self], self.get_grad_stats_parallel_group())

    # Checkpoint save and load, repaired (:mod:`megatron_ext.opt_checkpoint`).
    sharded_state_dict = opt_checkpoint.sharded_state_dict
    load_state_dict = opt_checkpoint.load_state_dict
    _set_main_param_and_optimizer_states = opt_checkpoint._set_main_param_and_optimizer_states


def _check_mirrors_filled(owner, scaling: bool) -> None:
    """:meth:`~megatron_ext.targets.FlatOptimizerState.check_mirrors_filled` of ``owner``
    (one optimizer) or of every child of ``owner`` (a chain)."""
    for child in getattr(owner, "chained_optimizers", [owner]):
        child._flat.spans.check_mirrors_filled(scaling)


def _per_param(
    owner: MegatronOptimizerSurface, children: list[FlatNormOptimizer], group
) -> ParamNorms:
    """Per-parameter norms over ``children``'s flat targets, reduced over ``group``.

    The stats pass and (NCCL) the all-reduce replay as one CUDA graph, as the norm does;
    gloo groups reduce between replays. Built at the first call, then kept.
    """
    _check_mirrors_filled(owner, scaling=False)  # what the stats read
    reducer_args = owner._flat.reducer_for(group).args()
    state = owner._flat
    launches = state.launches
    if state.param_norms is None:
        targets = [t for c in children for t in c._flat.targets]
        state.param_norms = MegatronParamNorms(
            targets, state.names, launches.device, launches.options
        )
    return state.param_norms.norms(2.0, launches.replay, group, reducer_args)
