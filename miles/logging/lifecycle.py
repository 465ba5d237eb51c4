"""The console lines that tell a run's story: started, resumed from, saved, exported, evaluated, finished.

Each function returns one line; `train_diffusion.py` logs it on the `miles` logger (the eval line comes from the
rollout manager, which knows the sets). They are for people reading the console: the numbers also go to the
metrics JSONL, and nothing parses these lines.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from miles.config.batch_geometry import BatchGeometry
from miles.config.schedule import RunSchedule, format_rollout_ids


def started_line(family: str | None, hf_checkpoint: str, device: str, trainer_ranks: int, engines: int,
                 colocated: bool, geometry: BatchGeometry, schedule: RunSchedule, output_dir: str,
                 trainer_on_host: bool = False) -> str:
    """The run's shape once its processes are placed: model, devices, one rollout's geometry, the schedule.
    `trainer_on_host`: the trainer runs on the CPU whatever `device` is (--rollout-gradient-trainer)."""
    engines_text = "no engines" if engines == 0 else f"{engines} engine(s)" + (" colocated" if colocated else "")
    pairs = "?" if geometry.pairs is None else str(geometry.pairs)
    trajectories = "?" if geometry.trajectories is None else str(geometry.trajectories)
    first, last = schedule.start_rollout_id, schedule.num_rollout - 1
    where = " on the host" if trainer_on_host else ""
    return (f"started: {family or 'custom family'} from {hf_checkpoint} on {device}, {trainer_ranks} trainer "
            f"rank(s){where}, {engines_text}; per rollout {geometry.prompts} prompts x {geometry.samples_per_prompt} "
            f"samples = {trajectories} trajectories, {pairs} train pairs, {geometry.optimizer_steps} optimizer "
            f"step(s); rollouts {first}..{last} of {schedule.num_rollout}; saves after "
            f"{format_rollout_ids(schedule.saves)}, evals before {format_rollout_ids(schedule.evals)}; "
            f"outputs in {output_dir}")


def resumed_line(checkpoint_dir: str, start_rollout_id: int, num_rollout: int) -> str:
    return (f"resumed from {checkpoint_dir}: {start_rollout_id} rollout(s) done, continuing at rollout "
            f"{start_rollout_id} of {num_rollout}")


def saved_line(rollout_id: int, path: str) -> str:
    return f"saved the checkpoint of rollout {rollout_id}: {path}"


def exported_line(rollout_id: int, path: str) -> str:
    return f"exported the policy of rollout {rollout_id} for inference: {path}"


def evaluated_line(rollout_id: int, name: str, metrics: dict[str, float], num_samples: int,
                   grid: str | None) -> str:
    """One eval set's result (`metrics`: its `eval/<name>/*` values)."""
    mean, std = metrics.get(f"eval/{name}/reward_mean"), metrics.get(f"eval/{name}/reward_std")
    where = f"; grid {grid}" if grid else ""
    return (f"evaluated {name} before rollout {rollout_id}: reward_mean={mean:.4g} reward_std={std:.4g} over "
            f"{num_samples} samples{where}")


def finished_line(history: Sequence[dict[str, Any]], schedule: RunSchedule, started_at: float,
                  output_dir: str, last_checkpoint: str | None) -> str:
    """The end of a run that completed: what it trained, the reward's course, where everything is."""
    rewards = [record["rollout/reward_mean"] for record in history if "rollout/reward_mean" in record]
    course = f"; reward_mean {rewards[0]:.4g} -> {rewards[-1]:.4g}" if rewards else ""
    checkpoint = f"; last checkpoint {last_checkpoint}" if last_checkpoint else ""
    return (f"finished: rollouts {schedule.start_rollout_id}..{schedule.num_rollout - 1} of {schedule.num_rollout} "
            f"in {time.perf_counter() - started_at:.0f} s{course}{checkpoint}; metrics, curves and samples in "
            f"{output_dir}")


def nothing_to_train_line(load: str, checkpoint_dir: str, rollouts_done: int, num_rollout: int) -> str:
    """A finished run asked to continue: said before Ray starts (train_diffusion.py exits 0 after it)."""
    return (f"--load {load}: checkpoint at rollout {rollouts_done} ({checkpoint_dir}), --num-rollout {num_rollout}: "
            "nothing to train (raise --num-rollout to continue)")
