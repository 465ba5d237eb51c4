"""Checkpoints (DCP) and the LoRA export: bitwise resume, atomic pointer, flags, diffusers-loadable adapters."""

from __future__ import annotations

import errno
import os
import pickle
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from miles.backends.fsdp_utils import checkpoint
from miles.backends.fsdp_utils.actor import DiffusionTrainer
from miles.backends.fsdp_utils.checkpoint import (
    POINTER_FILE,
    export_lora,
    read_latest_iteration,
    save_checkpoint,
)
from miles.backends.fsdp_utils.spawn import free_port, init_distributed
from miles.testing.tiny_rollout import load_tiny_family, make_rollout_samples, tiny_trainer_config, trained_state
from miles.types import GuidanceConfig
from miles.testing.payloads import RunsCode, swap_dcp_index_before_load
from miles.utils.errors import MilesUserError

NFT_SETTINGS = dict(
    loss_type="nft",
    use_lora=True,
    use_ema=True,
    micro_batch_size=3,
    num_rollout=3,
    lr_decay_style="cosine",
    lr_warmup_iters=1,
    lr_warmup_init=1e-3,
)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    torch.set_num_threads(1)
    init_distributed(0, 1, "gloo", free_port())
    args = tiny_trainer_config(tiny_checkpoint("sd3"))
    family, pipe = load_tiny_family(args)
    samples = make_rollout_samples(family, pipe, args, ["a red cube", "two cats"], 2, [1, 2], seed=5)
    yield args.model.hf_checkpoint, family, pipe, samples
    dist.destroy_process_group()


def make_trainer(tiny, **overrides) -> DiffusionTrainer:
    trainer = DiffusionTrainer(tiny_trainer_config(tiny[0], **overrides), tiny[1])
    trainer.start_rollout_id = trainer.init()
    return trainer


def snapshot(trainer) -> dict:
    optimizer = {
        f"{name}.{key}": value.full_tensor().clone() if hasattr(value, "full_tensor") else torch.as_tensor(value).clone()
        for (name, param) in trainer.trainable
        for key, value in trainer.optimizer.state[param].items()
    }
    ema = {name: t.full_tensor().clone() for name, t in trainer.ema.shadow_tensors().items()} if trainer.ema else {}
    return {"model": trained_state(trainer), "optimizer": optimizer, "ema": ema, "lr_steps": trainer.lr_scheduler.num_steps}


def assert_bitwise(a: dict, b: dict, parts=("model", "optimizer", "ema")) -> None:
    assert a["lr_steps"] == b["lr_steps"]
    for part in parts:
        assert a[part].keys() == b[part].keys() and a[part], part
        for name in a[part]:
            assert torch.equal(a[part][name], b[part][name]), f"{part}:{name}"


def test_save_load_continue_equals_uninterrupted_training(tiny, tmp_path):
    samples = tiny[3]
    save_dir = str(tmp_path / "ckpt")
    straight = make_trainer(tiny, **NFT_SETTINGS, save=save_dir)
    straight.train(0, samples)
    save_checkpoint(straight, 0, extra_state={"data_position": 4})
    rng_at_save = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    metrics_straight = straight.train(1, samples)
    assert read_latest_iteration(save_dir) == 0 and sorted(os.listdir(save_dir)) == ["iter_0000000", POINTER_FILE]

    torch.manual_seed(999), np.random.seed(999), random.seed(999)  # a fresh process would have other RNG states
    resumed = make_trainer(tiny, **NFT_SETTINGS, load=save_dir)
    assert resumed.start_rollout_id == 1 and resumed.loaded_extra_state == {"data_position": 4}
    assert torch.equal(torch.get_rng_state(), rng_at_save[0])
    assert np.array_equal(np.random.get_state()[1], rng_at_save[1]) and random.getstate() == rng_at_save[2]
    assert resumed.ema.num_updates == 1 and resumed.global_step == straight.global_step - 1
    metrics_resumed = resumed.train(1, samples)
    assert metrics_resumed["train/loss"] == metrics_straight["train/loss"]
    assert metrics_resumed["train/lr"] == metrics_straight["train/lr"]
    assert_bitwise(snapshot(straight), snapshot(resumed))


