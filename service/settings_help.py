"""The settings explained, from their declarations (backend.setting): the flags of `tokenspout serve
--help`, grouped as docs/configuration.md groups them, and that page's tables, which
tests/service/test_settings_help.py holds equal to these (`python -m service.settings_help` rewrites
them)."""

from __future__ import annotations

import argparse
import enum
import pathlib
import re
import sys
from collections.abc import Iterable

from backend import Group
from service.config import ENV_PREFIX, SETTINGS, Setting

CONFIGURATION_PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
TABLE_MARK = "<!-- settings: {group} (generated from the settings' declarations: python -m service.settings_help) -->"
_TABLE_HEAD = ("| setting (file key) | flag | environment | values | default | meaning |\n"
               "|---|---|---|---|---|---|\n")
_KIND_VALUES = {bool: "`true` or `false`", int: "an integer", float: "a number", str: "text"}
_METAVARS = {int: "N", float: "X", str: "TEXT"}


def flag(setting: Setting) -> str:
    return "--" + setting.name.replace("_", "-")


def environment_variable(setting: Setting) -> str:
    return ENV_PREFIX + setting.name.upper()


def values(setting: Setting) -> str:
    """The values a setting takes, in Markdown: a closed set lists itself, others say their form."""
    kind = setting.kind
    if setting.help.values:
        return setting.help.values
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        listed = [f"`{member.value}`" for member in kind]
        return f"{', '.join(listed[:-1])} or {listed[-1]}"
    return _KIND_VALUES.get(kind, "text")


def default(setting: Setting) -> str:
    """The default as an operator writes it, in Markdown (never a Python repr)."""
    if setting.help.default:
        return setting.help.default
    value = setting.default
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, enum.Enum):
        return f"`{value.value}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    if isinstance(value, tuple):
        return f"`{','.join(str(item) for item in value)}`" if value else "none"
    return f"`{value}`" if value != "" else "none"


def plain(markdown: str) -> str:
    """Text for a terminal: links as their words, no code marks."""
    return re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", markdown).replace("`", "")


def in_group(group: Group) -> list[Setting]:
    return [setting for setting in SETTINGS.values() if setting.help.group is group]


# -- serve --help ---------------------------------------------------------------------------------------------


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, in its group. Values stay text: load_config parses every source alike."""
    for group in Group:
        section = parser.add_argument_group(group.value)
        for setting in in_group(group):
            help_text = (f"{plain(setting.help.text)} Values: {plain(values(setting))}. "
                         f"Default: {plain(default(setting))}.").replace("%", "%%")
            if setting.kind is bool:  # `--flag` alone means true; `--flag false` is false
                section.add_argument(flag(setting), dest=setting.name, nargs="?", const="true", default=None,
                                     metavar="true|false", help=help_text)
            else:
                section.add_argument(flag(setting), dest=setting.name, default=None, metavar=_metavar(setting),
                                     help=help_text)


def _metavar(setting: Setting) -> str:
    kind = setting.kind
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return "{" + ",".join(str(member.value) for member in kind) + "}"
    return _METAVARS.get(kind, "LIST")


# -- docs/configuration.md ------------------------------------------------------------------------------------


def markdown_table(group: Group) -> str:
    rows = [
        f"| `{s.name}` | `{flag(s)}` | `{environment_variable(s)}` | {values(s)} | {default(s)} | {s.help.text} |\n"
        for s in in_group(group)
    ]
    return _TABLE_HEAD + "".join(rows)


def with_tables(page: str, groups: Iterable[Group] = Group) -> str:
    """The page with each group's table (the one after its mark) made from the settings."""
    for group in groups:
        mark = TABLE_MARK.format(group=group.value)
        if mark not in page:
            raise ValueError(f"{CONFIGURATION_PAGE.name} has no table mark for {group.value!r}: {mark}")
        before, _, after = page.partition(mark + "\n")
        old_table = re.match(r"(\|.*\n)*", after)
        assert old_table is not None  # the pattern matches the empty string too
        page = before + mark + "\n" + markdown_table(group) + after[old_table.end():]
    return page


if __name__ == "__main__":
    CONFIGURATION_PAGE.write_text(with_tables(CONFIGURATION_PAGE.read_text()))
    print(f"{CONFIGURATION_PAGE}: {len(SETTINGS)} settings in {len(Group)} tables", file=sys.stderr)
