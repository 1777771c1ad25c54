"""Per-connection byte and time bounds for a client that stops reading, set on each accepted connection of
the engine server and the router (docs/architecture.md#backpressure-and-cancellation).

A writer that waits for its transport's drain holds nothing once the transport pauses, but the bytes
below it are not the writer's to bound: the transport's write buffer (asyncio's default high-water mark is
64 KiB) and the kernel's send buffer, which Linux grows with the congestion window up to ``tcp_wmem``'s
maximum (4 MiB) unless SO_SNDBUF is set. On loopback a stream that was read fast, then not at all, left
~1.6 MB there before its request paused. Setting SO_SNDBUF turns that growth off: the kernel then keeps at
most twice the value asked for (the doubling covers its bookkeeping), so a connection holds at most
``write_buffer_bytes`` + 2 x ``send_buffer_bytes`` + one write.

TCP_USER_TIMEOUT (Linux) closes a connection whose peer accepts nothing for ``stall_timeout_s``: data
unacknowledged, or waiting behind a zero receive window, that long. It covers what no handler sees: a
response already written in full into the buffers of a client that never reads, a close that waits for
them to drain.
"""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass
from http import HTTPStatus

#: the smallest byte budget a connection can be given: the kernel's own floor for SO_SNDBUF is ~4.5 KiB
MIN_BUDGET_BYTES = 16 << 10


@dataclass(frozen=True)
class ConnectionLimits:
    #: SO_SNDBUF asked for; the kernel holds up to twice this of unsent or unacknowledged bytes
    send_buffer_bytes: int
    #: the transport's write-buffer high-water mark: a writer waiting for its drain pauses above it
    write_buffer_bytes: int
    #: seconds a peer may accept no bytes before the connection is closed (TCP_USER_TIMEOUT; 0 = the
    #: kernel's retransmission limits only, which a zero window never reaches)
    stall_timeout_s: float

    @classmethod
    def for_budget(cls, budget_bytes: int, stall_timeout_s: float) -> ConnectionLimits:
        """A connection's share of a ``budget_bytes`` stream budget: a quarter for the write buffer, a
        quarter for the kernel (SO_SNDBUF = an eighth, doubled by the kernel); the other half is the
        writer's own (a queue, a reader's buffer)."""
        if budget_bytes < MIN_BUDGET_BYTES:
            raise ValueError(f"a stream budget must be >= {MIN_BUDGET_BYTES} bytes, got {budget_bytes}")
        return cls(budget_bytes // 8, budget_bytes // 4, stall_timeout_s)

    @property
    def held_bytes(self) -> int:
        """The most a connection holds for a peer that reads nothing (plus the one write in progress)."""
        return self.write_buffer_bytes + 2 * self.send_buffer_bytes

    def apply(self, transport: asyncio.BaseTransport) -> None:
        """Bound ``transport`` (just accepted; a unix socket or a test's pipe only gets the write buffer)."""
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
            user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)  # Linux only
            if self.stall_timeout_s > 0 and user_timeout is not None:
                sock.setsockopt(socket.IPPROTO_TCP, user_timeout, max(1, round(self.stall_timeout_s * 1000)))
        if isinstance(transport, asyncio.WriteTransport):
            transport.set_write_buffer_limits(high=self.write_buffer_bytes, low=self.write_buffer_bytes // 4)


def raw_json_response(status: int, body: dict) -> bytes:
    """A whole HTTP/1.1 response with a JSON body and ``connection: close``, for a protocol handler to write
    itself when no application will (a request it could not parse, a head that never arrived)."""
    payload = json.dumps(body, separators=(",", ":")).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + payload
