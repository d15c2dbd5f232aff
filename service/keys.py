"""API keys: `name:sha256hex` entries (the hex SHA-256 of the key itself, so the server never stores a
usable key), inline in a setting or one per line in a file that is re-read when it changes.

Every configured digest is compared with `hmac.compare_digest`, so the time taken says nothing about
which key, or how much of one, matched.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import time
from typing import NamedTuple

log = logging.getLogger(__name__)

_KEY_LINE = re.compile(r"([^:\s]+):([0-9a-fA-F]{64})")
# How often a changed keys file is noticed without SIGHUP.
_FILE_CHECK_S = 1.0


class ApiKey(NamedTuple):
    name: str
    digest: bytes


def parse_keys(text: str, source: str) -> list[ApiKey]:
    """`name:sha256hex` entries, one per line (blank lines and # comments skipped)."""
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _KEY_LINE.fullmatch(line)
        if match is None:
            raise ValueError(f"{source} line {number}: expected name:sha256hex (64 hex digits)")
        keys.append(ApiKey(match.group(1), bytes.fromhex(match.group(2))))
    return keys


class KeyStore:
    """The configured keys: the inline ones, and the file's as last read."""

    def __init__(self, inline: tuple[ApiKey, ...] = (), path: str = "") -> None:
        self._inline = list(inline)
        self._path = path
        self._stamp: tuple[int, int, int] | None = None
        """The file as last read, or as last found unreadable (so one bad version is reported once)."""
        self._checked_at = 0.0
        self._keys = list(self._inline)
        if path:
            self.reload()

    def __len__(self) -> int:
        return len(self._keys)

    def reload(self) -> None:
        """Re-reads the keys file; raises OSError or ValueError and keeps the old keys if it is bad."""
        stat = os.stat(self._path)
        with open(self._path, encoding="utf-8") as f:
            from_file = parse_keys(f.read(), self._path)
        self._keys = self._inline + from_file
        self._stamp = (stat.st_mtime_ns, stat.st_size, stat.st_ino)

    def reload_if_changed(self, force: bool = False) -> None:
        """At most once a second (or when forced, on SIGHUP): a changed or replaced file is re-read. A file
        that does not parse, or has gone, is reported once, not at every check, until it changes again."""
        now = time.monotonic()
        if not self._path or not (force or now - self._checked_at >= _FILE_CHECK_S):
            return
        self._checked_at = now
        try:
            stat = os.stat(self._path)
        except OSError as exc:
            self._refuse(None, exc, force)
            return
        stamp = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if not force and stamp == self._stamp:
            return
        try:
            self.reload()
            log.info("API keys reloaded from %s: %d keys", self._path, len(self._keys))
        except (OSError, ValueError) as exc:
            self._refuse(stamp, exc, force)

    def _refuse(self, stamp: tuple[int, int, int] | None, problem: Exception, force: bool) -> None:
        """The previous keys stay; said once per version of the file (and at every SIGHUP)."""
        if force or stamp != self._stamp:
            log.error("API keys file not reloaded, the previous keys stay in force: %s", problem)
        self._stamp = stamp

    def name_for(self, key: str) -> str | None:
        """The name of a configured key, or None. Compares every digest, whichever matches."""
        digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        found = None
        for name, expected in self._keys:
            if hmac.compare_digest(digest, expected) and found is None:
                found = name
        return found
