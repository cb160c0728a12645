"""edit_judge with Edit-R1's judge (template edit_r1, scoring expected_digit) against a stub OpenAI-compatible server:
the request asks for first-token log-probabilities and carries Edit-R1's prompt with the row's requirement; the
score is E[digit 0-5] / 5 over the digits' renormalised probabilities; replies without digits are NaN."""

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from reward_models import build_scorer
from reward_models.edit_judge import EDIT_R1_TEMPLATE, expected_digit

FAST = dict(timeout_s=2.0, max_attempts=2, backoff_s=0.02, max_backoff_s=0.05, seed=0, concurrency=1)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send({"object": "list", "data": [{"id": "judge"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        top = [{"token": t, "logprob": lp} for t, lp in next(self.server.tops).items()]
        choice = {"message": {"role": "assistant", "content": "3"}, "logprobs": {"content": [{"top_logprobs": top}]}}
        self._send({"choices": [choice]})


def serve(tops):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.bodies, server.tops, server.daemon_threads = [], iter(tops), True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_edit_r1_judge_scores_the_expected_digit_over_five():
    # first reply: P(5) = 0.5, P(3) = 0.25, P(0) = 0.125 and a non-digit token; second: no digit at all
    tops = [{"5": math.log(0.5), "3": math.log(0.25), "0": math.log(0.125), "The": math.log(0.1)}, {"I": -0.1}]
    server, url = serve(tops)
    try:
        judge = build_scorer(
            "edit_judge", url=url, template="edit_r1", scoring="expected_digit", score_min=0, score_max=5, **FAST
        )
        src = torch.full((3, 8, 8), 128, dtype=torch.uint8)
        meta = {"source_images": [[src], [src]], "requirement": ["keep the background", None]}
        out = judge(torch.rand(2, 3, 8, 8), ["make the cat red", "remove the hat"], meta)
    finally:
        server.shutdown()
        server.server_close()
    expected = (5 * 0.5 + 3 * 0.25 + 0 * 0.125) / (0.5 + 0.25 + 0.125)  # renormalised over the digits
    assert out["edit_judge/raw"][0].item() == pytest.approx(expected, rel=1e-5)
    assert out["edit_judge"][0].item() == pytest.approx(expected / 5, rel=1e-5)
    assert torch.isnan(out["edit_judge"][1]) and judge.counters["unparseable"] == 1
    first = server.bodies[0]
    assert first["logprobs"] is True and first["top_logprobs"] == 20
    parts = first["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image_url", "image_url", "text"]  # source, edit, prompt (Edit-R1's order)
    assert parts[-1]["text"] == EDIT_R1_TEMPLATE.replace("{prompt}", "make the cat red").replace(
        "{requirement}", "keep the background"
    )
    assert "Requirements: \n" in server.bodies[1]["messages"][0]["content"][-1]["text"]  # no requirement: ""


def test_expected_digit_and_bad_settings():
    assert expected_digit(json.dumps({"2": 0.0}), 0, 5) == 2.0
    assert expected_digit(json.dumps({"9": 0.0, "x": 0.0}), 0, 5) is None  # 9 lies outside 0..5
    with pytest.raises(ValueError, match="scoring must be one of"):
        build_scorer("edit_judge", url="http://127.0.0.1:9", model="m", scoring="logits")
    with pytest.raises(ValueError, match="unknown template 'edit_r2'"):
        build_scorer("edit_judge", url="http://127.0.0.1:9", model="m", template="edit_r2")
    with pytest.raises(ValueError, match="single-digit integer scores"):
        build_scorer("edit_judge", url="http://127.0.0.1:9", model="m", scoring="expected_digit")  # 1..10
