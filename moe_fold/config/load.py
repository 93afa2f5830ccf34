"""Loading a config: a YAML file or preset, then ``--set section.field=value`` overrides,
each value checked against its field's type; and writing one back as YAML.

Rules between fields are checked by ``validate`` (rules/), which needs the world size.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from .schema import SECTIONS, Config, ConfigError, _field_types


def presets_dir() -> Path:
    """The folder of preset YAML files installed with ``moe_fold.models``."""
    # find_spec locates the package without running its __init__ (which imports torch).
    spec = importlib.util.find_spec("moe_fold.models")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("cannot locate the moe_fold.models package to read presets; is moe-fold installed?")
    return Path(next(iter(spec.submodule_search_locations))) / "presets"


def list_presets() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.yaml"))


def resolve_source(source: str | os.PathLike) -> Path:
    """A YAML path as given, or the file of the preset named ``source``."""
    source = os.fspath(source)
    path = Path(source)
    if path.is_file():
        return path
    if path.suffix in (".yaml", ".yml") or os.sep in source or "/" in source:
        raise ConfigError(f"config file not found: {source}")
    preset = presets_dir() / f"{source}.yaml"
    if preset.is_file():
        return preset
    names = list_presets()
    close = difflib.get_close_matches(source, names, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    available = ", ".join(names) if names else "none"
    raise ConfigError(f"unknown preset '{source}'; {hint}available presets: {available} (in {presets_dir()})")


def load_config(source: str | os.PathLike | None = None, overrides: list[str] = ()) -> Config:
    """Build a Config from a YAML file or preset name (None: defaults), then apply
    ``section.field=value`` overrides in order. Types are checked here; cross-field
    rules are checked by ``validate``, which needs the world size."""
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of section.field=value strings, got the string {overrides!r}")
    data: dict = {}
    if source is not None:
        path = resolve_source(source)
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"cannot parse {path} as YAML: {e}") from e
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must map section names to sections, got {type(data).__name__}")
    config = config_from_dict(data)
    problems = [p for text in overrides for p in _apply_override(config, text)]
    if problems:
        raise ConfigError(problems)
    return config


def config_from_dict(data: dict) -> Config:
    """A Config from ``{section: {field: value}}``; missing keys keep their defaults."""
    problems: list[str] = []
    sections = {}
    for name, section in data.items():
        if name not in SECTIONS:
            problems.append(_unknown(f"{name}", list(SECTIONS), "section"))
        elif section is not None and not isinstance(section, dict):
            problems.append(f"section '{name}' must be a mapping of field: value, got {section!r}")
    for name, cls in SECTIONS.items():
        given = data.get(name) or {}
        if not isinstance(given, dict):
            continue
        hints = _field_types(cls)
        values = {}
        for key, value in given.items():
            dotted = f"{name}.{key}"
            if key not in hints:
                problems.append(_unknown(dotted, [f"{name}.{k}" for k in hints], "key"))
                continue
            converted = _coerce(value, hints[key])
            if converted is _MISMATCH:
                problems.append(_type_problem(dotted, value, hints[key]))
            else:
                values[key] = converted
        sections[name] = cls(**values)
    if problems:
        raise ConfigError(problems)
    return Config(**sections)


def _apply_override(config: Config, text: str) -> list[str]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    section, dot, name = key.partition(".")
    if not sep or not dot or not section or not name:
        return [f"override '{text}' must look like section.field=value"]
    known = [f"{s}.{f}" for s, cls in SECTIONS.items() for f in _field_types(cls)]
    if key not in known:
        return [_unknown(key, known, "key")]
    tp = _field_types(SECTIONS[section])[name]
    try:
        parsed = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        return [f"cannot parse the value of override '{text}' as YAML: {e}"]
    value = _coerce(parsed, tp)
    # A string field given a bare 123 or true on the command line means that text.
    if value is _MISMATCH and isinstance(parsed, (bool, int, float)):
        value = _coerce(raw, tp)
    if value is _MISMATCH:
        return [_type_problem(key, parsed, tp)]
    setattr(getattr(config, section), name, value)
    return []


def _unknown(dotted: str, candidates: list[str], what: str) -> str:
    close = difflib.get_close_matches(dotted, candidates, n=1)
    if close:
        return f"unknown config {what} '{dotted}'; did you mean '{close[0]}'?"
    section = dotted.partition(".")[0]
    if what == "key" and section in SECTIONS:
        return f"unknown config key '{dotted}'; {section} has: {', '.join(_field_types(SECTIONS[section]))}"
    return f"unknown config {what} '{dotted}'; sections are: {', '.join(SECTIONS)}"


_MISMATCH = object()


def _coerce(value: Any, tp: Any, parse_floats: bool = True) -> Any:
    """``value`` converted to the annotated type ``tp``, or ``_MISMATCH``.

    With ``parse_floats``, floats also accept strings because YAML 1.1 reads ``1e-3``
    (no dot) as a string. bool is never taken for int or float, nor int for bool."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        # Loading checks the type of a choice; validate() checks the value against the
        # choices (choice_problems), with the other rules.
        return _coerce(value, type(typing.get_args(tp)[0]), parse_floats)
    if origin is Union:
        for arm in typing.get_args(tp):
            out = _coerce(value, arm, parse_floats)
            if out is not _MISMATCH:
                return out
        return _MISMATCH
    if tp is type(None):
        return None if value is None else _MISMATCH
    if origin is list:
        if not isinstance(value, (list, tuple)):
            return _MISMATCH
        (item,) = typing.get_args(tp)
        out = [_coerce(v, item, parse_floats) for v in value]
        return _MISMATCH if any(o is _MISMATCH for o in out) else out
    if isinstance(value, bool):
        return value if tp is bool else _MISMATCH
    if tp is int:
        return value if isinstance(value, int) else _MISMATCH
    if tp is float:
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str) and parse_floats:
            try:
                return float(value)
            except ValueError:
                return _MISMATCH
        return _MISMATCH
    if tp in (str, bool):
        return value if isinstance(value, tp) else _MISMATCH
    raise TypeError(f"config field type {tp} is not supported by the loader")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return type(typing.get_args(tp)[0]).__name__
    if typing.get_origin(tp) is Union:
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    return "null" if tp is type(None) else tp.__name__


def _type_problem(dotted: str, value: Any, tp: Any) -> str:
    if value is None:
        return f"{dotted}=null is not allowed: expected {_type_name(tp)}"
    return f"{dotted}={value!r} has type {type(value).__name__}: expected {_type_name(tp)}"


# ---------------------------------------------------------------------------
# Writing.


def config_to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def dump_config(config: Config, path: str | os.PathLike) -> None:
    """Write the config as YAML that ``load_config(path)`` reads back to an equal Config."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
