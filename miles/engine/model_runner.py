"""The engine's model side: load the pipeline through the family, and run requests one denoising step at a time.

A request becomes a `Trajectory` (`start`: encode the prompt, build the per-sample generators, draw the
initial latents; `activate`, at its first step: what depends on the weights); `step` advances any list of
trajectories by one step with ONE batched DiT forward (`family.predict_velocity`, CFG as a doubled batch inside
the family), then applies each trajectory's own step kernel from the math core (`SdeStepBackend.sample` on its
SDE steps S, Euler `ode_step` elsewhere, docs/algorithms.md §2–§3); `finish` decodes and packs the response.
Every sample keeps its own generator (seeded seed + b), used first for the initial noise and then for the step
noises, so a sample's trajectory never depends on which other samples share its forward.

All methods run on the engine's single GPU worker thread (see scheduler.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from miles.diffusion.sde import SdeStepBackend, build_sde_backend, ode_step
from miles.engine.cfg_parallel import (
    MODE_CFG_PARALLEL,
    MODE_SEQUENCE_PARALLEL,
    FollowerGroup,
    engine_parallel_mode,
    split_conditioning,
)
from miles.engine.host_transfer import DeviceTimer, HostCopies, PendingResponse
from miles.engine.patches import apply_patch_groups
from miles.engine.protocol import GenerateRequest, GenerateResponse, ProtocolError, SampleResult
from miles.engine.rollout_gradients import RolloutGradients, step_with_gradients
from miles.engine.sequence_parallel import (
    UlyssesComm,
    check_sequence_length,
    install_sequence_parallel,
    sequence_parallel_layouts,
)
from miles.engine.server_args import ServerArgs
from miles.models.base import GenerationShape, SequenceParallelLayout, TrainPipelineConfig, condition_image_mismatch
from miles.models.batch_invariant import gradient_engine_attention_backend, predict_velocity_in_tiles, route_attention
from miles.models.opaque_kernels import enable_eager_rounding, install_in_blocks, wanted as opaque_kernels_wanted
from miles.models.common import build_train_pipeline_config, combine_cfg, generators_from_seeds, parse_dtype
from miles.utils.compile import compile_blocks, compile_seconds, compiled_graphs, raise_recompile_limits
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError
from miles.utils.imports import load_function
from miles.utils.pinned import PinnedBuffers, replace_module_tensors

logger = logging.getLogger(__name__)

DEFAULT_NEGATIVE_PROMPT = " "  # docs/algorithms.md §1: the engine's negative prompt when CFG is on and none is given


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MilesUserError(f"--device {name}: CUDA is not available on this machine")
    return device


@dataclass
class Trajectory:
    """One in-flight request: M samples moving through the n denoising steps together."""

    request: GenerateRequest
    shape: GenerationShape
    conditioning: dict[str, torch.Tensor]  # on the device: [1, ...] once started, [M, ...] once activated
    sigmas: torch.Tensor  # [n + 1] fp32 on the device
    sigma_values: tuple[float, ...]  # the same on the host: the scheduler reads them between steps (no device sync)
    timesteps: torch.Tensor  # [n]
    latents: torch.Tensor  # [M, ...] fp32, x_k
    generators: list[torch.Generator]
    backend: SdeStepBackend
    sde_steps: frozenset[int]
    return_latents: frozenset[int]
    step: int = 0
    recorded: dict[int, torch.Tensor] = field(default_factory=dict)
    log_probs: dict[int, torch.Tensor] = field(default_factory=dict)
    debug_velocities: dict[int, torch.Tensor] = field(default_factory=dict)
    weight_version_at_start: int = 0  # the engine's weight version at the first step (`ModelRunner.activate`)
    activated: bool = False
    started_at: float = field(default_factory=time.perf_counter)
    start_seconds: float = 0.0  # `ModelRunner.start`: the prompt's encoding and the initial latents
    denoise_seconds: float = 0.0
    compile_seconds: float = 0.0  # of denoise and decode: compiling graphs (a first forward, a new batch size)
    # rollout_gradient requests: each sample's Σ_k ∇ℓ_{b,k} over the LoRA factors, [M, P] (rollout_gradients.py)
    gradient_sums: torch.Tensor | None = None

    @property
    def num_samples(self) -> int:
        return self.latents.shape[0]

    @property
    def done(self) -> bool:
        return self.step >= self.request.num_steps


def _conditioning_signature(conditioning: Mapping[str, torch.Tensor]) -> tuple:
    return tuple(sorted((key, tuple(value.shape[1:]), value.dtype) for key, value in conditioning.items()))


# A batch size that no compiled graph fits (within 2x) gets a graph of its own only once it recurs: in this many of
# the last `NEW_SIZE_WINDOW` forwards. Until then it is padded to a larger compiled size. A rollout whose requests
# arrive in two waves ends with a step or two of the late wave alone: padding those costs a fraction of a second
# where a new graph costs seconds (13 s at SD3.5-Medium size on an H200, bench/RESULTS.md).
NEW_SIZE_AFTER = 3
NEW_SIZE_WINDOW = 6


def batch_bucket(batch: int, max_batch_size: int) -> int:
    """The next power of two (at most `max_batch_size`, or `batch` when larger)."""
    return min(max(max_batch_size, batch), 1 << (batch - 1).bit_length())


def padded_batch_size(batch: int, compiled: set[int], max_batch_size: int, recent: int = 1) -> int:
    """The batch size a compiled engine forwards `batch` samples at: a size it already compiled when one fits
    within twice `batch_bucket` (padding costs at most one doubled forward); else the bucket, once `recent`
    (how many of the last forwards wanted this bucket, this one included) reaches `NEW_SIZE_AFTER`; before that the
    smallest larger compiled size, if any."""
    bucket = batch_bucket(batch, max_batch_size)
    fitting = [size for size in compiled if batch <= size <= 2 * bucket]
    if fitting:
        return min(fitting)
    larger = [size for size in compiled if size >= batch]
    if larger and recent < NEW_SIZE_AFTER:
        return min(larger)
    return bucket


class ModelRunner:
    """Owns the pipeline, the denoiser modules and the weight version of one engine."""

    def __init__(self, server_args: ServerArgs, loaded: tuple[TrainPipelineConfig, Any] | None = None):
        """`loaded`: an already built (family, pipeline) to serve instead of loading `model_path`."""
        self.server_args = server_args
        self.device = resolve_device(server_args.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", server_args.base_gpu_id)
            torch.cuda.set_device(self.device)
        self.dtype = parse_dtype(server_args.dtype)
        self.generator_device = self._resolve_generator_device(server_args.generator_device)
        # tp_size > 1: followers (cfg_parallel.py) run beside this process, rank 0; started before loading when the
        # family is known without loading, so they load while this process does
        self.cfg_parallel: FollowerGroup | None = None  # CFG-parallel: the unconditional branch on rank 1
        self.sequence_parallel: FollowerGroup | None = None  # sequence parallel: every forward on N ranks
        self._host_copies = PinnedBuffers(pin=True)  # where release_memory puts the weights (pinned once)
        self._released: list[str] = []  # the tensors it sent there
        family = loaded[0] if loaded is not None else None
        if family is None and server_args.tp_size > 1 and not server_args.pipeline_builder_path:
            family = self._build_family(server_args)
        if family is not None:
            self._start_followers(family)
        try:
            self.family, self.pipe = loaded if loaded is not None else self._load(server_args, family)
            if self.cfg_parallel is None and self.sequence_parallel is None:
                self._start_followers(self.family)
        except BaseException:
            self.close()
            raise
        self.module_names: tuple[str, ...] = tuple(self.family.trainable_modules)
        self.modules: dict[str, nn.Module] = {}
        for name in self.module_names:
            module = getattr(self.pipe, name, None)
            if module is None:
                raise MilesUserError(f"the pipeline at {server_args.model_path!r} has no denoiser module {name!r}")
            module.eval().requires_grad_(False)
            self.modules[name] = module
        self.patch_groups = apply_patch_groups(self.modules, server_args.rollout_patch_group, self.family)
        attention = server_args.attention_backend
        if attention is None and server_args.rollout_gradient_tile:
            attention = gradient_engine_attention_backend(self.dtype, self.family, self.device)
            if attention is not None:
                logger.info("attention through %s: under --diffusion-rollout-gradient no trainer forward reproduces "
                            "this engine's, and on this GPU it is the fastest kernel", attention)
        if attention:
            route_attention(self.modules, attention)
        self.forward_modules: dict[str, nn.Module] = dict(self.modules)
        # The opaque kernels and eager rounding give a compiled engine the trainer's bits, which only a trainer
        # forward needs. Under --diffusion-rollout-gradient none runs (the gradient is the engine's own), so the
        # compiler fuses freely there; the group's fixed tiles still keep a sample's bits whatever shares its batch.
        self.eager_rounding = opaque_kernels_wanted(bool(server_args.forward_tile), server_args.enable_torch_compile,
                                                    self.device.type) and not server_args.rollout_gradient_tile
        if self.eager_rounding:
            for module in self.modules.values():  # the batch_invariant group: the trainer's kernels, so its bits
                block_lists = self.family.transformer_block_lists(module)
                if block_lists:
                    install_in_blocks(block_lists)
        if server_args.enable_torch_compile:
            self._compile(server_args.torch_compile_mode)
        self.pad_batches = bool(server_args.enable_torch_compile)  # see predict
        self.forward_sizes: set[int] = set()  # the padded batch sizes forwarded so far (compiled graphs)
        self.recent_buckets: deque[int] = deque(maxlen=NEW_SIZE_WINDOW)  # `batch_bucket` of the last forwards
        if self.device.type == "cuda" and 0 < server_args.forward_tile < 4:
            logger.warning(
                "DiT forwards run %d sample(s) at a time: the batch_invariant patch group uses the trainer's "
                "micro-batch as the engine's forward size; raise --micro-batch-size (4-16) for speed, or pass "
                "--rollout-patch-group none to batch freely without bitwise parity", server_args.forward_tile,
            )
        if self.cfg_parallel is not None and server_args.forward_tile:
            logger.warning(
                "CFG-parallel engine with the batch_invariant patch group: each CFG branch forwards %d samples where "
                "the trainer's CFG forward is one doubled batch of %d, so engine and trainer velocities agree to "
                "~1e-6 (fp32), not bitwise; a one-process or sequence-parallel engine keeps them bitwise",
                server_args.forward_tile, 2 * server_args.forward_tile,
            )
        self.weight_version = 0
        if server_args.release_buffers_ahead and self.device.type == "cuda":
            self._reserve_release_buffers()
        self.rollout_gradients = RolloutGradients(self.modules) if server_args.rollout_gradient_tile else None
        self._backends: dict[tuple, SdeStepBackend] = {}
        self.sequence_parallel_layouts: dict[str, SequenceParallelLayout] = {}
        if self._followers is not None:
            try:
                if self.sequence_parallel is not None:
                    self.sequence_parallel_layouts = sequence_parallel_layouts(
                        self.family, self.modules, server_args.tp_size)
                self._followers.connect(self.family, self.modules)
                if self.sequence_parallel is not None:
                    install_sequence_parallel(self.sequence_parallel_layouts, self.modules,
                                              UlyssesComm(self.sequence_parallel.group))
            except BaseException:
                self.close()
                raise

    def _start_followers(self, family: TrainPipelineConfig) -> None:
        tp_size = self.server_args.tp_size
        mode = engine_parallel_mode(tp_size, self.server_args.ulysses_degree, family)
        if mode is None:
            return
        if mode == MODE_SEQUENCE_PARALLEL and self.server_args.enable_torch_compile:
            raise MilesUserError(f"--sglang-enable-torch-compile with a sequence-parallel engine (--rollout-num-gpus-"
                                 f"per-engine {tp_size}) is not supported yet: its blocks hold collectives; drop one")
        if self.device.type == "cuda" and self.device.index + tp_size > torch.cuda.device_count():
            raise MilesUserError(f"--rollout-num-gpus-per-engine {tp_size}: the engine on GPU {self.device.index} "
                                 f"sees only {torch.cuda.device_count()} GPUs")
        leader = FollowerGroup(self.server_args, self.device, ModelRunner, mode, tp_size)
        if mode == MODE_CFG_PARALLEL:
            self.cfg_parallel = leader
        else:
            self.sequence_parallel = leader
        logger.info("%d-process %s-parallel engine", tp_size, mode)

    def parallel_info(self) -> dict:
        """`GET /server_info`'s `parallel`: how many processes serve this engine and how they split a forward."""
        followers = self._followers
        return {"processes": 1 if followers is None else followers.world_size,
                "mode": None if followers is None else followers.mode}

    @property
    def _followers(self) -> FollowerGroup | None:
        return self.cfg_parallel if self.cfg_parallel is not None else self.sequence_parallel

    def prepare_thread(self) -> None:
        """This engine's compiler settings in the calling thread. torch keeps a dynamo or inductor setting made in
        code per thread (context variables, torch ≥ 2.13) and the server runs the model on a worker thread of its
        own (`StepScheduler`): without this the worker compiled without the group's eager rounding, so a compiled
        engine's bf16 velocities left the trainer's (by up to 0.8 on the CPU), and with dynamo's default
        recompile limit."""
        if self.server_args.enable_torch_compile:
            raise_recompile_limits()
        if self.eager_rounding:
            enable_eager_rounding()

    def _compile(self, mode: str | None) -> None:
        """Compile each transformer block in place (miles/utils/compile.py); a module whose family lists no
        blocks is compiled whole. The VAE decoder too where the family says it pays (`compile_vae_decoder`)."""
        for name, module in self.modules.items():
            block_lists = self.family.transformer_block_lists(module)
            if block_lists:
                compile_blocks(block_lists, mode)
            else:
                self.forward_modules[name] = torch.compile(module, mode=mode, dynamic=False)
        decoder = getattr(getattr(self.pipe, "vae", None), "decoder", None)
        if self.family.compile_vae_decoder and isinstance(decoder, nn.Module):
            decoder.compile(mode=mode, dynamic=False)  # in place: the VAE's parameter names stay as loaded

    # ---- loading ----------------------------------------------------------------------------------------
    def _resolve_generator_device(self, name: str) -> torch.device:
        device = torch.device(name)
        if device.type == "cuda" and self.device.type != "cuda":
            logger.info("generator device %s requested on a %s engine; using cpu generators", name, self.device)
            return torch.device("cpu")
        if device.type == "cuda" and device.index is None:
            return self.device  # the engine's own GPU
        return device

    def _load(self, server_args: ServerArgs, family: TrainPipelineConfig | None) -> tuple[TrainPipelineConfig, Any]:
        if server_args.pipeline_builder_path:
            builder = load_function(server_args.pipeline_builder_path, "--pipeline-builder-path", required_params=1)
            family, pipe = builder(server_args)
            return family, pipe
        family = family if family is not None else self._build_family(server_args)
        pipe = family.load_pipeline(server_args.model_path, self.dtype, self.device)
        return family, pipe

    def _build_family(self, server_args: ServerArgs) -> TrainPipelineConfig:
        """The family of `model_path` (reads its model_index.json, loads no weights)."""
        path = server_args.model_path
        if not path:
            raise MilesUserError("the engine needs --model-path (a diffusers pipeline folder or hub id)")
        if (os.path.isabs(path) or path.startswith((".", "~"))) and not os.path.exists(os.path.expanduser(path)):
            raise MilesUserError(f"--model-path {path!r} does not exist")
        return build_train_pipeline_config(
            server_args.model_path,
            diffusion_model_family=server_args.model_family,
            train_pipeline_config_path=server_args.train_pipeline_config_path,
            model_backend_path=server_args.model_backend_path,
        )

    # ---- one request ------------------------------------------------------------------------------------
    def _backend(self, request: GenerateRequest) -> SdeStepBackend:
        # the backend class comes from the engine's own flags: a request never names code to import
        key = (request.sde_type, request.noise_level, request.log_prob_no_const, self.server_args.sde_step_backend_path)
        if key not in self._backends:
            try:
                self._backends[key] = build_sde_backend(*key)
            except MilesUserError as err:
                raise ProtocolError(str(err)) from err
        return self._backends[key]

    @torch.no_grad()
    def start(self, request: GenerateRequest) -> Trajectory:
        """Encode the prompt, build the generators and the initial latents (x_0)."""
        began = time.perf_counter()
        request.validate()
        backend = self._backend(request)
        shape = GenerationShape(request.height, request.width, request.num_frames, request.fps)
        negative = request.negative_prompt
        if negative is None and request.guidance.do_cfg:
            negative = DEFAULT_NEGATIVE_PROMPT
        mismatch = condition_image_mismatch(self.family.family, self.family.condition_image, request.image is not None)
        if mismatch is not None:
            raise ProtocolError(mismatch)
        # The image (if any) is encoded once per request: its samples share it like the prompt.
        image = request.image.to_tensor() if request.image is not None else None
        encoded = self.family.encode_conditioning(self.pipe, [request.prompt], negative, request.guidance, shape=shape,
                                                  image=image)
        m = request.num_samples
        sigmas = self.family.sigmas(self.pipe, request.num_steps, shape, request.flow_shift)
        sigmas = sigmas.to(dtype=torch.float32)
        sigma_values = tuple(sigmas.tolist())  # before the move: reading them later would wait for the device
        sigmas = sigmas.to(device=self.device)
        timesteps = self.family.timesteps_from_sigmas(sigmas[:-1])
        seeds = [request.seed + b for b in range(m)]
        generators = generators_from_seeds(seeds, device=self.generator_device)
        latents = self.family.prepare_latents(self.pipe, shape, generators, self.dtype)
        latents = latents.to(device=self.device, dtype=torch.float32)
        for layout in self.sequence_parallel_layouts.values():
            try:
                check_sequence_length(layout, tuple(latents.shape[1:]), self.server_args.tp_size)
            except ValueError as err:
                raise ProtocolError(str(err)) from err
        if request.rollout_gradient:
            if self.rollout_gradients is None or self._followers is not None:
                raise ProtocolError("rollout_gradient: this engine was not started for it (--diffusion-rollout-"
                                    "gradient on a one-process engine)")
            self.rollout_gradients.check_pushed()
        trajectory = Trajectory(
            request=request,
            shape=shape,
            conditioning=encoded,  # one row until `activate`: a request waiting for its weights holds no more
            sigmas=sigmas,
            sigma_values=sigma_values,
            timesteps=timesteps,
            latents=latents,
            generators=generators,
            backend=backend,
            sde_steps=frozenset(request.sde_step_indices),
            return_latents=frozenset(request.return_latent_indices),
        )
        self.record_latents(trajectory)
        trajectory.start_seconds = time.perf_counter() - began
        return trajectory

    def activate(self, trajectory: Trajectory) -> None:
        """At a trajectory's first step, what depends on the weights it is denoised with (`start` does not, so a
        request may be encoded before the weights it waits for arrive): their version, the conditioning's row for
        every sample, and a rollout_gradient request's zeroed per-sample gradient sums (allocated only now: a
        request waiting for its gradient wave holds none)."""
        trajectory.activated = True
        m = trajectory.num_samples
        trajectory.conditioning = {key: value.expand(m, *value.shape[1:]).contiguous()
                                   for key, value in trajectory.conditioning.items()}
        trajectory.weight_version_at_start = self.weight_version
        if trajectory.request.rollout_gradient:
            self.rollout_gradients.spill_to_host()  # an earlier wave's kept sums make room for this one's
            trajectory.gradient_sums = self.rollout_gradients.sums(m)

    def batch_key(self, trajectory: Trajectory) -> tuple:
        """Trajectories with equal keys may share one DiT forward at their current steps."""
        request = trajectory.request
        expert = self.family.expert_for(trajectory.sigma_values[trajectory.step])
        return (
            expert,
            trajectory.shape,
            request.guidance,
            tuple(trajectory.latents.shape[1:]),
            _conditioning_signature(trajectory.conditioning),
        )

    def record_latents(self, trajectory: Trajectory) -> None:
        if trajectory.step in trajectory.return_latents:
            trajectory.recorded[trajectory.step] = trajectory.latents

    def step(self, trajectories: list[Trajectory]) -> None:
        """Advance every trajectory by one step with one batched velocity forward (chunked at max_batch_size);
        the SDE steps of rollout_gradient requests with their backward (`step_with_gradients`).

        The caller guarantees equal `batch_key`s.
        """
        for t in trajectories:
            if not t.activated:
                self.activate(t)
        with_gradients = [t for t in trajectories if t.gradient_sums is not None and t.step in t.sde_steps]
        if with_gradients:
            step_with_gradients(self, with_gradients)
            trajectories = [t for t in trajectories if not any(t is g for g in with_gradients)]
        if trajectories:
            self._step(trajectories)

    @torch.no_grad()
    def _step(self, trajectories: list[Trajectory]) -> None:
        began, compiled_before = time.perf_counter(), compile_seconds()
        first = trajectories[0]
        latents = torch.cat([t.latents for t in trajectories])
        sigmas = torch.cat([t.sigmas[t.step].expand(t.num_samples) for t in trajectories])
        conditioning = {
            key: torch.cat([t.conditioning[key] for t in trajectories]) for key in first.conditioning
        }
        chunk = max(1, self.server_args.max_batch_size)
        velocities = []
        for lo in range(0, latents.shape[0], chunk):
            velocities.append(
                self._forward(
                    latents[lo : lo + chunk],
                    sigmas[lo : lo + chunk],
                    {key: value[lo : lo + chunk] for key, value in conditioning.items()},
                    first,
                )
            )
        velocity = torch.cat(velocities) if len(velocities) > 1 else velocities[0]
        offset = 0
        for t in trajectories:
            v = velocity[offset : offset + t.num_samples]
            offset += t.num_samples
            self._apply_step(t, v)
        elapsed, compiling = time.perf_counter() - began, compile_seconds() - compiled_before
        for t in trajectories:
            t.denoise_seconds += elapsed
            t.compile_seconds += compiling

    def _forward(self, latents, sigmas, conditioning, first: Trajectory) -> torch.Tensor:
        """One guided velocity forward. On a CFG-parallel engine the follower computes the unconditional branch
        while this process computes the conditional one; `combine_cfg` joins them as the family's doubled batch
        would."""
        guidance, shape = first.request.guidance, first.shape
        if self.sequence_parallel is not None:  # every rank runs this forward on its share of the tokens
            self.sequence_parallel.send_forward(latents, sigmas, conditioning, guidance, shape)
            return self.predict(latents, sigmas, conditioning, guidance, shape)
        # every sample of a forward is in one expert phase (expert_for), so its first sigma says the scale
        scale = None if self.cfg_parallel is None else self.family.cfg_scale_at(guidance, first.sigma_values[first.step])
        if scale is None:
            return self.predict(latents, sigmas, conditioning, guidance, shape)
        positive, negative = split_conditioning(conditioning, self.cfg_parallel.keys)
        branch_guidance = self.family.cfg_branch_guidance(guidance)
        self.cfg_parallel.send_unconditional(latents, sigmas, negative, branch_guidance, shape)
        v_pos = self.predict(latents, sigmas, positive, branch_guidance, shape)
        v_neg = self.cfg_parallel.receive_unconditional(like=v_pos)
        return combine_cfg(torch.cat([v_neg, v_pos]), scale, renormalize=self.family.cfg_renormalize)

    def predict(self, latents, sigmas, conditioning, guidance: GuidanceConfig, shape: GenerationShape) -> torch.Tensor:
        """The family's velocity forward (fp32 out). With the batch_invariant group, in tiles of exactly
        `forward_tile` samples (the trainer's; miles/models/batch_invariant.py). Otherwise, with torch.compile, the
        batch is padded (repeating its last sample; `padded_batch_size`), so a compiled engine sees a handful of
        shapes instead of recompiling for every batch size that concurrent requests happen to form; samples never
        interact in a DiT, the padding is dropped."""
        if self.server_args.forward_tile:
            return predict_velocity_in_tiles(
                self.family, self.forward_modules, latents, sigmas, conditioning, guidance,
                shape, self.dtype, self.server_args.forward_tile,
            ).float()
        batch = latents.shape[0]
        padded = batch
        if self.pad_batches:
            bucket = batch_bucket(batch, self.server_args.max_batch_size)
            self.recent_buckets.append(bucket)
            padded = padded_batch_size(batch, self.forward_sizes, self.server_args.max_batch_size,
                                       self.recent_buckets.count(bucket))
            self.forward_sizes.add(padded)
        if padded > batch:
            extra = padded - batch

            def pad(tensor: torch.Tensor) -> torch.Tensor:
                return torch.cat([tensor, tensor[-1:].expand(extra, *tensor.shape[1:])])

            latents, sigmas = pad(latents), pad(sigmas)
            conditioning = {key: pad(value) for key, value in conditioning.items()}
        velocity = self.family.predict_velocity(
            self.forward_modules, latents, sigmas, conditioning, guidance, shape, self.dtype
        ).float()
        return velocity[:batch] if padded > batch else velocity

    def _apply_step(self, t: Trajectory, velocity: torch.Tensor) -> None:
        k = t.step
        m = t.num_samples
        sigma = t.sigmas[k].expand(m)
        sigma_next = t.sigmas[k + 1].expand(m)
        if t.request.debug:
            t.debug_velocities[k] = velocity
        if k in t.sde_steps:
            out = t.backend.sample(t.latents, velocity, sigma, sigma_next, t.sigmas[1].expand(m), t.generators)
            t.latents = out.next_latents
            t.log_probs[k] = out.log_prob
        else:
            t.latents = ode_step(t.latents, velocity, sigma, sigma_next)
        t.step = k + 1
        self.record_latents(t)

    def finish(self, t: Trajectory) -> GenerateResponse:
        """Decode the final latents and pack every sample's result on the host (`finish_async`, waited for)."""
        return self.finish_async(t).result()

    @torch.no_grad()
    def finish_async(self, t: Trajectory) -> PendingResponse:
        """Queue the decode of the final latents and the copies of every result to the host; the returned
        `PendingResponse` packs them once they landed (miles/engine/host_transfer.py), off this thread."""
        request = t.request
        compiled_before = compile_seconds()
        to_host, decode = HostCopies(self.device), DeviceTimer(self.device)
        decode.start()
        final_latents = self.family.final_latents(t.latents, t.conditioning)
        images: torch.Tensor | None = None
        if request.return_images:
            chunk = max(1, self.server_args.vae_decode_batch_size)
            images = to_host(torch.cat(
                [self.family.decode(self.pipe, final_latents[lo : lo + chunk], t.shape)
                 for lo in range(0, t.num_samples, chunk)]
            ))
        decode.stop()
        t.compile_seconds += compile_seconds() - compiled_before  # the VAE decoder's graph, on a first decode
        if t.compile_seconds > 0.5:  # the log says how much a first request (or a new shape) compiled
            logger.info("request %s compiled for %.1f s; %d graphs compiled in this engine so far",
                        request.request_id, t.compile_seconds, compiled_graphs())
        if t.gradient_sums is not None:  # kept under each sample's seed until POST /policy_gradient
            self.rollout_gradients.keep((request.seed + b for b in range(t.num_samples)), t.gradient_sums)
            t.gradient_sums = None
        training = not request.evaluation
        sigmas = torch.tensor(t.sigma_values, dtype=torch.float32)
        timesteps = to_host(t.timesteps.float())
        recorded = {k: to_host(v) for k, v in t.recorded.items()} if training else {}
        log_probs = (
            to_host(torch.stack([t.log_probs[k] for k in request.sde_step_indices], dim=1))
            if request.sde_step_indices
            else torch.zeros(t.num_samples, 0)
        )
        # One prompt per request: every sample's conditioning is the same row, sent (and kept) once. A
        # rollout_gradient request's trainer replays nothing, so it gets none (5.5 MB a request at SD3.5-M, bf16).
        replayed = training and not request.rollout_gradient
        conditioning = {key: to_host(value[0].clone()) for key, value in t.conditioning.items()} if replayed else {}
        final = to_host(final_latents)
        debug = {k: to_host(v) for k, v in t.debug_velocities.items()} if request.debug else None
        to_host.mark()
        if self.weight_version != t.weight_version_at_start:
            logger.warning(
                "request %s spanned a weight update (version %d -> %d)",
                request.request_id,
                t.weight_version_at_start,
                self.weight_version,
            )
        weight_version, num_samples = self.weight_version, t.num_samples

        def pack() -> GenerateResponse:  # on the host tensors only, once they landed
            samples = [
                SampleResult(
                    seed=request.seed + b,
                    image=None if images is None else images[b].clone(),
                    latents={k: v[b].clone() for k, v in recorded.items()},
                    timesteps=timesteps,
                    sigmas=sigmas,
                    rollout_log_probs=log_probs[b].clone(),
                    conditioning=conditioning,
                    clean_latents=final[b].clone() if training else None,
                    debug_model_outputs=None if debug is None else {k: v[b].clone() for k, v in debug.items()},
                )
                for b in range(num_samples)
            ]
            return GenerateResponse(request_id=request.request_id, weight_version=weight_version, samples=samples)

        return PendingResponse(pack, to_host, decode, t.started_at,
                               timings={"start": t.start_seconds, "denoise": t.denoise_seconds,
                                        "compile": t.compile_seconds})

    def weights_updated(self) -> None:
        """After a weight update's flush: the followers (CFG- or sequence-parallel) receive the new values; per-sample
        gradients of the previous policy that were not asked for are dropped."""
        if self._followers is not None:
            self._followers.sync_weights(self.modules)
        if self.rollout_gradients is not None:
            self.rollout_gradients.new_weights()

    def close(self) -> None:
        """Stop the followers, if any."""
        followers = self._followers
        self.cfg_parallel = self.sequence_parallel = None
        if followers is not None:
            followers.close()

    # ---- memory -----------------------------------------------------------------------------------------
    def pipeline_modules(self) -> dict[str, nn.Module]:
        """Every nn.Module component of the pipeline (denoisers, encoders, VAE)."""
        components = getattr(self.pipe, "components", None) or {}
        return {name: value for name, value in components.items() if isinstance(value, nn.Module)}

    def _reserve_release_buffers(self) -> None:
        """Pin the host buffers of every device tensor `release_memory` moves, on a thread of their own, while the
        trainer starts (an H100's first release of SD3.5-Medium's engine took 4.1-4.3 s pinning them, later
        ones 0.12 s)."""
        layouts = {}

        def record(name: str, tensor: torch.Tensor) -> None:
            if tensor.device.type == "cuda":
                layouts[name] = (tensor.shape, tensor.dtype)

        replace_module_tensors(nn.ModuleDict(self.pipeline_modules()), record)  # the names release_memory uses
        self._host_copies.reserve_in_background(layouts, self.device)

    def release_memory(self) -> None:
        """Every component's tensors on the device to pinned host buffers, and the cached device memory returned
        (colocated runs, while the trainer trains). The buffers are pinned at the first release and reused: a
        pageable `Module.to("cpu")` and back took 1.6 s per iteration for SD3.5-Medium's 4.6 GiB on an H100
        (bench/RESULTS.md, twenty-second session)."""
        if self.device.type != "cuda":
            return
        if self._followers is not None:
            self._followers.release_memory()
        if self.rollout_gradients is not None:
            self.rollout_gradients.spill_to_host()  # kept sums not yet asked for wait on the host meanwhile
        self._released = []

        def to_host(name: str, tensor: torch.Tensor) -> torch.Tensor | None:
            if tensor.device.type != "cuda":  # a component kept on the host stays there
                return None
            self._released.append(name)
            return self._host_copies.to_host(name, tensor)

        replace_module_tensors(nn.ModuleDict(self.pipeline_modules()), to_host)  # names: "<component>.<tensor>"
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        """What `release_memory` sent to the host back to the device."""
        if self.device.type != "cuda":
            return
        if self._followers is not None:
            self._followers.resume_memory()
        released = set(self._released)

        def to_device(name: str, tensor: torch.Tensor) -> torch.Tensor | None:
            return tensor.to(self.device, non_blocking=True) if name in released else None

        replace_module_tensors(nn.ModuleDict(self.pipeline_modules()), to_device)
        self._released = []
        torch.cuda.synchronize()
