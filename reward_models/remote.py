"""Client scorer for any HTTP reward server speaking reward_models.wire (JSON + PNG, no pickle).

Failure handling, learnt from the published methods' reward servers (which retried up to 1000 times, stalling
training for hours, and turned failures into silent zeros):
- every attempt has a timeout: timeout_s bounds the whole attempt (connect, headers and body), so
  a server that trickles its answer a byte at a time is cut off too; attempts are bounded
  (max_attempts), and deadline_s bounds the total time of one call including retries (without it:
  about max_attempts x timeout_s plus the backoffs);
- `token` sends `Authorization: Bearer <token>` (servers started with --token need it);
- only transport errors and HTTP 429/502/503/504 are retried, with capped exponential backoff
  and jitter; other statuses are the server's final answer;
- a server that stays down raises RemoteRewardError naming the URL, the attempts and the time;
- a bad answer (non-JSON, wrong lengths, HTTP 500, ...) raises, or with on_bad_response="nan"
  gives NaN rows and counts counters["bad_responses"];
- a health check (GET /health) runs before the first request and tells the client which prompts
  and metadata the server's scorer needs.
HttpClient is that transport on its own; the VLM judge and the GenEval detector client reuse it.
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
from typing import Sequence

import torch

from .base import Scorer
from .registry import register
from .wire import WireError, decode_scores, encode_request

RETRY_STATUSES = (429, 502, 503, 504)
BAD_RESPONSE_POLICIES = ("raise", "nan")
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class RemoteRewardError(RuntimeError):
    """The reward server could not be reached, or gave an answer that cannot be used."""


class HTTPStatusError(Exception):
    """A non-retryable HTTP status: the server answered, and the answer is an error."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"HTTP {status}: {detail}")
        self.status, self.detail = status, detail


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
    error. Counters go to the `counters` given (the owning scorer's), under a lock, so one client
    may serve a pool of threads. A `stop` event ends waiting and retrying early: a batch whose
    first request found the server down does not wait out every other request's retries.
    Standard library only (urllib).
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 120.0,
        max_attempts: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        deadline_s: float | None = None,
        retry_statuses: Sequence[int] = RETRY_STATUSES,
        seed: int | None = None,
        headers: dict[str, str] | None = None,
        counters: Counter | None = None,
        what: str = "reward server",
        token: str | None = None,
    ):
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"{what} url must be http(s)://host[:port], got {url!r}")
        if int(max_attempts) < 1 or not timeout_s > 0:
            raise ValueError("max_attempts must be >= 1 and timeout_s > 0")
        self.url = url.rstrip("/")
        self.timeout_s, self.max_attempts = float(timeout_s), int(max_attempts)
        self.backoff_s, self.max_backoff_s = float(backoff_s), float(max_backoff_s)
        self.deadline_s = None if deadline_s is None else float(deadline_s)
        self.retry_statuses = frozenset(int(s) for s in retry_statuses)
        self.headers = dict(headers or {})
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.counters = counters if counters is not None else Counter()
        self.what = what
        self._rng = random.Random(seed)
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
            opener = urllib.request.build_opener(*self._handlers, _WatchedHTTP(clock), _WatchedHTTPS(clock))
            try:
                with opener.open(request, timeout=timeout) as response:
                    data = response.read()
                if clock.expired:  # the shut socket can look like a short, complete body
                    raise TimeoutError(f"no complete answer within {timeout:.3g}s")
                return data
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
            f"(timeout {self.timeout_s:g}s each); last error: {last}"
        )

    def get_json(self, path: str, **kwargs):
        """GET path and parse JSON (ValueError on a non-JSON body)."""
        return json.loads(self.send("GET", path, **kwargs))

    def post_json(self, path: str, payload, **kwargs):
        """POST a JSON payload (no NaN) and parse the JSON answer (ValueError on a non-JSON body)."""
        return json.loads(self.send("POST", path, json.dumps(payload, allow_nan=False).encode(), **kwargs))


