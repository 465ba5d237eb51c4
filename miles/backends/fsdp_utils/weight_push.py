"""Rank 0's side of weight sync over a whole run: which transport reaches each engine, the broadcast group's
lifetime, and the optional checksum check (docs/design.md §6).

Per push (`WeightPusher.push`): every engine's `GET /server_info` (once per URL) gives its device identity and
dtype; `split_by_transport` sends the engines that share rank 0's memory through shared memory / CUDA IPC and the
others through the broadcast group (`--update-weight-transport`). The group is built on the first push that
needs it and kept while the same engines are reached by broadcast; a different set (an engine restarted on a new
URL) or a failed broadcast closes it and the push builds a new one.

`--check-weight-sync`: while the tensors stream out, each one is hashed as the engine will hold it (cast to the
engine's dtype) and compared afterwards with the engine's `GET /weights_checksum?per_tensor=1`.
"""

from __future__ import annotations

import json
import logging
import urllib.request
from typing import Any, Iterable, Iterator, Sequence

import torch

from miles.engine.weight_broadcast import WeightBroadcastGroup, device_identity, split_by_transport
from miles.engine.weight_sync import WeightSyncError, push_weights, tensor_checksum
from miles.utils.auth import auth_headers

logger = logging.getLogger(__name__)


def _get_json(url: str, timeout: float = 60.0) -> dict:
    request = urllib.request.Request(url, headers=auth_headers())
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except OSError as err:  # URLError, HTTPError and connection errors
        raise WeightSyncError(f"weight sync: GET {url} failed: {err}") from err


class WeightPusher:
    """One per trainer rank 0; `push` is what `TrainRayActor.update_weights` calls."""

    def __init__(self, transport: str, colocated: bool, device: torch.device | str, timeout: float):
        self.transport = transport
        self.colocated = colocated
        self.identity = device_identity(device)
        self.timeout = timeout
        self.group: WeightBroadcastGroup | None = None
        self._engine_info: dict[str, dict] = {}

    def engine_info(self, url: str) -> dict:
        if url not in self._engine_info:
            self._engine_info[url] = _get_json(f"{url}/server_info")
        return self._engine_info[url]

    def split(self, urls: Sequence[str]) -> tuple[list[str], list[str]]:
        """(engines that share rank 0's memory: reached by shared memory / CUDA IPC, the others)."""
        urls = list(urls)
        needs_info = self.transport == "auto" and self.colocated
        identities = [self.engine_info(url)["device_identity"] for url in urls] if needs_info else [""] * len(urls)
        return split_by_transport(urls, self.transport, self.colocated, self.identity, identities)

    def _group_for(self, urls: list[str]) -> WeightBroadcastGroup | None:
        if self.group is not None and (self.group.broken or self.group.engine_urls != urls):
            logger.info("weight broadcast group %s: rebuilding (%s)", self.group.name,
                        "a broadcast failed" if self.group.broken else "the engines changed")
            self.close()
        if urls and self.group is None:
            self.group = WeightBroadcastGroup.connect(urls, timeout=self.timeout)
        return self.group if urls else None

    def push(self, engine_urls: Sequence[str], named_tensors: Iterable[tuple[str, torch.Tensor]], *,
             bucket_bytes: int, weight_version: int, lora: bool, lora_scaling: float,
             target_modules: Sequence[str], check: bool = False) -> dict[str, Any]:
        urls = list(engine_urls)
        ipc_urls, broadcast_urls = self.split(urls)
        group = self._group_for(broadcast_urls)
        digests: dict[str, dict[str, str]] = {}
        if check:
            if lora:
                raise WeightSyncError("--check-weight-sync compares full weights, not LoRA pairs")
            named_tensors = self._hashing(named_tensors, urls, digests)
        stats = push_weights(ipc_urls, named_tensors, bucket_bytes, weight_version, lora=lora,
                             lora_scaling=lora_scaling, target_modules=target_modules, timeout=self.timeout,
                             broadcast_group=group)
        if check:
            stats["checked_tensors"] = self._check(urls, digests, target_modules)
            stats["checked_engines"] = len(urls)
        return stats

    def _hashing(self, named_tensors, urls: list[str], digests: dict[str, dict[str, str]]) -> Iterator:
        """Pass the tensors through, recording each one's checksum in every engine dtype seen, and in fp32: an
        engine keeps the parameters diffusers loads in fp32 (`_keep_in_fp32_modules`) in fp32 unless the
        batch_invariant group casts them."""
        dtypes = {getattr(torch, self.engine_info(url)["dtype"]) for url in urls} | {torch.float32}
        for name, tensor in named_tensors:
            for dtype in dtypes:
                digests.setdefault(str(dtype), {})[name] = tensor_checksum(name.partition(".")[2], tensor.to(dtype))
            yield name, tensor

    def _check(self, urls: list[str], digests: dict[str, dict[str, str]], modules: Sequence[str]) -> int:
        checked = 0
        for url in urls:
            engine_dtype = str(getattr(torch, self.engine_info(url)["dtype"]))
            expected = digests[engine_dtype]
            held = _get_json(f"{url}/weights_checksum?per_tensor=1&modules={','.join(modules)}")["checksums"]
            wrong = tensors_held_otherwise(held, [digests[engine_dtype], digests[str(torch.float32)]])
            if wrong:
                raise WeightSyncError(f"--check-weight-sync: engine {url} holds {len(wrong)} of {len(expected)} "
                                      f"pushed tensors with other values, e.g. {wrong[:3]}")
            checked = len(expected)
        return checked

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()


def tensors_held_otherwise(held: dict[str, dict[str, str]], expected: Sequence[dict[str, str]]) -> list[str]:
    """The pushed tensors (`<module>.<name>`) whose engine checksum (`held[module][name]`, which hashes the dtype
    too) matches none of the `expected` digests, one digest table per dtype the engine may hold them in."""
    wrong = []
    for name in expected[0]:
        module, _, rest = name.partition(".")
        if held.get(module, {}).get(rest) not in {table.get(name) for table in expected}:
            wrong.append(name)
    return wrong


def sync_metrics(stats: dict[str, Any] | None) -> dict[str, float]:
    """The push report as `weight_sync/*` metrics for the run's log."""
    if not stats:
        return {}
    keys = ("num_tensors", "num_buckets", "bytes", "buffer_bytes", "seconds", "gather_seconds", "engine_wait_seconds",
            "engine_apply_seconds", "ipc_engines", "broadcast_engines", "checked_tensors", "checked_engines",
            "engine_stepped")
    return {f"weight_sync/{key}": float(stats[key]) for key in keys if key in stats}
