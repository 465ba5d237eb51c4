"""The trainer's parallel layout: one place decides the device mesh (dp_replicate, dp_shard, sp).

`--dp-replicate-size` R replicas (HSDP), `--sequence-parallel-size` S ranks per sequence-parallel group
(USP = Ulysses × Ring; `--ulysses-degree` U, 0 = Ulysses fills S, ring degree = S / U), and dp_shard takes
what is left: world = R · dp_shard · S. Data parallelism is R · dp_shard ranks; the S ranks of one SP group
see the same train pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from miles.utils.errors import MilesUserError

if TYPE_CHECKING:
    from miles.config.sections import TrainerConfig


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    dp_replicate: int = 1
    sp: int = 1
    ulysses: int = 1

    @classmethod
    def from_config(cls, trainer: "TrainerConfig", world_size: int) -> "ParallelDims":
        """The grid of `--dp-replicate-size`, `--sequence-parallel-size` and the resolved Ulysses degree over the
        ranks that actually joined (`world_size`)."""
        dims = cls(world_size=world_size, dp_replicate=trainer.dp_replicate_size, sp=trainer.sequence_parallel_size,
                   ulysses=trainer.ulysses_degree_resolved)
        dims.validate()
        return dims

    def validate(self) -> None:
        if self.dp_replicate < 1 or self.sp < 1:
            raise MilesUserError(
                f"--dp-replicate-size ({self.dp_replicate}) and --sequence-parallel-size ({self.sp}) must be >= 1"
            )
        if self.world_size % (self.dp_replicate * self.sp):
            raise MilesUserError(
                f"train world size {self.world_size} is not divisible by --dp-replicate-size ({self.dp_replicate}) "
                f"x --sequence-parallel-size ({self.sp})"
            )
        if self.ulysses < 1 or self.sp % self.ulysses:
            raise MilesUserError(
                f"--ulysses-degree {self.ulysses} must divide --sequence-parallel-size {self.sp} "
                "(ring degree = sequence-parallel size / ulysses degree)"
            )

    @property
    def dp_shard(self) -> int:
        return self.world_size // (self.dp_replicate * self.sp)

    @property
    def ring(self) -> int:
        return self.sp // self.ulysses

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def sp_enabled(self) -> bool:
        return self.sp > 1

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(replicate index, shard index, sp index) of a global rank; the mesh is row-major in this order."""
        sp_index = rank % self.sp
        shard_index = (rank // self.sp) % self.dp_shard
        replicate_index = rank // (self.sp * self.dp_shard)
        return replicate_index, shard_index, sp_index

    def dp_rank(self, rank: int) -> int:
        replicate_index, shard_index, _ = self.coords(rank)
        return replicate_index * self.dp_shard + shard_index

    def build_mesh(self, device_type: str):
        """The 4-D mesh (dp_replicate, dp_shard, ring, ulysses); `fsdp_mesh` picks the sharding sub-mesh."""
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialised before building the device mesh")
        return init_device_mesh(
            device_type,
            (self.dp_replicate, self.dp_shard, self.ring, self.ulysses),
            mesh_dim_names=("dp_replicate", "dp_shard", "ring", "ulysses"),
        )

    def fsdp_mesh(self, mesh):
        """1-D mesh for plain FSDP, 2-D (replicate, shard) for HSDP; SP ranks join the shard dimension."""
        shard_dims = ("dp_shard", "ring", "ulysses") if self.sp_enabled else ("dp_shard",)
        shard_mesh = mesh[shard_dims]._flatten("dp_shard_sp") if self.sp_enabled else mesh["dp_shard"]
        if self.dp_replicate == 1:
            return shard_mesh
        if self.sp_enabled:
            return mesh[("dp_replicate", "dp_shard_sp")]
        return mesh[("dp_replicate", "dp_shard")]
