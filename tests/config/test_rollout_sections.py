"""The rollout side's parts: built once from the sections, each field from its flag (or the named fallback), frozen,
and rebuilt when a value changes."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, fields

import pytest

from miles.config.rollout_sections import DataSourceConfig, RewardSelection, StepStrategyConfig
from miles.config.sections import SECTIONS
from miles.testing.config import trainer_config

PART_NAMES = ("data_source", "sft_data", "reward_selection", "eval_sets", "step_strategy")
# Fields that combine flags (rollout_sections.py says how); every other field is one flag's value.
COMBINED = {("eval_sets", "input_key"), ("eval_sets", "num_steps"), ("eval_sets", "reward_key"),
            ("sft_data", "family_source")}


def test_every_plain_field_is_its_flags_value():
    config = trainer_config(rollout_seed=7, n_samples_per_prompt=3, diffusion_num_sde_steps=2,
                            eval_reward_key="ocr", reward_key="pickscore")
    for part_name in PART_NAMES:
        part = getattr(config, part_name)
        for field in fields(part):
            if (part_name, field.name) not in COMBINED:
                assert getattr(part, field.name) == config.values[field.name], (part_name, field.name)
    assert config.data_source == DataSourceConfig(**{f.name: config.values[f.name] for f in fields(DataSourceConfig)})
    assert config.reward_selection == RewardSelection("pickscore", None, "ocr")


def test_combined_fields_take_their_fallbacks():
    defaults = trainer_config(diffusion_num_steps=12, input_key="caption", reward_key="ocr")
    assert (defaults.eval_sets.input_key, defaults.eval_sets.num_steps, defaults.eval_sets.reward_key) == (
        "caption", 12, "ocr")
    own = trainer_config(diffusion_num_steps=12, diffusion_eval_num_steps=5, eval_input_key="text",
                         eval_reward_key="pickscore", reward_key="ocr")
    assert (own.eval_sets.input_key, own.eval_sets.num_steps, own.eval_sets.reward_key) == ("text", 5, "pickscore")
    assert own.sft_data.family_source == own.model.family_source()


def test_parts_are_frozen_and_follow_replace():
    config = trainer_config()
    with pytest.raises(FrozenInstanceError):
        config.step_strategy.diffusion_num_sde_steps = 3  # type: ignore[misc]
    changed = config.replace(diffusion_num_sde_steps=3, loss_type="nft")
    assert isinstance(changed.step_strategy, StepStrategyConfig)
    assert (changed.step_strategy.diffusion_num_sde_steps, changed.step_strategy.loss_type) == (3, "nft")
    assert config.step_strategy.diffusion_num_sde_steps != 3


def test_parts_are_not_sections():
    """A flag's one home stays its section (test_sections.py); the parts only gather what a reader needs."""
    assert not set(PART_NAMES) & set(SECTIONS)
