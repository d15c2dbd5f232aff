"""Splitting a model's streamed output into answer text, reasoning and tool calls.

Text arrives in arbitrary pieces (a marker may be cut anywhere), so like the stop-sequence filter
(backend.common.text) the parser holds back any tail that could still become a marker, and text
never carries markup. A call streams as it forms (name first, then its arguments as they are
written) and is complete once its object closes and its end marker follows. Markup that turns
out not to be a call (bad JSON, an unknown tool, output cut off inside it) is given back as text
when that is known, never as a half call in `calls`.
"""

from __future__ import annotations

import enum
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field

from backend.tools.formats import ReasoningFormat, ToolFormat
from backend.tools.scan import CallScanner, ScanError

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class CallDelta:
    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass
class Parsed:
    """What one push made safe to send."""

    text: str = ""
    reasoning: str = ""
    deltas: list[CallDelta] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.text or self.reasoning or self.deltas or self.calls)


class _Mode(enum.Enum):
    TEXT = "text"
    REASONING = "reasoning"
    CALL = "call"  # inside one call's object (and, after it, its end marker)
    ARRAY = "array"  # between the calls of a Mistral array


@dataclass
class _Call:
    """The call being read: its markup so far (given back as text if it fails) and what was sent of it."""

    raw: str
    scanner: CallScanner
    index: int
    id: str
    named: bool = False
    sent_arguments: str = ""


