"""Checks before Ray starts (miles.config.preflight via check_user_paths): every mistake is one line naming the
flag and the file, and --dry-run runs the same checks."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from miles.backends.fsdp_utils.checkpoint import POINTER_FILE
from miles.config import preflight
from miles.config.arguments import check_user_paths, parse_args
from miles.utils.errors import MilesUserError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_family_env(monkeypatch):
    monkeypatch.delenv("MILES_DIFFUSION_MODEL_FAMILY", raising=False)


@pytest.fixture()
def prompts(tmp_path) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"input": "a cat"}\n{"input": "a dog"}\n')
    return str(path)


def argv(prompts: str, tmp_path, *extra: str) -> list[str]:
    return ["--hf-checkpoint", "org/sd3-tiny", "--prompt-data", prompts, "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
            "--rm-type", "brightness", "--output-dir", str(tmp_path / "out"), *extra]


def check(prompts: str, tmp_path, *extra: str) -> None:
    check_user_paths(parse_args(argv(prompts, tmp_path, *extra)))


def error(prompts: str, tmp_path, *extra: str) -> str:
    with pytest.raises(MilesUserError) as info:
        check(prompts, tmp_path, *extra)
    assert "\n" not in str(info.value)
    return str(info.value)


def fake_checkpoint(root: Path, rollout_id: int = 3, **meta_overrides) -> Path:
    """A checkpoint folder as save_checkpoint lays it out (one tiny DCP shard, meta.pt, the pointer)."""
    import torch.distributed.checkpoint as dcp

    directory = root / f"iter_{rollout_id:07d}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": {"w": torch.ones(4)}}, checkpoint_id=str(directory), no_dist=True)
    meta = {"rollout_id": rollout_id, "global_step": 1, "has_optimizer": False, "lr_scheduler": {},
            "grad_scaler": {}, "ema_num_updates": None, "use_lora": False, "family": "sd3", "world_size": 1,
            "extra_state": {}, **meta_overrides}
    torch.save(meta, directory / "meta.pt")
    (root / POINTER_FILE).write_text(f"{rollout_id}\n")
    return directory


# ---- --load -------------------------------------------------------------------------------------------------
def test_load_of_a_missing_folder_fails_unless_it_is_the_save_folder(prompts, tmp_path):
    missing = str(tmp_path / "ckpt-typo")
    message = error(prompts, tmp_path, "--load", missing)
    assert message.startswith(f"--load {missing!r}: no such folder")
    check(prompts, tmp_path, "--load", missing, "--save", missing)  # resume-if-present (the reference's rule)
    assert not os.path.exists(missing)  # checking creates nothing


def test_load_of_a_folder_without_a_checkpoint(prompts, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"no {POINTER_FILE}, so no checkpoint to resume" in error(prompts, tmp_path, "--load", str(empty))
    directory = fake_checkpoint(tmp_path / "ckpt")
    os.remove(tmp_path / "ckpt" / POINTER_FILE)
    assert "pass --ckpt-step 3" in error(prompts, tmp_path, "--load", str(tmp_path / "ckpt"))
    check(prompts, tmp_path, "--load", str(tmp_path / "ckpt"), "--ckpt-step", "3")
    assert f"{directory.parent / 'iter_0000005'}: no such folder" in error(
        prompts, tmp_path, "--load", str(tmp_path / "ckpt"), "--ckpt-step", "5")


def test_load_checks_the_checkpoint_before_ray(prompts, tmp_path):
    directory = fake_checkpoint(tmp_path / "ckpt")
    load = ["--load", str(tmp_path / "ckpt")]
    check(prompts, tmp_path, *load)
    shard = next(directory.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:8])
    assert f"shard {shard} is truncated (8 bytes" in error(prompts, tmp_path, *load)
    fake_checkpoint(tmp_path / "ckpt", family="wan2_2")
    message = error(prompts, tmp_path, *load)
    assert message == (f"--load {str(directory)!r} holds model family 'wan2_2', but this run trains 'sd3' "
                       "(--hf-checkpoint / --diffusion-model-family / --train-pipeline-config-path)")
    fake_checkpoint(tmp_path / "ckpt", use_lora=True)
    assert "was saved with use_lora=True; this run has --use-lora=False" in error(prompts, tmp_path, *load)
    os.remove(directory / "meta.pt")
    assert "incomplete checkpoint: meta.pt is missing" in error(prompts, tmp_path, *load)


def test_a_lora_rank_or_alpha_other_than_the_checkpoints_is_caught_before_ray(prompts, tmp_path):
    lora = {"r": 32, "lora_alpha": 64, "target_modules": ["to_q"], "init_lora_weights": True}
    fake_checkpoint(tmp_path / "ckpt", use_lora=True, lora=lora)
    load = ["--load", str(tmp_path / "ckpt"), "--use-lora", "--lora-alpha", "64"]
    check(prompts, tmp_path, *load, "--lora-rank", "32")
    assert error(prompts, tmp_path, *load, "--lora-rank", "16").endswith(
        "holds a LoRA adapter of r 32, but this run has --lora-rank 16: pass --lora-rank 32 to resume it")
    assert "--lora-alpha 64 to resume it" in error(prompts, tmp_path, *load[:-2], "--lora-rank", "32",
                                                   "--lora-alpha", "8")


def test_the_resume_point_is_after_the_checkpoint(prompts, tmp_path):
    from miles.config.preflight import resume_point

    directory = fake_checkpoint(tmp_path / "ckpt", rollout_id=4)
    point = resume_point(parse_args(argv(prompts, tmp_path, "--load", str(tmp_path / "ckpt"))))
    assert (point.start_rollout_id, point.checkpoint_dir) == (5, str(directory))
    assert resume_point(parse_args(argv(prompts, tmp_path))).start_rollout_id == 0


# ---- the reward and the hooks -------------------------------------------------------------------------------
def test_an_rl_run_without_a_reward_fails_before_ray(prompts, tmp_path):
    no_reward = [a for a in argv(prompts, tmp_path) if a not in ("--rm-type", "brightness")]
    with pytest.raises(MilesUserError, match="^--loss-type policy_loss needs a reward and none is named"):
        check_user_paths(parse_args(no_reward))
    routed = tmp_path / "routed.jsonl"
    routed.write_text('{"input": "a cat", "metadata": {"rm_type": "brightness"}}\n')
    check_user_paths(parse_args([*no_reward, "--prompt-data", str(routed)]))  # the rows name their reward


def test_a_reward_that_is_not_async_fails_before_ray(prompts, tmp_path):
    message = error(prompts, tmp_path, "--custom-rm-path", "os.path.join")
    assert message == ("--custom-rm-path 'os.path.join': must be an async function: "
                       "async fn(args, samples) -> list[float]")


# ---- --save / --output-dir ----------------------------------------------------------------------------------
def test_save_must_be_a_writable_folder(prompts, tmp_path, monkeypatch):
    check(prompts, tmp_path, "--save", str(tmp_path / "new" / "ckpt"))
    assert not (tmp_path / "new").exists()  # the probe goes in the nearest existing folder and is removed
    assert os.listdir(tmp_path) == ["prompts.jsonl"]
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    assert error(prompts, tmp_path, "--save", str(a_file)) == f"--save {str(a_file)!r} is a file, not a folder"
    under_file = str(a_file / "ckpt")
    assert error(prompts, tmp_path, "--save", under_file) == (f"--save {under_file!r} cannot be created: {a_file} "
                                                               "is a file")

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    save = str(tmp_path / "ckpt")
    message = error(prompts, tmp_path, "--save", save)
    assert message == (f"--save {save!r} is not writable (in {tmp_path}, where it would be created): Read-only "
                       "file system")


# ---- prompt files --------------------------------------------------------------------------------------------
def test_prompt_files_empty_or_without_the_input_key(prompts, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert error(str(empty), tmp_path) == f"--prompt-data {str(empty)!r}: the file is empty"
    empty.write_text("\n  \n")
    assert "the file holds no prompts" in error(str(empty), tmp_path)
    wrong_key = tmp_path / "wrong.jsonl"
    wrong_key.write_text('{"input": "a cat"}\n\n{"prompt": "a dog"}\n{"prompt": "a cow"}\n')
    assert error(str(wrong_key), tmp_path) == (f"--prompt-data {wrong_key}:3: no key 'input' (--input-key); keys "
                                               "are ['prompt']")
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text('{"text": "a cat"}\n')
    message = error(prompts, tmp_path, "--eval-prompt-data", "held_out", str(eval_file), "--eval-interval", "1")
    assert message.startswith(f"--eval-prompt-data held_out {eval_file}:1: no key 'input'")
    check(prompts, tmp_path, "--eval-prompt-data", "held_out", str(eval_file), "--eval-interval", "1",
          "--eval-input-key", "text")


def test_only_the_first_rows_of_a_big_prompt_file_are_read(tmp_path, monkeypatch):
    big = tmp_path / "big.jsonl"
    rows = ['{"input": "p%d"}' % i for i in range(preflight.PROMPT_ROWS_CHECKED)]
    big.write_text("\n".join(rows) + "\nnot json at all\n")
    check(str(big), tmp_path)  # the bad line is past the rows checked; the data source reports it at load
    big.write_text('{"input": "p"}\n' * 5 + "{broken\n" + '{"input": "p"}\n' * 500)
    assert error(str(big), tmp_path).startswith(f"--prompt-data {big}:6: not valid JSON")


def test_text_and_geneval_prompt_files_are_checked_in_their_own_format(tmp_path):
    text = tmp_path / "train.txt"
    text.write_text("a red fox\n\na blue car\n")
    check(str(text), tmp_path)
    text.write_text("\n \n")
    assert error(str(text), tmp_path) == f"--prompt-data {str(text)!r}: the file holds no prompts (only blank lines)"
    text.write_bytes(b"a red fox\n\xff\xfe\n")
    assert error(str(text), tmp_path) == f"--prompt-data {text}:2: not UTF-8 text (byte 1 of the line)"

    geneval = tmp_path / "train_metadata.jsonl"
    row = '{"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"}\n'
    geneval.write_text(row * 3)
    check(str(geneval), tmp_path)
    geneval.write_text(row + '{"tag": "colors", "include": [], "text": "a red bench"}\n')
    assert error(str(geneval), tmp_path) == (f"--prompt-data {geneval}:2: no key 'prompt' (read as GenEval metadata, "
                                             "by the file name *_metadata.jsonl); keys are ['include', 'tag', 'text']")
    eval_file = tmp_path / "test_metadata.jsonl"
    eval_file.write_text(row + "{broken\n")
    text.write_text("a red fox\n")
    message = error(str(text), tmp_path, "--eval-prompt-data", "geneval", str(eval_file), "--eval-interval", "1")
    assert message.startswith(f"--eval-prompt-data geneval {eval_file}:2: not valid JSON")


def test_sft_refuses_a_prompt_only_file(tmp_path):
    text = tmp_path / "captions.txt"
    text.write_text("a watercolor fox\n")
    message = error(str(text), tmp_path, "--loss-type", "sft_loss")
    assert message == (f"--prompt-data {str(text)!r}: --loss-type sft_loss reads JSONL rows of a caption and an image "
                       "or video; this txt file holds prompts only")


def test_input_images_must_decode_and_fit_the_family(tmp_path):
    from PIL import Image

    Image.new("RGB", (16, 16), (10, 20, 30)).save(tmp_path / "cat.png")
    (tmp_path / "broken.png").write_bytes(b"not an image")
    edits = tmp_path / "edits.jsonl"
    edits.write_text('{"input": "make it red", "image": "cat.png"}\n')
    kontext = ("--diffusion-model-family", "flux_kontext")
    check(str(edits), tmp_path, *kontext)
    assert error(str(edits), tmp_path) == (  # org/sd3-tiny: a text-to-image family
        f"--prompt-data {edits}:1: family 'sd3' takes no input image; remove the row's \"image\" or use an "
        "image-conditioned checkpoint (docs/models.md, Image-conditioned families)")
    edits.write_text('{"input": "make it red", "image": "cat.png"}\n{"input": "add a hat"}\n')
    assert error(str(edits), tmp_path, *kontext) == (
        f"--prompt-data {edits}:2: family 'flux_kontext' needs an input image in every prompt row "
        "(\"image\": path, docs/data.md)")
    edits.write_text('{"input": "make it red", "image": "broken.png"}\n')
    assert error(str(edits), tmp_path, *kontext).startswith(
        f"--prompt-data {edits}:1: input image {str(tmp_path / 'broken.png')!r} cannot be read as an image")
    edits.write_text('{"input": "make it red", "image": "gone.png"}\n')
    assert error(str(edits), tmp_path, *kontext).startswith(
        f"--prompt-data {edits}:1: input image 'gone.png' does not exist")


def test_whether_a_wan_checkpoint_takes_an_image_is_read_from_its_folder(tmp_path, tiny_checkpoint):
    from PIL import Image

    from miles.testing.tiny import wan2_2 as tiny_wan

    Image.new("RGB", (16, 16)).save(tmp_path / "first_frame.png")
    rows = tmp_path / "i2v.jsonl"
    rows.write_text('{"input": "the cat runs", "image": "first_frame.png"}\n')
    ti2v = tiny_wan.build(str(tmp_path / "tiny-ti2v"), seed=0, variant="ti2v_5b")
    check(str(rows), tmp_path, "--hf-checkpoint", ti2v)
    assert error(str(rows), tmp_path, "--hf-checkpoint", tiny_checkpoint("wan2_2")).startswith(
        f"--prompt-data {rows}:1: family 'wan2_2' takes no input image")


def test_sft_rows_image_is_a_training_target_not_an_input_image(tmp_path):
    rows = tmp_path / "sft.jsonl"
    rows.write_text('{"input": "a fox", "image": "fox.png"}\n{"input": "a clip", "video": "clip"}\n')
    check(str(rows), tmp_path, "--loss-type", "sft_loss")  # SFT data checks its media itself, when it loads


# ---- --custom-config-path -----------------------------------------------------------------------------------
def test_yaml_typo_of_a_flag_is_an_error_with_a_suggestion(prompts, tmp_path, caplog):
    config = tmp_path / "config.yaml"
    config.write_text("rollout_batchsize: 8\n")
    with pytest.raises(MilesUserError) as info:
        parse_args(argv(prompts, tmp_path, "--custom-config-path", str(config)))
    assert str(info.value) == (f"--custom-config-path {str(config)!r}: unknown key 'rollout_batchsize': did you mean "
                               "'rollout_batch_size' (--rollout-batch-size)?")
    config.write_text("my_reward_threshold: 0.5\n")  # far from every flag: a setting for the user's hooks
    assert parse_args(argv(prompts, tmp_path, "--custom-config-path", str(config))).my_reward_threshold == 0.5


# ---- the entry point: --dry-run runs the same checks ------------------------------------------------------
def test_dry_run_runs_the_checks_and_fails_in_one_line(prompts, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("MILES_DIFFUSION_MODEL_FAMILY", None)
    missing = str(tmp_path / "ckpt-typo")
    result = subprocess.run([sys.executable, str(REPO / "train_diffusion.py"), *argv(prompts, tmp_path),
                             "--load", missing, "--dry-run"], capture_output=True, text=True, cwd=REPO, env=env,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: --load {missing!r}: no such folder (to start from scratch "
                                                  "drop --load; --load equal to --save resumes only if a checkpoint "
                                                  "is there)"]


def test_dry_run_reads_text_and_geneval_prompt_files(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("MILES_DIFFUSION_MODEL_FAMILY", None)
    text = tmp_path / "train.txt"
    text.write_text("a red fox\n\na blue car\n")
    geneval = tmp_path / "test_metadata.jsonl"
    geneval.write_text('{"tag": "colors", "include": [{"class": "car", "count": 1, "color": "blue"}], '
                       '"prompt": "a photo of a blue car"}\n{"tag": "colors", "include": []}\n')
    result = subprocess.run([sys.executable, str(REPO / "train_diffusion.py"), *argv(str(text), tmp_path),
                             "--eval-prompt-data", "geneval", str(geneval), "--eval-interval", "1", "--dry-run"],
                            capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert result.returncode == 2  # the text file passed; the GenEval file's second row has no prompt
    assert result.stderr.strip().splitlines() == [
        f"error: --eval-prompt-data geneval {geneval}:2: no key 'prompt' (read as GenEval metadata, by the file name "
        "*_metadata.jsonl); keys are ['include', 'tag']"]


def test_a_pipeline_that_is_a_file_broken_or_offline_and_uncached_is_one_line(prompts, tmp_path):
    a_file = tmp_path / "weights.safetensors"
    a_file.write_bytes(b"\0")
    assert error(prompts, tmp_path, "--hf-checkpoint", str(a_file), "--diffusion-model-family", "sd3") == (
        f"--hf-checkpoint {str(a_file)!r} is a file, not a diffusers pipeline folder or hub id")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model_index.json").write_text('{"_class_name": ')
    assert "model_index.json is not readable JSON" in error(prompts, tmp_path, "--hf-checkpoint", str(broken),
                                                            "--diffusion-model-family", "sd3")
    (broken / "model_index.json").write_text('["StableDiffusion3Pipeline"]')
    assert "names no pipeline class" in error(prompts, tmp_path, "--hf-checkpoint", str(broken),
                                              "--diffusion-model-family", "sd3")
    assert "HF_HUB_OFFLINE is set but the hub cache does not hold it" in error(
        prompts, tmp_path, "--hf-checkpoint", "someone/sd3-elsewhere")
    assert "no such folder" in error(prompts, tmp_path, "--hf-checkpoint", str(tmp_path / "sd3" / "typo"))
    # a path naming no family: the missing folder is the error, not the family it cannot tell
    assert error(prompts, tmp_path, "--hf-checkpoint", "/nonexistent/model") == (
        "--hf-checkpoint '/nonexistent/model': no such folder (and not a hub id of the form org/name)")
    assert "the hub cache does not hold it" in error(prompts, tmp_path, "--hf-checkpoint", "someone/elsewhere")


def test_rows_their_reward_cannot_score_are_one_line_with_the_file_and_line(prompts, tmp_path):
    from miles.tasks.shapes.data import write_prompt_files

    train, heldout = write_prompt_files(str(tmp_path / "shapes"))
    check(train, tmp_path, "--rm-type", "shapes", "--reward-key", "shapes", "--eval-prompt-data", "heldout", heldout)
    # a plain prompt file (no scenes) under the shapes reward: its first row names what is missing
    assert error(prompts, tmp_path, "--rm-type", "shapes", "--reward-key", "shapes") == (
        f"--prompt-data {prompts}:1: reward 'shapes' cannot score this row: shapes metadata: 'tag' must be one of "
        "('single', 'counting', 'two_object', 'position'), got None; write the prompts with "
        "`python -m miles.tasks.shapes.data`")
    assert f"--eval-prompt-data plain {prompts}:1: reward 'shapes'" in error(
        train, tmp_path, "--rm-type", "shapes", "--reward-key", "shapes", "--eval-prompt-data", "plain", prompts)
    # a row routed to the shapes reward by its own rm_type is checked too; --custom-rm-path rows are not
    routed = tmp_path / "routed.jsonl"
    routed.write_text('{"input": "a cat", "metadata": {"rm_type": "shapes", "tag": "single"}}\n')
    assert f"{routed}:1: reward 'shapes' cannot score this row: shapes metadata: 'objects'" in error(
        str(routed), tmp_path)
    check(prompts, tmp_path, "--rm-type", "shapes", "--custom-rm-path", "miles.rollout.rm_hub.builtin.brightness_rm")


def test_a_reward_of_several_components_needs_its_scalar_named_before_ray_starts(prompts, tmp_path):
    from miles.tasks.shapes.data import write_prompt_files

    train, heldout = write_prompt_files(str(tmp_path / "shapes"))
    assert error(train, tmp_path, "--rm-type", "shapes") == (
        "--rm-type shapes gives 2 reward components per sample (shapes, shapes_correct): set --reward-weights (e.g. "
        "shapes=1,shapes_correct=1) or --reward-key (one of them)")
    assert error(train, tmp_path, "--rm-type", "shapes", "--reward-key", "shape") == (
        "--reward-key 'shape' is none of the components of --rm-type shapes: ['shapes', 'shapes_correct']")
    eval_flags = ("--rm-type", "shapes", "--reward-key", "shapes", "--eval-prompt-data", "heldout", heldout)
    check(train, tmp_path, *eval_flags, "--eval-reward-key", "shapes_correct")
    assert "--eval-reward-key 'correct' is none of the components of --rm-type shapes" in error(
        train, tmp_path, *eval_flags, "--eval-reward-key", "correct")
    check(train, tmp_path, "--rm-type", "shapes", "--reward-weights", "shapes=1,shapes_correct=0.5")
    check(prompts, tmp_path, "--rm-type", "remote_rm", "--rm-url", "http://127.0.0.1:1")  # its service decides
    # a row routed to a reward of several components by its own rm_type, with no key for it
    routed = tmp_path / "routed.jsonl"
    routed.write_text('{"input": "a cat", "metadata": {"rm_type": "brightness,jpeg_compressibility"}}\n')
    assert error(str(routed), tmp_path, "--rm-type", "brightness") == (
        f"--prompt-data {routed}:1's metadata.rm_type brightness,jpeg_compressibility gives 2 reward components per "
        "sample (brightness, jpeg_compressibility): set --reward-weights (e.g. brightness=1,jpeg_compressibility=1) or "
        "--reward-key (one of them)")
    check(str(routed), tmp_path, "--rm-type", "brightness", "--reward-key", "brightness")


def test_an_image_larger_than_the_checkpoint_makes_is_one_line(prompts, tmp_path):
    from miles.tasks.shapes import PRETRAINED_SD3

    flags = ("--hf-checkpoint", PRETRAINED_SD3, "--diffusion-height", "64", "--diffusion-width")
    check(prompts, tmp_path, *flags, "64")  # the base's 16 patches of 2 latents of 2 px a side
    assert error(prompts, tmp_path, *flags, "80") == (
        f"--diffusion-width 80 is larger than --hf-checkpoint {PRETRAINED_SD3!r} can make: at most 64 px a side "
        "(its transformer's position table)")


@pytest.mark.parametrize("flags, message", [
    (("--diffusion-height", "8192"), "--diffusion-height 8192 exceeds the engines' --sglang-max-image-size 4096"),
    (("--sglang-max-image-size", "256"), "--diffusion-height 512 exceeds the engines' --sglang-max-image-size 256"),
    (("--sglang-max-num-steps", "4"), "exceeds the engines' --sglang-max-num-steps 4"),
    (("--rollout-microgroup-size", "2", "--sglang-max-samples-per-request", "1"), "--rollout-microgroup-size 2"),
    (("--sglang-max-request-pixel-steps", "1000"), "over the engines' --sglang-max-request-pixel-steps 1000"),
])
def test_the_run_geometry_must_fit_the_engine_limits(prompts, tmp_path, flags, message):
    with pytest.raises(MilesUserError) as info:
        parse_args(argv(prompts, tmp_path, *flags))
    assert message in str(info.value)
