"""The step-level batcher: concurrent requests whose samples can share a DiT forward run as one batch.

The scheduler lives on the server's event loop; every model call runs on ONE worker thread (the device is a
single stream of work), so HTTP stays responsive while the GPU is busy. Each loop iteration:

1. starts new requests (`ModelRunner.start`: encode + initial latents), waiting `batch_wait_ms` first when
   the engine was idle so that a burst of concurrent POSTs lands in the same batch;
2. activates the started ones whose weights are there (a request may ask for a weight version not yet pushed,
   `after_weight_version`: it is encoded now and denoised once the update lands) and, for rollout_gradient
   requests, whose gradient wave has room;
3. groups the active trajectories by `ModelRunner.batch_key` (same shape, guidance, conditioning layout and
   expert phase; the step index may differ, the family takes one sigma per sample), picks the group holding
   the oldest trajectory, and runs ONE `ModelRunner.step` on it (the runner chunks at `max_batch_size`
   samples, CFG doubling happens inside the family's forward);
4. queues the decode of the trajectories that reached step n and their copies to the host
   (`ModelRunner.finish_async`); their responses are packed on a second thread once the copies landed, while the
   worker goes on with the next steps (miles/engine/host_transfer.py).

Exclusive work (weight updates, memory release) goes through `run_exclusive`, which runs on the same worker
thread between two steps.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from miles.engine.host_transfer import PendingResponse
from miles.engine.model_runner import ModelRunner, Trajectory
from miles.engine.protocol import GenerateRequest, GenerateResponse

logger = logging.getLogger(__name__)


@dataclass(eq=False)  # a job is itself, not its fields: jobs key `_answering`
class _Job:
    request: GenerateRequest
    future: asyncio.Future
    trajectory: Trajectory | None = None
    admitted_at: float = field(default_factory=time.perf_counter)
    step_clock_at_start: float = 0.0  # the engine's `step_seconds` when this request's trajectory was activated
    weights_ready_at: float | None = None  # when the scheduler first saw the weights it waits for (if it waits)


@dataclass
class SchedulerCounters:
    requests_total: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0  # the client went away (disconnect, timeout) before the answer
    samples_total: int = 0
    forward_batches: int = 0
    forward_samples: int = 0
    max_forward_samples: int = 0
    step_seconds: float = 0.0  # worker time inside ModelRunner.step (DiT forwards + step kernels)
    decode_seconds: float = 0.0  # worker time inside ModelRunner.finish_async (queueing the VAE decode and copies)
    gradient_gathers: int = 0  # rollouts whose spilled gradient sums were gathered on the device after the last wave
    deferred_starts: int = 0  # rollout_gradient requests left to a later turn of the loop: a wave could step first

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# The most `batch_wait_ms` waits a burst's admission takes while requests keep arriving (see `_gather_burst`).
BURST_WAIT_FACTOR = 20


class StepScheduler:
    """Owns the worker thread, the queue of new requests and the active trajectories of one engine."""

    def __init__(self, runner: ModelRunner, max_batch_size: int, batch_wait_ms: float, gradient_wave: int = 0):
        """`gradient_wave`: samples of rollout_gradient requests denoised at once (0: no limit). Their tiles run
        one after another whatever the wave, so a wave of one tile costs no GPU work and bounds the per-sample
        gradient sums held on the GPU to that wave's (finished ones move to the host when the next wave starts:
        `RolloutGradients.spill_to_host`)."""
        self.runner = runner
        self.max_batch_size = max(1, int(max_batch_size))
        self.batch_wait_s = max(0.0, float(batch_wait_ms)) / 1000.0
        self.gradient_wave = max(0, int(gradient_wave))
        # the worker compiles and runs the model: it takes the runner's compiler settings (they are per thread)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-engine-worker",
                                           initializer=runner.prepare_thread)
        # packs finished requests' responses once their results reached the host (no device work on it)
        self.packer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-engine-packer")
        self.counters = SchedulerCounters()
        # more work after a rollout's last gradient wave, besides gathering its sums (the server's: staging the
        # LoRA bases for the coming merge)
        self.after_last_gradient_wave: list[Callable[[], None]] = []
        self._pending: list[_Job] = []  # received, not started
        self._started: list[_Job] = []  # encoded, waiting for their weights or their gradient wave
        self._active: list[_Job] = []  # being denoised
        self._answering: dict[_Job, asyncio.Task] = {}  # finished on the device, their responses being packed
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="miles-engine-scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for task in list(self._answering.values()):
            task.cancel()
        for job in self._pending + self._started + self._active + list(self._answering):
            if not job.future.done():
                job.future.set_exception(RuntimeError("engine shutting down"))
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.packer.shutdown(wait=False, cancel_futures=True)

    @property
    def num_running(self) -> int:
        return len(self._pending) + len(self._started) + len(self._active) + len(self._answering)

    # ---- public API -----------------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        job = _Job(request, asyncio.get_running_loop().create_future())
        self._pending.append(job)
        self.counters.requests_total += 1
        assert self._wakeup is not None, "scheduler not started"
        self._wakeup.set()
        return await job.future

    def wake(self) -> None:
        """The weights changed (a flush): requests waiting for that version may start denoising."""
        if self._wakeup is not None:
            self._wakeup.set()

    async def run_exclusive(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` on the worker thread, between two denoising steps."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def run_exclusive_timed(self, fn: Callable[[], Any]) -> tuple[Any, float, float]:
        """`run_exclusive(fn)`, and how long it waited for the worker thread (a step or a prompt encoding running
        there) and how long it ran: (result, wait seconds, run seconds), for the caller's report."""
        queued = time.perf_counter()

        def timed() -> tuple[Any, float, float]:
            began = time.perf_counter()
            result = fn()
            return result, began - queued, time.perf_counter() - began

        return await self.run_exclusive(timed)

    # ---- the loop -------------------------------------------------------------------------------------------
    async def _loop(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending and not self._started and not self._active:
                self._wakeup.clear()
                await self._wakeup.wait()
                await self._gather_burst()
            self._wakeup.clear()  # a request or a weight update from here on ends the wait for weights below
            await self._start_pending(loop)
            self._activate()
            self._drop_cancelled()
            if not self._active:
                if self._started:  # every started request waits for weights not pushed yet
                    await self._wakeup.wait()
                continue
            batch = self._pick_batch()
            began = time.perf_counter()
            try:
                await loop.run_in_executor(self.executor, self.runner.step, [job.trajectory for job in batch])
            except Exception as err:  # a failed forward fails its requests, never the engine
                logger.exception("denoising step failed for %d request(s)", len(batch))
                for job in batch:
                    self._fail(job, err)
                continue
            self.counters.step_seconds += time.perf_counter() - began
            samples = sum(job.trajectory.num_samples for job in batch)
            self.counters.forward_batches += 1
            self.counters.forward_samples += samples
            self.counters.max_forward_samples = max(self.counters.max_forward_samples, samples)
            for job in batch:
                if job.trajectory.done:
                    await self._finish(loop, job)

    async def _gather_burst(self) -> None:
        """Let the other requests of a concurrent burst arrive before the first step: wait `batch_wait_ms`, and
        again while requests keep arriving (up to `BURST_WAIT_FACTOR` waits). A rollout's requests come through
        the router a few milliseconds apart; admitted in two waves, its last steps would run the late wave alone."""
        waited = 0
        while self.batch_wait_s > 0 and waited < BURST_WAIT_FACTOR:
            seen = len(self._pending)
            await asyncio.sleep(self.batch_wait_s)
            waited += 1
            if len(self._pending) == seen:
                return

    async def _start_pending(self, loop: asyncio.AbstractEventLoop) -> None:
        """Encode the new requests (a prompt and initial noise depend on no weights), whatever the weights they
        wait for: a rollout sent ahead is encoded while the trainer still trains. Rollout_gradient requests stop
        being started once a whole gradient wave can step (its requests started and their weights there, or a
        wave running): the rest are started one a turn of the loop, each while the step queued before it runs on
        the device, instead of all before the first step (≈ 30 ms of host work a request at SD3.5-Medium, the
        prefetched rollout's encodings between new weights and its first step otherwise)."""
        pending, self._pending = self._pending, []
        for index, job in enumerate(pending):
            if index and job.request.rollout_gradient and self._gradient_wave_can_step():
                self._pending = pending[index:] + self._pending
                self.counters.deferred_starts += len(pending) - index
                return
            if job.future.done():  # cancelled while queued: never started
                self.counters.requests_cancelled += 1
                continue
            try:
                job.trajectory = await loop.run_in_executor(self.executor, self.runner.start, job.request)
            except Exception as err:
                self._fail(job, err)
                continue
            self._started.append(job)

    def _gradient_wave_can_step(self) -> bool:
        """A gradient wave's worth of samples is running or can start now (`gradient_wave` 0: no waves)."""
        if not self.gradient_wave:
            return False
        running = sum(job.request.num_samples for job in self._active if job.request.rollout_gradient)
        ready = sum(job.request.num_samples for job in self._started if job.request.rollout_gradient and (
            job.request.after_weight_version is None or job.request.after_weight_version <= self.runner.weight_version))
        return running + ready >= self.gradient_wave

    def _activate(self) -> None:
        """Move started requests to the active ones, in arrival order: those whose weights are there, and for
        rollout_gradient requests only as many samples as the gradient wave holds (the ones after a request that
        must wait for the next wave wait too)."""
        now = time.perf_counter()
        wave = sum(job.request.num_samples for job in self._active if job.request.rollout_gradient)
        waiting = False
        kept: list[_Job] = []
        for job in self._started:
            wanted = job.request.after_weight_version
            if wanted is not None:
                if self.runner.weight_version < wanted:
                    kept.append(job)
                    continue
                if job.weights_ready_at is None:
                    job.weights_ready_at = now
            if job.request.rollout_gradient and self.gradient_wave:
                waiting = waiting or (wave > 0 and wave + job.request.num_samples > self.gradient_wave)
                if waiting:
                    kept.append(job)
                    continue
                wave += job.request.num_samples
            job.step_clock_at_start = self.counters.step_seconds
            self._active.append(job)
        self._started = kept

    def _drop_cancelled(self) -> None:
        # a client that went away (timeout, disconnect) cancels its future: stop spending steps on it
        for jobs in (self._started, self._active):
            for job in jobs:
                if job.future.done():
                    self.counters.requests_cancelled += 1
                    logger.info("request %s cancelled by its client at step %d", job.request.request_id,
                                job.trajectory.step if job.trajectory is not None else 0)
            jobs[:] = [job for job in jobs if not job.future.done()]

    def _pick_batch(self) -> list[_Job]:
        groups: dict[tuple, list[_Job]] = {}
        for job in self._active:  # admission order, so each group's first job is its oldest
            groups.setdefault(self.runner.batch_key(job.trajectory), []).append(job)
        oldest_group = min(groups.values(), key=lambda jobs: jobs[0].admitted_at)
        batch: list[_Job] = []
        samples = 0
        for job in oldest_group:
            if batch and samples + job.trajectory.num_samples > self.max_batch_size:
                break
            batch.append(job)
            samples += job.trajectory.num_samples
        # rotate so that a group too large for one forward shares the device fairly
        picked = set(map(id, batch))
        self._active = [job for job in self._active if id(job) not in picked] + batch
        return batch

    async def _finish(self, loop: asyncio.AbstractEventLoop, job: _Job) -> None:
        """Queue the job's decode and copies on the worker, then answer it from the packer, not waiting here."""
        self._active.remove(job)
        began = time.perf_counter()
        try:
            pending = await loop.run_in_executor(self.executor, self.runner.finish_async, job.trajectory)
        except Exception as err:
            logger.exception("decoding failed for request %s", job.request.request_id)
            self._fail(job, err)
            return
        self.counters.decode_seconds += time.perf_counter() - began
        pending.timings["queue"] = job.trajectory.started_at - job.admitted_at
        # a request sent ahead of its weights (`after_weight_version`): its time from arrival until they were there
        # (its start included), which the rollout side leaves out of the request's time: the trainer trained meanwhile
        pending.timings["weights_wait"] = (0.0 if job.weights_ready_at is None
                                           else max(0.0, job.weights_ready_at - job.admitted_at))
        # the engine's step time from this request's start to its end, whoever's steps ran (waves, other requests):
        # the rollout side takes each engine's span over its requests as that engine's denoising time
        pending.timings["step_clock_start"] = job.step_clock_at_start
        pending.timings["step_clock_end"] = self.counters.step_seconds
        if job.request.rollout_gradient and not self._gradient_work_before_new_weights():
            # the rollout's last wave: its spilled sums back on the device while its results are decoded and scored,
            # and whatever else readies the engine for the new weights (queued behind the decode, before the
            # answer: whoever has the answer sees the gather counted)
            try:
                for prepare in (self.runner.rollout_gradients.gather_on_device, *self.after_last_gradient_wave):
                    await loop.run_in_executor(self.executor, prepare)
                self.counters.gradient_gathers += 1
            except Exception:  # a speed-up only: what stayed on the host is read from there
                logger.exception("readying the engine for the new weights after the last wave failed; the fetch "
                                 "and the merge read from the host")
        num_samples, job.trajectory = job.trajectory.num_samples, None
        self._answering[job] = loop.create_task(self._answer(loop, job, pending, num_samples))

    def _gradient_work_before_new_weights(self) -> bool:
        """A rollout_gradient request is being denoised or can start on the current weights (a later wave)."""
        return any(job.request.rollout_gradient for job in self._active) or any(
            job.request.rollout_gradient and (job.request.after_weight_version is None
                                              or job.request.after_weight_version <= self.runner.weight_version)
            for job in self._started + self._pending)

    async def _answer(self, loop: asyncio.AbstractEventLoop, job: _Job, pending: PendingResponse,
                      num_samples: int) -> None:
        try:
            response = await loop.run_in_executor(self.packer, pending.result)
        except Exception as err:
            logger.exception("packing the results of request %s failed", job.request.request_id)
            self._fail(job, err)
            return
        finally:
            self._answering.pop(job, None)
        self.counters.samples_total += num_samples
        if not job.future.done():
            job.future.set_result(response)

    def _fail(self, job: _Job, err: BaseException) -> None:
        self.counters.requests_failed += 1
        for jobs in (self._started, self._active):
            if job in jobs:
                jobs.remove(job)
        if not job.future.done():
            job.future.set_exception(err)
