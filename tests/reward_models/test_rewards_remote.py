"""Remote scoring against servers on 127.0.0.1 only: the reference server (healthy) and a stub that
is slow, flaky, failing, or answers garbage; plus a port with nothing listening (down).
Every network loop is bounded in attempts and in time."""

import json
import socket
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from reward_models import build_scorer
from reward_models.remote import RemoteRewardError, RemoteScorer
from reward_models.serving import make_server
from reward_models.wire import decode_request, encode_scores

from rewards_helpers import PROMPTS, quantised_images

FAST = dict(timeout_s=2.0, max_attempts=3, backoff_s=0.02, max_backoff_s=0.05, seed=0)


class StubServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, mode: str, delay: float = 0.0, fail_first: int = 0):
        self.mode, self.delay, self.fail_first = mode, delay, fail_first
        self.posts = 0
        self.scorer = build_scorer("brightness")
        super().__init__(("127.0.0.1", 0), StubHandler)

    def handle_error(self, request, client_address):  # clients that timed out closed the socket
        pass


class StubHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        status = "loading" if self.server.mode == "unhealthy" else "ok"
        self._send(200, json.dumps({"status": status, "key": "brightness"}).encode())

    def do_POST(self):
        srv = self.server
        srv.posts += 1
        images, prompts, metadata = decode_request(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        good = json.dumps(encode_scores(srv.scorer(images), "brightness")).encode()
        n = len(images)
        if srv.mode == "slow":
            time.sleep(srv.delay)
            self._send(200, good)
        elif srv.mode == "flaky":
            self._send(503, b'{"error": "warming up"}') if srv.posts <= srv.fail_first else self._send(200, good)
        elif srv.mode == "error":
            self._send(500, b'{"error": "CUDA out of memory"}')
        elif srv.mode == "garbage":
            self._send(200, b"<html>502 Bad Gateway</html>")
        elif srv.mode == "wrong_length":
            self._send(200, json.dumps({"key": "brightness", "scores": {"brightness": [0.5] * (n - 1)}}).encode())
        elif srv.mode == "bad_values":
            self._send(200, json.dumps({"key": "brightness", "scores": {"brightness": ["high"] * n}}).encode())


@contextmanager
def serving(server):
    server.serve_in_thread() if hasattr(server, "serve_in_thread") else threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    ).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_healthy_server_equals_local_scorer(images):
    local = build_scorer("brightness")
    with serving(make_server(build_scorer("brightness"))) as url:
        remote = RemoteScorer(url, batch_size=2, **FAST)
        out = remote(images, PROMPTS)
        assert remote.server_info["scorer"] == "brightness"
    assert set(out) == {"brightness"} and out["brightness"].dtype == torch.float32
    assert torch.allclose(out["brightness"], local(images)["brightness"], atol=1e-7)
    assert remote.counters["requests"] == 1 + 3  # health + ceil(5 / 2) posts
    assert remote.counters["retries"] == 0


def test_nan_and_metadata_images_cross_the_wire(images):
    # image_similarity: reference images in metadata travel as PNG; NaN scores travel as null.
    settings = dict(backbone="clip", tiny=True, device="cpu")
    local = build_scorer("image_similarity", **settings)
    refs = [images[1], None, images[0], [images[2], images[3]], images[4]]
    with serving(make_server(build_scorer("image_similarity", **settings))) as url:
        remote = build_scorer("remote", url=url, key="sim", **FAST)
        out = remote(images, metadata={"reference_images": refs})
        assert remote.metadata_keys == ("reference_images",)  # learnt from /health
        with pytest.raises(ValueError, match="needs metadata"):
            remote(images)  # checked on the client, before sending
    expected = local(images, metadata={"reference_images": refs})["image_similarity"]
    assert set(out) == {"sim"} and torch.isnan(out["sim"][1])
    assert torch.allclose(out["sim"], expected, atol=1e-5, equal_nan=True)


def test_server_reports_bad_requests(images):
    with serving(make_server(build_scorer("pickscore", tiny=True, device="cpu"))) as url:
        remote = RemoteScorer(url, health_check=False, **FAST)
        with pytest.raises(RemoteRewardError, match="HTTP 400.*needs one prompt per image"):
            remote(images)  # prompts sent as null
        assert remote.counters["attempts"] == 1  # a 400 is not retried


