"""The reward-hacking monitor: image statistics on hand-made images, the alarm rules on hand-made histories, the
config checks, the evaluate report's section, and (heavy tier) a tiny run that hacks a misspecified reward and is
caught, beside an honest run that is not."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from flowgrpo.config import ConfigError
from flowgrpo.t2i.hacking_alarm import assess, effect, slope
from flowgrpo.t2i.image_stats import (
    clipped_fraction,
    grid_energy,
    group_diversity,
    high_freq_energy,
    image_stats,
    saturation,
)
from flowgrpo.t2i.monitor_config import AlarmConfig

ROOT = Path(__file__).resolve().parents[2]


def _noise(seed: int, n: int = 1, size: int = 32) -> torch.Tensor:
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


# --- image statistics --------------------------------------------------------------------------------------


def test_saturation_grey_is_zero_pure_hue_is_one():
    grey = torch.full((1, 3, 8, 8), 0.5)
    red = torch.zeros(1, 3, 8, 8)
    red[:, 0] = 1.0
    pastel = torch.tensor([0.8, 0.6, 0.6]).view(1, 3, 1, 1).expand(1, 3, 8, 8)
    assert saturation(grey).item() == 0.0
    assert saturation(red).item() == pytest.approx(1.0)
    assert saturation(pastel).item() == pytest.approx(0.25)  # (0.8 - 0.6) / 0.8
    assert saturation(torch.zeros(1, 3, 4, 4)).item() == 0.0  # black: no hue, no division by zero


def test_clipped_fraction_counts_blown_and_crushed_values():
    x = torch.full((1, 3, 4, 4), 0.5)
    assert clipped_fraction(x).item() == 0.0
    x[:, :, :2] = 1.0  # half blown out
    x[:, :, 3] = 0.0  # a quarter crushed
    assert clipped_fraction(x).item() == pytest.approx(0.75)


def test_grid_energy_of_a_periodic_pattern_noise_and_a_flat_image():
    tile = _noise(1, size=8)
    grid = tile.repeat(1, 1, 4, 4)  # exactly 8-periodic, 32 x 32
    noise = _noise(2, n=64)
    assert grid_energy(grid, 8).item() == pytest.approx(1.0, abs=1e-6)
    assert grid_energy(grid, 16).item() == pytest.approx(1.0, abs=1e-6)  # its lattice holds the 8-px one
    white = (8 * 8 - 1) / (32 * 32 - 1)  # the share of the lattice's bins (8 x 8 of them)
    assert grid_energy(noise, 8).mean().item() == pytest.approx(white, rel=0.15)
    assert (grid_energy(noise, 16) >= grid_energy(noise, 8)).all()
    assert grid_energy(torch.full((1, 3, 32, 32), 0.3), 8).item() == 0.0
    assert math.isnan(grid_energy(_noise(3, size=12), 8).item())  # below two periods: not measured
    # a faint grid added to noise raises it
    assert grid_energy((0.7 * noise[:1] + 0.3 * grid).clamp(0, 1), 8).item() > 2 * white


def test_high_freq_energy_checkerboard_vs_gradient():
    i = torch.arange(32)
    checker = ((i[:, None] + i[None, :]) % 2).float().expand(1, 3, 32, 32)
    wave = (0.5 + 0.5 * torch.cos(2 * math.pi * i.float() / 32)).view(1, 1, 1, 32).expand(1, 3, 32, 32)
    assert high_freq_energy(checker).item() == pytest.approx(1.0)
    assert high_freq_energy(wave).item() == pytest.approx(0.0, abs=1e-9)  # one slow cycle
    assert 0.4 < high_freq_energy(_noise(7)).item() < 0.9  # white noise: the share of the bins above 1/4


def test_group_diversity_zero_for_identical_images():
    img = _noise(4)
    same = img.repeat(4, 1, 1, 1)
    assert group_diversity(same, 4).tolist() == [0.0]
    black_white = torch.cat([torch.zeros(1, 3, 32, 32), torch.ones(1, 3, 32, 32)])
    assert group_diversity(black_white, 2).item() == pytest.approx(1.0)  # RMS distance of 0 and 1
    two_groups = torch.cat([same[:2], black_white])
    assert group_diversity(two_groups, 2).tolist() == pytest.approx([0.0, 1.0])
    assert math.isnan(group_diversity(img, 1).item())


def test_image_stats_keys_and_means():
    stats = image_stats(torch.cat([_noise(5, 4)]), 4)
    assert set(stats) == {"saturation", "clipped", "grid8", "grid16", "high_freq", "diversity"}
    assert 0 < stats["diversity"] < 1 and 0 < stats["saturation"] < 1


# --- the alarm rules ---------------------------------------------------------------------------------------

TRAIN, GOLD = {"train/r": 1.0}, {"gold/g": 1.0}
STATS = {"saturation": 0.4, "clipped": 0.01, "grid8": 0.07, "grid16": 0.26, "high_freq": 0.4, "diversity": 0.14}


def _entry(it: int, train: float, gold: float, **stats: float) -> dict:
    return {
        "iteration": it,
        "means": {"train/r": train, "gold/g": gold},
        "sds": {"train/r": 1.0, "gold/g": 2.0},
        "stats": {**STATS, **stats},
    }


def _judge(entries: list[dict], **alarm) -> list[dict]:
    """assess() after each evaluation, the rules kept in the history as the monitor keeps them."""
    cfg, out, history = AlarmConfig(**alarm), [], []
    for e in entries:
        history.append(e)
        verdict = assess(history, TRAIN, GOLD, cfg)
        e["rules"] = verdict["rules"]
        out.append(verdict)
    return out


def test_effects_and_slope():
    base, now = _entry(0, 1.0, 3.0), _entry(1, 2.5, 2.0)
    assert effect(now, base, "train/r") == pytest.approx(1.5)
    assert effect(now, base, "gold/g") == pytest.approx(-0.5)
    assert slope([0.0, 1.0, 2.0]) == pytest.approx(1.0)
    assert slope([math.nan, 1.0, 3.0]) == pytest.approx(2.0)
    assert math.isnan(slope([1.0]))


def test_reward_rising_gold_flat_fires_after_patience():
    verdicts = _judge([_entry(i, 0.6 * i, 0.0) for i in range(5)])
    gaps = [v["metrics"]["monitor/gap"] for v in verdicts]
    assert gaps == pytest.approx([0.0, 0.6, 1.2, 1.8, 2.4])
    assert [v["alarm"] for v in verdicts] == [False, False, False, True, True]  # holds from eval 2, patience 2
    assert "reward_gold_gap" in verdicts[2]["rules"] and verdicts[3]["fired"] == ["reward_gold_gap"]
    assert verdicts[3]["metrics"]["monitor/alarm"] == 1.0 and "gold" in verdicts[3]["reasons"][0]


def test_honest_progress_never_fires_even_with_drifting_statistics():
    # reward and gold rise together; saturation and clipping drift, which the gold score endorses
    entries = [_entry(i, 0.8 * i, 1.6 * i, saturation=0.4 + 0.1 * i, clipped=0.01 + 0.05 * i) for i in range(6)]
    verdicts = _judge(entries, patience=1)
    assert not any(v["alarm"] for v in verdicts)
    assert all(v["metrics"]["monitor/gap"] == pytest.approx(0.0) for v in verdicts)
    assert verdicts[-1]["metrics"]["monitor/drift/saturation"] == 1.0  # reported, not counted


def test_nothing_moves_nothing_fires():
    verdicts = _judge([_entry(i, 0.0, 0.0) for i in range(4)], patience=1)
    assert not any(v["rules"] for v in verdicts)


def test_statistic_drift_with_flat_gold_fires():
    entries = [_entry(0, 0, 0), _entry(1, 0, 0, diversity=0.05), _entry(2, 0, 0, diversity=0.04, grid8=0.3)]
    verdicts = _judge(entries)
    assert verdicts[1]["rules"] == ["diversity"] and not verdicts[1]["alarm"]
    assert verdicts[2]["fired"] == ["diversity"] and set(verdicts[2]["rules"]) == {"grid", "diversity"}


def test_gold_drop_while_reward_holds():
    entries = [_entry(0, 0, 0), _entry(1, 1.0, 4.0), _entry(2, 1.0, 1.0)]  # gold +2 sd, then back to +0.5 sd
    verdicts = _judge(entries, patience=1)
    assert verdicts[2]["fired"] == ["gold_drop"]
    assert "iteration 1" in verdicts[2]["reasons"][0]


def test_no_gold_scorers_only_statistics():
    cfg = AlarmConfig(patience=1)
    history = [_entry(0, 0, 0), _entry(1, 5.0, 0, clipped=0.5)]
    verdict = assess(history, TRAIN, {}, cfg)
    assert math.isnan(verdict["metrics"]["monitor/gap"])
    assert verdict["fired"] == ["clipped"]


# --- config ------------------------------------------------------------------------------------------------


def test_default_gold_leaves_out_trained_scorers(recipe_config):
    from flowgrpo.t2i.monitor_config import gold_specs

    cfg = recipe_config("flow_grpo")
    assert cfg.monitor.enabled and [g.name for g in gold_specs(cfg)] == ["jpeg_compressibility"]
    cfg = recipe_config("flow_grpo", "rewards=[{name: jpeg_compressibility}]")
    assert gold_specs(cfg) == []


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("monitor.gold=[{name: no_such_scorer}]", "no_such_scorer"),
        ("monitor.gold=[{name: pointwise_as_pairwise}]", "pointwise"),
        ("monitor.gold=[{name: brightness, colour: 1}]", "no setting"),
        ("monitor.gold=[{name: brightness}, {name: brightness}]", "duplicate"),
        ("monitor.images_per_prompt=1", "images_per_prompt"),
    ],
)
def test_bad_monitor_settings_fail_at_load(recipe_config, override, message):
    with pytest.raises(ConfigError, match=message):
        recipe_config("flow_grpo", override)


# --- a short run: files, metrics, bar, resume state, the stop -----------------------------------------------


def test_monitor_files_metrics_and_stop(recipe_config, monkeypatch, caplog):
    from flowgrpo.metrics import read_metrics
    from flowgrpo.t2i import T2ITrainer
    from flowgrpo.t2i import hacking_monitor

    cfg = recipe_config(
        "flow_grpo", "iterations=2", "monitor.every=1", "monitor.stop_on_alarm=true", "monitor.max_prompts=1",
        "group_size=2", "prompts_per_iteration=1", "checkpoint.save_final_model=false",
    )  # fmt: skip
    real = hacking_monitor.assess

    def alarm_at_first(history, *args):  # the real verdict, made to fire at the first evaluation after training
        verdict = real(history, *args)
        if history[-1]["iteration"] == 1:
            verdict.update(alarm=True, fired=["grid"], reasons=["a test alarm"])
        return verdict

    monkeypatch.setattr(hacking_monitor, "assess", alarm_at_first)
    trainer = T2ITrainer(cfg)
    with caplog.at_level("WARNING"):
        history = trainer.train()
    out = Path(cfg.output_dir)
    assert [r["iteration"] for r in history] == [1]  # stopped after iteration 1 of 2
    assert (out / "checkpoints" / "step_00000001").is_dir()
    stops = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stopping after iteration 1")]
    assert len(stops) == 1 and "a test alarm" in stops[0]
    records = read_metrics(out / "metrics.jsonl")
    assert len(records) == 1 and records[0]["monitor/alarm"] == 1.0
    for key in ("monitor/train/brightness/mean", "monitor/gold/jpeg_compressibility/mean", "monitor/img/grid8",
                "monitor/img/diversity", "monitor/gap", "monitor/rule/reward_gold_gap", "time_monitor_s"):  # fmt: skip
        assert key in records[0], key
    monitor = json.loads((out / "monitor.json").read_text())
    assert [e["iteration"] for e in monitor["evaluations"]] == [0, 1]
    assert monitor["fired"] == {"iteration": 1, "reasons": ["a test alarm"]}
    best = json.loads((out / "best_gold.json").read_text())
    assert best["iteration"] == monitor["best_gold"]["iteration"]
    if best["iteration"] > 0:  # a LoRA run keeps the weights of its best-gold evaluation
        assert (Path(best["weights"]) / "pytorch_lora_weights.safetensors").is_file()
    assert trainer.progress_postfix(history[-1])["hack"] == "ALARM(grid)"
    state = json.loads((out / "checkpoints" / "step_00000001" / "state.json").read_text())
    assert "monitor" in json.dumps(state)  # the history travels with the checkpoint


# --- the evaluate report -----------------------------------------------------------------------------------


def test_evaluate_report_has_the_hacking_section(tmp_path):
    from PIL import Image

    from flowgrpo.evaluation import evaluate, load_eval_config

    images = tmp_path / "images"
    images.mkdir()
    tile = (_noise(6, size=8)[0].permute(1, 2, 0).numpy() * 255).astype("uint8")
    for i in range(2):
        Image.fromarray(tile).resize((32, 32)).save(images / f"{i}.png")
    (images / "prompts.txt").write_text("a cat\na cat\n")
    cfg = load_eval_config(None, [f"input.images.dir={images}", "scorers=[brightness]",
                                  f"output_dir={tmp_path / 'eval'}", "progress=false"])  # fmt: skip
    summary = evaluate(cfg)
    stats = summary["hacking"]["stats"]["eval"]
    assert stats["diversity"] == 0.0  # the same image twice for one prompt
    page = (tmp_path / "eval" / "report.html").read_text()
    assert "Reward-hacking indicators" in page and "grid8" in page


def test_training_monitor_is_found_from_a_lora_folder(tmp_path):
    from flowgrpo.evaluation.hacking import hacking_section, training_monitor

    (tmp_path / "best_gold" / "lora").mkdir(parents=True)
    fired = {"iteration": 4, "reasons": ["grid drifted"]}
    (tmp_path / "monitor.json").write_text(json.dumps({"alarm": True, "fired": fired, "iteration": 6,
                                                       "best_gold": {"iteration": 2}, "gold_scorers": ["gold/x"]}))  # fmt: skip
    mon = training_monitor(str(tmp_path / "best_gold" / "lora"))
    assert mon["fired"] == fired and mon["run"] == str(tmp_path.resolve())
    html = hacking_section({"stats": {}, "training_monitor": mon}, str, str)
    assert "alarm" in html and "grid drifted" in html and "iteration 2" in html
    assert training_monitor(None) is None


# --- the demo: a hacked run is caught, an honest one is not (heavy) -----------------------------------------


@pytest.mark.heavy
def test_hacking_demo_is_caught(tmp_path):
    from flowgrpo.t2i import load_t2i_config, train_t2i

    out = tmp_path / "hack"
    cfg = load_t2i_config(
        ROOT / "configs" / "t2i" / "hacking_demo.yaml",
        [f"output_dir={out}", "progress=false", "artifacts.tensorboard=false", "artifacts.plot=false"],
    )
    history = train_t2i(cfg)
    assert len(history) < cfg.iterations  # stop_on_alarm ended it
    monitor = json.loads((out / "monitor.json").read_text())
    assert monitor["alarm"] and monitor["fired"]["iteration"] == len(history)
    last = monitor["evaluations"][-1]
    assert last["metrics"]["monitor/gold_effect"] < -1.0  # the true objective fell
    assert last["stats"]["grid8"] > 2 * monitor["evaluations"][0]["stats"]["grid8"]  # a grid appeared
    assert json.loads((out / "best_gold.json").read_text())["iteration"] == 0  # best gold: before training
    assert (out / "checkpoints" / f"step_{len(history):08d}").is_dir()


@pytest.mark.heavy
def test_honest_run_does_not_fire(tmp_path):
    from flowgrpo.t2i import load_t2i_config, train_t2i

    out = tmp_path / "honest"
    cfg = load_t2i_config(
        ROOT / "configs" / "t2i" / "tiny" / "flow_grpo.yaml",
        [f"output_dir={out}", "progress=false", "artifacts.tensorboard=false", "artifacts.plot=false",
         "iterations=4", "monitor.every=2", "monitor.gold=[{name: brightness}]", "monitor.alarm.patience=1",
         "checkpoint.save_final_model=false"],
    )  # fmt: skip
    history = train_t2i(cfg)
    assert len(history) == 4
    monitor = json.loads((out / "monitor.json").read_text())
    assert not monitor["alarm"] and monitor["fired"] is None
    assert [e["iteration"] for e in monitor["evaluations"]] == [0, 2, 4]
    for e in monitor["evaluations"][1:]:
        assert e["rules"] == [] and e["metrics"]["monitor/gap"] == pytest.approx(0.0, abs=1e-9)
