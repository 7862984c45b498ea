"""How a seam entry's recorded use is compared with megatron-core's target.

Pure inspection, no table and no megatron-core import: what kind of object a target is
(:func:`kind_of`), whether a call we make still binds to its signature
(:func:`call_problems`), whether code megatron-core calls in the target's place still takes
what its callers pass (:func:`stand_in_problems`), and whether every ``return`` of its
source still builds the tuple we index or unpack (:func:`returns_problem`, read from the
source's syntax tree). Each returns the problems in words, for :mod:`megatron_ext.seam` to
name the entry they break.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

_EMPTY = inspect.Parameter.empty
_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)
_KEYWORD = (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY)
_KIND_TEXT = {_P.POSITIONAL_ONLY: "positional-only", _P.POSITIONAL_OR_KEYWORD: "positional",
              _P.KEYWORD_ONLY: "keyword-only", _P.VAR_POSITIONAL: "*args",
              _P.VAR_KEYWORD: "**kwargs"}  # fmt: skip


def kind_of(owner, raw) -> str:
    """What ``raw``, as found in ``owner``'s namespace, is: a seam ``Entry.kind`` word."""
    if isinstance(raw, classmethod):
        return "classmethod"
    if isinstance(raw, staticmethod):
        return "staticmethod"
    if isinstance(raw, property):
        return "property"
    if isinstance(raw, type):
        return "class"
    if callable(raw):
        return "method" if isinstance(owner, type) else "function"
    return f"{type(raw).__name__} value"


def spec(tokens: tuple[str, ...]) -> list[inspect.Parameter]:
    """``params`` tokens as parameters (default: a marker, only whether there is one)."""
    out = []
    keyword_only = False  # after "*" or "*args"
    for token in tokens:
        if token == "*":
            keyword_only = True
        elif token.startswith("**"):
            out.append(inspect.Parameter(token[2:], inspect.Parameter.VAR_KEYWORD))
        elif token.startswith("*"):
            out.append(inspect.Parameter(token[1:], inspect.Parameter.VAR_POSITIONAL))
            keyword_only = True
        else:
            name, default = token.removesuffix("="), token.endswith("=")
            kind = _P.KEYWORD_ONLY if keyword_only else _P.POSITIONAL_OR_KEYWORD
            out.append(inspect.Parameter(name, kind, default=... if default else _EMPTY))
    return out


def _required(p: inspect.Parameter) -> bool:
    return p.default is _EMPTY and p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)


def _describe_param(p: inspect.Parameter) -> str:
    return f"{'required' if _required(p) else 'optional'} {_KIND_TEXT[p.kind]} {p.name!r}"


def call_problems(have: list[inspect.Parameter], call: list[inspect.Parameter]) -> list[str]:
    """What would fail in calling a target whose parameters are ``have`` as ``call`` says."""
    problems = []
    by_name = {p.name: p for p in have}
    positional = [p for p in have if p.kind in _POSITIONAL]
    takes_args = any(p.kind == _P.VAR_POSITIONAL for p in have)
    takes_kwargs = any(p.kind == _P.VAR_KEYWORD for p in have)
    forwards_args = any(p.kind == _P.VAR_POSITIONAL for p in call)
    forwards_kwargs = any(p.kind == _P.VAR_KEYWORD for p in call)
    passed = set()
    ours = [p for p in call if p.kind == _P.POSITIONAL_OR_KEYWORD]
    for i, p in enumerate(ours):
        if i < len(positional):
            t = positional[i]
            if t.name != p.name:
                problems.append(
                    f"its positional parameter {i + 1} is {t.name!r}, where we pass {p.name!r}"
                )
            passed.add(t.name)
        elif not takes_args:
            problems.append(
                f"it takes {len(positional)} positional parameters; we pass {p.name!r} as "
                f"positional argument {i + 1}"
            )
    for p in call:
        if p.kind != _P.KEYWORD_ONLY:
            continue
        named = by_name.get(p.name)
        if named is None:
            if not takes_kwargs:
                problems.append(f"it has no parameter {p.name!r}, which we pass by keyword")
        elif named.kind not in _KEYWORD:
            problems.append(f"{p.name!r} is now {_KIND_TEXT[named.kind]}; we pass it by keyword")
        elif named.name in passed:
            problems.append(f"{p.name!r} now comes before it; we pass it by keyword")
        passed.add(p.name)
    for p in call:
        named = by_name.get(p.name)
        if p.default is not _EMPTY and named is not None and _required(named):
            problems.append(f"{p.name!r} is now required; we do not always pass it")
    for t in have:
        if not _required(t) or t.name in passed:
            continue
        forwarded = (forwards_args and t.kind in _POSITIONAL) or (
            forwards_kwargs and t.kind in _KEYWORD
        )
        if not forwarded:
            problems.append(f"it has a new {_describe_param(t)} parameter, which we do not pass")
    return problems


