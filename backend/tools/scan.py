"""Reading one tool call's JSON object as it streams in, character by character.

Only the object's outer level matters here: which key each top-level value belongs to, so the
call's name is known as soon as its string closes and its arguments can stream as they form.
Whether the whole object is valid JSON is decided once it closes (`json.loads`), not here.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field


class ScanError(ValueError):
    """The text cannot be (the start of) a call object."""


class _At(enum.Enum):
    BEFORE = "before"  # whitespace before the opening brace
    KEY = "key"  # expecting a key (or the closing brace)
    COLON = "colon"
    VALUE = "value"  # inside a top-level value
    AFTER_VALUE = "after_value"  # expecting , or }
    DONE = "done"


@dataclass
class CallScanner:
    arguments_key: str
    text: str = ""
    """Everything fed so far, from the opening brace on (leading whitespace dropped)."""
    values: dict[str, str] = field(default_factory=dict)
    """Raw text of each finished top-level value, by key."""
    current_key: str | None = None
    value_start: int = 0
    _at: _At = _At.BEFORE
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _key_start: int = -1

    @property
    def done(self) -> bool:
        return self._at is _At.DONE

    def feed(self, char: str) -> None:
        """Takes one character. Raises ScanError where no call object can continue this way."""
        if self._at is _At.BEFORE:
            if char.isspace():
                return
            if char != "{":
                raise ScanError(f"expected '{{', got {char!r}")
            self.text, self._at = "{", _At.KEY
            return
        if self._at is _At.DONE:
            raise ScanError("the object has ended")
        self.text += char
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                if self._at is _At.KEY:
                    self.current_key = json.loads(self.text[self._key_start :])
                    self._at = _At.COLON
                elif self._at is _At.VALUE and self._depth == 0:
                    self._end_value(len(self.text))
            return
        if self._at is _At.KEY:
            if char == '"':
                self._in_string, self._key_start = True, len(self.text) - 1
            elif char == "}" and not self.values:
                self._at = _At.DONE
            elif not char.isspace():
                raise ScanError(f"expected a key, got {char!r}")
        elif self._at is _At.COLON:
            if char == ":":
                self._at, self.value_start = _At.VALUE, len(self.text)
            elif not char.isspace():
                raise ScanError(f"expected ':', got {char!r}")
        elif self._at is _At.VALUE:
            self._in_value(char)
        elif self._at is _At.AFTER_VALUE:
            if char == ",":
                self._at = _At.KEY
            elif char == "}":
                self._at = _At.DONE
            elif not char.isspace():
                raise ScanError(f"expected ',' or '}}', got {char!r}")

    def _in_value(self, char: str) -> None:
        if char == '"':
            self._in_string = True
        elif char in "[{":
            self._depth += 1
        elif char in "]}":
            if self._depth == 0:  # a scalar value ended by the object's closing brace
                self._end_value(len(self.text) - 1)
                self._at = _At.DONE
                return
            self._depth -= 1
            if self._depth == 0:
                self._end_value(len(self.text))
        elif char == "," and self._depth == 0:
            self._end_value(len(self.text) - 1)
            self._at = _At.KEY

    def _end_value(self, end: int) -> None:
        assert self.current_key is not None
        if self.current_key in self.values:
            raise ScanError(f"key {self.current_key!r} given twice")
        self.values[self.current_key] = self.text[self.value_start : end].strip()
        if self._at is _At.VALUE:
            self._at = _At.AFTER_VALUE

    def name(self) -> str | None:
        """The call's name once its value has closed (ScanError when it is not a string)."""
        raw = self.values.get("name")
        if raw is None:
            return None
        name = json.loads(raw) if raw.startswith('"') else None
        if not isinstance(name, str):
            raise ScanError("the call's name is not a string")
        return name

    def arguments_so_far(self) -> str | None:
        """The arguments' text as far as it has streamed, trailing whitespace held back; None before they start."""
        if "arguments" in self.values or self.arguments_key in self.values:
            return self.values.get(self.arguments_key, self.values.get("arguments"))
        if self._at is _At.VALUE and self.current_key in (self.arguments_key, "arguments"):
            return self.text[self.value_start :].strip()
        return None

    def finished_call(self) -> tuple[str, str]:
        """The closed object's name and arguments (a JSON object, as written; "{}" when absent)."""
        try:
            whole = json.loads(self.text)
        except json.JSONDecodeError as exc:
            raise ScanError(f"the call is not valid JSON: {exc.msg}") from None
        name = whole.get("name")
        arguments = whole.get(self.arguments_key, whole.get("arguments", {}))
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise ScanError("a call needs a string name and an object of arguments")
        raw = self.values.get(self.arguments_key, self.values.get("arguments"))
        return name, raw if raw is not None else "{}"