def test_full_parameter_policy_loss_resume_equals_uninterrupted_training(tiny, tmp_path):
    # The first rollout a trainer process runs also counts FLOPs: the uninterrupted run counts rollout 0, the
    # resumed one rollout 1. Counting must leave that rollout's gradients bitwise unchanged.
    samples = tiny[3]
    settings = dict(loss_type="policy_loss", lr=2e-2, micro_batch_size=4, num_rollout=3, diffusion_clip_range=1e-2)
    save_dir = str(tmp_path / "ckpt")
    straight = make_trainer(tiny, **settings, save=save_dir)
    straight.train(0, samples)
    save_checkpoint(straight, 0)
    metrics_straight = [straight.train(rollout_id, samples) for rollout_id in (1, 2)]

    resumed = make_trainer(tiny, **settings, load=save_dir)
    assert resumed.start_rollout_id == 1 and resumed.flops_per_pair is None
    metrics_resumed = [resumed.train(rollout_id, samples) for rollout_id in (1, 2)]
    assert resumed.flops_per_pair == straight.flops_per_pair > 0
    for key in ("train/loss", "train/grad_norm", "train/lr"):
        assert [m[key] for m in metrics_resumed] == [m[key] for m in metrics_straight], key
    assert_bitwise(snapshot(straight), snapshot(resumed), parts=("model", "optimizer"))


def test_a_failed_save_is_one_line_and_leaves_the_pointer_on_the_last_complete_checkpoint(tiny, tmp_path,
                                                                                           monkeypatch):
    save_dir = str(tmp_path / "ckpt")
    trainer = make_trainer(tiny, use_lora=True, save=save_dir, micro_batch_size=4)
    trainer.train(0, tiny[3])
    save_checkpoint(trainer, 0)

    written = []

    def disk_full(value, path, what):  # the meta and RNG writer: the disk fills up after the DCP shards
        written.append(path)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "save_plain", disk_full)
        with pytest.raises(MilesUserError) as info:
            save_checkpoint(trainer, 1)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"--save {save_dir!r}: saving the checkpoint of rollout 1")
    assert "No space left on device [ENOSPC]" in message and written[0] in message
    assert f"{POINTER_FILE} still names iter_0000000" in message
    assert read_latest_iteration(save_dir) == 0
    assert sorted(os.listdir(save_dir)) == ["iter_0000000", POINTER_FILE]  # the half-written folder is gone
    resumed = make_trainer(tiny, use_lora=True, load=save_dir)
    assert resumed.start_rollout_id == 1
    save_checkpoint(trainer, 1)
    assert read_latest_iteration(save_dir) == 1
    assert sorted(os.listdir(save_dir)) == ["iter_0000000", "iter_0000001", POINTER_FILE]


def test_a_crash_mid_save_leaves_the_pointer_on_the_last_complete_checkpoint(tiny, tmp_path, monkeypatch):
    """A process killed mid-save (simulated: the temp folder stays) never moves the pointer; the next save
    replaces the stale temp folder."""
    save_dir = str(tmp_path / "ckpt")
    trainer = make_trainer(tiny, use_lora=True, save=save_dir, micro_batch_size=4)
    save_checkpoint(trainer, 0)
    os.makedirs(os.path.join(save_dir, "iter_0000001.tmp", "rng"))
    with open(os.path.join(save_dir, "iter_0000001.tmp", "__0_0.distcp"), "wb") as handle:
        handle.write(b"half")
    assert read_latest_iteration(save_dir) == 0 and make_trainer(tiny, use_lora=True, load=save_dir)
    save_checkpoint(trainer, 1)
    assert sorted(os.listdir(save_dir)) == ["iter_0000000", "iter_0000001", POINTER_FILE]


