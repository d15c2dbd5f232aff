"""A front end's process: one gRPC server (service.server.TokenspoutServer) on the engine in its own
process (backend.process.RemoteEngine), until the supervisor's SIGTERM drains it.

Started by service.supervisor through multiprocessing's spawn: the child imports this module and calls
`main`, which says ("ready", port) or ("failed", why) on `ready`, once it listens and the engine has answered.
"""

from __future__ import annotations

import asyncio
import functools
import pathlib
import signal
import sys
from multiprocessing.connection import Connection

from backend import EngineRecipe, ModelError, RemoteEngine
from service.config import ServeConfig
from service.parent import start_child
from service.server import TokenspoutServer, serve_until_signal, start_with_engine
from service.startup import StartupError


def main(config: ServeConfig, recipe: EngineRecipe, run_dir: str, index: int, ready: Connection) -> None:
    start_child(config)
    sys.exit(asyncio.run(_serve(config, recipe, pathlib.Path(run_dir), index, ready)))


async def _serve(config: ServeConfig, recipe: EngineRecipe, run_dir: pathlib.Path, index: int, ready: Connection) -> int:
    try:
        server = TokenspoutServer(None, config, front_end=index)
    except StartupError as exc:
        ready.send(("failed", str(exc)))
        return 2
    engine = RemoteEngine(run_dir, index, functools.partial(recipe.vocabulary, config.engine))
    try:
        await engine.connect()
    except ModelError as exc:  # the vocabulary (the engine loaded the same files: seldom)
        ready.send(("failed", str(exc)))
        return 2
    try:
        try:
            await start_with_engine(server, engine)
        except StartupError as exc:  # the engine cannot serve as configured
            ready.send(("failed", str(exc)))
            return 2
        ready.send(("ready", server.port))
        return await serve_until_signal(server, exit_on_engine_death=False, signals=(signal.SIGTERM,))
    finally:
        engine.close()
