"""Logging set-up: plain text, or one JSON object per line with request and trace ids (and the caller).

Log lines carry caller-controlled text (request ids, engine messages), so every
line break and control character in a message is escaped: one event is always
exactly one line, and no caller can forge another.
"""

from __future__ import annotations

import json
import logging
import re
import time

# ASCII controls, DEL, C1 controls and the Unicode line/paragraph separators (str.splitlines breaks on them).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_JSON_UNSAFE = re.compile("[\x7f-\x9f\u2028\u2029]")


def escape(text: str) -> str:
    """`text` on one line: control characters as \\n, \\t, \\x1b, \\u2028 ..."""
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class TextFormatter(logging.Formatter):
    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("request_id", "trace_id", "caller"):
            if getattr(record, key, ""):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        # json escapes ASCII controls itself; DEL, C1 controls and the separators it keeps raw are escaped here.
        return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(entry, ensure_ascii=False))


def configure(level: str, log_format: str) -> None:
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
