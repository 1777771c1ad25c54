"""How a request's failure before its first byte is described: to the log (with the replica's address), to the
client (by pod name, never the address: docs/architecture.md#engine-and-router) and to the failover loop
(whether it is the replica's fault, so it is ejected and the request retried elsewhere, or the request's own).
"""

from __future__ import annotations

from aiohttp import web
from multidict import CIMultiDict

from kvpilot.router.errors import error_response
from kvpilot.router.poller import TIMEOUT
from kvpilot.router.replica import Replica

REPLICA_HEADER = "x-kvpilot-replica"


class UpstreamFailure(Exception):
    """The request failed before the client got any byte: by the replica's fault (eject it, retry elsewhere)
    or, not ``replica_fault``, its own (answer ``status`` at once). ``str()`` is for the log (it holds the
    replica's URL); :meth:`client_message` is for the client."""

    def __init__(
        self,
        reason: str,
        detail: str,
        problem: str,
        response: tuple[int, CIMultiDict[str], bytes] | None = None,
        *,
        replica_fault: bool = True,
        status: int = 502,
        code: str = "upstream_failed",
    ):
        super().__init__(detail)
        self.reason = reason
        self.problem = problem  # what went wrong, without addresses
        self.response = response  # what the replica answered, if it answered (502/503/504)
        self.replica_fault = replica_fault
        self.status, self.code = status, code  # the client's answer when the replica gave none
        self.replica_url: str | None = None
        self.replica_id = ""  # the x-kvpilot-replica value of the replica that failed
        self.replica_name = describe(None)

    def client_message(self) -> str:
        return f"{self.replica_name} failed before answering: {self.problem}"

    def client_response(self) -> web.Response:
        """What the client gets when no replica answered: the last replica's own 502/503/504 as it said it,
        else a 502 (504 for the request timeout) naming the failure."""
        replica = {REPLICA_HEADER: self.replica_id}
        if self.response is None:
            return error_response(self.status, self.client_message(), self.code, headers=replica)
        status, headers, body = self.response
        response = web.Response(status=status, body=body, headers=headers)
        response.headers.update(replica)
        return response


def replica_id(replica: Replica) -> str:
    """The ``x-kvpilot-replica`` value: the pod's name where discovery knows it, else the configured URL."""
    return replica.pod or replica.url


def describe(replica: Replica | None) -> str:
    """A replica as clients may see it: its pod's name if known, never its address."""
    pod = replica.pod if replica is not None else None
    return f"engine replica {pod}" if pod else "an upstream replica"


def request_timeout(replica: Replica) -> UpstreamFailure:
    return UpstreamFailure(
        TIMEOUT,
        f"{replica.url}: no answer within the request timeout",
        "it ran past the router's request timeout",
        replica_fault=False,
        status=504,
        code="upstream_timeout",
    )
