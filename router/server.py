"""Runs a :class:`RouterApp` on a TCP port: in-process start/stop (tests, benchmarks) or until SIGTERM
(CLI)."""

from __future__ import annotations

import asyncio
import gc
import signal

from aiohttp import web

from kvpilot.engine.model.registry import resolve_tokenizer
from kvpilot.engine.tokenizer import Tokenizer
from kvpilot.router.app import RouterApp
from kvpilot.router.connections import RouterRunner
from kvpilot.router.request_profile import RequestProfiler
from kvpilot.router.segment_tokenizer import SegmentTokenizer


def load_profiler(model: str) -> RequestProfiler:
    """The engine's tokenizer and chat template for ``model`` (same spec forms as ``kvpilot serve``; a GGUF's
    tokenizer is extracted without converting its weights)."""
    model_dir = resolve_tokenizer(model)
    tokenizer = Tokenizer.from_dir(model_dir)
    segments = SegmentTokenizer(tokenizer, model_dir)
    return RequestProfiler(tokenizer, segments)


class RouterServer:
    def __init__(self, router: RouterApp, host: str = "127.0.0.1", port: int = 0) -> None:
        self.router = router
        self._host = host
        self._port = port
        # handler_cancellation: a client that disconnects cancels its handler, which closes the upstream
        # request, so the engine stops generating for nobody.
        self._runner = RouterRunner(
            router.build(),
            router.config.upstream.client_limits,
            router.config.upstream.body_read_timeout_s,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=5.0,
        )
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    async def start(self) -> RouterServer:
        # Everything loaded so far (tokenizer, templates, modules) lives as long as the process: move it out
        # of the collector's reach, so full collections on the request path do not walk it.
        gc.freeze()
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def serve_until_signalled(self) -> None:
        """Serve until SIGTERM or SIGINT, then stop cleanly (in-flight streams get the shutdown timeout)."""
        await self.start()
        try:
            await until_signalled()
        finally:
            await self.stop()


async def until_signalled() -> None:
    """Returns once the process gets SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
