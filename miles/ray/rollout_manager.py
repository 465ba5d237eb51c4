"""The rollout side of the loop: engines, the router, prompt data, rewards, advantages and eval.

`generate(rollout_id)` returns the rollout's samples (trajectories, rewards, advantages), flattened in
group-contiguous order. Without engines (`--train-only`, `--load-debug-rollout-data`) the samples come
from the SFT dataset or from a saved rollout.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from typing import Any, Callable

import torch

from miles.ray.engines import EngineFleet
from miles.ray.shutdown import on_run_exit
from miles.rollout.advantages import assign_advantages
from miles.rollout.data_source import build_data_source
from miles.rollout.eval_config import build_eval_datasets
from miles.rollout.hooks import apply_rollout_sample_filter, load_rollout_hooks
from miles.types import Sample
from miles.utils.errors import MilesUserError
from miles.utils.safe_load import load_plain, save_plain

logger = logging.getLogger(__name__)


class RolloutManager:
    def __init__(self, args, placement, run_logger) -> None:
        self.args = args
        self.run_logger = run_logger
        self.hooks = load_rollout_hooks(args)
        self.sft_dataset = None
        self.data_source = None
        if args.loss_type == "sft_loss":
            from miles.rollout.sft_data import build_sft_dataset

            self.sft_dataset = build_sft_dataset(args)
        elif not args.load_debug_rollout_data:
            self.data_source = build_data_source(args)
        self.eval_datasets = build_eval_datasets(args) if not args.train_only else []
        self.fleet = EngineFleet(args, placement) if placement.num_engines > 0 else None
        if placement.reward is not None:
            # the reward workers go where the placement reserved them (beside the engines with
            # --colocate-reward, on GPUs of their own otherwise), not wherever Ray finds room at first use
            from miles.rollout.rm_hub.pickscore import get_pickscore_pool

            get_pickscore_pool(args, actor_options=placement.reward.actor_options())
        self.weight_version = 0
        self._watcher: threading.Thread | None = None
        self._stop_watching = threading.Event()
        on_run_exit("the rollout engines, the router and the engine watcher", self.shutdown)

    # ---- engines ------------------------------------------------------------------------------------
    @property
    def has_engines(self) -> bool:
        return self.fleet is not None

    def start_engines(self) -> None:
        if self.fleet is not None:
            self.fleet.start()
            self.args.miles_router_url = self.fleet.router_url

    def engine_urls(self) -> list[str]:
        return self.fleet.engine_urls() if self.fleet is not None else []

    def release_memory(self) -> None:
        if self.fleet is not None:
            self.fleet.post_all("/release_memory_occupation")

    def resume_memory(self) -> None:
        if self.fleet is not None:
            self.fleet.post_all("/resume_memory_occupation")

    def engine_memory(self) -> list:
        """Every engine's GPU memory as `DeviceMemory` (empty on a CPU run)."""
        return self.fleet.memory_stats() if self.fleet is not None else []

    def watch_engines(self, on_restart: Callable[[str], None]) -> None:
        """`--use-fault-tolerance`: restart a dead engine with the current weights, in the background."""
        if self.fleet is None or not self.args.use_fault_tolerance:
            return
        self.fleet.on_restart = on_restart
        self._watcher = threading.Thread(target=self._watch, name="engine-watcher", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        time.sleep(self.args.rollout_health_check_first_wait)
        while not self._stop_watching.wait(self.args.rollout_health_check_interval):
            try:
                self.fleet.restart_dead_engines()
            except Exception:  # keep watching: one failed restart must not end fault tolerance for the run
                logger.exception("restarting a dead engine failed; will retry")

    # ---- rollouts -----------------------------------------------------------------------------------
    def generate(self, rollout_id: int) -> list[Sample]:
        start = time.perf_counter()
        samples, metrics = self._produce_samples(rollout_id)
        rollout_time = time.perf_counter() - start
        apply_rollout_sample_filter(self.hooks, self.args, samples)  # masked samples still count for advantages
        if self.args.loss_type != "sft_loss":
            metrics.update(assign_advantages(self.args, samples))
        metrics["rollout/num_samples"] = len(samples)
        num_images = sum(1 if s.image is None else s.image.shape[0] for s in samples)
        if rollout_time > 0 and self.sft_dataset is None and not self.args.load_debug_rollout_data:
            metrics["perf/images_per_second"] = num_images / rollout_time
        skip_default = self.hooks.rollout_log is not None and self.hooks.rollout_log(rollout_id, self.args, samples, metrics)
        if not skip_default:
            self.run_logger.log(rollout_id, metrics)
            self.run_logger.log_samples(rollout_id, samples)
        if self.args.save_debug_rollout_data:
            path = self.args.save_debug_rollout_data.format(rollout_id, rollout_id=rollout_id)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            save_plain({"rollout_id": rollout_id, "samples": [sample.to_record() for sample in samples]}, path,
                       "--save-debug-rollout-data")
        return samples

    def _produce_samples(self, rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
        """The rollout's samples and the rollout function's own counters (retries, dropped groups, ...)."""
        if self.sft_dataset is not None:
            return self.sft_dataset.next_batch(rollout_id), {}
        if self.args.load_debug_rollout_data:
            return self._load_debug_rollout(rollout_id), {}
        groups = self.hooks.rollout_function(self.args, rollout_id, self.data_source, evaluation=False)
        samples = [sample for group in groups for sample in group]
        for position, sample in enumerate(samples):
            sample.index = position
        return samples, dict(getattr(groups, "metrics", {}))

    def _load_debug_rollout(self, rollout_id: int) -> list[Sample]:
        path = self.args.load_debug_rollout_data.format(rollout_id, rollout_id=rollout_id)
        if not os.path.exists(path):
            raise MilesUserError(f"--load-debug-rollout-data: {path!r} does not exist (rollout {rollout_id})")
        payload = load_plain(path, "--load-debug-rollout-data")
        records = payload.get("samples") if isinstance(payload, dict) else None
        if not isinstance(records, list):
            raise MilesUserError(f"--load-debug-rollout-data: {path} holds no 'samples' list (not a saved rollout)")
        samples = [Sample.from_record(record, f"--load-debug-rollout-data {path} sample {position}")
                   for position, record in enumerate(records)]
        fraction = self.args.load_debug_rollout_data_subsample
        if fraction is not None:
            group_size = self.args.n_samples_per_prompt
            groups = [samples[i : i + group_size] for i in range(0, len(samples), group_size)]
            keep = max(1, int(len(groups) * fraction))
            groups = random.Random(rollout_id).sample(groups, keep)
            samples = [s for g in groups for s in g]
        return samples

    # ---- eval ---------------------------------------------------------------------------------------
    def should_eval(self, rollout_id: int, final: bool = False) -> bool:
        if not self.eval_datasets or self.fleet is None or not self.args.eval_interval:
            return False
        if final:
            return True
        if rollout_id == 0:
            return not self.args.skip_eval_before_train
        return rollout_id % self.args.eval_interval == 0

    def eval(self, rollout_id: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for dataset in self.eval_datasets:
            groups = self.hooks.eval_function(self.args, rollout_id, dataset, evaluation=True)
            samples = [sample for group in groups for sample in group]
            rewards = torch.tensor([dataset.scalar_reward(s.reward) for s in samples])
            dataset_metrics = {
                f"eval/{dataset.name}/reward_mean": rewards.mean().item(),
                f"eval/{dataset.name}/reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
            }
            skip = self.hooks.eval_rollout_log is not None and self.hooks.eval_rollout_log(
                rollout_id, self.args, samples, dataset_metrics
            )
            if not skip:
                self.run_logger.log(rollout_id, dataset_metrics)
                self.run_logger.log_samples(rollout_id, samples, prefix=f"eval/{dataset.name}")
            metrics.update(dataset_metrics)
        return metrics

    # ---- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any] | None:
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
        if self._watcher is not None:
            self._watcher.join(timeout=self.args.rollout_health_check_timeout)
        if self.fleet is not None:
            self.fleet.shutdown()

