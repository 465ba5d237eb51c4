"""miles/backends/fsdp_utils/gradient_fetch.py: rank 0 fetches the engines' policy gradient over real HTTP from a
real engine process, added into its own shared buffer (the by-reference path: a /dev/shm file on the CPU, CUDA IPC
on a GPU) or carried in the answer's body; both give the same bits, a refused request loses no kept gradient, and
an engine that lost samples stops every rank with one line."""

from __future__ import annotations

import urllib.request

import pytest
import torch

from miles.backends.fsdp_utils.gradient_fetch import FetchedGradient, PolicyGradientFetcher, _post
from miles.backends.fsdp_utils.rollout_gradient_step import _everyone_holds
from miles.backends.fsdp_utils.weight_push import WeightPusher
from miles.engine.launcher import launch_engines
from miles.engine.protocol import CONTENT_TYPE, GenerateRequest, encode_policy_gradient_request, encode_request
from miles.engine.server_args import ServerArgs
from miles.engine.weight_sync import SharedBuffer, push_weights
from miles.engine.weight_sync_wire import SharedMemoryRef, encode_buffer_ref
from miles.models.sd3 import SD3TrainPipelineConfig
from miles.types import GuidanceConfig, PolicyGradientAsk
from miles.utils.auth import auth_headers
from miles.utils.errors import PartDiedError

LAYERS = ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_v", "transformer_blocks.1.ff.net.2")
RANK = 2


@pytest.fixture(scope="module")
def engines_with_adapter(tiny_checkpoint, tmp_path_factory):
    """Two engine processes that keep rollout gradients, each holding the same random rank-2 adapter on three
    layers; their URLs and the adapter's tensors by the names the engines know them by."""
    path = tiny_checkpoint("sd3")
    transformer = SD3TrainPipelineConfig().load_pipeline(path, torch.float32).transformer
    generator = torch.Generator().manual_seed(0)
    adapter = {}
    for layer in LAYERS:
        linear = transformer.get_submodule(layer)
        adapter[f"transformer.{layer}.lora_A.weight"] = torch.randn(RANK, linear.in_features, generator=generator)
        adapter[f"transformer.{layer}.lora_B.weight"] = 0.1 * torch.randn(linear.out_features, RANK,
                                                                           generator=generator)
    args = ServerArgs(model_path=path, model_family="sd3", device="cpu", dtype="fp32", generator_device="cpu",
                      rollout_gradient_tile=2)
    processes = launch_engines([args, args], log_dir=str(tmp_path_factory.mktemp("engines")), startup_timeout=150)
    urls = [process.url for process in processes]
    push_weights(urls, adapter.items(), 1 << 20, weight_version=1, lora=True, lora_scaling=2.0,
                 target_modules=["transformer"])
    yield urls, adapter
    for process in processes:
        process.stop()


def _rollout(url: str, seed: int) -> None:
    """Two samples, both steps SDE steps, their gradients kept under seeds `seed` and `seed + 1`."""
    request = GenerateRequest(prompt="a red cube", num_samples=2, seed=seed, num_steps=2, height=32, width=32,
                              guidance=GuidanceConfig(guidance_scale=1.0), noise_level=0.9, sde_step_indices=[0, 1],
                              return_latent_indices=[], rollout_gradient=True, return_images=False)
    http = urllib.request.Request(f"{url}/rollout/generate", data=encode_request(request), method="POST",
                                  headers={"Content-Type": CONTENT_TYPE, **auth_headers()})
    urllib.request.urlopen(http, timeout=120).read()


def _fetch(coefficients: dict[str, dict[int, float]], adapter: dict, transport: str) -> FetchedGradient:
    pusher = WeightPusher(transport, colocated=True, device="cpu", timeout=60.0)
    shapes = {name: tensor.shape for name, tensor in reversed(adapter.items())}  # not the engines' order
    fetcher = PolicyGradientFetcher(pusher, shapes, torch.device("cpu"), timeout=60.0)
    try:
        fetched = fetcher.fetch(PolicyGradientAsk(coefficients, samples=sum(len(c) for c in coefficients.values())))
        fetched.flat = fetched.flat.clone()  # the fetcher's buffer goes with it
        return fetched
    finally:
        fetcher.close()


def test_the_gradient_added_into_the_trainers_buffer_is_the_one_in_the_bodies(engines_with_adapter):
    (first, second), adapter = engines_with_adapter
    coefficients = {first: {7: 0.25, 8: -0.5}, second: {9: 1.0, 10: -0.125}}

    def rollouts() -> None:  # the same samples each time (same weights, same seeds)
        _rollout(first, seed=7)
        _rollout(second, seed=9)

    rollouts()
    shared = _fetch(coefficients, adapter, "ipc")  # engines sharing the trainer's memory: into its buffer
    rollouts()
    bodies = _fetch(coefficients, adapter, "broadcast")  # any other engine: in the answers' bodies
    rollouts()
    alone = _fetch({first: coefficients[first]}, adapter, "ipc").flat
    alone += _fetch({second: coefficients[second]}, adapter, "ipc").flat
    assert (shared.engines_by_reference, shared.engines_by_body) == (2, 0)
    assert (bodies.engines_by_reference, bodies.engines_by_body) == (0, 2)
    for fetched in (shared, bodies):  # the engines say how long they waited for their worker and summed
        assert fetched.engine_sum_seconds > 0 and fetched.engine_wait_seconds >= 0
        assert fetched.engine_wait_seconds + fetched.engine_sum_seconds < fetched.seconds
    assert shared.held == bodies.held == 4
    assert shared.flat.abs().sum() > 0 and torch.equal(shared.flat, bodies.flat) and torch.equal(shared.flat, alone)
    assert torch.equal(_everyone_holds(shared, shared.flat.numel(), torch.device("cpu")), shared.flat)


