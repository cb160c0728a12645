"""VLM judges against a stub OpenAI-compatible server on 127.0.0.1: reply parsing, both-orders
averaging, group win rates, counters, bounded concurrency, and bounded time when the server is
slow, failing or down. The stub's judge looks at the images it is sent (mean brightness), so the
verdicts are known without a model."""

import base64
import io
import json
import socket
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from reward_models import build_scorer, get_entry
from reward_models.pairwise import group_win_rates, groups_win_rates, win_rates
from reward_models.remote import RemoteRewardError
from reward_models.vlm_judge import PairwiseVLMJudge, parse_preference, parse_score

FAST = dict(timeout_s=2.0, max_attempts=3, backoff_s=0.02, max_backoff_s=0.05, seed=0)
MODEL = "UnifiedReward"


def grey(values, size=16) -> torch.Tensor:
    """Constant-grey images (JPEG keeps their brightness exactly enough to compare)."""
    return torch.stack([torch.full((3, size, size), float(v)) for v in values])


def decode_images(body: dict) -> list[Image.Image]:
    out = []
    for part in body["messages"][0]["content"]:
        if part["type"] == "image_url":
            header, data = part["image_url"]["url"].split(",", 1)
            assert header in ("data:image/jpeg;base64", "data:image/png;base64")
            out.append(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"))
    return out


def mean_level(image: Image.Image) -> float:
    return float(np.asarray(image.convert("L"), dtype=np.float64).mean() / 255.0)


def brighter_wins(body: dict) -> str:
    first, second = (mean_level(im) for im in decode_images(body))
    winner = 1 if first > second else 2
    return f"<think>Image 1 total 20, Image 2 total 18.</think>\n<answer>Image {winner} is better</answer>"


def brightness_score(body: dict) -> str:
    (image,) = decode_images(body)
    return f"The picture is fine.\nFinal Score: {round(1 + 9 * mean_level(image))}"


class JudgeStub(ThreadingHTTPServer):
    """mode: 'ok' (answer(body) -> reply text), 'garbage', 'error', 'slow', 'flaky', 'no_choices'."""

    daemon_threads = True

    def __init__(self, answer=None, mode="ok", delay=0.0, fail_first=0, models=(MODEL,)):
        self.answer, self.mode, self.delay, self.fail_first, self.models = answer, mode, delay, fail_first, models
        self.bodies, self.headers_seen = [], []
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        super().__init__(("127.0.0.1", 0), JudgeHandler)

    def handle_error(self, request, client_address):  # clients that timed out closed the socket
        pass


class JudgeHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, status: int, body: bytes) -> None:
        self._leave()  # done before the reply goes out: a client holding the reply may send its next request
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": m} for m in self.server.models]}).encode())
        else:
            self._send(404, b'{"error": "not found"}')

    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            srv.bodies.append(body)
            srv.headers_seen.append(dict(self.headers))
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
            n_posts = len(srv.bodies)
        self._counted = True
        try:
            if srv.delay:
                time.sleep(srv.delay)
            if self.path != "/v1/chat/completions":
                self._send(404, b'{"error": "not found"}')
            elif srv.mode == "garbage":
                self._send(200, b"<html>upstream connect error</html>")
            elif srv.mode == "error":
                self._send(500, b'{"error": "CUDA out of memory"}')
            elif srv.mode == "no_choices":
                self._send(200, b'{"object": "chat.completion", "choices": []}')
            elif srv.mode == "flaky" and n_posts <= srv.fail_first:
                self._send(503, b'{"error": "warming up"}')
            else:
                text = srv.answer(body)
                reply = {
                    "object": "chat.completion",
                    "model": body["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
                }
                self._send(200, json.dumps(reply).encode())
        finally:
            self._leave()

    def _leave(self) -> None:
        """This request stops counting as in flight (once)."""
        if getattr(self, "_counted", False):
            self._counted = False
            with self.server.lock:
                self.server.in_flight -= 1


@contextmanager
def serving(server):
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- parsers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [
        ("<think>...</think><answer>Image 1 is better</answer>", 1.0),
        ("<answer> image 2 is better. </answer>", 0.0),
        ("<ANSWER>\n  Image 1 is better.\n</ANSWER>", 1.0),
        ("<answer>Image 2 is the better one? no: Image 1 is better</answer>", None),  # names both
        ("<answer>Image 1 is better</answer> ... <answer>Image 2 is better</answer>", 0.0),  # the last block
        ("Image 1 is better", None),  # no answer block
        ("<answer>Both are equally good</answer>", None),
        ("<answer>Image 1 is better and Image 2 is better</answer>", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_preference(text, expected):
    assert parse_preference(text) == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        ("Final Score: 7", 7.0),
        ("analysis...\nFinal Score: **8.5**", 8.5),
        ("Final Score: 2\nwait, Final Score: 9", 9.0),
        ("final score 7", None),
        ("no score", None),
        (None, None),
    ],
)
def test_parse_score(text, expected):
    assert parse_score(text) == expected


# -- pointwise -------------------------------------------------------------------------------------


def test_pointwise_scores_are_parsed_and_normalised():
    levels = [0.0, 1 / 3, 2 / 3, 1.0]
    server = JudgeStub(brightness_score)
    with serving(server) as url:
        judge = build_scorer("vlm_judge", url=url, concurrency=2, batch_size=3, **FAST)
        out = judge(grey(levels), ["a grey square"] * 4)
    raw = torch.tensor([round(1 + 9 * v) for v in levels], dtype=torch.float32)
    assert torch.equal(out["vlm_judge/raw"], raw)
    assert torch.allclose(out["vlm_judge"], (raw - 1) / 9)
    assert judge.client.served_models == [MODEL] and judge.client.model == MODEL  # from GET /v1/models
    assert judge.counters["replies"] == 4 and judge.counters["unparseable"] == 0
    assert judge.counters["requests"] == 1 + 4 and len(server.bodies) == 4


def test_request_content():
    server = JudgeStub(brightness_score)
    with serving(server) as url:
        judge = build_scorer(
            "vlm_judge",
            url=url + "/v1/chat/completions",
            model=MODEL,
            api_key="secret",
            max_side=8,
            max_tokens=77,
            request_params={"top_p": 1.0},
            **FAST,
        )
        judge(grey([0.5], size=32), ['a sign that says "hi"'])
    (body,) = server.bodies
    assert body["model"] == MODEL and body["temperature"] == 0.0 and body["max_tokens"] == 77
    assert body["top_p"] == 1.0
    content = body["messages"][0]["content"]
    assert [p["type"] for p in content] == ["image_url", "text"]
    assert 'a sign that says "hi"' in content[-1]["text"] and "{prompt}" not in content[-1]["text"]
    assert content[0]["image_url"]["url"].startswith("data:image/jpeg;base64,")
    assert decode_images(body)[0].size == (8, 8)  # longer side capped by max_side
    assert server.headers_seen[0]["Authorization"] == "Bearer secret"


def test_unparseable_and_out_of_range_replies_are_nan_and_counted():
    replies = iter(["Final Score: 10", "I cannot judge this image.", "Final Score: 42"])
    lock = threading.Lock()

    def answer(body):
        with lock:
            return next(replies)

    with serving(JudgeStub(answer)) as url:
        judge = build_scorer("vlm_judge", url=url, concurrency=1, **FAST)
        out = judge(grey([0.1, 0.2, 0.3]), ["p"] * 3)["vlm_judge"]
    assert out[0] == 1.0 and torch.isnan(out[1:]).all()  # never a silent 0
    assert judge.counters["unparseable"] == 1 and judge.counters["out_of_range"] == 1
    assert judge.counters["nan"] == 2
    assert judge.last_replies[1] == "I cannot judge this image."


def test_flow_grpo_style_one_to_five_over_five():
    with serving(JudgeStub(lambda body: "Final Score: 4")) as url:
        judge = build_scorer(
            "vlm_judge", url=url, template="Rate {prompt} from 1 to 5.", score_min=0, score_max=5, **FAST
        )
        out = judge(grey([0.5, 0.5]), ["x", "y"])["vlm_judge"]
    assert torch.allclose(out, torch.full((2,), 0.8))


@pytest.mark.parametrize(
    "mode,why",
    [
        ("garbage", "Expecting value"),
        ("no_choices", "not a chat completion"),
    ],
)
def test_bad_responses_are_nan_and_counted_or_raise(mode, why):
    with serving(JudgeStub(mode=mode)) as url:
        judge = build_scorer("vlm_judge", url=url, **FAST)
        out = judge(grey([0.2, 0.4, 0.6]), ["p"] * 3)["vlm_judge"]
        assert torch.isnan(out).all() and judge.counters["bad_responses"] == 3
        assert judge.counters["attempts"] == 1 + 3  # health + one attempt each: not retried
        strict = build_scorer("vlm_judge", url=url, on_bad_response="raise", **FAST)
        with pytest.raises(RemoteRewardError, match=why):
            strict(grey([0.2]), ["p"])


def test_a_judge_that_keeps_answering_500_is_retried_then_raises():
    # 500 is retried like 503 (vLLM answers 500 for an engine hiccup); when the attempts run out the run stops
    # loudly, as for a server that is down, even with on_bad_response="nan"
    with serving(JudgeStub(mode="error")) as url:
        judge = build_scorer("vlm_judge", url=url, concurrency=1, **FAST)
        with pytest.raises(RemoteRewardError, match=r"3 attempt\(s\).*HTTP 500: CUDA out of memory"):
            judge(grey([0.2, 0.4]), ["p"] * 2)
    assert judge.counters["attempts"] == 1 + 3 and judge.counters["bad_responses"] == 0


def test_concurrency_is_bounded_and_used():
    server = JudgeStub(brightness_score, delay=0.1)
    with serving(server) as url:
        start = time.monotonic()
        out = build_scorer("vlm_judge", url=url, concurrency=3, **FAST)(grey([0.5] * 9), ["p"] * 9)["vlm_judge"]
        elapsed = time.monotonic() - start
    assert torch.isfinite(out).all()
    assert server.max_in_flight == 3  # never more than `concurrency` requests at once
    assert elapsed < 9 * 0.1  # but they overlapped


def test_flaky_server_is_retried():
    server = JudgeStub(brightness_score, mode="flaky", fail_first=2)
    with serving(server) as url:
        judge = build_scorer("vlm_judge", url=url, concurrency=1, **FAST)
        out = judge(grey([1.0]), ["p"])["vlm_judge"]
    assert out.item() == 1.0 and judge.counters["retries"] == 2


def test_slow_server_fails_within_bounded_time():
    with serving(JudgeStub(brightness_score, delay=5.0)) as url:
        judge = build_scorer(
            "vlm_judge",
            url=url,
            concurrency=2,
            timeout_s=0.2,
            max_attempts=2,
            backoff_s=0.02,
            max_backoff_s=0.05,
            seed=0,
        )
        start = time.monotonic()
        with pytest.raises(RemoteRewardError) as info:
            judge(grey([0.5] * 6), ["p"] * 6)
        elapsed = time.monotonic() - start
    assert "/v1/chat/completions" in str(info.value) and "timed out" in str(info.value)
    assert elapsed < 2.0  # not 6 requests x 2 attempts x 0.2 s in sequence, and not the server's 5 s
    assert judge.counters["attempts"] <= 1 + 6 * 2


def test_down_server_raises_a_clear_error_quickly():
    url = f"http://127.0.0.1:{free_port()}"
    judge = build_scorer("vlm_judge_pairwise", url=url, **FAST)
    start = time.monotonic()
    with pytest.raises(RemoteRewardError) as info:
        judge(grey([0.2]), grey([0.8]), ["p"])
    assert time.monotonic() - start < 2.0
    message = str(info.value)
    assert f"{url}/v1/models" in message and "3 attempt(s)" in message
    assert "Connection refused" in message or "ConnectionRefused" in message


def test_down_server_without_health_check_stops_the_whole_batch():
    url = f"http://127.0.0.1:{free_port()}"
    judge = build_scorer(
        "vlm_judge",
        url=url,
        model=MODEL,
        health_check=False,
        concurrency=2,
        timeout_s=1.0,
        max_attempts=5,
        backoff_s=0.1,
        max_backoff_s=0.2,
        seed=0,
    )
    start = time.monotonic()
    with pytest.raises(RemoteRewardError, match="/v1/chat/completions"):
        judge(grey([0.5] * 12), ["p"] * 12)
    assert time.monotonic() - start < 2.5
    assert judge.counters["requests"] < 12  # queued requests never started once one had failed


def test_model_not_served_is_named():
    with serving(JudgeStub(brightness_score, models=("Qwen2.5-VL-7B",))) as url:
        with pytest.raises(RemoteRewardError, match=r"does not serve model 'UnifiedReward'.*Qwen2.5-VL-7B"):
            build_scorer("vlm_judge", url=url, model=MODEL, **FAST)(grey([0.5]), ["p"])


def test_settings_are_checked():
    with pytest.raises(ValueError, match="image_format"):
        build_scorer("vlm_judge", url="http://127.0.0.1:1", image_format="webp")
    with pytest.raises(ValueError, match="score_max"):
        build_scorer("vlm_judge", url="http://127.0.0.1:1", score_min=5, score_max=5)
    with pytest.raises(ValueError, match="model"):
        build_scorer("vlm_judge", url="http://127.0.0.1:1", health_check=False)
    with pytest.raises(ValueError, match="http"):
        build_scorer("vlm_judge_pairwise", url="127.0.0.1:8080")
    # built directly, the pairwise judge keeps room for reasoning, as the registry default does
    direct = PairwiseVLMJudge("http://127.0.0.1:1/v1/chat/completions")
    assert direct.client.max_tokens == 4096 == get_entry("vlm_judge_pairwise").settings["max_tokens"]
    assert direct.client.url == "http://127.0.0.1:1/v1"


# -- pairwise --------------------------------------------------------------------------------------


def test_pairwise_verdicts_follow_the_judge():
    server = JudgeStub(brighter_wins)
    with serving(server) as url:
        judge = build_scorer("vlm_judge_pairwise", url=url, **FAST)
        p = judge(grey([0.9, 0.1, 0.6]), grey([0.2, 0.7, 0.5]), ["a cat"] * 3)
    assert torch.equal(p, torch.tensor([1.0, 0.0, 1.0]))
    assert len(server.bodies) == 3 and judge.counters["undecided"] == 0
    body = server.bodies[0]
    assert [part["type"] for part in body["messages"][0]["content"]] == ["image_url", "image_url", "text"]
    assert "<answer>Image 1 is better</answer>" in body["messages"][0]["content"][-1]["text"]
    assert body["max_tokens"] == 4096


def test_undecided_is_a_counted_tie_and_bad_responses_are_nan():
    replies = {0: "<answer>Both are good</answer>", 1: "no tags at all", 2: "<answer>Image 2 is better</answer>"}
    count = iter(range(100))
    lock = threading.Lock()

    def answer(body):
        with lock:
            return replies[next(count)]

    with serving(JudgeStub(answer)) as url:
        judge = build_scorer("vlm_judge_pairwise", url=url, concurrency=1, **FAST)
        p = judge(grey([0.5] * 3), grey([0.5] * 3), ["p"] * 3)
    assert torch.equal(p, torch.tensor([0.5, 0.5, 0.0]))
    assert judge.counters["undecided"] == 2 and judge.counters["nan"] == 0
    with serving(JudgeStub(mode="garbage")) as url:
        judge = build_scorer("vlm_judge_pairwise", url=url, **FAST)
        p = judge(grey([0.5] * 2), grey([0.5] * 2), ["p"] * 2)
    assert torch.isnan(p).all() and judge.counters["bad_responses"] == 2 and judge.counters["nan"] == 2


def test_both_orders_cancels_position_bias():
    first_always = JudgeStub(lambda body: "<answer>Image 1 is better</answer>")
    with serving(first_always) as url:
        biased = build_scorer("vlm_judge_pairwise", url=url, both_orders=True, **FAST)
        p = biased(grey([0.9, 0.1]), grey([0.2, 0.7]), ["p"] * 2)
        single = build_scorer("vlm_judge_pairwise", url=url, **FAST)(grey([0.1]), grey([0.9]), ["p"])
    assert torch.equal(p, torch.tensor([0.5, 0.5])) and single.item() == 1.0
    assert biased.counters["order_disagreements"] == 2 and len(first_always.bodies) == 2 * 2 + 1
    # each pair was shown both ways (bodies arrive in any order: the requests run concurrently)
    shown = {tuple(round(mean_level(im), 1) for im in decode_images(b)) for b in first_always.bodies}
    assert shown == {(0.9, 0.2), (0.2, 0.9), (0.1, 0.7), (0.7, 0.1), (0.1, 0.9)}
    with serving(JudgeStub(brighter_wins)) as url:
        fair = build_scorer("vlm_judge_pairwise", url=url, both_orders=True, **FAST)
        p = fair(grey([0.9, 0.1]), grey([0.2, 0.7]), ["p"] * 2)
    assert torch.equal(p, torch.tensor([1.0, 0.0])) and fair.counters["order_disagreements"] == 0


def test_both_orders_averages_the_orders_that_could_be_judged():
    replies = iter(["<answer>Image 1 is better</answer>", "<answer>hmm</answer>"])
    with serving(JudgeStub(lambda body: next(replies))) as url:
        judge = build_scorer("vlm_judge_pairwise", url=url, both_orders=True, concurrency=1, **FAST)
        p = judge(grey([0.5]), grey([0.5]), ["p"])
    assert p.item() == pytest.approx((1.0 + (1 - 0.5)) / 2)


# -- group win rates -------------------------------------------------------------------------------


def test_group_win_rates_judge_every_unordered_pair_once():
    server = JudgeStub(brighter_wins)
    levels = [0.3, 0.9, 0.1, 0.6]
    with serving(server) as url:
        judge = build_scorer("vlm_judge_pairwise", url=url, **FAST)
        rates, pref = group_win_rates(judge, grey(levels), "a cat")
    assert len(server.bodies) == 4 * 3 // 2
    assert torch.allclose(rates, torch.tensor([1 / 3, 1.0, 0.0, 2 / 3]))
    off = ~torch.eye(4, dtype=torch.bool)
    assert torch.isnan(pref.diagonal()).all() and torch.allclose((pref + pref.T)[off], torch.ones(12))
    # every pair shows the lower index first, as Pref-GRPO does
    shown = [[round(mean_level(im), 1) for im in decode_images(b)] for b in server.bodies]
    assert sorted(shown) == sorted([[levels[i], levels[j]] for i in range(4) for j in range(i + 1, 4)])


def test_groups_win_rates_in_one_call_and_pil_groups():
    server = JudgeStub(brighter_wins)
    groups = [grey([0.2, 0.8, 0.5]), [Image.new("RGB", (16, 16), (v, v, v)) for v in (200, 20, 120)]]
    with serving(server) as url:
        judge = build_scorer("vlm_judge_pairwise", url=url, **FAST)
        rates, prefs = groups_win_rates(judge, groups, ["p", "q"])
    assert prefs.shape == (2, 3, 3) and len(server.bodies) == 6 and judge.counters["calls"] == 1
    assert torch.allclose(rates, torch.tensor([[0.0, 1.0, 0.5], [1.0, 0.0, 0.5]]))


def test_win_rates_count_unjudged_pairs_as_ties_like_the_core_estimator():
    nan = float("nan")
    pref = torch.tensor([[nan, 1.0, 0.5, nan], [0.0, nan, 1.0, 1.0], [0.5, 0.0, nan, 0.0], [nan, 0.0, 1.0, nan]])
    rates = win_rates(pref)
    assert torch.allclose(rates, torch.tensor([2.0 / 3, 2.0 / 3, 0.5 / 3, 1.5 / 3]))
    from flowgrpo.core import AdvantageConfig, GroupBatch, compute_advantages

    out = compute_advantages(GroupBatch(preferences=pref[None]), AdvantageConfig(estimator="win_rate"))
    assert out.metrics["win_rate/mean"] == pytest.approx(rates.mean().item(), abs=1e-6)
    z = (rates - rates.mean()) / (rates.std() + 1e-8)
    assert torch.allclose(out.advantages[0], z, atol=1e-5)
    with pytest.raises(ValueError, match="G >= 2"):
        win_rates(torch.zeros(1, 1))


def test_group_win_rates_work_with_any_pairwise_scorer():
    pair = build_scorer("pointwise_as_pairwise", scorer="brightness", temperature=1e-3)
    rates, pref = group_win_rates(pair, grey([0.5, 0.2, 0.8]), metadata={"note": "same for the group"})
    assert torch.allclose(rates, torch.tensor([0.5, 0.0, 1.0]))
    assert pref[2, 1] == 1.0 and pref[1, 2] == 0.0 and torch.isnan(pref.diagonal()).all()
    ragged = [grey([0.1, 0.9]), grey([0.3, 0.6, 0.9], size=8)]
    with pytest.raises(ValueError, match="differ in size"):
        groups_win_rates(pair, ragged)
    with pytest.raises(ValueError, match="every group or for none"):
        groups_win_rates(pair, [grey([0.1, 0.9]), grey([0.3, 0.6])], ["p", None])
