"""GenEval rules: one image's detections checked against its prompt's counts, colours and positions.

Pure functions, no I/O; reward_models.geneval sends the images to a detector and scores its
detections with `evaluate`.

Rules, per image, from its GenEval metadata {"tag", "include": [{"class", "count", "color"?,
"position"?: [relation, index of an earlier include entry]}], "exclude": [{"class", "count"}]}:
- keep a class's detections with score > threshold (0.3; 0.9 when tag == "counting"), highest
  score first, at most max_objects (16) per class, then greedy NMS at IoU nms_iou (1.0: off);
- relative position of A to B: centre offset d = c_A - c_B, shrunk per axis by margin x (size_A
  + size_B) (margin 0.1) towards 0; none if both shrunk offsets are < 1e-3, else with
  (dx, dy) = shrunk / |d|: "left of" dx < -0.5, "right of" dx > 0.5, "above" dy < -0.5,
  "below" dy > 0.5 (a diagonal offset can hold two relations);
- colour: the detector's colour of an object (GenEval's 10 colours) must equal the clause's.

Scores (the scorer's outputs, all [B]):
  '<key>'          partial score = mean over clause terms: per include entry
                   1 - |count - found| / count (negative when over-counting by more than count),
                   then, if the count matched, 1 - |count - right colour| / count for a colour
                   clause and 1 / 0 for a position clause (checked only if count and colour
                   matched); Flow-GRPO trains on this;
  '<key>/strict'   1 if every count is exact (==), every colour and position holds, and no
                   exclude clause is violated (the reward-server's strict_correct);
  '<key>/correct'  the published GenEval check: at least `count` objects (the `count` best
                   ones are checked for colour and position), exclude clauses as above.
Sources: thresholds and margin from Flow-GRPO's GenEval reward server; the
relation rule, the > comparisons, the NMS loop and the original `correct` check follow the
published GenEval evaluate_images.py as remembered [verify against the source]; the exact
structure of the partial score (which terms are added when a count fails, excludes not scored)
is from a description of yifan123/reward-server's GenEval scorer, not its code [unverified].
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
RELATIONS = ("left of", "right of", "above", "below")
THRESHOLD = 0.3
COUNTING_THRESHOLD = 0.9
MAX_OBJECTS = 16
NMS_IOU = 1.0
POSITION_MARGIN = 0.1


class MissingColor(ValueError):
    """A colour clause met a detection without a colour."""


@dataclass(frozen=True)
class Detection:
    label: str
    score: float
    box: tuple[float, float, float, float]
    color: str | None = None


@dataclass
class Verdict:
    score: float
    strict: bool
    correct: bool
    reasons: list[str] = field(default_factory=list)


def iou(a: Sequence[float], b: Sequence[float]) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def keep_detections(
    detections: Sequence[Detection], *, threshold: float, max_objects: int = MAX_OBJECTS, nms_iou: float = NMS_IOU
) -> dict[str, list[Detection]]:
    """Per class: score > threshold, best first, at most max_objects, greedy NMS (off at 1.0)."""
    by_class: dict[str, list[Detection]] = {}
    for det in detections:
        if det.score > threshold:
            by_class.setdefault(det.label, []).append(det)
    kept = {}
    for label, dets in by_class.items():
        order = sorted(dets, key=lambda d: -d.score)[:max_objects]
        chosen: list[Detection] = []
        while order:
            best = order.pop(0)
            chosen.append(best)
            if nms_iou < 1.0:
                order = [d for d in order if iou(best.box, d.box) < nms_iou]
        kept[label] = chosen
    return kept


def relative_position(box_a: Sequence[float], box_b: Sequence[float], margin: float = POSITION_MARGIN) -> set[str]:
    """Relations of A to B ("left of", "right of", "above", "below"), boxes [x1, y1, x2, y2]."""
    centre = [
        ((box_a[0] + box_a[2]) / 2, (box_a[1] + box_a[3]) / 2),
        ((box_b[0] + box_b[2]) / 2, (box_b[1] + box_b[3]) / 2),
    ]
    size_a = (abs(box_a[2] - box_a[0]), abs(box_a[3] - box_a[1]))
    size_b = (abs(box_b[2] - box_b[0]), abs(box_b[3] - box_b[1]))
    offset = [centre[0][k] - centre[1][k] for k in range(2)]
    shrunk = [
        max(abs(offset[k]) - margin * (size_a[k] + size_b[k]), 0.0) * math.copysign(1.0, offset[k]) for k in range(2)
    ]
    if all(abs(v) < 1e-3 for v in shrunk):
        return set()
    norm = math.hypot(*offset)
    dx, dy = shrunk[0] / norm, shrunk[1] / norm
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def check_geneval_metadata(meta: Any, where: str = "") -> dict:
    """Validate one prompt's GenEval metadata (a dict or its JSON text); return it as a dict."""
    if isinstance(meta, str):
        try:
            meta = json.loads(meta)
        except ValueError as e:
            raise ValueError(f"GenEval metadata{where} is not JSON: {e}") from None
    if not isinstance(meta, Mapping):
        raise ValueError(f"GenEval metadata{where} must be an object with 'include', got {type(meta).__name__}")
    include = meta.get("include")
    if not isinstance(include, list) or not include:
        raise ValueError(f"GenEval metadata{where} needs a non-empty 'include' list")
    for k, req in enumerate(list(include) + list(meta.get("exclude") or [])):
        if not isinstance(req, Mapping) or not isinstance(req.get("class"), str):
            raise ValueError(f"GenEval metadata{where}: clause {k} needs a 'class' name, got {req!r}")
        count = req.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"GenEval metadata{where}: clause {k} count must be an integer >= 1, got {count!r}")
    for k, req in enumerate(include):
        if "position" in req:
            pos = req["position"]
            if (
                not isinstance(pos, (list, tuple))
                or len(pos) != 2
                or pos[0] not in RELATIONS
                or not isinstance(pos[1], int)
                or not 0 <= pos[1] < k
            ):
                raise ValueError(
                    f"GenEval metadata{where}: include {k} position must be [relation in {RELATIONS}, "
                    f"index of an earlier include entry], got {pos!r}"
                )
        if "color" in req and not isinstance(req["color"], str):
            raise ValueError(f"GenEval metadata{where}: include {k} color must be a string, got {req['color']!r}")

    def clause(req: Mapping) -> dict:  # a normalised copy: names compare lower-case
        out = {**req, "class": req["class"].strip().lower(), "count": req.get("count", 1)}
        if "color" in req:
            out["color"] = req["color"].strip().lower()
        return out

    return {**meta, "include": [clause(r) for r in include], "exclude": [clause(r) for r in meta.get("exclude") or []]}


