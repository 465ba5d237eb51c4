"""The rollout side of the loop: engines, the router, prompt data, rewards, advantages and eval.

`generate(rollout_id)` returns the rollout's samples (trajectories, rewards, advantages), flattened in
group-contiguous order. Without engines (`--train-only`, `--load-debug-rollout-data`) the samples come
from the SFT dataset or from a saved rollout.

At start-up the model rewards the run names (`--rm-type`, the eval sets' `rm_type`) load their workers, behind a
progress bar; with `--colocate-reward` those workers go onto the rollout GPUs' placement-group bundles.
`eval(rollout_id)` logs each eval set's reward and reward components and writes its image grid under
`<--output-dir>/eval/<rollout_id>/`.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import torch

from miles.config.sections import RunConfig
from miles.logging.lifecycle import evaluated_line
from miles.logging.plots import save_eval_grid
from miles.ray.engines import EngineFleet
from miles.ray.shutdown import on_run_exit
from miles.rollout.advantages import assign_advantages
from miles.rollout.data_source import build_data_source
from miles.rollout.eval_config import build_eval_datasets
from miles.rollout.hooks import apply_rollout_sample_filter, call_rollout_function, call_rollout_log, load_rollout_hooks
from miles.rollout.rm_hub import (
    configured_reward_types,
    load_reward_models,
    model_reward_workers,
    reward_component_metrics,
)
from miles.types import PolicyGradientAsk, Sample
from miles.utils.device_memory import peak_memory_metrics
from miles.utils.errors import MilesUserError, PartDiedError
from miles.utils.safe_load import load_plain, save_plain

logger = logging.getLogger(__name__)
T = TypeVar("T")


class RolloutManager:
    def __init__(self, config: RunConfig, placement, run_logger) -> None:
        # The one configuration of the rollout side; user hooks get it as the read-only `args` from
        # miles/rollout/hooks.py, where they are called.
        self.config = config
        self.run_logger = run_logger
        self.hooks = load_rollout_hooks(config)
        self.sft_dataset = None
        self.data_source = None
        if config.trainer.loss_type == "sft_loss":
            from miles.rollout.sft_data import build_sft_dataset

            self.sft_dataset = build_sft_dataset(config)
        elif not config.debug.load_debug_rollout_data:
            self.data_source = build_data_source(config)
        self.eval_datasets = build_eval_datasets(config.eval_sets) if not config.debug.train_only else []
        self.fleet = EngineFleet(config, placement) if placement.num_engines > 0 else None
        if self.data_source is not None or self.eval_datasets:
            self._load_rewards(placement)
        self.weight_version = 0  # the engines' weights, as the train loop last pushed them
        self._watcher: threading.Thread | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._ahead: tuple[int, Future] | None = None  # (rollout id, its samples and metrics) generated ahead
        self._state_before_ahead: dict[str, Any] | None = None
        self._stop_watching = threading.Event()
        on_run_exit("the rollout engines, the router and the engine watcher", self.shutdown)

    def _load_rewards(self, placement) -> None:
        """Start the model rewards' workers now, so a bad model path fails before the first rollout."""
        reward_config = self.config.reward
        reward_types = configured_reward_types(reward_config, [dataset.rm_type for dataset in self.eval_datasets])
        if reward_config.colocate_reward:
            from miles.rollout.rm_hub.workers import colocate_reward_workers

            rollout_bundles = list(range(placement.num_engines * placement.gpus_per_engine))
            colocate_reward_workers(placement.rollout.placement_group, rollout_bundles,
                                    model_reward_workers(reward_config, reward_types),
                                    on_gpu=placement.device == "cuda")
        load_reward_models(reward_config, reward_types)

    # ---- engines ------------------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self._weight_version, self._weights_since = version, time.perf_counter()

    @property
    def has_engines(self) -> bool:
        return self.fleet is not None

    def launch_engines(self) -> None:
        """Start the engine processes loading, without waiting (the trainer loads meanwhile)."""
        if self.fleet is not None:
            self.fleet.launch()

    def wait_for_engines(self) -> None:
        """Wait until every engine serves, then start the router in front of them."""
        if self.fleet is not None:
            self.fleet.wait_until_started()
            self.config = self.config.with_router_url(self.fleet.router_url)  # hooks see args.miles_router_url
            # into the first record, beside perf/startup/*: the slowest engine's load, which the trainer's
            # start-up overlaps
            self.run_logger.log(0, {"perf/engine_load_s": max(self.fleet.load_seconds(), default=0.0)})

    def engine_urls(self) -> list[str]:
        return self.fleet.engine_urls() if self.fleet is not None else []

    def release_memory(self) -> None:
        if self.fleet is not None:
            self.survive_engine_death("releasing their memory",
                                      lambda: self.fleet.post_all("/release_memory_occupation"))

    def resume_memory(self) -> None:
        if self.fleet is not None:
            self.survive_engine_death("resuming their memory",
                                      lambda: self.fleet.post_all("/resume_memory_occupation"))

    def survive_engine_death(self, what: str, call: Callable[[], T]) -> T:
        """`call()` (a request to every engine: release, resume, a weight sync); if it fails because an engine
        died (while the trainer trained, or during the call), restart the dead engines and call again under
        --use-fault-tolerance, else end the run in one line naming the engine. An engine the watcher restarted
        while the call ran (it died, as in a rollout sent ahead, and came back at another address) counts too. Other
        failures raise as they are."""
        restarts = self.fleet.restarts if self.fleet is not None else 0
        try:
            return call()
        except Exception as err:  # noqa: BLE001 - classified below: a dead engine, or re-raised unchanged
            if self.fleet is None:
                raise
            dead = self.fleet.dead_engines()
            if dead:
                names = "; ".join(self.fleet.describe_engine(index) for index in dead)
                if not self.config.rollout.use_fault_tolerance:
                    raise PartDiedError(f"{names} died before or during {what} ({type(err).__name__}); "
                                        "--use-fault-tolerance restarts dead engines") from None
                logger.warning("%s died before or during %s; restarting it and trying again", names, what)
            self.fleet.restart_dead_engines()  # after a restart the watcher has under way, if any
            if self.fleet.restarts == restarts:
                raise
            if not dead:
                logger.warning("an engine was restarted during %s; trying again", what)
            return call()

    def engine_memory(self) -> list:
        """Every engine's GPU memory as `DeviceMemory` (empty on a CPU run)."""
        if self.fleet is None:
            return []
        return self.survive_engine_death("reading their memory", self.fleet.memory_stats)

    def watch_engines(self, on_restart: Callable[[str], None]) -> None:
        """`--use-fault-tolerance`: restart a dead engine with the current weights, in the background."""
        if self.fleet is None or not self.config.rollout.use_fault_tolerance:
            return
        self.fleet.on_restart = on_restart
        self._watcher = threading.Thread(target=self._watch, name="engine-watcher", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        time.sleep(self.config.rollout.rollout_health_check_first_wait)
        while not self._stop_watching.wait(self.config.rollout.rollout_health_check_interval):
            try:
                self.fleet.restart_dead_engines()
            except Exception:  # keep watching: one failed restart must not end fault tolerance for the run
                logger.exception("restarting a dead engine failed; will retry")

    # ---- rollouts -----------------------------------------------------------------------------------
    def generate(self, rollout_id: int) -> list[Sample]:
        """The rollout's samples with their advantages, logged. With `--overlap-rollout` the rollout started by
        `generate_ahead(rollout_id)` is waited for instead of generating it now."""
        if self._ahead is not None and self._ahead[0] == rollout_id:
            samples, metrics = self._ahead[1].result()
            self._ahead = None
            self._state_before_ahead = None
        else:
            samples, metrics = self._generate_scored(rollout_id)
        staleness = [self.weight_version - s.weight_version for s in samples if s.engine_url is not None]
        if staleness:
            metrics["rollout/staleness"] = sum(staleness) / len(staleness)
        if self.fleet is not None and self.fleet.placement.device == "cuda":
            metrics.update(peak_memory_metrics("perf/engine", self.engine_memory()))
        if not call_rollout_log(self.hooks, self.config, rollout_id, samples, metrics):
            self.run_logger.log(rollout_id, metrics)
            self.run_logger.log_samples(rollout_id, samples)
        if self.config.debug.save_debug_rollout_data:
            path = self.config.debug.save_debug_rollout_data.format(rollout_id, rollout_id=rollout_id)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            save_plain({"rollout_id": rollout_id, "samples": [sample.to_record() for sample in samples]}, path,
                       "--save-debug-rollout-data")
        return samples

    def policy_gradient_ask(self, samples: list[Sample]) -> PolicyGradientAsk | None:
        """`--diffusion-rollout-gradient`: what the trainer asks the engines for, which kept each sample's
        Σ_k ∇ℓ_{b,k}: per engine, c_b = −clip(A_b)/P for its samples, P the train pairs of the kept samples (the
        clipped loss's gradient at ratio 1 is Σ_b c_b·G_b, docs/algorithms.md §5). A sample whose engine is not
        known (no URL, or one no longer in the fleet) is asked of every engine. None without the flag."""
        if not self.config.trainer.diffusion_rollout_gradient or self.fleet is None:
            return None
        from miles.diffusion.losses import rollout_gradient_coefficients

        kept = [s for s in samples if not s.remove_sample]
        coefficients = rollout_gradient_coefficients(torch.tensor([float(s.advantage) for s in kept]),
                                                     torch.tensor([len(s.sde_step_indices) for s in kept]),
                                                     self.config.trainer.diffusion_adv_clip_max)
        urls = list(self.fleet.urls)
        by_engine: dict[str, dict[int, float]] = {url: {} for url in urls}
        for sample, coefficient in zip(kept, coefficients.tolist()):
            for url in [sample.engine_url] if sample.engine_url in by_engine else urls:
                by_engine[url][sample.seed] = coefficient
        return PolicyGradientAsk(by_engine, samples=len(kept))

    def generate_ahead(self, rollout_id: int, after_weight_version: int | None = None) -> None:
        """Start generating `rollout_id` in the background while the trainer trains on the previous one;
        `generate(rollout_id)` returns it. `--overlap-rollout` (`after_weight_version` None): on the engines' current
        weights, one step off-policy; `wait_ahead` before the engines' weights change. `--rollout-prefetch`: the
        engines encode its prompts now and denoise them on weights `after_weight_version`, the ones the trainer is
        making (on-policy; nothing waits for it before the weight sync)."""
        self._state_before_ahead = self.state_dict()  # a checkpoint taken meanwhile resumes before this rollout
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-rollout-ahead")
        self._ahead = (rollout_id, self._executor.submit(self._generate_scored, rollout_id, after_weight_version))

    def wait_ahead(self) -> None:
        """Block until the rollout started by `generate_ahead` has all its samples (re-raising its error)."""
        if self._ahead is not None:
            self._ahead[1].result()

    def _generate_scored(self, rollout_id: int, after_weight_version: int | None = None
                         ) -> tuple[list[Sample], dict[str, float]]:
        """Samples with filters and advantages applied, and the rollout's metrics; logs nothing (may run on the
        overlap thread)."""
        start = time.perf_counter()
        samples, metrics = self._produce_samples(rollout_id, after_weight_version)
        if after_weight_version is not None and self.weight_version >= after_weight_version:
            start = max(start, self._weights_since)  # a prefetched rollout's time counts from its weights' push
        rollout_time = time.perf_counter() - start
        apply_rollout_sample_filter(self.hooks, self.config, samples)  # masked samples still count for advantages
        if self.config.trainer.loss_type != "sft_loss":
            metrics.update(assign_advantages(self.config, samples))
        metrics["rollout/num_samples"] = len(samples)
        num_images = sum(1 if s.image is None else s.image.shape[0] for s in samples)
        if rollout_time > 0 and self.sft_dataset is None and not self.config.debug.load_debug_rollout_data:
            metrics["perf/images_per_second"] = num_images / rollout_time
        return samples, metrics

    def _produce_samples(self, rollout_id: int, after_weight_version: int | None = None
                         ) -> tuple[list[Sample], dict[str, float]]:
        """The rollout's samples and the rollout function's own counters (retries, dropped groups, ...)."""
        if self.sft_dataset is not None:
            return self.sft_dataset.next_batch(rollout_id), {}
        if self.config.debug.load_debug_rollout_data:
            return self._load_debug_rollout(rollout_id), {}
        groups = call_rollout_function(self.hooks, self.config, rollout_id, self.data_source,
                                       after_weight_version=after_weight_version)
        samples = [sample for group in groups for sample in group]
        for position, sample in enumerate(samples):
            sample.index = position
        return samples, dict(getattr(groups, "metrics", {}))

    def _load_debug_rollout(self, rollout_id: int) -> list[Sample]:
        path = self.config.debug.load_debug_rollout_data.format(rollout_id, rollout_id=rollout_id)
        if not os.path.exists(path):
            raise MilesUserError(f"--load-debug-rollout-data: {path!r} does not exist (rollout {rollout_id})")
        payload = load_plain(path, "--load-debug-rollout-data")
        records = payload.get("samples") if isinstance(payload, dict) else None
        if not isinstance(records, list):
            raise MilesUserError(f"--load-debug-rollout-data: {path} holds no 'samples' list (not a saved rollout)")
        samples = [Sample.from_record(record, f"--load-debug-rollout-data {path} sample {position}")
                   for position, record in enumerate(records)]
        fraction = self.config.debug.load_debug_rollout_data_subsample
        if fraction is not None:
            group_size = self.config.data.n_samples_per_prompt
            groups = [samples[i : i + group_size] for i in range(0, len(samples), group_size)]
            keep = max(1, int(len(groups) * fraction))
            groups = random.Random(rollout_id).sample(groups, keep)
            samples = [s for g in groups for s in g]
        return samples

    # ---- eval ---------------------------------------------------------------------------------------
    def should_eval(self, rollout_id: int, final: bool = False) -> bool:
        """The schedule's rule (miles.config.schedule.eval_due); `final`: the eval after the last rollout."""
        from miles.config.schedule import eval_due

        if not self.eval_datasets or self.fleet is None:
            return False
        evaluation, num_rollout = self.config.evaluation, self.config.data.num_rollout
        return eval_due(evaluation.eval_interval, evaluation.skip_eval_before_train,
                        num_rollout if final else rollout_id, num_rollout)

    def eval(self, rollout_id: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for dataset in self.eval_datasets:
            groups = call_rollout_function(self.hooks, self.config, rollout_id, dataset, evaluation=True)
            samples = [sample for group in groups for sample in group]
            rewards = torch.tensor([dataset.scalar_reward(s.reward) for s in samples])
            dataset_metrics = {
                f"eval/{dataset.name}/reward_mean": rewards.mean().item(),
                f"eval/{dataset.name}/reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
                **reward_component_metrics([s.reward for s in samples], f"eval/{dataset.name}/"),
            }
            if not call_rollout_log(self.hooks, self.config, rollout_id, samples, dataset_metrics, evaluation=True):
                self.run_logger.log(rollout_id, dataset_metrics)
                self.run_logger.log_samples(rollout_id, samples, prefix=f"eval/{dataset.name}")
                folder = os.path.join(self.config.logging.output_dir, "eval", str(rollout_id))
                grid = save_eval_grid(groups, folder, dataset.name)
                logger.info(evaluated_line(rollout_id, dataset.name, dataset_metrics, len(samples), grid))
            metrics.update(dataset_metrics)
        return metrics

    # ---- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any] | None:
        if self._state_before_ahead is not None:  # the overlapped rollout is not trained on yet: regenerate it
            return self._state_before_ahead
        source = self.data_source or self.sft_dataset
        return source.state_dict() if source is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        source = self.data_source or self.sft_dataset
        if state and source is not None:
            source.load_state_dict(state)

    def shutdown(self) -> None:
        """Stop the engine watcher, the engines and the router; idempotent (the loop's end and the run's cleanup
        both call it)."""
        self._stop_watching.set()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._watcher is not None:
            self._watcher.join(timeout=self.config.rollout.rollout_health_check_timeout)
        if self.fleet is not None:
            self.fleet.shutdown()

