"""The router process in front of two real engine processes: least-in-flight balancing, run-time add/remove,
an engine killed mid-request (marked dead; the client retries on the live engine or gets a clear error),
health-check thresholds, and the 503/504 answers. Nothing waits without a deadline."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import aiohttp
import pytest
import torch

from miles.config.sections import RunConfig
from miles.engine.launcher import launch_engines
from miles.engine.protocol import GenerateRequest, decode_response, encode_request
from miles.engine.server_args import ServerArgs
from miles.rollout.engine_client import EngineClient, EngineRequestError
from miles.router.router import Router, RouterConfig, WorkerUrlError, launch_router_process, normalize_worker_url
from miles.testing.config import trainer_config
from miles.types import GuidanceConfig
from miles.utils.auth import auth_headers

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engines(tiny_checkpoint, tmp_path_factory):
    path = tiny_checkpoint("sd3")
    logs = tmp_path_factory.mktemp("router")
    args = ServerArgs(model_path=path, model_family="sd3", device="cpu", dtype="fp32", generator_device="cpu",
                      batch_wait_ms=0.0)
    started = []
    try:
        started.extend(launch_engines([args, args], log_dir=str(logs), startup_timeout=150))
        yield started
    finally:
        for engine in started:
            engine.stop()


@pytest.fixture
def router(engines):
    config = RouterConfig(health_check_interval=60.0, health_check_timeout=5.0, failure_threshold=2, timeout=60.0)
    process, url = launch_router_process(config, [e.url for e in engines if e.alive()])
    yield url
    process.terminate()
    process.wait(timeout=10)


def _request(num_steps=3, seed=1, prompt="a boat") -> GenerateRequest:
    return GenerateRequest(prompt=prompt, num_samples=2, seed=seed, num_steps=num_steps, height=32, width=32,
                           guidance=GuidanceConfig(4.0), sde_step_indices=[0], return_latent_indices=[0, 1],
                           request_id=f"{prompt}-{seed}")


def _workers(router_url: str) -> dict[str, dict]:
    with urllib.request.urlopen(urllib.request.Request(f"{router_url}/workers", headers=auth_headers()),
                                timeout=10) as response:
        return {w["url"]: w for w in json.loads(response.read())["workers"]}


def _client_args(router_url: str, **overrides) -> RunConfig:
    fields = dict(use_fault_tolerance=False, miles_router_timeout=60.0, sglang_server_concurrency=8,
                  rollout_parser_num_workers=1, use_distributed_post=False)
    fields.update(overrides)
    return trainer_config(**fields).with_router_url(router_url)


async def _generate_all(args, requests):
    async with EngineClient(args) as client:
        return await asyncio.gather(*(client.generate(r) for r in requests))


def test_least_in_flight_spreads_a_burst_and_forwards_bodies_unchanged(engines, router):
    requests = [_request(seed=s) for s in range(4)]
    results = asyncio.run(_generate_all(_client_args(router), requests))
    served_by = [engine_url for _, engine_url in results]
    assert sorted(served_by) == sorted([engines[0].url] * 2 + [engines[1].url] * 2)
    workers = _workers(router)
    assert all(w["in_flight"] == 0 and w["requests_total"] == 2 for w in workers.values())
    # the same request through the router and straight to an engine gives the same bytes
    direct = urllib.request.urlopen(
        urllib.request.Request(f"{engines[1].url}/rollout/generate", data=encode_request(requests[0]), method="POST",
                               headers=auth_headers()),
        timeout=60,
    )
    assert torch.equal(decode_response(direct.read()).samples[0].clean_latents, results[0][0].samples[0].clean_latents)


def test_workers_can_be_removed_and_added_at_run_time(engines, router):
    def post(path, url):
        http = urllib.request.Request(f"{router}{path}", data=json.dumps({"url": url}).encode(), method="POST",
                                      headers=auth_headers())
        with urllib.request.urlopen(http, timeout=10) as response:
            return json.loads(response.read())

    assert post("/remove_worker", engines[1].url)["workers"] == [engines[0].url]
    results = asyncio.run(_generate_all(_client_args(router), [_request(seed=s) for s in range(3)]))
    assert {engine_url for _, engine_url in results} == {engines[0].url}
    assert engines[1].url in post("/add_worker", engines[1].url)["workers"]
    assert set(_workers(router)) == {engines[0].url, engines[1].url}


async def _kill_when_in_flight(router_url: str, victim, deadline_s: float = 30.0) -> None:
    """Kill `victim` as soon as the router reports a request in flight on it."""
    deadline = time.monotonic() + deadline_s
    async with aiohttp.ClientSession(headers=auth_headers()) as session:
        while time.monotonic() < deadline:
            async with session.get(f"{router_url}/workers") as response:
                workers = {w["url"]: w for w in (await response.json())["workers"]}
            if workers[victim.url]["in_flight"] > 0:
                victim.kill()
                return
            await asyncio.sleep(0.005)
    raise AssertionError("the request never reached the victim engine")


def _long_request() -> GenerateRequest:
    return _request(num_steps=120, seed=123, prompt="long")  # long enough to be killed mid-way


def test_health_checks_mark_dead_after_the_threshold_and_revive():
    async def run():
        router = Router(RouterConfig(health_check_interval=3600, health_check_timeout=2.0, failure_threshold=3,
                                     health_check_first_wait=3600),  # only the checks below run
                        ["127.0.0.1:9"])
        url = await router.start()
        try:
            worker = router.workers["http://127.0.0.1:9"]
            for expected_alive in (True, True, False):
                assert await router.check_worker(worker) is False
                assert worker.alive is expected_alive
            # the router answers 503 when no engine is alive
            async with aiohttp.ClientSession(headers=auth_headers()) as session:
                async with session.post(f"{url}/rollout/generate", data=encode_request(_request())) as response:
                    assert response.status == 503 and "no live engine" in (await response.json())["error"]
            # a worker pointing at the router's own /health comes back on its first good check
            worker.url = url
            assert await router.check_worker(worker) is True and worker.alive
        finally:
            await router.stop()

    asyncio.run(run())


def test_router_timeout_answers_504(engines):
    live = next(e for e in engines if e.alive())

    async def run():
        router = Router(RouterConfig(health_check_interval=3600, timeout=0.05), [live.url])
        url = await router.start()
        try:
            async with EngineClient(_client_args(url)) as client:
                with pytest.raises(EngineRequestError, match="504.*did not answer within 0.05s"):
                    await client.generate(_request(num_steps=200, seed=9))
        finally:
            await router.stop()

    asyncio.run(run())


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:9/update_weights_from_tensor",  # a path: the router would post elsewhere than the root
        "http://127.0.0.1:9?x=1",
        "http://127.0.0.1:9#frag",
        "http://user:pw@127.0.0.1:9",
        "file:///etc/passwd",
        "gopher://127.0.0.1:9",
        "http://127.0.0.1",  # no port
        "http://127.0.0.1:99999",
        "http://bad_host:9",
        "http://127.0.0.1:9\r\nX-Injected: 1",
        "",
        123,
    ],
)
def test_worker_urls_other_than_scheme_host_port_are_refused(url):
    with pytest.raises(WorkerUrlError):
        normalize_worker_url(url)


def test_add_and_remove_worker_answer_400_to_a_bad_url_and_keep_the_worker_set():
    async def run():
        router = Router(RouterConfig(health_check_interval=3600, health_check_first_wait=3600), ["127.0.0.1:9"])
        url = await router.start()
        try:
            async with aiohttp.ClientSession(headers=auth_headers()) as session:
                for path in ("/add_worker", "/remove_worker"):
                    for body in ({"url": "http://127.0.0.1:9/rollout/generate?x=1"}, {"url": ["x"]}, [1], {}):
                        async with session.post(f"{url}{path}", json=body) as response:
                            assert response.status == 400, (path, body)
                            assert "error" in await response.json()
                    async with session.post(f"{url}{path}", data=b"{not json") as response:
                        assert response.status == 400
                async with session.post(f"{url}/add_worker?url=HTTP://LOCALHOST:8/") as response:
                    assert response.status == 200
            assert sorted(router.workers) == ["http://127.0.0.1:9", "http://localhost:8"]
        finally:
            await router.stop()

    asyncio.run(run())


# The two kill tests run last (file order): the first kills engines[0] and retries on engines[1], the second
# kills engines[1] with fault tolerance off. A fresh router per test picks its first engine first.


def test_engine_killed_mid_request_is_retried_on_a_live_engine(engines, router):
    victim, live = engines

    async def run():
        async with EngineClient(_client_args(router, use_fault_tolerance=True)) as client:
            kill = asyncio.ensure_future(_kill_when_in_flight(router, victim))
            response, engine_url = await client.generate(_long_request())
            await kill
            return response, engine_url, client.stats

    response, engine_url, stats = asyncio.run(run())
    assert engine_url == live.url and stats["retries"] == 1 and victim.url in stats["failed_engines"]
    assert len(response.samples) == 2 and _workers(router)[victim.url]["alive"] is False


def test_engine_killed_mid_request_without_fault_tolerance_is_a_clear_error(engines, router):
    victim = engines[1]
    assert list(_workers(router)) == [victim.url]  # engines[0] died in the previous test

    async def run():
        async with EngineClient(_client_args(router)) as client:
            kill = asyncio.ensure_future(_kill_when_in_flight(router, victim))
            with pytest.raises(EngineRequestError, match=f"--use-fault-tolerance.*502.*{victim.url}"):
                await client.generate(_long_request())
            await kill

    asyncio.run(run())
    assert _workers(router)[victim.url]["alive"] is False


def test_fault_tolerant_client_waits_for_a_live_engine_then_gives_up_clearly():
    async def run():
        router = Router(RouterConfig(health_check_interval=3600, health_check_first_wait=3600), ["127.0.0.1:9"])
        url = await router.start()
        router.workers["http://127.0.0.1:9"].alive = False
        try:
            async with EngineClient(_client_args(url, use_fault_tolerance=True)) as client:
                client.no_engine_wait = 0.3
                began = time.monotonic()
                with pytest.raises(EngineRequestError, match=r"\[503\] no live engine.*no live engine for"):
                    await client.generate(_request())
                # it waited (and retried) for the allowed time before giving up
                assert client.stats["retries"] >= 1 and time.monotonic() - began >= 0.3
        finally:
            await router.stop()

    asyncio.run(run())

