"""Wire format (JSON + PNG, no pickle) and the reference server script."""

import base64
import importlib.util
import io
import json
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import torch
from PIL import Image

from reward_models import build_scorer
from reward_models.images import ImageBatch
from reward_models.remote import RemoteScorer
from reward_models.serving import make_server
from reward_models.wire import WireError, decode_request, decode_scores, encode_png, encode_request, encode_scores

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "reward_server.py"


def test_request_round_trip_is_lossless(images):
    meta = {
        "reference_images": [images[0], None, [images[1], images[2]], Image.new("RGB", (3, 2)), images[3:5]],
        "tag": ["a", "b", "c", "d", "e"],
        "extra": [{"count": 2}, 1, 2.5, True, None],
    }
    payload = json.loads(json.dumps(encode_request(ImageBatch(images), ["p"] * 5, meta)))
    pil, prompts, decoded = decode_request(payload)
    assert torch.equal(ImageBatch(pil).tensor(), images) and prompts == ["p"] * 5
    assert decoded["tag"] == meta["tag"] and decoded["extra"] == meta["extra"]
    refs = decoded["reference_images"]
    assert refs[1] is None and len(refs[2]) == 2 and len(refs[4]) == 2 and refs[3].size == (3, 2)
    assert torch.equal(ImageBatch([refs[0]]).tensor()[0], images[0])


def test_scores_null_is_nan():
    payload = json.loads(json.dumps(encode_scores({"r": torch.tensor([1.5, float("nan"), float("inf")])}, "r")))
    assert payload == {"key": "r", "scores": {"r": [1.5, None, None]}}
    key, scores = decode_scores(payload, 3)
    assert key == "r" and scores["r"][0] == 1.5 and torch.isnan(scores["r"][1:]).all()


@pytest.mark.parametrize(
    "payload,why",
    [
        ([], "JSON object"),
        ({"scores": {}}, "non-empty"),
        ({"key": "x", "scores": {"r": [1.0]}}, "not one of its scores"),
        ({"key": "r", "scores": {"r": [1.0, 2.0]}}, "list of 1 numbers"),
        ({"key": "r", "scores": {"r": [True]}}, "neither numbers nor null"),
    ],
)
def test_bad_responses_are_rejected(payload, why):
    with pytest.raises(WireError, match=why):
        decode_scores(payload, 1)


def test_bad_requests_are_rejected():
    jpeg = io.BytesIO()
    Image.new("RGB", (2, 2)).save(jpeg, format="JPEG")
    png = encode_png(Image.new("RGB", (2, 2)))
    cases = [
        ({"images": "x"}, "'images' list"),
        ({"images": ["not base64!"]}, "undecodable"),
        ({"images": [base64.b64encode(jpeg.getvalue()).decode()]}, "must be PNG"),
        ({"images": [png], "prompts": ["a", "b"]}, "list of 1 strings"),
        ({"images": [png], "metadata": {"m": [1, 2]}}, "list of 1 values"),
    ]
    for payload, why in cases:
        with pytest.raises(WireError, match=why):
            decode_request(payload)


def test_server_http_errors():
    server = make_server(build_scorer("brightness"))
    server.serve_in_thread()
    try:

        def post(path, body, content_type="application/json"):
            req = urllib.request.Request(server.url + path, data=body, method="POST")
            req.add_header("Content-Type", content_type)
            try:
                with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=5) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        assert post("/score", b"{not json")[0] == 400
        # urllib's default for a body: the server reads only what it serves
        assert post("/score", b"{}", "application/x-www-form-urlencoded")[0] == 415
        assert post("/nothing", b"{}")[0] == 404
        status, body = post(
            "/score", json.dumps({"images": [encode_png(Image.new("RGB", (2, 2), (255, 255, 255)))]}).encode()
        )
        assert status == 200 and body == {"key": "brightness", "scores": {"brightness": [1.0]}}
        server.max_body_bytes = 10
        status, body = post("/score", b"{" + b" " * 20 + b"}")
        assert status == 413 and "smaller batches" in body["error"]
    finally:
        server.shutdown()
        server.server_close()


def load_script():
    spec = importlib.util.spec_from_file_location("reward_server_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_settings_parsing():
    parse = load_script().parse_settings
    assert parse('{"tiny": true}', ["dtype=bfloat16", "batch_size=8", "tiny=false"]) == {
        "tiny": False,
        "dtype": "bfloat16",
        "batch_size": 8,
    }
    with pytest.raises(SystemExit):
        parse(None, ["novalue"])


def test_script_serves_a_scorer(images):
    command = [sys.executable, str(SCRIPT), "--scorer", "brightness", "--port", "0"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
        try:
            first_line: list[str] = []
            reader = threading.Thread(target=lambda: first_line.append(proc.stdout.readline()), daemon=True)
            reader.start()
            reader.join(timeout=30)
            assert first_line and "serving brightness" in first_line[0]
            url = first_line[0].split(" on ")[-1].strip()
            assert url.startswith("http://127.0.0.1:")
            out = RemoteScorer(url, timeout_s=10, max_attempts=2, backoff_s=0.1)(images)
            assert torch.allclose(out["brightness"], build_scorer("brightness")(images)["brightness"], atol=1e-7)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