def test_save_keep_latest_keeps_the_newest_checkpoints(tiny, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    trainer = make_trainer(tiny, use_lora=True, save=save_dir, save_keep_latest=2)
    for rollout_id in range(4):
        save_checkpoint(trainer, rollout_id)
    assert sorted(os.listdir(save_dir)) == ["iter_0000002", "iter_0000003", POINTER_FILE]
    save_checkpoint(trainer, 1)  # a resumed run saving below newer ones keeps what it just wrote
    assert sorted(os.listdir(save_dir)) == ["iter_0000001", "iter_0000002", "iter_0000003", POINTER_FILE]
    assert read_latest_iteration(save_dir) == 1


def test_full_model_checkpoint_and_load_flags(tiny, tmp_path, caplog):
    save_dir = str(tmp_path / "full")
    trainer = make_trainer(tiny, save=save_dir, micro_batch_size=4, lr_decay_style="linear", num_rollout=4)
    trainer.train(0, tiny[3])
    save_checkpoint(trainer, 0)
    trainer.train(1, tiny[3])
    trainer.config = trainer.config.replace(no_save_optim=True)
    save_checkpoint(trainer, 1)
    state = trained_state(trainer)

    at_step_0 = make_trainer(tiny, load=save_dir, ckpt_step=0, lr_decay_style="linear", num_rollout=4)
    assert at_step_0.start_rollout_id == 1 and at_step_0.lr_scheduler.num_steps == 1
    assert at_step_0.optimizer.state  # Adam moments came back

    caplog.clear()
    latest = make_trainer(tiny, load=save_dir, lr_decay_style="linear", num_rollout=4)
    assert latest.start_rollout_id == 2 and "--no-save-optim" in caplog.text
    assert not latest.optimizer.state and latest.lr_scheduler.num_steps == 0
    assert all(torch.equal(state[n], t) for n, t in trained_state(latest).items())

    skip = make_trainer(tiny, load=save_dir, ckpt_step=0, no_load_optim=True)
    assert not skip.optimizer.state and skip.lr_scheduler.num_steps == 0

    override = make_trainer(tiny, load=save_dir, ckpt_step=0, lr=5e-3, override_lr_scheduler=True)
    assert override.lr_scheduler.max_lr == 5e-3 and override.lr_scheduler.num_steps == 1
    kept = make_trainer(tiny, load=save_dir, ckpt_step=0, lr=5e-3)
    assert kept.lr_scheduler.max_lr == 1e-2

    empty = str(tmp_path / "empty")
    assert make_trainer(tiny, load=empty, save=empty).start_rollout_id == 0  # --load = --save: resume if present
    with pytest.raises(MilesUserError, match="no such folder"):
        make_trainer(tiny, load=empty)
    with pytest.raises(MilesUserError, match="iter_0000007: no such folder"):
        make_trainer(tiny, load=save_dir, ckpt_step=7)
    with pytest.raises(MilesUserError, match="use_lora=False"):
        make_trainer(tiny, load=save_dir, use_lora=True)
    with pytest.raises(MilesUserError, match="needs --save"):
        save_checkpoint(make_trainer(tiny), 0)


def test_exported_lora_loads_into_diffusers_and_reproduces_the_trainer(tiny, tmp_path):
    checkpoint_path, family, _, samples = tiny
    trainer = make_trainer(tiny, use_lora=True, lora_alpha=16, micro_batch_size=4)
    trainer.train(0, samples)
    trainer.train(1, samples)
    export_lora(trainer, str(tmp_path / "adapter"))
    assert os.path.exists(tmp_path / "adapter" / "pytorch_lora_weights.safetensors")

    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(checkpoint_path, dtype=torch.float32)
    pipe.load_lora_weights(str(tmp_path / "adapter"))
    sample = samples[2]
    latents = torch.stack([sample.latents[1], samples[0].latents[2]])
    sigmas = torch.stack([sample.sigmas[1], samples[0].sigmas[2]])
    conditioning = {k: torch.stack([sample.conditioning[k], samples[0].conditioning[k]]) for k in sample.conditioning}
    guidance = GuidanceConfig(4.0)
    with torch.no_grad():
        ours = trainer.velocity(latents, sigmas, conditioning, guidance)
        theirs = family.predict_velocity(
            {"transformer": pipe.transformer}, latents, sigmas, conditioning, guidance, trainer.shape, torch.float32
        )
        base = family.predict_velocity(
            {"transformer": tiny[2].transformer}, latents, sigmas, conditioning, guidance, trainer.shape, torch.float32
        )
    assert (ours - base).abs().max() > 1e-4  # the adapter changed the model
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)
    with pytest.raises(MilesUserError, match="--use-lora"):
        export_lora(make_trainer(tiny), str(tmp_path / "nothing"))


# ---- nothing in a checkpoint runs code; a damaged one is one line naming the file --------------------------
@pytest.fixture()
def saved(tiny, tmp_path):
    """A complete checkpoint (rollout 0) of a LoRA trainer, and a factory of trainers resuming from it."""
    save_dir = str(tmp_path / "ckpt")
    trainer = make_trainer(tiny, use_lora=True, save=save_dir, micro_batch_size=4)
    save_checkpoint(trainer, 0, extra_state={"data_source": {"epoch": 0, "offset": 2}})
    return save_dir, os.path.join(save_dir, "iter_0000000"), lambda **kw: make_trainer(tiny, use_lora=True,
                                                                                       load=save_dir, **kw)


def one_line_error(resume) -> str:
    with pytest.raises(MilesUserError) as info:
        resume()
    assert "\n" not in str(info.value)
    return str(info.value)


