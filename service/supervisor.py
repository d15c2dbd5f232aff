"""`tokenspout serve` with the engine in a process of its own: starts the engine's process and the
front ends, watches them, starts again what dies, and stops them in order.

    supervisor (this process: no model, no gRPC)
      ├─ engine process (service.engine_process): the model and its engine, backend.process.host
      └─ front end x front_ends (service.front_end): gRPC on `listen`, each on a RemoteEngine

- The engine's process dies (kill -9, a segfault, a CUDA error, its loop's crash): its front ends see it
  at once (every call in flight ends with UNAVAILABLE and RetryInfo, health NOT_SERVING) and it is
  started again after a backoff (RESTART_BACKOFF_S, doubling); the front ends serve again once it
  answers. After max_engine_restarts deaths in a row (an hour up starts the count again) the server
  gives up: the front ends stop and the process exits with ENGINE_DOWN_EXIT_CODE, for the
  orchestrator to replace it.
- A front end dies: the engine ends its requests at once, the others serve on, and it is started again.
- SIGTERM (or SIGINT): every front end drains (grace_period_s), then the engine stops; exit 0. A second
  one: everything is killed, exit 1. SIGHUP goes to the front ends (they re-read the API keys file).

Children are started with multiprocessing's spawn (no fork of a process holding threads or a CUDA
context); each says ("ready", ...) or ("failed", why) on a pipe once it serves or cannot.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from service.config import ServeConfig
from service.startup import ENGINE_DOWN_EXIT_CODE, StartupError, check_port, serving_line

if TYPE_CHECKING:
    from backend import EngineRecipe

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = 0.5
"""The wait before the first restart of a child that died; it doubles with each death in a row."""
CLEAN_RUN_S = 3600.0
"""A child up this long before it died starts its count of deaths in a row again."""
_STOP_MARGIN_S = 15.0
"""Beyond grace_period_s, how long front ends get to close before they are killed."""
_ENGINE_STOP_S = 30.0


@dataclass
class _Child:
    name: str
    process: BaseProcess
    ready: Connection
    started_at: float
    up: bool = False
    """It has said it is ready."""
    deaths: int = 0
    """Deaths in a row (see CLEAN_RUN_S)."""
    restart_at: float | None = None
    """When a child that died is started again."""


class Supervisor:
    def __init__(self, config: ServeConfig, recipe: EngineRecipe | None, run_dir: str) -> None:
        self.config = config
        self._recipe = recipe
        self._run_dir = run_dir
        self._spawn = multiprocessing.get_context("spawn")
        self._signals: list[int] = []
        self.engine_restarts = 0
        self._engine: _Child | None = None
        self._front_ends: list[_Child] = []

    # -- starting -----------------------------------------------------------------------------------

    def run(self) -> int:
        """Starts everything, then watches it (see the module's docstring). Raises StartupError."""
        wakeup_read, wakeup_write = os.pipe()
        os.set_blocking(wakeup_write, False)
        previous = signal.set_wakeup_fd(wakeup_write, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda signum, frame: self._signals.append(signum))
        self._wakeup = wakeup_read
        try:
            try:
                return self._run()
            except BaseException:
                self._kill_all()
                raise
        finally:
            signal.set_wakeup_fd(previous)
            os.close(wakeup_read)
            os.close(wakeup_write)

    def _run(self) -> int:
        config = self.config
        # The first front end starts beside the engine: it builds its server while the model loads, and says
        # Hello until the engine answers. Whichever of the two fails first is the error.
        self._engine = self._start_engine()
        answers = self._await_ready(self._engine, self._start_front_end(0, config))
        if answers is None:
            return self._stop_all()
        model_id, port = answers
        self.config = config = dataclasses.replace(config, listen=f"{config.listen.rsplit(':', 1)[0]}:{port}")
        for index in range(1, config.front_ends):  # on the port the first one got (listen may say :0)
            if self._await_ready(self._start_front_end(index, config)) is None:
                return self._stop_all()
        print(serving_line(config, model_id, port), flush=True)
        return self._watch()

    def _start_engine(self) -> _Child:
        return self._start("engine", "service.engine_process", self.config, self._recipe, self._run_dir, self.engine_restarts)

    def _start_front_end(self, index: int, config: ServeConfig) -> _Child:
        child = self._start(f"front end {index}", "service.front_end", config, self._recipe, self._run_dir, index)
        if index < len(self._front_ends):
            child.deaths = self._front_ends[index].deaths
            self._front_ends[index] = child
        else:
            self._front_ends.append(child)
        return child

    def _start(self, name: str, module: str, *args: Any) -> _Child:
        theirs, ours = self._spawn.Pipe(duplex=False)
        process = self._spawn.Process(target=_child_main, args=(module, *args, ours), name=name, daemon=False)
        process.start()
        ours.close()
        return _Child(name, process, theirs, time.monotonic())

    def _await_ready(self, *children: _Child) -> list[Any] | None:
        """What each starting child says it serves with (the model's id, a port), in order; None when a signal
        came first. Raises StartupError when one cannot start (the first to say so)."""
        answers: dict[int, Any] = {}
        while len(answers) < len(children):
            waiting = [(i, child) for i, child in enumerate(children) if i not in answers]
            waits = [self._wakeup, *(handle for _, child in waiting for handle in (child.ready, child.process.sentinel))]
            ready = multiprocessing.connection.wait(waits)
            for i, child in waiting:
                if child.ready in ready:
                    answers[i] = self._answer(child)
                elif child.process.sentinel in ready and not child.ready.poll():
                    raise StartupError(f"the {child.name} exited with {child.process.exitcode} while starting")
            if self._wakeup in ready and self._take_signals():
                return None
        return [answers[i] for i in range(len(children))]

    def _answer(self, child: _Child) -> Any:
        """A starting child's ready message: what it serves with. Raises StartupError when it failed."""
        try:
            state, detail = child.ready.recv()
        except EOFError:
            child.process.join(5)
            state, detail = "failed", f"the {child.name} exited with {child.process.exitcode} while starting"
        if state == "failed":
            raise StartupError(detail)
        child.up = True
        return detail

    # -- watching ----------------------------------------------------------------------------------

    def _watch(self) -> int:
        while True:
            children = [child for child in (self._engine, *self._front_ends) if child is not None]
            waits: list[Any] = [self._wakeup]
            for child in children:
                if child.restart_at is None:  # a dead one waiting for its restart is woken by the timeout
                    waits += [child.process.sentinel] if child.up else [child.process.sentinel, child.ready]
            due = [child.restart_at for child in children if child.restart_at is not None]
            timeout = max(0.0, min(due) - time.monotonic()) if due else None
            ready = multiprocessing.connection.wait(waits, timeout)
            if self._wakeup in ready and self._take_signals():
                return self._stop_all()
            for child in children:
                if child.restart_at is not None:
                    if time.monotonic() >= child.restart_at:
                        self._restart(child)
                    continue
                if not child.up and child.ready in ready:
                    self._heard_from(child)
                if child.process.sentinel in ready and not self._died(child):
                    return self._give_up()

    def _heard_from(self, child: _Child) -> None:
        try:
            state, detail = child.ready.recv()
        except EOFError:  # it died before it said: its sentinel tells next
            return
        if state == "ready":
            child.up = True
            log.info("%s is up again", child.name)
        else:
            log.error("%s could not start again: %s", child.name, detail)

    def _died(self, child: _Child) -> bool:
        """Schedules its restart; False when it died too often in a row to try again."""
        child.process.join()
        uptime = time.monotonic() - child.started_at
        if child.up and uptime >= CLEAN_RUN_S:
            child.deaths = 0
        child.deaths += 1
        log.error("%s (pid %s) exited with %s after %.1f s", child.name, child.process.pid, child.process.exitcode, uptime)
        if child is self._engine and child.deaths > self.config.max_engine_restarts:
            return False
        child.restart_at = time.monotonic() + RESTART_BACKOFF_S * 2 ** (child.deaths - 1)
        child.up = False
        return True

    def _restart(self, child: _Child) -> None:
        if child is self._engine:
            self.engine_restarts += 1
            log.warning("starting the engine again (restart %d)", self.engine_restarts)
            fresh = self._start_engine()
            fresh.deaths, self._engine = child.deaths, fresh
        else:
            index = self._front_ends.index(child)
            log.warning("starting front end %d again", index)
            self._start_front_end(index, self.config)

    def _give_up(self) -> int:
        log.critical("the engine died %d times in a row: giving up (exit %d, for a restart of the whole server)",
                     self.config.max_engine_restarts + 1, ENGINE_DOWN_EXIT_CODE)
        self._stop_all()
        return ENGINE_DOWN_EXIT_CODE

    # -- stopping ----------------------------------------------------------------------------------

    def _take_signals(self) -> bool:
        """Handles the signals that came; True when one asks to stop."""
        try:
            os.read(self._wakeup, 512)
        except BlockingIOError:
            pass
        signals, self._signals = self._signals, []
        for signum in signals:
            if signum == signal.SIGHUP:
                for child in self._front_ends:
                    if child.process.is_alive() and child.process.pid is not None:
                        os.kill(child.process.pid, signal.SIGHUP)
        return any(signum != signal.SIGHUP for signum in signals)

    def _stop_all(self) -> int:
        """Drains the front ends, then stops the engine; a second signal meanwhile kills everything (exit 1)."""
        log.info("draining: up to %.0f s for running streams", self.config.grace_period_s)
        running = [child for child in self._front_ends if child.process.is_alive()]
        for child in running:
            child.process.terminate()
        if not self._wait_for(running, self.config.grace_period_s + _STOP_MARGIN_S):
            return 1
        engine = self._engine
        if engine is not None and engine.process.is_alive():
            engine.process.terminate()
            if not self._wait_for([engine], _ENGINE_STOP_S):
                return 1
        return 0

    def _wait_for(self, children: list[_Child], timeout_s: float) -> bool:
        """Waits for them to exit (killing those still there at the end); False when a second signal came."""
        deadline = time.monotonic() + timeout_s
        while any(child.process.is_alive() for child in children):
            left = deadline - time.monotonic()
            if left <= 0:
                for child in children:
                    if child.process.is_alive():
                        log.warning("%s did not stop in time: killed", child.name)
                        child.process.kill()
                break
            ready = multiprocessing.connection.wait([self._wakeup, *(c.process.sentinel for c in children)], left)
            if self._wakeup in ready and self._take_signals():
                log.warning("second signal: exiting without waiting")
                self._kill_all()
                return False
        for child in children:
            child.process.join(5)
        return True

    def _kill_all(self) -> None:
        for child in (self._engine, *self._front_ends):
            if child is not None and child.process.is_alive():
                child.process.kill()
                child.process.join(5)


def supervise(config: ServeConfig, recipe: EngineRecipe | None = None) -> int:
    """Serves (see the module's docstring), each child on `recipe` (None: backend.MODEL_RECIPE, built there).
    Raises StartupError, with nothing left running."""
    check_port(config.listen)  # before anything starts, so a busy port is the only line printed
    with tempfile.TemporaryDirectory(prefix="tokenspout-") as run_dir:  # the engine's and front ends' sockets
        return Supervisor(config, recipe, run_dir).run()


def _child_main(module: str, config: ServeConfig, recipe: EngineRecipe | None, *args: Any) -> None:
    """A child's first code: its module (service.engine_process or service.front_end) is imported here, in the
    child, so the supervisor itself never loads gRPC, numpy or the model's libraries."""
    from backend import MODEL_RECIPE

    importlib.import_module(module).main(config, recipe or MODEL_RECIPE, *args)
