"""GenEval rules (local) over a stub detector on 127.0.0.1 that returns hand-made detections:
each task type, thresholds, counting, colours, relative positions with the margin, strict vs
original vs partial scores, and detector failures (NaN, counted, bounded in time)."""

import json
import socket
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from reward_models import build_scorer
from reward_models.geneval import make_detector_server
from reward_models.geneval_rules import (
    COLORS,
    Detection,
    evaluate,
    keep_detections,
    relative_position,
    summarize,
)
from reward_models.remote import RemoteRewardError

FAST = dict(timeout_s=2.0, max_attempts=3, backoff_s=0.02, max_backoff_s=0.05, seed=0)


def det(label, score=0.95, box=(0, 0, 10, 10), color=None) -> dict:
    out = {"label": label, "score": score, "box": list(box)}
    if color is not None:
        out["color"] = color
    return out


def tagged(n: int) -> torch.Tensor:
    """Image i has red value i/255, so the stub knows which hand-made detections to return."""
    x = torch.zeros(n, 3, 16, 16)
    for i in range(n):
        x[i, 0] = i / 255.0
    return x


class Detector:
    """detect(images, classes, colors): image i -> detections[i]; records what it was asked."""

    def __init__(self, detections):
        self.detections, self.requests = detections, []

    def __call__(self, images, classes, colors):
        self.requests.append((len(images), classes, colors))
        return [self.detections[im.getpixel((0, 0))[0]] for im in images]


@contextmanager
def detector(detections):
    fn = Detector(detections)
    server = make_detector_server(fn, name="stub")
    server.serve_in_thread()
    try:
        yield server.url, fn
    finally:
        server.shutdown()
        server.server_close()


def score(cases, **settings):
    """cases: [(metadata, detections)] -> (scorer output, detector, scorer)."""
    metas = [m for m, _ in cases]
    with detector([d for _, d in cases]) as (url, fn):
        scorer = build_scorer("geneval", url=url, **FAST, **settings)
        out = scorer(tagged(len(cases)), metadata={"geneval": metas})
    return out, fn, scorer


def single(cls="dog", count=1, tag="single_object", **extra):
    return {"tag": tag, "include": [{"class": cls, "count": count, **extra}], "prompt": f"a photo of a {cls}"}


# -- rules -----------------------------------------------------------------------------------------


def test_relative_position_with_margin():
    a, b = (0, 40, 20, 60), (60, 40, 80, 60)  # same row, a well to the left
    assert relative_position(a, b) == {"left of"} and relative_position(b, a) == {"right of"}
    assert relative_position((40, 0, 60, 20), (40, 60, 60, 80)) == {"above"}  # y grows downwards
    assert relative_position((0, 0, 20, 20), (60, 60, 80, 80)) == {"left of", "above"}  # diagonal: both
    # centres 3 px apart, boxes 20 px wide: inside the 0.1 x (20 + 20) = 4 px margin -> no relation
    near_a, near_b = (0, 0, 20, 20), (3, 0, 23, 20)
    assert relative_position(near_a, near_b) == set()
    assert relative_position(near_a, near_b, margin=0.0) == {"left of"}
    # mostly vertical offset with a small horizontal one: only "below"
    assert relative_position((10, 60, 30, 80), (0, 0, 20, 20)) == {"below"}


def test_keep_detections_threshold_order_cap_and_nms():
    dets = [Detection("dog", s, (i * 20, 0, i * 20 + 10, 10)) for i, s in enumerate([0.3, 0.31, 0.9, 0.5])]
    kept = keep_detections(dets, threshold=0.3)
    assert [d.score for d in kept["dog"]] == [0.9, 0.5, 0.31]  # strictly above, best first
    assert len(keep_detections(dets * 10, threshold=0.0, max_objects=16)["dog"]) == 16
    overlapping = [
        Detection("cat", 0.9, (0, 0, 10, 10)),
        Detection("cat", 0.8, (1, 0, 11, 10)),
        Detection("cat", 0.7, (50, 50, 60, 60)),
    ]
    assert len(keep_detections(overlapping, threshold=0.3)["cat"]) == 3  # NMS off at 1.0 (GenEval default)
    assert [d.score for d in keep_detections(overlapping, threshold=0.3, nms_iou=0.5)["cat"]] == [0.9, 0.7]


