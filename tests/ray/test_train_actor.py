"""TrainActorGroup: two gloo ranks as Ray actors on CPU, against a one-rank trainer in this process.

One Ray cluster and one actor group per file: DP = 2 equals DP = 1 (weights, metrics), a two-rank
checkpoint resumes, the LoRA export loads, `--export-interval` writes the gathered adapter, and a weight push
reaches a live engine bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest
import ray
import torch
import torch.distributed as dist

from miles.backends.fsdp_utils.actor import DiffusionTrainer
from miles.backends.fsdp_utils.checkpoint import read_latest_iteration
from miles.backends.fsdp_utils.spawn import free_port, init_distributed
from miles.testing.tiny_rollout import (
    load_tiny_family,
    make_rollout_samples,
    tiny_trainer_config,
    trained_state,
)
from miles.backends.fsdp_utils.weight_export import is_lora_param, strip_peft_name
from miles.config.arguments import build_parser
from miles.ray.train_actor import TrainActorGroup
from miles.utils.auth import auth_headers
from miles.utils.errors import MilesUserError, PartDiedError

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    torch.set_num_threads(1)
    save_dir = str(tmp_path_factory.mktemp("ckpt"))
    args = tiny_trainer_config(
        tiny_checkpoint("sd3"),
        use_lora=True,
        num_rollout=2,
        micro_batch_size=1,
        save=save_dir,
        train_env_vars='{"OMP_NUM_THREADS": "1", "MILES_TEST_MARKER": "set"}',
    )
    family, pipe = load_tiny_family(args)
    samples = make_rollout_samples(family, pipe, args, ["a red cube", "two cats"], 2, [1, 2], seed=5)
    ray.init(address="local", num_cpus=3, num_gpus=0, include_dashboard=False, log_to_driver=False)
    group = TrainActorGroup(args, None, world_size=2)
    assert group.init() == 0
    init_distributed(0, 1, "gloo", free_port())
    yield args, family, samples, group
    group.kill()  # not shutdown(): the last test kills a rank
    ray.shutdown()
    dist.destroy_process_group()


def _listening_addresses(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} write them) of the sockets listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as handle:
            for line in handle.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.append(address)
    return found


def test_the_rendezvous_of_a_one_node_group_listens_on_loopback_only(setup):
    """The store torch's env:// rendezvous makes listens on every interface, and authenticates no one."""
    group = setup[3]
    host, port = group.rendezvous
    assert host == "127.0.0.1"
    assert _listening_addresses(port) == ["0100007F"]  # 127.0.0.1, and nothing on 0.0.0.0 or ::


def test_dp2_actor_group_equals_one_rank(setup):
    args, family, samples, group = setup
    single = DiffusionTrainer(args, family)
    single.init()
    for rollout_id in (0, 1):
        want = single.train(rollout_id, samples)
        got = group.train(rollout_id, samples)
        for key in ("train/loss", "train/log_prob_mean_abs_diff", "train/grad_norm", "train/clipfrac"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-9), key
    single_state = trained_state(single)
    group_state = group.named_tensors(lora_only=True)
    assert len(group_state) == len(single_state)
    for name, tensor in single_state.items():
        engine_name = name.replace(".default.", ".")
        torch.testing.assert_close(group_state[engine_name], tensor, rtol=1e-5, atol=1e-7)


def test_two_rank_checkpoint_and_lora_export(setup, tmp_path):
    args, family, samples, group = setup
    path = group.save(1, {"data_position": 17})
    assert path.endswith("iter_0000001") and read_latest_iteration(args.checkpoint.save) == 1
    resumed_args = tiny_trainer_config(args.model.hf_checkpoint, use_lora=True, num_rollout=2, load=args.checkpoint.save)
    resumed = DiffusionTrainer(resumed_args, family)  # one rank loads what two ranks saved
    assert resumed.init() == 2 and resumed.loaded_extra_state == {"data_position": 17}
    group_state = group.named_tensors(lora_only=True)
    for name, tensor in trained_state(resumed).items():
        torch.testing.assert_close(group_state[name.replace(".default.", ".")], tensor, rtol=0, atol=0)

    from diffusers import StableDiffusion3Pipeline

    group.export_lora(str(tmp_path / "lora"))
    pipe = StableDiffusion3Pipeline.from_pretrained(args.model.hf_checkpoint, dtype=torch.float32)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    pipe.fuse_lora()
    fused = {strip_peft_name(n): p for n, p in pipe.transformer.named_parameters() if not is_lora_param(n)}
    for name, tensor in group.named_tensors().items():
        torch.testing.assert_close(fused[name.split(".", 1)[1]], tensor, rtol=1e-6, atol=1e-6)


