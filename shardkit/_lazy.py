"""Lazy package namespaces (PEP 562): a name is imported on first use, so importing a package
(or building the command line's flags) starts no JAX."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any


class _Package(types.ModuleType):
    """A package whose lazily exported functions may share their names with submodules
    (``shardkit.plan.dryrun``, ``shardkit.parallel.ring_attention``). The import system binds a
    submodule to its parent's attribute when first importing it, which would hide the function;
    such bindings are refused (the submodule stays in ``sys.modules``)."""

    _lazy_names: frozenset[str] = frozenset()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._lazy_names and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


def install(
    package: str, where: Mapping[str, str], submodules: Iterable[str] | Mapping[str, str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Make ``package`` lazy: ``where`` maps an exported name to the submodule defining it
    (dotted below ``package``: ``"core.errors"``).

    ``submodules`` names the submodules the package exposes as attributes: names, or a map from
    the attribute's name to the submodule's dotted path (``{"errors": "core.errors"}``).

    Returns the package's ``__getattr__`` and ``__dir__``.
    """
    module = sys.modules[package]
    module.__class__ = _Package
    module._lazy_names = frozenset(where)  # type: ignore[attr-defined]
    subs = dict(submodules) if isinstance(submodules, Mapping) else {name: name for name in submodules}

    def __getattr__(name: str) -> Any:
        if name in where:  # before submodules: an exported function wins over a module of its name
            value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
            module.__dict__[name] = value  # later lookups skip this function
            return value
        if name in subs:
            return importlib.import_module(f"{package}.{subs[name]}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*where, *subs})

    return __getattr__, __dir__