class OutputParser:
    """One sample's output, pushed in order; `finish` at the end. Not thread-safe (one per stream)."""

    def __init__(
        self,
        tools: ToolFormat | None,
        reasoning: ReasoningFormat | None,
        tool_names: frozenset[str] = frozenset(),
        in_reasoning: bool = False,
        call_id: Callable[[], str] = new_call_id,
    ) -> None:
        self._format = tools
        self._reasoning = reasoning
        self._names = tool_names
        self._call_id = call_id
        self._mode = _Mode.REASONING if in_reasoning and reasoning else _Mode.TEXT
        self._pending = ""
        self._at_turn_start = True  # only whitespace (or finished calls) so far: a bare JSON call may begin
        self._strip_leading = False  # drop the blank line a model puts after reasoning or a call
        self._call: _Call | None = None
        self._array_raw = ""
        self.calls: list[ToolCall] = []

    @property
    def in_reasoning(self) -> bool:
        return self._mode is _Mode.REASONING

    def push(self, text: str) -> Parsed:
        out = Parsed()
        self._pending += text
        while self._pending and self._step(out):
            pass
        return out

    def finish(self) -> Parsed:
        """The end of output: held text goes out as what it is; an unfinished call goes back to text."""
        out = Parsed()
        if self._mode is _Mode.REASONING:
            out.reasoning += self._pending
        elif self._mode in (_Mode.CALL, _Mode.ARRAY):
            out.text += self._array_raw + (self._call.raw if self._call else "") + self._pending
        else:
            out.text += self._text_part(self._pending)
        self._pending, self._call, self._array_raw = "", None, ""
        return out

    # One step over the pending text: False when it must wait for more.
    def _step(self, out: Parsed) -> bool:
        if self._mode is _Mode.REASONING:
            return self._step_reasoning(out)
        if self._mode is _Mode.CALL:
            return self._step_call(out)
        if self._mode is _Mode.ARRAY:
            return self._step_array(out)
        return self._step_text(out)

    def _step_text(self, out: Parsed) -> bool:
        markers = self._text_markers()
        hit = _earliest(self._pending, markers)
        if hit is not None:
            at, marker = hit
            out.text += self._text_part(self._pending[:at])
            self._pending = self._pending[at + len(marker) :]
            self._enter(marker)
            return True
        if self._bare_json_possible():
            stripped = self._pending.lstrip()
            if stripped.startswith("{"):  # a bare Llama 3.x call: its object opens the call
                out.text += self._text_part(self._pending[: len(self._pending) - len(stripped)])
                self._pending = stripped
                self._open_call("")
                return True
            if not stripped:
                return False  # whitespace at the turn's start: wait for what follows
        keep = _held_back(self._pending, markers)
        out.text += self._text_part(self._pending[: len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep :]
        return False

    def _text_part(self, text: str) -> str:
        if self._strip_leading:
            text = text.lstrip()
            self._strip_leading = not text
        if text.strip():
            self._at_turn_start = False
        return text

    def _bare_json_possible(self) -> bool:
        return self._format is not None and self._format.bare_json and self._at_turn_start

    def _text_markers(self) -> list[str]:
        markers = []
        if self._reasoning is not None:
            markers.append(self._reasoning.start)
        if self._format is not None:
            markers.append(self._format.start)
        return markers

    def _enter(self, marker: str) -> None:
        if self._reasoning is not None and marker == self._reasoning.start:
            self._mode = _Mode.REASONING
        elif self._format is not None and self._format.array:
            self._mode, self._array_raw = _Mode.ARRAY, marker
        else:
            self._open_call(marker)

    def _open_call(self, marker: str) -> None:
        assert self._format is not None
        scanner = CallScanner(self._format.arguments_key)
        self._call = _Call(marker, scanner, len(self.calls), self._call_id())
        self._mode = _Mode.CALL

    def _step_reasoning(self, out: Parsed) -> bool:
        assert self._reasoning is not None
        end = self._reasoning.end
        at = self._pending.find(end)
        if at >= 0:
            out.reasoning += self._pending[:at]
            self._pending = self._pending[at + len(end) :]
            self._mode, self._strip_leading = _Mode.TEXT, True
            return True
        keep = _held_back(self._pending, [end])
        out.reasoning += self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]
        return False

    def _step_call(self, out: Parsed) -> bool:
        call = self._call
        assert call is not None and self._format is not None
        if call.scanner.done:
            return self._close_call(out, call)
        consumed = 0
        try:
            for char in self._pending:
                call.scanner.feed(char)
                consumed += 1
                if call.scanner.done:
                    break
            self._stream(out, call)
        except ScanError:
            return self._fail(out, call, consumed + 1)
        call.raw += self._pending[:consumed]
        self._pending = self._pending[consumed:]
        return call.scanner.done and self._close_call(out, call)

    def _stream(self, out: Parsed, call: _Call) -> None:
        """Sends what is new of the call: its name (with its id) once known, then more of its arguments."""
        if not call.named:
            name = call.scanner.name()
            if name is None:
                return
            if self._names and name not in self._names:
                raise ScanError(f"no tool is named {name!r}")
            out.deltas.append(CallDelta(call.index, call.id, name))
            call.named = True
        arguments = call.scanner.arguments_so_far()
        if arguments and len(arguments) > len(call.sent_arguments):
            out.deltas.append(CallDelta(call.index, arguments=arguments[len(call.sent_arguments) :]))
            call.sent_arguments = arguments

    def _close_call(self, out: Parsed, call: _Call) -> bool:
        """After the object: its end marker (or, in an array, the next call or the array's end)."""
        assert self._format is not None
        end = self._format.end
        if end:
            stripped = self._pending.lstrip()
            if len(stripped) < len(end) and end.startswith(stripped):
                return False  # the marker may still be coming
            if not stripped.startswith(end):
                return self._fail(out, call, len(self._pending) - len(stripped) + 1)
            call.raw += self._pending[: len(self._pending) - len(stripped) + len(end)]
            self._pending = stripped[len(end) :]
        try:
            name, arguments = call.scanner.finished_call()
            if self._names and name not in self._names:
                raise ScanError(f"no tool is named {name!r}")
        except ScanError:
            return self._fail(out, call, 0)
        if not call.named:
            out.deltas.append(CallDelta(call.index, call.id, name))
        if arguments != call.sent_arguments:  # what was held back (or "{}" when none were given)
            out.deltas.append(CallDelta(call.index, arguments=arguments[len(call.sent_arguments) :]))
        finished = ToolCall(call.id, name, arguments)
        self.calls.append(finished)
        out.calls.append(finished)
        self._call = None
        if self._format.array:
            self._mode = _Mode.ARRAY
        else:
            self._mode, self._at_turn_start, self._strip_leading = _Mode.TEXT, True, True
        return True

    def _step_array(self, out: Parsed) -> bool:
        """Between a Mistral array's calls: '[' or ',' before a call, ']' at its end."""
        stripped = self._pending.lstrip()
        if not stripped:
            return False
        char = stripped[0]
        expected = "[" if self._array_raw.rstrip().endswith("[TOOL_CALLS]") else ",]"
        if char not in expected:
            text = self._array_raw + self._pending[: len(self._pending) - len(stripped) + 1]
            out.text += self._text_part(text)
            self._pending, self._array_raw, self._mode = stripped[1:], "", _Mode.TEXT
            return True
        self._pending = stripped[1:]
        if char == "]":
            self._array_raw, self._mode, self._at_turn_start, self._strip_leading = "", _Mode.TEXT, True, True
            return True
        self._array_raw += char
        self._open_call("")
        return True

    def _fail(self, out: Parsed, call: _Call, upto: int) -> bool:
        """Not a call after all: its markup so far (through the character that broke it) is text."""
        out.text += self._text_part(self._array_raw + call.raw + self._pending[:upto])
        self._pending = self._pending[upto:]
        self._call, self._array_raw, self._mode = None, "", _Mode.TEXT
        return True


def _earliest(text: str, markers: list[str]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for marker in markers:
        at = text.find(marker)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, marker)
    return best


def _held_back(text: str, markers: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a marker."""
    longest = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:length]):
                longest = length
                break
    return longest
