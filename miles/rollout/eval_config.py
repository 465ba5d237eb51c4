"""Evaluation datasets from `--eval-prompt-data NAME PATH ...` or `--eval-config` (which overrides them).

`--eval-config` is an OmegaConf YAML or JSON file:

    eval:                       # optional wrapper
      defaults:                 # optional, applied to every dataset
        n_samples_per_eval_prompt: 4
      datasets:
        - name: ocr_test
          path: data/ocr_test.jsonl      # relative paths: as given if that exists, else next to the config
          input_key: prompt              # default --eval-input-key, else --input-key
          metadata_key: metadata         # default --metadata-key
          n_samples_per_eval_prompt: 4   # default --n-samples-per-eval-prompt
          num_steps: 40                  # default --diffusion-eval-num-steps, else --diffusion-num-steps
          reward_key: ocr                # default --eval-reward-key, else --reward-key
          reward_weights: {ocr: 1.0, pickscore: 0.5}   # default --reward-weights; reward_key wins when set
          rm_type: ocr                   # default: as in training; a row's metadata.rm_type still wins

Metrics of a dataset are logged under `eval/<name>/*`: the scalar reward's mean and std, and each reward
component's (`eval/<name>/reward/<component>_mean`, `_std`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from miles.config.rollout_sections import EvalSetsConfig
from miles.rollout.data_source import PromptRow, load_prompt_data
from miles.utils.errors import MilesUserError


@dataclass
class EvalDataset:
    name: str
    path: str
    input_key: str = "input"
    metadata_key: str = "metadata"
    n_samples_per_eval_prompt: int = 1
    num_steps: int = 10
    reward_key: str | None = None
    reward_weights: dict[str, float] | None = None
    rm_type: str | None = None

    def load_prompts(self) -> list[PromptRow]:
        return load_prompt_data(self.path, self.input_key, self.metadata_key, flag=f"eval dataset {self.name!r}")

    def scalar_reward(self, reward: float | dict | None) -> float:
        """The logged eval reward: a float as is, the value at this dataset's `reward_key`, or (without a key)
        the sum of its `reward_weights`."""
        if reward is None:
            raise MilesUserError(f"eval dataset {self.name!r}: a sample has no reward")
        if self.reward_key is None and self.reward_weights:
            from miles.rollout.rm_hub import weighted_reward

            return weighted_reward(self.reward_weights, reward, f"eval dataset {self.name!r} reward_weights")
        if not isinstance(reward, dict):
            return float(reward)
        if self.reward_key is None or self.reward_key not in reward:
            raise MilesUserError(
                f"eval dataset {self.name!r}: the reward is a dict with keys {sorted(reward)}; set its reward_key "
                f"(--eval-reward-key / --reward-key or reward_key in --eval-config) or reward_weights "
                f"(--reward-weights), got reward_key {self.reward_key!r}"
            )
        return float(reward[self.reward_key])


OPTIONAL_KEYS = {f.name for f in fields(EvalDataset)} - {"name", "path"}


def _defaults(config: EvalSetsConfig) -> dict[str, Any]:
    return {
        "input_key": config.input_key,
        "metadata_key": config.metadata_key,
        "n_samples_per_eval_prompt": config.n_samples_per_eval_prompt,
        "num_steps": config.num_steps,
        "reward_key": config.reward_key,
        "reward_weights": config.reward_weights,
        "rm_type": None,  # None: routed like training (metadata.rm_type, --custom-rm-path, --rm-type)
    }


def _check(dataset: EvalDataset, where: str) -> EvalDataset:
    if not dataset.name or "/" in dataset.name:
        raise MilesUserError(f"{where}: eval dataset name {dataset.name!r} must be non-empty without '/'")
    if not os.path.isfile(dataset.path):
        raise MilesUserError(f"{where}: eval dataset {dataset.name!r}: file {dataset.path!r} does not exist")
    if dataset.n_samples_per_eval_prompt < 1 or dataset.num_steps < 1:
        raise MilesUserError(f"{where}: eval dataset {dataset.name!r}: n_samples_per_eval_prompt and num_steps must be >= 1")
    return dataset


def _from_pairs(config: EvalSetsConfig, pairs: list[str]) -> list[EvalDataset]:
    if len(pairs) % 2 != 0:
        raise MilesUserError(f"--eval-prompt-data takes NAME PATH pairs, got {len(pairs)} values: {pairs}")
    defaults = _defaults(config)
    return [
        _check(EvalDataset(name=name, path=path, **defaults), "--eval-prompt-data")
        for name, path in zip(pairs[0::2], pairs[1::2])
    ]


def _from_config(eval_sets: EvalSetsConfig, config_path: str) -> list[EvalDataset]:
    from omegaconf import OmegaConf

    where = f"--eval-config {config_path}"
    if not os.path.isfile(config_path):
        raise MilesUserError(f"{where}: file does not exist")
    try:
        spec = OmegaConf.to_container(OmegaConf.load(config_path), resolve=True)
    except Exception as err:
        raise MilesUserError(f"{where}: cannot parse: {err}") from err
    if isinstance(spec, dict) and "eval" in spec:
        spec = spec["eval"]
    if not isinstance(spec, dict) or not isinstance(spec.get("datasets"), list) or not spec["datasets"]:
        raise MilesUserError(f"{where}: expected a non-empty 'datasets' list (optionally under 'eval')")
    shared = spec.get("defaults") or {}
    unknown_top = set(spec) - {"datasets", "defaults"}
    if unknown_top or not isinstance(shared, dict) or set(shared) - OPTIONAL_KEYS:
        raise MilesUserError(f"{where}: unknown keys {sorted(unknown_top | (set(shared) - OPTIONAL_KEYS))}; allowed: datasets, defaults {sorted(OPTIONAL_KEYS)}")
    folder = os.path.dirname(os.path.abspath(config_path))
    datasets = []
    for position, entry in enumerate(spec["datasets"]):
        entry_where = f"{where}: datasets[{position}]"
        if not isinstance(entry, dict) or "name" not in entry or "path" not in entry:
            raise MilesUserError(f"{entry_where}: each dataset needs 'name' and 'path'")
        unknown = set(entry) - OPTIONAL_KEYS - {"name", "path"}
        if unknown:
            raise MilesUserError(f"{entry_where}: unknown keys {sorted(unknown)}; allowed: name, path, {sorted(OPTIONAL_KEYS)}")
        path = str(entry["path"])
        if not os.path.isabs(path) and not os.path.exists(path):
            path = os.path.join(folder, path)
        values = {**_defaults(eval_sets), **shared, **{k: v for k, v in entry.items() if k not in ("name", "path")}}
        dataset = EvalDataset(name=str(entry["name"]), path=path, **values)
        dataset.n_samples_per_eval_prompt = int(dataset.n_samples_per_eval_prompt)
        dataset.num_steps = int(dataset.num_steps)
        if dataset.reward_weights is not None:
            from miles.config.flags import parse_reward_weights

            try:
                dataset.reward_weights = parse_reward_weights(dataset.reward_weights)
            except ValueError as err:
                raise MilesUserError(f"{entry_where}: reward_weights: {err}") from err
        datasets.append(_check(dataset, entry_where))
    names = [dataset.name for dataset in datasets]
    if len(set(names)) != len(names):
        raise MilesUserError(f"{where}: duplicate dataset names {names}")
    return datasets


def build_eval_datasets(config: EvalSetsConfig) -> list[EvalDataset]:
    """The configured eval datasets ([] when none): `--eval-config` wins over `--eval-prompt-data`."""
    config_path = config.eval_config
    if config_path:
        return _from_config(config, config_path)
    pairs = config.eval_prompt_data
    if pairs:
        return _from_pairs(config, list(pairs))
    return []
