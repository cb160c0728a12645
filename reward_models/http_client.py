"""HTTP transport of every remote scorer: its settings (HttpSettings) and the client built from them (HttpClient).

Failure handling, learnt from the published methods' reward servers (which retried up to 1000 times, stalling
training for hours, and turned failures into silent zeros):
- every attempt has a timeout: timeout_s bounds the whole attempt (connect, headers and body), so
  a server that trickles its answer a byte at a time is cut off too; attempts are bounded
  (max_attempts), and deadline_s bounds the total time of one call including retries (without it:
  about max_attempts x timeout_s plus the backoffs);
- `token` sends `Authorization: Bearer <token>` (servers started with --token need it); a redirect to
  another origin (scheme, host, port) is refused with RemoteRewardError, so the token never leaves the
  server it was configured for (a redirect on the same origin is followed, as before);
- transport errors (refused, reset, cut off) and the statuses in `retry_statuses` (default 429, 500,
  502, 503, 504) are retried, with capped exponential backoff and jitter; other statuses (400, 401,
  404, 413, ...) are the server's final answer (HTTPStatusError). 500 is retried because the reward
  server answers 500 whenever its scorer raises, and the usual cause (CUDA out of memory, a worker
  restarting, an upstream hiccup behind vLLM) passes; a deterministic failure costs only the bounded
  attempts (by default 4, under 4 s of backoff) before the same loud error;
- a server that stays down or keeps failing raises RemoteRewardError: one line naming the URL, the
  attempts, the time and the last error (its status and the server's message);
- an answer is read only up to `max_response_bytes` (default 64 MiB; a declared Content-Length over it
  is refused before any byte of the body is read), and only as JSON: a Content-Type other than
  application/json (or +json) is refused (ResponseRefused, a ValueError: the server's final answer).
  Header lines are bounded by http.client (100 lines of 64 KiB), their time by timeout_s.
The reward server client (reward_models.remote), the VLM judges (reward_models.judge_client) and the
GenEval detector client (reward_models.geneval) build their HttpClient from an HttpSettings.
Standard library only (urllib).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from dataclasses import dataclass, fields
from typing import Any, Sequence

RETRY_STATUSES = (429, 500, 502, 503, 504)
MAX_RESPONSE_BYTES = 64 * 2**20  # a score list or a chat completion is KBs; detections with masks a few MB
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class HttpSettings:
    """The settings every remote scorer takes for its server, under these names in its config entry."""

    url: str  # http(s)://host[:port]
    timeout_s: float = 120.0  # one whole attempt: connect, headers and body
    max_attempts: int = 4
    backoff_s: float = 0.5  # first wait between attempts, doubled each time ...
    max_backoff_s: float = 10.0  # ... up to this
    deadline_s: float | None = None  # the whole call, retries included
    retry_statuses: Sequence[int] = RETRY_STATUSES
    seed: int | None = None  # of the backoff jitter
    token: str | None = None  # bearer token, or env:NAME
    health_check: bool = True  # ask the server once, before the first request, whether it is ready
    max_response_bytes: int = MAX_RESPONSE_BYTES  # the largest answer read (more: ResponseRefused)

    @classmethod
    def take(cls, url: str, settings: dict[str, Any]) -> "HttpSettings":
        """HttpSettings from url and the fields that `settings` holds, which are popped from it."""
        return cls(url, **{f.name: settings.pop(f.name) for f in fields(cls) if f.name in settings})


class RemoteRewardError(RuntimeError):
    """The reward server could not be reached, or gave an answer that cannot be used."""


class ResponseRefused(ValueError):
    """An answer the client will not read: over max_response_bytes, or not JSON (its Content-Type)."""


class HTTPStatusError(Exception):
    """A non-retryable HTTP status: the server answered, and the answer is an error."""

    def __init__(self, status: int, detail: str):
        detail = _one_line(detail)
        super().__init__(f"HTTP {status}: {detail}")
        self.status, self.detail = status, detail


class _CrossOriginRedirect(Exception):
    def __init__(self, code: int, url: str):
        super().__init__(code, url)
        self.code, self.url = code, url


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(scheme)


class _SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only on the same scheme, host and port: the bearer token (and the request) never go
    to another host. urllib would otherwise copy the Authorization header to wherever Location points."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if _origin(newurl) != _origin(req.full_url):
            raise _CrossOriginRedirect(code, newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class _AttemptClock:
    """Shuts an attempt's sockets when its time is up. A per-read socket timeout never fires on a server
    that trickles one byte a second; this bounds the attempt as a whole."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.expired = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            if self.expired:
                _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                _shut(sock)

    def cancel(self) -> None:
        self._timer.cancel()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in recv; it sees the connection end
    except OSError:
        pass


