"""What every remote scorer's client (`remote`, `geneval`, `vlm_judge`: one HttpClient) does with a server that
errs, redirects or answers too much, over HTTP on 127.0.0.1 only: transient statuses and connection resets are
retried a bounded number of times, then one line names the URL, the status and the attempts; the bearer token
never follows a redirect to another host; an answer over `max_response_bytes` or of another content type is
refused. Every server here answers a bounded number of bytes, and every call is bounded in attempts and time."""

import json
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from reward_models import build_scorer
from reward_models.http_client import RETRY_STATUSES, HttpClient, HttpSettings
from reward_models.remote import RemoteRewardError

from .cli_helpers import ROOT, blocking_outcome, run_cli

FAST = dict(timeout_s=5.0, max_attempts=3, backoff_s=0.02, max_backoff_s=0.05, seed=0)
GENEVAL_META = {"geneval": [{"tag": "single_object", "include": [{"class": "cat", "count": 1}]}] * 2}


class Scripted(ThreadingHTTPServer):
    """Answers like a healthy reward server, VLM judge and detector server at once, unless `script(handler, n)`
    (n: the number of this POST, from 1) answers first and returns True."""

    daemon_threads = True

    def __init__(self, script=None):
        self.script = script
        self.posts = 0
        self.seen: list[tuple[str, str, str | None]] = []  # method, path, Authorization
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request, client_address):  # clients that gave up closed the socket
        pass

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, status: int, body: bytes, content_type: str | None = "application/json", **headers) -> None:
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()
        self.wfile.write(body)

    def reset(self) -> None:
        """Close the connection with a TCP reset (SO_LINGER 0), no answer."""
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()

    def _any(self) -> None:
        srv = self.server
        length = int(self.headers.get("Content-Length") or 0)
        self.body = json.loads(self.rfile.read(length)) if length else None
        with srv.lock:
            srv.seen.append((self.command, self.path, self.headers.get("Authorization")))
            if self.command == "POST":
                srv.posts += 1
            n = srv.posts
        if srv.script is not None and srv.script(self, n):
            return
        self.healthy()

    do_GET = do_POST = _any

    def healthy(self) -> None:
        path, n = self.path.rstrip("/"), len((self.body or {}).get("images", []))
        if path == "/health":
            answer = {"status": "ok", "key": "brightness"}
        elif path == "/v1/models":
            answer = {"data": [{"id": "judge"}]}
        elif path == "/score":
            answer = {"key": "brightness", "scores": {"brightness": [0.5] * n}}
        elif path == "/detect":
            answer = {"detections": [[]] * n}
        elif path == "/v1/chat/completions":
            answer = {"choices": [{"message": {"role": "assistant", "content": "Final Score: 5"}}]}
        else:
            self.reply(404, b'{"error": "not found"}')
            return
        self.reply(200, json.dumps(answer).encode())


@pytest.fixture
def serve():
    servers: list[Scripted] = []

    def start(script=None) -> Scripted:
        servers.append(Scripted(script))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


KINDS = ("remote", "geneval", "vlm_judge")


def scorer(kind: str, url: str, **settings):
    strict = {"remote": {}, "geneval": {"on_failure": "raise"}, "vlm_judge": {"on_bad_response": "raise"}}[kind]
    return build_scorer({"name": kind, "url": url, **FAST, **strict, **settings})


def no_health(kind: str) -> dict:
    return {"health_check": False, **({"model": "judge"} if kind == "vlm_judge" else {})}


def score(kind: str, s) -> torch.Tensor:
    images = torch.rand(2, 3, 8, 8)
    if kind == "geneval":
        return s(images, ["a photo of a cat"] * 2, GENEVAL_META)["geneval"]
    if kind == "vlm_judge":
        return s(images, ["a cat"] * 2)["vlm_judge"]
    return s(images)["brightness"]


# -- transient statuses ----------------------------------------------------------------------------


def test_500_is_retried_by_default():
    assert 500 in HttpSettings("http://127.0.0.1:1").retry_statuses == RETRY_STATUSES
    assert set(RETRY_STATUSES) == {429, 500, 502, 503, 504}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("failure", [500, 502, 503, 504, 429, "reset"])
def test_one_transient_failure_is_retried(serve, kind, failure):
    def once(handler, n):
        if handler.command != "POST" or n > 1:
            return False
        if failure == "reset":
            handler.reset()
        else:
            handler.reply(failure, b'{"error": "CUDA out of memory"}')
        return True

    server = serve(once)
    s = scorer(kind, server.url, concurrency=1) if kind == "vlm_judge" else scorer(kind, server.url)
    out = score(kind, s)
    assert torch.isfinite(out).all()
    assert s.counters["retries"] == 1 and s.counters["unreachable"] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_server_that_keeps_failing_is_one_line_naming_url_status_and_attempts(serve, kind):
    def always(handler, n):
        if handler.command != "POST":
            return False
        handler.reply(500, b'{"error": "scorer failed: Traceback (most recent call last):\\n  File x\\nOOM"}')
        return True

    server = serve(always)
    s = scorer(kind, server.url, concurrency=1) if kind == "vlm_judge" else scorer(kind, server.url)
    err, seconds = blocking_outcome(lambda: score(kind, s))
    assert isinstance(err, RemoteRewardError), err
    message = str(err)
    assert len(message.splitlines()) == 1, message
    assert server.url in message and "HTTP 500" in message and "3 attempt(s)" in message, message
    assert "OOM" in message and seconds < 10