class RemoteScorer(Scorer):
    name = "remote"

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 120.0,
        max_attempts: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        deadline_s: float | None = None,
        retry_statuses: Sequence[int] = RETRY_STATUSES,
        on_bad_response: str = "raise",
        health_check: bool = True,
        batch_size: int = 16,
        key: str | None = None,
        seed: int | None = None,
        token: str | None = None,
    ):
        super().__init__(batch_size=batch_size, key=key)
        if on_bad_response not in BAD_RESPONSE_POLICIES:
            raise ValueError(f"on_bad_response must be one of {BAD_RESPONSE_POLICIES}, got {on_bad_response!r}")
        self.client = HttpClient(
            url,
            timeout_s=timeout_s,
            max_attempts=max_attempts,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
            deadline_s=deadline_s,
            retry_statuses=retry_statuses,
            seed=seed,
            counters=self.counters,
            token=resolve_token(token),
        )
        self.url = self.client.url
        self.on_bad_response = on_bad_response
        self.health_check = health_check
        self.server_info: dict | None = None
        self._server_key: str | None = None
        self._send_prompts = True

    @property
    def key(self) -> str:
        return self._key or self._server_key or self.name

    # -- transport -------------------------------------------------------------------------------

    def backoff(self, attempt: int) -> float:
        return self.client.backoff(attempt)

    def _send(self, method: str, path: str, body: bytes | None = None) -> bytes:
        return self.client.send(method, path, body)

    # -- protocol --------------------------------------------------------------------------------

    def health(self) -> dict:
        """GET /health; raises RemoteRewardError unless the server says it is ok."""
        try:
            info = json.loads(self._send("GET", "/health"))
        except HTTPStatusError as e:
            raise RemoteRewardError(f"reward server {self.url}/health: {e}") from None
        except ValueError as e:
            raise RemoteRewardError(f"reward server {self.url}/health answered non-JSON: {e}") from None
        if not isinstance(info, dict) or info.get("status") != "ok":
            raise RemoteRewardError(f"reward server {self.url}/health is not ok: {str(info)[:200]}")
        self.server_info = info
        self._server_key = info.get("key") if isinstance(info.get("key"), str) else None
        self.requires_prompts = bool(info.get("requires_prompts", False))
        self.metadata_keys = tuple(info.get("metadata_keys") or ())
        return info

    def __call__(self, images, prompts=None, metadata=None):
        if self.health_check and self.server_info is None:
            self.health()
        # No prompts travel as null, not as empty strings, so a server that needs them says so.
        self._send_prompts = prompts is not None
        return super().__call__(images, prompts, metadata)

    def score_batch(self, images, prompts, metadata):
        n = len(prompts)
        request = encode_request(images, prompts if self._send_prompts else None, metadata)
        body = json.dumps(request, allow_nan=False).encode()
        try:
            server_key, scores = decode_scores(json.loads(self._send("POST", "/score", body)), n)
            return self._rename(server_key, scores)
        except (HTTPStatusError, WireError, ValueError) as e:  # json errors are ValueErrors
            self.counters["bad_responses"] += 1
            message = f"reward server {self.url}/score gave an unusable answer: {e}"
            if self.on_bad_response == "raise":
                raise RemoteRewardError(message) from None
            return {self.key: torch.full((n,), float("nan"))}

    def _rename(self, server_key: str, scores: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Server keys -> this client's key (main score '<key>', extras '<key>/<what>')."""
        self._server_key = self._server_key or server_key
        out = {}
        for name, value in scores.items():
            if name == server_key:
                out[self.key] = value
            elif name.startswith(server_key + "/"):
                out[self.key + name[len(server_key) :]] = value
            else:
                raise WireError(f"score '{name}' is not named after the main key '{server_key}'")
        return out


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
        return str(json.loads(text).get("error", text))
    except (ValueError, AttributeError):
        return text or str(e.reason)


@register("remote")
def build_remote(
    *,
    url: str,
    timeout_s: float = 120.0,
    max_attempts: int = 4,
    backoff_s: float = 0.5,
    max_backoff_s: float = 10.0,
    deadline_s: float | None = None,
    retry_statuses: Sequence[int] = RETRY_STATUSES,
    on_bad_response: str = "raise",
    health_check: bool = True,
    batch_size: int = 16,
    key: str | None = None,
    seed: int | None = None,
    token: str | None = None,
) -> RemoteScorer:
    """Any HTTP reward server speaking reward_models.wire (see scripts/reward_server.py); `token`: the
    server's bearer token, or `env:NAME` to read it from an environment variable."""
    return RemoteScorer(
        url,
        timeout_s=timeout_s,
        max_attempts=max_attempts,
        backoff_s=backoff_s,
        max_backoff_s=max_backoff_s,
        deadline_s=deadline_s,
        retry_statuses=retry_statuses,
        on_bad_response=on_bad_response,
        health_check=health_check,
        batch_size=batch_size,
        key=key,
        seed=seed,
        token=token,
    )
