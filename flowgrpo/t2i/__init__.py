"""Text-to-image RL: one loop (trainer), recipes as configs (configs/), methods as small functions.

    from flowgrpo.t2i import load_t2i_config, train_t2i
    history = train_t2i(load_t2i_config("configs/t2i/tiny/flow_grpo.yaml", ["optim.lr=0"]))

Modules: config (typed config, every recipe check), data (prompt sets), model (adapter + LoRA / full, KL
reference), reward_stage (async scoring), credit (rewards -> per-edge advantages), objectives (edge loss),
methods (the method plug-ins' registries and their context): grpo (clipped objective), nft (DiffusionNFT
objective), adversarial (Adv-GRPO discriminator alternation); artifacts (grids, plots, trackers), trainer
(rollout and scoring; the loop and the update loop are flowgrpo.run).
"""

from .config import DEFAULTS, T2IConfig, load_t2i_config
from ..run.ratio_check import OnPolicyRatioWarning
from .trainer import T2ITrainer, train_t2i

__all__ = ["DEFAULTS", "OnPolicyRatioWarning", "T2IConfig", "T2ITrainer", "load_t2i_config", "train_t2i"]
