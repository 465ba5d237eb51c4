"""vlm_judge (OpenAI-compatible chat completions) and geneval (remote reward protocol) against local aiohttp
servers on 127.0.0.1 that the tests start: the requests they send, the scores they read back, retries and the
errors on bad replies."""

from __future__ import annotations

import asyncio
import base64
import io

import msgpack
import numpy as np
import pytest
import torch
from aiohttp import web
from PIL import Image

from miles.config.sections import HookArgs
from miles.rollout.rm_hub import batched_async_rm
from miles.rollout.rm_hub.vlm_judge import chat_completions_url, parse_score
from miles.testing.config import hook_args
from miles.types import Sample
from miles.utils.errors import MilesUserError


def _args(**overrides) -> HookArgs:
    values = dict(rm_type=None, custom_rm_path=None, group_rm=False, reward_weights=None, rm_timeout=5.0,
                  rm_max_retries=0, vlm_judge_url=None, vlm_judge_model="judge-1",
                  vlm_judge_prompt='Score "{prompt}" from 0 to 10.', vlm_judge_api_key_env="TEST_VLM_JUDGE_KEY",
                  vlm_judge_max_concurrency=2, geneval_url=None)
    values.update(overrides)
    return hook_args(**values)


def _sample(index: int, value: int, frames: int = 1, metadata: dict | None = None) -> Sample:
    image = torch.full((frames, 6, 6, 3), value, dtype=torch.uint8)
    if frames > 1:
        image[frames // 2] = 200  # the frame the judge must see
    return Sample(prompt=f"prompt {{with braces}} {index}", index=index, group_index=0, image=image,
                  metadata=metadata or {})


async def _serve(handler, path: str, run):
    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await run(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


class Judge:
    """An OpenAI-compatible judge: replies with the mean pixel value / 25.5 of the image, or scripted trouble."""

    def __init__(self, script: list[str] | None = None):
        self.script = list(script or [])
        self.requests: list[dict] = []
        self.headers: list[dict] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        action = self.script.pop(0) if self.script else "score"
        if action == "busy":
            return web.Response(status=503, text="overloaded")
        if action == "forbidden":
            return web.Response(status=403, text="bad key")
        if action == "not_json":
            return web.Response(text="<html>proxy error</html>")
        url = body["messages"][0]["content"][1]["image_url"]["url"]
        pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))
        text = "I cannot rate this." if action == "words" else f"<think>maybe 3?</think> Score: {pixels.mean() / 25.5:.1f}/10"
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": text}}]})


