"""The monitor's web server (the standard library's threaded HTTP server):

- ``/``: the dashboard, one static HTML page (``dashboard.html``, inline JavaScript drawing on
  ``<canvas>``, no external resources) that polls ``/api/state``;
- ``/api/state``: :meth:`SwarmState.to_json` as JSON;
- ``/metrics``: the Prometheus exposition of :mod:`.prometheus`, made by ``prometheus_client``.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hivemind_ext.monitoring.prometheus import registry_for
from hivemind_ext.monitoring.swarm_state import SwarmState

logger = logging.getLogger(__name__)


def dashboard_html() -> bytes:
    return resources.files("hivemind_ext.monitoring").joinpath("dashboard.html").read_bytes()


class MonitorServer:
    """Serves ``state`` on ``host:port`` from a background thread (port 0: any free port, see :attr:`port`)."""

    def __init__(self, state: SwarmState, *, host: str = "127.0.0.1", port: int = 8000) -> None:
        self.state = state
        registry, page = registry_for(state), dashboard_html()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # the name http.server calls
                path = self.path.split("?", 1)[0]
                if path in ("/", "/index.html"):
                    self._send(200, "text/html; charset=utf-8", page)
                elif path == "/api/state":
                    body = json.dumps(state.to_json(), allow_nan=False).encode()
                    self._send(200, "application/json", body)
                elif path == "/metrics":
                    self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))
                else:
                    self._send(404, "text/plain; charset=utf-8", b"not found\n")

            def _send(self, status: int, content_type: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("%s %s", self.address_string(), format % args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="MonitorServer", daemon=True)

    @property
    def host(self) -> str:
        return str(self._server.server_address[0])

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        """Stops serving and closes the socket. Idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(5)
        self._server.server_close()


__all__ = ["MonitorServer", "dashboard_html"]
