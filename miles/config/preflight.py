"""Checks of the files and folders a run will use, done before Ray starts (and by `--dry-run`).

`check_run_inputs` is what the entry point calls after parsing (through `check_user_paths`): a mistake that
would otherwise surface minutes later, after engines loaded their models (or never: a `--load` typo used to
train from scratch) is one `MilesUserError` naming the flag and the file, printed as one line with exit code 2:
- prompt files (`--prompt-data`, `--eval-prompt-data`): present, not empty, and their first rows are prompts in
  the file's format (JSONL objects with the prompt under `--input-key` / `--eval-input-key`, text lines, or GenEval
  metadata rows; `data_source.prompt_file_format`); the first bad line is named as file:line. A row's input image
  (`"image"`) must decode, and rows with or without one must fit the family (`TrainPipelineConfig.condition_image`:
  a text-to-image family refuses an image, an editing or image-to-video family needs one).
  Only the first `PROMPT_ROWS_CHECKED` rows are read, so a huge file costs nothing; the data source checks the
  rest when it loads the file.
- `--hf-checkpoint`: a local pipeline folder with a readable `model_index.json` naming a pipeline class, or a
  hub id (which, while HF_HUB_OFFLINE is set, must be in the local hub cache).
- `--save` and `--output-dir`: a folder (or creatable under one) in which a probe file can be created and removed.
- `--load`: the checkpoint it names is complete and matches the run (`checkpoint.checkpoint_to_resume`: family,
  --use-lora, the LoRA rank and alpha); a missing `--load` is an error unless it is the `--save` folder
  (resume-if-present). `resume_point` says where the run starts, which the entry point's finished-run line and
  `--dry-run`'s schedule read.
- the rollout hooks: each imports with its signature (an async `--custom-rm-path`, the arity of every hook), as
  the rollout manager checks them once Ray runs (`miles.rollout.hooks.load_rollout_hooks`);
- a reward: an RL run names one (--rm-type, --custom-rm-path, or metadata.rm_type in the first prompt rows).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from dataclasses import dataclass

from miles.utils.errors import MilesUserError

PROMPT_ROWS_CHECKED = 100


@dataclass(frozen=True)
class ResumePoint:
    """Where the run starts: after the `--load` checkpoint (`checkpoint_dir`), at `--start-rollout-id`, or at 0."""

    start_rollout_id: int
    checkpoint_dir: str | None


def check_run_inputs(args: argparse.Namespace) -> ResumePoint:
    _check_prompt_files(args)
    _check_hooks(args)
    _check_reward_is_named(args)
    _check_row_rewards(args)
    for flag, path in (("--save", args.save), ("--output-dir", args.output_dir)):
        if path:
            check_writable_folder(path, flag)
    check_pipeline_source(args.hf_checkpoint, "--hf-checkpoint")
    _check_image_size(args)
    return resume_point(args)


def _check_image_size(args: argparse.Namespace) -> None:
    """The output size within what the checkpoint's denoiser takes (SD3's position table), found here rather
    than by the engine's first request."""
    family_name = args.diffusion_model_family_resolved
    if not family_name:
        return
    from miles.models import get_family_class

    largest = get_family_class(family_name).largest_image_side(args.hf_checkpoint)
    for flag, value in (("--diffusion-height", args.diffusion_height), ("--diffusion-width", args.diffusion_width)):
        if largest is not None and value > largest:
            raise MilesUserError(f"{flag} {value} is larger than --hf-checkpoint {args.hf_checkpoint!r} can make: at "
                                 f"most {largest} px a side (its transformer's position table)")


def resume_point(args: argparse.Namespace) -> ResumePoint:
    """The checked `--load` checkpoint (`checkpoint.checkpoint_to_resume`) and the first rollout after it."""
    start, directory = 0, None
    if args.load:
        from miles.backends.fsdp_utils.checkpoint import checkpoint_to_resume
        from miles.config.sections import RunConfig

        resume = checkpoint_to_resume(RunConfig.from_args(args))
        if resume is not None:
            start, directory = int(resume.meta["rollout_id"]) + 1, resume.directory
    if args.start_rollout_id is not None:
        start = args.start_rollout_id
    return ResumePoint(start, directory)