def _watched(base: type, clock: _AttemptClock) -> type:
    class Watched(base):  # type: ignore[valid-type,misc]
        def connect(self) -> None:
            super().connect()
            clock.watch(self.sock)

    return Watched


class _WatchedHTTP(urllib.request.HTTPHandler):
    def __init__(self, clock: _AttemptClock):
        super().__init__()
        self.clock = clock

    def http_open(self, req):
        return self.do_open(_watched(http.client.HTTPConnection, self.clock), req)


class _WatchedHTTPS(urllib.request.HTTPSHandler):
    def __init__(self, clock: _AttemptClock):
        super().__init__()
        self.clock = clock

    def https_open(self, req):
        return self.do_open(_watched(http.client.HTTPSConnection, self.clock), req, context=self._context)


class HttpClient:
    """Bounded, retrying HTTP for every remote scorer (reward servers, VLM judges, detectors).

    send() makes at most max_attempts attempts, each bounded as a whole by timeout_s (connect, headers
    and body: a trickling server is cut off), all within deadline_s when set. Transport errors and
    retry_statuses are retried after a capped exponential backoff with jitter; any other HTTP
    error status raises HTTPStatusError at once (the server's final answer); running out of
    attempts or time raises RemoteRewardError naming the URL, the attempts, the time and the last
    error, on one line. A redirect to another origin raises RemoteRewardError at once; a 2xx answer
    that is not JSON or is over max_response_bytes raises ResponseRefused. Counters go to the `counters` given (the owning scorer's), under a lock, so one client
    may serve a pool of threads. A `stop` event ends waiting and retrying early: a batch whose
    first request found the server down does not wait out every other request's retries.
    Standard library only (urllib).
    """

    def __init__(
        self,
        settings: HttpSettings,
        *,
        counters: Counter | None = None,
        what: str = "reward server",
        headers: dict[str, str] | None = None,
    ):
        token = resolve_token(settings.token)
        url, timeout_s, max_attempts = settings.url, settings.timeout_s, settings.max_attempts
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"{what} url must be http(s)://host[:port], got {url!r}")
        if int(max_attempts) < 1 or not timeout_s > 0:
            raise ValueError("max_attempts must be >= 1 and timeout_s > 0")
        self.url = url.rstrip("/")
        self.timeout_s, self.max_attempts = float(timeout_s), int(max_attempts)
        self.backoff_s, self.max_backoff_s = float(settings.backoff_s), float(settings.max_backoff_s)
        self.deadline_s = None if settings.deadline_s is None else float(settings.deadline_s)
        self.retry_statuses = frozenset(int(s) for s in settings.retry_statuses)
        self.max_response_bytes = int(settings.max_response_bytes)
        if self.max_response_bytes < 1:
            raise ValueError(f"max_response_bytes must be >= 1, got {settings.max_response_bytes}")
        self.headers = dict(headers or {})
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.counters = counters if counters is not None else Counter()
        self.what = what
        self._rng = random.Random(settings.seed)
        self._lock = threading.Lock()
        # Loopback never goes through an environment proxy; other hosts follow the environment.
        self._handlers = [urllib.request.ProxyHandler({})] if parsed.hostname in _LOOPBACK else []

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def backoff(self, attempt: int) -> float:
        """Wait before attempt+1: capped exponential, times a jitter in [0.5, 1) so clients that
        failed together do not retry together."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) * self._rng.uniform(0.5, 1.0)

    def send(self, method: str, path: str, body: bytes | None = None, *, stop: threading.Event | None = None) -> bytes:
        url = self.url + path
        start = time.monotonic()
        deadline = start + self.deadline_s if self.deadline_s is not None else float("inf")
        last, attempts = "no attempt made (deadline_s too small)", 0
        self.count("requests")
        headers = dict(self.headers)
        if body:
            headers["Content-Type"] = "application/json"
        while attempts < self.max_attempts:
            if stop is not None and stop.is_set():
                last = f"stopped: another request of the batch failed; before that: {last}"
                break
            timeout = min(self.timeout_s, deadline - time.monotonic())
            if timeout <= 0:
                break
            attempts += 1
            self.count("attempts")
            request = urllib.request.Request(url, data=body, method=method, headers=headers)
            clock = _AttemptClock(timeout)
            opener = urllib.request.build_opener(
                *self._handlers, _WatchedHTTP(clock), _WatchedHTTPS(clock), _SameOriginRedirects()
            )
            try:
                with opener.open(request, timeout=timeout) as response:
                    data = self._read(response)
                if clock.expired:  # the shut socket can look like a short, complete body
                    raise TimeoutError(f"no complete answer within {timeout:.3g}s")
                return data
            except _CrossOriginRedirect as e:
                raise RemoteRewardError(
                    f"{self.what} {url} redirected (HTTP {e.code}) to {e.url}, another host: refused, the request "
                    "and its bearer token go only to the configured url (set url to the server's own address)"
                ) from None
            except urllib.error.HTTPError as e:
                detail = _error_detail(e)
                if e.code not in self.retry_statuses:
                    raise HTTPStatusError(e.code, detail) from None
                last = f"HTTP {e.code}: {detail}"
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                reason = getattr(e, "reason", e)
                last = (
                    f"timed out: no complete answer within {timeout:.3g}s"
                    if clock.expired
                    else f"{type(reason).__name__}: {reason}"
                )
            finally:
                clock.cancel()
            if attempts < self.max_attempts:
                wait = min(self.backoff(attempts), deadline - time.monotonic())
                if wait <= 0:
                    break
                self.count("retries")
                if stop is not None:
                    stop.wait(wait)
                else:
                    time.sleep(wait)
        self.count("unreachable")
        raise RemoteRewardError(
            f"{self.what} {url} failed: {attempts} attempt(s) in {time.monotonic() - start:.1f}s "
            f"(timeout {self.timeout_s:g}s each); last error: {_one_line(last)}"
        )

    def _read(self, response) -> bytes:
        """The body of a 2xx answer: JSON (or no Content-Type at all), at most max_response_bytes."""
        content_type = response.headers.get("Content-Type")
        if content_type is not None:
            media = content_type.split(";")[0].strip().lower()
            if media != "application/json" and not media.endswith("+json"):
                raise ResponseRefused(f"answered Content-Type {_one_line(content_type)!r}, not application/json")
        cap = self.max_response_bytes
        declared = response.headers.get("Content-Length")
        if declared is not None and declared.strip().isdecimal() and int(declared) > cap:
            raise ResponseRefused(f"answer of {int(declared)} bytes is over max_response_bytes={cap}")
        chunks, size = [], 0
        while size <= cap:
            chunk = response.read(min(1 << 20, cap + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > cap:
            raise ResponseRefused(f"answer is over max_response_bytes={cap}")
        return b"".join(chunks)

    def health(self) -> dict:
        """GET /health of a server in this package's style; RemoteRewardError unless it answers status ok."""
        try:
            info = self.get_json("/health")
        except (HTTPStatusError, ResponseRefused) as e:
            raise RemoteRewardError(f"{self.what} {self.url}/health: {e}") from None
        except ValueError as e:
            raise RemoteRewardError(f"{self.what} {self.url}/health answered non-JSON: {e}") from None
        if not isinstance(info, dict) or info.get("status") != "ok":
            raise RemoteRewardError(f"{self.what} {self.url}/health is not ok: {str(info)[:200]}")
        return info

    def get_json(self, path: str, **kwargs):
        """GET path and parse JSON (ValueError on a non-JSON body)."""
        return json.loads(self.send("GET", path, **kwargs))

    def post_json(self, path: str, payload, **kwargs):
        """POST a JSON payload (no NaN) and parse the JSON answer (ValueError on a non-JSON body)."""
        return json.loads(self.send("POST", path, json.dumps(payload, allow_nan=False).encode(), **kwargs))


def resolve_token(token: str | None) -> str | None:
    """A bearer token as configured: the value itself, or `env:NAME` (kept out of config files and logs)."""
    if token is None or not token.startswith("env:"):
        return token
    name = token[4:]
    value = os.environ.get(name)
    if not value:
        raise ValueError(f"token: environment variable {name} is not set")
    return value


def _error_detail(e: urllib.error.HTTPError) -> str:
    try:
        text = e.read(500).decode("utf-8", "replace")
    except Exception:  # the body is only for the message
        text = ""
    try:
        detail = str(json.loads(text).get("error", text))
    except (ValueError, AttributeError):
        detail = text or str(e.reason)
    return _one_line(detail)


def _one_line(text: str, limit: int = 500) -> str:
    """`text` on one line (whitespace runs, newlines included, become one space), at most `limit` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
