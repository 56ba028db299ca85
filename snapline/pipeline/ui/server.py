"""The HTTP server of ``snapline ui``: ``/`` the page, ``/api/job.json`` the same data as
JSON. The standard library's threading HTTP server; nothing else to run.

Threads: ``serve_forever`` on the caller's thread; one thread per request (``ViewSource``
is safe to share).
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from snapline.pipeline.ui.page import render
from snapline.pipeline.ui.view import JobView, ViewSource

log = logging.getLogger(__name__)


def view_json(view: JobView) -> dict[str, Any]:
    return {
        "job": view.job,
        "storage": view.storage,
        "generated_at": view.generated_at,
        "workers": view.workers,
        "errors": view.errors,
        "tasks": [
            {
                "task": t.task_id,
                "stage": t.stage,
                "worker": view.task_worker(t.task_id),
                "partitions": [
                    {
                        "topic": p.topic,
                        "partition": p.partition,
                        "committed": p.committed,
                        "end": p.end,
                        "lag": p.lag,
                    }
                    for p in t.partitions
                ],
                "lag": view.lag_of(t),
                "records_per_second": view.rates.get(t.task_id),
                "checkpoints": [
                    {
                        "id": c.ref.checkpoint_id,
                        "attempt": c.ref.attempt,
                        "committed": c.committed,
                        "complete": c.complete,
                        "bytes": c.bytes,
                        "created_at": c.created_at,
                        "worker": c.worker,
                        "timings": c.timings,
                        "error": c.error,
                    }
                    for c in t.checkpoints
                ],
            }
            for t in view.tasks
        ],
        "history": [e.to_json() for e in view.history],
    }


class UIServer:
    """Serves one job's page on ``host:port`` (port 0: any free port, see ``port``)."""

    def __init__(self, source: ViewSource, host: str = "127.0.0.1", port: int = 8080) -> None:
        self.source = source
        handler = _handler(source)
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.host = host
        self.port = int(self.httpd.server_address[1])
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def start(self) -> None:
        """Serve on a background thread (tests)."""
        self._thread = threading.Thread(target=self.serve_forever, name="snapline-ui", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _handler(source: ViewSource) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            url = urlparse(self.path)
            query = parse_qs(url.query)
            if url.path in ("/", "/index.html"):
                refresh = int(query.get("refresh", ["5"])[0])
                self._send(200, "text/html; charset=utf-8", render(source.collect(), refresh))
            elif url.path == "/api/job.json":
                body = json.dumps(view_json(source.collect()), indent=1, default=str)
                self._send(200, "application/json", body)
            else:
                self._send(404, "text/plain", "not found: try / or /api/job.json")

        def _send(self, code: int, kind: str, body: str) -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            log.debug("ui: " + format, *args)

    return Handler
