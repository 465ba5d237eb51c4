"""`geneval`: compositional-correctness reward from a GenEval-style scorer (Ghosh et al., arXiv 2310.11513).

GenEval checks an image against its prompt's structured description with an object detector: which objects,
how many, which colours, where. That detector lives in its own service (its own GPU and environment), so this
reward is an adapter over the remote reward protocol of `remote_rm` (miles/rollout/rm_hub/remote.py, wire format in
docs/rewards.md): one POST per batch to `--geneval-url`, retried and timed out by `--rm-max-retries` and
`--rm-timeout`, with `$MILES_RM_API_KEY` as its bearer key.

Each sample's metadata is GenEval's, from the prompt row (the GenEval prompt file's `metadata` rows):
`{"tag": "two_object", "include": [{"class": "bench", "count": 1}, ...], "exclude": [...]?, ...}`. A sample
without a string `tag` and a list `include` is an error naming it, before anything is sent. The service answers
each sample with its score, a number in [0, 1] (the fraction of the prompt's conditions the image satisfies, 1 =
correct), or a map holding it at `"score"` (other keys, e.g. a strict 0/1 `"correct"`, are ignored).
"""

from __future__ import annotations

import numbers
from typing import Any, Sequence

from miles.config.sections import RewardConfig
from miles.rollout.rm_hub.remote import post_samples, request_limits
from miles.types import Sample
from miles.utils.errors import MilesUserError

FLAG = "--geneval-url"


def check_geneval_metadata(sample: Sample) -> None:
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    if not isinstance(metadata.get("tag"), str) or not isinstance(metadata.get("include"), list):
        raise MilesUserError(
            f"--rm-type geneval: sample {sample.index} (prompt {sample.prompt[:60]!r}) needs GenEval metadata, a "
            f"string 'tag' and an 'include' list (got keys {sorted(metadata)}); use the GenEval prompt file's rows"
        )


def geneval_score(value: Any, sample: Sample, url: str) -> Any:
    """The score out of one entry of the service's `rewards` list (the dispatcher checks it is finite)."""
    if isinstance(value, dict):
        if "score" not in value:
            raise MilesUserError(f"{FLAG} {url}: the answer for sample {sample.index} is a map without 'score' "
                                 f"(keys {sorted(value)})")
        value = value["score"]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise MilesUserError(f"{FLAG} {url}: the answer for sample {sample.index} is {value!r}, not a score")
    return value


async def geneval_rm(reward_config: RewardConfig, samples: Sequence[Sample]) -> list[Any]:
    url = reward_config.geneval_url
    if not url:
        raise MilesUserError("--rm-type geneval needs --geneval-url")
    for sample in samples:
        check_geneval_metadata(sample)
    answers = await post_samples(url, samples, *request_limits(reward_config), flag=FLAG)
    return [geneval_score(answer, sample, url) for answer, sample in zip(answers, samples)]
