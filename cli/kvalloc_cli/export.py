"""``kvalloc export [--port N] [--address A] [--max-segments N] [--once]``: Prometheus metrics of
every live pool on the machine.

A sidecar, like node_exporter: it reads the pools' statistics segments in /dev/shm, as ``kvalloc
ls`` and ``top`` do, and never touches an engine. It serves the Prometheus text format at
``http://ADDRESS:PORT/metrics`` (default 127.0.0.1:9464); ``--port 0`` takes a free port, and the
status line on stderr says which. Each scrape reads at most ``--max-segments`` segments (default
256), skipping, and counting, those that vanish, are corrupt or belong to a dead process.
``--once`` prints one scrape on stdout and exits. The metrics and their labels (pool, pid,
process) are listed in the README; ``kvalloc_exporter_*`` are the exporter's own.
"""

from __future__ import annotations

import argparse
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from .arguments import add_command, whole_number
from .exposition import CONTENT_TYPE, MAX_SEGMENTS, ExporterState, scrape

DEFAULT_PORT = 9464  # the port OpenTelemetry's Prometheus exporter uses by default
# A client that connects and sends nothing is dropped after this long, so that it cannot hold
# the exporter, which serves one scrape at a time.
CLIENT_TIMEOUT_S = 10.0

_INDEX = b"kvalloc exporter: metrics at /metrics\n"


def port_number(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must lie between 0 and 65535, not {value}")
    return value


def register(subparsers: Any) -> None:
    parser = add_command(subparsers, "export", "serve every live pool's metrics to Prometheus",
                         __doc__)
    parser.add_argument("--port", type=port_number, default=DEFAULT_PORT,
                        help=f"TCP port to serve on (default {DEFAULT_PORT}; 0: any free one)")
    parser.add_argument("--address", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; 0.0.0.0 for every "
                             "interface)")
    parser.add_argument("--max-segments", type=whole_number(1 << 20), default=MAX_SEGMENTS,
                        metavar="N", help=f"the most segments a scrape reads (default "
                                          f"{MAX_SEGMENTS})")
    parser.add_argument("--once", action="store_true",
                        help="print one scrape on stdout and exit, serving nothing")
    parser.set_defaults(run=run)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = CLIENT_TIMEOUT_S

    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            with self.server.scrape_lock:
                body = scrape(self.server.state).encode()
            self._reply(200, CONTENT_TYPE, body)
        elif path == "/":
            self._reply(200, "text/plain; charset=utf-8", _INDEX)
        else:
            self._reply(404, "text/plain; charset=utf-8", b"not found: try /metrics\n")

    def _reply(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        pass  # a line per scrape would fill the sidecar's log


class _Server(HTTPServer):
    def __init__(self, address: tuple[str, int], state: ExporterState) -> None:
        super().__init__(address, _Handler)
        self.state = state
        self.scrape_lock = threading.Lock()


def serve(address: str, port: int, state: ExporterState) -> _Server:
    """A server bound to (address, port), not yet serving: ``serve_forever()`` serves."""
    return _Server((address, port), state)


def run(args: argparse.Namespace) -> int:
    state = ExporterState(max_segments=args.max_segments)
    if args.once:
        sys.stdout.write(scrape(state))
        return 0
    try:
        server = serve(args.address, args.port, state)
    except OSError as exc:
        print(f"kvalloc export: cannot listen on {args.address}:{args.port}: {exc.strerror}",
              file=sys.stderr)
        return 1
    port = server.server_address[1]
    print(f"kvalloc export: serving http://{args.address}:{port}/metrics", file=sys.stderr,
          flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0
