"""What an operator reads about a setting, declared on the setting's own field: `tokenspout serve --help`
and the tables of docs/configuration.md are both made from it (service.settings_help), so a new setting
is documented where it is declared, and the two cannot say different things."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, TypeVar

_Value = TypeVar("_Value")


class Group(enum.Enum):
    """The sections of docs/configuration.md and of `serve --help`, in their order."""

    SERVER = "Server and model"
    LLAMA_CPP = "llama.cpp"
    CACHE_EVENTS = "Cache events"
    EXLLAMAV2 = "exllamav2"
    EXLLAMAV3 = "exllamav3"
    SPECULATION = "Speculative decoding"
    SCHEDULING = "Scheduling and fair sharing"
    STREAMS = "Streams and input"
    CONSTRAINTS = "Constraints"
    SECURITY = "Security"
    TOOLS = "Tool calls and reasoning"
    TELEMETRY = "Logs and telemetry"


@dataclass(frozen=True)
class SettingHelp:
    text: str
    """What the setting does (Markdown: the docs show it as written, --help without the markup)."""
    group: Group
    values: str = ""
    """The values it takes, where its type alone does not say (a range, a form); a closed set lists itself."""
    default: str = ""
    """The default in words, where the value alone does not say it (`""` standing for "the model's name")."""


def setting(default: _Value, text: str, group: Group, *, values: str = "", shown_default: str = "",
            name: str = "") -> _Value:
    """A settings dataclass field with its help; `name` when the flat setting name is not the field's."""
    metadata: dict[str, Any] = {"help": SettingHelp(text, group, values, shown_default)}
    if name:
        metadata["setting"] = name
    # The Field object stands in for the value, as dataclasses.field's own does.
    found: _Value = field(default=default, metadata=metadata)
    return found