def test_slow_server_times_out_retries_then_fails_clearly(images):
    with serving(StubServer("slow", delay=5.0)) as url:
        remote = RemoteScorer(url, timeout_s=0.2, max_attempts=3, backoff_s=0.02, max_backoff_s=0.05)
        start = time.monotonic()
        with pytest.raises(RemoteRewardError) as info:
            remote(images)
        elapsed = time.monotonic() - start
    message = str(info.value)
    assert url + "/score" in message and "3 attempt(s)" in message and "timed out" in message
    assert elapsed < 3.0  # 3 x 0.2 s plus backoffs (and a loaded CI), not the server's 5 s
    assert remote.counters["retries"] == 2 and remote.counters["unreachable"] == 1


def test_down_server_fails_within_bounded_time(images):
    url = f"http://127.0.0.1:{free_port()}"
    remote = RemoteScorer(url, **FAST)
    start = time.monotonic()
    with pytest.raises(RemoteRewardError) as info:
        remote(images)
    assert time.monotonic() - start < 3.0
    assert f"{url}/health" in str(info.value) and "3 attempt(s)" in str(info.value)
    assert "Connection refused" in str(info.value) or "ConnectionRefused" in str(info.value)


def test_deadline_bounds_total_time():
    remote = RemoteScorer(
        f"http://127.0.0.1:{free_port()}", max_attempts=1000, backoff_s=0.05, max_backoff_s=0.1, deadline_s=0.5, seed=0
    )
    start = time.monotonic()
    with pytest.raises(RemoteRewardError):
        remote.health()
    assert time.monotonic() - start < 2.5
    assert remote.counters["attempts"] < 1000


def test_backoff_is_capped_exponential_with_jitter():
    remote = RemoteScorer("http://127.0.0.1:1", backoff_s=0.5, max_backoff_s=4.0, seed=0)
    for attempt, base in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (8, 4.0)]:
        waits = [remote.backoff(attempt) for _ in range(20)]
        assert all(0.5 * base <= w < base for w in waits) and len(set(waits)) > 1


def test_flaky_server_is_retried(images):
    with serving(StubServer("flaky", fail_first=2)) as url:
        remote = RemoteScorer(url, **FAST)
        out = remote(images)["brightness"]
    assert torch.allclose(out, build_scorer("brightness")(images)["brightness"], atol=1e-7)
    assert remote.counters["retries"] == 2


def test_server_error_is_retried_then_named(images):
    # a 500 (the server's scorer raised: often CUDA out of memory, which passes) is retried like a 503
    with serving(StubServer("error")) as url:
        remote = RemoteScorer(url, on_bad_response="nan", **FAST)
        with pytest.raises(RemoteRewardError, match=r"/score failed: 3 attempt\(s\).*HTTP 500: CUDA out of memory"):
            remote(images)  # loud even with on_bad_response="nan": a server that keeps failing is down
    assert remote.counters["attempts"] == 1 + 3  # health + three posts
    assert remote.counters["retries"] == 2 and remote.counters["bad_responses"] == 0


@pytest.mark.parametrize(
    "mode,why",
    [("garbage", "Expecting value"), ("wrong_length", "list of 5 numbers"), ("bad_values", "neither numbers nor null")],
)
def test_garbage_raises_or_is_nan_and_counted(images, mode, why):
    with serving(StubServer(mode)) as url:
        with pytest.raises(RemoteRewardError, match=why):
            RemoteScorer(url, **FAST)(images)
        lenient = RemoteScorer(url, on_bad_response="nan", batch_size=2, **FAST)
        out = lenient(images)
    assert torch.isnan(out["brightness"]).all()  # never a silent 0
    assert lenient.counters["bad_responses"] == 3 and lenient.counters["nan"] == 5


def test_unhealthy_server_is_reported(images):
    with serving(StubServer("unhealthy")) as url:
        with pytest.raises(RemoteRewardError, match="not ok"):
            RemoteScorer(url, **FAST)(images)


def test_url_and_policy_are_checked():
    with pytest.raises(ValueError, match="http"):
        RemoteScorer("127.0.0.1:8123")
    with pytest.raises(ValueError, match="on_bad_response"):
        RemoteScorer("http://127.0.0.1:8123", on_bad_response="zero")


def test_more_images_than_one_request_keep_order():
    x = quantised_images(7, 16, 16, seed=5)
    with serving(make_server(build_scorer("colorfulness"))) as url:
        out = RemoteScorer(url, batch_size=3, **FAST)(x)["colorfulness"]
    assert torch.allclose(out, build_scorer("colorfulness")(x)["colorfulness"], atol=1e-4)