def test_single_object():
    out, fn, _ = score(
        [
            (single(), [det("dog")]),  # right
            (single(), []),  # missing
            (single(), [det("dog", 0.25)]),  # below the 0.3 threshold
            (single(), [det("dog"), det("dog", 0.8, (50, 50, 60, 60))]),  # two dogs: not strict, still "correct"
            (single(), [det("Dog "), det("cat")]),  # labels compare lower-case; other classes ignored
            (single(), [det("dog"), det("dog"), det("dog")]),  # over-counting by 2: partial score -1
        ]
    )
    assert out["geneval"].tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, -1.0]
    assert out["geneval/strict"].tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert out["geneval/correct"].tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert fn.requests[0][1][0] == ["dog"] and fn.requests[0][2] is None  # classes asked, no colours needed


def test_two_objects():
    meta = {"tag": "two_object", "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1}]}
    out, _, _ = score([(meta, [det("dog"), det("cat")]), (meta, [det("dog")]), (meta, [])])
    assert out["geneval"].tolist() == [1.0, 0.5, 0.0]
    assert out["geneval/strict"].tolist() == [1.0, 0.0, 0.0]


def test_counting_uses_the_higher_threshold_and_excludes():
    meta = {"tag": "counting", "include": [{"class": "apple", "count": 3}], "exclude": [{"class": "apple", "count": 4}]}
    three = [det("apple", 0.95, (i * 20, 0, i * 20 + 10, 10)) for i in range(3)]
    out, _, _ = score(
        [
            (meta, three),
            (meta, three[:2] + [det("apple", 0.85, (90, 0, 99, 10))]),  # 0.85 < 0.9: only 2 apples count
            (meta, three + [det("apple", 0.95, (90, 0, 99, 10))]),  # 4 apples: excluded
        ]
    )
    assert out["geneval"].tolist() == pytest.approx([1.0, 1 - 1 / 3, 1 - 1 / 3])
    assert out["geneval/strict"].tolist() == [1.0, 0.0, 0.0]
    assert out["geneval/correct"].tolist() == [1.0, 0.0, 0.0]  # >= 3 holds for 4, but the exclude fails
    # the same 0.85 apple counts under the 0.3 threshold of other tags
    other = {**meta, "tag": "two_object"}
    out, _, _ = score([(other, three[:2] + [det("apple", 0.85, (90, 0, 99, 10))])])
    assert out["geneval/strict"].item() == 1.0


def test_colors():
    meta = single("car", tag="colors", color="red")
    out, fn, scorer = score(
        [
            (meta, [det("car", color="red")]),
            (meta, [det("car", color="blue")]),
            (meta, [{**det("car"), "colors": {"red": 0.1, "green": 0.7, "blue": 0.2}}]),  # probabilities: argmax
            (meta, [det("car")]),  # no colour from the detector: cannot score
        ]
    )
    assert out["geneval"][:3].tolist() == [1.0, 0.5, 0.5]  # count term 1, colour term 0 -> mean 0.5
    assert out["geneval/strict"][:3].tolist() == [1.0, 0.0, 0.0]
    assert torch.isnan(out["geneval"][3]) and torch.isnan(out["geneval/strict"][3])
    assert scorer.counters["missing_color"] == 1 and scorer.counters["nan"] == 1
    assert fn.requests[0][2] == list(COLORS)  # colours asked for when a clause needs them
    assert "blue" in " ".join(scorer.last_reasons[1])


def test_position():
    meta = {
        "tag": "position",
        "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["left of", 0]}],
    }
    dog, cat_left, cat_right = (
        det("dog", box=(60, 0, 80, 20)),
        det("cat", box=(0, 0, 20, 20)),
        det("cat", box=(90, 0, 99, 20)),
    )
    out, _, _ = score(
        [
            (meta, [dog, cat_left]),
            (meta, [dog, cat_right]),
            (meta, [cat_left]),  # no dog: the position cannot hold
            (meta, [dog, det("cat", box=(59, 0, 79, 20))]),  # within the margin: no relation
        ]
    )
    assert out["geneval"].tolist() == pytest.approx([1.0, 2 / 3, 1 / 3, 2 / 3])
    assert out["geneval/strict"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert out["geneval/correct"].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_color_attribution():
    meta = {
        "tag": "color_attr",
        "include": [{"class": "bench", "count": 1, "color": "blue"}, {"class": "vase", "count": 1, "color": "yellow"}],
    }
    out, _, _ = score(
        [
            (meta, [det("bench", color="blue"), det("vase", color="yellow")]),
            (meta, [det("bench", color="yellow"), det("vase", color="blue")]),  # colours swapped
            (meta, [det("bench", color="blue")]),
        ]
    )
    assert out["geneval"].tolist() == pytest.approx([1.0, 0.5, (1 + 1 + 0) / 3])
    assert out["geneval/strict"].tolist() == [1.0, 0.0, 0.0]


def test_original_geneval_checks_only_the_best_count_objects():
    # two dogs, the best one red: "a red dog" is correct for GenEval (>= 1, best one red), not strict
    meta = single("dog", tag="colors", color="red")
    verdict = evaluate(
        [Detection("dog", 0.9, (0, 0, 5, 5), "red"), Detection("dog", 0.8, (9, 9, 15, 15), "green")], meta
    )
    assert verdict.correct and not verdict.strict and verdict.score == 0.0


def test_summary_per_tag_and_overall():
    strict = torch.tensor([1.0, 0.0, 1.0, 1.0, float("nan")])
    summary = summarize(strict, ["counting", "counting", "position", "colors", "colors"])
    assert summary == {"colors": 1.0, "counting": 0.5, "position": 1.0, "overall": pytest.approx(2.5 / 3)}


@pytest.mark.parametrize(
    "meta,why",
    [
        ({"tag": "x"}, "non-empty 'include'"),
        ({"include": [{"count": 1}]}, "needs a 'class'"),
        ({"include": [{"class": "dog", "count": 0}]}, "integer >= 1"),
        ({"include": [{"class": "dog", "position": ["left of", 0]}]}, "earlier include entry"),
        ({"include": [{"class": "dog"}, {"class": "cat", "position": ["beside", 0]}]}, "relation"),
        ("{not json", "not JSON"),
    ],
)
def test_malformed_metadata_raises(meta, why):
    with pytest.raises(ValueError, match=why):
        evaluate([], meta)


def test_metadata_as_json_text_and_batching():
    metas = [json.dumps(single("dog")), single("cat"), single("bird"), json.dumps(single("dog", count=2))]
    dets = [[det("dog")], [det("cat")], [], [det("dog"), det("dog")]]
    with detector(dets) as (url, fn):
        scorer = build_scorer("geneval", url=url, batch_size=3, **FAST)
        out = scorer(tagged(4), metadata={"geneval": metas})
    assert out["geneval/strict"].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert [r[0] for r in fn.requests] == [3, 1]  # one request per micro-batch
    assert scorer.server_info["detector"] == "stub"
    with pytest.raises(ValueError, match="needs metadata"):
        scorer(tagged(1))


# -- detector failures -----------------------------------------------------------------------------


class BadDetector(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, mode, delay=0.0):
        self.mode, self.delay, self.posts = mode, delay, 0
        super().__init__(("127.0.0.1", 0), BadHandler)

    def handle_error(self, request, client_address):
        pass


class BadHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, status, body: bytes):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, b'{"status": "ok"}')

    def do_POST(self):
        self.server.posts += 1
        n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["images"])
        mode = self.server.mode
        if mode == "slow":
            time.sleep(self.server.delay)
            self._send(200, json.dumps({"detections": [[]] * n}).encode())
        elif mode == "garbage":
            self._send(200, b"Internal Server Error")
        elif mode == "error":
            self._send(500, b'{"error": "mmdet exploded"}')
        elif mode == "wrong_length":
            self._send(200, json.dumps({"detections": [[]] * (n + 1)}).encode())
        elif mode == "bad_box":
            self._send(
                200, json.dumps({"detections": [[{"label": "dog", "score": 0.9, "box": [5, 5, 1, 1]}]] * n}).encode()
            )
        elif mode == "unavailable":
            self._send(503, b'{"error": "busy"}')


