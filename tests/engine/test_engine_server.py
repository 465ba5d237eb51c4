"""One engine process (tiny SD3, CPU, fp32) serving /rollout/generate: determinism, batching, log-prob parity
with the math core's score mode, parity with the naive reference loop, memory release, error answers.
A tiny Wan 2.2 runner checks the video path (two experts) in-process."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import aiohttp
import pytest
import torch

from miles.diffusion.sde import build_sde_backend
from miles.engine.model_runner import ModelRunner
from miles.engine.protocol import GenerateRequest, decode_response, encode_request
from miles.engine.server_args import ServerArgs
from miles.router.router import Router, RouterConfig
from miles.models.base import GenerationShape
from miles.testing.reference_loop import sample_reference
from miles.types import GuidanceConfig
from miles.utils.auth import auth_headers

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engine(sd3_engine):
    return sd3_engine


@pytest.fixture(scope="module")
def local_runner(sd3_path, make_server_args):
    """The same model loaded in the test process: the trainer's view for score-mode checks."""
    return ModelRunner(make_server_args(sd3_path))


def _request(**overrides) -> GenerateRequest:
    fields = dict(prompt="a photo of a cat", num_samples=2, seed=11, num_steps=4, height=32, width=32,
                  guidance=GuidanceConfig(guidance_scale=4.0), sde_step_indices=[1, 2],
                  return_latent_indices=[1, 2, 3], noise_level=0.7, request_id="r")
    fields.update(overrides)
    return GenerateRequest(**fields)


def _served_alone(runner: ModelRunner, request: GenerateRequest):
    """The request denoised by the runner alone (no scheduler), its response."""
    trajectory = runner.start(request)
    while not trajectory.done:
        runner.step([trajectory])
    return runner.finish(trajectory)


def _post(url: str, request: GenerateRequest):
    http = urllib.request.Request(f"{url}/rollout/generate", data=encode_request(request), method="POST",
                                  headers=auth_headers())
    with urllib.request.urlopen(http, timeout=60) as response:
        return decode_response(response.read())


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=auth_headers()), timeout=30) as response:
        return json.loads(response.read())


def _assert_same_samples(a, b, exact: bool = True):
    for x, y in zip(a.samples, b.samples):
        pairs = [(x.image, y.image), (x.clean_latents, y.clean_latents), (x.rollout_log_probs, y.rollout_log_probs)]
        pairs += [(x.latents[k], y.latents[k]) for k in x.latents]
        for p, q in pairs:
            if exact:
                assert torch.equal(p, q)
            else:
                torch.testing.assert_close(p.float(), q.float(), atol=1e-5, rtol=1e-5)


def test_generate_returns_the_documented_fields(engine):
    response = _post(engine.url, _request(debug=True))
    # the version the engine holds: 0 when it has taken no update, more after test_weight_sync's (the engine is
    # shared by the session, its weights restored, its version not)
    version = _get_json(f"{engine.url}/server_info")["weight_version"]
    assert response.weight_version == version and len(response.samples) == 2
    sample = response.samples[0]
    assert sample.seed == 11 and response.samples[1].seed == 12
    assert sample.image.dtype == torch.uint8 and sample.image.shape == (1, 32, 32, 3)
    assert sorted(sample.latents) == [1, 2, 3] and sample.latents[1].shape == (4, 8, 8)
    assert sample.sigmas.shape == (5,) and sample.sigmas[0] == 1.0 and sample.sigmas[-1] == 0.0
    torch.testing.assert_close(sample.timesteps, sample.sigmas[:-1] * 1000)
    assert sample.rollout_log_probs.shape == (2,) and torch.isfinite(sample.rollout_log_probs).all()
    assert {"prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds"} <= set(sample.conditioning)
    assert sample.conditioning["prompt_embeds"].ndim == 2  # per sample: no batch axis
    assert sorted(sample.debug_model_outputs) == [0, 1, 2, 3]
    info = _get_json(f"{engine.url}/server_info")
    assert info["family"] == "sd3" and info["device"] == "cpu" and info["dtype"] == "float32"


def test_same_seed_gives_identical_outputs_and_other_seeds_differ(engine):
    first, second = _post(engine.url, _request()), _post(engine.url, _request())
    _assert_same_samples(first, second, exact=True)
    other = _post(engine.url, _request(seed=99))
    assert not torch.equal(first.samples[0].clean_latents, other.samples[0].clean_latents)
    # samples of one request differ from each other (seed, seed+1)
    assert not torch.equal(first.samples[0].clean_latents, first.samples[1].clean_latents)


