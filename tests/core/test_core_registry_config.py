"""Registries, strict configs and the shape checks of the data contracts: errors name what is wrong and list
what is valid."""

from __future__ import annotations

import re

import pytest
import torch

from flowgrpo.core import (
    ESTIMATORS,
    PRESETS,
    AdvantageConfig,
    GroupBatch,
    KLSpec,
    LossConfig,
    PartSpec,
    Registry,
    TreeStructure,
    UnknownNameError,
    compute_advantages,
)
from flowgrpo.core.losses import AGGREGATIONS, BOUNDS, RATIOS, SURROGATES
from flowgrpo.core.transforms import TRANSFORMS

# --- registry ---------------------------------------------------------------------------------


def make_registry():
    reg = Registry("widget")

    @reg.register("plain")
    def plain(x):
        """A plain widget.

        More text."""
        return x

    @reg.register("tuned", requires=("extra",))
    def tuned(x, *, alpha: float = 1.0, beta: int = 2):
        return x

    return reg


def test_registry_register_get_describe():
    reg = make_registry()
    assert reg.names() == ["plain", "tuned"]
    assert "plain" in reg and "other" not in reg
    assert reg.get("tuned").requires == frozenset({"extra"})
    assert reg.get("tuned").settings == {"alpha": 1.0, "beta": 2}
    assert reg.get("plain").settings == {}
    assert reg.describe() == {"plain": "A plain widget.", "tuned": ""}
    assert reg.get("plain").fn(3) == 3


def test_registry_rejects_duplicates():
    reg = make_registry()
    with pytest.raises(ValueError, match="widget 'plain' is already registered"):
        reg.register("plain")(lambda x: x)
    for real in (ESTIMATORS, TRANSFORMS, RATIOS):
        name = real.names()[0]
        with pytest.raises(ValueError, match="already registered"):
            real.register(name)(lambda *a, **k: None)
    assert ESTIMATORS.get("grpo").fn.__name__ == "grpo"  # the original entry is untouched


def test_registry_unknown_name_lists_valid_names_and_suggests():
    reg = make_registry()
    with pytest.raises(
        UnknownNameError, match=r"unknown widget 'tuend' \(did you mean 'tuned'\?\); valid names: \['plain', 'tuned'\]"
    ):
        reg.get("tuend")
    with pytest.raises(ValueError, match=r"valid names: \['plain', 'tuned'\]") as e:
        reg.get("zzzzzz")
    assert "did you mean" not in str(e.value)


def test_registry_unknown_setting_lists_valid_settings():
    reg = make_registry()
    with pytest.raises(
        ValueError,
        match=r"'tuned' has no setting 'alpah' \(did you mean 'alpha'\?\); valid settings: \['alpha', 'beta'\]",
    ):
        reg.get("tuned").check_settings({"alpah": 1}, "widget")
    with pytest.raises(ValueError, match="valid settings: none"):
        reg.get("plain").check_settings({"x": 1}, "widget")
    reg.get("tuned").check_settings({"alpha": 0.5}, "widget")


# --- configs ----------------------------------------------------------------------------------


def test_part_spec_forms():
    assert PartSpec.model_validate("grpo") == PartSpec(name="grpo", settings={})
    assert PartSpec.model_validate({"name": "grpo", "eps": 1e-6}).settings == {"eps": 1e-6}
    assert PartSpec.model_validate({"name": "grpo", "settings": {"eps": 1.0}}).settings == {"eps": 1.0}
    with pytest.raises(ValueError):
        PartSpec.model_validate({"eps": 1.0})  # no name


