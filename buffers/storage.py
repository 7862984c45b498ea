"""Flat per-dtype gradient storage with fused norm, clip and zero count."""

from __future__ import annotations

import operator
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Literal, overload

import torch

from . import graphs, ops
from .bindings import (
    SPARSE_FIX,
    BindingWatch,
    GradientOutsideBufferError,
    refuse_bucket_view_ddp,
)
from .graphs import NormClip
from .options import DEFAULT, BufferOptions
from .param_norms import ParamNormPass, ParamNorms
from .plan import ALIGN, LayoutPlan, ParamEntry, check_grad_dtype, plan_layout
from .registrations import ModelRoot, ModuleWatch, model_root

__all__ = ["FlatGradBuffers", "GradientOutsideBufferError"]

ParamsArg = (
    torch.nn.Module | torch.Tensor | Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
)


def _named(
    params: torch.Tensor | Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, torch.Tensor):  # one parameter, as torch's clip_grad_norm_ takes
        params = [params]
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


class FlatGradBuffers:
    """One contiguous gradient buffer per dtype; each parameter's ``.grad`` is a view of it.

    Backward accumulates into the views in place, so norms, clipping and zeroing each cost
    one fused launch per buffer instead of one per parameter.

    Args:
        params: a module (its ``named_parameters()``), parameters, one parameter, or
            ``(name, parameter)`` pairs such as ``named_parameters()``. A parameter given
            twice is laid out once, under its first name. Frozen parameters
            (``requires_grad=False``) get no place; a hook reports one that is unfrozen
            later, at the first norm, clip or count after it receives a gradient. Given a
            module or its ``named_parameters()`` / ``parameters()`` generator, a parameter
            registered on the model later is reported the same way
            (:mod:`buffers.registrations`); given a list, it cannot be seen. Parameters
            are held weakly: once one is freed (the model re-created,
            ``load_state_dict(..., assign=True)``), every call raises.
        counted: predicate on a parameter: does it count toward norms? Default: all do.
            Every gradient is still scaled by clipping (uncounted ones are typically
            duplicates of gradients counted elsewhere).
        align: every gradient starts at a multiple of ``align`` elements.
        device: where the buffers live. Default: the parameters' device (the CPU when
            there are none).
        options: kernel backend and CUDA-graph switches
            (:class:`buffers.options.BufferOptions`; default: all on, ``auto`` backend).

    Raises:
        ValueError: an iterator that yields no parameter, without ``device`` (an exhausted
            generator?; an empty list gives empty buffers, norm 0, as torch); a non-leaf
            tensor; a lazy module's parameter before its first forward; parameters on
            different devices; parameters of a model wrapped in torch DDP with
            ``gradient_as_bucket_view=True``.
        TypeError: a trainable parameter of a dtype without flat buffers (complex, fp8,
            integer); a sparse parameter, or the weight of an ``Embedding`` /
            ``EmbeddingBag`` with ``sparse=True`` (where the module is known; given a list,
            backward raises when its sparse gradient arrives); ``params``, ``counted``
            (or what it returns) or ``options`` of the wrong type.

        Construction is all-or-nothing: when it raises, no ``.grad`` has been replaced and
        no hook added.
    """

    def __init__(
        self,
        params: ParamsArg,
        *,
        counted: Callable[[torch.Tensor], bool] | None = None,
        align: int = ALIGN,
        device: torch.device | str | None = None,
        options: BufferOptions = DEFAULT,
    ) -> None:
        if not isinstance(params, torch.nn.Module | torch.Tensor | Iterable):
            raise TypeError(
                f"FlatGradBuffers(params={params!r}): expected a module, a parameter, or an "
                "iterable of parameters or (name, parameter) pairs such as "
                f"model.named_parameters(), not a {type(params).__name__}"
            )
        if counted is not None and not callable(counted):
            raise TypeError(
                f"counted={counted!r}: expected None (every parameter counts) or a function "
                "of a parameter returning True or False"
            )
        if not isinstance(options, BufferOptions):
            raise TypeError(
                f"options={options!r}: expected a buffers.BufferOptions (e.g. "
                "BufferOptions(backend='torch', cuda_graphs=False))"
            )
        root = model_root(params)  # before a generator is consumed
        if isinstance(params, torch.nn.Module):
            params = list(params.named_parameters())
        named = _named(params)
        if not named and device is None and iter(params) is params:
            raise ValueError(
                "FlatGradBuffers got an iterator that yields no parameters (an exhausted "
                "generator? model.parameters() can be iterated only once); to build empty "
                "buffers on purpose pass a list, or device="
            )
        options.check_environment()
        self.options = options
        trained, frozen = _checked_trained_and_frozen(named)
        if named and not trained:
            warnings.warn(
                f"none of the {len(named)} parameters given to FlatGradBuffers requires grad: "
                "the buffers are empty, norms are 0 and clipping does nothing; a parameter "
                "unfrozen later raises at the first call after it gets a gradient",
                UserWarning,
                stacklevel=2,
            )
        _refuse_sparse_gradients(trained, root)
        refuse_bucket_view_ddp(trained)
        self.device = _pick_device(device, trained)
        self._names = [name for name, _ in trained]

        entries = [
            ParamEntry(n, tuple(p.shape), p.dtype, _counts(counted, n, p)) for n, p in trained
        ]
        self.plan: LayoutPlan = plan_layout(entries, align)
        self.buffers: dict[torch.dtype, torch.Tensor] = {
            dt: torch.zeros(b.numel, dtype=dt, device=self.device)
            for dt, b in self.plan.buffers.items()
        }
        self._checked_optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # The hooks hold the watch only weakly, so a FlatGradBuffers built again over the
        # same parameters does not keep this one alive; when this one is collected, or
        # closed, its hooks go too.
        self._watch = BindingWatch()
        self._bind(trained, frozen)
        self._modules = None if root is None else ModuleWatch(self._watch, root)

        def views(spans_of):
            return [
                [self.buffers[dt][s.start : s.end] for s in spans_of(b)]
                for dt, b in self.plan.buffers.items()
            ]

        # Built once: norms and clips walk buffers, never parameters (only the per-call
        # check reads each .grad, in one C-level pass).
        self._norm_groups = views(lambda b: b.norm_spans)
        self._scale_groups = views(lambda b: b.scale_spans)
        # One view per counted parameter, no padding: read only by norms with p <= 0.
        exact = views(lambda b: [s.span for s in b.slots if s.counted])
        # Replays norm/clip as CUDA graphs after the first calls (buffers/graphs.py).
        self._norm_clip = NormClip(
            self._norm_groups, self._scale_groups, self.device, options, exact_groups=exact
        )
        self._norm_padding = sum(
            n for b in self.plan.buffers.values() for n in b.padding_in.values()
        )
        self._param_pass: ParamNormPass | None = None  # built at the first per_param call

    def _bind(
        self, trained: list[tuple[str, torch.Tensor]], frozen: list[tuple[str, torch.Tensor]]
    ) -> None:
        """Bind every trained parameter's ``.grad`` and watch the frozen ones, or nothing."""
        before: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        # In the order given, so that reports list names in the model's order.
        slots = sorted(
            ((dt, s) for dt, b in self.plan.buffers.items() for s in b.slots),
            key=lambda slot: slot[1].index,
        )
        try:
            for dt, slot in slots:
                name, p = trained[slot.index]
                before.append((p, p.grad))
                view = self.buffers[dt][slot.offset : slot.offset + slot.numel]
                self._watch.bind(name, p, view.view(slot.shape))
            for name, p in frozen:
                self._watch.watch_outsider(
                    p,
                    repr(name),
                    "parameter {names} was frozen (requires_grad=False) when these "
                    "FlatGradBuffers were built, so it has no place in their buffers; it now "
                    "receives a gradient that their norm would miss: build a new "
                    "FlatGradBuffers after unfreezing it",
                )
        except BaseException:
            self._watch.undo(before)
            raise
        self._watch.pick_samples()
        self._watch.claim()

    def close(self) -> None:
        """Remove the hooks these buffers put on the parameters (idempotent).

        Also what leaving a ``with FlatGradBuffers(...) as fgb:`` block does, and what
        happens when these buffers are garbage-collected. Nothing checks the ``.grad``
        views any more, so every later norm, clip, count or ``zero_()`` raises: build a new
        FlatGradBuffers to go on.
        """
        self._watch.close()
        if self._modules is not None:
            self._modules.close()

    def __enter__(self) -> FlatGradBuffers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_bound(self) -> None:
        """Every ``.grad`` its view, or taken in as torch would take it, or an error.

        One C-level pass over the parameters' ``.grad`` per call ([Note: gradients set to
        None or replaced] in :mod:`buffers.bindings`).
        """
        self._watch.check()

    @property
    def nbytes(self) -> int:
        """Bytes of all flat buffers, padding included."""
        return self.plan.nbytes

    def view(self, p: torch.Tensor) -> torch.Tensor:
        """The gradient view of ``p``: same shape and dtype as ``p``."""
        b = self._watch.bindings.get(id(p))
        if b is None or b.ref() is not p:
            raise KeyError(
                "this parameter has no gradient view here (frozen, or not passed to "
                "FlatGradBuffers)"
            )
        return b.view

    def check_bindings(self) -> None:
        """Verify every binding (one Python pass over the parameters; not per step).

        A ``.grad`` set to None or replaced is taken in as every norm, clip or count takes
        it (its view zeroed, or the new tensor copied into it). Also finds what the
        per-call check (every ``.grad``'s identity, one parameter per buffer's dtype) and
        the backward hooks cannot see before the next backward: part of a model converted
        (``submodule.half()``), a ``.grad.data`` replaced, or a parameter with a gradient
        added to the model where torch's registration hooks do not run
        (``ModuleList.insert``). Raises ``GradientOutsideBufferError`` naming them.
        """
        if self._modules is not None and not self._watch.closed:
            self._modules.scan()
        self._watch.settle()

    def zero_(self, set_to_none: bool = True) -> None:
        """Zero every buffer (padding included) and reset every ``.grad``, as ``zero_grad()``.

        Args:
            set_to_none: as torch's ``Optimizer.zero_grad``: True (default) sets every
                ``.grad`` to None, so a torch optimizer skips a parameter that gets no
                gradient before its next step (frozen, or unused this step: no momentum,
                no weight decay); backward points ``.grad`` back at its zeroed view when it
                accumulates one. False sets every ``.grad`` to its zeroed view, so every
                parameter is stepped, with a zero gradient where it got none.

        Raises ``GradientOutsideBufferError`` for what re-binding cannot fix (a converted
        or freed parameter, DDP bucket views, closed buffers, buffers built later over the
        same parameters).
        """
        ops.check_flag(set_to_none, "set_to_none")
        for buf in self.buffers.values():
            buf.zero_()
        self._watch.zeroed(set_to_none)

    @overload
    def grad_norm(
        self,
        norm_type: float = ...,
        error_if_nonfinite: bool = ...,
        foreach: bool | None = ...,
        *,
        group=...,
        per_param: Literal[False] = ...,
    ) -> torch.Tensor: ...
    @overload
    def grad_norm(
        self,
        norm_type: float = ...,
        error_if_nonfinite: bool = ...,
        foreach: bool | None = ...,
        *,
        group=...,
        per_param: Literal[True],
    ) -> ParamNorms: ...
    def grad_norm(
        self,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
        *,
        group=None,
        per_param: bool = False,
    ) -> torch.Tensor | ParamNorms:
        """Norm of the counted gradients, accumulated in fp32 (fp64 buffers in fp64); no sync.

        The positional arguments are those of ``torch.nn.utils.get_total_norm``.

        Args:
            norm_type: any number or +-inf, as torch's (0 and p < 0 too; see
                :func:`buffers.ops.check_torch_norm_type`).
            error_if_nonfinite: raise if the norm is NaN or inf (this one check syncs).
            foreach: accepted for torch's argument order; each buffer is always one fused
                launch. None or a bool.
            group: keyword-only: a ``torch.distributed.ProcessGroup`` to reduce over (one
                all-reduce), or None for local.
            per_param: keyword-only: also every parameter's own norm, from the same single
                pass over each buffer (:class:`buffers.param_norms.ParamNorms`). With
                ``group``, the one all-reduce carries the per-parameter vector and the total
                together; parameters are matched across ranks by name (gathered once per
                group, at the first such call).

        Returns:
            0-dim tensor on the buffers' device: fp32, or fp64 when a counted buffer is
            fp64 (with a group: when one on this rank is). With ``per_param``, a
            :class:`~buffers.param_norms.ParamNorms` whose ``total`` is that tensor.

        Every argument is checked (``TypeError``/``ValueError`` naming it) before any
        gradient is read.
        """
        _check_call_args(error_if_nonfinite, foreach, group, per_param)
        p = ops.check_torch_norm_type(norm_type)
        self._check_bound()
        result = self._param_norms(p, group) if per_param else self._total_norm(p, group)
        if error_if_nonfinite:
            total = result.total if isinstance(result, ParamNorms) else result
            _raise_if_nonfinite(total, norm_type)
        return result

    def _total_norm(self, p: float, group) -> torch.Tensor:
        if group is None:
            return self._norm_clip.norm(p)
        # Built per call, not kept: holding the group past destroy_process_group() can
        # abort the process when these buffers are freed later (seen with gloo).
        reducer = graphs.GroupReducer(p, group, self.device, self.options)
        return self._norm_clip.norm_reduced(p, *reducer.args())

    def _param_norms(self, p: float, group) -> ParamNorms:
        """Per-parameter and total norms: one segmented pass per buffer, one all-reduce."""
        if self._param_pass is None:
            self._param_pass = ParamNormPass(
                self.plan, self.buffers, self._names, self.device, self.options
            )
        with graphs.profiler_range(graphs.NORM_RANGE):
            if group is None:
                return self._param_pass.norms(p, self._norm_clip.replay)
            reducer = graphs.GroupReducer(p, group, self.device, self.options)
            return self._param_pass.norms(p, self._norm_clip.replay, group, reducer.args())

    @overload
    def clip_grad_norm_(
        self,
        max_norm: float | torch.Tensor,
        norm_type: float = ...,
        error_if_nonfinite: bool = ...,
        foreach: bool | None = ...,
        *,
        group=...,
        per_param: Literal[False] = ...,
    ) -> torch.Tensor: ...
    @overload
    def clip_grad_norm_(
        self,
        max_norm: float | torch.Tensor,
        norm_type: float = ...,
        error_if_nonfinite: bool = ...,
        foreach: bool | None = ...,
        *,
        group=...,
        per_param: Literal[True],
    ) -> ParamNorms: ...
    def clip_grad_norm_(
        self,
        max_norm: float | torch.Tensor,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
        *,
        group=None,
        per_param: bool = False,
    ) -> torch.Tensor | ParamNorms:
        """Scale all gradients by ``max_norm / (norm + 1e-6)`` when that is below 1.

        The positional arguments are those of ``torch.nn.utils.clip_grad_norm_`` (after its
        ``parameters``).

        Args:
            max_norm: the norm to clip to, >= 0, any size (``inf``, or beyond the
                statistic's dtype, never clips); a tensor is read to the host once
                (``float()``). Negative or NaN: ``ValueError``.
            norm_type: any number or +-inf, as torch's (0 and p < 0 too; see
                :func:`buffers.ops.check_torch_norm_type`).
            error_if_nonfinite: raise if the norm is NaN or inf (this one check syncs).
            foreach: accepted for torch's argument order; unused (None or a bool).
            group: keyword-only: a ``torch.distributed.ProcessGroup`` to reduce over, or
                None.
            per_param: keyword-only: return the pre-clip per-parameter norms too (as
                :meth:`grad_norm` with ``per_param=True``); the scale is then its own
                launch per buffer after them.

        Returns:
            The pre-clip norm, a 0-dim device tensor: fp32, or fp64 when a counted buffer
            is fp64. With ``per_param``: the pre-clip :class:`ParamNorms`.

        Every argument is checked (``TypeError``/``ValueError`` naming it) before any
        gradient is read or scaled.
        """
        _check_call_args(error_if_nonfinite, foreach, group, per_param)
        max_norm = ops.check_max_norm(max_norm)
        p = ops.check_torch_norm_type(norm_type)
        self._check_bound()
        if not (error_if_nonfinite or per_param):
            return self._clip(max_norm, p, group)
        result = self._param_norms(p, group) if per_param else self._total_norm(p, group)
        total = result.total if isinstance(result, ParamNorms) else result
        if error_if_nonfinite:
            _raise_if_nonfinite(total, norm_type)
        self._norm_clip.scale_by_norm_(total, max_norm)
        return result

    def _clip(self, max_norm: float, p: float, group) -> torch.Tensor:
        """The fused norm and scale, arguments and bindings checked by the caller."""
        if group is None:
            return self._norm_clip.clip_(max_norm, p)
        reducer = graphs.GroupReducer(p, group, self.device, self.options)
        return self._norm_clip.clip_reduced_(max_norm, p, *reducer.args())

    def clipped_step(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float | torch.Tensor,
        norm_type: float = 2.0,
        *,
        group=None,
        fold: bool = False,
    ) -> torch.Tensor:
        """Clip to ``max_norm``, then ``optimizer.step()``; returns the pre-clip norm.

        With ``fold=True`` and torch's fused Adam or AdamW (``fused=True``) the clip is
        folded into the optimizer's own read of the gradients: the inverse coefficient goes
        in as its ``grad_scale`` (a device scalar the fused kernel divides gradients by, as
        it does for ``GradScaler``), so there is no separate scale launch reading and
        writing the gradients; torch's kernel writes the divided gradients back, so
        ``.grad`` ends up clipped as after an explicit clip. It is off by default: torch's
        fused step reading a ``grad_scale`` costs more than our scale kernel does, so the
        fold measured slower than the explicit clip (``benchmarks/clip_step.py``; the
        numbers are in docs/RESULTS.md, "clip_step"). Otherwise, and for any other
        optimizer: ``clip_grad_norm_`` and then ``step()``. Either way every parameter the
        optimizer holds must have its gradient in these buffers, or the norm would not
        count it (``ValueError``); this is checked again whenever the optimizer's
        parameters change (one pass over their ids per call), and an optimizer parameter
        that is frozen now is watched by a hook.
        ``group`` and ``fold`` are keyword-only; every argument is checked as in
        :meth:`clip_grad_norm_`, before anything runs.
        """
        ops.check_group(group)
        ops.check_flag(fold, "fold")
        max_norm = ops.check_max_norm(max_norm)
        p = ops.check_torch_norm_type(norm_type)
        self._check_bound()
        self._check_optimizer_params(optimizer)
        if not (fold and self._can_fold(optimizer)):
            total = self._clip(max_norm, p, group)
            optimizer.step()
            return total
        given = None if group is None else self._total_norm(p, group)
        total = self._norm_clip.fold_(max_norm, p, given)
        # torch's fused Adam reads this attribute, which its stubs do not declare
        optimizer.grad_scale = self._norm_clip.inverse_coeff  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
        return total

    @staticmethod
    def _can_fold(optimizer) -> bool:
        if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            return False
        if hasattr(optimizer, "grad_scale") or hasattr(optimizer, "found_inf"):
            return False  # a GradScaler is already using the hook
        return all(g.get("fused") for g in optimizer.param_groups)

    def _check_optimizer_params(self, optimizer) -> None:
        # Compared parameter by parameter (identity, one C-level pass), not by count: a
        # parameter replaced in a group keeps the count. Our parameters are alive (a freed
        # one raised above), so an id found in the bindings is that parameter.
        groups = [g["params"] for g in optimizer.param_groups]
        if _same_objects(self._checked_optimizers.get(optimizer), groups):
            return
        watch = self._watch
        for gi, g in enumerate(optimizer.param_groups):
            for pi, q in enumerate(g["params"]):
                if id(q) in watch.bindings:
                    continue
                where = (
                    f"optimizer parameter {pi} of param group {gi} (shape {tuple(q.shape)}, "
                    f"{q.dtype})"
                )
                outsider = watch.outsiders.get(id(q))
                if q.requires_grad and outsider is not None and outsider[0]() is q:
                    raise ValueError(f"{where}: {watch.message(id(q))}")
                if q.requires_grad:
                    raise ValueError(
                        f"{where} is not in these FlatGradBuffers, so the norm would not count "
                        "its gradient; build FlatGradBuffers over every parameter the "
                        "optimizer updates"
                    )
                if not q.is_inference():
                    watch.watch_outsider(
                        q,
                        where,
                        "{names} is not in these FlatGradBuffers; it was frozen when checked "
                        "and now receives a gradient that their norm would miss: build "
                        "FlatGradBuffers over every parameter the optimizer updates",
                    )
        self._checked_optimizers[optimizer] = [list(g) for g in groups]

    def count_zeros(self, *, group=None) -> torch.Tensor:
        """Number of zero elements among counted gradients (padding excluded), int64.

        ``group`` (keyword-only): a ``torch.distributed.ProcessGroup`` to sum over, or None.
        """
        ops.check_group(group)
        self._check_bound()
        zeros = ops.count_zeros_groups(self._norm_groups, self._norm_padding, self.device)
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(zeros, op=dist.ReduceOp.SUM, group=group)
        return zeros

    def __repr__(self) -> str:
        sizes = ", ".join(f"{dt}: {b.numel}" for dt, b in self.plan.buffers.items())
        return f"FlatGradBuffers({len(self._names)} params; {sizes}; {self.nbytes} bytes)"


