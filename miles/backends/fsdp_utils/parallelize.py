"""Apply the trainer's parallelism and precision to a family's denoiser modules, in one function.

Order (torchtitan style): attention backend → sequence parallelism (diffusers context-parallel plan) →
activation checkpointing → (optional `torch.compile` per block, `--fsdp-torch-compile`) → `fully_shard` on
every transformer block the family lists, then on the module root (the root alone for LoRA on one shard rank).
Dtypes: parameters are held in `--fsdp-master-dtype` (sharded master weights, optimizer state), all-gathered
and computed in `--diffusion-forward-dtype` (MixedPrecisionPolicy.param_dtype), gradients reduce-scattered in
`--fsdp-reduce-dtype`. On a one-rank shard mesh, frozen parameters are held whole in the forward dtype instead
(`frozen_params_kept_whole`). `--fsdp-cpu-offload` keeps the shards (and so the optimizer) on the CPU.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

from miles.backends.fsdp_utils.parallel_dims import ParallelDims
from miles.models.batch_invariant import engine_holds_in_forward_dtype, route_attention
from miles.models.opaque_kernels import install_in_blocks, wanted as opaque_kernels_wanted
from miles.utils.compile import compile_blocks
from miles.utils.errors import MilesUserError

if TYPE_CHECKING:
    from miles.config.sections import TrainerConfig

logger = logging.getLogger(__name__)

# FSDP2 warns when a wrapped module returns a view (diffusers' FLUX.1 single blocks split their output into text
# and image tokens by slicing), because an in-place op on that view would skip FSDP's pre-backward hook. Nothing
# modifies those outputs in place: the blocks and the model after them only read them into new tensors (no `+=`,
# no `*_()` on the block outputs in diffusers' transformer_flux.py), so the warning is noise on every FLUX run.
# Cloning the views instead would cost a copy of every block's activations.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor", category=UserWarning)

# `--lora-init-weights` values whose adapters do not depend on the base weights' values
ADAPTER_INITS_BLIND_TO_THE_BASE = frozenset({"true", "false", "kaiming-uniform", "gaussian"})

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_dtype(name, flag: str) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise MilesUserError(f"{flag} {name!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def trainer_dtypes(trainer: TrainerConfig) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """(forward/param dtype, master dtype, reduce dtype) from the three precision flags."""
    return (
        parse_dtype(trainer.diffusion_forward_dtype, "--diffusion-forward-dtype"),
        parse_dtype(trainer.fsdp_master_dtype, "--fsdp-master-dtype"),
        parse_dtype(trainer.fsdp_reduce_dtype, "--fsdp-reduce-dtype"),
    )


def apply_sequence_parallel(module: nn.Module, family, dims: ParallelDims, mesh, name: str) -> None:
    """USP through diffusers' context parallelism with the family's plan (`--sequence-parallel-size` > 1).

    Runs on CUDA (NCCL) and on the CPU (gloo): Ulysses exchanges heads with all-to-all and the plan's output
    gather is an all-gather, both of which gloo implements for CPU tensors."""
    plan = family.context_parallel_plan(module)
    if plan is None:
        raise MilesUserError(
            f"--sequence-parallel-size {dims.sp}: the {family.family!r} family has no context-parallel plan for "
            f"its {name!r} module; run with --sequence-parallel-size 1 or give the family a context_parallel_plan"
        )
    from diffusers import ContextParallelConfig

    config = ContextParallelConfig(ring_degree=dims.ring, ulysses_degree=dims.ulysses, mesh=mesh[("ring", "ulysses")])
    if mesh.device_type != "cpu":
        module.enable_parallelism(config=config, cp_plan=plan)
        return
    # diffusers places each rank on `torch.device(accelerator, rank % torch.accelerator.device_count())`, which
    # divides by zero on a machine without an accelerator; everything else it does works on CPU tensors. Record
    # the config with the CPU as the device (exactly what its `_resolve_parallel_config` does otherwise) and let
    # `enable_parallelism` do the rest: the backend check, the processors, the split/gather hooks.
    module._resolve_parallel_config = _cpu_parallel_config_resolver(module)
    try:
        module.enable_parallelism(config=config, cp_plan=plan)
    finally:
        del module._resolve_parallel_config


def _cpu_parallel_config_resolver(module: nn.Module):
    import torch.distributed as dist
    from diffusers.models._modeling_parallel import ParallelConfig

    def resolve(config):
        if not isinstance(config, ParallelConfig):
            config = ParallelConfig(context_parallel_config=config)
        config.setup(dist.get_rank(), dist.get_world_size(), torch.device("cpu"),
                     mesh=config.context_parallel_config.mesh)
        module._parallel_config = config
        return config

    return resolve


def set_sequence_parallel_gradient_reduction(module: nn.Module, dims: ParallelDims, device_type: str) -> None:
    """Each SP rank's parameter gradients cover only its sequence shard: sum over SP, average over DP.

    The shard mesh holds dp_shard × sp ranks, so FSDP's default (the mean over that mesh) would divide by sp too
    many. Every FSDP unit — each block and the root — reduce-scatters its own gradients, so each gets the
    factor (`set_gradient_divide_factor` does not recurse). gloo has no PREMUL_SUM, the op a custom factor uses
    on NCCL: there the reduction sums and divides afterwards."""
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(float(dims.dp_size))
            if device_type == "cpu":
                unit.set_force_sum_reduction_for_comms(True)


def cast_buffers_like_the_engine(module: nn.Module, master_dtype: torch.dtype, forward_dtype: torch.dtype) -> None:
    """Floating buffers in the dtype the engine holds them in (`engine_holds_in_forward_dtype`).

    FSDP's mixed precision casts parameters for the forward but never buffers: without this the trainer adds an
    fp32 positional table where the engine (its pipeline loaded in the forward dtype) adds a bf16 one, and the
    two velocities differ by ~1% in bf16. Rotary tables the engine keeps in fp32 (non-persistent, or in
    diffusers' `_keep_in_fp32_modules`) stay fp32 here too."""
    if forward_dtype == master_dtype:
        return
    for owner_name, owner in module.named_modules():
        for name, buffer in list(owner.named_buffers(recurse=False)):
            if (buffer is not None and buffer.dtype == master_dtype
                    and engine_holds_in_forward_dtype(module, owner_name, name)):
                setattr(owner, name, buffer.to(forward_dtype))


def enable_gradient_checkpointing(module: nn.Module, blocks: list[nn.ModuleList]) -> None:
    """Diffusers' own switch when the module has one, else per-block `checkpoint_wrapper` (non-reentrant)."""
    if hasattr(module, "enable_gradient_checkpointing") and getattr(module, "_supports_gradient_checkpointing", False):
        module.enable_gradient_checkpointing()
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for block_list in blocks:
        for index, block in enumerate(block_list):
            block_list[index] = checkpoint_wrapper(block)


def holds_weights_whole(trainer: TrainerConfig, dims: ParallelDims) -> bool:
    """Each rank's shard is the whole tensor (one rank shards: dp_shard × sp = 1) and stays on the device (no
    `--fsdp-cpu-offload`)."""
    return not trainer.fsdp_cpu_offload and dims.dp_shard * dims.sp == 1


def frozen_params_kept_whole(module: nn.Module, trainer: TrainerConfig, dims: ParallelDims) -> set[nn.Parameter]:
    """The frozen parameters (the base weights under LoRA) that FSDP leaves alone: held whole, in the forward
    dtype, on the trainer's device. Only where `holds_weights_whole`.

    Otherwise FSDP casts every frozen fp32 master weight to the forward dtype before each micro-batch's forward
    and again before its backward: thousands of small copies per micro-batch that never change a value, which
    made the host, not the GPU, pace a one-GPU LoRA step; and the fp32 copy doubles the memory of weights
    nothing updates. A frozen weight's forward-dtype copy is exactly what FSDP's cast produced, so the layers
    compute the same values. Parameters the engine holds in fp32 (diffusers' `_keep_in_fp32_modules`) stay
    with FSDP: a weight sync sends every frozen weight too, and those must keep reaching the engine unrounded."""
    if not holds_weights_whole(trainer, dims):
        return set()
    kept = set()
    for name, param in module.named_parameters():
        owner_name, _, leaf = name.rpartition(".")
        if not param.requires_grad and engine_holds_in_forward_dtype(module, owner_name, leaf):
            kept.add(param)
    return kept


def base_load_dtype(trainer: TrainerConfig, dims: ParallelDims) -> torch.dtype:
    """The dtype the trainer loads its modules in. Under LoRA where the frozen base is held whole in the forward
    dtype (`frozen_params_kept_whole`) that is the forward dtype, as the engine loads it; otherwise the master
    dtype. Loading that base in the master dtype converted every weight up (fp32: 9 GB at SD3.5-Medium) only to
    convert it back down: 12 of the 20 s a CPU took to build the real-size LoRA trainer. Parameters diffusers keeps
    in fp32 load in fp32 either way, and the adapters are still created in the master dtype
    (`adapters_created_in`). An adapter initialisation that reads the base (PiSSA, OLoRA, LoftQ...) keeps the
    master-dtype load: from an fp32 checkpoint it would otherwise decompose the rounded weights."""
    forward_dtype, master_dtype, _ = trainer_dtypes(trainer)
    blind_init = str(trainer.lora_init_weights).lower() in ADAPTER_INITS_BLIND_TO_THE_BASE
    return forward_dtype if trainer.use_lora and blind_init and holds_weights_whole(trainer, dims) else master_dtype


@contextlib.contextmanager
def adapters_created_in(module: nn.Module, lora_config, dtype: torch.dtype):
    """PEFT creates each adapter in the dtype of the layer it wraps. Inside this context the layers `lora_config`
    targets hold their weights in `dtype` (the master dtype), so the adapters are initialised there exactly as
    when the whole module was loaded in it (and an initialisation that reads or rewrites the base weight, such
    as PiSSA's, works on those values); after it, the weights go back to the dtype they were loaded in."""
    from peft.tuners.tuners_utils import check_target_module_exists

    held = [(sub, sub.weight.dtype) for name, sub in module.named_modules()
            if isinstance(getattr(sub, "weight", None), nn.Parameter) and sub.weight.is_floating_point()
            and sub.weight.dtype != dtype and check_target_module_exists(lora_config, name)]
    for sub, _ in held:
        sub.weight.data = sub.weight.data.to(dtype)
    try:
        yield
    finally:
        for sub, loaded_dtype in held:  # the same object, now the adapter's `base_layer`
            sub.weight.data = sub.weight.data.to(loaded_dtype)


def base_stays_on_host(trainer: TrainerConfig, dims: ParallelDims) -> bool:
    """Under `--diffusion-rollout-gradient` the trainer runs no forward: the engines take the gradient and the
    trainer only steps the adapters. Its frozen base is then read by nothing but a merged export, so where FSDP
    leaves it alone (`frozen_params_kept_whole`) it stays in host memory instead of taking GPU memory (4.9 GB at
    SD3.5-Medium) beside the engine's."""
    return trainer.diffusion_rollout_gradient and holds_weights_whole(trainer, dims)


@contextlib.contextmanager
def set_aside(module: nn.Module, params: list[nn.Parameter]):
    """`module.to(device)` inside leaves these parameters where they are: each is unregistered from its owner
    during the move (`nn.Module._apply` skips an empty slot) and registered back after it, the same Parameter
    objects that FSDP and the optimizer hold."""
    wanted = {id(param) for param in params}
    slots = [(owner, name, param) for owner in module.modules() for name, param in owner._parameters.items()
             if param is not None and id(param) in wanted]
    for owner, name, _ in slots:
        owner._parameters[name] = None
    try:
        yield
    finally:
        for owner, name, param in slots:
            owner._parameters[name] = param


def block_groups(blocks: list, per_unit: int) -> list[list[nn.Module]]:
    """Each block list cut into runs of `per_unit` consecutive blocks (the last may be shorter): one FSDP unit
    each (`--fsdp-blocks-per-unit`). A run never spans two lists (a dual-stream family's lists run apart)."""
    return [list(block_list[start:start + per_unit])
            for block_list in blocks for start in range(0, len(block_list), per_unit)]


def parallelize_module(
    module: nn.Module, family, trainer: TrainerConfig, dims: ParallelDims, mesh, name: str, device,
    opaque_kernels: bool = False,
) -> nn.Module:
    """Shard one denoiser module in place (per block, then the root); returns it (now an FSDPModule).
    `opaque_kernels`: the batch_invariant group is on, so the blocks get its opaque kernels where
    `opaque_kernels.wanted` says (miles/models/opaque_kernels.py). Where `base_stays_on_host`, the frozen
    parameters held whole stay on the host."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    forward_dtype, master_dtype, reduce_dtype = trainer_dtypes(trainer)
    backend = trainer.fsdp_attention_backend
    if backend:
        if not hasattr(module, "set_attention_backend"):
            raise MilesUserError(f"--fsdp-attention-backend {backend!r}: module {name!r} has no set_attention_backend")
        try:
            route_attention({name: module}, backend)
        except Exception as err:  # diffusers raises ValueError/RuntimeError for an unknown or unavailable backend
            raise MilesUserError(f"--fsdp-attention-backend {backend!r}: {err}") from err
    if dims.sp_enabled:
        apply_sequence_parallel(module, family, dims, mesh, name)

    blocks = family.transformer_block_lists(module)
    if not blocks:
        raise MilesUserError(f"the {family.family!r} family lists no transformer blocks for {name!r}; cannot shard it")
    if trainer.gradient_checkpointing:
        enable_gradient_checkpointing(module, blocks)

    kept_whole = frozen_params_kept_whole(module, trainer, dims)
    for param in module.parameters():
        dtype = forward_dtype if param in kept_whole else master_dtype
        if param.dtype != dtype:
            param.data = param.data.to(dtype)
    cast_buffers_like_the_engine(module, master_dtype, forward_dtype)
    offload = trainer.fsdp_cpu_offload
    if not offload:
        with set_aside(module, list(kept_whole) if base_stays_on_host(trainer, dims) else []):
            module.to(device)
    mp_policy = MixedPrecisionPolicy(
        param_dtype=None if forward_dtype == master_dtype else forward_dtype,
        reduce_dtype=reduce_dtype,
        cast_forward_inputs=False,  # the family casts its inputs; sigmas/timesteps stay fp32 as in the engine
    )
    # Always reshard after the forward: a reference forward (EMA swapped into the shards) must gather again.
    fsdp_kwargs = {"mesh": dims.fsdp_mesh(mesh), "mp_policy": mp_policy, "reshard_after_forward": True}
    if kept_whole:
        fsdp_kwargs["ignored_params"] = kept_whole
    if offload:
        fsdp_kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    if opaque_kernels_wanted(opaque_kernels, trainer.fsdp_torch_compile, torch.device(device).type):
        install_in_blocks(blocks)  # the batch_invariant group: the engine's kernels, so its bits
    if trainer.fsdp_torch_compile:
        compile_blocks(blocks)  # per block, before sharding (torchtitan order): one graph reused by every layer
    # At one shard rank under LoRA FSDP manages only the adapters (the base is held whole): a unit per block
    # would shard nothing and cost every block four hooks per micro-batch (gather, reshard, gather again for
    # the backward, reduce the gradients), all paid by the host threads that dispatch the step, which is
    # host-bound there (bench/RESULTS.md). The root unit alone manages the adapters then.
    unit_per_block = not (kept_whole and trainer.use_lora)
    if unit_per_block:
        for group in block_groups(blocks, trainer.fsdp_blocks_per_unit):
            fully_shard(group if len(group) > 1 else group[0], **fsdp_kwargs)
    fully_shard(module, **fsdp_kwargs)
    if dims.sp_enabled:
        set_sequence_parallel_gradient_reduction(module, dims, torch.device(device).type)
    logger.info(
        "sharded %s: %d block lists, param %s / master %s / reduce %s, cpu offload %s, mesh %s, "
        "%d frozen parameters held whole in %s, %s",
        name, len(blocks), forward_dtype, master_dtype, reduce_dtype, offload, dims, len(kept_whole), forward_dtype,
        ("a unit per block" if trainer.fsdp_blocks_per_unit == 1 else f"a unit per {trainer.fsdp_blocks_per_unit} "
         "blocks") if unit_per_block else "the root as the one unit",
    )
    return module
