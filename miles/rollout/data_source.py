"""Prompt data for rollouts: the JSONL reader, the data source with its buffer, and `num_rollout`.

Prompt files come in three formats (`prompt_file_format` tells which; docs/data.md):
- JSONL: one JSON object per line, the prompt under `--input-key` (default "input"), optional metadata (a
  JSON object) under `--metadata-key` (default "metadata") and an optional input image under `image` (a path,
  relative to the prompt file's folder, for image-conditioned families: image editing, image-to-video);
- text (`.txt`): one prompt per line, as flow_grpo's `train.txt` / `test.txt`;
- GenEval metadata JSONL (`*_metadata.jsonl`, or rows with `prompt`, `tag` and `include` but no
  `--input-key`): the prompt under `prompt`, every other key of the row (`tag`, `include`, `exclude`, ...)
  goes into the sample's metadata for the reward.
Blank lines are skipped in all three. A bad line is a `MilesUserError` naming the file and the line.

Order: every epoch walks the prompts in a fresh permutation drawn from `--rollout-seed` + epoch, so a run
is reproducible and a resumed run continues the same order (`--no-rollout-shuffle` keeps file order).
The position (epoch, offset in the epoch, group counter) is in `state_dict()` and goes into checkpoints.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from miles.config.sections import DataConfig, HookArgs, RunConfig, run_config_of
from miles.rollout.hooks import REQUIRED_METHODS, build_user_data_source, with_hook_args
from miles.rollout.jsonl import decoded_lines, json_object
from miles.types import Sample
from miles.utils.errors import MilesUserError
from miles.utils.imports import load_function, load_object

logger = logging.getLogger(__name__)

Group = list[Sample]


@dataclass
class PromptRow:
    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)
    line: int = 0  # 1-based line number in the file
    image: str | None = None  # the row's input image, an absolute path (JSONL rows only)


TEXT_SUFFIX = ".txt"
GENEVAL_SUFFIX = "_metadata.jsonl"
GENEVAL_KEYS = ("prompt", "tag", "include")  # what every GenEval metadata row holds
IMAGE_KEY = "image"  # a JSONL row's input image


def _checked_prompt(where: str, record: dict[str, Any], key: str, key_origin: str) -> str:
    if key not in record:
        raise MilesUserError(f"{where}: no key {key!r} ({key_origin}); keys are {sorted(record)}")
    prompt = record[key]
    if not isinstance(prompt, str):
        raise MilesUserError(f"{where}: {key!r} must be a string, got {type(prompt).__name__}")
    if not prompt.strip():
        raise MilesUserError(f"{where}: empty prompt under {key!r}")
    return prompt


def prompt_file_format(path: str, input_key: str = "input", flag: str = "--prompt-data") -> str:
    """"txt", "geneval" or "jsonl": by the file name first, then by the first row's keys.

    A `.txt` file is text; a name ending in `_metadata.jsonl` is GenEval metadata (GenEval's
    `evaluation_metadata.jsonl`, flow_grpo's `train_metadata.jsonl`). Any other file is JSONL, unless its first
    row holds GenEval's `prompt`, `tag` and `include` and no `--input-key` (a renamed GenEval file).
    """
    name = os.path.basename(path).lower()
    if name.endswith(TEXT_SUFFIX):
        return "txt"
    if name.endswith(GENEVAL_SUFFIX):
        return "geneval"
    first_line = next(decoded_lines(path, flag), None)
    if first_line is None:
        return "jsonl"  # no rows: the reader reports the empty file
    try:
        first = json.loads(first_line[2])
    except json.JSONDecodeError:
        return "jsonl"  # the JSONL reader names the line
    # --input-key prompt on a GenEval file reads it as GenEval too: same prompt, and tag/include are kept
    looks_geneval = (isinstance(first, dict) and all(key in first for key in GENEVAL_KEYS)
                     and (input_key not in first or input_key == "prompt"))
    return "geneval" if looks_geneval else "jsonl"


def iter_prompt_rows(path: str, input_key: str = "input", metadata_key: str = "metadata",
                     flag: str = "--prompt-data", condition_image: Callable[[bool], str | None] | None = None,
                     input_images: bool = True) -> Iterator[PromptRow]:
    """Read and check a prompt file row by row (lazily: a caller may stop after the first rows), in the
    format `prompt_file_format` detects.

    Errors name the flag, the file and the line: `--prompt-data data.jsonl:7: no key 'input' (--input-key) ...`.
    Input images: `condition_image(has_image)` says why a row with (or without) one does not fit the run's family,
    or None (`miles.models.base.condition_image_mismatch`); and either every row of a file carries one or none
    does (the trainer batches samples of one conditioning layout). `input_images=False` reads no `image` key (SFT
    rows, where it is the training target: miles/rollout/sft_data.py checks those).
    """
    first_image_row: PromptRow | None = None
    for row, where in _iter_rows(path, input_key, metadata_key, flag, input_images):
        mismatch = condition_image(row.image is not None) if condition_image is not None else None
        if mismatch is not None:
            raise MilesUserError(f"{where}: {mismatch}")
        if first_image_row is None:
            first_image_row = row
        elif (row.image is None) != (first_image_row.image is None):
            has, lacks = (first_image_row, row) if row.image is None else (row, first_image_row)
            raise MilesUserError(f"{where}: line {has.line} has an input image (\"image\") and line {lacks.line} has "
                                 "none; every row of a prompt file carries one, or none does")
        yield row


def _iter_rows(path: str, input_key: str, metadata_key: str, flag: str,
               input_images: bool) -> Iterator[tuple[PromptRow, str]]:
    if not os.path.isfile(path):
        raise MilesUserError(f"{flag} {path!r}: prompt file does not exist")
    file_format = prompt_file_format(path, input_key, flag)
    geneval_reason = ("GenEval metadata, by the file name *_metadata.jsonl" if path.lower().endswith(GENEVAL_SUFFIX)
                      else "GenEval metadata, as the first row has prompt/tag/include")
    for line_number, where, text in decoded_lines(path, flag):
        if file_format == "txt":
            yield PromptRow(prompt=text.strip(), metadata={}, line=line_number), where
            continue
        record = json_object(where, text)
        if file_format == "geneval":
            prompt = _checked_prompt(where, record, "prompt", f"read as {geneval_reason}")
            metadata = {key: value for key, value in record.items() if key != "prompt"}
            yield PromptRow(prompt=prompt, metadata=metadata, line=line_number), where
            continue
        prompt = _checked_prompt(where, record, input_key, "--input-key")
        metadata = record.get(metadata_key, {})
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict):
            raise MilesUserError(
                f"{where}: {metadata_key!r} (--metadata-key) must be a JSON object, got {type(metadata).__name__}"
            )
        image = _checked_image(where, record, os.path.dirname(os.path.abspath(path))) if input_images else None
        yield PromptRow(prompt=prompt, metadata=metadata, line=line_number, image=image), where


def _checked_image(where: str, record: dict[str, Any], folder: str) -> str | None:
    """The row's input image as an absolute path (relative ones are read from the prompt file's folder)."""
    image = record.get(IMAGE_KEY)
    if image is None:
        return None
    if not isinstance(image, str) or not image.strip():
        raise MilesUserError(f"{where}: {IMAGE_KEY!r} must be the path of an image file, got {image!r}")
    resolved = os.path.join(folder, os.path.expanduser(image))
    if not os.path.isfile(resolved):
        raise MilesUserError(f"{where}: input image {image!r} does not exist (looked for {resolved}; relative "
                             "paths are read from the prompt file's folder)")
    return resolved


def check_prompt_file(path: str, input_key: str, metadata_key: str, flag: str, max_rows: int,
                      condition_image: Callable[[bool], str | None] | None = None, input_images: bool = True) -> int:
    """Check the first `max_rows` rows of a prompt file (cheap for any file size); returns how many it read.

    The entry point calls it before Ray starts, so an empty file or a wrong --input-key fails in a second. A row's
    input image must decode (PIL); `condition_image(has_image)` says why a row with (or without) one does not fit
    the run's family, or None (`miles.models.base.condition_image_mismatch`).
    """
    from miles.rollout.condition_image import check_image_file

    count = 0
    for row in iter_prompt_rows(path, input_key, metadata_key, flag, condition_image, input_images):
        if row.image is not None:
            check_image_file(row.image, f"{flag} {path}:{row.line}")
        count += 1
        if count >= max_rows:
            break
    if count == 0:
        raise MilesUserError(f"{flag} {path!r}: the file holds no prompts (only blank lines)" if os.path.getsize(path)
                             else f"{flag} {path!r}: the file is empty")
    return count


def load_prompt_data(path: str, input_key: str = "input", metadata_key: str = "metadata",
                     flag: str = "--prompt-data") -> list[PromptRow]:
    """Read and check a whole prompt file (any of the formats above)."""
    rows = list(iter_prompt_rows(path, input_key, metadata_key, flag))
    if not rows:
        raise MilesUserError(f"{flag} {path!r}: the file holds no prompts")
    return rows


def compute_num_rollout(
    num_rollout: int | None, num_epoch: int | None, num_prompts: int, rollout_batch_size: int
) -> int:
    """`--num-rollout` if set, else `ceil(num_epoch × num_prompts / rollout_batch_size)` (one epoch if
    neither is set)."""
    if num_rollout is not None:
        return int(num_rollout)
    if rollout_batch_size is None or rollout_batch_size < 1:
        raise MilesUserError("--rollout-batch-size must be set (>= 1) to derive --num-rollout")
    epochs = 1 if num_epoch is None else int(num_epoch)
    return math.ceil(epochs * num_prompts / rollout_batch_size)


def num_rollout_of(data: DataConfig) -> int:
    """`compute_num_rollout` with the prompt count read from `--prompt-data`."""
    if data.num_rollout is not None:
        return data.num_rollout
    if data.disable_rollout_global_dataset or not data.prompt_data:
        raise MilesUserError("set --num-rollout: without --prompt-data the number of rollouts cannot be derived")
    num_prompts = len(load_prompt_data(data.prompt_data, data.input_key, data.metadata_key))
    return compute_num_rollout(None, data.num_epoch, num_prompts, data.rollout_batch_size)


def pop_first(args, rollout_id: int, buffer: list[Group], num_groups: int) -> list[Group]:
    """The default buffer filter: the oldest `num_groups` groups (the hook's signature; `args` unused)."""
    return buffer[:num_groups]


class RolloutDataSource:
    """Walks the prompt file epoch by epoch and makes prompt groups of `--n-samples-per-prompt` samples."""

    def __init__(self, config: RunConfig | HookArgs):
        """`config`: the run's; a `--data-source-path` subclass passes the `args` it was built with."""
        self.config = run_config_of(config)
        settings = self.config.data_source
        self.n_samples_per_prompt = settings.n_samples_per_prompt
        self.seed = settings.rollout_seed
        self.shuffle = not settings.no_rollout_shuffle
        self.rows: list[PromptRow] = []
        if not settings.disable_rollout_global_dataset:
            if not settings.prompt_data:
                raise MilesUserError("--prompt-data is required (or pass --disable-rollout-global-dataset with your own --data-source-path)")
            self.rows = load_prompt_data(settings.prompt_data, settings.input_key, settings.metadata_key)
        self.epoch = 0
        self.offset = 0  # prompts consumed in the current epoch
        self.group_counter = 0  # next group_index (monotone across the run)
        self._order = self._epoch_order(0)
        # Preflight decodes only the first rows' input images; the others are decoded the first time they are
        # drawn, and one that does not decode is skipped (with a counted warning), never ending the run.
        self._decoded_images: set[int] = set()
        self.skipped_images: set[int] = set()

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle or not self.rows:
            return list(range(len(self.rows)))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.rows), generator=generator).tolist()

    def _next_rows(self, num_groups: int) -> list[PromptRow]:
        rows: list[PromptRow] = []
        while len(rows) < num_groups and self.rows:
            if self.offset == len(self.rows):
                self.epoch += 1
                self.offset = 0
                self._order = self._epoch_order(self.epoch)
                logger.info("prompt data: starting epoch %d", self.epoch)
            index = self._order[self.offset]
            self.offset += 1
            if self._image_decodes(index):
                rows.append(self.rows[index])
            elif len(self.skipped_images) == len(self.rows):
                raise MilesUserError(f"--prompt-data {self.config.data_source.prompt_data!r}: no row's input image "
                                     f"decodes ({len(self.rows)} skipped)")
        return rows

    def _image_decodes(self, index: int) -> bool:
        from miles.rollout.condition_image import check_image_file

        row = self.rows[index]
        if row.image is None or index in self._decoded_images:
            return True
        if index in self.skipped_images:
            return False
        try:
            check_image_file(row.image, f"--prompt-data {self.config.data_source.prompt_data}:{row.line}")
        except MilesUserError as err:
            self.skipped_images.add(index)
            logger.warning("%s: skipping the row (%d of %d rows skipped for their input image so far)", err,
                           len(self.skipped_images), len(self.rows))
            return False
        self._decoded_images.add(index)
        return True

    def _make_group(self, row: PromptRow) -> Group:
        group_index = self.group_counter
        self.group_counter += 1
        return [
            Sample(prompt=row.prompt, group_index=group_index, metadata=copy.deepcopy(row.metadata),
                   input_image=row.image)
            for _ in range(self.n_samples_per_prompt)
        ]

    def get_samples(self, num_groups: int, rollout_id: int | None = None) -> list[Group]:
        """`num_groups` new prompt groups; `sample.index` = position in the returned batch."""
        groups = [self._make_group(row) for row in self._next_rows(num_groups)]
        return _reindex(groups)

    def add_samples(self, groups: list[Group]) -> None:
        raise MilesUserError(
            "RolloutDataSource keeps no buffer, so groups cannot be put back; use RolloutDataSourceWithBuffer "
            "(the default of --data-source-path)"
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "group_counter": self.group_counter,
            "num_prompts": len(self.rows),
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_prompts", len(self.rows)) != len(self.rows):
            logger.warning(
                "prompt data changed since the checkpoint (%s prompts then, %d now): the position is kept, "
                "the order is not the one the checkpoint saw",
                state.get("num_prompts"),
                len(self.rows),
            )
        self.epoch = int(state["epoch"])
        self.offset = min(int(state["offset"]), len(self.rows))
        self.group_counter = int(state["group_counter"])
        self._order = self._epoch_order(self.epoch)

    def __len__(self) -> int:
        return len(self.rows)


class RolloutDataSourceWithBuffer(RolloutDataSource):
    """The default data source: groups put back by partial rollouts (`add_samples`) are served first,
    chosen by `--buffer-filter-path` `fn(args, rollout_id, buffer, num_groups) -> list[group]`."""

    def __init__(self, config: RunConfig | HookArgs):
        super().__init__(config)
        self.buffer: list[Group] = []
        self._calls = 0
        path = self.config.data_source.buffer_filter_path
        chosen = load_function(path, "--buffer-filter-path", required_params=4) if path else pop_first
        self.buffer_filter: Callable = with_hook_args(chosen, self.config)  # (rollout_id, buffer, num_groups)

    def get_samples(self, num_groups: int, rollout_id: int | None = None) -> list[Group]:
        rollout_id = self._calls if rollout_id is None else rollout_id
        self._calls += 1
        groups: list[Group] = []
        if self.buffer:
            selected = self.buffer_filter(rollout_id, self.buffer, num_groups)
            if not isinstance(selected, list) or len(selected) > num_groups:
                raise MilesUserError(
                    f"--buffer-filter-path must return a list of at most {num_groups} groups, got "
                    f"{len(selected) if isinstance(selected, list) else type(selected).__name__}"
                )
            chosen = {id(group) for group in selected}
            self.buffer = [group for group in self.buffer if id(group) not in chosen]
            groups.extend(selected)
        groups.extend(self._make_group(row) for row in self._next_rows(num_groups - len(groups)))
        return _reindex(groups)

    def add_samples(self, groups: list[Group]) -> None:
        for group in groups:
            if not isinstance(group, list) or not group or not all(isinstance(s, Sample) for s in group):
                raise MilesUserError("add_samples takes a list of groups, each a non-empty list of Samples")
        self.buffer.extend(groups)

    def state_dict(self) -> dict[str, Any]:
        # The buffer holds half-finished groups of the running rollout; they are regenerated after a resume.
        return {**super().state_dict(), "buffered_groups_dropped": len(self.buffer)}


def _reindex(groups: list[Group]) -> list[Group]:
    position = 0
    for group in groups:
        for sample in group:
            sample.index = position
            position += 1
    return groups


def build_data_source(config: RunConfig | HookArgs) -> Any:
    """`--data-source-path` (a class taking `args`), else `RolloutDataSourceWithBuffer`."""
    config = run_config_of(config)
    path = config.data_source.data_source_path
    if not path:
        return RolloutDataSourceWithBuffer(config)
    cls = load_object(path, "--data-source-path")
    if not callable(cls):
        raise MilesUserError(f"--data-source-path {path!r}: expected a class taking (args)")
    missing = [name for name in REQUIRED_METHODS if not callable(getattr(cls, name, None))]
    if missing:
        raise MilesUserError(f"--data-source-path {path!r}: missing method(s) {missing} (see docs/customization.md)")
    return build_user_data_source(cls, config)