MAX_MODEL_INDEX_BYTES = 1 << 20
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def check_pipeline_source(source: str | None, flag: str) -> None:
    """A diffusers pipeline folder (its model_index.json a JSON object naming `_class_name`), or a hub id that
    can be fetched (offline: one in the hub cache). Anything else is one line naming the flag."""
    if not source:
        return
    if os.path.isdir(source):
        index = os.path.join(source, "model_index.json")
        if not os.path.isfile(index):
            raise MilesUserError(f"{flag} {source!r}: no model_index.json, not a diffusers pipeline folder")
        try:
            with open(index, "rb") as handle:
                raw = handle.read(MAX_MODEL_INDEX_BYTES + 1)
            if len(raw) > MAX_MODEL_INDEX_BYTES:
                raise ValueError(f"larger than {MAX_MODEL_INDEX_BYTES} bytes")
            content = json.loads(raw)
        except (OSError, ValueError) as err:
            raise MilesUserError(f"{flag} {source!r}: {index} is not readable JSON "
                                 f"({' '.join(str(err).split())[:120]})") from None
        if not isinstance(content, dict) or not isinstance(content.get("_class_name"), str):
            raise MilesUserError(f"{flag} {source!r}: {index} names no pipeline class (\"_class_name\")")
        return
    if os.path.exists(source):
        raise MilesUserError(f"{flag} {source!r} is a file, not a diffusers pipeline folder or hub id")
    if not _HUB_ID.match(source):
        raise MilesUserError(f"{flag} {source!r}: no such folder (and not a hub id of the form org/name)")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(source, "model_index.json"), str):
            raise MilesUserError(f"{flag} {source!r}: not a local folder, and HF_HUB_OFFLINE is set but the hub "
                                 "cache does not hold it (download it first, or pass a local folder)")


def _check_prompt_files(args: argparse.Namespace) -> None:
    from miles.rollout.data_source import check_prompt_file, prompt_file_format

    input_key, metadata_key = args.input_key or "input", args.metadata_key or "metadata"
    if args.prompt_data:
        if not os.path.isfile(args.prompt_data):
            raise MilesUserError(f"--prompt-data {args.prompt_data!r}: no such file")
        if not args.disable_rollout_global_dataset:  # otherwise a custom data source reads it, in its own format
            file_format = prompt_file_format(args.prompt_data, input_key, "--prompt-data")
            if args.loss_type == "sft_loss" and file_format != "jsonl":
                raise MilesUserError(f"--prompt-data {args.prompt_data!r}: --loss-type sft_loss reads JSONL rows of a "
                                     f"caption and an image or video; this {file_format} file holds prompts only")
            rl = args.loss_type != "sft_loss"  # SFT rows' "image" is the training target, not an input image
            check_prompt_file(args.prompt_data, input_key, metadata_key, "--prompt-data", PROMPT_ROWS_CHECKED,
                              _condition_image_check(args) if rl else None, input_images=rl)
    eval_key = args.eval_input_key or input_key
    for name, path in args.eval_prompt_data_pairs:
        if not os.path.isfile(path):
            raise MilesUserError(f"--eval-prompt-data {name} {path!r}: no such file")
        check_prompt_file(path, eval_key, metadata_key, f"--eval-prompt-data {name}", PROMPT_ROWS_CHECKED,
                          _condition_image_check(args))
    if args.eval_config and not os.path.isfile(args.eval_config):
        raise MilesUserError(f"--eval-config {args.eval_config!r}: no such file")


def _check_hooks(args: argparse.Namespace) -> None:
    """Every rollout-side hook imports and has its signature (an async reward, the arity of each), as the rollout
    manager will check it after Ray started (miles.rollout.hooks)."""
    from miles.rollout.hooks import load_rollout_hooks

    load_rollout_hooks(args)