def test_advantage_config_errors_list_valid_names():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'grop' \(did you mean 'grpo'\?\)") as e:
        AdvantageConfig(estimator="grop")
    assert str(ESTIMATORS.names()) in str(e.value)
    with pytest.raises(
        ValueError,
        match=r"advantage estimator 'grpo' has no setting 'epsilon'.*valid settings: \['eps', 'std_scope', 'unbiased'\]",
    ):
        AdvantageConfig(estimator={"name": "grpo", "epsilon": 1e-6})
    with pytest.raises(
        ValueError,
        match=r"unknown advantage transform 'clipp'.*valid names: \['ace', 'clip', 'filter_zero_std', 'nft_optimality', 'top_bottom_k'\]",
    ):
        AdvantageConfig(transforms=["clipp"])
    with pytest.raises(
        ValueError, match=r"advantage transform 'clip' has no setting 'maximum'.*valid settings: \['max'\]"
    ):
        AdvantageConfig(transforms=[{"name": "clip", "maximum": 3}])
    with pytest.raises(
        ValueError,
        match=r"unknown key 'estimater' \(did you mean 'estimator'\?\); valid keys: \['estimator', 'head_nan_policy', 'transforms'\]",
    ):
        AdvantageConfig.model_validate({"estimater": "grpo"})
    with pytest.raises(ValueError, match="head_nan_policy"):
        AdvantageConfig(head_nan_policy="drop")


def test_every_estimator_and_transform_setting_is_accepted():
    for name in ESTIMATORS.names():
        cfg = AdvantageConfig(estimator={"name": name, **ESTIMATORS.get(name).settings})
        assert cfg.estimator.name == name
    for name in TRANSFORMS.names():
        AdvantageConfig(transforms=[{"name": name, **TRANSFORMS.get(name).settings}])


def test_loss_config_errors_list_valid_names():
    with pytest.raises(
        ValueError, match=r"unknown loss preset 'dapoo' \(did you mean 'dapo'\?\); valid presets: "
    ) as e:
        LossConfig(preset="dapoo")
    assert str(sorted(PRESETS)) in str(e.value)
    for key, value, slot, registry in [
        ("ratio", "tokn", "ratio", RATIOS),
        ("bounds", "asymetric", "bounds", BOUNDS),
        ("surrogate", "ppo", "surrogate", SURROGATES),
        ("aggregation", "token_means", "aggregation", AGGREGATIONS),
        ("step_weighting", "invdt", "step weighting", None),
    ]:
        with pytest.raises(ValueError, match=f"unknown {slot} '{value}'") as e:
            LossConfig(**{key: value})
        if registry is not None:
            assert str(registry.names()) in str(e.value)
    with pytest.raises(
        ValueError,
        match=r"unknown KL estimator 'k4'.*valid names: \['flow_grpo', 'gaussian', 'k1', 'k2', 'k3', 'k3\+'\]",
    ):
        LossConfig(kl={"estimator": "k4", "coef": 0.1})
    with pytest.raises(ValueError, match=r"bounds 'symmetric' has no setting 'eps_high'.*valid settings: \['eps'\]"):
        LossConfig(bounds={"name": "symmetric", "eps_high": 0.3})
    with pytest.raises(
        ValueError, match=r"surrogate 'ppo_clip' has no setting 'dualclip' \(did you mean 'dual_clip'\?\)"
    ):
        LossConfig(surrogate={"name": "ppo_clip", "dualclip": 3.0})
    with pytest.raises(ValueError, match=r"unknown key 'entropy' \(did you mean 'entropy_coef'\?\)"):
        LossConfig.model_validate({"entropy": 0.1})
    with pytest.raises(
        ValueError, match=r"unknown key 'coeff' \(did you mean 'coef'\?\); valid keys: \['coef', 'estimator'\]"
    ):
        KLSpec.model_validate({"coeff": 0.1})


def test_loss_config_assignment_is_validated():
    cfg = LossConfig()
    with pytest.raises(ValueError, match="unknown ratio 'tokn'"):
        cfg.ratio = "tokn"
    with pytest.raises(ValueError, match="has no setting 'foo'"):
        cfg.ratio = {"name": "token", "foo": 1}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_fill_parts_and_user_settings_win(name):
    cfg = LossConfig(preset=name)
    for key, value in PRESETS[name].items():
        got = getattr(cfg, key)
        want = type(got).model_validate(value)
        assert got == want, key
    override = LossConfig(preset=name, aggregation="balanced")
    assert override.aggregation.name == "balanced"
    assert override.ratio == cfg.ratio and override.bounds == cfg.bounds