def test_engine_matches_the_naive_reference_loop(engine, local_runner):
    request = _request(num_samples=2, seed=5, sde_step_indices=[0, 2], return_latent_indices=[0, 1, 2, 3])
    response = _post(engine.url, request)
    reference = sample_reference(
        local_runner.family, local_runner.pipe, [request.prompt] * 2, seeds=[5, 6], num_steps=4,
        shape=GenerationShape(32, 32), guidance=request.guidance, negative_prompt=" ",
        sde_backend=build_sde_backend("sde", 0.7, False), sde_step_indices=[0, 2],
    )
    for b, sample in enumerate(response.samples):
        torch.testing.assert_close(sample.clean_latents, reference.latents[b], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sample.rollout_log_probs, torch.stack(reference.log_probs)[:, b], atol=1e-5, rtol=0)
        assert (sample.image.int() - reference.images[b].int()).abs().max() <= 1


@pytest.mark.parametrize("sde_type, no_const", [("sde", False), ("cps", True)])
def test_engine_log_probs_equal_score_mode_log_probs(engine, local_runner, sde_type, no_const):
    """docs/algorithms.md §11.7: the trainer's SCORE-mode log-prob of the engine's x_{k+1} equals the engine's."""
    request = _request(sde_type=sde_type, log_prob_no_const=no_const, sde_step_indices=[0, 1, 3],
                       return_latent_indices=[0, 1, 2, 3, 4])
    response = _post(engine.url, request)
    backend = build_sde_backend(sde_type, request.noise_level, no_const)
    family = local_runner.family
    for sample in response.samples:
        conditioning = {k: v.unsqueeze(0) for k, v in sample.conditioning.items()}
        for j, k in enumerate(request.sde_step_indices):
            x_k = sample.latents[k].unsqueeze(0)
            sigma = sample.sigmas[k].reshape(1)
            velocity = family.predict_velocity(local_runner.modules, x_k, sigma, conditioning, request.guidance,
                                               GenerationShape(32, 32), torch.float32)
            scored = backend.log_prob(x_k, velocity, sample.latents[k + 1].unsqueeze(0), sigma,
                                      sample.sigmas[k + 1].reshape(1), sample.sigmas[1].reshape(1))
            torch.testing.assert_close(scored.log_prob[0], sample.rollout_log_probs[j], atol=1e-5, rtol=1e-5)


def test_concurrent_requests_are_batched_and_match_serial_serving(engine):
    requests = [_request(prompt=p, seed=s, request_id=p) for p, s in (("a cat", 1), ("a dog", 2), ("a fox", 3))]
    serial = [_post(engine.url, r) for r in requests]
    before = _get_json(f"{engine.url}/server_info")["counters"]

    async def burst():
        async with aiohttp.ClientSession(headers=auth_headers()) as session:
            async def one(r):
                async with session.post(f"{engine.url}/rollout/generate", data=encode_request(r)) as resp:
                    assert resp.status == 200
                    return decode_response(await resp.read())
            return await asyncio.gather(*(one(r) for r in requests))

    concurrent = asyncio.run(burst())
    after = _get_json(f"{engine.url}/server_info")["counters"]
    # 3 requests x 4 steps served in fewer forwards than 12: samples of different requests shared forwards
    assert after["forward_batches"] - before["forward_batches"] < 12
    assert after["max_forward_samples"] >= 4
    for alone, batched in zip(serial, concurrent):
        assert alone.request_id == batched.request_id
        # bitwise on CPU in practice; asserted to fp tolerance because the batch composition depends on timing
        # and a GEMM's reduction order may change with the batch size on other hardware
        _assert_same_samples(alone, batched, exact=False)


def test_release_and_resume_memory(engine):
    def post(path):
        http = urllib.request.Request(f"{engine.url}{path}", data=b"", method="POST", headers=auth_headers())
        with urllib.request.urlopen(http, timeout=30) as response:
            return json.loads(response.read())

    assert post("/release_memory_occupation")["memory_released"] is True
    with pytest.raises(urllib.error.HTTPError) as err:
        _post(engine.url, _request())
    assert err.value.code == 503
    assert post("/resume_memory_occupation")["memory_released"] is False
    assert len(_post(engine.url, _request(num_samples=1)).samples) == 1


