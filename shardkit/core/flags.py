"""A config is declared once, as a frozen dataclass whose fields carry their help and choices;
the command-line flags, a TOML config file with ``key=value`` overrides, and the argv for a
subprocess are all generated from it. Imports no JAX, so ``shardkit --help`` answers at once.

A field becomes the flag ``--field-name`` (or ``metadata["flag"]``). Its type gives the parser:
``int``/``float``/``str`` (``| None`` allowed), ``bool`` (a switch; ``negate=True`` makes the
flag store False), ``tuple[int, ...]`` and ``tuple[str, ...]`` (a comma list, or a repeated flag
with ``repeat=True``).

Example:
  >>> import argparse, dataclasses
  >>> @dataclasses.dataclass(frozen=True)
  ... class Job:
  ...     steps: int = setting(10, "steps to run")
  ...     sizes: tuple[int, ...] = setting((1, 2), "sizes to try")
  >>> parser = argparse.ArgumentParser()
  >>> add_flags(parser, Job)
  >>> config_from(Job, parser.parse_args(["--steps", "3", "--sizes", "4,8"]))
  Job(steps=3, sizes=(4, 8))
  >>> to_argv(Job(steps=3))
  ['--steps', '3']
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import pathlib
import tomllib
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from shardkit.core.errors import InputError


def setting(
    default: Any,
    help: str,
    *,
    choices: Sequence[str] | None = None,
    flag: str | None = None,
    negate: bool = False,
    repeat: bool = False,
    zero_is_none: bool = False,
) -> Any:
    """A dataclass field that is also a command-line flag.

    Args:
      default: the field's default (a tuple for sequences: fields are frozen).
      help: the flag's help text.
      choices: the values the flag accepts.
      flag: the flag's name when it is not ``--field-name``.
      negate: for a bool defaulting to True, a switch that sets it False (``--unrolled``).
      repeat: for ``tuple[str, ...]``, one value per repeated flag instead of a comma list.
      zero_is_none: for ``int | None``, 0 on the command line means None ("all").
    """
    meta: dict[str, object] = {"help": help, "choices": tuple(choices) if choices else None, "flag": flag}
    meta |= {"negate": negate, "repeat": repeat, "zero_is_none": zero_is_none}
    return dataclasses.field(default=default, metadata=meta)


def same_as(owner: type, name: str, default: Any = dataclasses.MISSING, **changes: Any) -> Any:
    """A field with the help and choices of ``owner``'s field ``name`` (one meaning wherever a
    setting appears), with its own default if given."""
    field = next(f for f in dataclasses.fields(owner) if f.name == name)
    meta = {**field.metadata, **changes}
    return dataclasses.field(default=field.default if default is dataclasses.MISSING else default, metadata=meta)


def flag_of(field: dataclasses.Field) -> str:
    """The command-line flag of a config field."""
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def _base(hint: Any) -> tuple[Any, bool]:
    """``(type without None, whether None is allowed)``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


