"""GenEval-style compositional reward: a remote object detector, local scoring rules.

The detector (GenEval: Mask2Former Swin-S on COCO, mmdetection 2.x, plus a CLIP ViT-L/14 colour
classifier on each masked crop) lives in its own process because its dependencies clash with
ours; only detections cross the wire, as JSON (no pickle):

  GET  /health  -> {"status": "ok", ...}
  POST /detect  {"images": [<base64 PNG>, ...],
                 "classes": [[class name, ...] per image],     (the classes the prompt names)
                 "colors": ["red", ...] | null}                 (candidate colours, when asked)
             -> {"detections": [[{"label": str, "score": float, "box": [x1, y1, x2, y2],
                                  "color": str (optional), "colors": {name: prob} (optional),
                                  "mask": ... (optional, ignored)}, ...] per image]}
Boxes are pixels of the image as sent (x right, y down). make_detector_server wraps any Python
detect function into such a server (standard library only).

Rules, outputs and their sources: reward_models.geneval_rules. Outputs (all [B]): '<key>' the
partial score (Flow-GRPO trains on it), '<key>/strict' and '<key>/correct' (the published check).
NaN (counted) when the detector fails after bounded retries (HTTP 500 included) or answers garbage
(on_failure="nan", the default; "raise" raises RemoteRewardError), or when a colour clause
meets an object without a colour (counters["missing_color"]). Malformed metadata raises.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Mapping, Sequence

import torch
from PIL import Image

from .base import Scorer
from .geneval_rules import (
    COLORS,
    COUNTING_THRESHOLD,
    MAX_OBJECTS,
    NMS_IOU,
    POSITION_MARGIN,
    THRESHOLD,
    Detection,
    MissingColor,
    check_geneval_metadata,
    evaluate,
)
from .http_client import HttpClient, HttpSettings, HTTPStatusError, RemoteRewardError
from .registry import register, with_settings
from .serving import JSONHandler, LocalJSONServer, ServerLimits
from .wire import ImageTooLarge, WireError, decode_pngs, encode_png

log = logging.getLogger(__name__)

FAILURE_POLICIES = ("nan", "raise")


# -- wire ----------------------------------------------------------------------------------------


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise WireError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def parse_detection(item: Any) -> Detection:
    if not isinstance(item, Mapping):
        raise WireError(f"a detection must be an object, got {type(item).__name__}")
    label = item.get("label")
    if not isinstance(label, str):
        raise WireError(f"detection 'label' must be a string, got {label!r}")
    box = item.get("box")
    if not isinstance(box, (list, tuple)) or len(box) != 4:
        raise WireError(f"detection 'box' must be [x1, y1, x2, y2], got {box!r}")
    box = tuple(_number(v, "a box coordinate") for v in box)
    if box[2] < box[0] or box[3] < box[1]:
        raise WireError(f"detection box {list(box)} has x2 < x1 or y2 < y1")
    color = item.get("color")
    if color is None and isinstance(item.get("colors"), Mapping) and item["colors"]:
        probs = {str(k): _number(v, "a colour probability") for k, v in item["colors"].items()}
        color = max(probs, key=probs.get)
    if color is not None and not isinstance(color, str):
        raise WireError(f"detection 'color' must be a string, got {color!r}")
    return Detection(
        label.strip().lower(),
        _number(item.get("score"), "detection 'score'"),
        box,
        None if color is None else color.strip().lower(),
    )


def parse_detections(payload: Any, n: int) -> list[list[Detection]]:
    """Validate a /detect answer for n images."""
    if not isinstance(payload, Mapping) or not isinstance(payload.get("detections"), list):
        raise WireError("detector answer must be a JSON object with a 'detections' list")
    per_image = payload["detections"]
    if len(per_image) != n:
        raise WireError(f"detector answered for {len(per_image)} images, expected {n}")
    out = []
    for dets in per_image:
        if not isinstance(dets, list):
            raise WireError(f"detections of one image must be a list, got {type(dets).__name__}")
        out.append([parse_detection(d) for d in dets])
    return out


def detection_to_json(det: Detection | Mapping) -> dict:
    if isinstance(det, Mapping):
        return dict(det)
    out = {"label": det.label, "score": det.score, "box": list(det.box)}
    if det.color is not None:
        out["color"] = det.color
    return out


# -- scorer --------------------------------------------------------------------------------------


class GenEvalScorer(Scorer):
    name = "geneval"

    def __init__(
        self,
        url: str,
        *,
        metadata_key: str = "geneval",
        threshold: float = THRESHOLD,
        counting_threshold: float = COUNTING_THRESHOLD,
        max_objects: int = MAX_OBJECTS,
        nms_iou: float = NMS_IOU,
        position_margin: float = POSITION_MARGIN,
        on_failure: str = "nan",
        batch_size: int = 16,
        key: str | None = None,
        **http,
    ):
        """`http`: the HttpSettings fields (timeout_s, max_attempts, token, health_check, ...)."""
        super().__init__(batch_size=batch_size, key=key)
        if on_failure not in FAILURE_POLICIES:
            raise ValueError(f"on_failure must be one of {FAILURE_POLICIES}, got {on_failure!r}")
        if not 0 < nms_iou <= 1 or int(max_objects) < 1 or position_margin < 0:
            raise ValueError("need 0 < nms_iou <= 1, max_objects >= 1 and position_margin >= 0")
        settings = HttpSettings(url, **http)
        self.client = HttpClient(settings, counters=self.counters, what="detector server")
        self.url = self.client.url
        self.metadata_key = metadata_key
        self.metadata_keys = (metadata_key,)
        self.rules = dict(
            threshold=float(threshold),
            counting_threshold=float(counting_threshold),
            max_objects=int(max_objects),
            nms_iou=float(nms_iou),
            position_margin=float(position_margin),
        )
        self.on_failure, self.health_check = on_failure, settings.health_check
        self.server_info: dict | None = None
        self.last_reasons: list[list[str] | None] = []

    def health(self) -> dict:
        """GET /health; raises RemoteRewardError unless the server says it is ok (checked once,
        before the first request: a detector that is down at start-up is a setup error)."""
        self.server_info = self.client.health()
        return self.server_info

    def __call__(self, images, prompts=None, metadata=None):
        if self.health_check and self.server_info is None:
            self.health()
        self.last_reasons = []
        return super().__call__(images, prompts, metadata)

    def _detect(self, images, metas: list[dict]) -> list[list[Detection]] | None:
        classes = [sorted({r["class"] for r in m["include"] + m["exclude"]}) for m in metas]
        wants_color = any("color" in r for m in metas for r in m["include"])
        request = {
            "images": [encode_png(im) for im in images.pil()],
            "classes": classes,
            "colors": list(COLORS) if wants_color else None,
        }
        try:
            return parse_detections(self.client.post_json("/detect", request), len(metas))
        except (RemoteRewardError, HTTPStatusError, WireError, ValueError) as e:  # json errors are ValueErrors
            self.counters["failed_requests"] += 1
            # RemoteRewardError already names the URL (attempts, status); the others are the answer's faults
            message = str(e) if isinstance(e, RemoteRewardError) else f"detector server {self.url}/detect failed: {e}"
            if self.on_failure == "raise":
                raise RemoteRewardError(message) from None
            log.warning("%s (scored NaN)", message)
            return None

    def score_batch(self, images, prompts, metadata):
        n = len(prompts)
        metas = [check_geneval_metadata(m, f" of image {i}") for i, m in enumerate(metadata[self.metadata_key])]
        nan = float("nan")
        score, strict, correct = [nan] * n, [nan] * n, [nan] * n
        reasons: list[list[str] | None] = [None] * n
        detections = self._detect(images, metas)
        if detections is not None:
            for i, (dets, meta) in enumerate(zip(detections, metas)):
                try:
                    verdict = evaluate(dets, meta, **self.rules)
                except MissingColor as e:
                    self.counters["missing_color"] += 1
                    reasons[i] = [str(e)]
                    continue
                score[i], strict[i], correct[i] = verdict.score, float(verdict.strict), float(verdict.correct)
                reasons[i] = verdict.reasons
        self.last_reasons.extend(reasons)

        def t(values):
            return torch.tensor(values, dtype=torch.float32)

        return {self.key: t(score), f"{self.key}/strict": t(strict), f"{self.key}/correct": t(correct)}


@register("geneval")
@with_settings(HttpSettings)
def build_geneval(
    *,
    metadata_key: str = "geneval",
    threshold: float = THRESHOLD,
    counting_threshold: float = COUNTING_THRESHOLD,
    max_objects: int = MAX_OBJECTS,
    nms_iou: float = NMS_IOU,
    position_margin: float = POSITION_MARGIN,
    on_failure: str = "nan",
    batch_size: int = 16,
    key: str | None = None,
    **http,
) -> GenEvalScorer:
    """GenEval rules (counts, colours, positions) over a remote detector: partial score, strict, correct.
    `token`: the detector server's bearer token, or `env:NAME`."""
    return GenEvalScorer(
        metadata_key=metadata_key,
        threshold=threshold,
        counting_threshold=counting_threshold,
        max_objects=max_objects,
        nms_iou=nms_iou,
        position_margin=position_margin,
        on_failure=on_failure,
        batch_size=batch_size,
        key=key,
        **http,
    )