def test_an_edited_meta_with_a_reduce_payload_does_not_run(saved, tmp_path):
    save_dir, directory, resume = saved
    meta_path = os.path.join(directory, "meta.pt")
    meta = torch.load(meta_path, weights_only=True)
    marker = str(tmp_path / "payload-ran")
    torch.save({**meta, "extra_state": RunsCode(marker)}, meta_path)
    message = one_line_error(resume)
    assert message.startswith(f"--load checkpoint meta: refusing to load {meta_path} with weights_only=True")
    assert "it holds io.open" in message  # the payload's callable, named and refused
    assert not os.path.exists(marker)


def test_an_edited_shard_index_with_a_reduce_payload_does_not_run(saved, tmp_path):
    _, directory, resume = saved
    marker = str(tmp_path / "payload-ran")
    index_path = os.path.join(directory, ".metadata")
    with open(index_path, "wb") as handle:
        pickle.dump(RunsCode(marker), handle)
    message = one_line_error(resume)
    assert f"refusing to load {index_path}: it refers to io.open" in message
    assert not os.path.exists(marker)


def rewrite_index(directory: str, edit) -> None:
    """Rewrite the checkpoint's own (trusted, just written) index after `edit(index)` changed it."""
    index_path = os.path.join(directory, ".metadata")
    with open(index_path, "rb") as handle:
        index = pickle.load(handle)
    edit(index)
    with open(index_path, "wb") as handle:
        pickle.dump(index, handle)


def test_an_index_of_none_does_not_fall_back_to_an_unchecked_rank_local_index(saved, tmp_path):
    """A `.metadata` that unpickles to None used to pass the allow-list; DCP then read `__0.metadata` with plain
    pickle."""
    _, directory, resume = saved
    marker = str(tmp_path / "payload-ran")
    with open(os.path.join(directory, ".metadata"), "wb") as handle:
        pickle.dump(None, handle)
    with open(os.path.join(directory, "__0.metadata"), "wb") as handle:
        pickle.dump(RunsCode(marker), handle)
    message = one_line_error(resume)
    assert "holds a NoneType, not a checkpoint index" in message and not os.path.exists(marker)


def test_an_index_swapped_between_the_check_and_the_load_is_never_read(saved, tmp_path, monkeypatch):
    """The check-then-load race: the index is replaced after it was checked, just before DCP loads. DCP loads
    with the copy that was checked, so the payload never runs and the resume is the one that was checked."""
    _, directory, resume = saved
    marker = str(tmp_path / "payload-ran")
    swap_dcp_index_before_load(monkeypatch, directory, marker)
    try:
        trainer = resume()
    except BaseException:  # noqa: BLE001 - before the fix DCP unpickled the payload and then failed
        trainer = None
    assert not os.path.exists(marker)
    assert trainer is not None and trainer.start_rollout_id == 1


@pytest.mark.parametrize("shard_path", ["../outside/__0_0.distcp", "/ABS/__0_0.distcp", "sub/__0_0.distcp"])
def test_an_index_naming_shards_outside_the_checkpoint_folder_is_refused(saved, tmp_path, shard_path):
    _, directory, resume = saved
    shard_name = next(name for name in os.listdir(directory) if name.endswith(".distcp"))
    target = os.path.normpath(os.path.join(directory, shard_path.replace("/ABS", str(tmp_path / "abs"))))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(os.path.join(directory, shard_name), "rb") as source, open(target, "wb") as copy:
        copy.write(source.read())  # a valid shard, just not in the folder: loading it would succeed

    def point_outside(index):
        for info in index.storage_data.values():
            if info.relative_path == shard_name:
                info.relative_path = shard_path.replace("/ABS", str(tmp_path / "abs"))

    rewrite_index(directory, point_outside)
    assert "is not a shard file name inside the checkpoint folder" in one_line_error(resume)


def test_a_shard_that_is_a_link_is_refused(saved, tmp_path):
    _, directory, resume = saved
    shard = os.path.join(directory, next(name for name in os.listdir(directory) if name.endswith(".distcp")))
    outside = str(tmp_path / "elsewhere.distcp")
    os.rename(shard, outside)
    os.symlink(outside, shard)
    assert f"shard {shard} is not a regular file" in one_line_error(resume)


@pytest.mark.parametrize("key, value", [("lr_scheduler", 5), ("global_step", "a"), ("use_lora", "yes"),
                                        ("rollout_id", 1.5), ("world_size", True), ("extra_state", [1]),
                                        ("modules", "transformer"), ("lora", {"r": "4"})])
def test_meta_values_of_the_wrong_type_are_one_line(saved, key, value):
    _, directory, resume = saved
    meta_path = os.path.join(directory, "meta.pt")
    torch.save({**torch.load(meta_path, weights_only=True), key: value}, meta_path)
    message = one_line_error(resume)
    assert message.startswith(f"--load checkpoint meta {meta_path}: not a miles checkpoint meta") and key in message


