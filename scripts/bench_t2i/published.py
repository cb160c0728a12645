"""Published settings (BranchGRPO's FLUX table): the same plans counted on a tiny FLUX, next to the paper's NFE."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from .closed_form import closed_form
from .recipes import RECIPES_DIR, drive, quiet_overrides, quiet_warnings, summarize


# BranchGRPO's README table (FLUX.1-dev, 20 steps, 16 images per prompt, splits {0,3,6,9}): NFE per image
# of pi_old (no grad) and pi_theta (grad). Our runs: the same plans on a tiny FLUX (counts do not depend
# on model size), no CFG (FLUX-dev's guidance is an embedding), one prompt of 16 images.
PUBLISHED_COMMON = [
    "model.family=flux",
    "sampler.num_steps=20",
    "group_size=16",
    "prompts_per_iteration=1",
    "rollout_prompts=1",
    "sampler.cfg_mode=none",
    "sampler.sde_kernel={name: dance_sde, eta: 0.3}",
]
TREE_20 = "{name: tree, split_steps: [0, 3, 6, 9], branch: 2%s}"
PUBLISHED = {
    "dance_grpo": dict(
        label="DanceGRPO",
        recipe="dance_grpo",
        published=(20, 20),
        settings="full_sde, all 20 steps trained",
        overrides=["plan={name: full_sde, train_fraction: 1.0}"],
    ),
    "mixgrpo": dict(
        label="MixGRPO (20, 5)",
        recipe="dance_grpo",
        published=(20, 5),
        settings="window of 4 SDE steps (progressive), ODE elsewhere",
        overrides=["plan={name: window, size: 4, schedule: progressive, share_prefix: false}"],
    ),
    "branchgrpo": dict(
        label="BranchGRPO",
        recipe="branchgrpo",
        published=(13.68, 13.68),
        settings="tree, splits {0,3,6,9}, branch 2, every step SDE and trained",
        overrides=["plan=" + TREE_20 % "", "edges.width_pruning=null"],
    ),
    "branchgrpo_width": dict(
        label="BranchGRPO width-pruned",
        recipe="branchgrpo",
        published=(13.68, 8.625),
        settings="the tree + width pruning 0.5 (mode 1)",
        overrides=["plan=" + TREE_20 % "", "edges.width_pruning=0.5"],
    ),
    "branchgrpo_mix": dict(
        label="BranchGRPO-Mix",
        recipe="branchgrpo",
        published=(13.68, 4.25),
        settings="the tree, SDE only at splits and in a progressive window of 4",
        overrides=["plan=" + TREE_20 % ", mix_window: 4", "edges.width_pruning=null"],
    ),
}


def _cycle(cfg) -> int:
    """Iterations in one full sweep of a progressive window (1 for plans that do not move)."""
    st = cfg.plan.settings
    T = cfg.sampler.num_steps
    if cfg.plan.name == "tree" and st.get("mix_window"):
        return len(range(0, T - st["mix_window"] + 1, st.get("mix_stride", 1))) * st.get("mix_iters_per_shift", 25)
    if cfg.plan.name == "window" and st.get("schedule", "random") == "progressive":
        end = st.get("range_end") or T
        positions = len(range(st.get("start", 0), end - st.get("size", 3) + 1, st.get("stride", 1)))
        return positions * st.get("iters_per_shift", 25)
    return 1


def bench_published(keys: list[str], args) -> dict[str, Any]:
    from flowgrpo.t2i import load_t2i_config

    quiet_warnings()
    out: dict[str, Any] = {}
    for key in keys:
        spec = PUBLISHED[key]
        overrides = PUBLISHED_COMMON + spec["overrides"]
        cfg = load_t2i_config(
            RECIPES_DIR / f"{spec['recipe']}.yaml",
            quiet_overrides(Path(args.out_dir) / f"published_{key}", args.num_threads, 1) + overrides,
        )
        rows = drive(cfg, 0, 1)["iterations"]
        s = summarize(rows)
        n = _cycle(cfg)
        sweep = [closed_form(cfg, it) for it in range(n)]
        images = sum(c["images"] for c in sweep)
        out[key] = {
            "label": spec["label"],
            "settings": spec["settings"],
            "recipe": spec["recipe"],
            "overrides": overrides,
            "published_per_image": list(spec["published"]),
            "per_image": s["per_image"],
            "closed_form_per_image": s["closed_form_per_image"],
            "counts_match_closed_form": s["counts_match_closed_form"],
            "hook_rows_match_counters": s["hook_rows_match_counters"],
            "edges_per_image": rows[0]["edges_trained"] / rows[0]["images"],
            "formula": rows[0]["closed_form"]["formula"],
            "sweep_iterations": n,
            "sweep_per_image": {
                "fwd_nograd": sum(c["nfe_nograd"] for c in sweep) / images,
                "fwd_grad": sum(c["nfe_grad"] for c in sweep) / images,
            },
        }
        print(
            f"  published setting {key}: {s['per_image']['fwd_nograd']:.3f} / {s['per_image']['fwd_grad']:.3f} "
            f"per image (published {spec['published'][0]} / {spec['published'][1]})",
            file=sys.stderr,
            flush=True,
        )
    return out
