"""Bad input fails in a second, before any model is loaded, with a message that names the problem."""

import pytest

from flowgrpo.config import ConfigError
from flowgrpo.t2i import T2ITrainer, load_t2i_config

from .learning_runs import RECIPES_DIR

REAL_DIR = RECIPES_DIR.parent / "real"


def _load(*overrides, recipe="flow_grpo"):
    return load_t2i_config(RECIPES_DIR / f"{recipe}.yaml", list(overrides))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["optim.lrr=1"], "unknown key 'lrr'"),
        (["sampler.num_step=3"], "did you mean 'num_steps'"),
        (["group_size=many"], "group_size"),
        (["plan.name=treee"], "unknown rollout plan 'treee'"),
        (["plan={name: tree}"], "needs the node-level estimator 'tree_depth'"),
        (["advantage.estimator.name=turning_point"], "needs per-step rewards from the 'probes' plan"),
        (["loss.ratio=sequence"], "image actions are single transitions"),
        (["edges.width_pruning=0.5"], "pruning are BranchGRPO options"),
        (["method=nft", "sampler.cfg_mode=full"], "CFG-free"),
        (
            ["method=grpoo"],
            r"unknown method 'grpoo'.*valid names: \['awm', 'diffusion_dpo', 'grpo', 'grpo_gardo', 'nft'",
        ),
        (["method=nft", "model.finetune=full"], "finetune must be 'lora'"),
        (["edges.per_sample_fraction=0.5", "method=nft"], "it needs method grpo"),
        (["model.finetune=full", "model.dtype=bfloat16"], "float32 master weights"),
        (["model.tiny=false"], "exactly one of `pretrained"),
        (["prompts_per_iteration=3", "rollout_prompts=2"], "multiple of rollout_prompts"),
        (["rewards=[{name: brightness}, {name: brightness}]"], "duplicate names"),
        (["adversarial.enabled=true", "adversarial.reference_generator=bright"], "is not among rewards"),
        (["sampler.share_noise=true", "sampler.share_noise_size=3"], "must divide group_size 8"),
        (["sampler.share_noise_size=4"], "needs share_noise: true"),
        (["ema.updates_per_step=2"], "set schedule: flow_grpo"),
        (["ema={schedule: flow_grpo, count_idle_iterations: true}"], "needs adversarial.enabled"),
        (["artifacts.save_lora=false"], "checkpoint.save_final_model"),
    ],
)
def test_bad_config_names_the_problem(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _load(*overrides)


def test_missing_weights_are_named_before_loading(tmp_path):
    cfg = _load("model.tiny=false", f"model.pretrained={tmp_path / 'no_such_model'}", f"output_dir={tmp_path / 'o'}")
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        T2ITrainer(cfg)


def test_unknown_scorer_and_setting_are_config_errors(tmp_path):
    for rewards, message in [
        ("[{name: brightnes}]", "did you mean 'brightness'"),
        ("[{name: brightness, gain: 2}]", "no setting 'gain'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            T2ITrainer(_load(f"rewards={rewards}", f"output_dir={tmp_path / 'o'}"))


def test_a_fresh_run_never_overwrites_checkpoints(recipe_config):
    from flowgrpo.t2i import train_t2i

    train_t2i(recipe_config("flow_grpo", "iterations=1", name="same"))
    with pytest.raises(ConfigError, match="resume=true"):
        T2ITrainer(recipe_config("flow_grpo", "iterations=2", name="same"))


@pytest.mark.parametrize("path", sorted(p.name for p in REAL_DIR.glob("*.yaml") if not p.name.startswith("_")))
def test_real_model_recipes_are_valid(path):
    cfg = load_t2i_config(REAL_DIR / path)
    assert cfg.model.pretrained and not cfg.model.tiny


def test_a_pretrained_model_s_resolution_is_checked_before_any_weight_loads(tmp_path, monkeypatch):
    """A saved pipeline folder: its denoiser's and VAE's config.json decide, before the weights are read."""
    from pipelines.adapters import build_adapter

    import flowgrpo.t2i.trainer as trainer_mod

    folder = tmp_path / "sd3"
    build_adapter("sd3", tiny=True).pipe.save_pretrained(folder)

    def no_load(*args, **kwargs):
        raise AssertionError("a weight was loaded before the resolution check")

    monkeypatch.setattr(trainer_mod, "build_policy", no_load)
    monkeypatch.setattr(trainer_mod, "RewardStage", no_load)
    for bad, why in (("sampler.height=4096", "larger than this model takes"), ("sampler.height=9", "multiples of")):
        cfg = _load("model.tiny=false", f"model.pretrained={folder}", bad, f"output_dir={tmp_path / 'o'}")
        with pytest.raises(ConfigError, match=f"sampler.height / sampler.width: sd3: .*{why}"):
            T2ITrainer(cfg)
    with pytest.raises(AssertionError, match="before the resolution check"):  # a size it takes goes on to load
        T2ITrainer(_load("model.tiny=false", f"model.pretrained={folder}", f"output_dir={tmp_path / 'o'}"))
