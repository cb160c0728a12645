"""A core demo that runs in seconds on a CPU: GRPO on a tabular token policy.

Each prompt asks for one target token; a completion's reward is the fraction of its tokens that hit
the target. Sampling, advantages (any estimator), the policy loss (any preset or parts), micro-batching
with a global normaliser and metrics all go through `flowgrpo.core`, exactly as the trainers use it.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch
from pydantic import Field
from tqdm.auto import tqdm

from .config import dump_config
from .core import AdvantageConfig, GroupBatch, LossConfig, LossInputs, LossNormalizer, StrictModel
from .core import compute_advantages, policy_loss
from .metrics import COUNTER_KEY, TIME_KEY, MetricsWriter


# The embedded default; a config file or overrides are merged over it key by key.
DEFAULTS: dict = {"loss": {"preset": "dapo"}}


class DemoConfig(StrictModel):
    prompts: int = 4
    group_size: int = 8
    length: int = 12
    vocab: int = 16
    iterations: int = 40
    lr: float = 0.05
    inner_epochs: int = 2
    micro_batches: int = 2
    seed: int = 0
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    loss: LossConfig = Field(default_factory=lambda: LossConfig(**DEFAULTS["loss"]))
    output_dir: str = "outputs/demo"
    progress: bool = True


def _sample(logits: torch.Tensor, group: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample `group` completions per prompt; returns tokens [P, G, T] and a ragged mask [P, G, T]."""
    P, T, V = logits.shape
    probs = torch.softmax(logits, -1).unsqueeze(1).expand(P, group, T, V)
    tokens = torch.multinomial(probs.reshape(-1, V), 1, generator=gen).view(P, group, T)
    lengths = torch.randint(T // 2, T + 1, (P, group), generator=gen)
    mask = torch.arange(T).view(1, 1, T) < lengths.unsqueeze(-1)
    return tokens, mask


def _token_logp(logits: torch.Tensor, tokens: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
    """log pi(token) for completion rows tokens [n, T] of prompts `prompt` [n], under logits [P, T, V]."""
    return torch.log_softmax(logits, -1)[prompt].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def run_demo(config: DemoConfig) -> list[dict]:
    torch.manual_seed(config.seed)
    gen = torch.Generator().manual_seed(config.seed)
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    dump_config(config, out / "config.yaml")
    logits = torch.zeros(config.prompts, config.length, config.vocab, requires_grad=True)
    target = torch.arange(config.prompts) % config.vocab
    optimizer = torch.optim.Adam([logits], lr=config.lr)
    history = []
    bar = tqdm(range(config.iterations), desc="demo", disable=not config.progress)
    with MetricsWriter(out / "metrics.jsonl") as writer:
        for iteration in bar:
            t0 = time.perf_counter()
            N = config.prompts * config.group_size
            prompt_of_row = torch.arange(N) // config.group_size
            with torch.no_grad():
                tokens, mask = _sample(logits, config.group_size, gen)
                rows = tokens.reshape(N, -1)
                logp_old = _token_logp(logits, rows, prompt_of_row)
                logp_ref = _token_logp(torch.zeros_like(logits), rows, prompt_of_row)  # the initial policy
            hits = (tokens == target.view(-1, 1, 1)) & mask
            rewards = hits.sum(-1) / mask.sum(-1)
            adv = compute_advantages(GroupBatch(rewards=rewards.float()), config.advantage)
            full = LossInputs(
                logp_old,
                logp_old,
                adv.advantages.reshape(N),
                mask.reshape(N, -1),
                sample_weight=adv.sample_weight.reshape(N),
                logp_ref=logp_ref,
            )
            norm = LossNormalizer.from_inputs(full)
            record = {COUNTER_KEY: iteration + 1, **adv.metrics}  # 1-based, as in the trainers' records
            for epoch in range(config.inner_epochs):
                optimizer.zero_grad()
                order = torch.randperm(N, generator=gen)
                for chunk in order.chunk(config.micro_batches):
                    micro = replace(full.split(chunk), logp=_token_logp(logits, rows[chunk], prompt_of_row[chunk]))
                    result = policy_loss(micro, config.loss, norm)
                    result.loss.backward()
                    if epoch == 0 and "ratio_first_pass_max_dev" not in record:
                        # on-policy: the first pass must give ratio 1 exactly
                        record["ratio_first_pass_max_dev"] = max(
                            abs(result.metrics["ratio/max"] - 1), abs(result.metrics["ratio/min"] - 1)
                        )
                optimizer.step()
            record.update(result.metrics)
            record[TIME_KEY] = time.perf_counter() - t0
            writer.write(record)
            history.append(record)
            bar.set_postfix(reward=f"{record['reward_mean']:.3f}")
    return history
