"""The diffusion rollout: prompt groups -> microgroup requests through the router -> scored samples.

`generate_rollout(args, rollout_id, data_source, evaluation=False) -> list[list[Sample]]`

Training (`evaluation=False`): `data_source` is a RolloutDataSource (`get_samples(num_groups)`). The rollout
takes `--rollout-batch-size` groups, reads each group's input image once (a row's `"image"`, resized to the output
size; `condition_image.py`), splits each group of `--n-samples-per-prompt` samples into microgroups of
`--rollout-microgroup-size` (the last one may be smaller), and sends every microgroup as one request:
- seed: `request_seed(--rollout-seed, group_index, G, offset)` (docs/algorithms.md §3); sample b of the
  microgroup gets seed + b on the engine;
- SDE steps and returned latents: the step strategy (`resolve_step_strategy(config)`), evaluated on the
  microgroup's first sample with that seed;
- each microgroup is scored by `batched_async_rm` as soon as it returns (a whole group at once with
  `--group-rm`);
- `--over-sampling-batch-size` groups (default `--rollout-batch-size`) start at once, so that a filter dropping
  some still leaves a full batch without waiting for replacements;
- a finished group goes through `--dynamic-sampling-filter-path`; a dropped group is replaced by a new one from
  the data source until `--rollout-batch-size` groups are kept (at most `MAX_GROUPS_FACTOR` × that many groups
  are generated: a filter that keeps (almost) nothing ends the rollout with a MilesUserError); once enough are
  kept, groups still in flight are cancelled, and kept groups beyond the batch are left out (the earliest prompts
  are kept); both count in `rollout/num_groups_unused`;
The result is group-contiguous, ordered by group_index, with `sample.index` renumbered 0..P·G−1, and carries
the rollout's metrics as `.metrics` (a `RolloutGroups` list). `--rollout-sample-filter-path` is applied by the
caller (the RolloutManager), once, after the rollout.

Evaluation (`evaluation=True`): plain generation — every step is an ODE step, no latents or conditioning come
back, rewards are scored with `evaluation=True`, and no filter runs. `data_source` is then either
- an `EvalDataset` (`miles.rollout.eval_config`): its prompts, `n_samples_per_eval_prompt`, `num_steps` and
  `rm_type` are used (a row's `metadata.rm_type` wins), or
- a list of groups (`list[list[Sample]]`, each the samples of one prompt), generated with
  `--diffusion-eval-num-steps` (default `--diffusion-num-steps`).
Eval seeds use the group's position in the eval set as group_index, so every evaluation sees the same noise. A
progress bar counts the eval samples (shown once the eval has run a few seconds).

`--custom-generate-function-path`: `async fn(args, group, sampling_params) -> list[Sample]` replaces the HTTP
call for each microgroup (`group` = the microgroup's samples; `sampling_params` = the request's fields as a dict
plus `router_url`). Samples it returns with `reward` already set are not scored again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import time
import uuid
from typing import Sequence

from miles.config.sections import RunConfig, run_config_of
from miles.engine.protocol import ConditionImage, GenerateRequest
from miles.rollout.condition_image import load_condition_image
from miles.rollout.engine_client import EngineClient, EngineRequestError
from miles.rollout.hooks import RolloutHooks, apply_dynamic_sampling_filter, call_generate, load_rollout_hooks
from miles.rollout.rm_hub import batched_async_rm
from miles.rollout.step_strategy_hub import request_seed, resolve_step_strategy
from miles.types import GuidanceConfig, Sample
from miles.utils.async_utils import run_sync
from miles.utils.errors import MilesUserError
from miles.utils.progress import progress_bar

logger = logging.getLogger(__name__)

MAX_GROUPS_FACTOR = 10

__all__ = ["generate_rollout", "generate_rollout_async", "RolloutGroups", "EngineRequestError", "build_request"]


class RolloutGroups(list):
    """The list of groups `generate_rollout` returns, carrying the rollout's metrics (`.metrics`:
    rollout/num_groups_dropped, rollout/num_retries, ...) for the caller to log."""

    def __init__(self, groups: list[list[Sample]], metrics: dict[str, float]):
        super().__init__(groups)
        self.metrics = metrics


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False,
                     after_weight_version: int | None = None) -> list[list[Sample]]:
    """See the module docstring. Synchronous; runs its own event loop (on a helper thread if one is running).
    The result is a `RolloutGroups` (a list of groups) whose `.metrics` holds the rollout's counters. `args`: the
    hook signature's read-only args (users wrap this function); the rollout reads the typed config behind them.
    `after_weight_version`: the engines denoise this rollout's requests only on weights of that version or later
    (`--rollout-prefetch`: the rollout is sent while the trainer trains on the previous one)."""
    groups, metrics = run_sync(generate_rollout_async(args, rollout_id, data_source, evaluation, after_weight_version))
    return RolloutGroups(groups, metrics)


# ---- requests ------------------------------------------------------------------------------------------------


def build_request(
    config: RunConfig,
    prompt: str,
    num_samples: int,
    seed: int,
    num_steps: int,
    sde_step_indices: Sequence[int],
    return_latent_indices: Sequence[int],
    evaluation: bool,
    image: ConditionImage | None = None,
    after_weight_version: int | None = None,
) -> GenerateRequest:
    """A GenerateRequest from the run's `--diffusion-*` flags (its sampling section); `image`: the prompt row's
    input image, read by `condition_image.load_condition_image`; `after_weight_version`: as `generate_rollout`'s."""
    sampling = config.sampling
    return GenerateRequest(
        prompt=prompt,
        num_samples=num_samples,
        seed=seed,
        num_steps=num_steps,
        negative_prompt=sampling.diffusion_negative_prompt,
        guidance=GuidanceConfig(
            guidance_scale=sampling.diffusion_guidance_scale,
            guidance_scale_2=sampling.diffusion_guidance_scale_2,
            true_cfg_scale=sampling.diffusion_true_cfg_scale,
        ),
        noise_level=sampling.diffusion_noise_level,
        sde_type=sampling.diffusion_sde_type,
        log_prob_no_const=sampling.diffusion_log_prob_no_const,
        sde_step_indices=list(sde_step_indices),
        # --diffusion-rollout-gradient: the engine keeps the gradients; no trajectory goes to the trainer
        return_latent_indices=[] if config.trainer.diffusion_rollout_gradient else list(return_latent_indices),
        height=sampling.diffusion_height,
        width=sampling.diffusion_width,
        num_frames=sampling.diffusion_output_num_frames,
        fps=sampling.diffusion_fps,
        flow_shift=sampling.diffusion_flow_shift,
        debug=config.debug.diffusion_debug_mode and not evaluation,
        evaluation=evaluation,
        request_id=uuid.uuid4().hex[:16],
        image=image,
        rollout_gradient=config.trainer.diffusion_rollout_gradient and not evaluation,
        after_weight_version=after_weight_version,
    )


