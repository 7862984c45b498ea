"""The flat methods of one megatron-core optimizer: norm, clip and zero count from spans."""

from __future__ import annotations

import torch

from buffers import graphs, ops

from . import opt_checkpoint
from .param_norms import MegatronParamNorms
from .targets import FlatOptimizerState


class FlatNormOptimizer:
    """Mixin for one megatron-core optimizer: norm, clip and zero count from flat spans."""

    _flat: FlatOptimizerState

    def _copy_model_grads_to_main_grads(self):
        if self._flat.bindings is None:
            return self._flat_base._copy_model_grads_to_main_grads(self)
        self._flat.fill_mirrors()
        for tensor, attr, view in self._flat.bindings:
            setattr(tensor, attr, view)

    def zero_grad(self, set_to_none: bool = True):
        self._flat_base.zero_grad(self, set_to_none)
        if set_to_none:  # where stock frees its fp32 copies ([Note: the mirror lives ...])
            self._flat.release_mirrors()

    def _flat_local_zeros(self) -> torch.Tensor:
        self._flat.check_mirrors_filled(scaling=False)
        return ops.count_zeros_groups(
            self._flat.norm_groups, self._flat.padding, self._flat_norm_clip.device
        )

    def _flat_scale(self, total_norm: torch.Tensor, max_norm: float) -> None:
        self._flat.check_mirrors_filled(scaling=True)
        self._flat_norm_clip.scale_by_norm_(total_norm, max_norm)

    def _flat_reducer(self, group=None):
        """(the all-reduce of a stat over ``group``, default this optimizer's, whether a
        graph holds it)

        The :class:`buffers.graphs.GroupReducer` is kept while the group stays the same
        object (megatron-core fixes it at construction), so its backend is looked up once.
        """
        _check_mirrors_filled(self, scaling=False)  # what the stat reads
        if group is None:
            group = self.get_grad_stats_parallel_group()
        reducer = self.__dict__.get("_flat_group_reducer")
        if reducer is None or reducer.group is not group:
            nc = self._flat_norm_clip
            reducer = graphs.GroupReducer(2.0, group, nc.device, nc.options)
            self._flat_group_reducer = reducer
        return reducer.args()

    @torch.no_grad()
    def get_grad_norm(self):
        return self._flat_norm_clip.norm_reduced(2.0, *self._flat_reducer())

    def _flat_clip(self, clip_grad: float) -> torch.Tensor:
        """Norm over this optimizer's group (a chain's: every child's spans), then scale:
        one fused sequence, no sync."""
        _check_mirrors_filled(self, scaling=True)
        return self._flat_norm_clip.clip_reduced_(clip_grad, 2.0, *self._flat_reducer())

    def clip_grad_norm(self, clip_grad: float):
        if clip_grad > 0.0:
            return self._flat_clip(clip_grad)
        return self.get_grad_norm()

    def count_zeros(self):
        zeros = self._flat_local_zeros()
        torch.distributed.all_reduce(zeros, group=self.get_grad_stats_parallel_group())
        return zeros

    @torch.no_grad()
    def per_param_grad_norms(self):
        """Every parameter's gradient norm and the total, from one pass, one all-reduce.

        Returns a :class:`buffers.ParamNorms`: ``total`` (what :meth:`get_grad_norm`
        returns, up to summation order), ``norms`` (a device vector), ``names`` (global:
        :mod:`megatron_ext.param_norms`) and ``counted``; ``.as_dict()`` is
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
        child._flat.check_mirrors_filled(scaling)


def _per_param(owner, children, group):
    """Per-parameter norms over ``children``'s flat targets, reduced over ``group``.

    The stats pass and (NCCL) the all-reduce replay as one CUDA graph, as the norm does;
    gloo groups reduce between replays. Built at the first call, then kept.
    """
    reducer = FlatNormOptimizer._flat_reducer(owner, group)  # first: it checks the mirrors
    nc = owner._flat_norm_clip
    pn = owner.__dict__.get("_flat_param_norms")
    if pn is None:
        targets = [t for c in children for t in c._flat.targets]
        pn = MegatronParamNorms(targets, owner._flat_names, nc.device, nc.options)
        owner._flat_param_norms = pn
    return pn.norms(2.0, nc.replay, group, reducer)
