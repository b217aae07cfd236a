"""Where a model comes from by name: a GPT preset, or the user's own factory.

A factory is named the way ``uvicorn main:app`` names an application: ``package.module:function``
(dots after the colon reach attributes, ``pkg.models:Zoo.small``). Calling it with no arguments
returns a :class:`shardkit.Model`, so a subprocess (a dry run for another device count, the
planner) can rebuild the user's model from that string alone.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from shardkit.core.errors import ModelError, ShardkitError, short_repr
from shardkit.models.model import Model

ModelSource = str | Callable[[], Model]


def is_factory_ref(name: str) -> bool:
    """``pkg.module:factory`` (a factory) rather than a preset name."""
    return isinstance(name, str) and ":" in name


def factory_ref(factory: Callable[[], Model]) -> str:
    """The ``module:qualname`` a subprocess can import ``factory`` by.

    Raises:
      ShardkitError: for a lambda, a nested function or one defined in ``__main__``.
    """
    module, qualname = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if not module or not qualname or module == "__main__" or "<" in qualname:
        raise ModelError(
            f"The model factory {short_repr(factory)} cannot be found by another process (it is a lambda, nested, "
            "or defined in __main__), and this dry run needs one because JAX already started here with another "
            "device count. Fix: define the factory at the top level of an importable module and pass it, or "
            "its name as 'package.module:factory'."
        )
    return f"{module}:{qualname}"


def importable_name(factory: Callable[[], Model]) -> str:
    """``module:qualname`` when another process can import ``factory``, else its bare name."""
    try:
        return factory_ref(factory)
    except ShardkitError:
        return getattr(factory, "__name__", "model")


def load_factory(ref: str) -> Callable[[], Model]:
    """Import ``package.module:attr.path`` and return the object it names."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ModelError(f"Model {ref!r}: write a factory as 'package.module:function', e.g. 'mymodels:small_lm'.")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ModelError(
            f"Model {ref!r}: cannot import module {module_name!r} ({e}). Fix: install the package, or run from "
            "the directory that holds it (or add it to PYTHONPATH)."
        ) from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelError(f"Model {ref!r}: module {module_name!r} has no attribute {attr!r}; check the name.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelError(f"Model {ref!r} names {short_repr(obj)}, which is not callable; name a factory function.")
    return obj


def build_model(factory: Callable[[], Model], label: str) -> Model:
    """Call a factory and check that it returned a :class:`Model`."""
    model = factory()
    if not isinstance(model, Model):
        raise ModelError(
            f"Model factory {label} returned {short_repr(model)} ({type(model).__name__}), not a shardkit Model. "
            "Fix: return sk.from_nnx(lambda rngs: MyModel(..., rngs=rngs)) or sk.from_linen(module, example_input)."
        )
    return model
