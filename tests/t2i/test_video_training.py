"""The image trainer drives a video family (tiny Wan 2.1: latents [B, C, F, h, w], clips [B, F, 3, H, W]): the same
command, methods, reward stage, hacking monitor and on-policy check as an image run; image-only parts refuse clips
with a message that says what to use instead."""

import json
from pathlib import Path

import pytest
import torch

from flowgrpo.config import ConfigError
from flowgrpo.t2i import load_t2i_config, train_t2i
from flowgrpo.t2i.config import RewardConfig
from flowgrpo.t2i.image_stats import group_diversity, image_stats
from flowgrpo.t2i.monitor_config import gold_specs
from flowgrpo.t2i.reward_stage import RewardStage
from flowgrpo.t2i.trainer import T2ITrainer

from .learning_runs import RECIPES_DIR, run

RECIPE = RECIPES_DIR / "wan_flow_grpo.yaml"
# cheap settings for the smoke runs: one iteration of one prompt's group of 4, one eval prompt, no final model; the
# monitor has a test of its own
SMALL = ("iterations=1", "prompts_per_iteration=1", "group_size=4", "checkpoint.save_final_model=false",
         "monitor.enabled=false", "data.eval_prompts=[a cat]")  # fmt: skip
# each image method through its own plug-ins, with its image recipe's settings made to fit 4 steps
METHODS = {
    "flow_grpo": (),
    "dance_grpo": (
        "sampler.sde_kernel={name: dance_sde, eta: 0.3}", "sampler.share_noise=true",
        "plan={name: full_sde, random_subset: 2}", "advantage.estimator={name: grpo, unbiased: true, eps: 1.0e-8}",
    ),
    "mixgrpo": ("plan={name: window, size: 2, schedule: progressive, iters_per_shift: 1}",),
    "diffusion_nft": ("method=nft", "plan={name: ode_only}", "nft={beta: 0.1}"),
    # Wan 2.2 A14B: two experts, the low-noise one trained; only its steps are trained (the adapter's restrict_plan)
    "wan22_low_expert": (
        "model.family=wan2.2", "model.options.train_experts=[low]", "model.tiny_options.boundary_ratio=0.95",
    ),
    "branchgrpo": (
        "sampler.sde_kernel={name: dance_sde, eta: 0.3}", "sampler.share_noise=true",
        "plan={name: tree, split_steps: [0, 2], branch: 2}", "advantage.estimator={name: tree_depth, fusion: mean}",
    ),
    "tempflow_grpo": (
        "plan={name: branch_points, points: [0, 1], k: 2}", "group_size=2",
        # two rewards: sibling credit takes the probes' one weighted value per node
        "rewards=[{name: per_frame, alias: colorfulness, reward: colorfulness}, "
        "{name: per_frame, alias: brightness, reward: brightness, weight: 0.5}]",
        "advantage.estimator={name: sibling}", "loss={preset: flow_grpo, step_weighting: noise_aware}",
    ),
}  # fmt: skip


def _config(tmp_path: Path, *overrides: str):
    return load_t2i_config(
        RECIPE,
        [f"output_dir={tmp_path / 'run'}", "progress=false", "artifacts.tensorboard=false", "artifacts.plot=false",
         *overrides],
    )  # fmt: skip


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_video_method_runs_on_policy(tmp_path, method):
    cfg = _config(tmp_path, *SMALL, *METHODS[method])
    history = train_t2i(cfg)
    assert [r["iteration"] for r in history] == [1]
    for r in history:
        assert r["backward_passes"] > 0 and r["nfe_grad"] > 0, r
        assert all(torch.isfinite(torch.tensor(r[f"rewards/{x.label}/mean"])) for x in cfg.rewards), r
        if method == "wan22_low_expert":  # grid 1, .9, .75, .5: step 0 is the frozen high expert's, not trained
            assert r["plan/trained_steps"] == 2, r
        if cfg.method == "grpo":  # the rollout re-scored by the weights that sampled it: ratio 1 on video too
            assert r["check/first_pass_ratio_dev"] < 1e-4, r
            assert r["check/rows"] > 0, r


