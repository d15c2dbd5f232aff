"""Turning generated token bytes into text that is safe to stream.

Two rules from the contract: streamed text is complete UTF-8 only (a code point
split across tokens waits for its last byte), and text that could still become
a stop sequence is held back, so a stop sequence never leaks into the stream.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass


class Utf8Stream:
    """Decodes a byte stream into complete code points as they arrive."""

    def __init__(self) -> None:
        self._pending = b""  # the start of a code point split across tokens

    def feed(self, data: bytes) -> str:
        # The codec itself, as codecs' incremental decoder calls it (one Python layer less: it runs per token).
        # "replace" only fires on bytes that can never be valid, not on a split code point.
        if self._pending:
            data = self._pending + data
        elif data.isascii():  # most tokens: nothing to hold back, and ASCII decodes fastest
            return data.decode("ascii")
        text, used = codecs.utf_8_decode(data, "replace", False)
        self._pending = data[used:]
        return text

    def flush(self) -> str:
        """Ends the stream. A code point cut off by the end of generation is dropped, not
        sent as U+FFFD: its bytes are still in the tokens for callers that want them."""
        self._pending = b""
        return ""


@dataclass(frozen=True)
class StopMatch:
    stop_sequence: str


class StopSequenceFilter:
    """Passes text through, holding back any tail that could start a stop sequence.

    `push` returns the text that is now safe to emit; once a stop sequence
    appears, `matched` is set and everything after it is dropped.
    """

    def __init__(self, stop_sequences: tuple[str, ...], include_stop_sequence: bool = False) -> None:
        self._stops = tuple(s for s in stop_sequences if s)
        self._include = include_stop_sequence
        self._held = ""
        self.matched: StopMatch | None = None

    def push(self, text: str) -> str:
        if self.matched is not None or not text:
            return ""
        if not self._stops:
            return text
        pending = self._held + text
        hit = self._earliest_match(pending)
        if hit is not None:
            start, stop = hit
            self.matched = StopMatch(stop)
            self._held = ""
            return pending[: start + len(stop)] if self._include else pending[:start]
        keep = self._longest_stop_prefix_suffix(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]

    def flush(self) -> str:
        """Releases held text at the end of generation (it did not become a stop)."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = text.find(stop)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
