"""Export for inference (`python -m miles.export`, `--export-interval`): a checkpoint of a tiny SD3 run becomes a
diffusers LoRA adapter or a complete pipeline folder, and diffusers' own loaders reproduce the trainer's policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from miles.backends.fsdp_utils.actor import DiffusionTrainer
from miles.backends.fsdp_utils.checkpoint import save_checkpoint
from miles.backends.fsdp_utils import model_export
from miles.backends.fsdp_utils.model_export import (
    EXPORT_INFO_FILE,
    LORA_WEIGHTS_FILE,
    export_dir,
    export_from_trainer,
    lora_format_problem,
    should_export,
    stored_dtype,
)
from miles.backends.fsdp_utils.spawn import free_port, init_distributed
from miles.testing.tiny_rollout import load_tiny_family, make_rollout_samples, tiny_trainer_config
from miles.export import export_checkpoint
from miles.types import GuidanceConfig
from miles.testing.payloads import RunsCode, swap_dcp_index_before_load
from miles.utils.errors import MilesUserError

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5  # fp32: the exported model against the trainer's own forward


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    torch.set_num_threads(1)
    init_distributed(0, 1, "gloo", free_port())
    args = tiny_trainer_config(tiny_checkpoint("sd3"))
    family, pipe = load_tiny_family(args)
    samples = make_rollout_samples(family, pipe, args, ["a red cube", "two cats"], 2, [1, 2], seed=5)
    yield args.model.hf_checkpoint, family, pipe, samples
    dist.destroy_process_group()


def train_one_rollout_and_save(tiny, save_dir: str, **settings) -> DiffusionTrainer:
    trainer = DiffusionTrainer(tiny_trainer_config(tiny[0], save=save_dir, micro_batch_size=4, **settings), tiny[1])
    trainer.init()
    trainer.train(0, tiny[3])
    save_checkpoint(trainer, 0)
    return trainer


def policy_inputs(samples):
    """Two recorded states of different samples and steps, with their conditioning (CFG on)."""
    latents = torch.stack([samples[2].latents[1], samples[0].latents[2]])
    sigmas = torch.stack([samples[2].sigmas[1], samples[0].sigmas[2]])
    conditioning = {k: torch.stack([samples[2].conditioning[k], samples[0].conditioning[k]])
                    for k in samples[0].conditioning}
    return latents, sigmas, conditioning, GuidanceConfig(4.0)


@torch.no_grad()
def trainer_output(trainer, samples) -> torch.Tensor:
    return trainer.velocity(*policy_inputs(samples))


@torch.no_grad()
def pipeline_output(family, trainer, pipe, samples) -> torch.Tensor:
    latents, sigmas, conditioning, guidance = policy_inputs(samples)
    return family.predict_velocity({"transformer": pipe.transformer}, latents, sigmas, conditioning, guidance,
                                   trainer.shape, torch.float32)


def assert_same_policy(exported: torch.Tensor, trainer: torch.Tensor, base: torch.Tensor) -> None:
    assert (trainer - base).abs().max() > 1e-4  # one rollout of training moved the policy
    assert (exported - trainer).abs().max() <= TOLERANCE


def test_lora_run_exports_an_adapter_and_a_merged_pipeline(tiny, tmp_path):
    from diffusers import DiffusionPipeline, StableDiffusion3Pipeline

    base_path, family, base_pipe, samples = tiny
    save_dir = str(tmp_path / "ckpt")
    trainer = train_one_rollout_and_save(tiny, save_dir, use_lora=True, lora_alpha=16)
    want = trainer_output(trainer, samples)
    base = pipeline_output(family, trainer, base_pipe, samples)

    adapter = str(tmp_path / "adapter")
    assert export_checkpoint(["--load", save_dir, "--out", adapter]) == "lora"
    assert sorted(os.listdir(adapter)) == [EXPORT_INFO_FILE, LORA_WEIGHTS_FILE]
    info = json.loads(Path(adapter, EXPORT_INFO_FILE).read_text())
    assert info["base"] == os.path.abspath(base_path) and info["lora"]["lora_alpha"] == 16
    pipe = StableDiffusion3Pipeline.from_pretrained(base_path, dtype=torch.float32)
    pipe.load_lora_weights(adapter)
    assert_same_policy(pipeline_output(family, trainer, pipe, samples), want, base)

    merged = str(tmp_path / "merged")
    assert export_checkpoint(["--load", save_dir, "--ckpt-step", "0", "--merge", "--out", merged]) == "pipeline"
    pipe = DiffusionPipeline.from_pretrained(merged, dtype=torch.float32)
    assert type(pipe).__name__ == "StableDiffusion3Pipeline"
    assert not any("lora" in name for name, _ in pipe.transformer.named_parameters())  # merged: a plain model
    assert_same_policy(pipeline_output(family, trainer, pipe, samples), want, base)
    for untrained in ("vae", "text_encoder", "tokenizer_3", "scheduler"):  # copied from the base, not linked
        for file_name in os.listdir(Path(base_path, untrained)):
            copy = Path(merged, untrained, file_name)
            assert copy.read_bytes() == Path(base_path, untrained, file_name).read_bytes()
            assert copy.stat().st_nlink == 1


def test_full_fine_tune_exports_a_pipeline_and_ema_on_request(tiny, tmp_path):
    from diffusers import DiffusionPipeline

    base_path, family, base_pipe, samples = tiny
    save_dir = str(tmp_path / "ckpt")
    trainer = train_one_rollout_and_save(tiny, save_dir, loss_type="nft", use_ema=True, lr=5e-3,
                                         ema_decay_init=0.5, ema_decay_flat_steps=1)  # θ̄ = (θ0 + θ1) / 2
    base = pipeline_output(family, trainer, base_pipe, samples)

    live = str(tmp_path / "live")
    assert export_checkpoint(["--load", save_dir, "--out", live]) == "pipeline"
    pipe = DiffusionPipeline.from_pretrained(live, dtype=torch.float32)
    assert_same_policy(pipeline_output(family, trainer, pipe, samples), trainer_output(trainer, samples), base)
    assert json.loads(Path(live, EXPORT_INFO_FILE).read_text())["dtype"] == {"transformer": "float32"}

    ema = str(tmp_path / "ema")
    export_checkpoint(["--load", os.path.join(save_dir, "iter_0000000"), "--ema", "--out", ema])
    pipe = DiffusionPipeline.from_pretrained(ema, dtype=torch.float32)
    with trainer.ema.swapped():
        want = trainer_output(trainer, samples)
    assert_same_policy(pipeline_output(family, trainer, pipe, samples), want, base)
    assert (want - trainer_output(trainer, samples)).abs().max() > 1e-5  # θ̄ is not the live policy

    half = str(tmp_path / "bf16")
    export_checkpoint(["--load", save_dir, "--out", half, "--dtype", "bf16"])
    assert stored_dtype(os.path.join(half, "transformer")) == torch.bfloat16
    assert stored_dtype(os.path.join(half, "vae")) == torch.float32  # untrained components stay as they were


def test_export_mistakes_are_one_line_naming_the_flag_and_file(tiny, tmp_path):
    from diffusers import DiffusionPipeline

    base_path, family, base_pipe, samples = tiny
    save_dir = str(tmp_path / "ckpt")
    trainer = train_one_rollout_and_save(tiny, save_dir, use_lora=True)
    directory = os.path.join(save_dir, "iter_0000000")

    def error(*argv: str) -> str:
        with pytest.raises(MilesUserError) as info:
            export_checkpoint(list(argv))
        assert "\n" not in str(info.value)
        return str(info.value)

    assert error("--load", save_dir, "--ema", "--out", str(tmp_path / "x")) == (
        f"--ema: the checkpoint {directory} holds no EMA weights (the run had no --use-ema)")
    typo = str(tmp_path / "typo")
    assert error("--load", typo, "--out", str(tmp_path / "x")) == f"--load {typo!r}: no such folder"
    assert "iter_0000004: no such folder" in error("--load", save_dir, "--ckpt-step", "4", "--out", str(tmp_path / "x"))
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    assert error("--load", save_dir, "--out", str(occupied)) == (
        f"--out {str(occupied)!r} already exists and is not an empty folder; remove it or choose another")
    assert (occupied / "notes.txt").read_text() == "mine"

    meta_path = os.path.join(directory, "meta.pt")
    meta = torch.load(meta_path, weights_only=True)
    # a checkpoint of an older version: no base pipeline and no LoRA settings recorded (the run had alpha 8)
    torch.save({**meta, "hf_checkpoint": None, "lora": None}, meta_path)
    assert error("--load", save_dir, "--out", str(tmp_path / "adapter")) == (
        f"--lora-alpha: the checkpoint {directory} predates recorded LoRA settings in meta.pt; pass the run's "
        "--lora-alpha (rank and targets are read off the adapter)")
    adapter = str(tmp_path / "adapter")
    assert export_checkpoint(["--load", save_dir, "--lora-alpha", "8", "--out", adapter]) == "lora"  # needs no base
    written = json.loads(Path(adapter, EXPORT_INFO_FILE).read_text())["lora"]
    assert written["r"] == 4 and written["lora_alpha"] == 8
    assert "transformer_blocks.0.attn.to_q" in written["target_modules"]
    assert error("--load", save_dir, "--lora-alpha", "8", "--merge", "--out", str(tmp_path / "merged")).startswith(
        "--hf-checkpoint: the checkpoint does not record the base pipeline")
    assert not (tmp_path / "merged").exists() and not (tmp_path / "merged.tmp").exists()
    not_a_pipeline = str(tmp_path / "occupied")
    assert error("--load", save_dir, "--lora-alpha", "8", "--merge", "--hf-checkpoint", not_a_pipeline,
                 "--out", str(tmp_path / "m")) == (
        f"--hf-checkpoint {not_a_pipeline!r}: no model_index.json, not a diffusers pipeline folder")
    export_checkpoint(["--load", save_dir, "--lora-alpha", "8", "--merge", "--hf-checkpoint", base_path,
                       "--out", str(tmp_path / "merged")])
    pipe = DiffusionPipeline.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    assert_same_policy(pipeline_output(family, trainer, pipe, samples), trainer_output(trainer, samples),
                       pipeline_output(family, trainer, base_pipe, samples))


def test_export_reads_no_unchecked_index_and_no_shard_outside_the_checkpoint(tiny, tmp_path, monkeypatch):
    import pickle

    import torch.distributed.checkpoint as dcp

    save_dir = str(tmp_path / "ckpt")
    train_one_rollout_and_save(tiny, save_dir, use_lora=True)
    directory = os.path.join(save_dir, "iter_0000000")
    index_path = os.path.join(directory, ".metadata")
    index_bytes = open(index_path, "rb").read()
    marker = str(tmp_path / "payload-ran")

    def export(out: str):
        try:
            return export_checkpoint(["--load", save_dir, "--out", str(tmp_path / out)])
        except BaseException as err:  # noqa: BLE001 - what matters is that nothing ran; the message is checked
            return err

    # the index swapped for a payload between the check and DCP's load: DCP loads with the checked copy
    real_load = dcp.load
    swap_dcp_index_before_load(monkeypatch, directory, marker)
    assert export("raced") == "lora" and not os.path.exists(marker)
    monkeypatch.setattr(dcp, "load", real_load)

    # an index of None with a payload as the rank-local index
    with open(index_path, "wb") as handle:
        pickle.dump(None, handle)
    result = export("none")
    assert isinstance(result, MilesUserError) and "not a checkpoint index" in str(result)
    assert not os.path.exists(marker)

    # a shard outside the checkpoint folder
    index = pickle.loads(index_bytes)
    shard_name = next(iter(index.storage_data.values())).relative_path
    os.makedirs(tmp_path / "outside")
    with open(os.path.join(directory, shard_name), "rb") as source, open(tmp_path / "outside" / shard_name, "wb") as f:
        f.write(source.read())
    for info in index.storage_data.values():
        info.relative_path = f"../../outside/{info.relative_path}"
    with open(index_path, "wb") as handle:
        pickle.dump(index, handle)
    result = export("outside")
    assert isinstance(result, MilesUserError) and "not a shard file name inside the checkpoint folder" in str(result)


def test_export_interval_writes_the_served_policy_during_training(tiny, tmp_path):
    args = tiny_trainer_config("unused", num_rollout=8, export_interval=3, output_dir=str(tmp_path / "out"))
    assert [r for r in range(8) if should_export(args, r)] == [2, 5, 7]  # every 3 rollouts and the last one
    assert export_dir(args, 5) == str(tmp_path / "out" / "export" / "iter_0000005")
    args = args.replace(export_interval=None)
    assert not any(should_export(args, r) for r in range(8))

    from diffusers import StableDiffusion3Pipeline

    base_path, family, base_pipe, samples = tiny
    trainer = train_one_rollout_and_save(tiny, str(tmp_path / "ckpt"), use_lora=True, lora_alpha=16)
    out = str(tmp_path / "out" / "export" / "iter_0000000")
    assert export_from_trainer(trainer, out, 0) == "lora"
    assert export_from_trainer(trainer, out, 0) == "lora"  # a resumed run exporting the same rollout again
    pipe = StableDiffusion3Pipeline.from_pretrained(base_path, dtype=torch.float32)
    pipe.load_lora_weights(out)
    base = pipeline_output(family, trainer, base_pipe, samples)
    assert_same_policy(pipeline_output(family, trainer, pipe, samples), trainer_output(trainer, samples), base)


def test_where_the_lora_format_cannot_hold_the_adapter_training_exports_merge(tiny, tmp_path, monkeypatch, caplog):
    from diffusers import DiffusionPipeline

    assert lora_format_problem("StableDiffusion3Pipeline", ["transformer"]) is None
    assert "cannot save LoRA weights" in lora_format_problem("Cosmos3OmniPipeline", ["transformer"])
    assert "no adapter for ['transformer_2']" in lora_format_problem("WanPipeline", ["transformer", "transformer_2"])

    base_path, family, base_pipe, samples = tiny
    trainer = train_one_rollout_and_save(tiny, str(tmp_path / "ckpt"), use_lora=True)
    monkeypatch.setattr(model_export, "lora_format_problem", lambda *a: "a family without a LoRA format")
    out = str(tmp_path / "export")
    assert export_from_trainer(trainer, out, 0) == "pipeline"
    assert "--export-interval: a family without a LoRA format; exporting a merged pipeline instead" in caplog.text
    pipe = DiffusionPipeline.from_pretrained(out, dtype=torch.float32)
    assert_same_policy(pipeline_output(family, trainer, pipe, samples), trainer_output(trainer, samples),
                       pipeline_output(family, trainer, base_pipe, samples))
    with pytest.raises(MilesUserError, match="a family without a LoRA format; export with --merge for a complete "
                                             "pipeline instead"):
        export_checkpoint(["--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "adapter")])


def test_the_command_line_needs_no_ray_no_gpu_and_fails_in_one_line(tiny, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    train_one_rollout_and_save(tiny, save_dir, use_lora=True)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        env.pop(name, None)
    check_no_ray = ("import sys, miles.export as e; e.main(sys.argv[1:]); "
                    "assert 'ray' not in sys.modules, 'the export imported ray'")
    out = str(tmp_path / "adapter")
    done = subprocess.run([sys.executable, "-c", check_no_ray, "--load", save_dir, "--out", out],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"to {out}, a LoRA adapter" in done.stdout and os.path.isfile(os.path.join(out, LORA_WEIGHTS_FILE))
    failed = subprocess.run([sys.executable, "-m", "miles.export", "--load", save_dir, "--ema", "--out", out + "2"],
                            capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert failed.returncode == 2
    assert failed.stderr.strip().splitlines() == [
        f"error: --ema: the checkpoint {os.path.join(save_dir, 'iter_0000000')} holds no EMA weights (the run had "
        "no --use-ema)"]
