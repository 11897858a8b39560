"""Typed configs from plain mappings: every key checked, errors name the dotted path.

Dependency-free on purpose: heads and the inference module use it without the trainer's stack.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config that does not fit its schema; the message names the dotted path."""


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from a mapping, checking every key and type; errors name the path."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'recipe'}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        raise ConfigError(f"unknown key '{where}'; allowed: {', '.join(sorted(fields))}")
    missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"missing key '{_join(path, missing[0])}' (required)")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _convert(hints[name], value, _join(path, name)) for name, value in data.items()}
    return cls(**kwargs)


def _join(path: str, name: str | int) -> str:
    return f"{path}[{name}]" if isinstance(name, int) else (f"{path}.{name}" if path else name)


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} fits none of {tp}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
            return tuple(_convert(a, v, _join(path, i)) for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        out = [_convert(item, v, _join(path, i)) for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {value!r}")
        return value
    if tp in (int, str):
        if not isinstance(value, tp) or isinstance(value, bool):
            raise ConfigError(f"{path}: expected {tp.__name__}, got {value!r}")
        return value
    return value


# ---------------------------------------------------------------------------------------------
# Files and overrides
# ---------------------------------------------------------------------------------------------
def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=c` -> (["a", "b"], c) with c parsed as YAML (numbers, booleans, lists, null)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.path=value")
    key, raw = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw) if raw != "" else ""


def apply_override(data: dict, keys: list[str], value: Any) -> None:
    node = data
    for i, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {'.'.join(keys)}: {'.'.join(keys[:i + 1])} is not a mapping")
        node = child
    node[keys[-1]] = value