def test_a_fetcher_keeps_its_buffer_from_one_rollout_to_the_next(engines_with_adapter):
    """The buffer the engines add into is made once and zeroed before each fetch; in the engines' order (the
    trainer's here) the gradient is that buffer, valid until the next fetch, and each fetch's is the rollout's own."""
    (url, _), adapter = engines_with_adapter
    coefficients = {url: {30: 0.5, 31: -1.0}}
    pusher = WeightPusher("ipc", colocated=True, device="cpu", timeout=60.0)
    fetcher = PolicyGradientFetcher(pusher, {name: tensor.shape for name, tensor in adapter.items()},
                                    torch.device("cpu"), timeout=60.0)
    try:
        firsts = []
        for _ in range(2):
            _rollout(url, seed=30)
            fetched = fetcher.fetch(PolicyGradientAsk(coefficients, samples=2))
            assert fetched.held == 2 and fetched.engines_by_reference == 1
            assert fetched.flat.data_ptr() == fetcher._shared.buffer.data_ptr()
            firsts.append(fetched.flat.clone())
        assert firsts[0].abs().sum() > 0 and torch.equal(firsts[0], firsts[1])  # zeroed between: not doubled
        _rollout(url, seed=30)
        in_bodies = PolicyGradientFetcher(WeightPusher("broadcast", colocated=True, device="cpu", timeout=60.0),
                                          fetcher.order.shapes, torch.device("cpu"), timeout=60.0)
        assert torch.equal(firsts[0], in_bodies.fetch(PolicyGradientAsk(coefficients, samples=2)).flat)
        assert in_bodies._shared is None  # no engine took the buffer: none was made
    finally:
        fetcher.close()


def test_a_refused_buffer_loses_no_kept_gradient_and_lost_samples_stop_the_step(engines_with_adapter):
    (url, _), adapter = engines_with_adapter
    _rollout(url, seed=20)
    small = SharedBuffer(16, torch.device("cpu"))  # far smaller than the gradient
    try:
        body = encode_policy_gradient_request({20: 1.0, 21: 1.0}, encode_buffer_ref(small.describe()))
        request = urllib.request.Request(f"{url}/policy_gradient", data=body, method="POST",
                                         headers={"Content-Type": CONTENT_TYPE, **auth_headers()})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        assert refused.value.code == 400 and b"'into' buffer holds 16 bytes" in refused.value.read()
        forged = encode_policy_gradient_request({20: 1.0}, encode_buffer_ref(SharedMemoryRef("miles_" + "0" * 32, 64)))
        request = urllib.request.Request(f"{url}/policy_gradient", data=forged, method="POST",
                                         headers={"Content-Type": CONTENT_TYPE, **auth_headers()})
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(request, timeout=60)
        assert missing.value.code == 400
    finally:
        small.close()
    # both samples' gradients are still there; seed 99 was never served here
    fetched = _fetch({url: {20: 1.0, 21: 1.0, 99: 1.0}}, adapter, "ipc")
    assert fetched.held == 2 and fetched.flat.abs().sum() > 0
    with pytest.raises(PartDiedError, match="held the gradients of 2 of the rollout's 3 samples"):
        _everyone_holds(fetched, fetched.flat.numel(), torch.device("cpu"))
    # a refusal reaches the run's one line with the engine's reason
    with pytest.raises(PartDiedError, match=r"policy_gradient failed \(HTTP Error 400.*not valid msgpack"):
        _post(url, b"\xc1", timeout=60.0)


def _every_rank_holds_rank_zeros_fetch(rank: int, held: int) -> dict:
    flat = torch.arange(6, dtype=torch.float32) if rank == 0 else None
    fetched = FetchedGradient(flat, held=held if rank == 0 else -1, expected=2)
    try:
        return {"flat": _everyone_holds(fetched, 6, torch.device("cpu"))}
    except PartDiedError as err:
        return {"error": str(err)}


def test_other_ranks_receive_rank_zeros_gradient_and_stop_alike_when_samples_were_lost():
    from miles.backends.fsdp_utils.spawn import spawn_ranks

    ranks = spawn_ranks(2, _every_rank_holds_rank_zeros_fetch, (2,), backend="gloo")
    assert all(torch.equal(r["flat"], torch.arange(6, dtype=torch.float32)) for r in ranks)
    ranks = spawn_ranks(2, _every_rank_holds_rank_zeros_fetch, (1,), backend="gloo")
    assert [r["error"] for r in ranks] == ["--diffusion-rollout-gradient: the engines held the gradients of 1 of "
                                           "the rollout's 2 samples (an engine restarted during the rollout?)"] * 2