def _checked_trained_and_frozen(
    named: list[tuple[str, torch.Tensor]],
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """Check each parameter (a leaf tensor; if trained, of a gradient dtype we hold) and
    split them into ``(trained, frozen)``, each parameter once, in the given order.

    Raises:
        ValueError: a parameter is not a leaf tensor.
        TypeError: a trained parameter's dtype has no flat buffer.
    """
    seen: set[int] = set()
    trained, frozen = [], []
    for name, p in named:
        if id(p) in seen:
            continue
        seen.add(id(p))
        if torch.nn.parameter.is_lazy(p):
            raise ValueError(
                f"parameter {name!r} is not initialized yet (a lazy module such as LazyLinear "
                "before its first forward), so it has no shape to lay out: run one forward "
                "pass first, then build FlatGradBuffers"
            )
        if not p.is_leaf:
            raise ValueError(
                f"parameter {name!r} is not a leaf tensor (it was computed by "
                f"{type(p.grad_fn).__name__}), so backward never fills its .grad: pass the "
                "parameters themselves (e.g. model.named_parameters())"
            )
        if p.requires_grad:
            check_grad_dtype(p.dtype, f"parameter {name!r}")
            trained.append((name, p))
        elif (p.is_floating_point() or p.is_complex()) and not p.is_inference():
            frozen.append((name, p))  # could be unfrozen later: watched by a hook
    return trained, frozen


def _counts(counted: Callable[[torch.Tensor], bool] | None, name: str, p: torch.Tensor) -> bool:
    """``counted(p)``, which must be a bool (True where ``counted`` is None)."""
    if counted is None:
        return True
    answer = counted(p)
    if not isinstance(answer, bool):
        raise TypeError(
            f"counted returned {answer!r} (a {type(answer).__name__}) for parameter {name!r}; "
            "it must return True or False"
        )
    return answer


SPARSE_EMBEDDINGS = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def _refuse_sparse_gradients(
    trained: list[tuple[str, torch.Tensor]], root: ModelRoot | None
) -> None:
    """``TypeError`` naming a trained parameter whose gradient would not be dense.

    A flat buffer holds dense gradients: a sparse one would be made dense in it (and
    ``torch.optim.SparseAdam`` then refuses it). A sparse parameter is refused, and so is
    the weight of an ``Embedding`` / ``EmbeddingBag`` with ``sparse=True`` where the
    module is known (``root``); given a list, the backward hook refuses its gradient.
    """
    for name, p in trained:
        if p.layout is not torch.strided:
            raise TypeError(
                f"parameter {name!r} is a {p.layout} tensor; flat buffers hold dense "
                "gradients only: leave it out of FlatGradBuffers"
            )
    if root is None:
        return
    names = {id(p): name for name, p in trained}  # also skips modules not given
    for module in root.module.modules():
        if isinstance(module, SPARSE_EMBEDDINGS) and module.sparse and id(module.weight) in names:
            raise TypeError(
                f"parameter {names[id(module.weight)]!r} gets sparse gradients "
                f"({type(module).__name__}(sparse=True)), which a flat buffer would make dense "
                f"(torch.optim.SparseAdam then refuses it): {SPARSE_FIX}"
            )


def _pick_device(device, trained: list[tuple[str, torch.Tensor]]) -> torch.device:
    devices = {p.device for _, p in trained}
    if len(devices) > 1:
        by_dev: dict[torch.device, str] = {}
        for name, p in trained:
            by_dev.setdefault(p.device, name)
        listing = ", ".join(f"{n!r} on {d}" for d, n in by_dev.items())
        raise ValueError(
            f"parameters are on different devices ({listing}); build one FlatGradBuffers per device"
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


def _same_objects(checked: list[list] | None, groups: list[list]) -> bool:
    """Whether ``groups`` hold exactly the objects ``checked`` does, in the same order."""
    if checked is None or len(checked) != len(groups):
        return False
    return all(
        len(c) == len(g) and all(map(operator.is_, c, g))
        for c, g in zip(checked, groups, strict=True)
    )


def _check_call_args(error_if_nonfinite, foreach, group, per_param) -> None:
    """The non-tensor arguments of a norm or clip, checked before any gradient is read."""
    ops.check_flag(error_if_nonfinite, "error_if_nonfinite")
    ops.check_foreach(foreach)
    ops.check_group(group)
    ops.check_flag(per_param, "per_param")


def _raise_if_nonfinite(total: torch.Tensor, norm_type: float) -> None:
    if not torch.isfinite(total).item():
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite, so it "
            "cannot be clipped; pass error_if_nonfinite=False to scale by NaN/0 instead"
        )