def test_bad_requests_get_400_with_a_reason(engine):
    http = urllib.request.Request(f"{engine.url}/rollout/generate", data=b"\xc1garbage", method="POST",
                                  headers=auth_headers())
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(http, timeout=30)
    assert err.value.code == 400 and "msgpack" in json.loads(err.value.read())["error"]
    with pytest.raises(urllib.error.HTTPError) as err:
        _post(engine.url, _request(height=30))  # not a multiple of the VAE scale x patch size
    assert err.value.code == 400 and "height" in json.loads(err.value.read())["error"]
    with pytest.raises(urllib.error.HTTPError) as err:
        _post(engine.url, _request(sde_type="langevin"))
    assert err.value.code == 400 and "sde-type" in json.loads(err.value.read())["error"]
    assert _get_json(f"{engine.url}/health")["ok"] is True  # the engine survived all of them


def _wait_idle(url: str, deadline_s: float = 20.0) -> dict:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        info = _get_json(f"{url}/server_info")
        if info["running_requests"] == 0:
            return info["counters"]
        time.sleep(0.05)  # polling another process's state; there is no event to wait on
    raise AssertionError(f"engine {url} still runs requests after {deadline_s}s")


@pytest.mark.parametrize("through_router", [False, True])
def test_a_client_that_disconnects_cancels_its_request(engine, through_router):
    """A 1000-step request whose client gives up after 0.5 s stops at the next step instead of running on."""
    long_request = _request(num_samples=1, num_steps=1000, sde_step_indices=[], return_latent_indices=[],
                            request_id="abandoned")
    before = _wait_idle(engine.url)

    async def give_up():
        router = None
        url = engine.url
        if through_router:
            router = Router(RouterConfig(health_check_interval=3600, health_check_first_wait=3600), [engine.url])
            url = await router.start()
        try:
            async with aiohttp.ClientSession(headers=auth_headers()) as session:
                with pytest.raises(asyncio.TimeoutError):
                    async with session.post(f"{url}/rollout/generate", data=encode_request(long_request),
                                            timeout=aiohttp.ClientTimeout(total=0.5)):
                        pass
        finally:
            if router is not None:
                await router.stop()

    asyncio.run(give_up())
    after = _wait_idle(engine.url)
    assert after["requests_cancelled"] == before["requests_cancelled"] + 1
    assert after["forward_batches"] - before["forward_batches"] < 900  # stopped long before step 1000
    assert len(_post(engine.url, _request(num_samples=1)).samples) == 1  # and the engine serves on


def test_the_batch_key_reads_no_device_tensor(local_runner):
    """The scheduler computes batch keys on its event loop between steps: a read of a device tensor there would
    wait for the queued steps every time, so the sigmas it needs are kept on the host as well."""
    trajectory = local_runner.start(_request(num_samples=1))
    assert trajectory.sigma_values == tuple(trajectory.sigmas.tolist())
    key = local_runner.batch_key(trajectory)
    trajectory.sigmas = torch.empty_like(trajectory.sigmas, device="meta")  # reading its values would raise
    assert local_runner.batch_key(trajectory) == key


def test_wan_video_runner_two_experts_and_score_mode(tiny_checkpoint, make_server_args):
    """The video path in-process: frames out, experts switch, log-probs equal score mode."""
    path = tiny_checkpoint("wan2_2")
    runner = ModelRunner(make_server_args(path, model_family="wan2_2"))
    # step 0 stays ODE: the tiny Wan schedule starts at sigma = 1 - 1.0e-6, just outside the 'sde' kind's
    # sigma == 1 tolerance, which makes that step's std explode (reported to the math-core owner)
    request = _request(num_samples=1, num_frames=5, height=32, width=32, num_steps=4, sde_step_indices=[1, 3],
                       return_latent_indices=[1, 2, 3, 4], guidance=GuidanceConfig(4.0, guidance_scale_2=3.0))
    trajectory = runner.start(request)
    experts = []
    while not trajectory.done:
        experts.append(runner.batch_key(trajectory)[0])
        runner.step([trajectory])
    response = runner.finish(trajectory)
    sample = response.samples[0]
    assert sample.image.shape[0] == 5 and sample.image.shape[-1] == 3
    assert len(set(experts)) == len(runner.module_names)  # every expert of the checkpoint ran
    backend = build_sde_backend("sde", request.noise_level, False)
    conditioning = {k: v.unsqueeze(0) for k, v in sample.conditioning.items()}
    for j, k in enumerate(request.sde_step_indices):
        x_k = sample.latents[k].unsqueeze(0)
        velocity = runner.family.predict_velocity(runner.modules, x_k, sample.sigmas[k].reshape(1), conditioning,
                                                  request.guidance, trajectory.shape, torch.float32)
        scored = backend.log_prob(x_k, velocity, sample.latents[k + 1].unsqueeze(0), sample.sigmas[k].reshape(1),
                                  sample.sigmas[k + 1].reshape(1), sample.sigmas[1].reshape(1))
        torch.testing.assert_close(scored.log_prob[0], sample.rollout_log_probs[j], atol=1e-5, rtol=1e-5)


