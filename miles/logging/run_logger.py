"""Everything a run reports: the metrics JSONL, the console line, wandb, TensorBoard, phase timings and the
final plots.

Metric names are stable: `rollout/*` (rewards, advantages), `train/*` (losses, ratios, grad norm, lr),
`eval/<name>/*`, `perf/*` (phase times, images/s, pairs/s, MFU). One JSON line per rollout id goes to
`--metrics-path` (default `<output-dir>/metrics.jsonl`).

Every second of an iteration is accounted for: the loop opens each iteration with `begin_iteration` and times
its parts with `phase`; `flush` adds `perf/iteration_time` and `perf/unaccounted_time` (the iteration minus
its phases). An iteration's clock starts when the previous one's `flush` starts, so that flush's own writing is
the `perf/log_time` phase of the next record and the records tile the run's wall time without gaps.
`perf/startup_time` (process start to the first iteration) comes with the first record.

`--use-tensorboard` writes every record's scalars, at step = rollout id, to `<output-dir>/tensorboard`
(torch.utils.tensorboard; scalars only: images stay on disk and in wandb).
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from miles.config.sections import RunConfig
from miles.logging.dashboard import PhaseTimeline
from miles.logging.plots import save_reward_curve, save_sample_grid

logger = logging.getLogger(__name__)


def setup_console_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


class RunLogger:
    """Collects one rollout's metrics, then writes them everywhere at `flush`."""

    def __init__(self, config: RunConfig, started_at: float | None = None) -> None:
        """`started_at`: the `time.perf_counter()` reading at process start, for `perf/startup_time`."""
        setup_console_logging()
        self.config = config
        self.output_dir = config.logging.output_dir
        os.makedirs(self.output_dir, exist_ok=True)
        self.metrics_path = config.logging.metrics_path  # resolved by validation: <output-dir>/metrics.jsonl
        os.makedirs(os.path.dirname(os.path.abspath(self.metrics_path)), exist_ok=True)
        self._pending: dict[str, float] = {}
        self._history: list[dict[str, Any]] = []
        self._sample_images: list[tuple[int, str, torch.Tensor]] = []  # (rollout id, prompt, uint8 [F,H,W,3])
        logging_config = config.logging
        self.timeline = (PhaseTimeline(logging_config.miles_dashboard_workspace) if logging_config.use_miles_dashboard
                         else None)
        self.wandb = self._init_wandb(config) if logging_config.use_wandb else None
        self.tensorboard = self._init_tensorboard(config) if logging_config.use_tensorboard else None
        self._started_at = started_at
        self._iteration_start: float | None = None
        self._next_iteration_start: float | None = None  # when the last flush began
        self._last_flush_seconds = 0.0
        self._accounted = 0.0  # seconds of top-level phases inside the current iteration
        self._phase_depth = 0

    # ---- collecting ---------------------------------------------------------------------------------
    def begin_iteration(self) -> None:
        """Start the clock of one loop iteration (see the module docstring for where it starts)."""
        now = time.perf_counter()
        if self._started_at is not None:
            self._pending["perf/startup_time"] = now - self._started_at
            self._started_at = None  # once, in the first record
        self._iteration_start = self._next_iteration_start if self._next_iteration_start is not None else now
        self._accounted = 0.0
        if self._next_iteration_start is not None:
            self._add_phase_time("log", self._last_flush_seconds)
            self._add_phase_time("between_iterations", now - self._next_iteration_start - self._last_flush_seconds)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase of the loop into `perf/<name>_time` (summed if it runs more than once per rollout).

        A phase nested in another is reported but counted once in the iteration's accounting."""
        start = time.perf_counter()
        if self.timeline is not None:
            self.timeline.begin(name)
        self._phase_depth += 1
        try:
            yield
        finally:
            self._phase_depth -= 1
            elapsed = time.perf_counter() - start
            key = f"perf/{name}_time"
            self._pending[key] = self._pending.get(key, 0.0) + elapsed
            if self._phase_depth == 0 and self._iteration_start is not None and start >= self._iteration_start:
                self._accounted += elapsed
            if self.timeline is not None:
                self.timeline.end(name)

    def _add_phase_time(self, name: str, seconds: float) -> None:
        key = f"perf/{name}_time"
        self._pending[key] = self._pending.get(key, 0.0) + seconds
        self._accounted += seconds

    def log(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor):
                value = value.item()
            if isinstance(value, numbers.Real) and not isinstance(value, bool):  # numpy scalars included
                self._pending[key] = float(value)

    def log_samples(self, rollout_id: int, samples: list, prefix: str = "rollout") -> None:
        """Keep a few images for the final grid and, on the image interval, send them to wandb."""
        keep = max(self.config.logging.wandb_log_num_images, 4)
        chosen = [s for s in samples if s.image is not None][:keep]
        if prefix == "rollout":
            self._sample_images = [(rollout_id, s.prompt, s.image) for s in chosen] if chosen else self._sample_images
            if rollout_id == 0 or not hasattr(self, "_first_images"):
                self._first_images = [(rollout_id, s.prompt, s.image) for s in chosen]
        if self.wandb is None or self.config.logging.wandb_log_num_images <= 0:
            return
        if rollout_id % self.config.logging.wandb_log_image_interval != 0:
            return
        media = [self._to_wandb_media(s) for s in chosen[: self.config.logging.wandb_log_num_images]]
        self.wandb.log({f"{prefix}/samples": media}, step=rollout_id)

    # ---- writing ------------------------------------------------------------------------------------
    def flush(self, rollout_id: int) -> dict[str, Any]:
        flush_start = time.perf_counter()
        if self._iteration_start is not None:
            iteration = flush_start - self._iteration_start
            self._pending["perf/iteration_time"] = iteration
            self._pending["perf/unaccounted_time"] = max(iteration - self._accounted, 0.0)
            self._iteration_start = None
        record: dict[str, Any] = {"rollout_id": rollout_id, "time": time.time()}
        record.update({k: v for k, v in sorted(self._pending.items()) if not math.isnan(v)})
        self._pending = {}
        self._history.append(record)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        logger.info("rollout %d | %s", rollout_id, self._console_summary(record))
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k not in ("rollout_id", "time")}, step=rollout_id)
        if self.tensorboard is not None:
            for key, value in record.items():
                if key not in ("rollout_id", "time"):
                    self.tensorboard.add_scalar(key, value, global_step=rollout_id)
            self.tensorboard.flush()
        if self.timeline is not None:
            self.timeline.flush()
        self._next_iteration_start = flush_start
        self._last_flush_seconds = time.perf_counter() - flush_start
        return record

    def finish(self) -> None:
        """Leave the reward curve and a grid of first and last samples in the output folder."""
        curve = save_reward_curve(self._history, os.path.join(self.output_dir, "reward_curve.png"))
        if curve:
            logger.info("reward curve: %s", curve)
        first = getattr(self, "_first_images", [])
        grid = save_sample_grid(first, self._sample_images, os.path.join(self.output_dir, "samples.png"))
        if grid:
            logger.info("sample grid: %s", grid)
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()

    @property
    def history(self) -> list[dict[str, Any]]:
        return self._history

    # ---- helpers ------------------------------------------------------------------------------------
    @staticmethod
    def _console_summary(record: dict[str, Any]) -> str:
        keys = [
            "rollout/reward_mean",
            "eval/reward_mean",
            "train/loss",
            "train/approx_kl",
            "train/clipfrac",
            "train/grad_norm",
            "perf/rollout_time",
            "perf/train_time",
            "perf/weight_sync_time",
            "perf/iteration_time",
            "perf/unaccounted_time",
        ]
        parts = [f"{k.split('/', 1)[1]}={record[k]:.4g}" for k in keys if k in record]
        return " ".join(parts) if parts else "(no metrics)"

    def _init_wandb(self, config: RunConfig):
        import wandb

        if config.logging.wandb_key:
            wandb.login(key=config.logging.wandb_key, host=config.logging.wandb_host)
        name = config.logging.wandb_group or "miles"
        if not config.logging.disable_wandb_random_suffix:
            name = f"{name}-{os.urandom(3).hex()}"
        return wandb.init(
            project=config.logging.wandb_project or "miles",
            entity=config.logging.wandb_team,
            group=config.logging.wandb_group,
            name=name,
            id=config.logging.wandb_run_id,
            resume="allow" if config.logging.wandb_run_id else None,
            mode=config.logging.wandb_mode,
            dir=config.logging.wandb_dir or os.path.abspath("wandb"),
            config=dict(config.values),
        )

    @staticmethod
    def _init_tensorboard(config: RunConfig):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (validation checks)

        return SummaryWriter(log_dir=os.path.join(config.logging.output_dir, "tensorboard"))

    @staticmethod
    def _to_wandb_media(sample):
        import numpy as np
        import wandb

        frames = sample.image.numpy()
        caption = sample.prompt[:200]
        if frames.shape[0] == 1:
            return wandb.Image(frames[0], caption=caption)
        fps = int(getattr(sample, "fps", None) or 8)
        try:  # wandb needs a container format for raw frames, and moviepy to encode them
            return wandb.Video(np.transpose(frames, (0, 3, 1, 2)), fps=fps, format="mp4", caption=caption)
        except (ImportError, ValueError, wandb.Error) as error:
            import importlib.util

            hint = "" if importlib.util.find_spec("moviepy") else (
                "; moviepy is not installed: pip install -e '.[video]' (or pip install moviepy) to log videos")
            logger.warning("cannot encode a video for wandb (%s)%s; logging its first frame instead", error, hint)
            return wandb.Image(frames[0], caption=caption)
