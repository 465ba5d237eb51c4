"""`remote_rm`: score samples through a user's HTTP reward service (`--rm-url`).

Wire format (docs/rewards.md has the full description and an example server):

request   POST <rm_url>, Content-Type: application/msgpack, body = msgpack map
          {"samples": [{"prompt": str, "index": int, "group_index": int, "metadata": map,
                        "image": {"dtype": "uint8", "shape": [F, H, W, 3], "data": bytes}}, ...]}
response  200 with {"rewards": [float | {str: float}, ...]} (one per sample, same order), encoded as
          msgpack (Content-Type application/msgpack) or JSON (application/json).

A connection error, a timeout or a 5xx status is retried (`--rm-max-retries`, exponential back-off); a
4xx status or a malformed body is a user error at once.

`geneval` (miles/rollout/rm_hub/geneval.py) speaks the same protocol to a GenEval-style scorer.

Auth: with $MILES_RM_API_KEY set, every request carries `Authorization: Bearer <that key>` for the service to
check. It is a key of its own on purpose: the reward service lives outside the run, often on another host, and
must never receive the run's engine key ($MILES_API_KEY), which controls the engines.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any, Sequence

import aiohttp
import msgpack

from miles.config.sections import RewardConfig
from miles.rollout.rm_hub.builtin import frames_uint8
from miles.types import Sample
from miles.utils.errors import MilesUserError

logger = logging.getLogger(__name__)

MSGPACK_CONTENT_TYPE = "application/msgpack"
RM_API_KEY_ENV = "MILES_RM_API_KEY"


def request_headers() -> dict[str, str]:
    headers = {"Content-Type": MSGPACK_CONTENT_TYPE}
    key = os.environ.get(RM_API_KEY_ENV)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return headers


def encode_request(samples: Sequence[Sample]) -> bytes:
    payload = []
    for sample in samples:
        frames = frames_uint8(sample)
        payload.append(
            {
                "prompt": sample.prompt,
                "index": sample.index,
                "group_index": sample.group_index,
                "metadata": sample.metadata,
                "image": {"dtype": "uint8", "shape": list(frames.shape), "data": frames.tobytes()},
            }
        )
    return msgpack.packb({"samples": payload}, use_bin_type=True)


def decode_response(body: bytes, content_type: str, url: str, flag: str = "--rm-url") -> list[Any]:
    try:
        if "json" in content_type:
            decoded = json.loads(body)
        else:
            decoded = msgpack.unpackb(body, raw=False)
    except Exception as err:
        raise MilesUserError(f"{flag} {url}: cannot decode the response ({content_type or 'no content type'}): {err}") from err
    if not isinstance(decoded, dict) or not isinstance(decoded.get("rewards"), list):
        raise MilesUserError(f"{flag} {url}: the response must be a map with a 'rewards' list, got {str(decoded)[:200]!r}")
    return decoded["rewards"]


async def post_samples(url: str, samples: Sequence[Sample], timeout_s: float, max_retries: int, flag: str) -> list[Any]:
    """POST the samples in the wire format above and return the service's `rewards` list (one per sample).

    Connection errors, timeouts and 5xx statuses are retried with exponential back-off; a 4xx status or a
    malformed body is a user error at once. `flag` names the URL's flag in every message."""
    body = encode_request(samples)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    last_error: str = ""
    for attempt in range(max_retries + 1):
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.post(url, data=body, headers=request_headers()) as response:
                    content = await response.read()
                    if response.status >= 500:
                        last_error = f"HTTP {response.status}: {content[:200]!r}"
                    elif response.status >= 400:
                        raise MilesUserError(f"{flag} {url}: HTTP {response.status}: {content[:300]!r}")
                    else:
                        rewards = decode_response(content, response.headers.get("Content-Type", ""), url, flag)
                        if len(rewards) != len(samples):
                            raise MilesUserError(
                                f"{flag} {url}: returned {len(rewards)} rewards for {len(samples)} samples"
                            )
                        return rewards
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            last_error = f"{type(err).__name__}: {err}"
        if attempt < max_retries:
            delay = min(2.0**attempt * 0.5, 10.0)
            logger.warning("reward service %s failed (%s); retry %d/%d in %.1fs", url, last_error, attempt + 1,
                           max_retries, delay)
            await asyncio.sleep(delay)
    raise MilesUserError(f"{flag} {url}: no valid response after {max_retries + 1} attempt(s): {last_error}")


def request_limits(reward_config: RewardConfig) -> tuple[float, int]:
    """(timeout in seconds, retries) of one HTTP reward request: --rm-timeout, --rm-max-retries."""
    return reward_config.rm_timeout, reward_config.rm_max_retries


async def remote_rm(reward_config: RewardConfig, samples: Sequence[Sample]) -> list[Any]:
    url = reward_config.rm_url
    if not url:
        raise MilesUserError("--rm-type remote_rm needs --rm-url")
    return await post_samples(url, samples, *request_limits(reward_config), flag="--rm-url")