# -- server --------------------------------------------------------------------------------------

DetectFn = Callable[[list[Image.Image], list[list[str]], "list[str] | None"], Sequence[Sequence[Any]]]


class DetectorServer(LocalJSONServer):
    """Serves a Python detect function over the protocol above; detection is serialised by a lock
    (one model on one device). Binds 127.0.0.1 unless told otherwise."""

    def __init__(
        self,
        detect: DetectFn,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        name: str = "detector",
        max_body_bytes: int = 512 * 2**20,
        limits: ServerLimits | None = None,
        token: str | None = None,
    ):
        self.detect, self.detector_name = detect, name
        super().__init__(_DetectorHandler, host, port, max_body_bytes, limits, token)


class _DetectorHandler(JSONHandler):
    server: DetectorServer

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/health":
            self._reply(200, {"status": "ok", "detector": self.server.detector_name})
        else:
            self._reply(404, {"error": f"unknown path {self.path}; use GET /health or POST /detect"})

    def do_POST(self) -> None:
        if self.path.rstrip("/") != "/detect":
            self._reply(404, {"error": f"unknown path {self.path}; use POST /detect"})
            return
        body = self._read_body()
        payload = None if body is None else self._parse_json(body)
        if payload is None:
            return
        try:
            limits = self.server.limits
            images = decode_pngs(payload["images"], limits.max_pixels, limits.max_request_pixels)
            classes = payload.get("classes") or [[] for _ in images]
            if len(classes) != len(images):
                raise WireError(f"{len(classes)} class lists for {len(images)} images")
        except ImageTooLarge as e:
            self._reply(413, {"error": str(e)})
            return
        except (ValueError, KeyError, TypeError, WireError) as e:
            self._reply(400, {"error": f"bad request: {e}"})
            return
        try:
            with self.server.lock:
                found = self.server.detect(images, classes, payload.get("colors"))
            detections = [[detection_to_json(d) for d in dets] for dets in found]
        except Exception as e:  # noqa: BLE001 - reported to the client, the server stays up
            self._reply(500, {"error": f"{self.server.detector_name} failed: {type(e).__name__}: {e}"})
            return
        self._reply(200, {"detections": detections})

    def log_message(self, format: str, *args) -> None:
        pass


def make_detector_server(detect: DetectFn, host: str = "127.0.0.1", port: int = 0, **kwargs) -> DetectorServer:
    """A GenEval detector server around detect(images, classes, colors) -> per image a list of
    {"label", "score", "box", "color"?} dicts (or Detection objects). Port 0 picks a free one."""
    return DetectorServer(detect, host, port, **kwargs)
