"""OCR reward: the real Tesseract engine on rendered text, the Flow-GRPO string rule with a fake
engine, targets from prompts and metadata, and the errors of a missing engine."""

import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from reward_models import build_scorer
from reward_models.ocr import OCREngineError, OCRScorer, TesseractEngine, normalise, ocr_distance, quoted_target


def render(text: str, size=(560, 200)) -> Image.Image:
    """Dark text on a light background, large font (Pillow's bundled scalable font, so no system
    font is needed)."""
    image = Image.new("RGB", size, (245, 240, 230))
    font = ImageFont.load_default(size=56)
    ImageDraw.Draw(image).text((24, 60), text, font=font, fill=(20, 20, 40))
    return image


class FakeEngine:
    """Reads a canned [(text, confidence)] per image, chosen by the image's red value."""

    name = "fake"

    def __init__(self, readings):
        self.readings = readings
        self.calls = 0

    def read(self, image):
        self.calls += 1
        reading = self.readings[image.getpixel((0, 0))[0]]
        if isinstance(reading, Exception):
            raise reading
        return reading


def tagged(n: int) -> list[Image.Image]:
    return [Image.new("RGB", (8, 8), (i, 0, 0)) for i in range(n)]


def test_tesseract_reads_rendered_text():
    scorer = build_scorer("ocr", workers=2)
    image = render("HELLO WORLD")
    prompts = ['a shop sign that says "Hello World"', 'a shop sign that says "Goodbye Moon"']
    out = scorer([image, image], prompts)
    right, wrong = out["ocr"].tolist()
    assert right >= 0.9, scorer.last_texts
    assert wrong < 0.5 and wrong < right
    assert out["ocr/distance"][0] <= 1
    assert "hello" in scorer.last_texts[0].lower()


def test_tesseract_engine_reports_words_with_confidences():
    words = TesseractEngine().read(render("GRPO 2025"))
    assert [w for w, _ in words] == ["GRPO", "2025"]
    assert all(0.5 < c <= 1.0 for _, c in words)


def test_missing_tesseract_binary_names_the_install_step():
    import pytesseract

    before = pytesseract.pytesseract.tesseract_cmd
    with pytest.raises(OCREngineError, match=r"not found.*apt-get install tesseract-ocr"):
        build_scorer("ocr", tesseract_cmd="/nonexistent/bin/tesseract")
    assert pytesseract.pytesseract.tesseract_cmd == before  # a failed engine leaves the global alone


def test_missing_language_data_names_the_package():
    with pytest.raises(OCREngineError, match="apt-get install tesseract-ocr-xyz"):
        build_scorer("ocr", lang="eng+xyz")


def test_unknown_engine_is_an_error():
    with pytest.raises(ValueError, match="unknown OCR engine 'paddle'.*tesseract"):
        build_scorer("ocr", engine="paddle")
    with pytest.raises(TypeError, match="read"):
        OCRScorer(object())


@pytest.mark.parametrize(
    "recognised,target,reward,dist",
    [
        ("Hello World", "hello world", 1.0, 0),  # case and spaces do not count
        ("OPEN 24 HOURS daily", "24 hours", 1.0, 0),  # a substring is a perfect match
        ("HELL0 WORLD", "Hello World", 0.9, 1),  # one substitution over 10 characters
        ("", "coffee", 0.0, 6),  # nothing read: distance capped at len(target)
        ("a very long unrelated sentence", "cat", 0.0, 3),  # cap: never below 0
        ("caat", "cat", 1 - 1 / 3, 1),  # one insertion
    ],
)
def test_flow_grpo_rule(recognised, target, reward, dist):
    r, d = ocr_distance(normalise(recognised), normalise(target))
    assert r == pytest.approx(reward) and d == dist


def test_targets_from_prompts():
    assert quoted_target('a sign saying "Hello" and "World"') == "Hello"
    assert quoted_target("a neon sign “OPEN” at night") == "OPEN"
    assert quoted_target('an unmatched "quote') is None
    assert quoted_target("no quotes at all") is None


def test_scorer_rules_nan_and_counters_with_a_fake_engine():
    engine = FakeEngine(
        {
            0: [("HELLO", 0.9), ("W0RLD", 0.8)],
            1: [("STOP", 0.95)],
            2: [("noise", 0.0), ("CAFE", 0.7)],  # confidence 0 is dropped (Flow-GRPO keeps conf > 0)
            3: RuntimeError("engine crashed"),
            4: [("anything", 0.9)],
            5: [("MENU", 0.9)],
        }
    )
    scorer = OCRScorer(engine, workers=3, batch_size=4)
    prompts = [
        'a card "Hello World"',
        'a road sign "STOP"',
        'a shop "Cafe"',
        'a poster "Sale"',
        "no quotes here",
        "ignored",
    ]
    out = scorer(tagged(6), prompts, {"ocr_target": [None, None, None, None, None, "menu"]})
    reward = out["ocr"]
    assert reward[:3].tolist() == pytest.approx([0.9, 1.0, 1.0])
    assert torch.isnan(reward[3]) and torch.isnan(reward[4])  # engine failure, no target: NaN, not 0
    assert reward[5] == 1.0  # the metadata target wins over the prompt
    assert scorer.counters["ocr_errors"] == 1 and scorer.counters["no_target"] == 1
    assert scorer.counters["nan"] == 2 and engine.calls == 5  # no OCR without a target
    assert scorer.last_texts[2] == "CAFE" and scorer.last_texts[4] is None
    scorer.close()


def test_min_confidence_and_empty_target():
    engine = FakeEngine({0: [("SALE", 0.4), ("SALT", 0.9)], 1: [("x", 1.0)]})
    strict = OCRScorer(engine, min_confidence=0.5, workers=1)
    out = strict(tagged(2), ['a poster "sale"', 'empty quotes ""'])["ocr"]
    assert out[0] == pytest.approx(0.75)  # only SALT is kept: one substitution over 4
    assert torch.isnan(out[1]) and strict.counters["no_target"] == 1


def test_nan_pixels_are_nan():
    engine = FakeEngine({0: [("STOP", 0.9)]})
    x = torch.zeros(2, 3, 8, 8)
    x[1] = float("nan")
    out = OCRScorer(engine, workers=1)(x, ['"stop"', '"stop"'])["ocr"]
    assert out[0] == 1.0 and torch.isnan(out[1])
