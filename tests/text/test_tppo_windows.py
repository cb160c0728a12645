"""T-PPO's windowed generation (`critic.window`, flowgrpo/text/windows.py): streams carry their unfinished response
into the next step as context, the reward functions read whole responses, ended streams take fresh prompts, the
config rules, and a stop + resume continues bit-identically (the stream pool is checkpointed)."""

from pathlib import Path

import pytest
import torch

import flowgrpo.text.tppo  # noqa: F401  (registers the method)
from flowgrpo.checkpoint import latest_checkpoint
from flowgrpo.config import ConfigError
from flowgrpo.text import TextGRPOTrainer, load_text_config
from flowgrpo.text.tppo import TextTPPOMethod

ROOT = Path(__file__).resolve().parents[2]
TPPO = ROOT / "configs" / "text" / "tiny_tppo.yaml"
EOS = 256  # the tiny byte tokenizer's <|endoftext|>
SMALL = ["prompts_per_iteration=2", "group_size=2", "generation.batch_size=3", "generation.max_new_tokens=12",
         "critic.window=4"]  # fmt: skip


def _config(tmp_path, *overrides, name="run"):
    base = [f"output_dir={tmp_path / name}", "progress=false", "num_threads=1", *SMALL]
    return load_text_config(TPPO, [*base, *overrides])


def test_streams_continue_with_their_earlier_tokens_as_context(tmp_path):
    seen: list[list[int]] = []

    def whole(prompts, completions, completion_ids, **kwargs):  # records what the reward functions read
        seen.extend(completion_ids)
        return [1.0] * len(completion_ids)

    trainer = TextGRPOTrainer(_config(tmp_path, "rewards=[{name: whole}]"), {"whole": whole})
    col = trainer.collector
    first = col.collect({}, 0).rollout
    rows0, pool0 = first.prompt_index.clone(), col.windows.pool.state_dict()
    assert first.num_sequences == 4 and first.completion_ids.shape[1] <= 4
    record: dict = {}
    second = col.collect(record, 1).rollout
    assert record["windows/continued"] == int(first.truncated.sum()) > 0
    for s in range(4):
        p_mask = second.prompt_mask[s].bool()
        context = second.prompt_ids[s][p_mask].tolist()
        prompt = list(trainer.data.prompt_ids[int(second.prompt_index[s])])
        if bool(first.truncated[s]):  # carried on: its prompt + its first window are the context, same dataset row
            assert second.prompt_index[s] == rows0[s]
            assert context == prompt + first.completion_ids[s][first.completion_mask[s]].tolist()
            assert int(pool0["length"][s]) == int(first.lengths[s])
            # the reward read the whole response: both windows
            both = first.completion_ids[s][first.completion_mask[s]].tolist()
            assert seen[4 + s] == both + second.completion_ids[s][second.completion_mask[s]].tolist()
        else:  # ended with EOS: a fresh prompt, no earlier tokens
            assert context == prompt and first.completion_ids[s][first.lengths[s] - 1] == EOS
    assert seen[:4] == [first.completion_ids[s][first.completion_mask[s]].tolist() for s in range(4)]
    # every response ends by the budget of 12 tokens: 3 windows of 4
    col.collect({}, 2)
    assert int(col.windows.pool.length.max()) <= 8
    record = {}
    col.collect(record, 3)
    assert int(col.windows.pool.length.max()) <= 8 and record["windows/continued"] <= 4


def test_window_config_rules(tmp_path):
    with pytest.raises(ConfigError, match=r"critic.window \(12\) must be below generation.max_new_tokens \(12"):
        _config(tmp_path, "critic.window=12")
    cfg = _config(tmp_path)
    cfg.generation.backend = "vllm"  # (a tiny model refuses vLLM at load before this rule)
    with pytest.raises(ValueError, match="critic.window: generation.backend must be transformers.*got vllm"):
        TextTPPOMethod.check_config(cfg)
    with pytest.raises(ConfigError, match="critic.window: dynamic_sampling.enabled must be False"):
        _config(tmp_path, "dynamic_sampling.enabled=true")


def _tensors(run_dir: Path, part: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(latest_checkpoint(run_dir / "checkpoints") / f"tensors.{part}.safetensors")


def test_stop_and_resume_with_windows_is_bit_identical(tmp_path):
    # seed 5: responses finish at steps 2 and 4 (critic targets and steps before and after the stop)
    common = ["iterations=4", "checkpoint.every=2", "checkpoint.keep_last=5", "seed=5"]
    full = TextGRPOTrainer(_config(tmp_path, *common, name="uninterrupted")).train()
    first = TextGRPOTrainer(_config(tmp_path, *common, "stop_after=2", name="interrupted")).train()
    torch.manual_seed(4321)
    resumed = TextGRPOTrainer(_config(tmp_path, *common, "resume=true", name="interrupted"))
    assert resumed.iteration == 2 and int(resumed.collector.windows.pool.length.sum()) > 0  # carried streams
    rest = resumed.train()
    keys = ("reward_mean", "loss/total", "critic/loss", "critic/value_mean", "windows/continued", "windows/finished")
    assert [[r.get(k) for k in keys] for r in first + rest] == [[r.get(k) for k in keys] for r in full]
    assert [r["windows/finished"] for r in full] == [0, 1, 0, 1] and full[-1]["critic/optimizer_steps"] == 1
    for group in ("model", "critic", "tppo_streams"):
        a, b = _tensors(tmp_path / "uninterrupted", group), _tensors(tmp_path / "interrupted", group)
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
