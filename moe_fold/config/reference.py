"""The configuration reference (docs/configuration.md), generated from the dataclasses of
schema.py: each field's type, default and comment, so the docs cannot drift from the code
(``python -m moe_fold.config --reference > docs/configuration.md``)."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any, Literal, Union

from .schema import SECTIONS, _field_types, _fmt


def field_comments(cls: type) -> dict[str, str]:
    """Each field of the config dataclass ``cls`` -> the comment that documents it: the
    comment lines just above it (the source is the documentation)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    comments: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("#").strip())
            continue
        name = text.partition(":")[0]
        if name in fields and above:
            comments[name] = " ".join(above)
        above = []
    return comments


def _type_doc(tp: Any) -> str:
    """A field type as the reference shows it: choices spelled out, Optional as "or null"."""
    if typing.get_origin(tp) is Literal:
        return " \\| ".join(f"`{v}`" for v in typing.get_args(tp))
    if typing.get_origin(tp) is Union:
        return " or ".join(_type_doc(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list of {_type_doc(typing.get_args(tp)[0])}"
    return "null" if tp is type(None) else tp.__name__


def _default_doc(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return f"`{_fmt(value)}`"


def reference_markdown() -> str:
    """docs/configuration.md: one section per config dataclass, one row per field."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from the dataclasses of moe_fold/config/schema.py by",
        "     `python -m moe_fold.config --reference > docs/configuration.md`: edit the field",
        "     comments there; tests/config/test_reference.py fails when this file differs. -->",
        "",
        "A run is configured by a YAML file or preset (`--config`) of `section: {key: value}`",
        "mappings, then `--set section.key=value` overrides. Loading checks each value's type;",
        "`validate()` then checks the rules between keys and the world size, and lists every",
        "problem (field, value, rule) before any rank starts. A key with choices takes exactly",
        "one of the values listed.",
        "",
    ]
    for name, cls in SECTIONS.items():
        doc = inspect.cleandoc(cls.__doc__ or "")
        lines += [f"## {name}", "", doc, "", "| key | type | default | description |", "| --- | --- | --- | --- |"]
        comments = field_comments(cls)
        types = _field_types(cls)
        for f in dataclasses.fields(cls):
            text = comments.get(f.name, "").replace("|", "\\|")
            lines.append(f"| `{name}.{f.name}` | {_type_doc(types[f.name])} | {_default_doc(f)} | {text} |")
        lines.append("")
    return "\n".join(lines)
