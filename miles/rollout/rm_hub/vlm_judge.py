"""`vlm_judge`: a vision-language model rates each image through an OpenAI-compatible chat-completions API.

For each sample one request goes to `--vlm-judge-url` (a base URL like `http://host:8000/v1`, to which
`/chat/completions` is added, or the full chat-completions URL), with JSON body

    {"model": <--vlm-judge-model>, "temperature": 0,
     "messages": [{"role": "user", "content": [
         {"type": "text", "text": <--vlm-judge-prompt with {prompt} replaced by the sample's prompt>},
         {"type": "image_url", "image_url": {"url": "data:image/png;base64,<the image as PNG>"}}]}]}

A video sends its middle frame ⌊F/2⌋. The reward is the first number in the reply's text (`choices[0].message
.content`, after any `<think>...</think>` block), on whatever scale the prompt asks for (0–10 by default).

The API key is read from the environment variable named by `--vlm-judge-api-key-env` (default
`MILES_VLM_JUDGE_API_KEY`) and sent as `Authorization: Bearer <key>`; it is a key of its own, never the run's
engine key. At most `--vlm-judge-max-concurrency` requests are in flight. A connection error, a timeout
(`--rm-timeout` per request), a 429 or 5xx status, or a reply without a number is retried `--rm-max-retries`
times with exponential back-off; another 4xx status or a body that is not a chat completion stops the run at
once, and so does a reply that still has no number after the retries, with the reply's text in the message.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import os
import re
from typing import Any, Sequence

import aiohttp
import numpy as np
from PIL import Image

from miles.config.sections import RewardConfig
from miles.rollout.rm_hub.builtin import frames_uint8
from miles.rollout.rm_hub.remote import request_limits
from miles.types import Sample
from miles.utils.errors import MilesUserError

logger = logging.getLogger(__name__)

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_THINKING = re.compile(r"<think>.*?</think>", re.DOTALL)


def chat_completions_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/chat/completions") else url + "/chat/completions"


def image_data_url(frame: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def judge_request(model: str, question: str, frame: np.ndarray) -> dict[str, Any]:
    return {
        "model": model,
        "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": question},
            {"type": "image_url", "image_url": {"url": image_data_url(frame)}},
        ]}],
    }


def parse_score(text: str) -> float | None:
    """The first number of the reply (after a `<think>` block), or None when it has none."""
    match = _NUMBER.search(_THINKING.sub("", text))
    return float(match.group()) if match else None


def reply_text(body: bytes, url: str) -> str:
    """`choices[0].message.content` of a chat completion (a string, or text parts joined); a user error if absent."""
    try:
        decoded = json.loads(body)
        content = decoded["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise MilesUserError(
            f"--vlm-judge-url {url}: the answer is not an OpenAI chat completion ({type(err).__name__}: {err}): "
            f"{body[:300]!r}"
        ) from err
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    if not isinstance(content, str):
        raise MilesUserError(f"--vlm-judge-url {url}: message content is {type(content).__name__}, not text")
    return content


class VlmJudge:
    """One judging session: the endpoint, the key, the limits and a semaphore for the concurrency cap."""

    def __init__(self, reward_config: RewardConfig):
        base_url = reward_config.vlm_judge_url
        self.model = reward_config.vlm_judge_model
        if not base_url or not self.model:
            raise MilesUserError("--rm-type vlm_judge needs --vlm-judge-url and --vlm-judge-model")
        self.url = chat_completions_url(base_url)
        self.template = reward_config.vlm_judge_prompt
        self.timeout_s, self.max_retries = request_limits(reward_config)
        self.headers = {"Content-Type": "application/json"}
        key = os.environ.get(reward_config.vlm_judge_api_key_env)
        if key:
            self.headers["Authorization"] = f"Bearer {key}"
        self.semaphore = asyncio.Semaphore(reward_config.vlm_judge_max_concurrency)

    def question(self, prompt: str) -> str:
        return self.template.replace("{prompt}", prompt)  # no str.format: prompts may hold braces

    async def judge(self, session: aiohttp.ClientSession, sample: Sample) -> float:
        frames = frames_uint8(sample)
        payload = json.dumps(judge_request(self.model, self.question(sample.prompt), frames[frames.shape[0] // 2]))
        last_error = ""
        for attempt in range(self.max_retries + 1):
            try:
                async with self.semaphore, session.post(self.url, data=payload, headers=self.headers) as response:
                    body = await response.read()
                    if response.status == 429 or response.status >= 500:
                        last_error = f"HTTP {response.status}: {body[:200]!r}"
                    elif response.status >= 400:
                        raise MilesUserError(f"--vlm-judge-url {self.url}: HTTP {response.status}: {body[:300]!r}")
                    else:
                        text = reply_text(body, self.url)
                        score = parse_score(text)
                        if score is not None:
                            return score
                        last_error = f"the reply has no number: {text[:200]!r}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                last_error = f"{type(err).__name__}: {err}"
            if attempt < self.max_retries:
                delay = min(2.0**attempt * 0.5, 10.0)
                logger.warning("vlm_judge %s for sample %d failed (%s); retry %d/%d in %.1fs", self.url, sample.index,
                               last_error, attempt + 1, self.max_retries, delay)
                await asyncio.sleep(delay)
        raise MilesUserError(f"--vlm-judge-url {self.url}: no score for sample {sample.index} (prompt "
                             f"{sample.prompt[:60]!r}) after {self.max_retries + 1} attempt(s): {last_error}")


async def vlm_judge_rm(reward_config: RewardConfig, samples: Sequence[Sample]) -> list[float]:
    judge = VlmJudge(reward_config)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=judge.timeout_s)) as session:
        return list(await asyncio.gather(*(judge.judge(session, sample) for sample in samples)))