def test_settings_only_part_keeps_the_preset_or_default_name():
    dapo = LossConfig(preset="dapo", bounds={"eps_high": 0.3})
    assert dapo.bounds == PartSpec(name="asymmetric", settings={"eps_low": 0.2, "eps_high": 0.3})
    plain = LossConfig(bounds={"eps": 0.1})
    assert plain.bounds == PartSpec(name="symmetric", settings={"eps": 0.1})
    sapo = LossConfig(preset="sapo", surrogate={"tau_neg": 2.0})
    assert sapo.surrogate == PartSpec(name="sapo", settings={"tau_neg": 2.0})
    flow = LossConfig(preset="flow_grpo", kl={"coef": 0.04})
    assert (flow.kl.estimator, flow.kl.coef) == ("flow_grpo", 0.04)  # the preset's KL form, the user's beta
    assert (LossConfig(kl={"coef": 0.1}).kl.estimator, LossConfig(kl={"coef": 0.1}).kl.coef) == ("k3", 0.1)
    # a named part replaces the preset's part entirely
    named = LossConfig(preset="dapo", bounds={"name": "symmetric", "eps": 0.1})
    assert named.bounds == PartSpec(name="symmetric", settings={"eps": 0.1})
    with pytest.raises(ValueError, match="bounds 'asymmetric' has no setting 'eps'"):
        LossConfig(preset="dapo", bounds={"eps": 0.1})
    again = LossConfig.model_validate(dapo)
    assert again == dapo


def test_default_configs():
    assert AdvantageConfig().estimator.name == "grpo" and AdvantageConfig().transforms == []
    cfg = LossConfig()
    assert (cfg.ratio.name, cfg.bounds.name, cfg.surrogate.name, cfg.aggregation.name, cfg.step_weighting.name) == (
        "token",
        "symmetric",
        "ppo_clip",
        "token_mean",
        "none",
    )
    assert cfg.kl.coef == 0.0 and cfg.entropy_coef == 0.0


# --- GroupBatch / TreeStructure shapes --------------------------------------------------------


def test_group_batch_needs_a_source():
    with pytest.raises(ValueError, match="rewards: a GroupBatch needs rewards, step_rewards or preferences"):
        GroupBatch()
    with pytest.raises(ValueError, match=re.escape("rewards: expected a tensor with a [P, G, ...] shape")):
        GroupBatch(rewards=torch.zeros(3))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(rewards=torch.zeros(2, 3, 4, 5)), "rewards"),
        (dict(rewards=torch.zeros(2, 3, dtype=torch.long)), "rewards"),
        (dict(rewards=torch.zeros(2, 3), valid=torch.ones(2, 4, dtype=torch.bool)), "valid"),
        (dict(rewards=torch.zeros(2, 3), valid=torch.ones(2, 3)), "valid"),
        (dict(rewards=torch.zeros(2, 3, 2), reward_weights=[1.0, 2.0, 3.0]), "reward_weights"),
        (dict(rewards=torch.zeros(2, 3, 2), reward_names=["a"]), "reward_names"),
        (dict(rewards=torch.zeros(2, 3), step_rewards=torch.zeros(2, 4, 5)), "step_rewards"),
        (
            dict(
                rewards=torch.zeros(2, 3),
                step_rewards=torch.zeros(2, 3, 5),
                step_mask=torch.ones(2, 3, 4, dtype=torch.bool),
            ),
            "step_mask",
        ),
        (
            dict(rewards=torch.zeros(2, 3), step_rewards=torch.zeros(2, 3, 5), step_mask=torch.ones(2, 3, 5)),
            "step_mask",
        ),
        (dict(rewards=torch.zeros(2, 3), step_mask=torch.ones(2, 3, 5, dtype=torch.bool)), "step_mask"),
        (dict(rewards=torch.zeros(2, 3), preferences=torch.zeros(2, 3, 4)), "preferences"),
        (dict(rewards=torch.zeros(2, 3), lengths=torch.zeros(3, 2)), "lengths"),
        (dict(rewards=torch.zeros(2, 3), valid=[[True] * 3] * 2), "valid"),
    ],
)
def test_group_batch_shape_errors_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}: "):
        GroupBatch(**kwargs)


