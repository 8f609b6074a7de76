"""Typed dataclass configs: dataclass defaults, then YAML files, then `key=value` overrides.

    cfg = load_config(RunConfig, "run.yaml", ["optim.lr=1e-3", "manifests=[a.jsonl]"])
    cfg = load_config(RunConfig, ["base.yaml", "more.yaml"])   # later files win

Nested dataclass fields are YAML sections and dotted keys on the command line. Override values
are parsed as YAML, so lists and mappings work (`manifests=[{path: a.jsonl, weight: 2}]`).
Unknown keys and values of the wrong type are errors that name the key; a key a dataclass has
renamed (its `RENAMED`) names the new one, while `renamed` reads a saved config's old keys as the
new ones. Each field's trailing comment, or its metadata["help"] where it has one, is its
description (`describe`), so the text next to the default is the one place a key is documented.

Imports nothing from `aed`: the modules whose dataclasses it loads (aed/model.py, aed/train_config.py)
import it.
"""

import dataclasses
import inspect
import io
import os
import re
import textwrap
import tokenize
import types
import typing
from typing import Any

import yaml


class ConfigError(ValueError):
    pass


# --- loading and checking -----------------------------------------------------------------------


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
    """Build dataclass `cls` from a (possibly partial) mapping, checking names and types. A key the
    class has renamed (its RENAMED: {old: new}) is an error that names the new key."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    renamed = getattr(cls, "RENAMED", {})
    old = sorted(set(d) & set(renamed))
    if old:
        raise ConfigError("; ".join(f"{prefix}{k} is now {prefix}{renamed[k]}" for k in old))
    unknown = sorted(set(d) - names)
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(prefix + k for k in unknown)}; "
                          f"valid keys here: {', '.join(sorted(names))}")
    values = {k: _check(v, hints[k], prefix + k) for k, v in d.items()}
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (AssertionError, ValueError) as e:  # the dataclass's own checks of its values
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {e}") from None


def renamed(cls, d: dict) -> dict:
    """Mapping `d` of dataclass `cls` with the keys that it, or a section of it, has renamed (RENAMED)
    under their new names: what a checkpoint saved before the rename holds, read as today's."""
    hints, out = typing.get_type_hints(cls), {}
    for k, v in d.items():
        if isinstance(v, dict) and dataclasses.is_dataclass(hints.get(k)):
            v = renamed(hints[k], v)
        new = {}
        _set_dotted(new, getattr(cls, "RENAMED", {}).get(k, k), v)
        out = _merge(out, new)
    return out


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


def user_dict(yaml_path: str | os.PathLike | list | None, overrides: list[str]) -> dict:
    """What the YAML file(s) and the overrides set, merged in order, without defaults."""
    d = {}
    for path in [yaml_path] if isinstance(yaml_path, (str, os.PathLike)) else yaml_path or []:
        try:
            with open(path, encoding="utf-8") as f:
                part = yaml.safe_load(f) or {}
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config file ({e.strerror})") from None
        if not isinstance(part, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        d = _merge(d, part)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        _set_dotted(d, key.strip(), yaml.safe_load(raw) if raw.strip() else "")
    return d


def dotted_keys(d: dict, prefix: str = "") -> set:
    """Every key of nested mapping `d`, sections included, as "section.key"."""
    keys = set()
    for k, v in d.items():
        keys.add(prefix + k)
        if isinstance(v, dict):
            keys |= dotted_keys(v, f"{prefix}{k}.")
    return keys


def merged_dict(cls, yaml_path: str | list[str] | None = None, overrides: list[str] = ()) -> dict:
    return _merge(dataclasses.asdict(cls()), user_dict(yaml_path, overrides))


def load_config(cls, yaml_path: str | list[str] | None = None, overrides: list[str] = ()):
    """Defaults < YAML file(s) < `key=value` overrides, validated against dataclass `cls`."""
    return from_dict(cls, merged_dict(cls, yaml_path, overrides))


# --- documentation ------------------------------------------------------------------------------


def _field_comments(cls) -> dict:
    """{field name: its trailing comment} read from the dataclass's source."""
    comments, names = {}, {}
    source = inspect.getsource(cls)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    for lineno, line in enumerate(source.splitlines(), 1):
        m = re.match(r"\s+(\w+)\s*:\s*[^=]+=", line)
        if m and lineno in comments:
            names[m.group(1)] = comments[lineno]
    return names


def describe(cls, notes: dict | None = None, defaults=None, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) for every leaf field of dataclass `cls`;
    `notes` {dotted key: text} puts "(text) " before a key's description."""
    notes = notes or {}
    defaults = defaults if defaults is not None else cls()
    hints, comments, rows = typing.get_type_hints(cls), _field_comments(cls), []
    for f in dataclasses.fields(cls):
        value, hint = getattr(defaults, f.name), hints[f.name]
        if dataclasses.is_dataclass(hint):
            rows += describe(hint, notes, value, f"{prefix}{f.name}.")
            continue
        key = prefix + f.name
        note = f"({notes[key]}) " if key in notes else ""
        type_name = re.sub(r"\btyping\.|<class '(\w+)'>", r"\1", str(hint))
        rows.append((key, type_name, repr(value), note + f.metadata.get("help", comments.get(f.name, ""))))
    return rows


def help_table(rows: list[tuple[str, str, str, str]]) -> str:
    """`describe`'s rows as text: "key  type = default" over its description, a blank line
    between sections."""
    width = max(len(k) for k, *_ in rows)
    indent = " " * (width + 4)
    lines = []
    for key, type_name, default, text in rows:
        section = key.rsplit(".", 1)[0] if "." in key else ""
        if lines and section != lines[-1][0]:
            lines.append((section, ""))
        wrapped = textwrap.fill(text, 100, initial_indent=indent, subsequent_indent=indent)
        lines.append((section, f"  {key:<{width}}  {type_name} = {default}\n{wrapped}"))
    return "\n".join(line for _, line in lines)
