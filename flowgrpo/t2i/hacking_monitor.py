"""The reward-hacking monitor of the image trainer, on by default (`monitor:`, flowgrpo/t2i/monitor_config.py).

Every `monitor.every` iterations (and once before the first update: the baseline) the monitor samples a fixed
held-out set: the eval prompts (or `monitor.prompts`), `images_per_prompt` images each, from the same initial noise
(`monitor.seed`) by the deterministic ODE plan, with the EMA weights when kept. On those images it scores

  - the trained rewards (their pointwise scorers, as configured),
  - the held-out gold scorers (`monitor.gold`; default: DEFAULT_GOLD less the trained scorers: no downloads),
  - image statistics that betray hacking (flowgrpo/t2i/image_stats.py: saturation, clipped pixels, grid and
    high-frequency energy, group diversity; on a video model's clips: over every frame, diversity between clips),

and judges the history with the rules of flowgrpo/t2i/hacking_alarm.py (thresholds: `monitor.alarm`).

What it writes (rank 0): `monitor/...` keys in that iteration's metrics.jsonl record (`monitor/train/<label>/mean`,
`monitor/gold/<label>/mean`, `monitor/img/<stat>`, the effects, trends, drift and rule flags, `monitor/alarm`,
`monitor/best_gold_iteration`, `time_monitor_s`); `monitor.json` (every evaluation, the baseline included, the
alarm and the best-gold evaluation; read by `flowgrpo evaluate` for its report); `best_gold.json` (the evaluation
with the highest gold effect so far) and, for LoRA runs, `best_gold/lora/` (its weights, loadable as
`generate.lora`), both replaced atomically. The progress bar shows `hack=ALARM(<rules>)` once the alarm fires.
With `monitor.stop_on_alarm` the run ends after that iteration: checkpoint saved, one line saying why.
Its history is checkpoint state, so a resumed run judges the same series.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from ..atomic_io import replace_folder, replace_text_atomically
from ..config import ConfigError
from ..scaling.sharding import full_state
from .hacking_alarm import assess
from .image_stats import image_stats
from .monitor_config import MonitorConfig, gold_specs, makes_video

log = logging.getLogger(__name__)

MONITOR_JSON = "monitor.json"
BEST_JSON = "best_gold.json"
BEST_DIR = "best_gold"


@contextlib.contextmanager
def _scorer_state_kept(scorers: list[Any]) -> Iterator[None]:
    """A stateful scorer (Adv-GRPO's discriminator draws its patches from its own generator) leaves the monitor's
    call as it entered it: watching a run must not change what it trains on."""
    saved = [(s, s.state_tensors()) for s in scorers if hasattr(s, "state_tensors")]
    try:
        yield
    finally:
        for scorer, state in saved:
            scorer.load_state_tensors(state)


def _mean_sd(v: torch.Tensor) -> tuple[float, float]:
    v = v[torch.isfinite(v)].double()
    if v.numel() == 0:
        return math.nan, math.nan
    return float(v.mean()), float(v.std()) if v.numel() > 1 else 0.0


def _clean(value: Any) -> Any:
    """JSON-safe copy: NaN / inf -> None."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class HackingMonitor:
    """Built by the trainer with itself as `host` (it reads: cfg, out, dist, adapter, rewards, eval_prompts and the
    `_ema_weights(wanted)` context)."""

    def __init__(self, cfg: Any, host: Any):
        self.cfg, self.host = cfg, host
        self.m: MonitorConfig = cfg.monitor
        self.enabled = self.m.enabled
        self.history: list[dict[str, Any]] = []  # rank 0's (it scores); the others keep only `last_evaluated`
        self.last_evaluated: Optional[int] = None  # every rank: when to evaluate must not depend on the history
        self.best: Optional[dict[str, Any]] = None
        self.fired: Optional[dict[str, Any]] = None  # the first evaluation that raised the alarm
        self.alarm_now = False
        self.gold = None
        if not self.enabled:
            return
        from .reward_stage import RewardStage

        specs = gold_specs(cfg)
        self.gold_weights = {f"gold/{g.label}": g.weight for g in specs}
        self.train_weights = {
            f"train/{label}": w
            for label, w, kind in zip(host.rewards.labels, host.rewards.weights, host.rewards.kinds)
            if kind == "pointwise"
        }
        try:  # a video run's gold scorers score clips: an image scorer there must be wrapped (per_frame)
            self.gold = RewardStage(specs, 1, makes_video(cfg)) if specs and host.dist.is_main else None
        except ValueError as err:
            raise ConfigError(f"monitor.gold: {err}") from None
        prompts = self.m.prompts or host.eval_prompts.prompts
        meta = [{} for _ in prompts] if self.m.prompts else host.eval_prompts.metadata
        self.prompts, self.metadata = prompts[: self.m.max_prompts], meta[: self.m.max_prompts]

    # --- the trainer's calls -------------------------------------------------------------------------

    def baseline(self) -> None:
        """Before the first update (the start of an iteration): the baseline evaluation, once."""
        if self.enabled and self.last_evaluated is None:
            self._evaluate(self.host.iteration, None)

    def step(self, record: dict[str, Any], iteration: int) -> None:
        """After the update of `iteration` (1-based): a monitor evaluation when one is due."""
        if (
            self.enabled
            and iteration % self.m.every == 0
            and (self.last_evaluated is None or self.last_evaluated < iteration)
        ):
            self._evaluate(iteration, record)

    def stop_reason(self) -> Optional[str]:
        if not (self.m.stop_on_alarm and self.alarm_now and self.fired):
            return None
        return (
            f"reward-hacking alarm at iteration {self.fired['iteration']}: {'; '.join(self.fired['reasons'])} "
            f"(monitor.stop_on_alarm; best gold: iteration {(self.best or {}).get('iteration')}, "
            f"{self.host.out / BEST_JSON})"
        )

    def postfix(self) -> dict[str, str]:
        if not self.enabled or len(self.history) < 2:
            return {}
        if self.alarm_now:
            return {"hack": "ALARM(" + ",".join(self.history[-1].get("fired") or ()) + ")"}
        gap = self.history[-1]["metrics"].get("monitor/gap")
        return {"gap": f"{gap:.2f}"} if gap is not None and math.isfinite(gap) else {}

    def state_dict(self) -> dict[str, Any]:
        return _clean({"history": self.history, "best": self.best, "fired": self.fired, "alarm_now": self.alarm_now,
                       "last_evaluated": self.last_evaluated})  # fmt: skip

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        if state:
            self.history, self.best = list(state.get("history") or []), state.get("best")
            self.fired, self.alarm_now = state.get("fired"), bool(state.get("alarm_now"))
            last = state.get("last_evaluated")
            if last is None and self.history:  # a checkpoint from before last_evaluated was saved
                last = self.history[-1]["iteration"]
            self.last_evaluated = None if last is None else int(last)

    def close(self) -> None:
        if self.gold is not None:
            self.gold.close()

    # --- one evaluation ------------------------------------------------------------------------------

    def _images(self) -> torch.Tensor:
        cfg, m = self.cfg, self.m
        steps = m.num_steps or cfg.eval.num_steps or cfg.sampler.num_steps
        images = self.host.ode_images(
            self.prompts, steps, m.images_per_prompt, m.seed, m.use_ema, share_noise=False, share_noise_size=None
        )
        return images.float().cpu()

    def _score(self, images: torch.Tensor) -> tuple[dict[str, float], dict[str, float]]:
        n = self.m.images_per_prompt
        rows = [p for p in range(len(self.prompts)) for _ in range(n)]
        prompts, meta = [self.prompts[r] for r in rows], [self.metadata[r] for r in rows]
        means, sds = {}, {}
        for prefix, stage in (("train", self.host.rewards), ("gold", self.gold)):
            if stage is None:
                continue
            with _scorer_state_kept(stage.scorers):
                scored = stage.score(images, prompts, meta, n, len(rows))
            for k, (label, kind) in enumerate(zip(stage.labels, stage.kinds)):
                if kind == "pointwise":
                    means[f"{prefix}/{label}"], sds[f"{prefix}/{label}"] = _mean_sd(scored.values[:, k])
        return means, sds

    def _evaluate(self, iteration: int, record: Optional[dict[str, Any]]) -> None:
        t0 = time.perf_counter()
        self.last_evaluated = iteration
        dist = self.host.dist
        images = self._images() if dist.is_main or dist.gathers_weights else None
        verdict: dict[str, Any] = {"alarm": False, "metrics": {}}
        new_best = False
        if dist.is_main:
            assert images is not None
            means, sds = self._score(images)
            entry: dict[str, Any] = {
                "iteration": iteration, "means": means, "sds": sds,
                "stats": image_stats(images, self.m.images_per_prompt),
            }  # fmt: skip
            self.history.append(entry)
            verdict = assess(self.history, self.train_weights, self.gold_weights, self.m.alarm)
            verdict["metrics"]["monitor/alarm"] = float(verdict["alarm"])
            entry.update(rules=verdict["rules"], metrics=verdict["metrics"], fired=verdict["fired"])
            gold = verdict["metrics"]["monitor/gold_effect"] if len(self.history) > 1 else 0.0
            new_best = (
                bool(self.gold_weights)
                and math.isfinite(gold)
                and (self.best is None or gold > self.best["gold_effect"])
            )
            if new_best:
                self.best = {"iteration": iteration, "gold_effect": gold, "gold_means": {
                    k: v for k, v in means.items() if k.startswith("gold/")}}  # fmt: skip
        self.alarm_now = bool(dist.max(float(verdict["alarm"]))) if dist.active else verdict["alarm"]
        if self.alarm_now and self.fired is None:  # every rank: stop_reason() must agree (reasons: rank 0's)
            self.fired = {"iteration": iteration, "reasons": verdict.get("reasons", [])}
        if self.alarm_now and dist.is_main and self.fired["iteration"] == iteration:
            log.warning("reward-hacking alarm at iteration %d: %s", iteration, "; ".join(verdict["reasons"]))
        if (bool(dist.max(float(new_best))) if dist.active else new_best) and iteration > 0:
            self._save_best()
        if dist.is_main:
            self._write(iteration)
            if record is not None:
                self._record(record, time.perf_counter() - t0)

    def _record(self, record: dict[str, Any], seconds: float) -> None:
        entry = self.history[-1]
        record.update(entry["metrics"])
        for key, value in entry["means"].items():
            record[f"monitor/{key}/mean"] = value
        for key, value in entry["stats"].items():
            record[f"monitor/img/{key}"] = value
        if self.best is not None:
            record["monitor/best_gold_iteration"] = self.best["iteration"]
        record["time_monitor_s"] = seconds

    # --- files ---------------------------------------------------------------------------------------

    def _write(self, iteration: int) -> None:
        out = self.host.out
        summary = {
            "iteration": iteration,
            "alarm": self.alarm_now,
            "fired": self.fired,
            "best_gold": self.best,
            "gold_scorers": sorted(self.gold_weights),
            "train_scorers": sorted(self.train_weights),
            "thresholds": self.m.alarm.model_dump(),
            "evaluations": self.history,
        }
        replace_text_atomically(out / MONITOR_JSON, json.dumps(_clean(summary), indent=1) + "\n")
        if self.best is not None:
            best = {"weights": None, **self.best}  # weights None: not saved (the untrained model, or save_best off)
            replace_text_atomically(out / BEST_JSON, json.dumps(_clean(best), indent=1) + "\n")

    def _weights_name(self) -> str:
        return "lora" if self.cfg.model.finetune == "lora" else self.host.adapter.denoiser_name

    def _save_best(self) -> None:
        """The weights the best gold score was measured with (EMA when used), into best_gold/ (every rank gathers in
        a sharded run; rank 0 writes a staging folder and moves it in whole)."""
        lora = self.cfg.model.finetune == "lora"
        if not (self.m.save_best if self.m.save_best is not None else lora):
            return
        host, out = self.host, self.host.out
        staging = out / f".tmp-{BEST_DIR}"
        with host._ema_weights(self.m.use_ema):
            state = full_state(host.adapter.denoiser, trainable_only=lora) if host.dist.sharded else None
            if host.dist.is_main:
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir()
                folder = staging / self._weights_name()
                (host.adapter.save_lora if lora else host.adapter.save_denoiser)(folder, state=state)
        if host.dist.is_main:
            replace_folder(staging, out / BEST_DIR)
            if self.best is not None:
                self.best["weights"] = str(out / BEST_DIR / self._weights_name())


def read_monitor(run_dir: str | Path) -> Optional[dict[str, Any]]:
    """A training run's monitor.json (None when absent or unreadable)."""
    path = Path(run_dir) / MONITOR_JSON
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