def test_cli_is_generated_from_server_args_and_round_trips():
    from miles.engine.__main__ import parse_server_args, server_args_to_argv

    args = ServerArgs(model_path="/x", model_family="sd3", port=1234, enable_torch_compile=True, batch_wait_ms=7.5,
                      rollout_patch_group="fp32_norms,sgld")
    assert parse_server_args(server_args_to_argv(args)) == args
    assert parse_server_args(["--no-enable-torch-compile"]).enable_torch_compile is False


def test_a_missing_model_fails_fast_with_a_one_line_reason(tmp_path):
    from miles.engine.launcher import launch_engine

    with pytest.raises(RuntimeError, match="does not exist"):
        launch_engine(ServerArgs(model_path=str(tmp_path / "missing"), device="cpu"),
                      log_path=str(tmp_path / "engine.log"), startup_timeout=60)


def test_padded_batches_give_the_same_samples(local_runner):
    """A compiled engine pads each forward to a power of two; the padding must not change any sample."""

    def run(pad: bool):
        local_runner.pad_batches = pad
        try:
            return _served_alone(local_runner, _request(num_samples=3, seed=21))
        finally:
            local_runner.pad_batches = False

    _assert_same_samples(run(False), run(True), exact=False)


def test_a_compiled_engine_reuses_a_compiled_batch_size_before_compiling_a_new_one():
    from miles.engine.model_runner import padded_batch_size

    assert padded_batch_size(3, set(), 64) == 4  # the next power of two
    assert padded_batch_size(16, {4, 32}, 64) == 32  # a size compiled in an earlier rollout: no new graph
    assert padded_batch_size(1, {4, 32}, 64) == 4  # a late wave's last steps: padded, no new graph yet
    assert padded_batch_size(8, {32}, 64, recent=2) == 32
    assert padded_batch_size(8, {32}, 64, recent=3) == 8  # a size that recurs gets its own graph
    assert padded_batch_size(1, {4, 32}, 64, recent=3) == 1
    assert padded_batch_size(2, {4, 32}, 64) == 4
    assert padded_batch_size(2, set(), 64) == 2  # nothing compiled yet: nothing to pad to
    assert padded_batch_size(100, {32}, 64) == 100  # larger than the cap: as is


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the multi-GPU check applies to CUDA engines")
def test_engines_wider_than_the_visible_gpus_are_refused_clearly(sd3_path):
    from miles.utils.errors import MilesUserError

    with pytest.raises(MilesUserError, match="rollout-num-gpus-per-engine 64: the engine on GPU 0 sees only"):
        ModelRunner(ServerArgs(model_path=sd3_path, model_family="sd3", device="cuda", tp_size=64, ulysses_degree=64))


def test_a_compiled_engine_compiles_the_image_vae_decoder_in_place(sd3_path, make_server_args):
    """SD3's AutoencoderKL decoder is compiled with the DiT blocks (lazily: nothing compiles until the first decode);
    in place, so the VAE's parameter names stay those of the checkpoint."""
    eager = ModelRunner(make_server_args(sd3_path))
    compiled = ModelRunner(make_server_args(sd3_path, enable_torch_compile=True))
    assert eager.pipe.vae.decoder._compiled_call_impl is None
    assert compiled.pipe.vae.decoder._compiled_call_impl is not None
    assert list(compiled.pipe.vae.state_dict()) == list(eager.pipe.vae.state_dict())


