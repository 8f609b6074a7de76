"""Typed configuration: dataclass defaults, then a YAML file, then `key=value` overrides.

    cfg = load_config(TrainConfig, "configs/tiny.yaml", ["optim.lr=1e-3", "train.manifests=[a.jsonl]"])

Nested dataclass fields are YAML sections and dotted keys on the command line. Override values
are parsed as YAML, so lists and mappings work (`train.manifests=[{path: a.jsonl, weight: 2}]`).
Unknown keys and values of the wrong type are errors that name the key.
"""

import dataclasses
import types
import typing
from typing import Any

import yaml


class ConfigError(ValueError):
    pass


def _check(value: Any, hint: Any, key: str) -> Any:
    """Return `value` converted to `hint` (int -> float only), or raise ConfigError naming `key`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return from_dict(hint, value, prefix=f"{key}.")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        item = args[0] if args else Any
        out = [_check(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{key}: expected float, got {value!r}") from None
    if hint is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if isinstance(hint, type) and not isinstance(value, hint) or (
            hint is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {hint.__name__}, got {value!r}")
    return value


def from_dict(cls, d: dict, prefix: str = ""):
    """Build dataclass `cls` from a (possibly partial) mapping, checking names and types."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(prefix + k for k in unknown)}; "
                          f"valid keys here: {', '.join(sorted(names))}")
    return cls(**{k: _check(v, hints[k], prefix + k) for k, v in d.items()})


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _set_dotted(d: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(f"{dotted}: '{p}' is not a section")
    d[last] = value


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(cls, yaml_path: str | None = None, overrides: list[str] = ()):
    """Defaults < YAML file < `key=value` overrides, validated against dataclass `cls`."""
    d = dataclasses.asdict(cls())
    if yaml_path:
        with open(yaml_path, encoding="utf-8") as f:
            from_file = yaml.safe_load(f) or {}
        if not isinstance(from_file, dict):
            raise ConfigError(f"{yaml_path}: expected a mapping at the top level")
        d = _merge(d, from_file)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        _set_dotted(d, key.strip(), yaml.safe_load(raw) if raw.strip() else "")
    return from_dict(cls, d)
