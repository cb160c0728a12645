"""scripts/reward_server.py under abuse, over HTTP (one request must never cost unbounded memory, time or
connections): a PNG declaring 144 M pixels,
100,000 nested brackets, idle / trickling / too many connections, and the bearer token."""

import base64
import http.client
import io
import json
import socket
import struct
import subprocess
import sys
import time
import zlib

import pytest
import torch
from PIL import Image

from reward_models import build_scorer
from reward_models.remote import RemoteRewardError

from .cli_helpers import ROOT

LIMITS = ["--header-timeout", "1", "--body-timeout", "1", "--idle-timeout", "1", "--max-connections", "3"]


def start_server(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    import os

    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts/reward_server.py"), "--scorer", "brightness", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )
    line = proc.stdout.readline()
    assert "serving" in line, proc.stderr.read()
    return proc, line.split(" on ")[1].split()[0]


@pytest.fixture(scope="module")
def _servers():
    """One server process per (flags, environment) for the whole module: each start is a fresh interpreter
    (~1.3 s), and every test's requests are independent of the others' (the limits are per request or per open
    connection, and each test's connections are closed by the time it ends)."""
    running: dict[tuple, tuple[subprocess.Popen, str]] = {}
    yield running
    for proc, _ in running.values():
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def server(_servers):
    def start(*args: str, env: dict | None = None) -> str:
        key = (args, tuple(sorted((env or {}).items())))
        if key not in _servers:
            _servers[key] = start_server(*args, env=env)
        proc, url = _servers[key]
        assert proc.poll() is None, f"the shared server {args} exited: {proc.stderr.read()[-2000:]}"
        return url

    return start


def post(url: str, body: bytes, headers: dict | None = None, path: str = "/score") -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=20)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    return response.status, json.loads(response.read() or b"{}")


def png(width: int, height: int) -> str:
    """A valid small PNG, then the width / height in its header rewritten (the pixels are never decoded)."""
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (100, 100, 100)).save(buf, format="PNG")
    raw = bytearray(buf.getvalue())
    ihdr = raw[12:29]  # b"IHDR" + 13 bytes of data
    ihdr[4:12] = struct.pack(">II", width, height)
    raw[12:29] = ihdr
    raw[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)) & 0xFFFFFFFF)
    return base64.b64encode(bytes(raw)).decode()


def request(*images: str) -> bytes:
    return json.dumps({"images": list(images), "prompts": None, "metadata": {}}).encode()


def test_pixel_bomb_is_refused_from_its_header(server):
    url = server()
    start = time.monotonic()
    status, answer = post(url, request(png(12000, 12000)))
    assert status == 413 and "12000 x 12000" in answer["error"]
    assert time.monotonic() - start < 5
    assert post(url, request(png(4, 4)))[0] == 200  # a small image still scores


def test_pixel_cap_is_a_setting(server):
    url = server("--max-megapixels", "0.0001")  # 100 pixels
    assert post(url, request(png(20, 20)))[0] == 413
    assert post(url, request(png(4, 4)))[0] == 200


def test_pixels_per_request_are_capped_before_decoding(server):
    url = server()  # defaults: 16.8 M pixels an image, 67.2 M a request
    start = time.monotonic()
    status, answer = post(url, request(*[png(4096, 4096)] * 5))  # each under the image cap, 84 M in all
    assert status == 413 and "per request" in answer["error"], answer
    assert time.monotonic() - start < 5  # refused from the headers, nothing decoded
    assert post(url, request(*[png(4, 4)] * 8))[0] == 200
    url = server("--max-request-megapixels", "0.0001")  # 100 pixels a request
    assert post(url, request(*[png(4, 4)] * 7))[0] == 413  # 112 pixels
    assert post(url, request(*[png(4, 4)] * 6))[0] == 200  # 96 pixels


def test_deep_nesting_is_a_400(server):
    url = server()
    status, answer = post(url, b"[" * 100_000)
    assert status == 400 and "nested" in answer["error"]
    assert post(url, request(png(4, 4)))[0] == 200  # and the server is still up


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> bool:
    """Send `trickle` a byte per 0.2 s (or nothing); True when the server closes the connection in time."""
    start = time.monotonic()
    i = 0
    while time.monotonic() - start < seconds:
        try:
            if trickle:
                sock.sendall(trickle[i % len(trickle) : i % len(trickle) + 1])
                i += 1
            sock.settimeout(0.2)
            data = sock.recv(4096)
            if data == b"" or data.startswith(b"HTTP/"):
                return True
        except socket.timeout:
            continue
        except OSError:
            return True
    return False


