"""Progress of long first-run work (the model fetch): a bar in a terminal, plain lines in logs."""

from __future__ import annotations

import logging
import sys
from typing import IO, Never

from tqdm import tqdm

log = logging.getLogger(__name__)


class Progress:
    """Reports `done` of `total` bytes: a tqdm bar when `stream` is a terminal, else a log line
    at every tenth, so a log holds ten lines rather than thousands."""

    def __init__(self, description: str, stream: IO[str] | None = None) -> None:
        self.description = description
        stream = stream or sys.stderr
        self._bar: tqdm[Never] | None = None  # a bar over no iterable
        self._terminal = stream.isatty()
        self._stream = stream
        self._logged_tenths = -1

    def update(self, done: int, total: int) -> None:
        if self._terminal:
            if self._bar is None:
                self._bar = tqdm(total=total or None, desc=self.description, unit="B", unit_scale=True,
                                 unit_divisor=1024, file=self._stream)
            self._bar.update(done - self._bar.n)
            return
        tenths = done * 10 // total if total else 0
        if tenths > self._logged_tenths:
            self._logged_tenths = tenths
            log.info("%s: %d%% (%.1f of %.1f MB)", self.description, tenths * 10, done / 1e6, total / 1e6)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def parse_pip_progress(line: str) -> tuple[int, int] | None:
    """pip's `--progress-bar raw` writes "Progress <done> of <total>" lines."""
    parts = line.split()
    if len(parts) == 4 and parts[0] == "Progress" and parts[2] == "of" and parts[1].isdigit() and parts[3].isdigit():
        return int(parts[1]), int(parts[3])
    return None
