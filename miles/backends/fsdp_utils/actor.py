"""The per-rank FSDP2 trainer: one rollout's samples in, optimizer steps out (docs/algorithms.md §5–§9).

`train()` reads as one rollout: samples → pairs (train_data.py) → optional old-log-prob recompute → for each
optimizer window: micro-batch forwards (the family's CFG-combined `predict_velocity`), the math core's loss,
backward on Σ/Q → unscale (fp16) → clip → AdamW → LR step; then one EMA update. Metrics are Σtotal/Σcount over
micro-batches and ranks. Checkpoints and weight export live in checkpoint.py and weight_export.py.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from miles.backends.fsdp_utils import deterministic
from miles.backends.fsdp_utils.optimizer_parking import GIB, OptimizerParking
from miles.backends.fsdp_utils.parallel_dims import ParallelDims
from miles.backends.fsdp_utils.parallelize import (
    adapters_created_in, base_load_dtype, base_stays_on_host, holds_weights_whole, parallelize_module, set_aside,
    trainer_dtypes,
)
from miles.backends.fsdp_utils.train_data import (
    TrainBatch,
    collate,
    convert_samples_to_train_data,
    plan_rank_train_data,
)
from miles.backends.fsdp_utils.train_metrics import FlopCount, MetricSums, train_speed_metrics
from miles.config.sections import RunConfig
from miles.models.base import GenerationShape
from miles.models.batch_invariant import (
    lora_merge_suspended,
    lora_merged_once,
    patch_lora_layers,
    pin_attention,
    predict_velocity_in_tiles,
)
from miles.types import GuidanceConfig, Sample
from miles.utils.compile import compile_seconds
from miles.utils.device_memory import allocator_counts
from miles.utils.errors import MilesUserError
from miles.utils.host_usage import HostUsage
from miles.utils.imports import load_function
from miles.utils.laps import Laps
from miles.utils.profiling import profile_train_step

if TYPE_CHECKING:
    from miles.backends.fsdp_utils.gradient_fetch import FetchedGradient

logger = logging.getLogger(__name__)

class DiffusionTrainer:
    """One trainer rank. Needs torch.distributed initialised (world size 1 works too)."""

    def __init__(self, config: RunConfig, family, device: torch.device | str = "cpu"):
        """`config` went through `validate_args`: the loss type, the reference policy (`ref_mode`) and the EMA
        consumers are already checked and resolved there, once."""
        self.config = config
        self.family = family
        self.device = torch.device(device)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.dims = ParallelDims.from_config(config.trainer, self.world_size)
        self.dp_rank = self.dims.dp_rank(self.rank)
        self.forward_dtype, self.master_dtype, self.reduce_dtype = trainer_dtypes(config.trainer)
        self.ref_mode = config.trainer.ref_mode
        self.guidance = GuidanceConfig(
            guidance_scale=config.sampling.diffusion_guidance_scale,
            guidance_scale_2=config.sampling.diffusion_guidance_scale_2,
            true_cfg_scale=config.sampling.diffusion_true_cfg_scale,
        )
        self.shape = GenerationShape(
            height=config.sampling.diffusion_height,
            width=config.sampling.diffusion_width,
            num_frames=config.sampling.diffusion_output_num_frames,
            fps=config.sampling.diffusion_fps,
        )
        self.module_names = self._module_names()
        # the batch_invariant patch group (miles/models/batch_invariant.py): forwards in the engine's tiles
        self.forward_tile = config.sampling.parity_forward_tile
        # its LoRA layers form the merged weight once per optimizer step where the weights are whole on the rank
        self.merge_lora_once = bool(self.forward_tile and config.trainer.use_lora
                                    and holds_weights_whole(config.trainer, self.dims))
        # One trainer rank, its weights whole on the device, one denoiser module, LoRA: FSDP2 would copy and cast
        # every unit's gradients into its reduction after each micro-batch. Accumulating them unsharded in the
        # reduce dtype and reducing once, after a window's last micro-batch, adds the same values in the same order
        # (the same gradients, bit for bit) with one reduction per optimizer step. Several modules (Wan2.2's two
        # experts) keep the reduction per micro-batch: a module the last micro-batch skips would keep its
        # gradients unreduced; so do more ranks (their reductions overlap the backward and keep gradients sharded),
        # and so does a full fine-tune: with it, the documented SD3.5-Medium full fine-tune on one H100 ran out of
        # memory in its second training, which it had fitted without it (bench/RESULTS.md, twenty-eighth session).
        self.reduce_once_per_window = (self.world_size == 1 and holds_weights_whole(config.trainer, self.dims)
                                       and len(self.module_names) == 1 and config.trainer.use_lora)
        self.model: nn.ModuleDict | None = None
        self.host_params: list[nn.Parameter] = []
        self.ema = None
        self.flops_per_pair: float | None = None
        self.global_step = 0

    def _module_names(self) -> list[str]:
        value = self.config.model.update_weight_target_module
        if not value:
            return list(self.family.trainable_modules)
        names = value.split(",") if isinstance(value, str) else list(value)
        return [n.strip() for n in names if n.strip()]

    # ------------------------------------------------------------------------------------------------
    # construction
    # ------------------------------------------------------------------------------------------------
    def init(self) -> int:
        """Load, LoRA, shard, optimizer, scheduler, EMA, resume. Returns the first rollout id to run."""
        config = self.config
        laps = self.init_laps = Laps()  # perf/startup/trainer_init/<lap>_time
        deterministic.apply_deterministic_mode(config.trainer.seed, config.trainer.deterministic_mode)
        self.mesh = self.dims.build_mesh(self.device.type)
        with laps.lap("load"):
            modules = self.family.load_modules(config.model.hf_checkpoint, self.module_names,
                                               base_load_dtype(config.trainer, self.dims))
            if self.forward_tile:
                pin_attention(modules, self.forward_dtype, self.device.type, family=self.family)
        deterministic.seed_everything(config.trainer.seed)  # identical LoRA init on every rank
        for name, module in modules.items():
            with laps.lap("adapters"):
                if config.trainer.use_lora:
                    self._add_lora(name, module)
                    if self.forward_tile:
                        patch_lora_layers(module)
                else:
                    module.requires_grad_(True)
                    self.family.freeze_untrained(name, module)
            with laps.lap("shard"):
                parallelize_module(module, self.family, config.trainer, self.dims, self.mesh, name, self.device,
                                   opaque_kernels=bool(self.forward_tile))
        self.model = nn.ModuleDict(modules)
        self.trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        # the frozen base the trainer never forwards (--diffusion-rollout-gradient): kept on the host throughout
        self.host_params = [p for p in self.model.parameters() if not p.requires_grad and p.device.type == "cpu"] \
            if base_stays_on_host(config.trainer, self.dims) and self.device.type != "cpu" else []
        if not self.trainable:
            raise MilesUserError("no trainable parameters: check --lora-target-modules / --update-weight-target-module")
        self.optimizer = torch.optim.AdamW(
            [p for _, p in self.trainable],
            lr=config.trainer.lr,
            betas=(config.trainer.adam_beta1, config.trainer.adam_beta2),
            eps=config.trainer.adam_eps,
            weight_decay=config.trainer.weight_decay,
            # fused: one kernel per step on the GPU; on the host, where only a trainer there by choice steps
            # (--rollout-gradient-trainer host), torch's CPU kernel (a third of the foreach step's time on 19 M values)
            fused=(self.device.type == "cuda" and not config.trainer.fsdp_cpu_offload) or config.trainer.on_host,
        )
        # where the moments would not fit beside the next training's peak, they wait on the host through it
        self.optimizer_parking = OptimizerParking(
            self.optimizer, self.device, int(config.placement.colocate_memory_margin_gb * GIB))
        from miles.diffusion.lr_scheduler import build_lr_scheduler
        from miles.diffusion.sde import build_sde_backend

        total_steps = config.data.num_rollout * config.data.num_steps_per_rollout
        self.lr_scheduler = build_lr_scheduler(config.trainer, self.optimizer, total_steps)
        if config.trainer.use_ema:
            from miles.diffusion.ema import EMA

            self.ema = EMA(
                self.trainable,
                decay_init=config.trainer.ema_decay_init,
                decay_ramp=config.trainer.ema_decay_ramp,
                decay_max=config.trainer.ema_decay_max,
                flat_steps=config.trainer.ema_decay_flat_steps,
            )
        self.sde = build_sde_backend(
            config.sampling.diffusion_sde_type,
            config.sampling.diffusion_noise_level,
            config.sampling.diffusion_log_prob_no_const,
            config.sampling.sde_step_backend_path,
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.forward_dtype == torch.float16)
        self.custom_loss = None
        if config.trainer.loss_type == "custom_loss":
            from miles.diffusion.losses import load_custom_loss

            self.custom_loss = load_custom_loss(config.trainer.custom_loss_function_path)
        prepare_path = config.trainer.custom_prepare_train_batch_path
        self.prepare_batch = (
            load_function(prepare_path, "--custom-prepare-train-batch-path", 2) if prepare_path else None
        )
        from miles.backends.fsdp_utils.checkpoint import load_checkpoint

        with laps.lap("resume"):
            start_rollout_id = load_checkpoint(self)
        if config.data.start_rollout_id is not None:
            start_rollout_id = config.data.start_rollout_id
        return start_rollout_id

    def _add_lora(self, name: str, module: nn.Module) -> None:
        from peft import LoraConfig

        config = self.config
        targets = config.trainer.lora_target_modules or list(self.family.default_lora_target_modules)
        if not targets:
            raise MilesUserError("--use-lora: the family names no default LoRA targets; pass --lora-target-modules")
        init = config.trainer.lora_init_weights
        init_value = {"kaiming-uniform": True, "true": True, "false": False}.get(init.lower(), init)
        lora_config = LoraConfig(
            r=config.trainer.lora_rank,
            lora_alpha=config.trainer.lora_alpha,
            target_modules=list(targets),
            init_lora_weights=init_value,
        )
        module.requires_grad_(False)
        try:
            with adapters_created_in(module, lora_config, self.master_dtype):
                module.add_adapter(lora_config)
        except ValueError as err:  # PEFT: no target matched, or an unknown init scheme
            raise MilesUserError(f"--use-lora on {name!r}: {err}") from err
        self.lora_config = lora_config

    # ------------------------------------------------------------------------------------------------
    # forwards
    # ------------------------------------------------------------------------------------------------
    def velocity(self, latents, sigmas, conditioning, guidance: GuidanceConfig) -> torch.Tensor:
        """The family's CFG-combined velocity in fp32 (the same function the engine samples with)."""
        if self.forward_tile:
            return predict_velocity_in_tiles(
                self.family, self.model, latents, sigmas, conditioning, guidance, self.shape, self.forward_dtype,
                self.forward_tile,
            )
        return self.family.predict_velocity(
            self.model, latents, sigmas, conditioning, guidance, self.shape, self.forward_dtype
        )

    def _reduce_gradients_after_this_backward(self, last_of_window: bool) -> None:
        """With `reduce_once_per_window`, FSDP reduces only the window's last backward (the others accumulate)."""
        if self.reduce_once_per_window:
            from torch.distributed.fsdp import FSDPModule

            for module in self.model.values():
                if isinstance(module, FSDPModule):
                    module.set_requires_gradient_sync(last_of_window)

    def _check_gradients_reduced(self, rollout_id: int) -> None:
        """With `reduce_once_per_window`: every FSDP unit's gradient was reduced by the window's last backward. A
        unit a window's earlier micro-batches used but its last one skipped would keep its accumulated gradient
        unreduced, and the optimizer step would not see it; no family's denoiser skips a block today, and this
        says so plainly if one ever does, instead of losing the gradient."""
        if not self.reduce_once_per_window:
            return
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.values():
            for name, unit in module.named_modules():
                group = getattr(unit._get_fsdp_state(), "_fsdp_param_group", None) \
                    if isinstance(unit, FSDPModule) else None
                for fsdp_param in getattr(group, "fsdp_params", []):
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None or (
                            unsharded is not None and unsharded.grad is not None):
                        raise RuntimeError(
                            f"rollout {rollout_id}: the FSDP unit {name or '(root)'!r} took part in a window's earlier "
                            "micro-batches but not in its last, so the one-rank reduction once per window "
                            "(reduce_once_per_window, miles/backends/fsdp_utils/actor.py) left its gradient "
                            "unreduced; this family needs the reduction after every micro-batch")

    def _weights_fixed(self):
        """Context for forwards between two optimizer steps: the LoRA layers' merged weight formed once."""
        return lora_merged_once(self.model) if self.merge_lora_once else contextlib.nullcontext()

    @contextlib.contextmanager
    def reference_weights(self):
        """No-grad context with the reference policy in the live modules (`--ref-mode`, §5/§8)."""
        with torch.no_grad():
            if self.ref_mode == "ema":
                with self.ema.swapped(), lora_merge_suspended(self.model):
                    yield
            elif self.ref_mode == "lora_base":
                for module in self.model.values():
                    module.disable_adapters()
                try:
                    yield
                finally:
                    for module in self.model.values():
                        module.enable_adapters()
            else:
                yield

    def _pair_noise(self, batch: TrainBatch, rollout_id: int) -> torch.Tensor:
        noises = []
        for pair in batch.pairs:
            seed = self.config.trainer.seed
            generator = deterministic.pair_generator(seed, rollout_id, pair.sample_index, pair.step_index)
            noises.append(torch.randn(tuple(pair.latents.shape), generator=generator, dtype=torch.float32))
        return torch.stack(noises).to(self.device)

    # ------------------------------------------------------------------------------------------------
    # losses
    # ------------------------------------------------------------------------------------------------
    def _rl_loss(self, batch: TrainBatch, window_index: int, metrics: MetricSums):
        from miles.diffusion.losses import LossInputs, call_custom_loss, kl_to_reference, policy_loss

        config = self.config
        kl_beta = config.trainer.diffusion_kl_beta
        velocity = self.velocity(batch.latents, batch.sigmas, batch.conditioning, self.guidance)
        step = self.sde.log_prob(
            batch.latents, velocity, batch.next_latents, batch.sigmas, batch.sigmas_next, batch.sigmas_1
        )
        recompute = config.trainer.diffusion_recompute_old_log_prob
        old_log_prob = step.log_prob.detach() if (recompute and window_index == 0) else batch.old_log_probs
        ref_mean = ref_velocity = None
        if kl_beta > 0 or (self.custom_loss is not None and self.ref_mode != "none"):
            with self.reference_weights():
                ref_velocity = self.velocity(batch.latents, batch.sigmas, batch.conditioning, self.guidance)
                ref_mean = self.sde.log_prob(
                    batch.latents, ref_velocity, batch.next_latents, batch.sigmas, batch.sigmas_next, batch.sigmas_1
                ).mean
        if self.custom_loss is not None:
            inputs = LossInputs(
                advantages=batch.advantages,
                new_log_prob=step.log_prob,
                old_log_prob=old_log_prob,
                rollout_log_prob=batch.old_log_probs,
                velocity=velocity,
                ref_velocity=ref_velocity,
                mean=step.mean,
                ref_mean=ref_mean,
                std=step.std,
                diffusion_coef=step.diffusion_coef,
                latents=batch.latents,
                next_latents=batch.next_latents,
                sigma=batch.sigmas,
                sigma_next=batch.sigmas_next,
                sample_indices=torch.tensor([p.sample_index for p in batch.pairs]),
                step_indices=torch.tensor([p.step_index for p in batch.pairs]),
                loss_mask=batch.loss_mask,
                extra=batch.extra,
            )
            loss, pair_metrics = call_custom_loss(self.custom_loss, config.hook_args, inputs)
        else:
            kl = kl_to_reference(step.mean, ref_mean, step.diffusion_coef) if kl_beta > 0 else None
            loss, pair_metrics = policy_loss(
                step.log_prob,
                old_log_prob,
                batch.advantages,
                config.trainer.diffusion_clip_range,
                config.trainer.diffusion_adv_clip_max,
                kl=kl,
                kl_beta=kl_beta,
            )
        if window_index == 0:
            metrics.add("rollout_train_log_prob_abs_diff", (step.log_prob.detach() - batch.old_log_probs).abs())
        self._debug_metrics(batch, velocity, metrics)
        return loss, pair_metrics

    def _nft_or_sft_loss(self, batch: TrainBatch, rollout_id: int, metrics: MetricSums):
        from miles.diffusion.losses import forward_noise, nft_loss, sft_loss

        config = self.config
        noise = self._pair_noise(batch, rollout_id)
        clean = batch.latents
        noised = forward_noise(clean, noise, batch.sigmas)
        no_cfg = GuidanceConfig(guidance_scale=1.0)
        v_theta = self.velocity(noised, batch.sigmas, batch.conditioning, no_cfg)
        if config.trainer.loss_type == "sft_loss":
            return sft_loss(v_theta, clean, noise)
        if self.ref_mode == "none":
            v_old = v_theta.detach()
        else:
            with self.reference_weights():
                v_old = self.velocity(noised, batch.sigmas, batch.conditioning, no_cfg)
        return nft_loss(
            v_theta,
            v_old,
            noised,
            clean,
            batch.sigmas,
            batch.advantages,
            config.trainer.diffusion_nft_beta,
            config.trainer.diffusion_adv_clip_max,
            adaptive_weight=not config.trainer.no_diffusion_nft_adaptive_weight,
        )

    def _debug_metrics(self, batch: TrainBatch, velocity: torch.Tensor, metrics: MetricSums) -> None:
        if not self.config.debug.diffusion_debug_mode or batch.debug_model_outputs is None:
            return
        diff = (velocity.detach().float() - batch.debug_model_outputs.to(velocity.device)).abs()
        metrics.add("model_output_mean_abs_diff", diff.reshape(diff.shape[0], -1).mean(dim=1))
        metrics.add_max("model_output_max_abs_diff", diff.max())

    def _micro_batch_loss(self, batch: TrainBatch, rollout_id: int, window_index: int, metrics: MetricSums):
        if self.config.trainer.loss_type in ("policy_loss", "custom_loss"):
            return self._rl_loss(batch, window_index, metrics)
        return self._nft_or_sft_loss(batch, rollout_id, metrics)

    # ------------------------------------------------------------------------------------------------
    # one rollout
    # ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def recompute_old_log_probs(self, windows) -> None:
        """§5: with the pre-update weights, overwrite ℓ_old of every pair in windows 1…W−1."""
        with self._weights_fixed():
            self._recompute_old_log_probs(windows)

    def _recompute_old_log_probs(self, windows) -> None:
        for window in windows[1:]:
            for micro_batch in window:
                batch = self._batch(micro_batch)
                velocity = self.velocity(batch.latents, batch.sigmas, batch.conditioning, self.guidance)
                step = self.sde.log_prob(
                    batch.latents, velocity, batch.next_latents, batch.sigmas, batch.sigmas_next, batch.sigmas_1
                )
                for pair, value in zip(micro_batch, step.log_prob.tolist()):
                    pair.old_log_prob = value

    def _batch(self, micro_batch) -> TrainBatch:
        batch = collate(micro_batch, self.device)
        if self.prepare_batch is not None:
            batch = self.prepare_batch(self.config.hook_args, batch)
            if not isinstance(batch, TrainBatch):
                raise MilesUserError(
                    f"--custom-prepare-train-batch-path must return a TrainBatch, got {type(batch).__name__}"
                )
        return batch

    def train(self, rollout_id: int, samples: list[Sample], gradient: FetchedGradient | None = None
              ) -> dict[str, float]:
        """Train on one rollout's samples; returns `train/*` and `perf/*` metrics (identical on every rank).
        `gradient`: the engines' policy gradient (`--diffusion-rollout-gradient`: fetched by rank 0,
        gradient_fetch.py), stepped on without a replay."""
        if gradient is not None:
            from miles.backends.fsdp_utils.rollout_gradient_step import train_on_rollout_gradient

            return train_on_rollout_gradient(self, rollout_id, samples, gradient)
        with profile_train_step(rollout_id, self.rank, self.device):  # MILES_PROFILE_TRAIN_DIR, else nothing
            return self._train(rollout_id, samples)

    def _train(self, rollout_id: int, samples: list[Sample]) -> dict[str, float]:
        started = time.perf_counter()
        compiled_before = compile_seconds()
        host_before = HostUsage.measure()
        allocator_before = allocator_counts(self.device)
        config = self.config
        skip_step = config.debug.debug_skip_optimizer_step
        _stage_on_device(samples, self.device)
        pairs = convert_samples_to_train_data(config, samples, self.family)
        # pairs are views of the samples; copy the scalars we overwrite (recompute) so samples stay untouched
        pairs = [_shallow_copy(p) for p in pairs]
        if not pairs:  # every sample filtered out (--rollout-sample-filter-path): nothing to learn from
            logger.warning("rollout %d: no train pairs (all samples removed); skipping its optimizer steps", rollout_id)
            return {"train/num_pairs": 0.0, "perf/train_time_s": time.perf_counter() - started}
        plan = plan_rank_train_data(config, pairs, self.dp_rank, self.dims.dp_size, self.family)
        if config.debug.save_debug_train_data:
            self._save_debug_train_data(rollout_id, plan)
        staged = time.perf_counter() - started  # moving the rollout to the GPU and cutting it into micro-batches
        if config.trainer.diffusion_recompute_old_log_prob:
            self.recompute_old_log_probs(plan.windows)
        metrics = MetricSums()
        grad_norms: list[torch.Tensor] = []
        skipped_steps = 0
        parked_bytes = 0
        lr = self.lr_scheduler.get_lr()
        if not skip_step:
            self.optimizer_parking.before_first_training()
        for window_index, window in enumerate(plan.windows):
            self.optimizer.zero_grad(set_to_none=True)
            parked_bytes += self.optimizer_parking.park()
            loss_is_finite = torch.ones((), dtype=torch.bool, device=self.device)  # on the device: no sync per batch
            lr = self.optimizer.param_groups[0]["lr"]
            with self._weights_fixed():  # the window's micro-batches: no optimizer step between them
                for position, micro_batch in enumerate(window):
                    self._reduce_gradients_after_this_backward(position == len(window) - 1)
                    batch = self._batch(micro_batch)
                    # FLOPs are counted once, eagerly; a dispatch mode around compiled blocks would force recompiles
                    measure = self.flops_per_pair is None and not skip_step and not config.trainer.fsdp_torch_compile
                    with self._flop_counter(measure, len(micro_batch)), torch.set_grad_enabled(not skip_step):
                        per_pair_loss, pair_metrics = self._micro_batch_loss(batch, rollout_id, window_index, metrics)
                        if not skip_step:
                            from miles.diffusion.losses import window_reduce

                            loss = window_reduce(per_pair_loss * batch.loss_mask, plan.pairs_per_window)
                            loss_is_finite &= torch.isfinite(loss.detach())
                            self.scaler.scale(loss).backward()
                    for name, values in pair_metrics.items():
                        metrics.add(name, values)
            if not skip_step:
                self._check_gradients_reduced(rollout_id)
            self.optimizer_parking.unpark()
            if not skip_step:
                where = f"rollout {rollout_id}, step {window_index + 1}/{len(plan.windows)}"
                grad_norm = self.optimizer_step(where, loss_is_finite)
                if grad_norm is None:
                    skipped_steps += 1
                else:
                    grad_norms.append(grad_norm)
        if not skip_step:
            self.optimizer_parking.after_first_training()
        if self.ema is not None and not skip_step:
            self.ema.update()  # once per rollout, after its optimizer steps (§8)
        result = {f"train/{k}": v for k, v in metrics.reduce(self.device).items()}
        if grad_norms:  # over the steps taken: a skipped step's norm is not a number
            result["train/grad_norm"] = float(torch.stack(grad_norms).float().mean())
        if not skip_step:
            result["train/skipped_steps"] = float(skipped_steps)
        result["train/lr"] = lr
        result["train/num_pairs"] = float(plan.num_pairs_total - plan.num_pairs_dropped)
        if self.ema is not None:
            result["train/ema_num_updates"] = float(self.ema.num_updates)
        result.update(self._perf_metrics(plan, time.perf_counter() - started))
        result["perf/train_prepare_s"] = staged
        if parked_bytes:
            result["perf/train_optimizer_parked_gib"] = parked_bytes / GIB  # sent to the host, each back for its step
        result["perf/train_compile_s"] = compile_seconds() - compiled_before  # a first step's or a new shape's
        for key, value in allocator_counts(self.device).items():
            result[f"perf/train_{key}"] = float(value - allocator_before[key])
        result.update(HostUsage.measure().delta(host_before).metrics("perf/train_"))  # host-bound or not
        return result

    def _save_debug_train_data(self, rollout_id: int, plan) -> None:
        """`--save-debug-train-data`: this rank's windows of micro-batches of train pairs, before training."""
        template = self.config.debug.save_debug_train_data
        path = template.format(rollout_id, self.dp_rank, rollout_id=rollout_id, rank=self.dp_rank)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save({"rollout_id": rollout_id, "dp_rank": self.dp_rank, "windows": plan.windows}, path)

    def optimizer_step(self, where: str, loss_is_finite: torch.Tensor) -> torch.Tensor | None:
        """Clip and step; returns the gradient norm, or None when the step was skipped.

        A non-finite loss or gradient (a NaN from a loss, an fp16 overflow) skips the step: the weights, the
        optimizer state and the LR schedule stay as they were, a warning names the step (`where`), and the
        rollout's `train/skipped_steps` counts it. Every rank skips the same steps: the gradient norm is global,
        and so is the loss flag (a loss can be NaN where it does not reach the gradient, e.g. `torch.where`).
        """
        self.scaler.unscale_(self.optimizer)
        params = [p for _, p in self.trainable]
        clip = self.config.trainer.clip_grad
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"), foreach=True)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        loss_ok = loss_is_finite.to(torch.float32)
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(loss_ok, op=dist.ReduceOp.MIN)
        finite = bool(torch.isfinite(grad_norm) & (loss_ok > 0))  # one host sync per step: no NaN reaches a weight
        if finite:
            self.scaler.step(self.optimizer)  # optimizer.step() when the scaler is off (fp32, bf16)
        self.scaler.update()  # fp16: lowers the loss scale after an overflow; nothing when the scaler is off
        if not finite:
            scale = f", fp16 loss scale now {self.scaler.get_scale():g}" if self.scaler.is_enabled() else ""
            logger.warning("%s: non-finite loss or gradient (loss finite: %s, gradient norm %s%s); optimizer step "
                           "skipped, weights unchanged", where, bool(loss_ok > 0), grad_norm.item(), scale)
            return None
        self.lr_scheduler.step()
        self.global_step += 1
        return grad_norm.detach()

    @contextlib.contextmanager
    def _flop_counter(self, enabled: bool, num_pairs: int):
        """Count the FLOPs of one micro-batch's forward + backward once (torch.utils.flop_counter)."""
        if not enabled:
            yield
            return
        counter = FlopCount()
        with counter:
            yield
        self.flops_per_pair = counter.total / max(num_pairs, 1)
        if counter.uncounted:
            logger.info("perf/mfu leaves out %s (no FLOP formula for these shapes)", sorted(counter.uncounted))

    def _perf_metrics(self, plan, seconds: float) -> dict[str, float]:
        # every SP rank of a group runs the pair's full FLOPs in the count: per rank, that is sp / world_size of it
        return train_speed_metrics(plan.num_pairs_total - plan.num_pairs_dropped, seconds, self.flops_per_pair,
                                   self.dims.sp / self.world_size, self.device)

    # ------------------------------------------------------------------------------------------------
    # colocated runs
    # ------------------------------------------------------------------------------------------------
    def offload(self) -> None:
        """Move parameters, optimizer state and EMA to the CPU (the engines take the GPU)."""
        self._move("cpu")

    def onload(self) -> None:
        self._move(self.device)

    def _move(self, device) -> None:
        if self.device.type == "cpu" or self.config.trainer.fsdp_cpu_offload:
            return
        with set_aside(self.model, self.host_params):
            self.model.to(device)
        self.optimizer_parking.state_to(device)  # parked moments return only for the step
        if self.ema is not None:
            for name, shadow in self.ema._shadow.items():
                self.ema._shadow[name] = shadow.to(device, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            if str(device) == "cpu":
                torch.cuda.empty_cache()


def _shallow_copy(pair):
    return copy.copy(pair)


STAGE_ON_DEVICE_MAX_BYTES = 8 << 30


def _stage_on_device(samples: list[Sample], device: torch.device) -> None:
    """Move the rollout's trajectory tensors to the GPU once, in place, before they are cut into pairs.

    Every pair of a sample shares its conditioning (10 pairs per sample at 10 trained steps), and each step's
    latent is x_{k+1} of one pair and x_k of the next: collating from the host would copy each tensor that
    many times over PCIe. Rollouts larger than `STAGE_ON_DEVICE_MAX_BYTES` stay on the host.
    """
    if device.type != "cuda":
        return
    fields = []
    for sample in samples:
        fields += [sample.latents, sample.conditioning]
        if sample.debug_model_outputs:
            fields.append(sample.debug_model_outputs)
    # the samples of one prompt share their conditioning tensors: count and move each tensor once
    unique = {id(t): t for d in fields for t in d.values()}
    total = sum(t.numel() * t.element_size() for t in unique.values())
    total += sum(s.clean_latents.numel() * s.clean_latents.element_size() for s in samples if s.clean_latents is not None)
    if total > STAGE_ON_DEVICE_MAX_BYTES:
        return
    on_device = {key: value.to(device) for key, value in unique.items()}
    for tensors in fields:  # a dict shared by several samples is met again with its values already moved
        for key, value in tensors.items():
            tensors[key] = on_device.get(id(value), value)
    for sample in samples:
        if sample.clean_latents is not None:
            sample.clean_latents = sample.clean_latents.to(device)
