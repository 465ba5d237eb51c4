"""The Ray engine supervisor (start / kill / restart / stop of a real engine process) and
`--use-distributed-post` through the per-node POST actors. Ray starts once for this file."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

ray = pytest.importorskip("ray")

from miles.engine.launcher import BackgroundLoop  # noqa: E402
from miles.engine.server_args import ServerArgs  # noqa: E402
from miles.ray.engine_actor import engine_actor_class  # noqa: E402
from miles.rollout.sglang_diffusion_rollout import generate_rollout  # noqa: E402
from miles.router.router import Router, RouterConfig  # noqa: E402
from miles.testing.config import hook_args  # noqa: E402
from miles.types import Sample  # noqa: E402
from miles.utils.auth import auth_headers  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _health(url: str) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/health", headers=auth_headers()),
                                    timeout=10) as response:
            return json.loads(response.read())["ok"]
    except OSError:
        return False


def test_actor_starts_kills_restarts_and_stops_its_engine(ray_cluster, tiny_checkpoint, tmp_path):
    server_args = ServerArgs(model_path=tiny_checkpoint("sd3"), model_family="sd3", device="cpu", dtype="fp32",
                             generator_device="cpu")
    actor = engine_actor_class(num_cpus=0).remote(server_args, log_path=str(tmp_path / "engine.log"),
                                                    startup_timeout=150)
    url = ray.get(actor.start.remote(), timeout=170)
    assert _health(url) and ray.get(actor.is_alive.remote())
    assert ray.get(actor.start.remote()) == url  # idempotent while alive

    # distributed POST: the rollout's requests travel through the per-node POST actors
    loop = BackgroundLoop()
    router = Router(RouterConfig(health_check_interval=3600, health_check_first_wait=3600), [url])
    router_url = loop.run(router.start())
    try:
        args = hook_args(router_url=router_url, use_distributed_post=True, use_fault_tolerance=False,
                         sglang_server_concurrency=4, rollout_parser_num_workers=1, rollout_seed=1,
                         rollout_microgroup_size=1, diffusion_num_steps=2, diffusion_height=32, diffusion_width=32,
                         diffusion_guidance_scale=1.0, rm_type="brightness", group_rm=False)
        groups = generate_rollout(args, 0, [[Sample(prompt="a kite", group_index=0) for _ in range(2)]],
                                  evaluation=True)
        assert all(s.engine_url == url and s.reward is not None for s in groups[0])
        names = ray.util.list_named_actors()
        assert any(name.startswith("miles-http-post-") for name in names), names
    finally:
        loop.run(router.stop())
        loop.close()

    ray.get(actor.kill.remote())
    assert not ray.get(actor.is_alive.remote()) and not _health(url)
    new_url = ray.get(actor.restart.remote(), timeout=170)
    assert _health(new_url) and ray.get(actor.is_alive.remote())
    ray.get(actor.stop.remote())
    assert not _health(new_url) and not ray.get(actor.is_alive.remote())
