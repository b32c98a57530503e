"""One recipe key, declared once: its default, a one-line doc and the values it accepts.

Every field of a config dataclass is declared as `name: type = key(default, doc, check)`.
The loader (pipeline/config.py) checks each value against `check` when a recipe is read,
and the config reference (`loongsage config`, docs/config.md, pipeline/config_doc.py) is
generated from the same fields, so a key's doc, default and range cannot drift apart.

This module imports nothing from the project: every stage's config imports it.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any, Callable


class Check:
    """What a key accepts: a predicate and the words the reference and errors print for it."""

    def __init__(self, text: str, ok: Callable[[Any], bool]):
        self.text, self.ok = text, ok

    def __call__(self, value) -> bool:
        return self.ok(value)

    def __str__(self) -> str:
        return self.text


def _num(x) -> str:
    return format(x, "g") if isinstance(x, float) else str(x)


def at_least(lo) -> Check:
    return Check(f">= {_num(lo)}", lambda v: v >= lo)


def above(lo) -> Check:
    return Check(f"> {_num(lo)}", lambda v: v > lo)


def between(lo, hi, lo_open: bool = False, hi_open: bool = False) -> Check:
    """lo..hi, each end closed unless said open: between(0, 1, hi_open=True) is [0, 1)."""
    return Check(f"in {'(' if lo_open else '['}{_num(lo)}, {_num(hi)}{')' if hi_open else ']'}",
                 lambda v: (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi))


def one_of(*choices) -> Check:
    shown = ", ".join(repr(c) if c == "" else str(c) for c in choices)
    return Check(f"one of {shown}", lambda v: v in choices)


POSITIVE = above(0)
NONNEG = at_least(0)
UNIT = between(0, 1)


def key(default, doc: str, check: Check | None = None):
    """A dataclass field carrying its doc and check. A dataclass type as the default is a
    nested section (built by default_factory); a dict or list default is copied per instance."""
    meta = {"doc": doc, "check": check}
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=default, metadata=meta)
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def doc_of(f: dataclasses.Field) -> str:
    return f.metadata.get("doc", "")


def check_of(f: dataclasses.Field) -> Check | None:
    return f.metadata.get("check")


def default_of(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def problem(value, check: Check | None) -> str | None:
    """Why `value` (already of the key's type) is refused, or None. NaN and infinities are
    refused for every float key: no recipe value means 'not a number' or 'unbounded'."""
    if any(isinstance(v, float) and not math.isfinite(v) for v in (value if isinstance(value, tuple) else (value,))):
        return f"a finite number{' ' + str(check) if check else ''}"
    if check is None or value is None:
        return None
    try:
        return None if check(value) else str(check)
    except TypeError:                 # e.g. a None where a bound compares numbers
        return str(check)


def section(name: str):
    """A frozen config dataclass for the recipe section `name`. Built, it refuses a value its key's check
    refuses (a config built in code is held to what the loader holds a recipe to, with the same words;
    nested sections check themselves), then runs the class's own __post_init__ (if any) for what one
    key's check cannot say."""
    def make(cls):
        own = cls.__dict__.get("__post_init__")

        def __post_init__(self):
            for f in dataclasses.fields(self):
                value = getattr(self, f.name)
                why = None if dataclasses.is_dataclass(value) else problem(value, check_of(f))
                if why:
                    raise ValueError(f"{name}.{f.name} must be {why}, got {value!r}")
            if own is not None:
                own(self)
        cls.__post_init__ = __post_init__
        return dataclasses.dataclass(frozen=True)(cls)
    return make


def import_object(path: str):
    """The object a dotted path names: `pkg.module:attr` or `pkg.module.attr`."""
    module, _, attr = path.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module), attr)
