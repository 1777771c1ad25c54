"""A local HTTP file server standing in for a model mirror (an in-cluster HTTP server, an S3 endpoint, a
Hugging Face mirror): the e2e tests point ``spec.model.source`` at it, so nothing is ever fetched from
the internet. It serves registered files (URL path → a file on disk, streamed) with Content-Length, 404
for the rest, and records every request's path and headers. As an S3 stand-in (``require_signature``) it
answers 403 to a GET whose AWS Signature V4 is not the one those credentials give for it."""

from __future__ import annotations

import http.server
import shutil
import threading
from datetime import datetime, timezone
from pathlib import Path

from kvpilot.operator.s3_signing import Credentials, sign_get


class FileServer:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.files: dict[str, Path] = {}
        self.requests: list[str] = []
        self.headers: list[dict[str, str]] = []  # each request's, names in lower case
        self._signed_by: tuple[Credentials, str] | None = None
        served = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # the stdlib calls the handler by this name
                served.requests.append(self.path)
                served.headers.append({k.lower(): v for k, v in self.headers.items()})
                path = served.files.get(self.path.split("?", 1)[0])
                if not served.signature_ok(self.path, served.headers[-1]):
                    self.send_response(403)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if path is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(path.stat().st_size))
                self.end_headers()
                with path.open("rb") as source:
                    shutil.copyfileobj(source, self.wfile, 1 << 20)

            def log_message(self, format: str, *args: object) -> None:
                return

        self._httpd = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="file-server", daemon=True)

    def serve(self, url_path: str, file: Path) -> str:
        """Serve ``file`` at ``url_path``; returns its full URL."""
        self.files[url_path] = file
        return f"{self.url}{url_path}"

    def require_signature(self, credentials: Credentials, region: str) -> None:
        """From now on, every GET must be signed with ``credentials`` for ``region`` (service s3)."""
        self._signed_by = (credentials, region)

    def signature_ok(self, path: str, headers: dict[str, str]) -> bool:
        if self._signed_by is None:
            return True
        credentials, region = self._signed_by
        try:
            sent_at = datetime.strptime(headers["x-amz-date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
        except (KeyError, ValueError):
            return False
        expected = sign_get(f"{self.url}{path}", credentials, region, sent_at)
        return headers.get("authorization") == expected["authorization"]

    def start(self) -> FileServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
