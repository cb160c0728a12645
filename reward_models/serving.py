"""Reference reward server: any registered scorer over HTTP, speaking reward_models.wire.

Standard library only (http.server.ThreadingHTTPServer). Requests are parsed in parallel threads;
scoring is serialised by a lock, since one model on one device is not made faster by concurrent
forwards and most models are not thread-safe. Binds 127.0.0.1 unless told otherwise.
Status codes, every one answered with a one-line JSON body {"error": ...} (also those http.server raises
itself: 501 unknown method, 414 / 431 request line or headers too long, 400 malformed request line):
400 malformed request (also JSON nested too deeply, an invalid or repeated Content-Length, Transfer-Encoding
together with Content-Length, more body bytes than Content-Length declares), 401 missing or wrong bearer
token, 404 unknown path, 411 no Content-Length (chunked bodies are not accepted), 413 a body over
`max_body_bytes` (refused from its Content-Length, before any of it is read), an image over `max_pixels` or
a request whose images hold more than `max_request_pixels` in all (refused from the PNG headers, before
decoding any), 415 a body that is not application/json (the only type served), 503 over `max_connections`
open connections, 500 the scorer failed.

Limits (ServerLimits): the request line and headers must arrive within `header_timeout_s` and the body
within `body_timeout_s` of them, however slowly the bytes trickle (a watchdog shuts the socket); a
connection silent for `idle_timeout_s` is closed.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from .base import Scorer
from .wire import ImageTooLarge, WireError, decode_request, decode_video_request, encode_scores, parse_json

MAX_BODY_BYTES = 512 * 2**20
_BUSY_BODY = b'{"error": "too many open connections; retry"}'
_BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Content-Length: " + str(len(_BUSY_BODY)).encode() + b"\r\nConnection: close\r\n\r\n" + _BUSY_BODY
)


@dataclass
class ServerLimits:
    """What one client may cost the server."""

    max_body_bytes: int = MAX_BODY_BYTES
    max_pixels: int = 4096 * 4096  # per image, read from the PNG header before decoding
    max_request_pixels: int = 4 * 4096 * 4096  # all images of one request together, also from the headers
    header_timeout_s: float = 10.0  # request line + headers, in total
    body_timeout_s: float = 120.0  # the whole body, in total
    idle_timeout_s: float = 30.0  # any single wait for bytes (and an idle connection)
    max_connections: int = 64  # open at once; more are answered 503 (the client retries)


class _Watchdog:
    """Shuts a connection's socket when the current phase (headers, body) runs past its time."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._timer: Optional[threading.Timer] = None

    def arm(self, seconds: float) -> None:
        self.disarm()
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def is_loopback(host: str) -> bool:
    """True for a host only this machine can reach: localhost, 127.0.0.0/8, ::1."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


class LocalJSONServer(ThreadingHTTPServer):
    """A JSON-over-HTTP server on host:port (port 0 picks a free one; see .url). Requests are parsed in
    parallel threads; `lock` serialises the model calls. A host beyond loopback (e.g. 0.0.0.0, "") needs a
    bearer `token`: ValueError otherwise."""

    daemon_threads = True  # a hung client never keeps the process alive

    def __init__(
        self,
        handler: type,
        host: str,
        port: int,
        max_body_bytes: int,
        limits: Optional[ServerLimits] = None,
        token: Optional[str] = None,
    ):
        if not is_loopback(host) and not token:
            raise ValueError(
                f"host {host!r} serves beyond this machine: set a bearer token (token=..., or --token / "
                "FLOWGRPO_REWARD_TOKEN for scripts/reward_server.py), or bind 127.0.0.1"
            )
        self.limits = limits or ServerLimits(max_body_bytes=max_body_bytes)
        self.max_body_bytes = self.limits.max_body_bytes
        self.token = token or None
        self.lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.limits.max_connections)
        super().__init__((host, port), handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):  # over the connection cap: answer at once and close
            try:
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

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

    def setup(self) -> None:
        self.timeout = self.server.limits.idle_timeout_s  # StreamRequestHandler sets it on the socket
        super().setup()
        self._watchdog = _Watchdog(self.connection)

    def handle_one_request(self) -> None:
        self._watchdog.arm(self.server.limits.header_timeout_s)  # each request's line + headers, kept-alive too
        super().handle_one_request()

    def finish(self) -> None:
        self._watchdog.disarm()
        super().finish()

    def parse_request(self) -> bool:
        """After the headers: the body's clock starts, and the bearer token (if the server has one) is checked
        before any handler runs."""
        if not super().parse_request():
            return False
        self._watchdog.arm(self.server.limits.body_timeout_s)
        expected = self.server.token
        if expected is not None:
            given = self.headers.get("Authorization", "")
            scheme, _, value = given.partition(" ")
            ok = scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), expected.encode())
            if not ok:
                self.close_connection = True
                self._reply(
                    401,
                    {"error": "missing or wrong bearer token (Authorization: Bearer <token>)"},
                    {"WWW-Authenticate": "Bearer"},
                )
                return False
        return True

    def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
        """http.server's own errors (501 unknown method, 414 / 431 too long, 400 malformed request line) as
        one-line JSON, like every other answer, instead of an HTML page; the connection is closed."""
        self.close_connection = True
        if self.request_version == "HTTP/0.9":  # a malformed request line: still a status line and headers
            self.request_version = "HTTP/1.0"
        short = self.responses.get(code, ("error",))[0]
        text = message or short
        if explain and explain != text:
            text = f"{text}: {explain}"
        self._reply(code, {"error": text})

    def _reply(self, status: int, payload: dict, headers: Optional[dict] = None) -> None:
        self._watchdog.disarm()  # the request is in; a slow reader of the answer meets the idle timeout
        if status >= 400:
            self.close_connection = True  # an unread or refused body never becomes the next request
            if "error" in payload:
                payload = {**payload, "error": " ".join(str(payload["error"]).split())}  # one line
        body = json.dumps(payload, allow_nan=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _read_body(self) -> bytes | None:
        """The request body, read only up to its declared Content-Length and only when that is within the
        server's limit; or None after answering 411 (no Content-Length: chunked bodies are not accepted), 400
        (an invalid or repeated Content-Length, Transfer-Encoding beside it, more bytes than declared), 413 (over
        max_body_bytes) or 415 (not application/json)."""
        lengths = self.headers.get_all("Content-Length") or []
        chunked = self.headers.get("Transfer-Encoding") is not None
        if not lengths:
            why = "chunked transfer encoding is not accepted; " if chunked else ""
            self._reply(411, {"error": f"Content-Length required ({why}send the body with its length)"})
            return None
        declared = {value.strip() for value in lengths}
        if chunked or len(declared) != 1 or not next(iter(declared)).isascii() or not next(iter(declared)).isdigit():
            why = "Transfer-Encoding beside Content-Length" if chunked else f"invalid Content-Length {lengths}"
            self._reply(400, {"error": f"bad request: {why}"})
            return None
        length = int(declared.pop())
        if length > self.server.max_body_bytes:
            self._reply(413, {"error": f"body over {self.server.max_body_bytes} bytes; send smaller batches"})
            return None
        content_type = self.headers.get("Content-Type")
        if (content_type or "").split(";")[0].strip().lower() != "application/json":
            self._reply(415, {"error": f"Content-Type must be application/json, got {content_type!r}"})
            return None
        body = self.rfile.read(length)
        if len(body) < length:  # the watchdog (or the client) closed it mid-body
            self.close_connection = True
            return None
        if self._more_than_declared():
            self._reply(400, {"error": f"bad request: more body bytes than the declared Content-Length {length}"})
            return None
        self._watchdog.disarm()
        return body

    def _more_than_declared(self) -> bool:
        """Whether bytes beyond the declared body have already arrived (never waits, never reads them)."""
        sock = self.connection
        timeout = sock.gettimeout()
        try:
            sock.settimeout(0)  # a peek that finds nothing buffered returns at once
            return bool(self.rfile.peek(1))
        except OSError:
            return False
        finally:
            try:
                sock.settimeout(timeout)
            except OSError:
                pass

    def _parse_json(self, body: bytes):
        """The JSON body, or None after answering 400 (malformed, or nested too deeply)."""
        try:
            return parse_json(body)
        except ValueError as e:  # WireError and json errors
            self._reply(400, {"error": f"bad request: {e}"})
            return None


class RewardServer(LocalJSONServer):
    def __init__(
        self,
        scorer: Scorer,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_body_bytes: int = MAX_BODY_BYTES,
        verbose: bool = False,
        limits: Optional[ServerLimits] = None,
        token: Optional[str] = None,
    ):
        self.scorer, self.verbose = scorer, verbose
        super().__init__(RewardHandler, host, port, max_body_bytes, limits, token)

    def health_info(self) -> dict:
        s = self.scorer
        return {
            "status": "ok",
            "scorer": s.name,
            "key": s.key,
            "requires_prompts": bool(s.requires_prompts),
            "metadata_keys": list(s.metadata_keys),
            "inputs": scorer_inputs(s),
        }


def scorer_inputs(scorer: Scorer) -> str:
    """What a scorer's requests carry: "videos" (a video scorer: clips [B, F, 3, H, W]) or "images"."""
    return getattr(scorer, "inputs", "images")


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
        payload = self._parse_json(body)
        if payload is None:
            return
        wanted = scorer_inputs(self.server.scorer)
        other = "images" if wanted == "videos" else "videos"
        if isinstance(payload, dict) and wanted not in payload and other in payload:
            self._reply(400, {"error": f"bad request: this server scores {wanted}; send '{wanted}', not '{other}'"})
            return
        try:
            limits = self.server.limits
            decode = decode_video_request if wanted == "videos" else decode_request
            images, prompts, metadata = decode(payload, limits.max_pixels, limits.max_request_pixels)
        except ImageTooLarge as e:
            self._reply(413, {"error": str(e)})
            return
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