def test_a_pointer_file_that_is_a_folder_or_garbage_is_one_line(saved):
    save_dir, _, resume = saved
    pointer = os.path.join(save_dir, POINTER_FILE)
    os.remove(pointer)
    os.mkdir(pointer)
    assert f"{pointer} is not a file" in one_line_error(resume)
    os.rmdir(pointer)
    with open(pointer, "wb") as handle:
        handle.write(b"9" * 100_000)
    assert "not an iteration number" in one_line_error(resume)


def test_a_damaged_checkpoint_is_one_line_naming_the_file(saved):
    save_dir, directory, resume = saved
    shards = sorted(name for name in os.listdir(directory) if name.endswith(".distcp"))
    shard = os.path.join(directory, shards[0])
    data = open(shard, "rb").read()
    with open(shard, "wb") as handle:  # a copy cut short
        handle.write(data[: len(data) // 2])
    assert f"shard {shard} is truncated ({len(data) // 2} bytes" in one_line_error(resume)
    os.remove(shard)
    assert f"incomplete checkpoint: shard {shard} is missing" in one_line_error(resume)
    with open(shard, "wb") as handle:
        handle.write(data)
    resume()  # restored: loads again
    meta = os.path.join(directory, "meta.pt")
    meta_bytes = open(meta, "rb").read()
    with open(meta, "wb") as handle:
        handle.write(meta_bytes[:40])
    assert f"--load checkpoint meta: {meta} is truncated or corrupt" in one_line_error(resume)
    os.remove(meta)
    assert f"{directory}: incomplete checkpoint: meta.pt is missing" in one_line_error(resume)
    os.remove(os.path.join(directory, ".metadata"))
    with open(meta, "wb") as handle:
        handle.write(meta_bytes)
    assert "the shard index .metadata is missing" in one_line_error(resume)


def test_an_edited_rng_state_is_refused_with_the_way_out(saved, tmp_path):
    _, directory, resume = saved
    rng = os.path.join(directory, "rng", "rank_0.pt")
    torch.save({"numpy": RunsCode(str(tmp_path / "payload-ran"))}, rng)
    message = one_line_error(resume)
    assert f"refusing to load {rng}" in message and message.endswith("--no-load-rng resumes without the RNG states")
    assert resume(no_load_rng=True).start_rollout_id == 1 and not os.path.exists(tmp_path / "payload-ran")


def test_a_checkpoint_of_another_family_or_lora_setting_is_refused(saved, tiny):
    save_dir, directory, resume = saved
    meta_path = os.path.join(directory, "meta.pt")
    meta = torch.load(meta_path, weights_only=True)
    assert meta["family"] == "sd3"
    torch.save({**meta, "family": "flux"}, meta_path)
    message = one_line_error(resume)
    assert f"--load {directory!r} holds model family 'flux', but this run trains 'sd3'" in message
    torch.save({**meta, "family": None}, meta_path)  # checkpoints from before the family was recorded
    assert resume().start_rollout_id == 1
    assert "use_lora=True" in one_line_error(lambda: make_trainer(tiny, load=save_dir))


def test_load_without_a_checkpoint(saved, tiny, tmp_path):
    save_dir, directory, _ = saved
    os.remove(os.path.join(save_dir, POINTER_FILE))
    message = one_line_error(lambda: make_trainer(tiny, use_lora=True, load=save_dir))
    assert f"no {POINTER_FILE}" in message and "pass --ckpt-step 0" in message
    assert make_trainer(tiny, use_lora=True, load=save_dir, ckpt_step=0).start_rollout_id == 1
    missing = str(tmp_path / "typo")
    assert "no such folder" in one_line_error(lambda: make_trainer(tiny, use_lora=True, load=missing))
    fresh = make_trainer(tiny, use_lora=True, load=missing, save=missing)  # --load = --save: resume if present
    assert fresh.start_rollout_id == 0 and fresh.loaded_extra_state is None


def test_a_state_that_would_need_the_unsafe_loader_fails_at_save(tiny, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    trainer = make_trainer(tiny, use_lora=True, save=save_dir)
    save_checkpoint(trainer, 0)
    with pytest.raises(MilesUserError) as info:
        save_checkpoint(trainer, 1, extra_state={"data_source": {"rows": [1, RunsCode("x")]}})
    message = str(info.value)
    assert "extra_state.data_source.rows[1]: an object of type " in message and "RunsCode" in message
    assert read_latest_iteration(save_dir) == 0 and sorted(os.listdir(save_dir)) == ["iter_0000000", POINTER_FILE]
