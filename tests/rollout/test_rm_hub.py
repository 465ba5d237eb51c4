"""Reward dispatch: custom, group, per-sample rm_type, remote, reward keys, and the error paths."""

from __future__ import annotations

import asyncio
import textwrap
import uuid

import msgpack
import numpy as np
import pytest
import torch
from aiohttp import web

from miles.config.sections import HookArgs
from miles.rollout.rm_hub import batched_async_rm, reward_value
from miles.testing.config import hook_args
from miles.types import Sample
from miles.utils.errors import MilesUserError


def _args(**overrides) -> HookArgs:
    values = dict(rm_type=None, custom_rm_path=None, group_rm=False, reward_key=None, eval_reward_key=None,
                  rm_url=None, rm_timeout=5.0, rm_max_retries=1)
    values.update(overrides)
    return hook_args(**values)


def _samples(num_groups: int, group_size: int, value: int = 100, rm_type: str | None = None) -> list[Sample]:
    samples = []
    for group in range(num_groups):
        for member in range(group_size):
            index = group * group_size + member
            pixels = torch.full((1, 4, 4, 3), value + index, dtype=torch.uint8)
            metadata = {"rm_type": rm_type} if rm_type else {}
            samples.append(Sample(prompt=f"prompt {group}", index=index, group_index=group, image=pixels, metadata=metadata))
    return samples


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Write a module into a temporary import path; returns its dotted name."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str) -> str:
        name = f"user_rm_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    return write


CUSTOM_RM = """
    CALLS = []

    async def rm(args, samples):
        CALLS.append([s.index for s in samples])
        return [float(s.image.float().mean()) / 255.0 for s in samples]

    async def rm_dict(args, samples):
        return [{"aesthetic": 0.25, "ocr": float(s.index)} for s in samples]

    async def rm_nan(args, samples):
        return [float("nan") if s.index == 2 else 0.0 for s in samples]

    async def rm_raises(args, samples):
        raise RuntimeError("reward service exploded")

    async def rm_short(args, samples):
        return [0.0] * (len(samples) - 1)

    async def rm_text(args, samples):
        return ["good"] * len(samples)

    def rm_sync(args, samples):
        return [0.0] * len(samples)
"""


def test_custom_rm_is_called_once_per_batch(user_module):
    module = user_module(CUSTOM_RM)
    args = _args(custom_rm_path=f"{module}.rm")
    samples = _samples(2, 3)
    rewards = asyncio.run(batched_async_rm(args, samples))
    assert rewards == pytest.approx([(100 + i) / 255.0 for i in range(6)])
    calls = __import__(module).CALLS
    assert calls == [[0, 1, 2, 3, 4, 5]]


def test_group_rm_scores_each_prompt_group_in_one_call(user_module):
    module = user_module(CUSTOM_RM)
    args = _args(custom_rm_path=f"{module}.rm", group_rm=True)
    rewards = asyncio.run(batched_async_rm(args, _samples(3, 2)))
    assert rewards == pytest.approx([(100 + i) / 255.0 for i in range(6)])
    assert sorted(__import__(module).CALLS) == [[0, 1], [2, 3], [4, 5]]


def test_metadata_rm_type_overrides_the_flag(user_module):
    module = user_module(CUSTOM_RM)
    args = _args(custom_rm_path=f"{module}.rm", rm_type="jpeg_compressibility")
    samples = _samples(1, 2)
    samples[1].metadata["rm_type"] = "brightness"
    rewards = asyncio.run(batched_async_rm(args, samples))
    assert rewards[0] == pytest.approx(100 / 255.0)  # custom rm (the flag)
    assert rewards[1] == pytest.approx(101 / 255.0)  # brightness (metadata)
    assert __import__(module).CALLS == [[0]]


def test_dict_rewards_and_reward_keys(user_module):
    module = user_module(CUSTOM_RM)
    args = _args(custom_rm_path=f"{module}.rm_dict", reward_key="aesthetic", eval_reward_key="ocr")
    rewards = asyncio.run(batched_async_rm(args, _samples(1, 2)))
    assert rewards == [{"aesthetic": 0.25, "ocr": 0.0}, {"aesthetic": 0.25, "ocr": 1.0}]
    assert reward_value(args, rewards[1]) == 0.25
    assert reward_value(args, rewards[1], evaluation=True) == 1.0
    assert reward_value(_args(reward_key="ocr"), rewards[1], evaluation=True) == 1.0  # eval key defaults to reward key
    assert reward_value(args, 0.5) == 0.5
    with pytest.raises(MilesUserError, match="set --reward-key"):
        reward_value(_args(), rewards[0])
    with pytest.raises(MilesUserError, match=r"--reward-key 'missing' is not in the reward dict"):
        reward_value(_args(reward_key="missing"), rewards[0])


