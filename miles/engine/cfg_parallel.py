"""Engines of several processes: rank 0 (the HTTP server's ModelRunner) and its followers (`FollowerGroup`).

With `--rollout-num-gpus-per-engine N > 1` (ServerArgs.tp_size) rank 0 starts N − 1 follower processes that
load the same pipeline on the next devices, and all join a private N-rank group (gloo on CPU, NCCL on GPU;
`ProcessGroupGloo`/`ProcessGroupNCCL` over a `TCPStore`, so it lives beside any default group of the process).
Rank 0 drives them with a fixed-field int64 header broadcast, then the tensors (nothing is pickled).
`engine_parallel_mode` (ServerArgs.ulysses_degree) picks how they split a forward:

- CFG-parallel (`MODE_CFG_PARALLEL`, N = 2): for every CFG forward rank 0 broadcasts the step's
  unconditional inputs (the branch guidance, conditioning key names, latents, sigmas, negative conditioning),
  computes the conditional branch itself while rank 1 computes the unconditional one, receives rank 1's velocity
  by a broadcast rooted at rank 1, and combines them with `combine_cfg` exactly as the family's doubled batch
  would. Each branch is the family's own `predict_velocity` under `cfg_branch_guidance` (CFG off), so no family
  code changes; a family qualifies by declaring the conditioning keys of its positive branch
  (`TrainPipelineConfig.cfg_branch_keys`, models/base.py), which says its CFG is that plain `combine_cfg`.
- sequence parallel (`MODE_SEQUENCE_PARALLEL`, any N): rank 0 broadcasts every forward's whole input
  (guidance, conditioning key names, latents, sigmas, conditioning) and all ranks run the same forward on
  their share of the tokens (sequence_parallel.py); the velocity is gathered inside it.

Weights: the followers receive every denoiser parameter and buffer of rank 0 once at start-up (so all ranks
hold identical weights whatever each loaded) and again after every applied weight-update flush.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn

from miles.engine import sequence_parallel as sp
from miles.engine.weight_broadcast import _connect, _Group
from miles.models.base import GenerationShape, TrainPipelineConfig
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

logger = logging.getLogger(__name__)

# The follower blocks in a broadcast while it waits for the next command, so the group's per-operation timeout
# is also how long an engine may sit idle; a dead rank 0 is noticed by the follower's parent watch instead.
GROUP_TIMEOUT = timedelta(days=7)
STARTUP_TIMEOUT_S = 600.0

# ---- the header: one int64 vector of fixed fields --------------------------------------------------------
CMD_STOP, CMD_FORWARD, CMD_SYNC_WEIGHTS, CMD_RELEASE_MEMORY, CMD_RESUME_MEMORY, CMD_SP_FORWARD = range(6)
MAX_DIMS = 6
MAX_TENSORS = 12
TENSOR_FIELDS = 2 + MAX_DIMS  # dtype code, ndim, dims (zero-padded)
# command, count (tensors of a forward / parameters of a weight sync), height, width, num_frames, fps in 1/1000
# (-1: none), then MAX_TENSORS tensor descriptors
HEAD_FIELDS = 6
HEADER_LEN = HEAD_FIELDS + MAX_TENSORS * TENSOR_FIELDS
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool, torch.float64, torch.uint8)

MODE_CFG_PARALLEL = "cfg"
MODE_SEQUENCE_PARALLEL = "sequence"


Family = TrainPipelineConfig | type[TrainPipelineConfig]


def check_cfg_parallel_family(family: Family) -> tuple[str, ...]:
    """The conditioning keys of the family's positive CFG branch; a family that declares none is refused."""
    if not family.cfg_branch_keys:
        raise MilesUserError(f"--rollout-num-gpus-per-engine 2 (CFG-parallel engine): family {family.family!r} has no "
                             "CFG of two forwards to split (TrainPipelineConfig.cfg_branch_keys); use "
                             "--sglang-ulysses-degree 2 (sequence parallel, where the family has a layout) or 1 GPU "
                             "per engine")
    return family.cfg_branch_keys


