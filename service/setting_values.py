"""A setting's value from where it was written: text from a flag or an environment variable, parsed by the
setting's type (a bool is true/false/1/0/yes/no, nothing else; a closed set is one of its values), or a TOML
value, which must already have that type. Every mistake is one line naming the setting."""

from __future__ import annotations

import enum
from typing import Any

from service.caller_weights import CallerWeight, parse_weights
from service.keys import ApiKey, parse_keys

_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")
_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "text"}


def parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(f"{text!r} is not a boolean (use true/false, 1/0 or yes/no)")


def coerce(name: str, kind: Any, value: Any) -> Any:
    """A value from any source as its setting's type: text from a flag or variable is parsed, a TOML value
    must already have that type (see check_typed)."""
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            return kind(value.strip())
        except (AttributeError, ValueError):
            choices = [member.value for member in kind]
            raise ValueError(f"{name} must be {', '.join(choices[:-1])} or {choices[-1]}, not {value!r}") from None
    if kind == tuple[ApiKey, ...]:
        if not isinstance(value, str):
            raise ValueError(f"{name}: expected text, got {value!r}")
        return tuple(parse_keys(value.replace(",", "\n"), name))
    if kind == tuple[float, ...]:
        return _numbers(name, value)
    if kind == tuple[str, ...]:
        return _strings(name, value)
    if kind == tuple[CallerWeight, ...]:
        return parse_weights(_strings(name, value), name)
    try:
        if isinstance(value, str):
            if kind is bool:
                return parse_bool(value)
            return kind(value.strip()) if kind is not str else value
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}" if kind is bool else f"{name}: expected {_KIND_NAMES[kind]}, got {value!r}") from exc
    raise ValueError(f"{name}: expected {_KIND_NAMES[kind]}, got {value!r}")


def check_typed(name: str, kind: Any, value: Any, path: str) -> None:
    """A TOML value of a boolean or number setting must be one: a quoted "2" is refused, as TOML loaders
    that check types refuse it, rather than read as text the way a flag or variable is."""
    if kind in (bool, int, float) and isinstance(value, str):
        try:
            parsed = coerce(name, kind, value)
            written = str(parsed).lower() if kind is bool else value.strip()
            hint = f" (write {name} = {written}, without quotes)"
        except ValueError:
            hint = ""
        raise ValueError(f"{path}: {name} must be {_KIND_NAMES[kind]}, not the text {value!r}{hint}")


def _strings(name: str, value: Any) -> tuple[str, ...]:
    """Comma-separated text ("a,b"), or a TOML list of strings."""
    if isinstance(value, str):
        return tuple(item.strip() for item in value.split(",") if item.strip())
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise ValueError(f"{name}: expected comma-separated text or a list of strings, got {value!r}")


def _numbers(name: str, value: Any) -> tuple[float, ...]:
    """Comma-separated numbers ("20,24"), or a TOML list of them."""
    items = [item for item in value.split(",") if item.strip()] if isinstance(value, str) else value
    try:
        if not isinstance(items, list) or any(isinstance(item, bool) for item in items):
            raise ValueError
        return tuple(float(item) for item in items)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected comma-separated numbers, got {value!r}") from None
