"""rollout_split: a group's completions drawn in parts (each its own seed, so each can run on its own
rank) and joined back into whole groups before advantages are computed."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.config import ConfigError
from flowgrpo.text import load_text_config
from flowgrpo.text.collect import whole_groups

CONFIG = "configs/text/tiny_pattern.yaml"


def test_whole_groups_puts_each_part_in_its_place():
    # one chunk of 2 prompts, 2 parts of 2 samples: part 0 = [p0 s0, p0 s1, p1 s0, p1 s1], part 1 likewise
    assert whole_groups([2], 2, 4).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    # two chunks (2 prompts, then 1): each chunk's parts join on their own; no split keeps the order
    assert whole_groups([2, 1], 2, 2).tolist() == [0, 2, 1, 3, 4, 5]
    assert whole_groups([3, 1], 1, 4).tolist() == list(range(16))


def test_split_groups_are_the_parts_sampled_apart(tmp_path):
    """The collected batch: prompt p's group holds part 0's then part 1's samples, each exactly what the
    generator draws for that part under its own seed."""
    from flowgrpo.text import TextGRPOTrainer

    overrides = [f"output_dir={tmp_path}", "progress=false", "prompts_per_iteration=2", "group_size=4",
                 "rollout_split=2", "generation.batch_size=8"]  # fmt: skip
    trainer = TextGRPOTrainer(load_text_config(CONFIG, overrides))
    state = trainer.sampler.state_dict()
    batch = trainer.collector.collect({}, step=0)
    assert batch is not None
    trainer.sampler.load_state_dict(state)
    index = trainer.sampler.next(2)
    prompts = [trainer.data.prompt_ids[i] for i in index]
    parts = [trainer.generator.generate(prompts, index, 2, seed=trainer.collector._chunk_seed(0, 0, q)) for q in (0, 1)]
    rollout = batch.rollout
    assert rollout.group_size == 4 and rollout.prompt_index.tolist() == [index[0]] * 4 + [index[1]] * 4
    for p in range(2):
        for q in range(2):
            got = rollout.completion_ids[p * 4 + q * 2 : p * 4 + q * 2 + 2]
            want = parts[q].completion_ids[p * 2 : p * 2 + 2]
            width = max(got.shape[1], want.shape[1])
            pad = trainer.generator.pad_id
            assert torch.equal(
                torch.nn.functional.pad(got, (0, width - got.shape[1]), value=pad),
                torch.nn.functional.pad(want, (0, width - want.shape[1]), value=pad),
            ), (p, q)
    assert batch.scores.values.shape[0] == 8


def test_a_split_that_does_not_divide_the_group_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="rollout_split 3 must divide group_size 8"):
        load_text_config(CONFIG, [f"output_dir={tmp_path}", "group_size=8", "rollout_split=3"])