def test_a_400_is_still_the_server_s_final_answer(serve):
    def bad_request(handler, n):
        if handler.command != "POST":
            return False
        handler.reply(400, b'{"error": "needs one prompt per image"}')
        return True

    server = serve(bad_request)
    s = scorer("remote", server.url)
    with pytest.raises(RemoteRewardError, match="HTTP 400.*needs one prompt per image"):
        score("remote", s)
    assert server.posts == 1 and s.counters["retries"] == 0


def test_the_run_stops_in_one_line_when_the_reward_server_keeps_failing(serve, tmp_path):
    """`flowgrpo train-t2i` with a `remote` reward whose server answers 500: one line (exit 2), no traceback."""

    def always(handler, n):
        if handler.command != "POST":
            return False
        handler.reply(500, b'{"error": "CUDA out of memory"}')
        return True

    server = serve(always)
    done = run_cli(
        "train-t2i",
        str(ROOT / "configs/t2i/tiny/flow_grpo.yaml"),
        f"output_dir={tmp_path / 'run'}",
        "progress=false",
        "artifacts.tensorboard=false",
        "artifacts.plot=false",
        f"rewards=[{{name: remote, url: '{server.url}', max_attempts: 2, backoff_s: 0.01, timeout_s: 5}}]",
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert server.url in last and "HTTP 500" in last and "2 attempt(s)" in last, last


# -- redirects -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("status", [302, 307, 308])
def test_the_token_never_follows_a_redirect_to_another_host(serve, kind, status):
    other = serve()  # another port of the same machine: another origin

    def away(handler, n):
        handler.reply(status, b"", Location=other.url + handler.path)
        return True

    first = serve(away)
    s = scorer(kind, first.url, token="s3cret")
    err, _ = blocking_outcome(lambda: score(kind, s))
    assert isinstance(err, RemoteRewardError) and "redirect" in str(err) and other.url in str(err), err
    assert len(str(err).splitlines()) == 1
    assert all(auth is None for _, _, auth in other.seen), other.seen
    # the same with health_check off: the POST is not followed either
    err, _ = blocking_outcome(lambda: score(kind, scorer(kind, first.url, token="s3cret", **no_health(kind))))
    assert isinstance(err, RemoteRewardError) and "redirect" in str(err), err
    assert all(auth is None for _, _, auth in other.seen), other.seen


def test_a_redirect_on_the_same_host_keeps_working(serve):
    def moved(handler, n):
        if handler.path == "/old/health":
            handler.reply(302, b"", Location="/health")
            return True
        return False

    server = serve(moved)
    client = HttpClient(HttpSettings(server.url + "/old", token="s3cret", **FAST))
    assert client.health()["status"] == "ok"
    assert [auth for _, _, auth in server.seen] == ["Bearer s3cret"] * 2


# -- what the client reads -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("declared", [True, False])
def test_an_answer_over_max_response_bytes_is_refused(serve, kind, declared):
    size = 8 * 2**20  # sent in full by the server, bounded

    def huge(handler, n):
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        if declared:
            handler.send_header("Content-Length", str(size))
        handler.end_headers()
        try:
            for _ in range(size // 2**16):
                handler.wfile.write(b" " * 2**16)
        except OSError:
            pass
        handler.close_connection = True
        return True

    server = serve(huge)
    s = scorer(kind, server.url, max_response_bytes=2**20, **no_health(kind))
    err, _ = blocking_outcome(lambda: score(kind, s))
    assert isinstance(err, RemoteRewardError) and "max_response_bytes" in str(err), err
    assert s.counters["retries"] == 0  # the server's answer, not retried


def test_max_response_bytes_has_a_sane_default():
    assert 2**20 <= HttpSettings("http://127.0.0.1:1").max_response_bytes <= 2**30


@pytest.mark.parametrize("kind", KINDS)
def test_an_answer_of_another_content_type_is_refused(serve, kind):
    def html(handler, n):
        if handler.command == "GET":
            return False
        # a proxy's or login page's answer; the body would even parse as JSON
        handler.reply(200, b'{"key": "brightness", "scores": {"brightness": [1, 1]}}', "text/html; charset=utf-8")
        return True

    server = serve(html)
    err, _ = blocking_outcome(lambda: score(kind, scorer(kind, server.url)))
    assert isinstance(err, RemoteRewardError) and "text/html" in str(err), err


def test_json_with_parameters_or_without_a_content_type_is_read(serve):
    def plain(handler, n):
        if handler.command == "GET":
            handler.reply(200, b'{"status": "ok", "key": "brightness"}', None)
        else:
            handler.reply(200, b'{"key": "b", "scores": {"b": [0.5, 0.5]}}', "application/json; charset=utf-8")
        return True

    server = serve(plain)
    assert torch.equal(score("remote", scorer("remote", server.url, key="brightness")), torch.full((2,), 0.5))


def test_endless_headers_are_cut_off(serve):
    """http.client reads at most 100 header lines of 64 KiB; the attempt's clock bounds the time."""

    def endless(handler, n):
        handler.wfile.write(b"HTTP/1.0 200 OK\r\n")
        try:
            for i in range(200_000):
                handler.wfile.write(b"X-Filler-%d: %s\r\n" % (i, b"a" * 100))
        except OSError:
            pass
        handler.close_connection = True
        return True

    server = serve(endless)
    err, seconds = blocking_outcome(lambda: score("remote", scorer("remote", server.url, **no_health("remote"))))
    assert isinstance(err, RemoteRewardError) and "3 attempt(s)" in str(err), err
    assert seconds < 15
