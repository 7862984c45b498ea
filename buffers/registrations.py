"""Parameters registered on the model after its FlatGradBuffers were built.

A parameter added to a module after the buffers were built has no place in them, so their
norm would miss its gradient. When the buffers know the model (built from a module, or from
its ``named_parameters()`` / ``parameters()`` generator), every module it held then is
watched: a parameter registered on one of them (``register_parameter``, attribute
assignment, ``ParameterList.append``), or a submodule attached to one, is watched like a
parameter frozen at build, so the first norm, clip or count after it receives a gradient
raises :class:`~buffers.bindings.GradientOutsideBufferError` naming it.

torch offers no per-module registration hook, only global ones
(``torch.nn.modules.module.register_module_parameter_registration_hook`` and its module
twin). One of each is installed per process, at the first FlatGradBuffers that knows its
model, and is never removed: at each registration anywhere in the process it does one
weak-dictionary lookup (under a microsecond) and nothing more unless the module is held
by a live, open FlatGradBuffers. Nothing runs per step. Writes that bypass those hooks
(``ModuleList.insert``, assigning into ``module._parameters``) are found by
``FlatGradBuffers.check_bindings()``, which walks the model. A plain list of tensors says
nothing about where they came from, so nothing added later can be seen there.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass

import torch

from .bindings import BindingWatch

REGISTERED_LATE = (
    "parameter {names} was registered on the model after these FlatGradBuffers were built, "
    "so it has no place in their buffers and their norm would miss its gradient: build a new "
    "FlatGradBuffers over the complete model (and the optimizer over its parameters)"
)


@dataclass(frozen=True)
class ModelRoot:
    """Where the parameters given to FlatGradBuffers came from: a module and how it was read."""

    module: torch.nn.Module
    prefix: str = ""
    recurse: bool = True


def model_root(params: object) -> ModelRoot | None:
    """The module behind ``params``, or None where it cannot be known (a list, a chain).

    A module itself, or a fresh generator from ``Module.named_parameters()`` or
    ``Module.parameters()``: its arguments are read with ``inspect.getgeneratorlocals``
    before it is consumed.
    """
    if isinstance(params, torch.nn.Module):
        return ModelRoot(params)
    if not inspect.isgenerator(params) or params.gi_code.co_name not in (
        "named_parameters",
        "parameters",
    ):
        return None
    if inspect.getgeneratorstate(params) != inspect.GEN_CREATED:
        return None  # partly consumed: what is left is not the whole module
    args = inspect.getgeneratorlocals(params)
    module = args.get("self")
    if not isinstance(module, torch.nn.Module):
        return None
    prefix = args.get("prefix", "")
    recurse = args.get("recurse", True)
    if not isinstance(prefix, str) or not isinstance(recurse, bool):
        return None
    return ModelRoot(module, prefix, recurse)


class ModuleWatch:
    """The modules a FlatGradBuffers' parameters came from, watched for new parameters."""

    def __init__(self, watch: BindingWatch, root: ModelRoot) -> None:
        self.watch = watch
        # Weak, as the parameters are: the buffers must not keep a discarded model alive
        # (its freed parameters are how they notice it was re-created).
        self.module = weakref.ref(root.module)
        self.prefix = root.prefix
        self.recurse = root.recurse
        self.names: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        _install_hooks()
        if root.recurse:
            for name, module in root.module.named_modules(prefix=root.prefix):
                self._track(module, name)
        else:
            self._track(root.module, root.prefix)

    def _track(self, module: torch.nn.Module, name: str) -> None:
        self.names.setdefault(module, name)
        _tracked.setdefault(module, weakref.WeakSet()).add(self)

    def close(self) -> None:
        for module in list(self.names):
            _tracked.get(module, set()).discard(self)

    def added_parameter(self, module: torch.nn.Module, name: str, param) -> None:
        """``param`` is being registered as ``name`` on ``module``, one of ours."""
        if param is not None:
            self._watch_late(_join(self.names[module], name), param)

    def added_module(self, parent: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
        """``module`` is being attached as ``name`` to ``parent``, one of ours."""
        if not self.recurse:
            return  # only the root's own parameters were given
        prefix = _join(self.names[parent], name)
        for sub_name, sub in module.named_modules(prefix=prefix):
            self._track(sub, sub_name)
        for param_name, param in module.named_parameters(prefix=prefix):
            self._watch_late(param_name, param)

    def scan(self) -> None:
        """Watch every parameter the model holds now and the buffers do not (one pass)."""
        module = self.module()
        if module is None:
            return  # the model is gone; its parameters' bindings report that
        if self.recurse:
            for name, sub in module.named_modules(prefix=self.prefix):
                self._track(sub, name)
                self.names[sub] = name  # where it is now (ModuleList.insert renumbers)
        for name, param in module.named_parameters(prefix=self.prefix, recurse=self.recurse):
            self._watch_late(name, param)

    def _watch_late(self, name: str, param: torch.Tensor) -> None:
        pid = id(param)
        if pid in self.watch.bindings or pid in self.watch.outsiders:
            return
        if param.is_inference() or not (param.is_floating_point() or param.is_complex()):
            return  # can never receive a gradient (and takes no hook)
        self.watch.watch_outsider(param, repr(name), REGISTERED_LATE)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# Every module some live watch holds, and those watches; both sides weak.
_tracked: weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakSet[ModuleWatch]] = (
    weakref.WeakKeyDictionary()
)
_hooks: list = []  # the two global handles, once installed


def _watching(module: torch.nn.Module) -> list[ModuleWatch]:
    """The live watches that hold ``module``: runs at every registration in the process,
    so one weak-dictionary lookup (under a microsecond) when the module is not ours."""
    try:
        watches = _tracked.get(module)
    except TypeError:  # a module class made unhashable by its own __eq__: never ours
        return []
    return list(watches) if watches else []


def _on_parameter(module: torch.nn.Module, name: str, param) -> None:
    for mw in _watching(module):
        mw.added_parameter(module, name, param)


def _on_module(parent: torch.nn.Module, name: str, module) -> None:
    if module is not None:
        for mw in _watching(parent):
            mw.added_module(parent, name, module)


def _install_hooks() -> None:
    if _hooks:
        return
    from torch.nn.modules import module as torch_module

    _hooks.append(torch_module.register_module_parameter_registration_hook(_on_parameter))
    _hooks.append(torch_module.register_module_module_registration_hook(_on_module))
