"""deadline_s / timeout_s bound the whole remote call, even against a server that trickles its answer one
byte at a time (a run never waits on a reward server without a bound). Through the `remote` and
`geneval` config keys a user sets."""

import socket
import threading
import time

import pytest
import torch

from reward_models import build_scorer
from reward_models.remote import RemoteRewardError
from .cli_helpers import blocking_outcome


class TricklingServer:
    """Accepts connections and sends an HTTP answer one byte per `every` seconds (headers or body)."""

    def __init__(self, where: str, every: float = 0.5):
        self.where, self.every = where, every
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        body = b'{"key": "brightness", "scores": {"brightness": [0.5]}}' + b" " * 1000
        head = f"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        conn.recv(1 << 20)
        try:
            if self.where == "body":
                conn.sendall(head)
                data = body
            else:
                data = head + body
            for i in range(len(data)):
                if self.stop.is_set():
                    break
                conn.sendall(data[i : i + 1])
                time.sleep(self.every)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.fixture
def trickling():
    servers = []

    def make(where: str, every: float = 0.5) -> TricklingServer:
        servers.append(TricklingServer(where, every))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


@pytest.mark.parametrize("where", ["body", "headers"])
def test_deadline_bounds_a_trickling_answer(trickling, where):
    server = trickling(where)
    scorer = build_scorer(
        {
            "name": "remote",
            "url": server.url,
            "health_check": False,
            "timeout_s": 30,
            "deadline_s": 1.0,
            "max_attempts": 3,
            "backoff_s": 0.05,
        }
    )
    err, seconds = blocking_outcome(lambda: scorer(torch.rand(1, 3, 8, 8)), limit_s=10.0)
    assert isinstance(err, RemoteRewardError) and "timed out" in str(err), err
    assert seconds < 2.5


def test_timeout_bounds_each_whole_attempt(trickling):
    server = trickling("body", every=0.2)  # a byte well within each read's timeout: only the attempt's bound cuts
    scorer = build_scorer(
        {
            "name": "remote",
            "url": server.url,
            "health_check": False,
            "timeout_s": 0.5,
            "max_attempts": 2,
            "backoff_s": 0.05,
            "max_backoff_s": 0.05,
        }
    )
    err, seconds = blocking_outcome(lambda: scorer(torch.rand(1, 3, 8, 8)), limit_s=10.0)
    assert isinstance(err, RemoteRewardError) and "2 attempt" in str(err), err
    assert seconds < 2.5


def test_geneval_client_deadline_bounds_a_trickling_detector(trickling):
    server = trickling("body")
    scorer = build_scorer(
        {
            "name": "geneval",
            "url": server.url,
            "health_check": False,
            "timeout_s": 30,
            "deadline_s": 1.0,
            "on_failure": "raise",
        }
    )
    err, seconds = blocking_outcome(
        lambda: scorer(
            torch.rand(1, 3, 8, 8),
            ["a photo of a cat"],
            {"geneval": [{"tag": "single_object", "include": [{"class": "cat", "count": 1}]}]},
        ),
        limit_s=10.0,
    )
    assert isinstance(err, RemoteRewardError), err
    assert seconds < 2.5
