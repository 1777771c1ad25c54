"""Running the app under uvicorn, with the first SIGTERM/SIGINT draining instead of stopping at once.

uvicorn's own handling stops listening at the first signal; a draining replica must instead keep
answering — 503 to new requests and ``/ready``, the rest of the streams to in-flight ones — until the
drain is over (``drain.py``). A second signal stops at once. The exit status is 0 after a drain and 1
when the engine could not load or its loop failed (so the pod restarts).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from types import FrameType

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.server.app import build_state, create_app
from kvpilot.engine.server.config import ServerConfig
from kvpilot.engine.server.drain import drain
from kvpilot.engine.server.http_protocol import http_protocol
from kvpilot.engine.server.state import ServerState
from kvpilot.engine.server.tracing import tracer_provider_from_env

log = logging.getLogger(__name__)
#: after the drain, how long uvicorn waits for connections to close before it cancels them
SHUTDOWN_TIMEOUT_S = 5


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        self.exit_code = 0
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._event_loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is None and self._event_loop is not None and not self.should_exit:
            self._event_loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)  # a second signal (or one before startup): stop now

    def _start_drain(self) -> None:
        if self._drain_task is not None:
            return

        async def drain_then_exit() -> None:
            try:
                await drain(self.state, self.grace_s)
            finally:
                self.should_exit = True

        self._drain_task = asyncio.ensure_future(drain_then_exit())

    def fatal(self, reason: str) -> None:
        """The engine could not load or its loop died (called from the engine thread)."""
        log.error("stopping the server: %s", reason)
        self.exit_code = 1
        self.should_exit = True


def serve(engine_config: EngineConfig, config: ServerConfig) -> int:
    logging.basicConfig(
        level=config.log_level.upper() if config.log_level != "trace" else "DEBUG",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    tracer_provider = tracer_provider_from_env()
    holder: list[DrainingServer] = []
    state = build_state(
        engine_config,
        config,
        tracer_provider=tracer_provider,
        on_fatal=lambda reason: holder[0].fatal(reason),
    )
    uv_config = uvicorn.Config(
        create_app(state),
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=config.access_log,
        timeout_graceful_shutdown=SHUTDOWN_TIMEOUT_S,
        lifespan="on",
        # uvicorn annotates int but only hands it to loop.call_later: fractional seconds work as given
        timeout_keep_alive=config.timeout_keep_alive_s,  # type: ignore[arg-type]
        server_header=False,
        http=http_protocol(config.connection_limits, config.body_read_timeout_s),
    )
    server = DrainingServer(uv_config, state, config.drain_grace_s)
    holder.append(server)
    try:
        server.run()
    except SystemExit as exit_:
        # uvicorn exits 3 (STARTUP_FAILURE) once it has logged why, e.g. an address it cannot bind: that is a
        # runtime failure, status 1 as the cli documents
        if exit_.code != STARTUP_FAILURE:
            raise
        return 1
    finally:
        if tracer_provider is not None:
            tracer_provider.shutdown()
    return server.exit_code
