"""The rule registry and what every rule module uses.

A rule that modules apply too is written once, as a function registered in ``RULES`` by
``@rule``: validate() checks the whole config before any rank starts, and a module built
from its own arguments (a test, a bench, a tool) checks them with the same function through
``require()``, so both paths raise one message from one definition. tests/config/test_rules.py
checks that validate() applies every one and that no module checks a config field by itself.
"""

from __future__ import annotations

import typing
from typing import Any, Callable, Literal, Optional, Union

from ..load import _MISMATCH, _coerce, _type_problem
from ..schema import SECTIONS, Config, ConfigError, _field_types, _fmt


RULES: dict[str, Callable[..., list[str]]] = {}


def rule(fn: Callable[..., list[str]]) -> Callable[..., list[str]]:
    """Register ``fn`` (the rule's inputs -> one message per problem found) in RULES."""
    RULES[fn.__name__] = fn
    return fn


def require(check: Callable[..., list[str]], *args: Any) -> None:
    """Raise ConfigError with what the registered rule ``check`` finds wrong with ``args``."""
    if RULES.get(check.__name__) is not check:
        raise TypeError(f"{check.__name__} is not a rule of moe_fold.config.RULES")
    problems = check(*args)
    if problems:
        raise ConfigError(problems)


def _literal_choices(tp: Any) -> Optional[tuple]:
    """The values of a ``Literal[...]`` type, also inside ``Optional[...]``; None for other types."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) is Union:
        for arm in typing.get_args(tp):
            if typing.get_origin(arm) is Literal:
                return typing.get_args(arm)
    return None


def choices(dotted: str) -> tuple:
    """The values the ``Literal`` field ``section.field`` allows, read from its type."""
    section, _, name = dotted.partition(".")
    allowed = _literal_choices(_field_types(SECTIONS[section]).get(name))
    if allowed is None:
        raise TypeError(f"config field {dotted} is not a Literal choice")
    return allowed


@rule
def choice(dotted: str, value: Any) -> list[str]:
    """``value`` is one of the choices of the ``Literal`` field ``dotted`` (or None where the
    field is Optional)."""
    allowed = choices(dotted)
    section, _, name = dotted.partition(".")
    if value is None and _coerce(None, _field_types(SECTIONS[section])[name]) is None:
        return []
    if isinstance(value, str) and value in allowed:
        return []
    return [f"{dotted}={_fmt(value)} must be one of {', '.join(allowed)}"]


def _choice_problems(config: Config) -> list[str]:
    """Every ``Literal`` field checked against the choices its type lists."""
    return [problem for name, cls in SECTIONS.items() for key, tp in _field_types(cls).items()
            if _literal_choices(tp) is not None
            for problem in choice(f"{name}.{key}", getattr(getattr(config, name), key))]


def _type_problems(config: Config) -> list[str]:
    problems = []
    for name, cls in SECTIONS.items():
        section = getattr(config, name)
        if not isinstance(section, cls):
            problems.append(f"config.{name} must be a {cls.__name__}, got {type(section).__name__}")
            continue
        for key, tp in _field_types(cls).items():
            value = getattr(section, key)
            if _coerce(value, tp, parse_floats=False) is _MISMATCH:
                problems.append(_type_problem(f"{name}.{key}", value, tp))
    return problems


def _at_least(out: list[str], dotted: str, value: float, low: float) -> bool:
    if not value >= low:  # also catches nan
        out.append(f"{dotted}={_fmt(value)} must be >= {low}")
        return False
    return True


def _minimum(dotted: str, value: float, low: float) -> list[str]:
    """A one-field rule: its problem when ``value`` is below ``low`` (none when it is not)."""
    out: list[str] = []
    _at_least(out, dotted, value, low)
    return out


def _positive(out: list[str], dotted: str, value: float) -> bool:
    if not value > 0:
        out.append(f"{dotted}={_fmt(value)} must be > 0")
        return False
    return True


def _divisible(out: list[str], a_name: str, a: int, b_name: str, b: int, why: str = "") -> None:
    if b >= 1 and a % b:
        out.append(f"{a_name}={a} is not divisible by {b_name}={b}{why}")
