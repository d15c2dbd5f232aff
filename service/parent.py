"""A child process of the supervisor (the engine's, or a front end) ends with it: killed with the supervisor
(kill -9, an OOM kill), the engine and the front ends must not live on as orphans holding the port and the
model's memory."""

from __future__ import annotations

import ctypes
import os
import signal

from service import logs
from service.config import ServeConfig

_PR_SET_PDEATHSIG = 1


def start_child(config: ServeConfig) -> None:
    """A child process's first steps: it ends with its parent, logs as configured, and leaves Ctrl-C (which
    reaches the whole group) to the supervisor, which decides, through SIGTERM."""
    end_with_parent()
    logs.configure(config.log_level, config.log_format)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def end_with_parent() -> None:
    """Asks Linux to kill this process when its parent dies (prctl PR_SET_PDEATHSIG), and exits at once if the
    parent died before the request took effect."""
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # it died before prctl: nothing would send the signal
        os._exit(1)