def test_a_burst_arriving_over_several_waits_is_admitted_together(local_runner):
    """Requests 30 and 70 ms after the first, with a 50 ms wait: the wait is taken again while requests keep
    arriving, so all three share every denoising step (no late wave running its last steps alone)."""
    from miles.engine.scheduler import StepScheduler

    async def burst():
        scheduler = StepScheduler(local_runner, max_batch_size=32, batch_wait_ms=50.0)
        scheduler.start()
        try:
            async def after(delay: float, seed: int):
                await asyncio.sleep(delay)
                return await scheduler.generate(_request(seed=seed, request_id=str(seed)))

            await asyncio.gather(after(0.0, 1), after(0.03, 2), after(0.07, 3))
            return scheduler.counters
        finally:
            await scheduler.stop()

    counters = asyncio.run(burst())
    assert counters.max_forward_samples == 6
    assert counters.forward_batches == 4  # one forward per step for all three


def test_the_worker_denoises_the_next_request_while_a_finished_one_is_packed(local_runner, monkeypatch):
    """A finished request's response is packed on the scheduler's packer thread, not on the worker: with the first
    request's packing held, a second request is still denoised to its end; both are answered once released."""
    from miles.engine.scheduler import StepScheduler

    packing, second_denoised, release = threading.Event(), threading.Event(), threading.Event()
    queue_decode = local_runner.finish_async

    def held(trajectory):
        pending = queue_decode(trajectory)
        if trajectory.request.request_id == "second":
            second_denoised.set()
        if trajectory.request.request_id == "first":
            pack = pending.pack

            def pack_when_released():
                packing.set()
                assert release.wait(60), "never released"
                return pack()

            pending.pack = pack_when_released
        return pending

    monkeypatch.setattr(local_runner, "finish_async", held)

    async def until(event: threading.Event) -> None:
        for _ in range(6000):
            if event.is_set():
                return
            await asyncio.sleep(0.01)
        raise TimeoutError("the worker did not get there")

    async def two_requests():
        scheduler = StepScheduler(local_runner, max_batch_size=32, batch_wait_ms=0.0)
        scheduler.start()
        try:
            first = asyncio.ensure_future(scheduler.generate(_request(request_id="first", seed=1)))
            await until(packing)
            second = asyncio.ensure_future(scheduler.generate(_request(request_id="second", seed=2)))
            await until(second_denoised)  # every step of the second ran while the first was being packed
            assert not first.done()
            release.set()
            return await first, await second
        finally:
            release.set()
            await scheduler.stop()

    first, second = asyncio.run(two_requests())
    assert (first.request_id, second.request_id) == ("first", "second")
    assert len(first.samples) == len(second.samples) == 2
    assert first.timings["decode"] >= 0 and first.timings["pack"] > 0 and first.timings["total"] > first.timings["pack"]


def test_a_compiled_engine_on_its_worker_thread_gives_the_eager_bf16_velocities():
    """torch keeps a compiler setting made in code per thread (torch >= 2.13), and the server runs the model on
    its scheduler's worker thread: that thread must compile with the batch_invariant group's eager rounding
    (`ModelRunner.prepare_thread`), or the compiled engine's bf16 velocities leave the eager ones (and so the
    trainer's) by up to 0.8 on the shipped shapes base."""
    from miles.engine.scheduler import StepScheduler
    from miles.tasks.shapes import PRETRAINED_SD3

    def runner(compiled: bool) -> ModelRunner:
        return ModelRunner(ServerArgs(model_path=PRETRAINED_SD3, device="cpu", dtype="bf16", generator_device="cpu",
                                      enable_torch_compile=compiled, forward_tile=4,
                                      rollout_patch_group="batch_invariant"))

    request = _request(prompt="two red circles", num_samples=4, guidance=GuidanceConfig(guidance_scale=1.0), debug=True,
                       return_images=False)  # the VAE compiles nothing the check needs
    eager = runner(False)
    trajectory = eager.start(request)
    while not trajectory.done:
        eager.step([trajectory])
    expected = eager.finish(trajectory).samples

    async def through_the_scheduler():
        scheduler = StepScheduler(runner(True), max_batch_size=8, batch_wait_ms=0.0)
        scheduler.start()
        try:
            return await scheduler.generate(request)
        finally:
            await scheduler.stop()

    torch._dynamo.reset()
    compiled = asyncio.run(through_the_scheduler()).samples
    for got, want in zip(compiled, expected):
        for step, velocity in want.debug_model_outputs.items():
            assert torch.equal(got.debug_model_outputs[step], velocity), f"sample {want.seed}, step {step}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ahead", [False, True])
