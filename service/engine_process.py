"""The engine's process: loads the model, serves it to the front ends (backend.process.host) and
publishes its KV-cache events, until the supervisor's SIGTERM. Nothing of gRPC runs here.

Started by service.supervisor through multiprocessing's spawn: the child imports this module and calls
`main`, which says ("ready", model id) or ("failed", why) on `ready` once the model is loaded or could not be.
"""

from __future__ import annotations

import logging
import os
import pathlib
import signal
import sys
from multiprocessing.connection import Connection

import zmq

from backend import CacheEventHub, EngineHost, EngineRecipe, EngineUnavailable, ModelError
from service.config import ServeConfig
from service.kv_publisher import cache_publisher
from service.parent import start_child

log = logging.getLogger(__name__)

ENGINE_CRASH_EXIT_CODE = 70
"""The engine's own loop died (a bug, or a CUDA error): the supervisor starts it again."""


def main(config: ServeConfig, recipe: EngineRecipe, run_dir: str, restarts: int, ready: Connection) -> None:
    start_child(config)
    try:
        engine = recipe.engine(config.engine)
    except (ModelError, EngineUnavailable) as exc:
        ready.send(("failed", str(exc)))
        sys.exit(2)
    try:  # one publisher for every front end, here where the events are made
        hub = engine.cache_events
        publisher = cache_publisher(config, hub, engine.info.model_id) if isinstance(hub, CacheEventHub) else None
    except zmq.ZMQError as exc:
        ready.send(("failed", str(exc)))
        sys.exit(2)
    host = EngineHost(engine, pathlib.Path(run_dir), restarts, publisher.sources if publisher is not None else ("", "", ""))
    engine.on_death(_crashed)
    signal.signal(signal.SIGTERM, lambda signum, frame: host.stop_serving())
    log.info("engine (pid %d) serving %s%s", os.getpid(), engine.info.model_id,
             f", started again after dying ({restarts})" if restarts else "")
    ready.send(("ready", engine.info.model_id))
    try:
        host.serve()
    except Exception as exc:  # its output thread failed: nothing reaches the front ends any more
        _crashed(exc)
    log.info("engine stopping")
    engine.close()
    host.close()
    if publisher is not None:
        publisher.close()


def _crashed(exc: BaseException) -> None:
    """On the engine thread, its loop dead: the process ends now, its front ends see it and the supervisor starts
    another (what the loop held cannot be trusted; nothing here is worth a clean exit)."""
    log.critical("the engine loop died (%s): the engine process exits for a restart", type(exc).__name__)
    logging.shutdown()
    os._exit(ENGINE_CRASH_EXIT_CODE)
