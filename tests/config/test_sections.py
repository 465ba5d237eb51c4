"""The typed sections: every flag lands in exactly one section (or is parse-only), values come from the declarations
untouched, the config pickles for Ray, and hooks get a read-only view of every value."""

from __future__ import annotations

import pickle
from dataclasses import FrozenInstanceError, fields

import pytest

from miles.config.flags import all_flags
from miles.config.sections import HOOK_ONLY, PARSE_ONLY, SECTIONS, EngineConfig, RunConfig
from miles.config.validation import DERIVED_ATTRIBUTES
from miles.engine.server_args import ServerArgs
from miles.testing.config import parsed_config, trainer_config

BASE = ["--hf-checkpoint", "org/sd3-tiny", "--prompt-data", "prompts.jsonl", "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1"]


def section_fields() -> list[str]:
    return [f.name for section in SECTIONS.values() for f in fields(section)]


def test_every_flag_and_derived_value_has_exactly_one_home():
    names = section_fields()
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
    homes = set(names) | set(EngineConfig.flag_dests()) | set(PARSE_ONLY) | set(HOOK_ONLY)
    assert not set(PARSE_ONLY) & set(names)
    assert sorted(set(all_flags()) - homes) == []  # a new flag must be given a section
    assert sorted(set(DERIVED_ATTRIBUTES) - homes) == []
    assert sorted(set(names) - set(all_flags()) - set(DERIVED_ATTRIBUTES)) == []  # no field without a source


def test_values_are_the_declared_defaults():
    config = parsed_config(BASE)
    flags = all_flags()
    assert config.sampling.diffusion_noise_level == flags["diffusion_noise_level"].default
    assert config.trainer.lr == flags["lr"].default
    assert config.placement.dp_size == 1 and config.placement.train_world_size == 1
    assert config.trainer.ref_mode == "none"  # resolved by the reference-policy rule
    assert config.engine.passthrough["max_batch_size"] == ServerArgs().max_batch_size
    assert parsed_config([*BASE, "--sglang-max-batch-size", "3"]).engine.passthrough["max_batch_size"] == 3


def test_sections_are_frozen_and_replace_routes_to_the_section():
    config = trainer_config()
    with pytest.raises(FrozenInstanceError):
        config.trainer.lr = 1.0  # type: ignore[misc]
    changed = config.replace(lr=0.5, save="/ckpt")
    assert (changed.trainer.lr, changed.checkpoint.save) == (0.5, "/ckpt")
    assert config.trainer.lr != 0.5 and changed.hook_args.lr == 0.5


def test_config_pickles_for_ray_actors():
    config = parsed_config(BASE)
    again = pickle.loads(pickle.dumps(config))
    assert again == config and again.hook_args.lr == config.trainer.lr
    assert pickle.loads(pickle.dumps(config.hook_args)).prompt_data == "prompts.jsonl"


def test_hook_args_are_a_read_only_view_of_every_value(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("my_hook_setting: 3\n")
    args = parsed_config([*BASE, "--custom-config-path", str(yaml_file)]).hook_args
    assert args.my_hook_setting == 3  # a YAML-only key the reference keeps for hooks
    assert args.rollout_batch_size == 4 and args.dp_size == 1 and vars(args)["lr"] == args.lr
    assert getattr(args, "no_such_value", None) is None
    with pytest.raises(AttributeError, match="read-only"):
        args.lr = 1.0


def test_from_args_refuses_an_unvalidated_namespace():
    from miles.config.arguments import build_parser

    with pytest.raises(ValueError, match="not a validated namespace"):
        RunConfig.from_args(build_parser().parse_args(["--hf-checkpoint", "x"]))


def test_trainer_config_refuses_unknown_names_and_derived_values():
    with pytest.raises(KeyError, match="lrr"):
        trainer_config(lrr=1.0)
    with pytest.raises(KeyError, match="dp_size"):
        trainer_config(dp_size=2)
