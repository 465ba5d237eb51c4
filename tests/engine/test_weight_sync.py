"""Weight sync into a running engine process through shared memory (the CPU path of CUDA IPC):
exact weights (checksums), outputs equal to a fresh engine loaded with the new weights (bitwise), LoRA merge
equal to the equivalent full update and replacing (not accumulating) the previous delta, and error paths."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request

import pytest
import torch
from torch import nn

from miles.engine.model_runner import ModelRunner
from miles.engine.protocol import GenerateRequest, ProtocolError, decode_response, encode_request
from miles.engine.weight_sync import (
    SharedBuffer,
    WeightReceiver,
    WeightSyncError,
    merge_lora_weight,
    named_tensor_checksums,
    push_weights,
)
from miles.engine.weight_sync_wire import (
    SharedMemoryRef,
    aligned_size,
    TensorEntry,
    UpdateMessage,
)
from miles.models.sd3 import SD3TrainPipelineConfig
from miles.types import GuidanceConfig
from miles.utils.auth import auth_headers

pytestmark = pytest.mark.timeout(150)

BUCKET_BYTES = 16 * 1024  # small: the tiny transformer travels in many buckets, some tensors alone
LORA_LAYERS = ("transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.add_k_proj")
LORA_RANK = 2


@pytest.fixture(scope="module")
def engine(sd3_engine):
    return sd3_engine


@pytest.fixture(scope="module")
def base_transformer(sd3_path):
    return SD3TrainPipelineConfig().load_modules(sd3_path, ["transformer"], torch.float32)["transformer"]


def _named(module, prefix="transformer"):
    # parameters: what a trainer syncs and what the checksum covers
    return [(f"{prefix}.{name}", tensor.detach().clone()) for name, tensor in module.named_parameters()]


def _perturbed(base, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return [(name, t + 0.05 * torch.randn(t.shape, generator=generator)) for name, t in _named(base)]


REQUEST = GenerateRequest(prompt="a tiny house", num_samples=2, seed=3, num_steps=3, height=32, width=32,
                          guidance=GuidanceConfig(4.0), sde_step_indices=[0, 1], return_latent_indices=[0, 1, 2])


def _generate(url: str):
    http = urllib.request.Request(f"{url}/rollout/generate", data=encode_request(REQUEST), method="POST",
                                  headers=auth_headers())
    with urllib.request.urlopen(http, timeout=60) as response:
        return decode_response(response.read())


def _engine_state(url: str) -> tuple[dict, int]:
    with urllib.request.urlopen(urllib.request.Request(f"{url}/weights_checksum", headers=auth_headers()),
                                timeout=60) as response:
        body = json.loads(response.read())
    return body["checksums"], body["weight_version"]


def _assert_identical(a, b):
    for x, y in zip(a.samples, b.samples):
        assert torch.equal(x.image, y.image)
        assert torch.equal(x.clean_latents, y.clean_latents)
        assert torch.equal(x.rollout_log_probs, y.rollout_log_probs)


def test_full_update_gives_exact_weights_and_a_fresh_engines_outputs(
    engine, base_transformer, sd3_path, tmp_path, make_server_args
):
    before = _generate(engine.url)
    new_weights = _perturbed(base_transformer, seed=1)
    def produced_slowly():  # as a trainer gathering its weights: the report counts that time apart
        for item in new_weights:
            time.sleep(0.002)
            yield item

    stats = push_weights([engine.url], produced_slowly(), bucket_bytes=BUCKET_BYTES, weight_version=1)
    assert stats["num_buckets"] > 3 and stats["num_tensors"] == len(new_weights)
    # the push's seconds split: producing the tensors, the engine's wait for its worker thread, its apply
    assert stats["gather_seconds"] >= 0.002 * len(new_weights) and stats["engine_apply_seconds"] > 0
    assert stats["engine_wait_seconds"] >= 0
    assert stats["gather_seconds"] + stats["engine_wait_seconds"] + stats["engine_apply_seconds"] < stats["seconds"]
    # two alternating buffers sized by the buckets, never above the bucket size unless one tensor is
    largest = max(tensor.numel() * tensor.element_size() for _, tensor in new_weights)
    assert stats["buffer_bytes"] <= 2 * max(BUCKET_BYTES, largest + 256)
    checksums, version = _engine_state(engine.url)
    assert version == 1 and stats["engine_weight_versions"] == [1]
    assert checksums == named_tensor_checksums(new_weights)
    updated = _generate(engine.url)
    assert updated.weight_version == 1
    assert not torch.equal(updated.samples[0].clean_latents, before.samples[0].clean_latents)

    # a fresh engine loaded from a checkpoint holding the new weights produces the same bits
    fresh_path = tmp_path / "updated"
    shutil.copytree(sd3_path, fresh_path)
    base_transformer_copy = SD3TrainPipelineConfig().load_modules(sd3_path, ["transformer"], torch.float32)["transformer"]
    base_transformer_copy.load_state_dict({name.partition(".")[2]: t for name, t in new_weights}, strict=False)
    base_transformer_copy.save_pretrained(fresh_path / "transformer")
    fresh = ModelRunner(make_server_args(str(fresh_path)))
    trajectory = fresh.start(REQUEST)
    while not trajectory.done:
        fresh.step([trajectory])
    _assert_identical(updated, fresh.finish(trajectory))

    # restoring the original weights restores the original outputs
    push_weights([engine.url], _named(base_transformer), bucket_bytes=BUCKET_BYTES, weight_version=2)
    _assert_identical(before, _generate(engine.url))


def _lora_pairs(base, seed: int, scale: float = 0.3):
    generator = torch.Generator().manual_seed(seed)
    state = base.state_dict()
    pairs = []
    for layer in LORA_LAYERS:
        out_features, in_features = state[f"{layer}.weight"].shape
        lora_a = scale * torch.randn(LORA_RANK, in_features, generator=generator)
        lora_b = scale * torch.randn(out_features, LORA_RANK, generator=generator)
        pairs.append((layer, lora_a, lora_b))
    return pairs


def _lora_named(pairs):
    # PEFT's naming, as the trainer exports it
    named = []
    for layer, lora_a, lora_b in pairs:
        named.append((f"transformer.base_model.model.{layer}.lora_A.default.weight", lora_a))
        named.append((f"transformer.base_model.model.{layer}.lora_B.default.weight", lora_b))
    return named


def _merged_full(base, pairs, scaling):
    state = {name: t.detach().clone() for name, t in base.named_parameters()}
    for layer, lora_a, lora_b in pairs:
        state[f"{layer}.weight"] = merge_lora_weight(state[f"{layer}.weight"], lora_a, lora_b, scaling)
    return [(f"transformer.{name}", t) for name, t in state.items()]


def test_lora_update_equals_the_equivalent_full_update_and_replaces_the_previous_delta(engine, base_transformer):
    scaling = 0.5
    push_weights([engine.url], _named(base_transformer), bucket_bytes=BUCKET_BYTES, weight_version=10)
    first = _lora_pairs(base_transformer, seed=7)
    push_weights([engine.url], _lora_named(first), bucket_bytes=1024, weight_version=11, lora=True,
                 lora_scaling=scaling)
    after_lora = _generate(engine.url)
    lora_checksums, version = _engine_state(engine.url)
    assert version == 11
    expected_first = _merged_full(base_transformer, first, scaling)
    assert lora_checksums == named_tensor_checksums(expected_first)

    # the second LoRA update replaces the first delta (W = W_base + s·B2@A2), it does not add to it
    second = _lora_pairs(base_transformer, seed=8)
    stats = push_weights([engine.url], _lora_named(second), bucket_bytes=512 << 20, weight_version=12, lora=True,
                         lora_scaling=scaling)
    # one bucket, and a buffer of its size: not the 512 MiB a bucket may hold (a GPU trainer's allocator keeps it)
    lora_bytes = sum(aligned_size(t.numel() * t.element_size()) for _, t in _lora_named(second))
    assert stats["num_buckets"] == 1 and stats["buffer_bytes"] == lora_bytes
    assert _engine_state(engine.url)[0] == named_tensor_checksums(_merged_full(base_transformer, second, scaling))

    # the equivalent full-weight update gives the same bits as the first LoRA update
    push_weights([engine.url], expected_first, bucket_bytes=BUCKET_BYTES, weight_version=13)
    assert _engine_state(engine.url)[0] == lora_checksums
    _assert_identical(after_lora, _generate(engine.url))
    push_weights([engine.url], _named(base_transformer), bucket_bytes=BUCKET_BYTES, weight_version=14)


def test_rejected_updates_name_the_problem_and_keep_the_version(engine, base_transformer):
    version_before = _engine_state(engine.url)[1]
    with pytest.raises(WeightSyncError, match="no parameter 'not_a_param'"):
        push_weights([engine.url], [("transformer.not_a_param", torch.zeros(2))], BUCKET_BYTES, weight_version=99)
    with pytest.raises(WeightSyncError, match="no module 'unet'"):
        push_weights([engine.url], [("unet.conv.weight", torch.zeros(2))], BUCKET_BYTES, weight_version=99)
    name, tensor = _named(base_transformer)[0]
    with pytest.raises(WeightSyncError, match="shape"):
        push_weights([engine.url], [(name, tensor.reshape(-1)[:-1])], BUCKET_BYTES, weight_version=99)
    with pytest.raises(WeightSyncError, match="unpaired"):
        only_a = _lora_named(_lora_pairs(base_transformer, seed=1))[:1]
        push_weights([engine.url], only_a, BUCKET_BYTES, weight_version=99, lora=True)
    with pytest.raises(WeightSyncError, match="unreachable"):
        push_weights(["http://127.0.0.1:9"], [(name, tensor)], BUCKET_BYTES, weight_version=99, timeout=5)
    assert _engine_state(engine.url)[1] == version_before


def test_receiver_rejects_targets_outside_target_modules(base_transformer):
    receiver = WeightReceiver({"transformer": base_transformer})
    weight = base_transformer.pos_embed.proj.weight
    entry = TensorEntry("transformer.pos_embed.proj.weight", torch.float32, tuple(weight.shape), 0)
    message = UpdateMessage(weight_version=1, target_modules=("transformer_2",),
                            buffer=SharedMemoryRef("miles_" + "0" * 32, entry.nbytes), entries=(entry,))
    with pytest.raises(ProtocolError, match="outside target_modules"):
        receiver.apply(message)


def test_a_lora_bucket_with_a_mismatched_rank_changes_nothing():
    """The halves of a LoRA pair may arrive in different buckets; a B whose rank differs from the pending A is
    refused before anything is copied, and the pending A stays as it was."""
    layer = nn.Linear(4, 3, bias=False)
    weight_before = layer.weight.detach().clone()
    receiver = WeightReceiver({"transformer": nn.ModuleDict({"proj": layer})})
    buffer = SharedBuffer(4096, torch.device("cpu"))
    try:
        def bucket(*named):
            entries = buffer.pack(list(named))
            return UpdateMessage(weight_version=3, lora=True, lora_scaling=0.5, buffer=buffer.describe(),
                                 entries=entries)

        receiver.apply(bucket(("transformer.proj.lora_A.weight", torch.ones(2, 4))))  # rank 2, waits for its B
        with pytest.raises(ProtocolError, match="with rank 2"):
            receiver.apply(bucket(("transformer.proj.lora_B.weight", torch.ones(3, 5)),))
        with pytest.raises(ProtocolError, match="does not fit"):  # out-features 2, the weight has 3
            receiver.apply(bucket(("transformer.proj.lora_B.weight", torch.ones(2, 2))))
        assert torch.equal(layer.weight, weight_before) and receiver.tensors_received == 1
        receiver.apply(bucket(("transformer.proj.lora_B.weight", torch.ones(3, 2))))  # the right B merges
        torch.testing.assert_close(layer.weight, weight_before + 0.5 * torch.ones(3, 2) @ torch.ones(2, 4))
    finally:
        buffer.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_ipc_update_into_a_gpu_engine(sd3_path, base_transformer, make_server_args, tmp_path):
    from miles.engine.launcher import launch_engine

    engine = launch_engine(make_server_args(sd3_path, device="cuda", generator_device="cuda", dtype="bf16"),
                           log_path=str(tmp_path / "engine.log"), startup_timeout=300)
    try:
        new_weights = [(name, t.to("cuda", torch.bfloat16)) for name, t in _perturbed(base_transformer, seed=3)]
        stats = push_weights([engine.url], new_weights, bucket_bytes=BUCKET_BYTES, weight_version=5)
        assert stats["num_buckets"] > 3
        checksums, version = _engine_state(engine.url)
        assert version == 5 and checksums == named_tensor_checksums(new_weights)
        assert len(_generate(engine.url).samples) == 2
    finally:
        engine.stop()
