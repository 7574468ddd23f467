"""Which memo and params keys a step can write, read from its code and from what it calls in dashboard/services:
the keyword names of its ``memo_save`` and ``remember`` calls, the key of each ``start_once``, and whether it reads
with Spark (``state_reader_client`` writes its records under keys of its own). The test of each kind's declared keys
compares them with this."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Written:
    memo: set[str] = field(default_factory=set)
    params: set[str] = field(default_factory=set)
    reads: bool = False


def written(steps: Iterable[Callable[..., Any]]) -> Written:
    found, seen = Written(), set[Any]()
    for step in steps:
        _visit(step, found, seen)
    return found


def _visit(fn: Any, found: Written, seen: set[Any]) -> None:
    while isinstance(fn, functools.partial):
        fn = fn.func
    if not isinstance(fn, types.FunctionType) or fn in seen or not fn.__module__.startswith("dashboard.services"):
        return
    seen.add(fn)
    scope = dict(fn.__globals__)
    scope.update(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ()), strict=True))
    source = textwrap.dedent(inspect.getsource(fn))
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a lambda in the middle of a line: the lambda alone
        tree = ast.parse(source[source.index("lambda") :].rstrip(",) \n"))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        callee = _callee(node, scope)
        name = getattr(callee, "__name__", None)
        if name in ("memo_save", "remember"):
            for keyword in node.keywords:
                if keyword.arg:
                    (found.memo if name == "memo_save" else found.params).add(keyword.arg)
                elif fn.__module__.endswith(".state_reader_client"):
                    found.reads = True
                else:
                    raise AssertionError(f"{fn.__qualname__}: a key that is not written out in {name}(**...)")
        elif name == "start_once":
            key = next((k.value for k in node.keywords if k.arg == "key"), None)
            key = key or (node.args[1] if len(node.args) > 1 else None)
            found.params.add(key.value if isinstance(key, ast.Constant) else "run")
        else:  # what it calls, and the functions it hands on (a table built by a function, a callback)
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                if isinstance(arg, ast.Name):
                    _visit(scope.get(arg.id), found, seen)
            _visit(callee, found, seen)


def _callee(node: ast.Call, scope: dict[str, Any]) -> Any:
    if isinstance(node.func, ast.Name):
        return scope.get(node.func.id)
    if isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
        owner = scope.get(node.func.value.id)
        return getattr(owner, node.func.attr, None) if isinstance(owner, types.ModuleType) else None
    return None
