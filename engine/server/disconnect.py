"""Noticing that a client went away — promptly, streaming or not
(docs/architecture.md#backpressure-and-cancellation: a request nobody listens to must stop holding the batch
and its KV blocks).

The ASGI server reports a closed connection as an ``http.disconnect`` message on ``receive()``, which
only arrives if someone is waiting for it. Before a response starts, ``until_disconnected`` races the
handler's work against that message; once an SSE response streams, ``SSEResponse`` keeps listening for
it whatever ASGI spec version the server speaks (Starlette stops listening at 2.4 and relies on a failing
write instead — which never comes while the request is queued or backpressured and writes nothing).
Either way the handler's coroutine is cancelled and its ``finally`` cancels the engine requests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import ContentStream, StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``await work``, unless the client disconnects first: then ``work`` is cancelled and
    ``ClientDisconnected`` raised. The request body must have been read already."""
    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work_task.cancel()
        raise
    finally:
        watch.cancel()
    if not work_task.done():
        work_task.cancel()
        raise ClientDisconnected()
    return work_task.result()


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that always listens for the client's disconnect while it streams."""

    media_type = "text/event-stream"

    def __init__(self, content: ContentStream, headers: dict[str, str] | None = None) -> None:
        super().__init__(
            content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def stream_then_stop() -> None:
                # a socket that fails mid-write means the client is gone, same as a disconnect
                with contextlib.suppress(OSError):
                    await self.stream_response(send)
                group.cancel_scope.cancel()

            group.start_soon(stream_then_stop)
            await _wait_for_disconnect(receive)
            group.cancel_scope.cancel()
        aclose = getattr(self.body_iterator, "aclose", None)
        if aclose is not None:
            await aclose()
