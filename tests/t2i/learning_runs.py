"""Run a tiny recipe with its learning rate and with lr = 0 (same seed: same prompts and noise)."""

from __future__ import annotations

import statistics
from pathlib import Path

from flowgrpo.t2i import load_t2i_config, train_t2i

RECIPES_DIR = Path(__file__).resolve().parents[2] / "configs" / "t2i" / "tiny"
WATCH = "rewards/brightness/mean"  # every tiny recipe logs brightness (weight 0 where it is not the reward)


def run(recipe: str, out: Path, *overrides: str) -> list[dict]:
    cfg = load_t2i_config(
        RECIPES_DIR / f"{recipe}.yaml",
        [
            f"output_dir={out}",
            "progress=false",
            "artifacts.tensorboard=false",
            "artifacts.plot=false",
            "checkpoint.save_final_model=false",
            *overrides,
        ],
    )
    return train_t2i(cfg)


def learning_margin(recipe: str, tmp: Path, iterations: int = 16, last: int = 5, extra: tuple = ()) -> dict[str, float]:
    """gain: last-k mean of the learning run minus that of the lr = 0 run (paired: same noise);
    noise: the standard error of a last-k mean, from the lr = 0 run's iteration-to-iteration spread."""
    learn = [r[WATCH] for r in run(recipe, tmp / "learn", f"iterations={iterations}", *extra)]
    still = [r[WATCH] for r in run(recipe, tmp / "still", f"iterations={iterations}", *extra, "optim.lr=0")]
    gain = statistics.fmean(learn[-last:]) - statistics.fmean(still[-last:])
    noise = statistics.pstdev(still) / last**0.5
    return {
        "gain": gain,
        "noise": noise,
        "first_learn": learn[0],
        "first_still": still[0],
        "last_learn": statistics.fmean(learn[-last:]),
        "last_still": statistics.fmean(still[-last:]),
    }
