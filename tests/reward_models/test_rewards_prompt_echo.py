"""prompt_echo on a tiny LLaVA: the teacher-forced prompt log-likelihood, batching/padding, settings,
loading from a directory."""

import pytest
import torch

from reward_models import build_scorer, get_entry
from reward_models import prompt_echo as pe
from reward_models.images import ImageBatch

from rewards_helpers import quantised_images

PROMPTS = ["a red cat", "a blue dog riding a bike", "x", "a red cat"]


@pytest.fixture(scope="module")
def tiny_echo():
    return pe.PromptEcho.tiny(dtype="float32")


@pytest.fixture
def echo_images():
    return quantised_images(4, 40, 56, seed=3)


def reference_logprobs(scorer, image, prompt, query=pe.DEFAULT_QUERY):
    """One image, no padding, full logits: log P(prompt token j | image, query, tokens < j)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": query}]}]
    prefix = scorer.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = scorer.processor(text=[prefix], images=[image], return_tensors="pt")
    answer = scorer.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    n = enc["input_ids"].shape[1]
    ids = torch.cat([enc["input_ids"], torch.tensor([answer], dtype=torch.long)], 1)
    with torch.no_grad():
        logits = (
            scorer.model(
                input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=enc["pixel_values"].to(scorer.dtype)
            )
            .logits[0]
            .float()
        )
    logp = logits.log_softmax(-1)
    return torch.stack([logp[n - 1 + j, token] for j, token in enumerate(answer)])


def test_defaults_and_the_unverified_settings():
    assert get_entry("prompt_echo").kind == "pointwise"
    settings = get_entry("prompt_echo").settings
    assert settings["reduction"] == "mean" and settings["query"] == pe.DEFAULT_QUERY == "Describe this image in detail."
    assert settings["model"] == "Qwen/Qwen2.5-VL-7B-Instruct" and settings["image_backend"] == "pil"
    assert pe.REDUCTIONS == ("mean", "sum") and not pe.PromptEcho.differentiable


def test_score_is_the_mean_log_prob_of_the_prompt_tokens(tiny_echo, echo_images):
    out = tiny_echo(echo_images, PROMPTS)
    assert set(out) == {"prompt_echo", "prompt_echo/tokens"} and out["prompt_echo"].dtype == torch.float32
    pil = ImageBatch(echo_images).pil()
    refs = [reference_logprobs(tiny_echo, im, p) for im, p in zip(pil, PROMPTS)]
    assert out["prompt_echo/tokens"].tolist() == [9.0, 24.0, 1.0, 9.0]  # byte-level tokenizer: one per byte
    assert torch.allclose(out["prompt_echo"], torch.stack([r.mean() for r in refs]), atol=1e-5)
    assert (out["prompt_echo"] < 0).all()  # log-probabilities; a random model sits near -log(vocab)
    summed = pe.PromptEcho(tiny_echo.model, tiny_echo.processor, reduction="sum", device="cpu", dtype="float32")
    assert torch.allclose(summed(echo_images, PROMPTS)["prompt_echo"], torch.stack([r.sum() for r in refs]), atol=1e-4)


def test_depends_on_the_image_and_the_query(tiny_echo, echo_images):
    same_prompt = ["a red cat"] * 4
    by_image = tiny_echo(echo_images, same_prompt)["prompt_echo"]
    assert by_image.unique().numel() == 4  # the image is attended to
    other = pe.PromptEcho(tiny_echo.model, tiny_echo.processor, query="What is shown?", device="cpu", dtype="float32")
    assert "What is shown?" in other.prefix and "<image>" in other.prefix
    assert other.prefix.endswith("<|im_start|>assistant\n") and pe.DEFAULT_QUERY not in other.prefix
    pil = ImageBatch(echo_images).pil()
    expected = reference_logprobs(tiny_echo, pil[0], "a red cat", query="What is shown?").mean()
    got = other(echo_images[:1], ["a red cat"])["prompt_echo"]
    assert torch.allclose(got, expected[None], atol=1e-5) and not torch.allclose(got, by_image[:1], atol=1e-4)


def test_batching_padding_and_logit_cropping_do_not_change_scores(tiny_echo, echo_images):
    whole = tiny_echo(echo_images, PROMPTS)["prompt_echo"]
    one = pe.PromptEcho(tiny_echo.model, tiny_echo.processor, batch_size=1, device="cpu", dtype="float32")
    assert torch.allclose(one(echo_images, PROMPTS)["prompt_echo"], whole, atol=1e-5)
    uncropped = pe.PromptEcho(tiny_echo.model, tiny_echo.processor, device="cpu", dtype="float32")
    uncropped._crop_logits = False  # full logits instead of logits_to_keep
    assert torch.allclose(uncropped(echo_images, PROMPTS)["prompt_echo"], whole, atol=1e-5)
    inputs, prefix_len, answer_len = tiny_echo.inputs(ImageBatch(echo_images[:2]), PROMPTS[:2])
    assert answer_len.tolist() == [9, 24] and inputs["input_ids"].shape[1] == int(prefix_len[0]) + 24
    assert inputs["attention_mask"].sum(1).tolist() == (prefix_len + answer_len).tolist()  # right padding only


def test_empty_prompt_and_truncation(tiny_echo, echo_images):
    out = tiny_echo(echo_images[:2], ["", "a red cat"])
    assert torch.isnan(out["prompt_echo"][0]) and out["prompt_echo/tokens"][0] == 0
    assert torch.isfinite(out["prompt_echo"][1])
    short = pe.PromptEcho(tiny_echo.model, tiny_echo.processor, max_prompt_tokens=3, device="cpu", dtype="float32")
    pil = ImageBatch(echo_images).pil()
    expected = reference_logprobs(tiny_echo, pil[1], PROMPTS[1])[:3].mean()
    got = short(echo_images[1:2], PROMPTS[1:2])
    assert got["prompt_echo/tokens"].item() == 3 and torch.allclose(got["prompt_echo"], expected[None], atol=1e-5)


def test_nan_images_give_nan_rows_only(tiny_echo, echo_images):
    x = echo_images.clone()
    x[2] = float("nan")
    masked = tiny_echo(x, PROMPTS)["prompt_echo"]
    clean = tiny_echo(echo_images, PROMPTS)["prompt_echo"]
    assert torch.isnan(masked[2]) and torch.allclose(masked[[0, 1, 3]], clean[[0, 1, 3]], atol=1e-5)


def test_bfloat16_default_dtype(echo_images, tiny_echo):
    scorer = build_scorer("prompt_echo", tiny=True, device="cpu")  # default dtype bfloat16
    assert scorer.model.dtype == torch.bfloat16
    out = scorer(echo_images, PROMPTS)["prompt_echo"]
    assert out.dtype == torch.float32
    assert torch.allclose(out, tiny_echo(echo_images, PROMPTS)["prompt_echo"], atol=0.1)


def test_errors_are_clear(tiny_echo):
    with pytest.raises(ValueError, match="reduction must be one of"):
        build_scorer("prompt_echo", reduction="median")
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        pe.PromptEcho(tiny_echo.model, tiny_echo.processor, max_prompt_tokens=0, device="cpu")
    bare = pe.tiny_vlm_processor()
    bare.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        pe.PromptEcho(tiny_echo.model, bare, device="cpu")
    with pytest.raises(ValueError, match="needs one prompt per image"):
        tiny_echo(quantised_images(1))


def test_loads_a_local_checkpoint_directory(tiny_echo, echo_images, tmp_path):
    tiny_echo.save_pretrained(tmp_path)
    loaded = build_scorer("prompt_echo", model=str(tmp_path), local_files_only=True, device="cpu", dtype="float32")
    assert type(loaded.model).__name__ == "LlavaForConditionalGeneration"
    assert type(loaded.processor.image_processor).__name__ == "CLIPImageProcessorPil"  # image_backend="pil"
    assert loaded.prefix == tiny_echo.prefix
    assert torch.allclose(
        loaded(echo_images, PROMPTS)["prompt_echo"], tiny_echo(echo_images, PROMPTS)["prompt_echo"], atol=1e-5
    )
    with pytest.raises(OSError):  # a hub id offline fails fast, without a download
        build_scorer("prompt_echo", local_files_only=True, device="cpu")