def test_frames_come_from_model_options_and_the_monitor_scores_clips(tmp_path):
    cfg = _config(tmp_path, *SMALL, "model.options.num_frames=9", "monitor.enabled=true", "monitor.every=1",
                  "monitor.images_per_prompt=2")  # fmt: skip
    assert cfg.model.tiny_options["num_frames"] == 9  # a tiny model takes the adapter's options too
    trainer = T2ITrainer(cfg)
    try:
        assert trainer.video and trainer.adapter.num_frames == 9
        clips = trainer.ode_images(["a cat"], 2, 2, 0, use_ema=False)
        assert clips.shape == (2, 9, 3, 32, 32)
    finally:
        trainer.close()
    history = train_t2i(cfg)
    r = history[-1]
    # default gold on video: the image gold scorer on every frame, under its own name
    assert [g.name for g in gold_specs(cfg)] == ["per_frame"] and "monitor/gold/jpeg_compressibility/mean" in r
    for key in ("monitor/img/saturation", "monitor/img/grid8", "monitor/img/diversity"):
        assert torch.isfinite(torch.tensor(r[key])), (key, r[key])
    saved = json.loads((Path(cfg.output_dir) / "monitor.json").read_text())
    assert len(saved["evaluations"]) == 2  # the baseline and iteration 1


def test_image_scorers_are_refused_on_clips_naming_per_frame(tmp_path):
    with pytest.raises(ValueError, match=r"scorer 'brightness' scores images .*per_frame"):
        RewardStage([RewardConfig(name="brightness")], video=True)
    with pytest.raises(ValueError, match=r"scorer 'motion_magnitude' scores video clips"):
        RewardStage([RewardConfig(name="motion_magnitude")], video=False)
    cfg = _config(tmp_path, "rewards=[{name: colorfulness}]")
    with pytest.raises(ConfigError, match=r"rewards: scorer 'colorfulness' scores images.*name: per_frame"):
        T2ITrainer(cfg)  # before any model loads
    cfg = _config(tmp_path, *SMALL, "monitor.enabled=true", "monitor.gold=[{name: jpeg_compressibility}]")
    with pytest.raises(ConfigError, match=r"monitor.gold: scorer 'jpeg_compressibility' scores images"):
        T2ITrainer(cfg)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (("adversarial.enabled=true", "adversarial.reference_generator=bright"), "discriminator judges single"),
        (("rewards=[{name: pointwise_as_pairwise, reward: brightness}]",), "pairwise reward compares two images"),
    ],
)
def test_image_only_features_refuse_video(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=f"model.family 'wan' makes video clips: .*{match}"):
        _config(tmp_path, *overrides)


def test_image_stats_of_clips_are_over_frames_and_diversity_between_clips():
    g = torch.Generator().manual_seed(0)
    clips = torch.rand(4, 3, 3, 32, 32, generator=g)
    stats = image_stats(clips, group_size=2)
    frames = image_stats(clips.flatten(0, 1), group_size=6)
    for key in ("saturation", "clipped", "grid8", "grid16", "high_freq"):
        assert stats[key] == pytest.approx(frames[key], rel=1e-6), key
    same = clips[:1].expand(2, -1, -1, -1, -1)  # two identical clips: no diversity
    assert float(group_diversity(same, 2)[0]) == 0.0
    moved = torch.cat([clips[:1], clips[:1].roll(1, dims=1)])  # same frames, other order: clips differ
    assert float(group_diversity(moved, 2)[0]) > 0.05


@pytest.mark.heavy
@pytest.mark.parametrize(
    "recipe, iterations",
    # the tiny HunyuanVideo learns more slowly (full fine-tune at a small lr: its recipe's header says why)
    [
        pytest.param("wan_flow_grpo", 10, id="wan_flow_grpo"),
        pytest.param("hunyuan_dance_grpo", 16, id="hunyuan_dance_grpo"),
    ],
)
def test_video_recipe_learns(tmp_path, recipe, iterations):
    """Each tiny video recipe's reward (per-frame colourfulness) rises above the same run at lr 0 (same noise)."""
    watch, last, fixed = "rewards/colorfulness/mean", 4, (f"iterations={iterations}", "monitor.enabled=false")
    learn = [r[watch] for r in run(recipe, tmp_path / "learn", *fixed)]
    still = [r[watch] for r in run(recipe, tmp_path / "still", *fixed, "optim.lr=0")]
    assert learn[0] == pytest.approx(still[0], abs=1e-5)  # the same start: a paired comparison
    gain = sum(learn[-last:]) / last - sum(still[-last:]) / last
    noise = float(torch.tensor(still).std(unbiased=False)) / last**0.5
    assert gain > 5.0 * noise and gain > 0, (gain, noise, learn, still)