def _check(
    detected: Mapping[str, list[Detection]], meta: Mapping, *, exact: bool, margin: float
) -> tuple[bool, list[float], list[str]]:
    ok, terms, reasons = True, [], []
    groups: list[list[Detection] | None] = []
    for req in meta["include"]:
        cls, n = req["class"], req["count"]
        objects = detected.get(cls, [])
        found = objects if exact else objects[:n]
        matched = True
        terms.append(1.0 - abs(n - len(found)) / n)
        if (len(found) != n) if exact else (len(found) < n):
            ok = matched = False
            reasons.append(f"expected {cls} {'==' if exact else '>='} {n}, found {len(objects)}")
        else:
            if "color" in req:
                colors = [o.color for o in found]
                if any(c is None for c in colors):
                    raise MissingColor(f"the detector gave no colour for a '{cls}' detection")
                right = sum(c == req["color"] for c in colors)
                terms.append(1.0 - abs(n - right) / n)
                if right < n:
                    ok = matched = False
                    reasons.append(f"expected {req['color']} {cls} x{n}, found colours {colors}")
            if "position" in req and matched:
                relation, target = req["position"]
                if groups[target] is None:
                    good = False
                    reasons.append(f"no target for {cls} to be {relation}")
                else:
                    good = all(
                        relation in relative_position(o.box, t.box, margin) for o in found for t in groups[target]
                    )
                    if not good:
                        reasons.append(f"expected {cls} {relation} target {target}")
                terms.append(1.0 if good else 0.0)
                if not good:
                    ok = matched = False
        groups.append(found if matched else None)
    for req in meta["exclude"]:
        found = len(detected.get(req["class"], []))
        if found >= req["count"]:
            ok = False
            reasons.append(f"expected {req['class']} < {req['count']}, found {found}")
    return ok, terms, reasons


def evaluate(
    detections: Sequence[Detection],
    meta: Mapping,
    *,
    threshold: float = THRESHOLD,
    counting_threshold: float = COUNTING_THRESHOLD,
    max_objects: int = MAX_OBJECTS,
    nms_iou: float = NMS_IOU,
    position_margin: float = POSITION_MARGIN,
) -> Verdict:
    """Score one image's detections against its GenEval metadata."""
    meta = check_geneval_metadata(meta)
    cut = counting_threshold if meta.get("tag") == "counting" else threshold
    detected = keep_detections(detections, threshold=cut, max_objects=max_objects, nms_iou=nms_iou)
    strict, terms, reasons = _check(detected, meta, exact=True, margin=position_margin)
    correct, _, _ = _check(detected, meta, exact=False, margin=position_margin)
    return Verdict(sum(terms) / len(terms), strict, correct, reasons)


def summarize(correct: torch.Tensor, tags: Sequence[str]) -> dict[str, float]:
    """GenEval report: accuracy per tag (NaN rows left out) and 'overall' = the mean over tags."""
    values = correct.detach().float().cpu().tolist()
    per_tag: dict[str, list[float]] = {}
    for value, tag in zip(values, tags, strict=True):
        if not math.isnan(value):
            per_tag.setdefault(tag, []).append(value)
    out = {tag: sum(v) / len(v) for tag, v in sorted(per_tag.items())}
    if out:
        out["overall"] = sum(out.values()) / len(out)
    return out
