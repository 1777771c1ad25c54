"""Streaming requests to an OpenAI-compatible endpoint, timestamped at the client.

The hot path does nothing per token but take a timestamp per network read and split lines: the JSON of
each SSE event is parsed only after the stream ended, so parsing cost never shifts a timestamp. Events that
arrived in the same read share its timestamp, which is when the client could first have seen them.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from kvpilot.bench.config import EndpointConfig
from kvpilot.bench.records import (
    ERROR_CONNECTION,
    ERROR_EMPTY_OUTPUT,
    ERROR_INVALID_RESPONSE,
    ERROR_STREAM_BROKEN,
    ERROR_TIMEOUT,
    RequestRecord,
)
from kvpilot.bench.workloads import RequestSpec

_DETAIL_CHARS = 400  # how much of an error body or exception text a record keeps (an OpenAI error fits)


class ProbeError(Exception):
    """A prompt-length probe got no usable answer; the message says what came back."""


class _Failure(Exception):
    """Ends one request with an error type (see ``kvpilot.bench.records``) and a short detail."""

    def __init__(self, error_type: str, detail: str):
        super().__init__(error_type, detail)
        self.error_type = error_type
        self.detail = detail


class OpenAIStreamClient:
    """Sends benchmark requests to one endpoint over a shared aiohttp session."""

    def __init__(self, session: aiohttp.ClientSession, endpoint: EndpointConfig, model: str):
        self._session = session
        self._endpoint = endpoint
        self._model = model
        self._url = endpoint.base_url.rstrip("/") + endpoint.request_path

    def payload(self, spec: RequestSpec) -> dict:
        """The JSON body for ``spec``."""
        body: dict = {
            "model": self._model,
            "max_tokens": spec.max_tokens,
            "stream": True,
            "temperature": self._endpoint.temperature,
        }
        if self._endpoint.api == "chat":
            messages = [{"role": "user", "content": spec.prompt}]
            if spec.system_prompt is not None:
                messages.insert(0, {"role": "system", "content": spec.system_prompt})
            body["messages"] = messages
        else:
            prefix = "" if spec.system_prompt is None else spec.system_prompt + "\n\n"
            body["prompt"] = prefix + spec.prompt
        if self._endpoint.include_usage:
            body["stream_options"] = {"include_usage": True}
        if self._endpoint.ignore_eos:
            body["ignore_eos"] = True
        if self._endpoint.min_tokens_equal_max:
            body["min_tokens"] = spec.max_tokens
        if spec.tenant is not None:
            body["user"] = spec.tenant
        return body

    async def count_prompt_tokens(self, spec: RequestSpec) -> int | None:
        """The ``usage.prompt_tokens`` the server reports for ``spec``'s prompt, sent as the benchmark sends
        it but unstreamed for one output token; None when the answer carries no usage."""
        body = self.payload(spec) | {"stream": False, "max_tokens": 1}
        body.pop("stream_options", None)
        headers = {} if spec.tenant is None else {"x-tenant": spec.tenant}
        try:
            async with self._session.post(self._url, json=body, headers=headers) as response:
                if response.status != 200:
                    raise ProbeError(f"HTTP {response.status}: {await _body_excerpt(response)}")
                answer = await response.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise ProbeError(f"{type(exc).__name__}: {exc}") from None
        usage = answer.get("usage") if isinstance(answer, dict) else None
        return _int_or_none(usage.get("prompt_tokens")) if isinstance(usage, dict) else None

    async def send(
        self,
        spec: RequestSpec,
        *,
        phase: str,
        t0: float,
        scheduled_s: float,
        gate: asyncio.Semaphore | None = None,
    ) -> RequestRecord:
        """Issue ``spec`` (after taking a slot of ``gate``, if given) and measure it; never raises for a
        failed request, which comes back with ``error_type`` set."""
        if gate is None:
            return await self._send(spec, phase, t0, scheduled_s)
        async with gate:
            return await self._send(spec, phase, t0, scheduled_s)

    async def _send(self, spec: RequestSpec, phase: str, t0: float, scheduled_s: float) -> RequestRecord:
        clock = time.perf_counter
        headers = {} if spec.tenant is None else {"x-tenant": spec.tenant}
        body = self.payload(spec)
        record = RequestRecord(
            index=spec.index,
            phase=phase,
            prompt_words=spec.prompt_words,
            max_tokens=spec.max_tokens,
            tenant=spec.tenant,
            scheduled_s=scheduled_s,
            sent_s=clock() - t0,
        )
        try:
            events, record.end_s = await self._stream(body, headers, t0)
            _apply_events(record, events, chat=self._endpoint.api == "chat")
        except _Failure as failure:
            record.end_s = clock() - t0
            record.emit_s = []
            record.error_type, record.error_detail = failure.error_type, failure.detail[:_DETAIL_CHARS]
        return record

    async def _stream(self, body: dict, headers: dict, t0: float) -> tuple[list[tuple[float, bytes]], float]:
        """Timestamped SSE data payloads of one request up to (not including) ``[DONE]``, and the time
        ``[DONE]`` arrived."""
        clock = time.perf_counter
        events: list[tuple[float, bytes]] = []
        got_response = False
        try:
            async with self._session.post(self._url, json=body, headers=headers) as response:
                got_response = True
                if response.status != 200:
                    raise _Failure(f"http_{response.status}", await _body_excerpt(response))
                buffer = b""
                async for data in response.content.iter_any():
                    now = clock() - t0
                    buffer += data
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        if line.startswith(b"data:"):
                            payload = line[5:].strip()
                            if payload == b"[DONE]":
                                return events, now
                            events.append((now, payload))
        except aiohttp.ConnectionTimeoutError as exc:
            raise _Failure(ERROR_CONNECTION, f"connect timeout: {exc}") from None
        except asyncio.TimeoutError:
            raise _Failure(ERROR_TIMEOUT, "request timeout expired") from None
        except aiohttp.ClientPayloadError as exc:
            raise _Failure(ERROR_STREAM_BROKEN, str(exc)) from None
        except aiohttp.ClientError as exc:
            kind = ERROR_STREAM_BROKEN if got_response else ERROR_CONNECTION
            raise _Failure(kind, f"{type(exc).__name__}: {exc}") from None
        raise _Failure(ERROR_STREAM_BROKEN, f"stream ended without 'data: [DONE]' after {len(events)} events")


async def _body_excerpt(response: aiohttp.ClientResponse) -> str:
    try:
        return (await response.text())[:_DETAIL_CHARS]
    except (aiohttp.ClientError, UnicodeDecodeError, asyncio.TimeoutError):
        return ""


def _apply_events(record: RequestRecord, events: list[tuple[float, bytes]], *, chat: bool) -> None:
    """Fill emits, usage and finish reason of ``record`` from its stream's events."""
    for when, payload in events:
        try:
            event = json.loads(payload)
        except ValueError:
            raise _Failure(ERROR_INVALID_RESPONSE, f"unparsable event: {payload[:80]!r}") from None
        if not isinstance(event, dict):
            raise _Failure(ERROR_INVALID_RESPONSE, f"event is not a JSON object: {payload[:80]!r}")
        if event.get("error"):
            raise _Failure(ERROR_INVALID_RESPONSE, f"error in stream: {event['error']}")
        usage = event.get("usage")
        if isinstance(usage, dict):
            record.usage_prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
            record.usage_output_tokens = _int_or_none(usage.get("completion_tokens"))
        carried_text = False
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                raise _Failure(ERROR_INVALID_RESPONSE, f"choice is not a JSON object: {payload[:80]!r}")
            text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            carried_text = carried_text or bool(text)
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
        if carried_text:
            record.emit_s.append(when)
    if not record.emit_s:
        raise _Failure(ERROR_EMPTY_OUTPUT, f"complete stream of {len(events)} events without output text")


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