@contextmanager
def bad(mode, delay=0.0):
    server = BadDetector(mode, delay)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "mode,why",
    [
        ("garbage", "Expecting value"),
        ("error", "HTTP 500: mmdet exploded"),
        ("wrong_length", "for 3 images, expected 2"),
        ("bad_box", "x2 < x1"),
        ("unavailable", "3 attempt"),
    ],
)
def test_detector_failures_are_nan_and_counted_or_raise(mode, why):
    metas = {"geneval": [single(), single()]}
    with bad(mode) as (url, _):
        scorer = build_scorer("geneval", url=url, **FAST)
        out = scorer(tagged(2), metadata=metas)
        with pytest.raises(RemoteRewardError, match=why):
            build_scorer("geneval", url=url, on_failure="raise", **FAST)(tagged(2), metadata=metas)
    for key in ("geneval", "geneval/strict", "geneval/correct"):
        assert torch.isnan(out[key]).all()  # never a silent 0
    assert scorer.counters["failed_requests"] == 1 and scorer.counters["nan"] == 2


def test_slow_detector_is_bounded_in_time():
    with bad("slow", delay=5.0) as (url, _):
        scorer = build_scorer("geneval", url=url, timeout_s=0.2, max_attempts=2, backoff_s=0.02, max_backoff_s=0.05)
        start = time.monotonic()
        out = scorer(tagged(2), metadata={"geneval": [single(), single()]})
        elapsed = time.monotonic() - start
    assert torch.isnan(out["geneval"]).all() and elapsed < 2.0
    assert scorer.counters["attempts"] == 1 + 2 and scorer.counters["unreachable"] == 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_down_detector():
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(RemoteRewardError, match=r"/health.*3 attempt\(s\)"):  # at start-up: a setup error
        build_scorer("geneval", url=url, **FAST)(tagged(1), metadata={"geneval": [single()]})
    later = build_scorer("geneval", url=url, health_check=False, **FAST)  # gone after start-up: NaN, counted
    out = later(tagged(1), metadata={"geneval": [single()]})
    assert torch.isnan(out["geneval"]).all() and later.counters["failed_requests"] == 1
    assert time.monotonic() - start < 2.0


def test_detector_server_reports_errors():
    def broken(images, classes, colors):
        raise RuntimeError("weights missing")

    server = make_detector_server(broken)
    server.serve_in_thread()
    try:
        scorer = build_scorer("geneval", url=server.url, on_failure="raise", **FAST)
        with pytest.raises(RemoteRewardError, match="HTTP 500: detector failed: RuntimeError: weights missing"):
            scorer(tagged(1), metadata={"geneval": [single()]})
    finally:
        server.shutdown()
        server.server_close()


def test_settings_are_checked():
    with pytest.raises(ValueError, match="on_failure"):
        build_scorer("geneval", url="http://127.0.0.1:1", on_failure="zero")
    with pytest.raises(ValueError, match="nms_iou"):
        build_scorer("geneval", url="http://127.0.0.1:1", nms_iou=0)