class _Rollout:
    """State of one generate_rollout call."""

    def __init__(self, config: RunConfig, rollout_id: int, hooks: RolloutHooks, client: EngineClient,
                 evaluation: bool, after_weight_version: int | None = None):
        self.config = config
        self.rollout_id = rollout_id
        self.after_weight_version = after_weight_version
        self.hooks = hooks
        self.client = client
        self.evaluation = evaluation
        self.strategy = None if evaluation else resolve_step_strategy(config)
        self.microgroup_size = max(1, config.rollout.rollout_microgroup_size)
        self.num_steps = config.sampling.diffusion_num_steps
        self.group_rm = config.reward.group_rm
        # engine-side seconds of this rollout's requests: where a rollout's time goes (bench/RESULTS.md)
        self.engine_seconds = empty_engine_seconds()
        self.engine_step_clocks: dict[str, tuple[float, float]] = {}  # engine url -> its step clock's span

    async def generate_group(self, group: list[Sample], group_index: int, group_size: int) -> list[Sample]:
        """Generate and score one prompt group (its microgroups run concurrently)."""
        offsets = range(0, len(group), self.microgroup_size)
        image = await self.condition_image(group[0])
        await asyncio.gather(*(self.generate_microgroup(group, offset, group_index, group_size, image)
                               for offset in offsets))
        if self.group_rm:
            await self.score(group)
        return group

    async def condition_image(self, sample: Sample) -> ConditionImage | None:
        """The group's input image, read once (off the event loop) at the output size; None for a text prompt."""
        if sample.input_image is None:
            return None
        sampling = self.config.sampling
        return await asyncio.to_thread(load_condition_image, sample.input_image, sampling.diffusion_height,
                                       sampling.diffusion_width, f"prompt group {sample.group_index}")

    async def generate_microgroup(self, group: list[Sample], offset: int, group_index: int, group_size: int,
                                  image: ConditionImage | None = None) -> None:
        """Fill `group[offset : offset + microgroup_size]` from one request (or the custom generate hook)."""
        samples = group[offset : offset + self.microgroup_size]
        seed = request_seed(self.config.sampling.rollout_seed, group_index, group_size, offset)
        if self.evaluation:
            sde_steps, return_latents = [], []
        else:
            sde_steps, return_latents = self.strategy(self.config, samples[0], self.num_steps, seed)
        request = build_request(self.config, samples[0].prompt, len(samples), seed, self.num_steps, sde_steps,
                                return_latents, self.evaluation, image, self.after_weight_version)
        if self.hooks.custom_generate is not None:
            params = {f.name: getattr(request, f.name) for f in dataclasses.fields(request)}
            params["router_url"] = self.client.router_url
            returned = await call_generate(self.hooks, self.config, samples, params)
            if not isinstance(returned, list) or len(returned) != len(samples) or not all(
                isinstance(s, Sample) for s in returned
            ):
                raise MilesUserError(
                    f"--custom-generate-function-path must return a list of {len(samples)} Samples, got "
                    f"{len(returned) if isinstance(returned, list) else type(returned).__name__}"
                )
            group[offset : offset + len(samples)] = returned  # the hook may return new Sample objects
            samples = returned
        else:
            response, engine_url = await self.client.generate(request)
            if len(response.samples) != len(samples):
                raise EngineRequestError(f"engine {engine_url} returned {len(response.samples)} samples for {len(samples)}")
            for sample, result in zip(samples, response.samples):
                result.fill_sample(sample, request, response.weight_version, engine_url)
            add_engine_timings(self.engine_seconds, self.engine_step_clocks, response.timings, engine_url)
        if not self.group_rm:
            await self.score(samples)

    async def score(self, samples: list[Sample]) -> None:
        unscored = [s for s in samples if s.reward is None]
        if not unscored:
            return
        rewards = await batched_async_rm(self.config, unscored, evaluation=self.evaluation)
        for sample, reward in zip(unscored, rewards):
            sample.reward = reward


