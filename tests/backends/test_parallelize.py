"""Which frozen parameters the trainer keeps out of FSDP (miles/backends/fsdp_utils/parallelize.py)."""

from types import SimpleNamespace

from torch import nn

from miles.backends.fsdp_utils.parallel_dims import ParallelDims
from miles.backends.fsdp_utils.parallelize import frozen_params_kept_whole


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
