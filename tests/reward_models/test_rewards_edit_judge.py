"""edit_judge / edit_judge_pairwise against a stub OpenAI-compatible server on 127.0.0.1: what a request carries
(the source(s), the edit(s), the instruction), how replies are read, malformed replies, missing sources. The stub
judges by mean brightness, so its verdicts are known without a model."""

import base64
import io
import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from reward_models import build_scorer
from reward_models.pairwise import group_win_rates

FAST = dict(timeout_s=2.0, max_attempts=2, backoff_s=0.02, max_backoff_s=0.05, seed=0)


def grey(values, size=16) -> torch.Tensor:
    return torch.stack([torch.full((3, size, size), float(v)) for v in values])


def grey_u8(value, size=24) -> torch.Tensor:
    return torch.full((3, size, size), round(value * 255), dtype=torch.uint8)


def decode(body: dict) -> list[Image.Image]:
    parts = body["messages"][0]["content"]
    return [
        Image.open(io.BytesIO(base64.b64decode(p["image_url"]["url"].split(",", 1)[1]))).convert("RGB")
        for p in parts
        if p["type"] == "image_url"
    ]


def level(image: Image.Image) -> float:
    return round(float(np.asarray(image.convert("L"), dtype=np.float64).mean() / 255), 1)


def change_score(body: dict) -> str:
    """1 + 9 * |edit - first source| in brightness."""
    images = decode(body)
    return f"Looks edited.\nFinal Score: {round(1 + 9 * abs(level(images[-1]) - level(images[0])))}"


def brighter_edit_wins(body: dict) -> str:
    first, second = (level(im) for im in decode(body)[-2:])
    return f"<think>...</think><answer>Image {1 if first > second else 2} is better</answer>"


class Stub(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, answer, garbage=False):
        self.answer, self.garbage, self.bodies, self.lock = answer, garbage, [], threading.Lock()
        super().__init__(("127.0.0.1", 0), Handler)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(json.dumps({"object": "list", "data": [{"id": "judge"}]}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.bodies.append(body)
        if self.server.garbage:
            return self._send(b"<html>upstream connect error</html>")
        reply = {"choices": [{"message": {"role": "assistant", "content": self.server.answer(body)}}]}
        self._send(json.dumps(reply).encode())


@contextmanager
def serving(server):
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_edit_judge_sends_source_edit_and_instruction():
    server = Stub(change_score)
    sources = [[grey_u8(0.2)], [grey_u8(0.5)], [Image.new("RGB", (20, 12), (255, 255, 255))]]
    with serving(server) as url:
        judge = build_scorer("edit_judge", url=url, concurrency=2, **FAST)
        out = judge(grey([0.2, 1.0, 0.0]), ["make it brighter"] * 3, {"source_images": sources})
    raw = torch.tensor([1.0, round(1 + 9 * 0.5), 10.0])
    assert torch.equal(out["edit_judge/raw"], raw) and torch.allclose(out["edit_judge"], (raw - 1) / 9)
    assert len(server.bodies) == 3 and judge.counters["replies"] == 3
    for body in server.bodies:
        parts = body["messages"][0]["content"]
        assert [p["type"] for p in parts] == ["image_url", "image_url", "text"]
        assert '"make it brighter"' in parts[-1]["text"] and "{prompt}" not in parts[-1]["text"]
    shown = sorted((level(s), s.size, level(e), e.size) for s, e in map(decode, server.bodies))
    assert shown == [(0.2, (24, 24), 0.2, (16, 16)), (0.5, (24, 24), 1.0, (16, 16)), (1.0, (20, 12), 0.0, (16, 16))]


def test_every_source_or_the_one_picked_is_sent():
    server = Stub(change_score)
    sources = [[grey_u8(0.1), grey_u8(0.9, size=8)]]
    with serving(server) as url:
        build_scorer("edit_judge", url=url, **FAST)(grey([0.5]), ["swap them"], {"source_images": sources})
        build_scorer("edit_judge", url=url, source_index=1, **FAST)(grey([0.5]), ["x"], {"source_images": sources})
    assert [[level(im) for im in decode(b)] for b in server.bodies] == [[0.1, 0.9, 0.5], [0.9, 0.5]]


def test_malformed_replies_and_missing_sources_are_nan_and_counted():
    replies = iter(["Final Score: 10", "I cannot judge this edit.", "Final Score: 42"])
    server = Stub(lambda body: next(replies))
    sources = [[grey_u8(0.5)], [grey_u8(0.5)], None, [grey_u8(0.5)]]
    with serving(server) as url:
        judge = build_scorer("edit_judge", url=url, concurrency=1, **FAST)
        out = judge(grey([0.1, 0.2, 0.3, 0.4]), ["p"] * 4, {"source_images": sources})["edit_judge"]
    assert out[0] == 1.0 and torch.isnan(out[1:]).all()  # never a silent 0
    assert len(server.bodies) == 3  # no request for the edit without a source
    c = judge.counters
    assert (c["unparseable"], c["out_of_range"], c["missing_source"], c["nan"]) == (1, 1, 1, 3)
    assert judge.last_replies == ["Final Score: 10", "I cannot judge this edit.", None, "Final Score: 42"]
    with serving(Stub(None, garbage=True)) as url:
        judge = build_scorer("edit_judge", url=url, **FAST)
        out = judge(grey([0.1, 0.2]), ["p"] * 2, {"source_images": [[grey_u8(0.5)]] * 2})["edit_judge"]
    assert torch.isnan(out).all() and judge.counters["bad_responses"] == 2


def test_pairwise_edit_judge_compares_two_edits_of_one_source():
    server = Stub(brighter_edit_wins)
    src = [[grey_u8(0.3)]] * 3
    with serving(server) as url:
        judge = build_scorer("edit_judge_pairwise", url=url, **FAST)
        p = judge(grey([0.9, 0.1, 0.6]), grey([0.2, 0.7, 0.5]), ["make it brighter"] * 3, {"source_images": src})
        assert torch.equal(p, torch.tensor([1.0, 0.0, 1.0]))
        parts = server.bodies[0]["messages"][0]["content"]
        assert [x["type"] for x in parts] == ["image_url"] * 3 + ["text"] and '"make it brighter"' in parts[-1]["text"]
        assert all(level(decode(b)[0]) == 0.3 for b in server.bodies) and server.bodies[0]["max_tokens"] == 4096
        # both orders: the (b, a) request shows the same source first; a missing source is NaN, not asked
        both = build_scorer("edit_judge_pairwise", url=url, both_orders=True, **FAST)
        p = both(grey([0.9, 0.9]), grey([0.2, 0.2]), ["p"] * 2, {"source_images": [src[0], []]})
        assert p[0] == 1.0 and torch.isnan(p[1]) and both.counters["missing_source"] == 1
        assert [[level(im) for im in decode(b)] for b in server.bodies[3:]] in (
            [[0.3, 0.9, 0.2], [0.3, 0.2, 0.9]],
            [[0.3, 0.2, 0.9], [0.3, 0.9, 0.2]],
        )
        # group win rates over the edits of one source
        rates, _ = group_win_rates(judge, grey([0.4, 0.8, 0.6]), "make it brighter", {"source_images": src[0]})
    assert torch.allclose(rates, torch.tensor([0.0, 1.0, 0.5]))
    with pytest.raises(ValueError, match=r"needs metadata \['source_images'\]"):
        judge(grey([0.5]), grey([0.5]), ["p"])
