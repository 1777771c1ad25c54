"""A request body's Content-Encoding, undone by the ingress gate before the app parses the body
(docs/architecture.md#admission).

gzip (concatenated members too) and deflate (with or without its zlib header, told apart by its first byte
as aiohttp tells them) are decoded through zlib; no header or ``identity`` leaves the body as sent. Any other
coding is 415 with ``Accept-Encoding`` naming these, before the body is read: ``br`` and ``zstd`` included,
as no brotli or zstandard library is a dependency. The router and the activator decode with this same
decoder (``kvpilot.router.json_body.read_body``; aiohttp's own decoding is off there).

``--max-body-bytes`` bounds the decoded body as well as the sent one, counted as it is inflated: a bomb (a
few KiB that inflate to gigabytes) is 413 after at most the limit + 1 decoded bytes, never inflated whole.
A body that does not decode (corrupt, truncated, data after its end) is 400 ``invalid_encoding`` with the
router's wording. Either leaves the body unread or its coding broken, so the answer closes the connection.
"""

from __future__ import annotations

import zlib

from kvpilot.engine.server.errors import APIError

#: the codings decoded, as ``Accept-Encoding`` of a 415 names them
SUPPORTED = ("gzip", "deflate")
#: a gzip body may concatenate members (RFC 1952 §2.2); each costs a decompressor, so a body of thousands
#: of empty 20-byte members is refused instead of walked (aiohttp stops at 1024 too)
MAX_GZIP_MEMBERS = 1024
_IDENTITY = "identity"


def too_large(limit: int, decoded: bool = False) -> APIError:
    once = " once decoded from its Content-Encoding" if decoded else ""
    return APIError(
        413, f"the request body exceeds {limit} bytes{once}", code="request_too_large", closes=True
    )


def body_decoder(content_encoding: str | None, limit: int) -> BodyDecoder | None:
    """The decoder for a request's ``Content-Encoding`` header (None: the body is used as sent); 415 for a
    coding this server cannot decode, or more than one."""
    codings = [c.strip().lower() for c in (content_encoding or "").split(",")]
    codings = [c for c in codings if c and c != _IDENTITY]
    if not codings:
        return None
    if len(codings) == 1 and codings[0] in SUPPORTED:
        return BodyDecoder(codings[0], limit)
    raise APIError(
        415,
        f"Content-Encoding {content_encoding!r} is not supported: send the body as "
        f"{', '.join(SUPPORTED)} or {_IDENTITY} (one coding)",
        code="unsupported_encoding",
        headers={"Accept-Encoding": ", ".join(SUPPORTED)},
        closes=True,
    )


class BodyDecoder:
    """Feed the body's chunks as they arrive; each call returns what they decode to."""

    def __init__(self, encoding: str, limit: int) -> None:
        self.encoding = encoding
        self.limit = limit
        self.decoded_bytes = 0
        self._fed = False
        self._members = 1
        self._inflater: zlib._Decompress | None = None

    def _invalid(self, why: str = "") -> APIError:
        return APIError(
            400,
            f"request body is not valid {self.encoding} (its Content-Encoding){why}",
            code="invalid_encoding",
            closes=True,
        )

    def _new_inflater(self, first_byte: int) -> zlib._Decompress:
        if self.encoding == "gzip":
            return zlib.decompressobj(16 + zlib.MAX_WBITS)
        # RFC 1950: a zlib header's low nibble is 8 (deflate); clients that send raw deflate are common
        return zlib.decompressobj(zlib.MAX_WBITS if first_byte & 0x0F == 8 else -zlib.MAX_WBITS)

    def feed(self, chunk: bytes) -> bytes:
        if not chunk:
            return b""
        self._fed = True
        inflater = self._inflater = self._inflater or self._new_inflater(chunk[0])
        out, data = [], chunk
        try:
            while data:
                # never more than one byte past the limit: that byte proves the body too large
                piece = inflater.decompress(data, self.limit - self.decoded_bytes + 1)
                self.decoded_bytes += len(piece)
                if self.decoded_bytes > self.limit:
                    raise too_large(self.limit, decoded=True)
                out.append(piece)
                data = inflater.unconsumed_tail
                if inflater.eof and inflater.unused_data:
                    if self.encoding != "gzip":
                        raise self._invalid(": data after the end of its stream")
                    self._members += 1
                    if self._members > MAX_GZIP_MEMBERS:
                        raise self._invalid(f": more than {MAX_GZIP_MEMBERS} gzip members")
                    data = inflater.unused_data
                    inflater = self._inflater = self._new_inflater(data[0])
        except zlib.error:
            raise self._invalid() from None
        return b"".join(out)

    def finish(self) -> None:
        """The body has ended: its coded stream must have too (an empty body is left empty, as aiohttp
        leaves it)."""
        if self._fed and not (self._inflater is not None and self._inflater.eof):
            raise self._invalid(": it ends before its stream does")
