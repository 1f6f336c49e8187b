"""YAML files under configs/ loaded into frozen dataclasses, with errors that name the field."""
from __future__ import annotations

import dataclasses
import pathlib
import types
import typing
from typing import Any, TypeVar

import yaml

from talaria_jax import configs

T = TypeVar("T")

# The shipped configuration files: the package talaria_jax.configs (configs/ in the source tree).
CONFIG_DIR = pathlib.Path(configs.__file__).resolve().parent


class ConfigError(ValueError):
    """A config file or dict that does not fit its dataclass; the message names the field."""


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for a in inner[:-1]:  # the first of the union's types the value is
            try:
                return _coerce(a, value, where)
            except ConfigError:
                pass
        return _coerce(inner[-1], value, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        return from_dict(tp, value, where)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        elem = args[0] if args else Any
        return tuple(_coerce(elem, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # PyYAML reads "8.03e9" (no sign in the exponent) as a string
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if tp in (int, str, bool) and not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


def from_dict(cls: type[T], data: dict, where: str | None = None) -> T:
    """Builds dataclass `cls` from a mapping; unknown or missing fields raise ConfigError naming them."""
    where = where or cls.__name__
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown}; known: {sorted(fields)}")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _coerce(hints[name], data[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}: missing required field {name!r}")
    return cls(**kwargs)


def load_yaml(cls: type[T], path: str | pathlib.Path) -> T:
    path = pathlib.Path(path)
    with open(path) as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return from_dict(cls, data, where=str(path.name))


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)
