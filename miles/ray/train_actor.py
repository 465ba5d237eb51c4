"""Trainer ranks as Ray actors (docs/design.md §3): one `TrainRayActor` per rank, driven by `TrainActorGroup`.

The ranks form one torch.distributed group (`--distributed-backend` on GPU, nccl by default; gloo on CPU whatever
the flag says; with `--fsdp-cpu-offload` a `cpu:<--fsdp-cpu-backend>,cuda:<--distributed-backend>` group). Every group call fans out to all ranks and waits for all of them:
FSDP collectives (training, gathering weights for sync, checkpoints) need every rank.

The group's rendezvous store (a TCPStore on rank 0) authenticates nothing, so it listens on 127.0.0.1 when every
rank runs on one node, and on rank 0's node address only when the ranks span nodes; torch's own env:// store
would listen on every interface. Gloo's connections follow (GLOO_SOCKET_IFNAME=lo on one node, unless set).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

import ray

from miles.config.sections import RunConfig
from miles.ray.placement import TRAIN_GPU_SHARE
from miles.ray.shutdown import on_run_exit
from miles.utils.errors import PartDiedError

logger = logging.getLogger(__name__)

DEATH_REPORT_SECONDS = 10.0  # how long a rank's failure waits for Ray to report another rank's death behind it


def process_group_backend(config: RunConfig, on_gpu: bool, log: bool = True) -> str:
    """The trainer's torch.distributed backend: `--distributed-backend` on GPU (its cuda part under
    `--fsdp-cpu-offload`), gloo on CPU, where nccl cannot run (`log`: say so, once per run from rank 0)."""
    requested = config.placement.distributed_backend
    if not on_gpu:
        if requested != "gloo" and log:
            where = ("the trainer runs on the host (--rollout-gradient-trainer host)" if config.trainer.on_host
                     else "no GPU")
            logger.info("--distributed-backend %s: %s, the trainer's process group uses gloo", requested, where)
        return "gloo"
    if config.trainer.fsdp_cpu_offload:
        return f"cpu:{config.trainer.fsdp_cpu_backend},cuda:{requested}"
    return requested


def out_of_memory_cause(err: BaseException) -> BaseException | None:
    """The CUDA out-of-memory error behind `err` (the cause Ray wrapped, or itself), else None."""
    import torch

    for candidate in (getattr(err, "cause", None), err):  # Ray's wrapper is an instance too, its text the traceback
        if isinstance(candidate, torch.OutOfMemoryError):
            return candidate
    return None


def out_of_memory_detail(oom: BaseException) -> str:
    """torch's first sentences (what it tried to allocate, the device's capacity and what was free), without the
    per-process list and the allocator advice that follow."""
    text = str(oom).strip()
    text = text.splitlines()[0] if text else "CUDA out of memory"
    for tail in (" Including non-PyTorch memory", " Process ", " Of the allocated memory"):
        text = text.split(tail)[0]
    return text.rstrip(". ")


class TrainRayActor:
    """One trainer rank. Methods mirror `DiffusionTrainer`; see `TrainActorGroup` for their meaning."""

    def __init__(self, config: RunConfig, rank: int, world_size: int):
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.trainer = None
        self.weight_pusher = None  # rank 0: transports and the broadcast group of weight sync (weight_push.py)
        self.gradient_fetcher = None  # rank 0 under --diffusion-rollout-gradient: its buffer kept for the run
        # (engine URLs, weight version) the engine already holds after taking the optimizer step itself
        self.engine_stepped: tuple[list[str], int] | None = None
        self.engines_stepping_otherwise: set[str] = set()  # failed their start-up AdamW check: warned once
        self._store_socket = None  # rank 0: the rendezvous store's listening socket, until the store takes it
        os.environ.update(config.trainer.train_env_vars)
        if config.trainer.on_host:  # before anything asks torch for a GPU: this process then never makes a context
            os.environ["CUDA_VISIBLE_DEVICES"] = ""

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def master_address(self, one_node: bool) -> tuple[str, int]:
        """Rank 0: open the rendezvous store's listening socket (loopback when every rank is on this node)."""
        import socket

        host = "127.0.0.1" if one_node else ray.util.get_node_ip_address()
        self._store_socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._store_socket.bind((host, 0))
        self._store_socket.listen(128)
        if one_node:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        return host, self._store_socket.getsockname()[1]

    def init(self, master_addr: str, master_port: int) -> int:
        import torch
        import torch.distributed as dist

        from miles.backends.fsdp_utils.actor import DiffusionTrainer
        from miles.models.common import build_train_pipeline_config
        from miles.utils.cuda_allocator import grow_segments_unless_set

        os.environ.update(
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank), WORLD_SIZE=str(self.world_size)
        )
        on_gpu = torch.cuda.is_available()
        if on_gpu:
            torch.cuda.set_device(0)  # Ray exposes this actor's GPU as device 0
            grow_segments_unless_set()
        backend = process_group_backend(self.config, on_gpu, log=self.rank == 0)
        timeout = timedelta(minutes=self.config.placement.distributed_timeout_minutes)
        if master_addr == "127.0.0.1":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        listen_fd = self._store_socket.detach() if self.rank == 0 else None  # rank 0 serves on its bound socket
        began = time.perf_counter()
        store = dist.TCPStore(master_addr, master_port, self.world_size, self.rank == 0, timeout=timeout,
                              master_listen_fd=listen_fd)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)
        self.process_group_seconds = time.perf_counter() - began
        family = build_train_pipeline_config(**self.config.model.family_source())
        self.trainer = DiffusionTrainer(self.config, family, device="cuda" if on_gpu else "cpu")
        return self.trainer.init()

    def init_laps(self) -> dict[str, float]:
        """Where `init` spent its time: the process group, then the trainer's laps (load, adapters, shard, resume)."""
        return {"process_group": self.process_group_seconds, **self.trainer.init_laps.seconds}

    def loaded_extra_state(self) -> dict | None:
        return self.trainer.loaded_extra_state

    def train(self, rollout_id: int, samples, ask=None) -> dict[str, float]:
        """The trainer's metrics, with this rank's peak GPU memory (`perf/train_peak_*_gib`, CUDA only). `ask`
        (`--diffusion-rollout-gradient`, a `PolicyGradientAsk`): rank 0 fetches the engines' policy gradient and
        every rank steps on it."""
        from miles.utils.device_memory import current_device_memory, peak_memory_metrics

        gradient = None
        if ask is not None:
            from miles.backends.fsdp_utils.gradient_fetch import FetchedGradient, PolicyGradientFetcher
            from miles.backends.fsdp_utils.rollout_gradient_step import adapter_params_by_pushed_name

            if self.rank == 0:
                if self.gradient_fetcher is None:
                    shapes = {name: p.shape for name, p in adapter_params_by_pushed_name(self.trainer).items()}
                    self.gradient_fetcher = PolicyGradientFetcher(
                        self._weight_pusher(), shapes, self.trainer.device,
                        timeout=60.0 * self.config.placement.distributed_timeout_minutes)
                gradient = self.gradient_fetcher.fetch(ask, self._engine_step(ask), weight_version=rollout_id + 1)
            else:
                gradient = FetchedGradient(None, held=-1, expected=ask.samples)
        metrics = self.trainer.train(rollout_id, samples, gradient)
        if gradient is not None and gradient.engine_step is not None:
            self._after_engine_step(ask, gradient, rollout_id + 1)
        memory = current_device_memory()
        return {**metrics, **peak_memory_metrics("perf/train", [memory] if memory is not None else [])}

    def _engine_step(self, ask):
        """The AdamW step the engine should take itself (`--rollout-gradient-engine-step`), or None."""
        from miles.backends.fsdp_utils.rollout_gradient_step import engine_may_step, engine_step_wanted, next_adamw_step

        if not engine_step_wanted(self.config, self.gradient_fetcher.engine_can_step(ask)):
            return None
        url = ask.engines[0]
        if engine_may_step(self.config, True, self._weight_pusher().engine_info(url)):
            return next_adamw_step(self.trainer)
        if url not in self.engines_stepping_otherwise:  # only the engine's start-up check stands in the way: once
            self.engines_stepping_otherwise.add(url)
            logger.warning("engine %s steps AdamW with other bits than the host (its start-up check): the trainer "
                           "takes the optimizer step alone and pushes the weights", url)
        return None

    def _after_engine_step(self, ask, gradient, weight_version: int) -> None:
        """The engine holds the trainer's new weights under `weight_version` (the next weight sync has nothing to
        push), or it had no moments to step with: then it gets the trainer's, and the weight sync pushes as before."""
        from miles.backends.fsdp_utils.rollout_gradient_step import adapter_moments, steps_taken

        url = ask.engines[0]
        if gradient.engine_step.outcome == "no_state":
            self.engine_stepped = None
            self.gradient_fetcher.push_moments(url, gradient.engine_layout, adapter_moments(self.trainer),
                                               steps_taken(self.trainer))
        else:
            self.engine_stepped = ([url], weight_version)

    def _weight_pusher(self):
        """Rank 0's `WeightPusher`, built on first use (it knows which engines share rank 0's memory)."""
        if self.weight_pusher is None:
            from miles.backends.fsdp_utils.weight_push import WeightPusher

            self.weight_pusher = WeightPusher(
                self.config.rollout.update_weight_transport,
                colocated=self.config.placement.colocate,
                device=self.trainer.device,
                timeout=60.0 * self.config.placement.distributed_timeout_minutes,
            )
        return self.weight_pusher

    def update_weights(self, engine_urls: list[str], weight_version: int) -> dict | None:
        """Push the weights; rank 0 sends (shared memory / CUDA IPC or broadcast per engine, `WeightPusher`), the
        other ranks join the gathers. Returns rank 0's push report."""
        from miles.backends.fsdp_utils.weight_export import iter_sync_tensors, lora_scaling

        stepped, self.engine_stepped = self.engine_stepped, None
        if stepped == (list(engine_urls), weight_version):  # the engine took this step itself: nothing to push
            return {"engine_stepped": 1, "seconds": 0.0}
        named_tensors = iter_sync_tensors(self.trainer)
        if self.rank != 0:
            for _ in named_tensors:  # join every gather; only rank 0 sends
                pass
            return None
        config = self.config
        return self._weight_pusher().push(
            engine_urls,
            named_tensors,
            bucket_bytes=config.rollout.update_weight_buffer_size,
            weight_version=weight_version,
            lora=config.trainer.lora_ipc_weight_sync,
            lora_scaling=lora_scaling(self.trainer),
            target_modules=list(self.trainer.model.keys()),
            check=config.rollout.check_weight_sync,
        )

    def named_tensors(self, lora_only: bool = False, use_ema: bool = False) -> dict | None:
        """Gathered tensors (rank 0 returns them; for tests and debugging)."""
        from miles.backends.fsdp_utils.weight_export import iter_named_tensors

        tensors = {name: tensor.cpu() for name, tensor in iter_named_tensors(self.trainer, lora_only, use_ema)}
        return tensors if self.rank == 0 else None

    def save(self, rollout_id: int, extra_state: dict | None = None) -> str:
        from miles.backends.fsdp_utils.checkpoint import save_checkpoint

        return save_checkpoint(self.trainer, rollout_id, extra_state)

    def export_lora(self, path: str) -> None:
        from miles.backends.fsdp_utils.checkpoint import export_lora

        export_lora(self.trainer, path)

    def export(self, path: str, rollout_id: int) -> str | None:
        from miles.backends.fsdp_utils.model_export import export_from_trainer

        return export_from_trainer(self.trainer, path, rollout_id)

    def offload(self) -> None:
        self.trainer.offload()

    def onload(self) -> None:
        self.trainer.onload()

    def empty_cache(self) -> None:
        """Give the allocator's cached blocks (a train step's freed activations) back to the device."""
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def memory_stats(self) -> dict | None:
        """This rank's GPU memory (`DeviceMemory` fields), None on a CPU run. Its peak is the one the next
        training will reach: with the optimizer state the first step created, less what is parked on the host
        during trainings; `parkable` is the rest of that state (miles/backends/fsdp_utils/optimizer_parking.py)."""
        import dataclasses

        from miles.utils.device_memory import current_device_memory

        memory = current_device_memory()
        if memory is None:
            return None
        parking = self.trainer.optimizer_parking
        return dataclasses.replace(memory, peak_reserved=memory.peak_reserved + parking.next_peak_extra,
                                   parkable=parking.parkable).as_dict()

    def park_optimizer_state(self, more_bytes: int) -> None:
        """Park at least `more_bytes` more of the optimizer state during trainings (the colocation policy's ask,
        so that trainer and engines stay resident together)."""
        self.trainer.optimizer_parking.park_more(more_bytes)

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self.gradient_fetcher is not None:
            self.gradient_fetcher.close()
        if self.weight_pusher is not None:
            self.weight_pusher.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class TrainActorGroup:
    """The N trainer ranks (`--actor-num-nodes` × `--actor-num-gpus-per-node`).

    `placement_group`: a Ray placement group with one bundle per rank (GPU bundles, or CPU bundles on a CPU
    run), or None to let Ray place the actors. On GPU each actor takes one GPU (0.7 under `--colocate`).
    """

    def __init__(
        self,
        config: RunConfig,
        placement_group=None,
        world_size: int | None = None,
        gpu_share: float | None = None,
        cpu_share: float | None = None,
    ):
        """`gpu_share` / `cpu_share` override each actor's resources (the placement's colocation shares)."""
        import torch

        self.config = config
        self.world_size = world_size or config.placement.train_world_size
        if config.trainer.on_host:  # --rollout-gradient-trainer host: the bundles' GPUs are the engines' alone
            gpu_share = 0.0
        use_gpu = torch.cuda.is_available()
        num_gpus = (TRAIN_GPU_SHARE if config.placement.colocate else 1.0) if use_gpu else 0
        env_vars = dict(config.trainer.train_env_vars)
        remote_cls = ray.remote(TrainRayActor)
        self.actors = []
        for rank in range(self.world_size):
            options: dict[str, Any] = {
                "num_cpus": cpu_share if cpu_share is not None else (1 if not use_gpu else 0.01),
                "num_gpus": gpu_share if gpu_share is not None else num_gpus,
            }
            if env_vars:
                options["runtime_env"] = {"env_vars": env_vars}
            if placement_group is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=rank
                )
            self.actors.append(remote_cls.options(**options).remote(config, rank, self.world_size))
        self.weight_version = 0
        self.weight_sync_metrics: dict[str, float] = {}  # the last push as `weight_sync/*` metrics
        on_run_exit("the trainer actors", self.kill)

    def _all(self, method: str, *args) -> list:
        return self._gather(method, [getattr(actor, method).remote(*args) for actor in self.actors])

    def _gather(self, method: str, refs: list) -> list:
        """Every rank's result, in rank order. A rank that died is a `PartDiedError` as soon as Ray notices, not
        once the other ranks return: they wait for it in a collective until --distributed-timeout-minutes, or
        fail in it (gloo: "connection closed by peer"), and then the dead rank is the error to report."""
        results: dict = {}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            rank = refs.index(done[0])
            try:
                results[rank] = ray.get(done[0])
            except ray.exceptions.RayActorError as err:
                raise PartDiedError(self._death_message(rank, method)) from err
            except Exception as err:
                dead = self._dead_rank(refs, pending)
                if dead is not None:
                    raise PartDiedError(self._death_message(dead, method)) from err
                oom = out_of_memory_cause(err)
                if oom is not None:
                    raise PartDiedError(self._out_of_memory_message(rank, method, oom)) from err
                raise
        return [results[rank] for rank in range(len(refs))]

    def _dead_rank(self, refs: list, pending: list) -> int | None:
        """The first rank among `pending` whose process died (Ray reports it within seconds), else None."""
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=DEATH_REPORT_SECONDS) if pending else ([], [])
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                return refs.index(ref)
            except Exception as err:  # another echo of the same failure: keep looking for the dead rank
                logger.debug("rank %d failed too: %s", refs.index(ref), type(err).__name__)
        return None

    def _resume_hint(self) -> str:
        save = self.config.checkpoint.save
        return (f"; rerun with --load {save} to resume from its last checkpoint" if save
                else "; without --save there is no checkpoint to resume from")

    def _death_message(self, rank: int, method: str) -> str:
        return (f"trainer rank {rank} of {len(self.actors)} died during {method}() (its process was killed, ran out "
                f"of memory or crashed); the run is stopped{self._resume_hint()}")

    def _out_of_memory_message(self, rank: int, method: str, oom: BaseException) -> str:
        """One line for a rank's CUDA out-of-memory error: where, torch's own numbers, and the flags that lower
        the trainer's memory."""
        ways = ("lower --micro-batch-size, or add --gradient-checkpointing or --fsdp-cpu-offload, or raise "
                "--colocate-memory-margin-gb (the optimizer state then waits on the host while the trainer forwards)")
        if self.config.placement.colocate:
            ways += (", or keep the trainer and the engines taking turns on the GPU "
                     "(--colocate-offload-policy always)")
        return (f"trainer rank {rank} of {len(self.actors)} ran out of GPU memory during {method}() "
                f"({out_of_memory_detail(oom)}): {ways}; the run is stopped{self._resume_hint()}")

    def init(self) -> int:
        """Start the process group, load and shard the model, resume from `--load`; returns the first rollout id.
        `init_laps` then says where the time went (rank 0's laps; `spawn`: the actor processes' start)."""
        began = time.perf_counter()
        one_node = len(set(self._all("node_id"))) == 1  # the first call: waits for the processes to start
        spawn_seconds = time.perf_counter() - began
        master_addr, master_port = self._gather("master_address",
                                                [self.actors[0].master_address.remote(one_node)])[0]
        self.rendezvous = (master_addr, master_port)
        start_ids = self._all("init", master_addr, master_port)
        self.loaded_extra_state = self._gather("loaded_extra_state", [self.actors[0].loaded_extra_state.remote()])[0]
        self.init_laps = {"spawn": spawn_seconds, **self._gather("init_laps", [self.actors[0].init_laps.remote()])[0]}
        return start_ids[0]

    def train(self, rollout_id: int, samples, ask=None) -> dict[str, float]:
        """Every rank expands all samples and trains on its DP share; returns rank 0's (global) metrics. With
        `ask` (`--diffusion-rollout-gradient`: what to ask the engines for) every rank steps on the engines'
        policy gradient instead, which rank 0 fetches: that step reads each sample's advantage, SDE steps and filter
        flag only (rollout_gradient_step.py), so the samples travel without their images and tensors."""
        if ask is not None:
            samples = [replace(s, image=None, latents={}, conditioning={}, clean_latents=None,
                               debug_model_outputs=None, rollout_log_probs=None) for s in samples]
        samples_ref = ray.put(samples)
        return self._all("train", rollout_id, samples_ref, ask)[0]

    def update_weights(self, engine_urls: list[str], weight_version: int | None = None) -> dict | None:
        """Push the live or EMA weights (full or LoRA pairs) to the engines; returns rank 0's push report."""
        from miles.backends.fsdp_utils.weight_push import sync_metrics

        self.weight_version = self.weight_version + 1 if weight_version is None else int(weight_version)
        if not engine_urls:
            return None
        report = self._all("update_weights", list(engine_urls), self.weight_version)[0]
        self.weight_sync_metrics = sync_metrics(report)
        return report

    def named_tensors(self, lora_only: bool = False, use_ema: bool = False) -> dict:
        return self._all("named_tensors", lora_only, use_ema)[0]

    def save(self, rollout_id: int, extra_state: dict | None = None) -> str:
        from miles.utils.progress import progress_bar

        with progress_bar(1, f"saving the checkpoint of rollout {rollout_id}", unit="checkpoint") as bar:
            path = self._all("save", rollout_id, extra_state)[0]
            bar.update(1)
        return path

    def export_lora(self, path: str) -> None:
        self._all("export_lora", path)

    def export_if_due(self, rollout_id: int, phase=None) -> str | None:
        """`--export-interval N`: every N rollouts and after the last one, write the policy the engines serve for
        inference (a LoRA adapter, or a pipeline folder for a full fine-tune) to
        `<--output-dir>/export/iter_<rollout id>/`; returns that folder, or None when no export is due.

        `phase`: the run logger's `phase`, so that an export is timed as `perf/export_time` (and not as
        unaccounted time) in the rollouts that export, and nothing is logged in the others."""
        import contextlib

        from miles.backends.fsdp_utils.model_export import export_dir, should_export

        if not should_export(self.config, rollout_id):
            return None
        path = export_dir(self.config, rollout_id)  # resolved here: the ranks may run in another folder
        with phase("export") if phase is not None else contextlib.nullcontext():
            self._all("export", path, rollout_id)
        return path

    def offload(self) -> None:
        self._all("offload")

    def onload(self) -> None:
        self._all("onload")

    def empty_cache(self) -> None:
        self._all("empty_cache")

    def memory_stats(self) -> list:
        """Every rank's GPU memory as `DeviceMemory` (empty on a CPU run)."""
        from miles.utils.device_memory import DeviceMemory

        return [DeviceMemory(**stats) for stats in self._all("memory_stats") if stats]

    def park_optimizer_state(self, more_bytes: int) -> None:
        if more_bytes > 0:
            self._all("park_optimizer_state", more_bytes)

    def shutdown(self) -> None:
        self._all("shutdown")
        self.kill()

    def kill(self) -> None:
        """End every rank's process now (idempotent). The run's cleanup uses this, not `shutdown`: a rank busy in
        a collective (interrupted mid-train) would never get to a queued `shutdown` call."""
        actors, self.actors = self.actors, []
        for actor in actors:
            ray.kill(actor)
