"""OpenAI error objects: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status.

Every client mistake is an ``APIError`` with a 4xx status; a 500 means a bug in the server, never bad
input. ``code`` is also the ``reason`` label of ``kvpilot_requests_rejected_total``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


_HTTP_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        retry_after: int | None = None,
        headers: dict[str, str] | None = None,
        closes: bool = False,
    ) -> None:
        """``closes``: the request's body was left unread (or undecodable), so the connection cannot carry
        another request; the answer says ``Connection: close``."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after
        self._headers = dict(headers or {})
        self.closes = closes

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        headers = dict(self._headers)
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        if self.closes:
            headers["Connection"] = "close"
        return headers


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> APIError:
    return APIError(400, message, code=code, param=param)


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") in (
        "model_attributes_type",
        "dict_type",
    ):
        # a form or text body (curl -d without a Content-Type header sends a form)
        return "the body must be a JSON object, sent with Content-Type: application/json", None

    def field_of(error: Any) -> list[str]:  # "body" and the union-member tags ("str", "list[int]") dropped
        return [
            str(p)
            for p in error.get("loc", ())
            if p != "body" and str(p) not in _TYPE_TAGS and "[" not in str(p)
        ]

    loc = field_of(first)
    # of a union's errors for one field, the member of the value's own kind says what is wrong with it (a
    # list of 65 stop strings is too long, not "not a string")
    kind = "list[" if isinstance(first.get("input"), list) else None
    for error in errors:
        if kind and field_of(error) == loc and any(str(p).startswith(kind) for p in error.get("loc", ())):
            first = error
            break
    param = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return (
        f"{param}: {first.get('msg', 'invalid value')}{more}"
        if param
        else f"{first.get('msg', 'invalid request body')}{more}"
    ), param


def install_error_handlers(app: FastAPI, count_rejection: Callable[[str], None]) -> None:
    """Every error leaves as an OpenAI error object; each is counted by its code. (The decorator form:
    starlette's ``add_exception_handler`` types each handler as taking any ``Exception``.)"""

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        count_rejection(exc.code)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return await on_api_error(request, bad_request(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        error = APIError(exc.status_code, str(exc.detail), code=code)
        count_rejection(code)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        error = APIError(500, f"internal server error: {type(exc).__name__}", code="internal_error")
        return error_response(error)