def test_a_released_engine_holds_its_weights_in_pinned_memory_and_samples_the_same_after_resuming(sd3_path,
                                                                                                make_server_args,
                                                                                                ahead):
    """With `release_buffers_ahead` the first release copies into the buffers pinned after loading."""
    runner = ModelRunner(make_server_args(sd3_path, device="cuda", release_buffers_ahead=ahead))
    if ahead:
        runner._host_copies.wait()
        reserved = dict(runner._host_copies._buffers)
        assert reserved and all(buffer.is_pinned() for buffer in reserved.values())

    def sample():
        return _served_alone(runner, _request(num_samples=2, seed=5))

    before = sample()
    weights = {name: p.detach().clone() for name, p in runner.pipe.transformer.named_parameters()}
    for _ in range(2):  # the second release reuses the buffers of the first
        runner.release_memory()
        assert all(p.device.type == "cpu" and p.is_pinned() for p in runner.pipe.transformer.parameters())
        runner.resume_memory()
        assert all(p.device.type == "cuda" for p in runner.pipe.transformer.parameters())
    assert all(torch.equal(p, weights[name]) for name, p in runner.pipe.transformer.named_parameters())
    _assert_same_samples(before, sample(), exact=True)
    if ahead:
        assert all(runner._host_copies._buffers[key] is buffer for key, buffer in reserved.items())


def test_a_failed_resume_answers_500_with_its_reason_and_the_driver_says_it(local_runner, make_server_args,
                                                                              monkeypatch):
    """An engine that cannot take its memory back (out of memory beside the trainer) answers with the error's
    text, and the driver's message names the engine, the request, that text and the log folder."""
    from miles.engine.launcher import BackgroundLoop
    from miles.engine.server import EngineServer
    from miles.ray.engines import post_to_engines

    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    loop = BackgroundLoop()
    server = EngineServer(local_runner.server_args, runner=local_runner)
    url = loop.run(server.start())
    try:
        post_to_engines([url], "/release_memory_occupation", "/logs")
        monkeypatch.setattr(local_runner, "resume_memory", out_of_memory)
        with pytest.raises(RuntimeError) as err:
            post_to_engines([url], "/resume_memory_occupation", "/logs")
        assert str(err.value) == (f"engine {url} answered 500 to POST /resume_memory_occupation: resuming the "
                                  "engine's memory failed: OutOfMemoryError: CUDA out of memory. Tried to allocate "
                                  "2.00 GiB; its log is in /logs/")
        assert server.memory_released  # the flag still says what the memory is
        monkeypatch.undo()
        post_to_engines([url], "/resume_memory_occupation", "/logs")
        assert not server.memory_released
    finally:
        loop.run(server.stop())
        loop.close()


def test_a_request_sent_ahead_of_its_weights_is_encoded_at_once_and_denoised_on_them(local_runner):
    """`after_weight_version` (--rollout-prefetch): the request starts while the engine holds older weights, takes
    no step until that version is there (a request without it is served meanwhile), then gives the samples of the
    same request sent after the update, bit for bit; its wait for the weights is reported apart."""
    from miles.engine.scheduler import StepScheduler

    version = local_runner.weight_version

    async def ahead_then_now():
        scheduler = StepScheduler(local_runner, max_batch_size=32, batch_wait_ms=0.0)
        scheduler.start()
        try:
            ahead = asyncio.ensure_future(scheduler.generate(_request(request_id="ahead",
                                                                      after_weight_version=version + 1)))
            meanwhile = await scheduler.generate(_request(request_id="meanwhile", seed=12))
            await asyncio.sleep(0.2)
            assert not ahead.done() and scheduler.num_running == 1
            assert scheduler.counters.forward_batches == 4  # the other request's four steps alone
            local_runner.weight_version = version + 1  # what a weight update's flush does (server.py), then wakes
            scheduler.wake()
            return await asyncio.wait_for(ahead, 60), meanwhile, scheduler.counters.forward_batches
        finally:
            local_runner.weight_version = version
            await scheduler.stop()

    ahead, meanwhile, batches = asyncio.run(ahead_then_now())
    assert batches == 8 and meanwhile.weight_version == version and ahead.weight_version == version + 1
    assert ahead.timings["weights_wait"] > 0.2 and meanwhile.timings["weights_wait"] == 0.0
    _assert_same_samples(ahead, _served_alone(local_runner, _request(request_id="after")))