def tree(parent, depth, leaf, **kw):
    t = lambda a: torch.tensor([a])  # noqa: E731
    return TreeStructure(t(parent), t(depth), t(leaf), **{k: t(v) for k, v in kw.items()})


@pytest.mark.parametrize(
    "tree_kwargs, name",
    [
        (dict(parent=[-1, 0, 0], depth=[0, 1], leaf=[1, 2]), "tree.depth"),
        (dict(parent=[-1, 0, 0], depth=[0, 1, 1], leaf=[1, 2, 2]), "tree.leaf_index"),
        (dict(parent=[-1, 0, 0], depth=[0, 1, 1], leaf=[1, 2], node_valid=[True, True]), "tree.node_valid"),
        (dict(parent=[-1, 0, 0], depth=[0, 1, 1], leaf=[1, 2], edge_logp=[0.0, 0.0]), "tree.edge_logp"),
        (dict(parent=[-1, 0, 3], depth=[0, 1, 1], leaf=[1, 2]), "tree.parent"),
        (dict(parent=[-2, 0, 0], depth=[0, 1, 1], leaf=[1, 2]), "tree.parent"),
        (dict(parent=[-1, 0, 0], depth=[0, 1, 1], leaf=[1, 3]), "tree.leaf_index"),
        (dict(parent=[-1, 0, 1], depth=[0, 1, 1], leaf=[1, 2]), "tree.depth"),
    ],
)
def test_tree_shape_errors_name_the_field(tree_kwargs, name):
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}: "):
        GroupBatch(rewards=torch.zeros(1, 2), tree=tree(**tree_kwargs))
    with pytest.raises(ValueError, match=r"^tree\.parent: expected shape \[1, \*\]"):
        GroupBatch(
            rewards=torch.zeros(1, 2), tree=TreeStructure(torch.tensor([-1]), torch.tensor([0]), torch.tensor([[0, 0]]))
        )


def test_group_batch_defaults_and_properties():
    b = GroupBatch(rewards=torch.zeros(2, 3, 2))
    assert b.num_groups == 2 and b.group_size == 3 and b.num_heads == 2
    assert b.reward_names == ["reward_0", "reward_1"] and torch.equal(b.reward_weights, torch.ones(2))
    assert b.valid.dtype == torch.bool and bool(b.valid.all())
    assert GroupBatch(rewards=torch.zeros(2, 3)).reward_names == ["reward"]
    s = GroupBatch(step_rewards=torch.zeros(2, 3, 4))
    assert s.step_mask.shape == (2, 3, 4) and s.num_heads == 1
    with pytest.raises(ValueError, match="rewards: this estimator needs scalar rewards"):
        s.head_rewards()
    t = tree([-1, 0, 0], [0, 1, 1], [1, 2])
    GroupBatch(rewards=torch.zeros(1, 2), tree=t)
    assert t.num_nodes == 3 and bool(t.node_valid.all())
    with pytest.raises(ValueError, match="nan_policy"):
        GroupBatch(rewards=torch.zeros(1, 2)).scalar_rewards("zero")


def test_win_rate_without_preferences_raises():
    with pytest.raises(ValueError, match="advantage estimator 'win_rate' needs GroupBatch.preferences"):
        compute_advantages(GroupBatch(rewards=torch.zeros(1, 3)), AdvantageConfig(estimator="win_rate"))


def test_config_head_nan_policy_overrides_the_batch():
    r = torch.tensor([[[3.0, float("nan")], [0.0, 0.0], [2.0, 0.0]]])
    b = GroupBatch(rewards=r)
    prop = compute_advantages(b, AdvantageConfig(estimator="dr_grpo"))
    ign = compute_advantages(b, AdvantageConfig(estimator="dr_grpo", head_nan_policy="ignore_head"))
    assert prop.advantages[0].tolist() == [0.0, -1.0, 1.0]  # sample 0 is NaN: mean of (0, 2)
    assert ign.advantages[0].tolist() == pytest.approx([4 / 3, -5 / 3, 1 / 3])  # NaN head left out: (3, 0, 2)
    assert prop.metrics["rewards/nan_count"] == 1.0 and ign.metrics["rewards/nan_count"] == 0.0