def _check_reward_is_named(args: argparse.Namespace) -> None:
    """An RL run scores its samples: --rm-type, --custom-rm-path, or `metadata.rm_type` in the prompt rows (checked
    on the first `PROMPT_ROWS_CHECKED`), unless a custom generate function or data source brings its own."""
    if args.loss_type == "sft_loss" or args.train_only:
        return
    own_rollout = not args.rollout_function_path.startswith("miles.rollout.")  # it may score its samples itself
    if (args.rm_type or args.custom_rm_path or args.custom_generate_function_path or own_rollout
            or args.disable_rollout_global_dataset):
        return
    if args.prompt_data:
        from itertools import islice

        from miles.rollout.data_source import iter_prompt_rows
        from miles.rollout.rm_hub import reward_spec

        rows = islice(iter_prompt_rows(args.prompt_data, args.input_key or "input", args.metadata_key or "metadata",
                                       "--prompt-data", input_images=False), PROMPT_ROWS_CHECKED)
        if any(reward_spec(row.metadata, None, None) for row in rows):
            return
    raise MilesUserError(f"--loss-type {args.loss_type} needs a reward and none is named: set --rm-type (e.g. "
                         "--rm-type pickscore) or --custom-rm-path, or give the prompt rows a metadata.rm_type")


def _check_row_rewards(args: argparse.Namespace) -> None:
    """The rewards the first rows of each prompt file go to (a row's `metadata.rm_type`, else --rm-type unless
    --custom-rm-path scores it): each row carries the metadata its reward reads (`ROW_METADATA_CHECKS`: the
    `shapes` scene), and a reward of several components that a row's own rm_type or an eval set's rows use has its
    scalar named (`check_reward_selection`)."""
    from itertools import islice

    from miles.config.reward_rules import check_reward_selection
    from miles.rollout.data_source import iter_prompt_rows
    from miles.rollout.rm_hub import CUSTOM_RM_TYPE, ROW_METADATA_CHECKS, reward_spec, split_reward_spec

    if args.loss_type == "sft_loss" or args.train_only or args.disable_rollout_global_dataset:
        return
    default_spec = None if args.custom_rm_path else args.rm_type
    input_key, metadata_key = args.input_key or "input", args.metadata_key or "metadata"
    files = [("--prompt-data", args.prompt_data, input_key, False)] if args.prompt_data else []
    files += [(f"--eval-prompt-data {name}", path, args.eval_input_key or input_key, True)
              for name, path in args.eval_prompt_data_pairs]
    specs: dict[tuple[str, bool], str] = {}  # (spec, evaluation) -> the first row that uses it
    for flag, path, key, evaluation in files:
        for row in islice(iter_prompt_rows(path, key, metadata_key, flag, input_images=False), PROMPT_ROWS_CHECKED):
            spec = reward_spec(row.metadata, args.rm_type, args.custom_rm_path)
            if spec in (None, CUSTOM_RM_TYPE):
                continue
            specs.setdefault((spec, evaluation), f"{flag} {path}:{row.line}")
            for rm_type in split_reward_spec(spec):
                check = ROW_METADATA_CHECKS.get(rm_type)
                try:
                    if check is not None:
                        check(row.metadata)
                except ValueError as err:
                    raise MilesUserError(f"{flag} {path}:{row.line}: reward {rm_type!r} cannot score this row: "
                                         f"{err}") from None
    for (spec, evaluation), where in specs.items():
        if spec != default_spec:
            check_reward_selection(args, spec, evaluation, f"{where}'s metadata.rm_type")
        elif evaluation:  # training under --rm-type is a flag rule (validation)
            check_reward_selection(args, spec, evaluation, "--rm-type")


def _condition_image_check(args: argparse.Namespace):
    """`has_image -> reason or None` for the run's registered family; None (no check here) for a
    `--train-pipeline-config-path` family, which the engine checks when a request arrives."""
    family_name = args.diffusion_model_family_resolved
    if not family_name:
        return None
    from miles.models import get_family_class
    from miles.models.base import condition_image_mismatch

    policy = get_family_class(family_name).condition_image_policy(args.hf_checkpoint)
    return lambda has_image: condition_image_mismatch(family_name, policy, has_image)


def check_writable_folder(path: str, flag: str) -> None:
    """`path` is a folder, or can be created, and a file can be created and removed in it (or in the nearest
    existing folder above it, which is where creating it starts)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise MilesUserError(f"{flag} {path!r} is a file, not a folder")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise MilesUserError(f"{flag} {path!r} cannot be created: {existing} is a file")
    try:
        handle, probe = tempfile.mkstemp(prefix=".miles-write-probe-", dir=existing)
        os.close(handle)
        os.remove(probe)
    except OSError as err:
        where = "" if existing == os.path.abspath(path) else f" (in {existing}, where it would be created)"
        raise MilesUserError(f"{flag} {path!r} is not writable{where}: {err.strerror}") from None
