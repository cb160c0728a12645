"""Reference reward server: any registered scorer over HTTP, speaking reward_models.wire.

Standard library only (http.server.ThreadingHTTPServer). Requests are parsed in parallel threads;
scoring is serialised by a lock, since one model on one device is not made faster by concurrent
forwards and most models are not thread-safe. Binds 127.0.0.1 unless told otherwise.
Status codes: 400 malformed request, 404 unknown path, 411/413 missing or too large body,
500 the scorer failed (the message is returned as {"error": ...}).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .base import Scorer
from .wire import WireError, decode_request, encode_scores

MAX_BODY_BYTES = 512 * 2**20


class LocalJSONServer(ThreadingHTTPServer):
    """A JSON-over-HTTP server on host:port (port 0 picks a free one; see .url). Requests are parsed in
    parallel threads; `lock` serialises the model calls."""

    daemon_threads = True  # a hung client never keeps the process alive

    def __init__(self, handler: type, host: str, port: int, max_body_bytes: int):
        self.max_body_bytes = max_body_bytes
        self.lock = threading.Lock()
        super().__init__((host, port), handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def serve_in_thread(self) -> threading.Thread:
        """Start serving in a daemon thread (tests, notebooks); stop with shutdown()."""
        thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        return thread


class JSONHandler(BaseHTTPRequestHandler):
    server: LocalJSONServer

    def _reply(self, status: int, payload: dict) -> None:
        body = json.dumps(payload, allow_nan=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _read_body(self) -> bytes | None:
        """The request body, or None after answering 411 (no length) / 413 (over the server's limit)."""
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._reply(411, {"error": "Content-Length required"})
            return None
        if int(length) > self.server.max_body_bytes:
            self._reply(413, {"error": f"body over {self.server.max_body_bytes} bytes; send smaller batches"})
            return None
        return self.rfile.read(int(length))


class RewardServer(LocalJSONServer):
    def __init__(self, scorer: Scorer, host: str = "127.0.0.1", port: int = 0, *,
                 max_body_bytes: int = MAX_BODY_BYTES, verbose: bool = False):
        self.scorer, self.verbose = scorer, verbose
        super().__init__(RewardHandler, host, port, max_body_bytes)

    def health_info(self) -> dict:
        s = self.scorer
        return {"status": "ok", "scorer": s.name, "key": s.key, "requires_prompts": bool(s.requires_prompts),
                "metadata_keys": list(s.metadata_keys)}

class RewardHandler(JSONHandler):
    server: RewardServer

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/health":
            self._reply(200, self.server.health_info())
        else:
            self._reply(404, {"error": f"unknown path {self.path}; use GET /health or POST /score"})

    def do_POST(self) -> None:
        if self.path.rstrip("/") != "/score":
            self._reply(404, {"error": f"unknown path {self.path}; use POST /score"})
            return
        body = self._read_body()
        if body is None:
            return
        try:
            images, prompts, metadata = decode_request(json.loads(body))
        except (ValueError, WireError) as e:  # json errors are ValueErrors
            self._reply(400, {"error": f"bad request: {e}"})
            return
        scorer = self.server.scorer
        try:
            with self.server.lock:
                scores = scorer(images, prompts, metadata)
        except (ValueError, TypeError) as e:  # input checks of the scorer: the client's mistake
            self._reply(400, {"error": f"{scorer.name}: {e}"})
            return
        except Exception as e:  # noqa: BLE001 - any scorer failure is reported, the server stays up
            self._reply(500, {"error": f"{scorer.name} failed: {type(e).__name__}: {e}"})
            return
        self._reply(200, encode_scores(scores, scorer.key))

    def log_message(self, format: str, *args) -> None:
        if self.server.verbose:
            super().log_message(format, *args)


def make_server(scorer: Scorer, host: str = "127.0.0.1", port: int = 0, **kwargs) -> RewardServer:
    """A server for `scorer` bound to host:port (port 0 picks a free one; see .url)."""
    return RewardServer(scorer, host, port, **kwargs)
