"""Which frozen parameters the trainer keeps out of FSDP (miles/backends/fsdp_utils/parallelize.py)."""

from types import SimpleNamespace

from torch import nn

from miles.backends.fsdp_utils.parallel_dims import ParallelDims
from miles.backends.fsdp_utils.parallelize import (
    base_load_dtype, base_stays_on_host, block_groups, frozen_params_kept_whole, set_aside,
)


class Tiny(nn.Module):
    _keep_in_fp32_modules = ["norm"]  # diffusers: loaded in fp32 whatever torch_dtype says

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 4)


def kept_names(module: nn.Module, world_size: int = 1, sp: int = 1, replicate: int = 1,
               cpu_offload: bool = False) -> set[str]:
    dims = ParallelDims(world_size=world_size, sp=sp, dp_replicate=replicate)
    kept = frozen_params_kept_whole(module, SimpleNamespace(fsdp_cpu_offload=cpu_offload), dims)
    return {name for name, param in module.named_parameters() if param in kept}


def test_frozen_weights_the_engine_holds_in_the_forward_dtype_are_kept_whole_on_one_shard_rank():
    module = Tiny()
    module.proj.requires_grad_(False)
    module.norm.requires_grad_(False)  # frozen, but the engine holds it in fp32: stays with FSDP
    assert kept_names(module) == {"proj.weight", "proj.bias"}


def test_nothing_is_kept_whole_when_shards_span_ranks_or_live_on_the_host():
    module = Tiny().requires_grad_(False)
    assert kept_names(module, world_size=2) == set()
    assert kept_names(module, world_size=2, sp=2) == set()
    assert kept_names(module, cpu_offload=True) == set()
    everything = {"proj.weight", "proj.bias", "head.weight", "head.bias"}
    assert kept_names(module) == everything
    assert kept_names(module, world_size=2, replicate=2) == everything  # replicas hold whole shards anyway


def test_the_base_stays_on_the_host_only_where_the_trainer_never_forwards_and_holds_it_whole():
    def config(rollout_gradient, cpu_offload=False):
        return SimpleNamespace(diffusion_rollout_gradient=rollout_gradient, fsdp_cpu_offload=cpu_offload)

    one_rank = ParallelDims(world_size=1, sp=1, dp_replicate=1)
    assert base_stays_on_host(config(True), one_rank)
    assert not base_stays_on_host(config(False), one_rank)
    assert not base_stays_on_host(config(True, cpu_offload=True), one_rank)
    assert not base_stays_on_host(config(True), ParallelDims(world_size=2, sp=1, dp_replicate=1))


def test_a_lora_base_held_whole_loads_in_the_forward_dtype_unless_its_adapters_read_it():
    import torch

    def config(use_lora=True, init="true", cpu_offload=False):
        return SimpleNamespace(use_lora=use_lora, lora_init_weights=init, fsdp_cpu_offload=cpu_offload,
                               diffusion_forward_dtype="bf16", fsdp_master_dtype="fp32", fsdp_reduce_dtype="fp32")

    one_rank = ParallelDims(world_size=1, sp=1, dp_replicate=1)
    assert base_load_dtype(config(), one_rank) == torch.bfloat16
    assert base_load_dtype(config(init="gaussian"), one_rank) == torch.bfloat16
    assert base_load_dtype(config(init="pissa"), one_rank) == torch.float32  # decomposes the base
    assert base_load_dtype(config(use_lora=False), one_rank) == torch.float32  # full fine-tune: fp32 masters
    assert base_load_dtype(config(cpu_offload=True), one_rank) == torch.float32  # FSDP holds the base
    assert base_load_dtype(config(), ParallelDims(world_size=2, sp=1, dp_replicate=1)) == torch.float32


def test_a_move_leaves_the_set_aside_parameters_where_they_are():
    import torch

    module = Tiny()
    module.proj.requires_grad_(False)
    host = [module.proj.weight, module.proj.bias]
    values = [p.detach().clone() for p in host]
    with set_aside(module, host):
        module.to("meta")  # a device every machine has: a moved tensor loses its values
    assert module.head.weight.device.type == "meta" and module.norm.weight.device.type == "meta"
    assert module.proj.weight is host[0]  # the same Parameter objects, which FSDP and the optimizer hold
    for param, value in zip(host, values):
        assert param.device.type == "cpu" and torch.equal(param, value)


def _units(use_lora: bool, tiny_checkpoint) -> tuple[bool, list[bool]]:
    """(root is an FSDP unit, whether each transformer block is one) after the trainer's init on one rank."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    from miles.backends.fsdp_utils.actor import DiffusionTrainer
    from miles.backends.fsdp_utils.spawn import free_port, init_distributed
    from miles.testing.tiny_rollout import build_tiny_family, tiny_trainer_config

    config = tiny_trainer_config(tiny_checkpoint("sd3"), use_lora=use_lora)
    init_distributed(0, 1, "gloo", free_port())
    try:
        trainer = DiffusionTrainer(config, build_tiny_family(config))
        trainer.init()
        transformer = trainer.model["transformer"]
        blocks = [block for blocks in trainer.family.transformer_block_lists(transformer) for block in blocks]
        return isinstance(transformer, FSDPModule), [isinstance(block, FSDPModule) for block in blocks]
    finally:
        torch.distributed.destroy_process_group()


def test_one_rank_lora_is_one_unit_and_a_full_fine_tune_a_unit_per_block(tiny_checkpoint):
    """Per-block units shard nothing at one rank; under LoRA they would only add hooks to every block."""
    root, blocks = _units(True, tiny_checkpoint)
    assert root and blocks and not any(blocks)
    root, blocks = _units(False, tiny_checkpoint)
    assert root and blocks and all(blocks)


def test_blocks_are_grouped_in_runs_within_each_list():
    single, dual = [nn.Linear(1, 1) for _ in range(5)], [nn.Linear(1, 1) for _ in range(2)]
    groups = block_groups([single, dual], 2)
    assert [len(group) for group in groups] == [2, 2, 1, 2]
    assert groups[0] == single[:2] and groups[3] == dual
    assert block_groups([single], 1) == [[block] for block in single]
