"""Run a function on N local ranks of one torch.distributed group without torchrun (tests, benchmarks).

`spawn_ranks(world_size, fn, fn_args)` starts N spawned processes, each with MASTER_ADDR/PORT, RANK,
WORLD_SIZE set and the process group initialised (gloo on CPU, nccl on CUDA with one GPU per rank), calls
`fn(rank, *fn_args)` and returns the per-rank results in rank order. `fn` must be importable (module level).
"""

from __future__ import annotations

import os
import socket
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(rank: int, world_size: int, backend: str, port: int, timeout_minutes: float = 10) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(minutes=timeout_minutes))


def _rank_main(rank: int, world_size: int, backend: str, port: int, fn, fn_args, result_dir: str, threads: int):
    if threads:
        torch.set_num_threads(threads)
    init_distributed(rank, world_size, backend, port)
    try:
        result = fn(rank, *fn_args)
        torch.save(result, os.path.join(result_dir, f"rank_{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn_ranks(world_size: int, fn, fn_args: tuple = (), backend: str | None = None, threads: int = 1) -> list:
    """Run `fn(rank, *fn_args)` on `world_size` fresh processes; returns their results (tensors and plain values,
    read back with weights_only=True)."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    with tempfile.TemporaryDirectory(prefix="miles-spawn-") as result_dir:
        mp.start_processes(
            _rank_main,
            args=(world_size, backend, free_port(), fn, fn_args, result_dir, threads),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        # Results are plain values and tensors (metrics, state dicts): weights_only=True reads them.
        return [torch.load(os.path.join(result_dir, f"rank_{r}.pt"), weights_only=True) for r in range(world_size)]