def test_idle_connection_is_closed(server):
    url = server(*LIMITS)
    with _connect(url) as sock:
        assert _closed_within(sock, 6)


def test_trickling_headers_are_cut_off(server):
    url = server(*LIMITS)
    with _connect(url) as sock:
        assert _closed_within(sock, 6, trickle=b"POST /score HTTP/1.1\r\nX-Slow: " + b"a" * 100)


def test_trickling_body_is_cut_off(server):
    url = server(*LIMITS)
    with _connect(url) as sock:
        sock.sendall(b"POST /score HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
        assert _closed_within(sock, 6, trickle=b"[")


def test_connection_cap_answers_503(server):
    url = server(*LIMITS[:-2], "--idle-timeout", "30", "--max-connections", "2")
    held = [_connect(url) for _ in range(2)]
    time.sleep(0.3)
    try:
        with _connect(url) as extra:
            extra.settimeout(5)
            assert extra.recv(4096).startswith(b"HTTP/1.0 503")
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    assert post(url, request(png(4, 4)))[0] == 200  # the slots come back


def test_token_is_required_and_checked(server):
    url = server("--token", "s3cret")
    assert post(url, request(png(4, 4)))[0] == 401
    assert post(url, request(png(4, 4)), {"Authorization": "Bearer wrong"})[0] == 401
    assert post(url, request(png(4, 4)), {"Authorization": "Bearer s3cret"})[0] == 200
    with pytest.raises(RemoteRewardError, match="401"):
        build_scorer({"name": "remote", "url": url, "max_attempts": 1})(torch.rand(1, 3, 8, 8))
    good = build_scorer({"name": "remote", "url": url, "token": "s3cret"})(torch.rand(2, 3, 8, 8))
    assert good["brightness"].shape == (2,)


def test_token_from_the_environment_on_both_sides(server, monkeypatch):
    url = server(env={"FLOWGRPO_REWARD_TOKEN": "from-env"})
    assert post(url, request(png(4, 4)))[0] == 401
    monkeypatch.setenv("MY_REWARD_TOKEN", "from-env")
    scores = build_scorer({"name": "remote", "url": url, "token": "env:MY_REWARD_TOKEN"})(torch.rand(1, 3, 8, 8))
    assert scores["brightness"].shape == (1,)


def test_binding_beyond_loopback_needs_a_token():
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/reward_server.py"),
            "--scorer",
            "brightness",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 2 and "token" in done.stderr.splitlines()[-1]


def test_python_servers_beyond_loopback_need_a_token():
    """make_server / make_detector_server (the Python API) refuse a non-loopback host without a token too."""
    from reward_models.geneval import make_detector_server
    from reward_models.serving import make_server

    scorer = build_scorer({"name": "brightness"})
    for make, target in ((make_server, scorer), (make_detector_server, lambda images, classes, colors: [])):
        for host in ("0.0.0.0", ""):
            with pytest.raises(ValueError, match="token") as err:
                make(target, host, 0)
            assert repr(host) in str(err.value)
        for host in ("127.0.0.1", "127.0.0.2", "localhost"):
            make(target, host, 0).server_close()
        make(target, "0.0.0.0", 0, token="s3cret").server_close()


def test_judge_clients_send_the_token(monkeypatch):
    """The VLM judges (OpenAI-compatible servers) send `token` (or `api_key`) as the bearer token."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: list[str] = []

    class Models(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.headers.get("Authorization", ""))
            body = json.dumps({"data": [{"id": "judge"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("JUDGE_TOKEN", "j-secret")
        url = f"http://127.0.0.1:{server.server_address[1]}"
        for name in ("vlm_judge", "vlm_judge_pairwise"):
            build_scorer({"name": name, "url": url, "token": "env:JUDGE_TOKEN"}).client.health()
        assert seen == ["Bearer j-secret"] * 2
    finally:
        server.shutdown()


# -- what the server reads: only JSON, only as much as declared, never more than max_body_bytes ------------


def raw(url: str, data: bytes) -> tuple[int, dict]:
    """Send `data` as it is; the status and the JSON error of the answer, which must be one line of JSON."""
    with _connect(url) as sock:
        sock.sendall(data)
        answer = b""
        while len(answer) < 1 << 20:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:  # the server closed on bytes it refused to read, after answering
                break
            if not chunk:
                break
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/"), answer[:200]
    assert b"content-type: application/json" in head.lower(), head
    assert body.count(b"\n") == 0 and body, body[:300]  # one line of JSON, never an HTML page
    return int(head.split()[1]), json.loads(body)


def head_of(*lines: str, content_type: str | None = "application/json", path: str = "/score") -> bytes:
    headers = [f"POST {path} HTTP/1.1", "Host: x", *([f"Content-Type: {content_type}"] if content_type else []), *lines]
    return ("\r\n".join(headers) + "\r\n\r\n").encode("latin-1")


def test_chunked_body_without_a_length_is_411(server):
    url = server()
    body = request(png(4, 4))
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    status, answer = raw(url, head_of("Transfer-Encoding: chunked") + chunked)
    assert status == 411 and "chunked" in answer["error"], answer


@pytest.mark.parametrize(
    "lines",
    [
        ["Content-Length: abc"],
        ["Content-Length: -5"],
        ["Content-Length: \xb2"],  # a latin-1 "superscript two": str.isdigit() says yes, int() says no
        ["Content-Length: 5", "Content-Length: 500"],
        ["Content-Length: 40", "Transfer-Encoding: chunked"],  # which one frames the body? (request smuggling)
    ],
)
def test_an_invalid_or_ambiguous_length_is_400(server, lines):
    url = server()
    status, answer = raw(url, head_of(*lines) + b"0" * 40)
    assert status == 400, answer
    assert "Content-Length" in answer["error"] or "Transfer-Encoding" in answer["error"], answer
    assert post(url, request(png(4, 4)))[0] == 200  # and the server is still up


def test_a_body_over_the_limit_is_413_before_any_of_it_is_read(server):
    url = server("--max-body-mb", "1")
    start = time.monotonic()
    status, answer = raw(url, head_of(f"Content-Length: {2 * 2**20}"))  # the body never comes
    assert status == 413 and "1048576" in answer["error"], answer
    assert time.monotonic() - start < 5  # answered from the header, not after the body timeout


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "text/html", None])
def test_a_body_that_is_not_json_is_415(server, content_type):
    url = server()
    body = request(png(4, 4))  # valid JSON, declared as something else
    status, answer = raw(url, head_of(f"Content-Length: {len(body)}", content_type=content_type) + body)
    assert status == 415 and "application/json" in answer["error"], answer
    ok = head_of(f"Content-Length: {len(body)}", content_type="application/json; charset=utf-8") + body
    assert raw_status(url, ok) == 200


def raw_status(url: str, data: bytes) -> int:
    with _connect(url) as sock:
        sock.sendall(data)
        return int(sock.recv(4096).split()[1])


def test_more_bytes_than_declared_is_400(server):
    url = server()
    body = request(png(4, 4))
    status, answer = raw(url, head_of(f"Content-Length: {len(body)}") + body + b'{"images": []}')
    assert status == 400 and "more body bytes" in answer["error"], answer


@pytest.mark.parametrize(
    "data,code",
    [
        (b"PUT /score HTTP/1.1\r\nHost: x\r\n\r\n", 501),  # a method the server does not serve
        (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414),  # request line too long
        (b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(120)) + b"\r\n", 431),
        (b"GARBAGE\r\n\r\n", 400),
    ],
)
def test_http_server_s_own_errors_are_one_line_json(server, data, code):
    status, answer = raw(server(), data)
    assert status == code and answer["error"], answer


def test_the_detector_server_reads_only_json_too():
    from reward_models.geneval import make_detector_server

    detector = make_detector_server(lambda images, classes, colors: [[] for _ in images])
    detector.serve_in_thread()
    try:
        body = json.dumps({"images": [png(4, 4)], "classes": [["cat"]]}).encode()
        status, answer = raw(
            detector.url, head_of(f"Content-Length: {len(body)}", content_type="text/plain", path="/detect") + body
        )
        assert status == 415, answer
        assert raw_status(detector.url, head_of(f"Content-Length: {len(body)}", path="/detect") + body) == 200
    finally:
        detector.shutdown()
        detector.server_close()
