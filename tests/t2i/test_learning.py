"""Every recipe learns: the watched reward rises well above an identical run with learning rate 0.

Families across the recipes: SD3 (flow_grpo, fast, mix-flash, branch-mix, tempflow, tp, nft, adv),
FLUX (dance, branch, guard, vgpo) and SD1.5-style DDIM (mixgrpo, pref).
"""

import pytest

from .learning_runs import learning_margin

RECIPES = ["flow_grpo", "flow_grpo_fast", "dance_grpo", "mixgrpo", "mixgrpo_flash", "branchgrpo", "branchgrpo_mix",
           "tempflow_grpo", "tp_grpo", "grpo_guard", "pref_grpo", "diffusion_nft", "vgpo", "adv_grpo"]
MARGIN = 5.0  # the gain must exceed this many standard errors of the lr = 0 run


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_learns(recipe, tmp_path):
    m = learning_margin(recipe, tmp_path)
    assert m["first_learn"] == pytest.approx(m["first_still"], abs=1e-7), m  # same start: a paired comparison
    assert m["gain"] > MARGIN * m["noise"] and m["gain"] > 0, m
