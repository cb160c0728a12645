"""method tppo (T-PPO): Extended GAE advantages from a critic in the text trainer. The method's advantages equal
core.egae's on a hand-built batch (float64), the critic starts from the policy's weights with V = 0, the config
rules, an exact resume (policy, critic and its AdamW), and a tiny learning run against lr 0."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import flowgrpo.text.tppo  # noqa: F401  (registers the method)
from flowgrpo.checkpoint import latest_checkpoint
from flowgrpo.config import ConfigError
from flowgrpo.core import AdvantageConfig, GroupBatch, compute_advantages
from flowgrpo.core.egae import TokenValueBatch, egae
from flowgrpo.text import TextGRPOTrainer, load_text_config, train_text
from flowgrpo.text.critic import CriticConfig, build_critic
from flowgrpo.text.generation import Rollout
from flowgrpo.text.models import load_policy
from flowgrpo.text.tppo import TextTPPOMethod

ROOT = Path(__file__).resolve().parents[2]
TPPO = ROOT / "configs" / "text" / "tiny_tppo.yaml"
EOS = 256  # the tiny byte tokenizer's <|endoftext|>


def _config(tmp_path, *overrides, name="run"):
    base = [f"output_dir={tmp_path / name}", "progress=false", "num_threads=1"]
    return load_text_config(TPPO, [*base, *overrides])


def test_the_methods_advantages_are_core_egae_on_a_hand_built_batch_float64():
    """P = 1, G = 4, T = 4: finished rows of length 2 and 4, an unfinished one (bootstrapped, its NaN reward unread),
    a finished one whose reward is NaN (no tokens: advantage 0, no critic target)."""
    lengths, truncated = [2, 4, 4, 3], [False, True, False, False]
    cmask = torch.arange(4).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    rollout = Rollout(
        torch.ones(4, 2, dtype=torch.long), torch.ones(4, 2, dtype=torch.long), torch.where(cmask, 7, EOS), cmask,
        torch.tensor(truncated), torch.zeros(4, dtype=torch.long), 4,
    )  # fmt: skip
    rewards = torch.tensor([[0.5, float("nan"), 1.0, float("nan")]])
    groups = GroupBatch(rewards=rewards, head_nan_policy="ignore_head")
    values = torch.tensor(
        [[0.1, -0.2, 0.3, 0.7], [0.4, 0.25, -0.5, 0.125], [0.3, 0.6, -0.1, 0.2], [1.0, 2.0, 3.0, 4.0]]
    )
    values = values.double()
    last = torch.tensor([0.9, 0.75, -0.3, 5.0], dtype=torch.float64)
    method = object.__new__(TextTPPOMethod)
    method.gamma, method.lam = 0.9, 0.8
    method.critic = SimpleNamespace(values=lambda r: (values, last))
    record: dict = {}
    batch = method._advantage_inputs(groups, rollout, record, {})
    est = AdvantageConfig(estimator={"name": "egae", "gamma": 0.9, "lam": 0.8})
    result = compute_advantages(batch, est)
    got = method._action_advantages(result, rollout)

    step_rewards = torch.zeros(1, 4, 4, dtype=torch.float64)
    step_rewards[0, 0, 1], step_rewards[0, 2, 3] = 0.5, 1.0  # the outcome on each finished row's last token
    mask = cmask.clone()
    mask[3] = False  # finished, reward NaN: left out
    hand = TokenValueBatch(
        rewards=rewards, step_rewards=step_rewards, step_mask=mask.view(1, 4, 4), values=values.view(1, 4, 4),
        last_value=last.view(1, 4), finished=torch.tensor([[True, False, True, True]]),
    )  # fmt: skip
    want = egae(hand, gamma=0.9, lam=0.8).advantages.view(4, 4)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-15)
    assert got[3].abs().sum() == 0 and got[1].abs().sum() > 0
    # row 1 (unfinished) bootstraps: its last delta is gamma V(s_l) - V(s_3)
    assert got[1, 3].item() == pytest.approx(0.9 * 0.75 - 0.125, abs=1e-15)
    # the critic's targets: returns of finished, scored rows only
    assert method.pending.mask.tolist() == [[True, True, False, False], [False] * 4, [True] * 4, [False] * 4]
    torch.testing.assert_close(method.pending.targets[2].double(), (want[2] + values[2]).float().double())
    # one weight per completion once grpo takes the max over tokens: the unscored row weighs 0
    assert result.sample_weight.amax(-1).tolist() == [[1.0, 1.0, 1.0, 0.0]]


def test_the_critic_starts_from_the_policys_weights_with_zero_values(tiny_config, tmp_path):
    cfg = tiny_config("model.lora.enabled=true")
    _, policy = load_policy(cfg.model)
    critic = build_critic(policy, CriticConfig(), cfg.model.lora, torch.device("cpu"))
    trained = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert any("lora_" in n for n in trained) and any("score" in n for n in trained)
    ids = torch.randint(0, 256, (2, 5))
    out = critic(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert out.shape == (2, 5, 1) and out.abs().max() == 0
    with torch.no_grad():  # the decoders agree: the policy's last hidden state is the critic's
        h_pol = policy.get_base_model().model(input_ids=ids).last_hidden_state
        h_crit = critic.get_base_model().model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(h_pol, h_crit, rtol=0, atol=0)
    full = build_critic(policy, CriticConfig(lora=False), cfg.model.lora, torch.device("cpu"))
    assert all(p.requires_grad for p in full.parameters()) and full.dtype == torch.float32
    with torch.no_grad():  # `critic.model`: a saved value model loads with its head
        full.score.weight.fill_(0.01)
    full.save_pretrained(tmp_path / "critic")
    loaded = build_critic(policy, CriticConfig(model=str(tmp_path / "critic")), cfg.model.lora, torch.device("cpu"))
    with torch.no_grad():
        want, got = full(input_ids=ids).logits, loaded.get_base_model()(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert want.abs().min() > 0


def test_config_rules_name_the_bad_value(tmp_path):
    with pytest.raises(ConfigError, match="method tppo: advantage.estimator must be 'egae'.*got 'grpo'"):
        _config(tmp_path, "advantage.estimator=grpo")
    with pytest.raises(ConfigError, match="method tppo: advantage.transforms must be empty"):
        _config(tmp_path, "advantage.transforms=[{name: clip}]")
    with pytest.raises(ConfigError, match="mask_truncated must be false"):
        _config(tmp_path, "generation.mask_truncated=true")
    with pytest.raises(ConfigError, match="unknown key 'lrr'.*valid keys"):
        _config(tmp_path, "critic.lrr=1")
    with pytest.raises(ConfigError, match="critic.model '/nonexistent/critic'"):
        TextGRPOTrainer(_config(tmp_path, "critic.model=/nonexistent/critic"))
    with pytest.raises(ConfigError, match="method tppo: FSDP2, DeepSpeed ZeRO and context-parallel launches"):
        TextTPPOMethod(SimpleNamespace(dist=SimpleNamespace(lockstep=True)))


def _tensors(run_dir: Path, part: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(latest_checkpoint(run_dir / "checkpoints") / f"tensors.{part}.safetensors")


def test_stop_and_resume_is_bit_identical_with_the_critic(tmp_path):
    common = ["iterations=4", "checkpoint.every=2", "checkpoint.keep_last=5", "generation.max_new_tokens=16"]
    full = train_text(_config(tmp_path, *common, name="uninterrupted"))
    first = train_text(_config(tmp_path, *common, "stop_after=2", name="interrupted"))
    torch.manual_seed(4321)
    resumed = TextGRPOTrainer(_config(tmp_path, *common, "resume=true", name="interrupted"))
    assert resumed.iteration == 2
    rest = resumed.train()
    keys = ("reward_mean", "loss/total", "critic/loss", "critic/value_mean", "critic/grad_norm")
    assert [[r.get(k) for k in keys] for r in first + rest] == [[r.get(k) for k in keys] for r in full]
    assert full[-1]["critic/optimizer_steps"] == 1 and full[-1]["critic/target_tokens"] > 0
    for group in ("model", "critic"):
        a, b = _tensors(tmp_path / "uninterrupted", group), _tensors(tmp_path / "interrupted", group)
        assert a.keys() == b.keys() and any("score" in k for k in _tensors(tmp_path / "interrupted", "critic"))
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def _finished(prompts, completions, completion_ids, **kwargs):
    """1 for a response that ended (its last token is EOS): T-PPO reads the reward of finished responses only."""
    return [float(bool(ids) and ids[-1] == EOS) for ids in completion_ids]


@pytest.mark.heavy
def test_tppo_learns_to_finish_against_lr_0(tmp_path):
    common = ["iterations=8", "rewards=[{name: finished}]"]
    funcs = {"finished": _finished}
    learnt = train_text(_config(tmp_path, *common, name="learnt"), funcs)  # lr 2e-2, critic lr 1e-3
    control = train_text(_config(tmp_path, *common, "optim.lr=0", "critic.lr=0", name="control"), funcs)
    rewards, flat = [r["reward_mean"] for r in learnt], [r["reward_mean"] for r in control]
    assert sum(rewards[-3:]) / 3 > 0.8 and max(flat) < 0.4, (rewards, flat)
    assert learnt[-1]["critic/value_mean"] > 0.1 and control[-1]["critic/value_mean"] == 0
