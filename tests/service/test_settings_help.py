"""`tokenspout serve --help` and docs/configuration.md, both made from the settings' declarations: every
setting explained (meaning, values, a default as an operator writes it) in its group, the page's tables
equal to what the declarations say, and a mistyped flag answered with serve's own usage."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from backend import Group, setting
from service import settings_help
from service.config import SETTINGS, _settings

PAGE = settings_help.CONFIGURATION_PAGE


def serve_help() -> str:
    result = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--help"], capture_output=True, text=True,
                            timeout=60, env={"COLUMNS": "200", "PATH": ""})
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_page_tables_are_the_declarations():
    page = PAGE.read_text()
    assert settings_help.with_tables(page) == page, "run `python -m service.settings_help` to rewrite the tables"


def test_the_page_has_a_section_per_group_in_order_and_lists_every_setting_once():
    page = PAGE.read_text()
    headings = re.findall(r"^## (.+)$", page, re.MULTILINE)
    assert [h for h in headings if h in {g.value for g in Group}] == [g.value for g in Group]
    listed = re.findall(r"^\| `(\w+)` \| `--", page, re.MULTILINE)
    assert sorted(listed) == sorted(SETTINGS)


def test_serve_help_explains_every_setting_in_its_group():
    text = serve_help()
    sections = dict(re.findall(r"^(\S[^\n]*):\n((?:  .*\n?)*)", text, re.MULTILINE))
    assert [title for title in sections if title in {g.value for g in Group}] == [g.value for g in Group]
    for name, one in SETTINGS.items():
        section = sections[one.help.group.value]
        entry = re.search(rf"^  {settings_help.flag(one)}(?= ).*?(?=^  --|\Z)", section, re.MULTILINE | re.DOTALL)
        assert entry, f"{name} is not under {one.help.group.value}"
        words = " ".join(entry.group(0).split())
        assert settings_help.plain(one.help.text).split()[0] in words
        assert "Values: " in words and "Default: " in words, words
    assert not re.search(r"<\w+\.\w+: |\(\)|Default: \.", text), "a Python repr or an empty default"
    assert "--engine {llama.cpp,exllamav2,exllamav3}" in text and "Default: the host of listen." in text
    assert "--prefix-cache [true|false]" in text


def test_defaults_read_as_an_operator_writes_them():
    shown = {name: settings_help.default(one) for name, one in SETTINGS.items()}
    assert shown["engine"] == "`llama.cpp`" and shown["prefix_cache"] == "`true`"
    assert shown["grace_period_s"] == "`30`" and shown["priority_callers"] == "`*`"
    assert shown["api_keys"] == "none" and shown["gpu_split"] == "all GPUs in order"
    assert settings_help.values(SETTINGS["cache_type"]) == "`fp16`, `q8`, `q6` or `q4`"


def test_a_setting_without_help_does_not_load():
    @dataclasses.dataclass(frozen=True)
    class Section:
        explained: int = setting(1, "Explained.", Group.SERVER)
        bare: int = 2

    with pytest.raises(AssertionError, match="setting bare has no help"):
        _settings(Section)


def test_a_mistyped_flag_gets_serves_usage_and_the_flags_it_may_mean():
    result = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--max-batch", "4"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("usage: tokenspout serve [--config FILE]"), result.stderr
    assert "unrecognized arguments: --max-batch (did you mean --max-batch-size" in result.stderr
    # An abbreviation is a mistake too: a flag added later would make it mean something else.
    abbreviated = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--context-len", "64"],
                                 capture_output=True, text=True, timeout=60)
    assert abbreviated.returncode == 2 and "did you mean --context-length" in abbreviated.stderr
