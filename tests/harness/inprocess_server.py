"""A tokenspout server in the test process, on a loopback port: TokenspoutServer on an event loop
thread of its own, configured from the same flags and environment as `tokenspout serve`, serving the
engine a test gives it (tests/harness/fake_engine.py's, usually). Real sockets, real gRPC; what a subprocess
adds (signals, exit codes) is left to conftest.start_server."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import TypeVar

from backend.engine import Engine
from service import cli
from service.config import ServeConfig, load_config
from service.logs import TextFormatter
from service.server import TokenspoutServer
from service.telemetry import Telemetry
from tests.harness.fake_engine import FakeEngine

T = TypeVar("T")


def serve_config(*flags: str, env: dict[str, str] | None = None) -> ServeConfig:
    """The config `tokenspout serve --listen 127.0.0.1:0 FLAGS` would run with, `env` as its environment."""
    args = cli._parser().parse_args(["serve", "--listen", "127.0.0.1:0", *flags])
    return load_config(vars(args), environ=env or {}, config_file=args.config)


class _ServerLog(logging.Handler):
    """The lines this server logs (its event loop's and its engine's), as `tokenspout serve` writes them."""

    def __init__(self, loop_thread: threading.Thread) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self._loop_thread = loop_thread
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self._loop_thread.ident or record.name.startswith("backend"):
            self.lines.append(self.format(record))


class InProcessServer:
    def __init__(self, engine: Engine, config: ServeConfig, telemetry: Telemetry | None = None) -> None:
        self.engine = engine
        self.config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="server-loop", daemon=True)
        self._log = _ServerLog(self._thread)
        root = logging.getLogger()
        self._root_level = root.level
        root.setLevel(logging.INFO)  # as `tokenspout serve` configures it
        root.addHandler(self._log)
        self._thread.start()
        self._draining: concurrent.futures.Future | None = None
        try:
            self.server: TokenspoutServer = self.call(self._start(telemetry))
        except BaseException:
            self._stop_loop()
            raise
        self.address = f"127.0.0.1:{self.server.port}"

    async def _start(self, telemetry: Telemetry | None) -> TokenspoutServer:
        server = TokenspoutServer(self.engine, self.config, telemetry)  # on the loop, as `serve` builds it
        await server.start()
        return server

    def call(self, coroutine: Coroutine[object, object, T], timeout_s: float = 60) -> T:
        """Runs a coroutine on the server's event loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=timeout_s)

    def on_loop(self, function: Callable[[], T], timeout_s: float = 60) -> T:
        """Calls `function` on the server's event loop (where the server's state may be read and changed)."""

        async def run() -> T:
            return function()

        return self.call(run(), timeout_s)

    def log(self) -> str:
        return "\n".join(self._log.lines)

    def wait_for_log(self, text: str, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log():
            assert time.monotonic() < deadline, f"the server never logged {text!r}:\n{self.log()}"
            time.sleep(0.02)

    def drain(self) -> concurrent.futures.Future:
        """Starts what SIGTERM starts (TokenspoutServer.drain); the future is done when the listener has closed."""
        self._draining = asyncio.run_coroutine_threadsafe(self.server.drain(), self.loop)
        return self._draining

    def close(self) -> None:
        try:
            if self._draining is None:
                self.call(self.server.server.stop(None))
            else:
                self._draining.result(timeout=120)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.engine.close()
        root = logging.getLogger()
        root.removeHandler(self._log)
        root.setLevel(self._root_level)


def start_fake(*flags: str, env: dict[str, str] | None = None, step_s: float = 0.0,
               telemetry: Telemetry | None = None) -> InProcessServer:
    """An in-process server on a FakeEngine built from the flags' engine settings."""
    config = serve_config(*flags, env=env)
    return InProcessServer(FakeEngine(config.engine, step_s), config, telemetry)

