"""Flat per-dtype gradient storage with fused norm, clip and zero count."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Literal, overload

import torch

from . import graphs, ops
from .graphs import NormClip
from .options import DEFAULT, BufferOptions
from .param_norms import ParamNormPass, ParamNorms
from .plan import LayoutPlan, ParamEntry, plan_layout

ParamsArg = Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class GradientOutsideBufferError(RuntimeError):
    """A parameter's ``.grad`` no longer lives in its flat buffer, so a norm would miss it."""


def _named(params: ParamsArg) -> list[tuple[str, torch.Tensor]]:
    out = []
    for i, item in enumerate(params):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            name, p = item
        else:
            name, p = f"params[{i}]", item
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{name} is a {type(p).__name__}, not a torch.Tensor parameter")
        out.append((name, p))
    return out


def _binding_check(owner: weakref.ref, name: str, ptr: int):
    """A post-accumulate hook: mark ``name`` escaped when its ``.grad`` left the view."""

    def check(p: torch.Tensor) -> None:
        fgb = owner()
        if fgb is not None and (p.grad is None or p.grad.data_ptr() != ptr):
            fgb._escaped[id(p)] = name

    return check


def _remove_hooks(hooks) -> None:
    for handle in hooks:
        handle.remove()
    hooks.clear()


class FlatGradBuffers:
    """One contiguous gradient buffer per dtype; each parameter's ``.grad`` is a view of it.

    Backward accumulates into the views in place, so norms, clipping and zeroing each cost
    one fused launch per buffer instead of one per parameter.

    Args:
        params: parameters, or ``(name, parameter)`` pairs such as ``named_parameters()``.
            Frozen parameters (``requires_grad=False``) are skipped. A parameter given twice
            is laid out once, under its first name.
        counted: predicate on a parameter: does it count toward norms? Default: all do.
            Every gradient is still scaled by clipping (uncounted ones are typically
            duplicates of gradients counted elsewhere).
        align: every gradient starts at a multiple of ``align`` elements.
        device: where the buffers live. Default: the parameters' device.
        options: kernel backend and CUDA-graph switches
            (:class:`buffers.options.BufferOptions`; default: all on, ``auto`` backend).
    """

    def __init__(
        self,
        params: ParamsArg,
        *,
        counted: Callable[[torch.Tensor], bool] | None = None,
        align: int = 64,
        device: torch.device | str | None = None,
        options: BufferOptions = DEFAULT,
    ) -> None:
        named = _named(params)
        self.options = options
        seen: set[int] = set()
        self._params: list[tuple[str, torch.Tensor]] = []
        for name, p in named:
            if not p.requires_grad or id(p) in seen:
                continue
            if not p.is_floating_point():
                raise TypeError(
                    f"parameter {name!r} has non-floating dtype {p.dtype} but requires_grad; "
                    "only floating-point parameters can have gradients"
                )
            seen.add(id(p))
            self._params.append((name, p))
        self.device = self._pick_device(device)

        entries = [
            ParamEntry(n, tuple(p.shape), p.dtype, counted(p) if counted else True)
            for n, p in self._params
        ]
        self.plan: LayoutPlan = plan_layout(entries, align)
        self.buffers: dict[torch.dtype, torch.Tensor] = {
            dt: torch.zeros(b.numel, dtype=dt, device=self.device)
            for dt, b in self.plan.buffers.items()
        }
        self._views: dict[int, torch.Tensor] = {}
        self._param_by_id = {id(p): p for _, p in self._params}
        self._escaped: dict[int, str] = {}
        self._checked_optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        hooks = []
        for dt, b in self.plan.buffers.items():
            for slot in b.slots:
                name, p = self._params[slot.index]
                view = self.buffers[dt][slot.offset : slot.offset + slot.numel].view(slot.shape)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                self._views[id(p)] = view
                hooks.append(
                    p.register_post_accumulate_grad_hook(
                        _binding_check(weakref.ref(self), name, view.data_ptr())
                    )
                )
        # The hooks hold these buffers only weakly, so a FlatGradBuffers built again over
        # the same parameters does not keep this one alive; when this one is collected, or
        # closed, its hooks go too.
        self._hooks = weakref.finalize(self, _remove_hooks, hooks)

        def views(spans_of):
            return [
                [self.buffers[dt][s.start : s.end] for s in spans_of(b)]
                for dt, b in self.plan.buffers.items()
            ]

        # Built once: the hot path walks buffers, never parameters.
        self._norm_groups = views(lambda b: b.norm_spans)
        self._scale_groups = views(lambda b: b.scale_spans)
        # Replays norm/clip as CUDA graphs after the first calls (buffers/graphs.py).
        self._norm_clip = NormClip(self._norm_groups, self._scale_groups, self.device, options)
        self._norm_padding = sum(
            n for b in self.plan.buffers.values() for n in b.padding_in.values()
        )
        self._param_pass: ParamNormPass | None = None  # built at the first per_param call

    def _pick_device(self, device) -> torch.device:
        devices = {p.device for _, p in self._params}
        if len(devices) > 1:
            by_dev: dict[torch.device, str] = {}
            for name, p in self._params:
                by_dev.setdefault(p.device, name)
            listing = ", ".join(f"{n!r} on {d}" for d, n in by_dev.items())
            raise ValueError(
                f"parameters are on different devices ({listing}); build one "
                "FlatGradBuffers per device"
            )
        if device is None:
            return devices.pop() if devices else torch.device("cpu")
        device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0"
        if devices and devices != {device}:
            raise ValueError(
                f"device={device} but the parameters are on {devices.pop()}; gradients must "
                "live on their parameter's device, so leave device=None"
            )
        return device

    def close(self) -> None:
        """Remove the hooks these buffers put on the parameters (idempotent).

        The ``.grad`` views stay bound; nothing checks them any more. Also what leaving a
        ``with FlatGradBuffers(...) as fgb:`` block does, and what happens when these
        buffers are garbage-collected.
        """
        self._hooks()

    def __enter__(self) -> FlatGradBuffers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _raise_if_escaped(self) -> None:
        if self._escaped:
            names = ", ".join(repr(n) for n in self._escaped.values())
            raise GradientOutsideBufferError(
                f"the gradient of {names} no longer lives in its flat buffer (was .grad set "
                "to None, e.g. by zero_grad(set_to_none=True), or reassigned?), so the norm "
                "would miss it. Zero gradients with FlatGradBuffers.zero_() (or "
                "zero_grad(set_to_none=False)) instead; zero_() also re-binds them."
            )

    @property
    def nbytes(self) -> int:
        """Bytes of all flat buffers, padding included."""
        return self.plan.nbytes

    def view(self, p: torch.Tensor) -> torch.Tensor:
        """The gradient view of ``p``: same shape and dtype as ``p``."""
        try:
            return self._views[id(p)]
        except KeyError:
            raise KeyError(
                "this parameter has no gradient view here (frozen, or not passed to "
                "FlatGradBuffers)"
            ) from None

    def check_bindings(self) -> None:
        """Verify every ``.grad`` is still its view (one pass over parameters; not per step)."""
        for name, p in self._params:
            if p.grad is None or p.grad.data_ptr() != self._views[id(p)].data_ptr():
                self._escaped[id(p)] = name
        self._raise_if_escaped()

    def zero_(self) -> None:
        """Zero every buffer (padding included) and re-bind any gradient that escaped."""
        for buf in self.buffers.values():
            buf.zero_()
        for pid in self._escaped:  # usually empty: no per-parameter work per step
            self._param_by_id[pid].grad = self._views[pid]
        self._escaped.clear()

    @overload
    def grad_norm(
        self, norm_type: float = ..., group=..., per_param: Literal[False] = ...
    ) -> torch.Tensor: ...
    @overload
    def grad_norm(
        self, norm_type: float = ..., group=..., *, per_param: Literal[True]
    ) -> ParamNorms: ...
    def grad_norm(
        self, norm_type: float = 2.0, group=None, per_param: bool = False
    ) -> torch.Tensor | ParamNorms:
        """Norm of the counted gradients, accumulated in fp32 (fp64 buffers in fp64); no sync.

        Args:
            norm_type: p > 0, or ``inf``.
            group: a process group to reduce over (one all-reduce), or None for local.
            per_param: also every parameter's own norm, from the same single pass over
                each buffer (:class:`buffers.param_norms.ParamNorms`). With ``group``, the
                one all-reduce carries the per-parameter vector and the total together;
                parameters are matched across ranks by name (gathered once per group, at
                the first such call).

        Returns:
            0-dim tensor on the buffers' device: fp32, or fp64 when a counted buffer is
            fp64 (with a group: when one on this rank is). With ``per_param``, a
            :class:`~buffers.param_norms.ParamNorms` whose ``total`` is that tensor.
        """
        self._raise_if_escaped()
        p = ops.check_norm_type(norm_type)
        if per_param:
            return self._param_norms(p, group)
        if group is None:
            return self._norm_clip.norm(p)
        # Built per call, not kept: holding the group past destroy_process_group() can
        # abort the process when these buffers are freed later (seen with gloo).
        reducer = graphs.GroupReducer(p, group, self.device, self.options)
        return self._norm_clip.norm_reduced(p, *reducer.args())

    def _param_norms(self, p: float, group) -> ParamNorms:
        """Per-parameter and total norms: one segmented pass per buffer, one all-reduce."""
        if self._param_pass is None:
            names = [name for name, _ in self._params]
            self._param_pass = ParamNormPass(
                self.plan, self.buffers, names, self.device, self.options
            )
        if group is None:
            return self._param_pass.norms(p, self._norm_clip.replay)
        reducer = graphs.GroupReducer(p, group, self.device, self.options)
        return self._param_pass.norms(p, self._norm_clip.replay, group, reducer.args())

    @overload
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = ...,
        group=...,
        error_if_nonfinite: bool = ...,
        per_param: Literal[False] = ...,
    ) -> torch.Tensor: ...
    @overload
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = ...,
        group=...,
        error_if_nonfinite: bool = ...,
        *,
        per_param: Literal[True],
    ) -> ParamNorms: ...
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        group=None,
        error_if_nonfinite: bool = False,
        per_param: bool = False,
    ) -> torch.Tensor | ParamNorms:
        """Scale all gradients by ``max_norm / (norm + 1e-6)`` when that is below 1.

        Args:
            max_norm: the norm to clip to, >= 0 (``inf`` never clips); a tensor is read to
                the host once (``float()``). Negative or NaN: ``ValueError``.
            norm_type: p > 0, or ``inf``.
            group: a process group to reduce over, or None.
            error_if_nonfinite: raise if the norm is NaN or inf (this one check syncs).
            per_param: return the pre-clip per-parameter norms too (as
                :meth:`grad_norm` with ``per_param=True``); the scale is then its own
                launch per buffer after them.

        Returns:
            The pre-clip norm, a 0-dim device tensor: fp32, or fp64 when a counted buffer
            is fp64. With ``per_param``: the pre-clip :class:`ParamNorms`.
        """
        max_norm = ops.check_max_norm(max_norm)
        if not (error_if_nonfinite or per_param):
            self._raise_if_escaped()
            p = ops.check_norm_type(norm_type)
            if group is None:
                return self._norm_clip.clip_(float(max_norm), p)
            reducer = graphs.GroupReducer(p, group, self.device, self.options)
            return self._norm_clip.clip_reduced_(float(max_norm), p, *reducer.args())
        result = self.grad_norm(norm_type, group, per_param=per_param)
        total = result.total if per_param else result
        if error_if_nonfinite and not torch.isfinite(total).item():
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite, so it "
                "cannot be clipped; pass error_if_nonfinite=False to scale by NaN/0 instead"
            )
        self._norm_clip.scale_by_norm_(total, float(max_norm))
        return result

    def clipped_step(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        group=None,
        fold: bool = False,
    ) -> torch.Tensor:
        """Clip to ``max_norm``, then ``optimizer.step()``; returns the pre-clip norm.

        With ``fold=True`` and torch's fused Adam or AdamW (``fused=True``) the clip is
        folded into the optimizer's own read of the gradients: the inverse coefficient goes
        in as its ``grad_scale`` (a device scalar the fused kernel divides gradients by, as
        it does for ``GradScaler``), so there is no separate scale launch reading and
        writing the gradients; torch's kernel writes the divided gradients back, so
        ``.grad`` ends up clipped as after an explicit clip. Measured on an H200 with torch 2.11
        (``benchmarks/clip_step.py``, docs/RESULTS.md) folding was *slower* than the
        explicit clip (2.5 ms against 1.6 ms on top of the step for 2 GiB of gradients), so
        it is off by default. Otherwise, and for any other optimizer: ``clip_grad_norm_``
        and then ``step()``. Either way every parameter the optimizer holds must have its
        gradient in these buffers, or the norm would not count it (``ValueError``).
        ``max_norm`` is checked as in :meth:`clip_grad_norm_`, before anything runs.
        """
        max_norm = ops.check_max_norm(max_norm)
        self._check_optimizer_params(optimizer)
        if not (fold and self._can_fold(optimizer)):
            total = self.clip_grad_norm_(max_norm, norm_type, group)
            optimizer.step()
            return total
        self._raise_if_escaped()
        p = ops.check_norm_type(norm_type)
        given = None if group is None else self.grad_norm(p, group)
        total = self._norm_clip.fold_(float(max_norm), p, given)
        optimizer.grad_scale = self._norm_clip.inverse_coeff
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale
        return total

    @staticmethod
    def _can_fold(optimizer) -> bool:
        if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            return False
        if hasattr(optimizer, "grad_scale") or hasattr(optimizer, "found_inf"):
            return False  # a GradScaler is already using the hook
        return all(g.get("fused") for g in optimizer.param_groups)

    def _check_optimizer_params(self, optimizer) -> None:
        count = sum(len(g["params"]) for g in optimizer.param_groups)
        if self._checked_optimizers.get(optimizer) == count:
            return  # checked before, and no parameter added since
        for gi, g in enumerate(optimizer.param_groups):
            for pi, q in enumerate(g["params"]):
                if q.requires_grad and id(q) not in self._param_by_id:
                    raise ValueError(
                        f"optimizer parameter {pi} of param group {gi} (shape "
                        f"{tuple(q.shape)}, {q.dtype}) is not in these FlatGradBuffers, so "
                        "the norm would not count its gradient; build FlatGradBuffers over "
                        "every parameter the optimizer updates"
                    )
        self._checked_optimizers[optimizer] = count

    def count_zeros(self, group=None) -> torch.Tensor:
        """Number of zero elements among counted gradients (padding excluded), int64."""
        self._raise_if_escaped()
        zeros = ops.count_zeros_groups(self._norm_groups, self._norm_padding, self.device)
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(zeros, op=dist.ReduceOp.SUM, group=group)
        return zeros

    def __repr__(self) -> str:
        sizes = ", ".join(f"{dt}: {b.numel}" for dt, b in self.plan.buffers.items())
        return f"FlatGradBuffers({len(self._params)} params; {sizes}; {self.nbytes} bytes)"