def empty_engine_seconds() -> dict[str, float]:
    """A rollout's engine-side seconds before its first response (`add_engine_timings` fills them)."""
    return dict.fromkeys(("start", "denoise", "decode", "pack", "request", "compile", "weights_wait"), 0.0)


def add_engine_timings(seconds: dict[str, float], step_clocks: dict[str, tuple[float, float]],
                       timings: dict[str, float], engine_url: str) -> None:
    """Add one response's engine timings to a rollout's `seconds`. An engine's requests start (encode the prompt) on
    its worker, decode on its device and pack their results on its packer thread, one after another (they add);
    its denoising time is the span of
    its step clock over the rollout's requests (`step_clocks`: requests that share steps count them once, waves
    one after another add up), the slowest engine's. The request time is the longest request's, queue included,
    its wait for weights not yet pushed left out."""
    if "step_clock_end" in timings:  # every engine's scheduler gives it
        start, end = float(timings["step_clock_start"]), float(timings["step_clock_end"])
        first, last = step_clocks.get(engine_url, (start, end))
        step_clocks[engine_url] = span = (min(first, start), max(last, end))
        seconds["denoise"] = max(seconds["denoise"], span[1] - span[0])
    seconds["compile"] = max(seconds["compile"], float(timings.get("compile", 0.0)))  # in denoise and decode
    for part in ("start", "decode", "pack"):
        seconds[part] += float(timings.get(part, 0.0))
    # a request sent ahead of its weights (--rollout-prefetch) leaves out its wait for them: the trainer trained
    weights_wait = float(timings.get("weights_wait", 0.0))
    seconds["weights_wait"] = max(seconds["weights_wait"], weights_wait)
    request = float(timings.get("total", 0.0)) + float(timings.get("queue", 0.0)) - weights_wait
    seconds["request"] = max(seconds["request"], request)


def _get_groups(data_source, num_groups: int, rollout_id: int) -> list[list[Sample]]:
    get = data_source.get_samples
    if "rollout_id" in inspect.signature(get).parameters:
        return get(num_groups, rollout_id=rollout_id)
    return get(num_groups)


def _eval_groups(data_source) -> tuple[list[list[Sample]], int | None]:
    """(groups, num_steps override) for an EvalDataset or a plain list of groups."""
    if hasattr(data_source, "load_prompts"):
        n = int(getattr(data_source, "n_samples_per_eval_prompt", 1) or 1)
        rm_type = getattr(data_source, "rm_type", None)
        groups = []
        for group_index, row in enumerate(data_source.load_prompts()):
            metadata = dict(row.metadata or {})
            if rm_type:
                metadata.setdefault("rm_type", rm_type)
            groups.append([Sample(prompt=row.prompt, group_index=group_index, metadata=dict(metadata),
                                  input_image=row.image) for _ in range(n)])
        return groups, int(getattr(data_source, "num_steps", 0) or 0) or None
    groups = list(data_source)
    if not all(isinstance(g, list) and g and all(isinstance(s, Sample) for s in g) for g in groups):
        raise MilesUserError("evaluation=True takes an EvalDataset or a list of groups (non-empty lists of Samples)")
    return groups, None