def stand_in_problems(have: list[inspect.Parameter], ours: list[inspect.Parameter]) -> list[str]:
    """What megatron-core's callers of a target with parameters ``have`` could pass or omit
    that code taking ``ours`` does not handle (``ours``' ``*args``/``**kwargs`` forward)."""
    problems = []
    mine = {p.name: (i, p) for i, p in enumerate(ours)}
    forwards_args = any(p.kind == _P.VAR_POSITIONAL for p in ours)
    forwards_kwargs = any(p.kind == _P.VAR_KEYWORD for p in ours)
    for i, t in enumerate(have):
        if t.kind == _P.VAR_POSITIONAL and not forwards_args:
            problems.append(f"it now takes *{t.name}, which our code does not")
            continue
        if t.kind == _P.VAR_KEYWORD and not forwards_kwargs:
            problems.append(f"it now takes **{t.name}, which our code does not")
            continue
        if t.kind in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD):
            continue
        if t.name not in mine:
            forwarded = (t.kind == _P.KEYWORD_ONLY and forwards_kwargs) or (
                t.kind in _POSITIONAL
                and forwards_args
                and (t.kind == _P.POSITIONAL_ONLY or forwards_kwargs)
            )
            if not forwarded:
                problems.append(f"it has a new {_describe_param(t)} parameter {i + 1}")
            continue
        j, p = mine[t.name]
        if p.kind != t.kind:
            problems.append(f"{t.name!r} is now {_KIND_TEXT[t.kind]} (was {_KIND_TEXT[p.kind]})")
        elif t.kind in _POSITIONAL and i != j:
            problems.append(f"{t.name!r} moved from position {j + 1} to {i + 1}")
        if _required(p) and not _required(t):
            problems.append(f"{t.name!r} now has a default, so callers may leave it out")
    names = {t.name for t in have}
    for p in ours:
        if p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD) and p.name not in names:
            problems.append(f"it no longer takes {_describe_param(p)}")
    return problems


def returned_tuples(func) -> list[ast.expr | None]:
    """The value of every ``return`` in ``func``'s own body (not in nested functions);
    None for a bare ``return``."""
    source = textwrap.dedent(inspect.getsource(inspect.unwrap(func)))
    node = ast.parse(source).body[0]
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        raise TypeError(f"its source starts with a {type(node).__name__}, not a function")
    out: list[ast.expr | None] = []
    todo: list[ast.AST] = list(node.body)
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Return):
            out.append(n.value)
        elif not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            todo.extend(ast.iter_child_nodes(n))
    return out


def returns_problem(obj, expected: tuple[str, ...]) -> str | None:
    func = getattr(obj, "__func__", obj)
    try:
        values = returned_tuples(func)
    except (OSError, TypeError, SyntaxError) as e:
        return f"its source cannot be read to check the tuple it returns ({e})"
    if not values:
        return f"it has no return statement; we expect the tuple ({', '.join(expected)})"
    for v in values:
        got = "None" if v is None else ast.unparse(v)
        items = tuple(ast.unparse(e) for e in v.elts) if isinstance(v, ast.Tuple) else None
        if items != expected:
            what = f"a {len(items)}-tuple ({', '.join(items)})" if items is not None else got
            return (
                f"it returns {what}; we index or unpack the {len(expected)}-tuple "
                f"({', '.join(expected)})"
            )
    return None


def signature_params(obj, kind: str | None) -> list[inspect.Parameter]:
    """``obj``'s parameters as its callers pass them (``self`` left out of a method)."""
    params = list(inspect.signature(obj).parameters.values())
    if kind == "method" and params:  # looked up on the class: drop self
        params = params[1:]
    return params