def _parse_list(item: Callable[[str], Any], name: str) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        try:
            return tuple(item(part.strip()) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: give a comma list, e.g. 1,2,4; got {text!r}") from None

    return parse


def _converter(field: dataclasses.Field, hint: Any) -> Callable[[str], Any]:
    """str -> the field's value, for flags and ``key=value`` overrides."""
    base, _ = _base(hint)
    if typing.get_origin(base) is tuple:
        return _parse_list(typing.get_args(base)[0], flag_of(field))
    if base is bool:
        return _parse_bool
    return base


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r} (use true or false)")


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    only: Iterable[str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Add one flag per field of the dataclass ``cls`` (``only``: just these fields;
    ``overrides``: extra ``add_argument`` keywords per field name, e.g. ``required=True``, and
    ``aliases``: more option strings for it)."""
    hints, overrides = typing.get_type_hints(cls), overrides or {}
    chosen = None if only is None else set(only)
    for field in dataclasses.fields(cls):
        if (chosen is not None and field.name not in chosen) or "help" not in field.metadata:
            continue
        meta = field.metadata
        help_text = meta["help"].replace("%", "%%")  # argparse formats help with %
        kwargs: dict[str, Any] = {"dest": field.name, "default": field.default, "help": help_text}
        base, _ = _base(hints[field.name])
        if base is bool:
            kwargs["action"] = "store_false" if meta["negate"] else "store_true"
        elif meta["repeat"]:
            kwargs |= {"action": "append", "metavar": "KEY", "default": list(field.default)}  # type: ignore[arg-type]
        else:
            kwargs["type"] = _converter(field, hints[field.name])
            if meta["choices"]:
                kwargs["choices"] = meta["choices"]
            if typing.get_origin(base) is tuple and field.default is not None:
                kwargs["default"] = ",".join(str(v) for v in field.default)  # type: ignore[union-attr]  # shown in --help
        extra = dict(overrides.get(field.name, {}))
        parser.add_argument(flag_of(field), *extra.pop("aliases", ()), **{**kwargs, **extra})


def config_from(cls: type, args: argparse.Namespace, **extra: Any) -> Any:
    """The ``cls`` config of parsed flags (fields absent from ``args`` keep their default)."""
    values: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if not hasattr(args, field.name):
            continue
        value = getattr(args, field.name)
        if isinstance(value, str) and typing.get_origin(_base(hints[field.name])[0]) is tuple:
            value = _converter(field, hints[field.name])(value)  # argparse leaves a default string as is
        if isinstance(value, list):
            value = tuple(value)
        if field.metadata.get("zero_is_none") and value == 0:
            value = None
        values[field.name] = value
    return cls(**values, **extra)


def to_argv(config: Any) -> list[str]:
    """Flags that rebuild ``config`` (only those that differ from the defaults)."""
    argv: list[str] = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if "help" not in field.metadata or value == field.default:
            continue
        flag = flag_of(field)
        if isinstance(value, bool):
            argv.append(flag)  # a switch differs from its default only when given
        elif field.metadata["repeat"]:
            argv += [part for v in value for part in (flag, str(v))]
        elif isinstance(value, tuple):
            argv += [flag, ",".join(str(v) for v in value)]
        elif value is None and field.metadata["zero_is_none"]:
            argv += [flag, "0"]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def file_values(cls: type, path: str | None, assignments: Sequence[str]) -> dict[str, Any]:
    """Field values from a TOML file and ``key=value`` overrides (the overrides win), checked
    against ``cls``'s fields before anything runs.

    Keys are field names (``weight_decay``) or flag names (``weight-decay``); the TOML file is flat
    (``lr = 1e-3``, ``layout = "fsdp=8"``).

    Raises:
      InputError: an unreadable file, an unknown key, or a value of the wrong type.
    """
    fields = {f.name: f for f in dataclasses.fields(cls) if "help" in f.metadata}
    hints = typing.get_type_hints(cls)
    raw: dict[str, Any] = {}
    if path is not None:
        raw |= _read_toml(path)
    for text in assignments:
        key, sep, value = text.partition("=")
        if not sep or not key.strip():
            raise InputError(f"{text!r}: write overrides as key=value, e.g. lr=1e-3 or layout=fsdp=8.")
        raw[key.strip()] = value.strip()
    values = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in fields:
            close = difflib.get_close_matches(name, sorted(fields), n=1)
            hint = f" Did you mean {close[0]}?" if close else f" Settings: {', '.join(sorted(fields))}."
            raise InputError(f"{key!r} in the config is not a setting.{hint}")
        values[name] = _value_for(fields[name], hints[name], key, value)
    return values


def _read_toml(path: str) -> dict[str, Any]:
    file = pathlib.Path(path)
    if not file.is_file():
        raise InputError(f"--config {path}: no such file. Give a TOML file of settings, e.g. `lr = 1e-3`.")
    try:
        data = tomllib.loads(file.read_text())
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"--config {path} is not valid TOML: {e}. Write one `key = value` per line.") from None
    nested = [k for k, v in data.items() if isinstance(v, dict)]
    if nested:
        raise InputError(f"--config {path}: tables ([{nested[0]}]) are not settings; keep the file flat.")
    return data


def _value_for(field: dataclasses.Field, hint: Any, key: str, value: Any) -> Any:
    """A TOML value or an override's text as the field's type."""
    base, optional = _base(hint)
    if isinstance(value, str) and not (base is str and typing.get_origin(base) is not tuple):
        if optional and value.lower() in ("none", ""):
            return None
        try:
            value = _converter(field, hint)(value)
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise InputError(f"{key}={value!r}: {e}; {flag_of(field)} takes a {_type_name(base)}.") from None
    if typing.get_origin(base) is tuple and isinstance(value, list):
        value = tuple(value)
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    expected = tuple if typing.get_origin(base) is tuple else base
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise InputError(f"{key} = {value!r}: {flag_of(field)} takes a {_type_name(base)}.")
    if field.metadata["choices"] and value not in field.metadata["choices"]:
        raise InputError(f"{key} = {value!r} is not one of {', '.join(field.metadata['choices'])}.")
    return value


def _type_name(base: Any) -> str:
    if typing.get_origin(base) is tuple:
        return "list (a comma list on the command line)"
    return {int: "whole number", float: "number", str: "string", bool: "true/false"}.get(base, str(base))