def engine_parallel_mode(tp_size: int, ulysses_degree: int, family: Family | None) -> str | None:
    """How an engine of `tp_size` processes splits its forwards (ServerArgs.ulysses_degree): None for one process,
    MODE_CFG_PARALLEL or MODE_SEQUENCE_PARALLEL; an impossible combination is a MilesUserError naming the flags.
    `family` None (not known before loading: --train-pipeline-config-path) skips the family's own check."""
    flags = f"--rollout-num-gpus-per-engine {tp_size} with --sglang-ulysses-degree {ulysses_degree}"
    if ulysses_degree < 0:
        raise MilesUserError(f"--sglang-ulysses-degree {ulysses_degree} must be >= 0")
    if tp_size == 1:
        if ulysses_degree > 1:
            raise MilesUserError(f"{flags}: a sequence-parallel degree needs that many GPUs per engine")
        return None
    if ulysses_degree == tp_size:
        return MODE_SEQUENCE_PARALLEL
    if ulysses_degree == 1:
        if tp_size != 2:
            raise MilesUserError(f"{flags}: a CFG-parallel engine has exactly 2 GPUs (one per CFG branch)")
        if family is not None:
            check_cfg_parallel_family(family)
        return MODE_CFG_PARALLEL
    if ulysses_degree == 0:
        splits_cfg = family is not None and bool(family.cfg_branch_keys)
        return MODE_CFG_PARALLEL if tp_size == 2 and splits_cfg else MODE_SEQUENCE_PARALLEL
    raise MilesUserError(f"{flags}: CFG-parallel and sequence parallel in one engine are not implemented; set "
                         f"--sglang-ulysses-degree to {tp_size} (sequence parallel), 1 (CFG-parallel, 2 GPUs) or 0 (auto)")


def split_conditioning(conditioning: Mapping[str, torch.Tensor], keys: tuple[str, ...]):
    """(positive, negative) branch conditionings, both under the plain key names: the negative branch takes the
    `negative_<key>` twin of every key in `keys`; every other key (an input image's latents) goes to both."""
    positive = {key: value for key, value in conditioning.items() if not key.startswith("negative_")}
    negatives = {key for key in conditioning if key.startswith("negative_")}
    undeclared = negatives - {f"negative_{key}" for key in keys}
    if undeclared:  # the family's cfg_branch_keys miss a key its CFG pairs: the split would be wrong
        raise ValueError(f"conditioning keys {sorted(undeclared)} are not negatives of the CFG branch keys {keys}")
    return positive, {**positive, **{key: conditioning[f"negative_{key}"] for key in keys}}


def _broadcast(group: _Group, tensor: torch.Tensor, root: int) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = root
    options.rootTensor = 0
    options.timeout = group.timeout
    group.backend.broadcast([tensor], options).wait()
    if tensor.is_cuda:
        # NCCL's wait() only orders the current stream; the caller reads or reuses the tensor right after
        torch.cuda.current_stream(tensor.device).synchronize()