def _reindex(groups: list[list[Sample]]) -> None:
    position = 0
    for group in groups:
        for sample in group:
            sample.index = position
            position += 1


async def generate_rollout_async(
    args, rollout_id: int, data_source, evaluation: bool = False, after_weight_version: int | None = None
) -> tuple[list[list[Sample]], dict[str, float]]:
    """The rollout as a coroutine; returns (groups, metrics). `args`, `after_weight_version`: as for
    `generate_rollout`."""
    config = run_config_of(args)
    hooks = load_rollout_hooks(config)
    began = time.perf_counter()
    async with EngineClient(config) as client:
        rollout = _Rollout(config, rollout_id, hooks, client, evaluation, after_weight_version)
        if evaluation:
            groups, num_steps = _eval_groups(data_source)
            rollout.num_steps = num_steps or config.eval_sets.num_steps
            name = getattr(data_source, "name", None) or "groups"
            with progress_bar(sum(map(len, groups)), f"eval {name}", unit="sample") as bar:

                async def generate_counted(group: list[Sample], group_index: int) -> None:
                    await rollout.generate_group(group, group_index, len(group))
                    bar.update(len(group))

                await asyncio.gather(*(generate_counted(g, i) for i, g in enumerate(groups)))
            _reindex(groups)
            metrics = {"eval/rollout_seconds": time.perf_counter() - began, "eval/num_samples": sum(map(len, groups))}
            return groups, metrics
        kept, generated, dropped, unused = await _generate_train_groups(config, rollout_id, data_source, rollout)
        stats = dict(client.stats)
    kept.sort(key=lambda g: g[0].group_index)
    _reindex(kept)
    metrics = {
        "rollout/seconds": time.perf_counter() - began,
        "rollout/num_groups_generated": generated,
        "rollout/num_groups_dropped": dropped,
        "rollout/num_groups_unused": unused,
        "rollout/num_requests": stats["requests"],
        "rollout/num_retries": stats["retries"],
        **{f"rollout/engine_{name}_seconds": value for name, value in rollout.engine_seconds.items()},
    }
    logger.debug("rollout %d: %s", rollout_id, metrics)  # the run logger's line shows the main ones
    return kept, metrics


async def _generate_train_groups(config: RunConfig, rollout_id: int, data_source, rollout: _Rollout):
    """(kept groups, generated, dropped, unused): `--over-sampling-batch-size` groups start at once (default
    `--rollout-batch-size`); a dropped group is replaced until `--rollout-batch-size` groups are kept; groups
    beyond that (finished late or cancelled in flight) are unused."""
    target = config.data.rollout_batch_size
    if target <= 0:
        raise MilesUserError(f"--rollout-batch-size must be > 0, got {target}")
    first_wave = max(target, config.rollout.over_sampling_batch_size or target)
    max_groups = max(MAX_GROUPS_FACTOR * target, first_wave)
    group_size = config.data.n_samples_per_prompt
    kept: list[list[Sample]] = []
    in_flight: set[asyncio.Task] = set()
    generated = dropped = 0
    bar = progress_bar(target, f"rollout {rollout_id}", unit="group")
    try:
        while len(kept) < target:
            need = (first_wave if generated == 0 else target) - len(kept) - len(in_flight)
            if need > 0:
                if generated >= max_groups:
                    raise MilesUserError(
                        f"--dynamic-sampling-filter-path kept {len(kept)} of {generated} groups, fewer than "
                        f"--rollout-batch-size {target} after {MAX_GROUPS_FACTOR}x that many; check the filter"
                    )
                new_groups = _get_groups(data_source, need, rollout_id)
                if not new_groups and not in_flight:
                    raise MilesUserError(f"the data source ran out of prompts with {len(kept)}/{target} groups kept")
                for group in new_groups:
                    generated += 1
                    in_flight.add(asyncio.ensure_future(rollout.generate_group(group, group[0].group_index, group_size)))
            done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            # every failed group's error read (none is reported again at exit as unretrieved), the first re-raised
            errors = [error for error in (task.exception() for task in done) if error is not None]
            if errors:
                raise errors[0]
            finished = [task.result() for task in done]
            keep, drop = apply_dynamic_sampling_filter(rollout.hooks, config, finished)
            kept.extend(keep)
            dropped += len(drop)
            bar.update(min(len(keep), target - bar.n))
    finally:
        bar.close()
        unused = len(in_flight)
        for task in in_flight:
            task.cancel()
        if in_flight:
            await asyncio.gather(*in_flight, return_exceptions=True)
    kept.sort(key=lambda g: g[0].group_index)  # surplus kept groups: the batch takes the earliest prompts
    unused += len(kept) - target
    return kept[:target], generated, dropped, unused