def test_export_interval_writes_the_adapter_of_both_ranks(setup, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    args, _, _, group = setup
    monkeypatch.setattr(group, "config", args.replace(export_interval=2, output_dir=str(tmp_path / "out")))
    assert group.export_if_due(0) is None  # not due: rollout 1 of 2 is the interval and the last one
    path = group.export_if_due(1)
    assert path == str(tmp_path / "out" / "export" / "iter_0000001")
    exported = load_file(f"{path}/pytorch_lora_weights.safetensors")
    gathered = group.named_tensors(lora_only=True)
    assert exported.keys() == gathered.keys()
    for name, tensor in gathered.items():
        assert torch.equal(exported[name], tensor), name


def test_weight_push_reaches_a_live_engine(setup, tmp_path):
    from miles.engine.launcher import launch_engine
    from miles.engine.server_args import ServerArgs
    from miles.engine.weight_sync import named_tensor_checksums

    args, _, _, group = setup
    engine = launch_engine(
        ServerArgs(model_path=args.model.hf_checkpoint, model_family="sd3", device="cpu", dtype="fp32", generator_device="cpu"),
        log_path=str(tmp_path / "engine.log"),
        startup_timeout=120,
    )
    def engine_json(path: str) -> dict:
        request = urllib.request.Request(f"{engine.url}{path}", headers=auth_headers())
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())

    try:
        # not colocated: rank 0 (a Ray actor) reaches the engine through a gloo broadcast group
        report = group.update_weights([engine.url], weight_version=5)
        assert report["num_tensors"] > 0 and report["broadcast_engines"] == 1 and report["ipc_engines"] == 0
        assert group.weight_sync_metrics["weight_sync/broadcast_engines"] == 1.0
        body = engine_json("/weights_checksum?per_tensor=1")
        assert body["weight_version"] == 5
        pushed = named_tensor_checksums(group.named_tensors().items(), per_tensor=True)["transformer"]
        engine_side = body["checksums"]["transformer"]
        assert pushed and all(engine_side[name] == digest for name, digest in pushed.items())
        # the group is built once and reused by the next push
        group_name = engine_json("/server_info")["weights_update_group"]["group_name"]
        group.update_weights([engine.url], weight_version=6)
        info = engine_json("/server_info")
        assert info["weight_version"] == 6 and info["weights_update_group"]["group_name"] == group_name
    finally:
        engine.stop()


def test_train_env_vars_reach_the_ranks_and_bad_json_is_refused(setup):
    group = setup[3]
    assert ray.get(group.actors[1].__ray_call__.remote(lambda actor: __import__("os").environ["MILES_TEST_MARKER"])) == "set"
    with pytest.raises(MilesUserError, match="--train-env-vars"):  # refused at parse time, by the flag's type
        build_parser().parse_args(["--train-env-vars", "{not json"])
    with pytest.raises(MilesUserError, match="JSON object"):
        build_parser().parse_args(["--train-env-vars", "[1, 2]"])


OOM_TEXT = ("CUDA out of memory. Tried to allocate 48.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which "
            "44.94 MiB is free. Process 584 has 518.00 MiB memory in use. Of the allocated memory 69.55 GiB is "
            "allocated by PyTorch, and 596.39 MiB is reserved by PyTorch but unallocated.")


def test_a_rank_out_of_gpu_memory_is_one_line_with_the_flags_that_help(setup):
    """torch's error as Ray delivers it from the ranks (wrapped, with the remote traceback) becomes one line:
    torch's numbers, the flags that lower the trainer's memory, how to resume. The ranks live on."""
    args, _, _, group = setup

    def run_out_of_memory(actor):  # a closure: Ray ships it by value (this test module is not importable there)
        raise torch.OutOfMemoryError(OOM_TEXT)

    with pytest.raises(PartDiedError) as info:
        group._gather("train", [actor.__ray_call__.remote(run_out_of_memory) for actor in group.actors])
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("trainer rank ") and "ran out of GPU memory during train() (CUDA out of memory. " \
        "Tried to allocate 48.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which 44.94 MiB is free)" in message
    assert "--micro-batch-size" in message and "--gradient-checkpointing" in message
    assert "--colocate-memory-margin-gb" in message  # a larger margin parks the optimizer state sooner
    assert message.endswith(f"rerun with --load {args.checkpoint.save} to resume from its last checkpoint")
    assert ray.get([actor.__ray_call__.remote(lambda actor: actor.rank) for actor in group.actors]) == [0, 1]


def test_a_dead_rank_ends_the_group_call_at_once_in_one_line(setup):
    """Last in the file: the group is broken afterwards. Rank 0 would wait for the dead rank 1 in a collective
    until --distributed-timeout-minutes; the call fails as soon as Ray reports rank 1's death instead."""
    args, _, samples, group = setup
    rank1 = ray.get(group.actors[1].__ray_call__.remote(lambda actor: os.getpid()))
    os.kill(rank1, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(PartDiedError) as info:
        group.train(2, samples)
    assert time.monotonic() - started < 60
    assert str(info.value) == (f"trainer rank 1 of 2 died during train() (its process was killed, ran out of memory "
                               f"or crashed); the run is stopped; rerun with --load {args.checkpoint.save} to resume from its "
                               f"last checkpoint")
