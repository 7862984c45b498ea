"""Which attributes of megatron-core's objects the project's code reads and writes, recorded
while it runs (test support for ``tests/test_seam_coverage.py``).

:func:`recording` gives the classes of megatron-core loaded then (the roots of its class
trees, and any class below one with its own attribute access: a subclass inherits the hook,
ours included) a ``__getattribute__``, ``__setattr__`` and ``__delattr__`` that note the
access when the code making it is ours: a function in a file of ``megatron_ext`` or
``buffers`` (not the seam's own checks, :mod:`megatron_ext.seam`: asking whether an attribute
is there is not using it; not code generated at run time, such as a dataclass's
``__init__``). Then they do what the class did before. megatron-core's own code, torch's and
the tests' go through unrecorded. Everything is restored when the block ends.

An access is noted with the object's class, the attribute's name, whether it was a read or a
write, whether a read found it (a ``getattr`` with a default of an absent one is a probe),
and the first place in our code that made it. Left out, as not megatron-core's part of the
object: dunder names (``isinstance`` reads ``__class__``), names our classes define (our
methods, our subclasses' settings), and names torch or Python define (``named_parameters``,
``register_forward_pre_hook``) unless the instance's own attribute shadows them. A write of
``__class__`` (a class swap) is noted.
"""

from __future__ import annotations

import contextlib
import enum
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

OURS = ("megatron_ext", "buffers")
NOT_USES = ("megatron_ext.seam", "megatron_ext.seam_signatures")  # the seam's own checks


@dataclass(frozen=True)
class Access:
    """One kind of access: ``mode`` is ``"read"`` or ``"write"``; ``cls`` the object's class."""

    cls: type
    name: str
    mode: str


@dataclass
class AccessLog:
    """Every access noted: per :class:`Access`, where it was first made (``module:line``)
    and whether the attribute was ever absent when read (a probe)."""

    where: dict[Access, str] = field(default_factory=dict)
    absent: set[Access] = field(default_factory=set)
    hooked: list[type] = field(default_factory=list)  # the classes whose accesses it saw

    def note(self, access: Access, where: str, found: bool = True) -> None:
        self.where.setdefault(access, where)
        if not found:
            self.absent.add(access)


def _ours(module: str) -> bool:
    if module in NOT_USES:
        return False
    return any(module == p or module.startswith(p + ".") for p in OURS)


def _caller() -> str | None:
    """``module:line`` of the frame that made the access (two above the hook), if it is
    our code: a module of ours, in a file of ours (not code generated at run time, such as
    a dataclass's ``__init__``, which reads and writes every field)."""
    frame = sys._getframe(2)
    module = frame.f_globals.get("__name__", "")
    if not _ours(module) or not frame.f_code.co_filename.endswith(".py"):
        return None
    return f"{module}:{frame.f_lineno}"


def _owner(cls: type, name: str) -> type | None:
    """The first class in ``cls``'s MRO whose namespace defines ``name``, if any."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass
    return None


def _megatron_cores(cls: type) -> bool:
    return (cls.__module__ or "").startswith("megatron.")


def _skipped(obj: object, name: str) -> bool:
    """Not megatron-core's part of ``obj``: a dunder; a name one of our classes defines (our
    subclasses' methods and settings); a name torch or Python defines (``named_parameters``),
    unless the instance's own attribute of that name shadows it (megatron-core's DDP sets
    ``buffers`` over ``torch.nn.Module.buffers``). What no class defines is an instance
    attribute: megatron-core's, or one we added."""
    if name.startswith("__") and name.endswith("__"):
        return True
    owner = _owner(type(obj), name)
    if owner is None or _megatron_cores(owner):
        return False
    module = owner.__module__ or ""
    if not (module == "builtins" or module == "torch" or module.startswith("torch.")):
        return True  # ours (a class we build may take its metaclass's module, "abc")
    return name not in object.__getattribute__(obj, "__dict__")


def megatron_roots() -> list[type]:
    """The classes of megatron-core loaded now that no other of its classes derives from,
    and those that define their own attribute access: hooking them hooks every megatron-core
    class (and every subclass of one)."""
    found = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.core") or module is None:
            continue
        for value in list(vars(module).values()):
            if (
                isinstance(value, type)
                and value.__module__ == name
                and not issubclass(value, BaseException | enum.Enum)
                and "__slots__" not in vars(value)
            ):
                found.append(value)
    classes = set(found)
    own = {"__getattribute__", "__setattr__", "__delattr__"}
    return sorted(
        (c for c in classes if not any(b in classes for b in c.__mro__[1:]) or own & set(vars(c))),
        key=lambda c: f"{c.__module__}.{c.__qualname__}",
    )


def _hooks(cls: type, log: AccessLog):
    get, set_, del_ = cls.__getattribute__, cls.__setattr__, cls.__delattr__

    def __getattribute__(self, name):
        where = _caller()
        if where is None:
            return get(self, name)
        try:
            value = get(self, name)
        except AttributeError:
            # what Python does next (torch's modules find their submodules there)
            fallback = getattr(type(self), "__getattr__", None)
            try:
                if fallback is None:
                    raise
                value = fallback(self, name)
            except AttributeError:
                if not _skipped(self, name):
                    log.note(Access(type(self), name, "read"), where, found=False)
                raise
        if not _skipped(self, name):
            log.note(Access(type(self), name, "read"), where)
        return value

    def __setattr__(self, name, value):
        where = _caller()
        if where is not None and (name == "__class__" or not _skipped(self, name)):
            log.note(Access(type(self), name, "write"), where)
        set_(self, name, value)

    def __delattr__(self, name):
        where = _caller()
        if where is not None and not _skipped(self, name):
            log.note(Access(type(self), name, "write"), where)
        del_(self, name)

    return {"__getattribute__": __getattribute__, "__setattr__": __setattr__,
            "__delattr__": __delattr__}  # fmt: skip


@contextlib.contextmanager
def recording(roots: list[type] | None = None) -> Iterator[AccessLog]:
    """Note the accesses of the project's code to megatron-core's objects in the block
    (``roots``: the classes hooked, with their subclasses; default :func:`megatron_roots`)."""
    log = AccessLog()
    saved: list[tuple[type, str, object]] = []
    _missing = object()
    try:
        for cls in megatron_roots() if roots is None else roots:
            for name, hook in _hooks(cls, log).items():
                saved.append((cls, name, vars(cls).get(name, _missing)))
                try:
                    setattr(cls, name, hook)
                except TypeError:  # a class that takes no attributes (built in C)
                    saved.pop()
                    break
            else:
                log.hooked.append(cls)
        yield log
    finally:
        for cls, name, before in reversed(saved):
            if before is _missing:
                delattr(cls, name)
            else:
                setattr(cls, name, before)
