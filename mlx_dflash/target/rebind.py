"""A module's own forward with some of the functions its code calls by name
replaced, for one copy of the module: the class's method bodies are reused
with other globals, so mlx-lm's modules, its classes and the loaded instance
are untouched. Rollback uses it for the recurrent mixers' scans (rollback.py),
the verify for attention (verify_attention.py)."""

from __future__ import annotations

import types

import mlx.nn as nn


def uses(module, names) -> bool:
    """Whether a method of `module`'s class (below nn.Module) calls one of `names`."""
    return any(_methods(module, set(names)))


def _methods(module, names: set):
    """(name, function) of each method the class resolves (the first in its
    MRO below nn.Module) whose code calls one of `names`."""
    seen = set()
    for klass in type(module).__mro__:
        if klass in (nn.Module, dict, object):
            return
        for name, fn in vars(klass).items():
            if name in seen:
                continue
            seen.add(name)
            if isinstance(fn, types.FunctionType) and names & set(fn.__code__.co_names):
                yield name, fn


def forward_with(module, replace: dict):
    """`module`'s forward, run with the functions its code calls by the names in
    `replace` replaced by theirs; `module` must be the caller's own copy: its
    other methods that call them are bound on it (found before the class's).
    Returns the forward (`module` itself where `__call__` calls none of them)."""
    def swapped(fn):
        g = dict(fn.__globals__)
        g.update({k: v for k, v in replace.items() if k in g})
        f = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
        f.__kwdefaults__ = fn.__kwdefaults__
        return f

    forward = None
    for name, fn in _methods(module, set(replace)):
        if name == "__call__":
            forward = swapped(fn).__get__(module)
        elif name not in module.__dict__:
            module.__dict__[name] = swapped(fn).__get__(module)  # the copy's, found before the class's
    return forward or module
