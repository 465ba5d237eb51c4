"""Everything a run reports: the metrics JSONL, the console line, wandb, TensorBoard, phase timings and the
final plots.

Metric names are stable: `rollout/*` (rewards, advantages), `train/*` (losses, ratios, grad norm, lr),
`eval/<name>/*`, `perf/*` (phase times, images/s, pairs/s, MFU). One JSON line per rollout id goes to
`--metrics-path` (default `<output-dir>/metrics.jsonl`).

Every second of an iteration is accounted for: the loop opens each iteration with `begin_iteration` and times
its parts with `phase`; `flush` adds `perf/iteration_time` and `perf/unaccounted_time` (the iteration minus
its phases). An iteration's clock starts when the previous one's `flush` starts, so that flush's own writing is
the `perf/log_time` phase of the next record and the records tile the run's wall time without gaps.
`perf/startup_time` (process start to the first iteration) comes with the first record, split into
`perf/startup/<part>_time` (the loop's `startup_part`s: launch, ray, actors, engines_launch, trainer_init,
engines_ready, weight_sync, trainer_offload) and `perf/startup/other_time`, the rest;
`perf/startup/trainer_init/<lap>_time` splits the trainer's part (spawn, process_group, load, adapters, shard,
resume, other).

`--use-tensorboard` writes every record's scalars, at step = rollout id, to `<output-dir>/tensorboard`
(torch.utils.tensorboard), and the sample grid whenever it is redrawn.

Pictures (`write_pictures`): every `--plot-interval` rollouts and once more when the run ends, however it ends
(`finish` runs in the loop's `finally`), the output folder gets `samples.png` (captioned samples of the run's first
rollout above those of the latest; the first row is kept in `samples/first_rollout.png`, so a resumed run shows
its real first rollout), `reward_curve.png` (the rollout and eval rewards of every rollout since the first, read
back from the metrics JSONL after a resume: `resume_history`) and, for a video family, the latest rollout's
samples as `videos/rollout_<id>_<k>.mp4` (miles.logging.video_files).
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
from miles.logging.plots import render_strip, sample_tile, save_image, save_reward_curve, stack_strips
from miles.logging.video_files import write_video

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
        self._earlier: list[dict[str, Any]] = []  # records of the rollouts before a resume (for the curves)
        self._latest_samples: tuple[int, list] | None = None  # (rollout id, the samples the grid shows)
        self._first_strip = None  # the grid's first row (PIL image): the run's first rollout
        self._videos_written: set[int] = set()
        self._finished = False
        logging_config = config.logging
        self.timeline = (PhaseTimeline(logging_config.miles_dashboard_workspace) if logging_config.use_miles_dashboard
                         else None)
        self.wandb = self._init_wandb(config) if logging_config.use_wandb else None
        self.tensorboard = self._init_tensorboard(config) if logging_config.use_tensorboard else None
        self._started_at = started_at
        self._startup_parts: dict[str, float] = {}  # perf/startup/<part>_time, see startup_part
        self._startup_laps: dict[str, dict[str, float]] = {}  # perf/startup/<part>/<lap>_time, see record_startup_laps
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
            startup = now - self._started_at
            self._pending["perf/startup_time"] = startup
            for part, seconds in self._startup_parts.items():
                self._pending[f"perf/startup/{part}_time"] = seconds
                laps = self._startup_laps.get(part)
                if laps:  # the part's own split, with what its laps leave of it
                    for lap, lap_seconds in laps.items():
                        self._pending[f"perf/startup/{part}/{lap}_time"] = lap_seconds
                    self._pending[f"perf/startup/{part}/other_time"] = seconds - sum(laps.values())
            self._pending["perf/startup/other_time"] = startup - sum(self._startup_parts.values())
            self._started_at = None  # once, in the first record
        self._iteration_start = self._next_iteration_start if self._next_iteration_start is not None else now
        self._accounted = 0.0
        if self._next_iteration_start is not None:
            self._add_phase_time("log", self._last_flush_seconds)
            self._add_phase_time("between_iterations", now - self._next_iteration_start - self._last_flush_seconds)

    def record_startup(self, part: str, seconds: float) -> None:
        """A part of the start-up (before the first iteration), reported as `perf/startup/<part>_time` with the
        first record; `perf/startup/other_time` is what the parts leave of `perf/startup_time`."""
        self._startup_parts[part] = self._startup_parts.get(part, 0.0) + seconds

    def record_startup_laps(self, part: str, laps: dict[str, float]) -> None:
        """Where a start-up part's time went (e.g. the trainer's load, adapters, shard), reported as
        `perf/startup/<part>/<lap>_time` with `perf/startup/<part>/other_time` the rest of the part."""
        self._startup_laps[part] = dict(laps)

    @contextmanager
    def startup_part(self, part: str) -> Iterator[None]:
        """Time a part of the start-up (`record_startup`); the dashboard timeline shows it like a phase."""
        began = time.perf_counter()
        if self.timeline is not None:
            self.timeline.begin(part)
        try:
            yield
        finally:
            self.record_startup(part, time.perf_counter() - began)
            if self.timeline is not None:
                self.timeline.end(part)

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
        """Keep a few samples for the pictures and, on the image interval, send them to wandb."""
        keep = max(self.config.logging.wandb_log_num_images, 4)
        chosen = [s for s in samples if s.image is not None][:keep]
        if prefix == "rollout" and chosen:
            self._latest_samples = (rollout_id, chosen)
            if self._first_strip is None:
                self._first_strip = render_strip(f"rollout {rollout_id} (first)", [sample_tile(s) for s in chosen])
                save_image(self._first_strip, self._first_strip_path)
        if self.wandb is None or self.config.logging.wandb_log_num_images <= 0:
            return
        if rollout_id % self.config.logging.wandb_log_image_interval != 0:
            return
        media = [self._to_wandb_media(s) for s in chosen[: self.config.logging.wandb_log_num_images]]
        self.wandb.log({f"{prefix}/samples": media}, step=rollout_id)

    def resume_history(self, start_rollout_id: int) -> None:
        """A resumed run's pictures cover the whole run: the records of rollouts before `start_rollout_id` from the
        metrics JSONL (later ones belong to an attempt that did not reach its next checkpoint), and the first
        rollout's grid row."""
        if start_rollout_id <= 0:
            return
        if os.path.isfile(self.metrics_path):
            with open(self.metrics_path) as handle:
                for line in handle:
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:  # a line cut short by a killed run
                        continue
                    if isinstance(record, dict) and record.get("rollout_id", start_rollout_id) < start_rollout_id:
                        self._earlier.append(record)
        if self._first_strip is None and os.path.isfile(self._first_strip_path):
            from PIL import Image

            with Image.open(self._first_strip_path) as strip:
                self._first_strip = strip.convert("RGB")

    @property
    def _first_strip_path(self) -> str:
        return os.path.join(self.output_dir, "samples", "first_rollout.png")

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
        if (rollout_id + 1) % self.config.logging.plot_interval == 0:
            self.write_pictures()
        self._next_iteration_start = flush_start
        self._last_flush_seconds = time.perf_counter() - flush_start
        return record

    def write_pictures(self) -> dict[str, str]:
        """(Re)write the reward curve, the sample grid and the latest videos; returns what was written."""
        out = self.output_dir
        written = {}
        curve = save_reward_curve([*self._earlier, *self._history], os.path.join(out, "reward_curve.png"))
        if curve:
            written["reward curve"] = curve
        latest = None
        if self._latest_samples is not None:
            rollout_id, samples = self._latest_samples
            latest = render_strip(f"rollout {rollout_id} (latest)", [sample_tile(s) for s in samples])
            written.update(self._write_videos(rollout_id, samples))
        grid = stack_strips([self._first_strip, latest])
        if grid is not None:
            written["sample grid"] = save_image(grid, os.path.join(out, "samples.png"))
            step = self._history[-1]["rollout_id"] if self._history else 0
            if self.tensorboard is not None:
                import numpy as np

                self.tensorboard.add_image("samples", np.asarray(grid), global_step=step, dataformats="HWC")
                self.tensorboard.flush()
            if self.wandb is not None:
                import wandb

                self.wandb.log({"samples_grid": wandb.Image(grid, caption="first and latest rollout")}, step=step)
        return written

    def _write_videos(self, rollout_id: int, samples: list) -> dict[str, str]:
        """Each shown sample of a video family as an MP4, once per rollout."""
        if rollout_id in self._videos_written or all(s.image.shape[0] == 1 for s in samples):
            return {}
        self._videos_written.add(rollout_id)
        fps = self.config.sampling.diffusion_fps
        written = {}
        for k, sample in enumerate(samples):
            path = write_video(sample.image.numpy(), os.path.join(self.output_dir, "videos",
                                                                  f"rollout_{rollout_id:07d}_{k}.mp4"), fps)
            if path:
                written[f"video {k}"] = path
        return written

    def finish(self) -> None:
        """Leave the pictures in the output folder and close wandb and TensorBoard; runs however the run ends
        (the loop's `finally`), so it never raises over the error that ended the run. Idempotent."""
        if self._finished:
            return
        self._finished = True
        try:
            for what, path in self.write_pictures().items():
                logger.info("%s: %s", what, path)
        except Exception:  # noqa: BLE001 - an error that ended the run must stay the one reported
            logger.exception("could not write the run's pictures to %s", self.output_dir)
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
        eval_keys = sorted(k for k in record if k.startswith("eval/") and k.endswith("/reward_mean"))
        keys = [
            "rollout/reward_mean",
            *eval_keys,
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
        parts = [f"{k.removeprefix('rollout/').removeprefix('train/').removeprefix('perf/')}={record[k]:.4g}"
                 for k in keys if k in record]
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