def test_parse_score_and_url():
    assert parse_score("8") == 8.0 and parse_score("Score: 7.5/10") == 7.5 and parse_score("-.5 points") == -0.5
    assert parse_score("<think>it is 2</think>\n9") == 9.0 and parse_score("no idea") is None
    assert chat_completions_url("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    assert chat_completions_url("http://h:1/v1/chat/completions") == "http://h:1/v1/chat/completions"


def test_vlm_judge_sends_the_image_and_reads_the_score(monkeypatch):
    monkeypatch.setenv("TEST_VLM_JUDGE_KEY", "secret-judge-key")
    judge = Judge()
    samples = [_sample(0, 51), _sample(1, 102, frames=3)]

    async def run(base):
        return await batched_async_rm(_args(rm_type="vlm_judge", vlm_judge_url=f"{base}/v1"), samples)

    scores = asyncio.run(_serve(judge.handle, "/v1/chat/completions", run))
    assert scores == pytest.approx([2.0, 200 / 25.5], abs=0.051)  # the video's middle frame was sent
    request = judge.requests[0]
    assert request["model"] == "judge-1" and request["temperature"] == 0
    text = request["messages"][0]["content"][0]["text"]
    assert text in ('Score "prompt {with braces} 0" from 0 to 10.', 'Score "prompt {with braces} 1" from 0 to 10.')
    assert request["messages"][0]["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert judge.headers[0]["Authorization"] == "Bearer secret-judge-key"


def test_vlm_judge_retries_busy_servers_and_wordy_replies():
    judge = Judge(["busy", "words"])

    async def run(base):
        return await batched_async_rm(_args(rm_type="vlm_judge", vlm_judge_url=base, rm_max_retries=2),
                                      [_sample(0, 255)])

    assert asyncio.run(_serve(judge.handle, "/chat/completions", run)) == [10.0]
    assert len(judge.requests) == 3


@pytest.mark.parametrize(
    "script, retries, message",
    [
        (["words", "words"], 1, r"no score for sample 0 .* after 2 attempt\(s\): the reply has no number: 'I cannot"),
        (["forbidden"], 3, "HTTP 403"),
        (["not_json"], 3, "the answer is not an OpenAI chat completion"),
    ],
)
def test_vlm_judge_errors_are_one_clear_line(script, retries, message):
    judge = Judge(script)

    async def run(base):
        return await batched_async_rm(_args(rm_type="vlm_judge", vlm_judge_url=base, rm_max_retries=retries),
                                      [_sample(0, 10)])

    with pytest.raises(MilesUserError, match=message) as info:
        asyncio.run(_serve(judge.handle, "/chat/completions", run))
    assert "\n" not in str(info.value)


class GenEvalScorer:
    """A GenEval-style scorer: the fraction of `include` objects it 'detects' (the image brightness decides)."""

    def __init__(self, answer_as_map: bool = False):
        self.answer_as_map = answer_as_map
        self.bodies: list[dict] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = msgpack.unpackb(await request.read(), raw=False)
        self.bodies.append(body)
        answers = []
        for item in body["samples"]:
            meta = item["metadata"]
            pixels = np.frombuffer(item["image"]["data"], np.uint8).reshape(item["image"]["shape"])
            found = sum(1 for _ in meta["include"]) if pixels.mean() > 127 else 0
            score = found / len(meta["include"])
            answers.append({"score": score, "correct": float(score == 1.0)} if self.answer_as_map else score)
        return web.Response(body=msgpack.packb({"rewards": answers}), content_type="application/msgpack")


GENEVAL_META = {"tag": "two_object", "include": [{"class": "bench", "count": 1}, {"class": "cat", "count": 1}],
                "prompt": "a photo of a bench and a cat"}


@pytest.mark.parametrize("answer_as_map", [False, True])
def test_geneval_posts_the_metadata_and_reads_the_score(answer_as_map):
    scorer = GenEvalScorer(answer_as_map)
    samples = [_sample(0, 255, metadata=dict(GENEVAL_META)), _sample(1, 0, metadata=dict(GENEVAL_META))]

    async def run(base):
        return await batched_async_rm(_args(rm_type="geneval", geneval_url=f"{base}/geneval"), samples)

    assert asyncio.run(_serve(scorer.handle, "/geneval", run)) == [1.0, 0.0]
    sent = scorer.bodies[0]["samples"][0]
    assert sent["metadata"]["tag"] == "two_object" and sent["metadata"]["include"][1]["class"] == "cat"
    assert sent["image"]["shape"] == [1, 6, 6, 3]


def test_geneval_needs_metadata_and_a_score():
    with pytest.raises(MilesUserError, match="sample 0 .* needs GenEval metadata, a string 'tag' and an 'include'"):
        asyncio.run(batched_async_rm(_args(rm_type="geneval", geneval_url="http://127.0.0.1:9"), [_sample(0, 1)]))

    async def no_score(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"rewards": [{"correct": 1.0}]})

    async def run(base):
        return await batched_async_rm(_args(rm_type="geneval", geneval_url=base + "/g"),
                                      [_sample(0, 1, metadata=dict(GENEVAL_META))])

    with pytest.raises(MilesUserError, match=r"--geneval-url .*a map without 'score' \(keys \['correct'\]\)"):
        asyncio.run(_serve(no_score, "/g", run))