@pytest.mark.parametrize(
    "name, message",
    [
        ("rm_nan", r"reward 'custom' returned nan for sample 2 \(group 1, prompt 'prompt 1'\)"),
        ("rm_raises", r"reward 'custom' raised RuntimeError: reward service exploded on 4 samples starting at sample 0"),
        ("rm_short", r"reward 'custom' returned 3 values for 4 samples \(first: sample 0"),
        ("rm_text", r"reward 'custom' returned str 'good' for sample 0"),
    ],
)
def test_bad_rewards_name_the_reward_and_the_sample(user_module, name, message):
    module = user_module(CUSTOM_RM)
    args = _args(custom_rm_path=f"{module}.{name}")
    with pytest.raises(MilesUserError, match=message):
        asyncio.run(batched_async_rm(args, _samples(2, 2)))


def test_a_reward_that_raises_keeps_its_traceback_in_the_log(user_module, caplog):
    module = user_module(CUSTOM_RM)
    with caplog.at_level("ERROR"), pytest.raises(MilesUserError):
        asyncio.run(batched_async_rm(_args(custom_rm_path=f"{module}.rm_raises"), _samples(2, 2)))
    logged = [record for record in caplog.records if record.exc_info]
    assert len(logged) == 1 and logged[0].getMessage().startswith("reward 'custom' raised RuntimeError")
    assert "reward service exploded" in caplog.text and "Traceback" in caplog.text and module in caplog.text


def test_configuration_errors(user_module):
    module = user_module(CUSTOM_RM)
    with pytest.raises(MilesUserError, match="must be an `async def"):
        asyncio.run(batched_async_rm(_args(custom_rm_path=f"{module}.rm_sync"), _samples(1, 1)))
    with pytest.raises(MilesUserError, match="--custom-rm-path"):
        asyncio.run(batched_async_rm(_args(custom_rm_path=f"{module}.nope"), _samples(1, 1)))
    with pytest.raises(MilesUserError, match="set --rm-type or --custom-rm-path"):
        asyncio.run(batched_async_rm(_args(), _samples(1, 1)))
    with pytest.raises(MilesUserError, match="--rm-type must be one of"):  # the flag's declared choices
        _args(rm_type="aesthetics")
    with pytest.raises(MilesUserError, match="needs --rm-url"):  # the reward rule of validation
        _args(rm_type="remote_rm")
    assert asyncio.run(batched_async_rm(_args(rm_type="brightness"), [])) == []


# ---- remote_rm against a local aiohttp reward server ---------------------------------------------------
class RewardServer:
    """A user reward service: brightness of the received pixels, plus scripted failures."""

    def __init__(self, failures_before_success: int = 0, mode: str = "msgpack"):
        self.failures_left = failures_before_success
        self.mode = mode
        self.requests: list[dict] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = msgpack.unpackb(await request.read(), raw=False)
        self.requests.append(body)
        if self.failures_left > 0:
            self.failures_left -= 1
            return web.Response(status=503, text="warming up")
        if self.mode == "bad_request":
            return web.Response(status=400, text="prompt too long")
        if self.mode == "garbage":
            return web.Response(body=b"\xc1not msgpack", content_type="application/msgpack")
        rewards = []
        for item in body["samples"]:
            pixels = np.frombuffer(item["image"]["data"], np.uint8).reshape(item["image"]["shape"])
            rewards.append(float(pixels.mean()) / 255.0 + item["metadata"].get("bonus", 0.0))
        if self.mode == "json":
            return web.json_response({"rewards": rewards})
        return web.Response(body=msgpack.packb({"rewards": rewards}), content_type="application/msgpack")


async def _run_with_server(server: RewardServer, flags: dict, samples: list[Sample]):
    app = web.Application()
    app.router.add_post("/score", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    args = _args(rm_url=f"http://127.0.0.1:{port}/score", **flags)
    try:
        return await batched_async_rm(args, samples)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("mode", ["msgpack", "json"])
def test_remote_rm_round_trip(mode):
    server = RewardServer(mode=mode)
    samples = _samples(1, 2)
    samples[1].metadata["bonus"] = 1.0
    rewards = asyncio.run(_run_with_server(server, dict(rm_type="remote_rm"), samples))
    assert rewards == pytest.approx([100 / 255.0, 101 / 255.0 + 1.0])
    sent = server.requests[0]["samples"]
    assert [item["prompt"] for item in sent] == ["prompt 0", "prompt 0"]
    assert sent[1]["image"]["shape"] == [1, 4, 4, 3] and sent[1]["index"] == 1


def test_remote_rm_retries_server_errors():
    server = RewardServer(failures_before_success=1)
    rewards = asyncio.run(_run_with_server(server, dict(rm_type="remote_rm", rm_max_retries=1), _samples(1, 1)))
    assert rewards == pytest.approx([100 / 255.0])
    assert len(server.requests) == 2


@pytest.mark.parametrize(
    "server, message",
    [
        (RewardServer(failures_before_success=5), r"no valid response after 1 attempt\(s\): HTTP 503"),
        (RewardServer(mode="bad_request"), "HTTP 400"),
        (RewardServer(mode="garbage"), "cannot decode the response"),
    ],
)
def test_remote_rm_errors(server, message):
    with pytest.raises(MilesUserError, match=message):
        asyncio.run(_run_with_server(server, dict(rm_type="remote_rm", rm_max_retries=0), _samples(1, 1)))
