"""OpenAI-style JSON error responses from the router itself (the engines' own errors pass through as is)."""

from __future__ import annotations

from aiohttp import web

# status → OpenAI error type
_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          413: "invalid_request_error", 502: "bad_gateway", 503: "service_unavailable", 504: "timeout"}


def error_response(status: int, message: str, code: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": None,
                      "code": code}}
    return web.json_response(body, status=status, headers=headers)