def _encode_header(command: int, count: int = 0, shape: GenerationShape | None = None,
                   tensors: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"a CFG-parallel forward carries at most {MAX_TENSORS} tensors, got {len(tensors)}")
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0], header[1] = command, count
    if shape is not None:
        header[2], header[3], header[4] = shape.height, shape.width, shape.num_frames
        header[5] = -1 if shape.fps is None else round(shape.fps * 1000)
    for i, tensor in enumerate(tensors):
        if tensor.dim() > MAX_DIMS:
            raise ValueError(f"a CFG-parallel tensor has at most {MAX_DIMS} dims, got shape {tuple(tensor.shape)}")
        row = HEAD_FIELDS + i * TENSOR_FIELDS
        header[row] = DTYPES.index(tensor.dtype)
        header[row + 1] = tensor.dim()
        header[row + 2 : row + 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header


def _decode_shape(header: torch.Tensor) -> GenerationShape:
    fps_milli = int(header[5])
    return GenerationShape(int(header[2]), int(header[3]), int(header[4]), None if fps_milli < 0 else fps_milli / 1000)


def _decode_tensor_specs(header: torch.Tensor, count: int) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    specs = []
    for i in range(count):
        row = HEAD_FIELDS + i * TENSOR_FIELDS
        ndim = int(header[row + 1])
        specs.append((DTYPES[int(header[row])], tuple(int(d) for d in header[row + 2 : row + 2 + ndim])))
    return specs


def _denoiser_tensors(modules: Mapping[str, nn.Module]) -> list[torch.Tensor]:
    """Every parameter and buffer of the denoisers, in an order both ranks derive the same way."""
    tensors = []
    for name in sorted(modules):
        module = modules[name]
        tensors += [p.data for _, p in module.named_parameters()] + [b for _, b in module.named_buffers()]
    return tensors


def _sync_weights(group: _Group, modules: Mapping[str, nn.Module]) -> None:
    for tensor in _denoiser_tensors(modules):
        if not tensor.is_contiguous():
            raise RuntimeError("a CFG-parallel weight sync needs contiguous parameters")
        _broadcast(group, tensor, root=0)


def _guidance_tensor(guidance: GuidanceConfig) -> torch.Tensor:
    nan = float("nan")
    values = (guidance.guidance_scale, guidance.guidance_scale_2, guidance.true_cfg_scale)
    return torch.tensor([nan if v is None else v for v in values], dtype=torch.float64)


def _named_inputs(guidance: GuidanceConfig, latents: torch.Tensor, sigmas: torch.Tensor,
                  conditioning: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """One forward's inputs as tensors: guidance, the conditioning key names (ASCII, comma-joined), latents, sigmas,
    then the conditioning in the order of the names (`_forward_from` reads them back)."""
    keys = sorted(conditioning)
    names = torch.tensor(list(",".join(keys).encode("ascii")), dtype=torch.uint8)
    return (_guidance_tensor(guidance), names, latents, sigmas, *(conditioning[key] for key in keys))


def _forward_from(tensors: list[torch.Tensor]):
    """The inverse of `_named_inputs`: (latents, sigmas, conditioning, guidance)."""
    guidance, names, latents, sigmas, *conditioning = tensors
    names = bytes(names.cpu().tolist()).decode("ascii").split(",")
    return latents, sigmas, dict(zip(names, conditioning, strict=True)), _guidance_from(guidance)


def _guidance_from(tensor: torch.Tensor) -> GuidanceConfig:
    scale, scale_2, true_cfg = (float(v) for v in tensor.cpu())
    return GuidanceConfig(guidance_scale=scale, guidance_scale_2=None if math.isnan(scale_2) else scale_2,
                          true_cfg_scale=None if math.isnan(true_cfg) else true_cfg)


class FollowerGroup:
    """Rank 0's side of a multi-process engine: starts the followers (ranks 1..N-1) and drives them.

    `mode` MODE_CFG_PARALLEL: one follower computes the unconditional half of each CFG forward.
    `mode` MODE_SEQUENCE_PARALLEL: `world_size` - 1 followers run every forward with rank 0 (sequence_parallel.py).
    """

    def __init__(self, server_args, device: torch.device, runner_class: type, mode: str = MODE_CFG_PARALLEL,
                 world_size: int = 2):
        """`runner_class`: what each follower runs, a plain 1-device runner (ModelRunner, which builds this group;
        passed in so that this module does not import the runner that uses it)."""
        self.keys: tuple[str, ...] = ()  # known once rank 0 has loaded its family (connect)
        self.mode = mode
        self.world_size = world_size
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        # bound now, served by the store in connect(): the followers can start and load meanwhile
        self._listen_socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listen_socket.bind(("127.0.0.1", 0))
        self._listen_socket.listen()
        port = self._listen_socket.getsockname()[1]
        context = multiprocessing.get_context("spawn")
        self.processes = []
        for rank in range(1, world_size):
            follower_device = f"cuda:{device.index + rank}" if device.type == "cuda" else "cpu"
            follower_args = dataclasses.replace(server_args, tp_size=1, ulysses_degree=0, device=follower_device,
                                                url_file=None, port=0)
            process = context.Process(
                target=follower_main,
                args=(runner_class, follower_args, port, self.backend, os.getpid(), rank, world_size, mode),
                name=f"miles-{mode}-follower-{rank}", daemon=True,
            )
            process.start()
            self.processes.append(process)
        self.group: _Group | None = None

    @property
    def process(self) -> multiprocessing.Process:
        """The first follower (the only one of a CFG-parallel engine)."""
        return self.processes[0]

    def connect(self, family: TrainPipelineConfig, modules: Mapping[str, nn.Module]) -> None:
        """Join the group (waits for the followers to load) and give them rank 0's weights."""
        if self.mode == MODE_CFG_PARALLEL:
            self.keys = check_cfg_parallel_family(family)
        began = time.perf_counter()
        self.group = self._join_followers()
        self.sync_weights(modules)
        logger.info("%s-parallel followers (pids %s) joined in %.1fs", self.mode, [p.pid for p in self.processes],
                    time.perf_counter() - began)

    def _join_followers(self) -> _Group:
        """Host the group's rendezvous on a thread while watching the followers: one that dies while loading
        (its error is in the engine log) fails the start-up instead of leaving rank 0 waiting for it."""
        joined: dict[str, object] = {}

        def host() -> None:
            try:
                joined["group"] = _connect("127.0.0.1", self._listen_socket.getsockname()[1], 0, self.world_size,
                                           f"{self.mode}-parallel", self.backend, GROUP_TIMEOUT, self.device,
                                           listen_socket=self._listen_socket)
            except BaseException as err:  # re-raised on the caller's thread
                joined["error"] = err

        thread = threading.Thread(target=host, name=f"miles-{self.mode}-parallel-join", daemon=True)
        thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while thread.is_alive():
            thread.join(timeout=0.5)
            dead = [p for p in self.processes if not p.is_alive()]
            if thread.is_alive() and dead:
                raise RuntimeError(f"{self.mode}-parallel follower {dead[0].name} exited with code {dead[0].exitcode} "
                                   "during start-up; its error is in the engine log above")
            if thread.is_alive() and time.monotonic() > deadline:
                raise RuntimeError(f"{self.mode}-parallel followers did not join within {STARTUP_TIMEOUT_S:.0f}s")
        if "error" in joined:
            raise joined["error"]
        return joined["group"]

    def _send_header(self, header: torch.Tensor) -> None:
        _broadcast(self.group, header.to(self.device), root=0)

    def _send(self, command: int, shape: GenerationShape, tensors: tuple[torch.Tensor, ...]) -> None:
        tensors = tuple(t.to(self.device).contiguous() for t in tensors)
        self._send_header(_encode_header(command, len(tensors), shape, tensors))
        for tensor in tensors:
            _broadcast(self.group, tensor, root=0)

    def send_unconditional(self, latents: torch.Tensor, sigmas: torch.Tensor, negative: Mapping[str, torch.Tensor],
                           branch_guidance: GuidanceConfig, shape: GenerationShape) -> None:
        """Start the follower's unconditional forward; `receive_unconditional` collects it."""
        self._send(CMD_FORWARD, shape, _named_inputs(branch_guidance, latents, sigmas, negative))

    def receive_unconditional(self, like: torch.Tensor) -> torch.Tensor:
        velocity = torch.empty_like(like, dtype=torch.float32, memory_format=torch.contiguous_format)
        _broadcast(self.group, velocity, root=1)
        return velocity

    def send_forward(self, latents: torch.Tensor, sigmas: torch.Tensor, conditioning: Mapping[str, torch.Tensor],
                     guidance: GuidanceConfig, shape: GenerationShape) -> None:
        """Sequence parallel: start every follower on this forward; rank 0 then runs it too."""
        self._send(CMD_SP_FORWARD, shape, _named_inputs(guidance, latents, sigmas, conditioning))

    def sync_weights(self, modules: Mapping[str, nn.Module]) -> None:
        tensors = _denoiser_tensors(modules)
        self._send_header(_encode_header(CMD_SYNC_WEIGHTS, len(tensors)))
        _sync_weights(self.group, modules)

    def release_memory(self) -> None:
        self._send_header(_encode_header(CMD_RELEASE_MEMORY))

    def resume_memory(self) -> None:
        self._send_header(_encode_header(CMD_RESUME_MEMORY))

    def close(self) -> None:
        if self.group is not None:
            try:
                self._send_header(_encode_header(CMD_STOP))
            except RuntimeError as err:  # a follower is already gone; nothing left to stop
                logger.warning("%s-parallel follower stop: %s", self.mode, err)
            for process in self.processes:
                process.join(timeout=30)
            self.group.close()
            self.group = None
        if self._listen_socket.fileno() != -1:  # never handed to a store: connect() did not run
            self._listen_socket.close()
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)


def _watch_parent(parent_pid: int) -> None:
    """The follower must not outlive its engine (a killed rank 0 cannot send CMD_STOP)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(1.0)


def _drop_all_but_denoisers(runner) -> None:
    """A follower only runs the denoisers: free its text encoders and VAE (a Wan UMT5-XXL is ~11 GB in bf16)."""
    for name in runner.pipeline_modules():
        if name not in runner.modules:
            setattr(runner.pipe, name, None)
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()


def follower_main(runner_class: type, server_args, port: int, backend: str, parent_pid: int, rank: int = 1,
                  world_size: int = 2, mode: str = MODE_CFG_PARALLEL) -> None:
    """Rank 1..N-1: load the pipeline in a `runner_class` (see FollowerGroup), join the group, then serve commands
    until CMD_STOP."""
    logging.basicConfig(level=server_args.log_level.upper(),
                        format=f"%(asctime)s {mode}-follower-{rank} %(levelname)s %(message)s")
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    runner = runner_class(server_args)
    _drop_all_but_denoisers(runner)
    if mode == MODE_CFG_PARALLEL:
        check_cfg_parallel_family(runner.family)
    else:
        layouts = sp.sequence_parallel_layouts(runner.family, runner.modules, world_size)
    group = _connect("127.0.0.1", port, rank, world_size, f"{mode}-parallel", backend, GROUP_TIMEOUT, runner.device)
    if mode == MODE_SEQUENCE_PARALLEL:
        sp.install_sequence_parallel(layouts, runner.modules, sp.UlyssesComm(group))
    try:
        while True:
            header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=runner.device)
            _broadcast(group, header, root=0)
            header = header.cpu()
            command, count = int(header[0]), int(header[1])
            if command == CMD_STOP:
                break
            if command in (CMD_FORWARD, CMD_SP_FORWARD):
                tensors = []
                for dtype, shape in _decode_tensor_specs(header, count):
                    tensor = torch.empty(shape, dtype=dtype, device=runner.device)
                    _broadcast(group, tensor, root=0)
                    tensors.append(tensor)
                latents, sigmas, conditioning, guidance = _forward_from(tensors)
                velocity = runner.predict(latents, sigmas, conditioning, guidance, _decode_shape(header))
                if command == CMD_FORWARD:  # the unconditional branch (the guidance is a branch's: CFG off)
                    _broadcast(group, velocity.float().contiguous(), root=1)
                # sequence parallel: the velocity is gathered inside the forward; rank 0 keeps it
            elif command == CMD_SYNC_WEIGHTS:
                expected = len(_denoiser_tensors(runner.modules))
                if count != expected:
                    # both ranks would then disagree on every later broadcast: stop rather than mis-assign
                    raise RuntimeError(f"weight sync of {count} tensors, the follower holds {expected}")
                _sync_weights(group, runner.modules)
            elif command == CMD_RELEASE_MEMORY:
                runner.release_memory()
            elif command == CMD_RESUME_MEMORY:
                runner.resume_memory()
            else:
                raise RuntimeError(f"unknown {mode}-parallel command {command}")
    finally:
        group.close()
