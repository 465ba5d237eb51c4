"""Weight sync across devices and machines: one torch.distributed group of the trainer's rank 0 and every engine
process, over which each bucket travels as one broadcast (docs/design.md §6, docs/engine.md).

Why a group of its own: the trainer's default group holds only trainer ranks, and engines are separate OS
processes (possibly on other nodes) with no default group at all. This group is built from bare backend objects
(`ProcessGroupGloo` / `ProcessGroupNCCL` over a `TCPStore`), so it lives beside the trainer's default group
without touching it.

Set-up, once (`WeightBroadcastGroup.connect`, trainer side): the trainer binds a listening socket on the master
address (127.0.0.1 when every engine URL is on loopback, its node address otherwise), serves the rendezvous
store on exactly that socket, and posts `POST /init_weights_update_group` to every engine: master address and
port, the engine's rank (`rank_offset`; the trainer is rank 0), the world size, a fresh group name, the backend
(NCCL when the trainer has a GPU, gloo otherwise) and the timeout. The engine checks every field, answers at
once and joins on a background thread (joining blocks until every member arrived; HTTP stays responsive).
Both sides end the set-up with a one-element broadcast that proves the data path. `POST
/destroy_weights_update_group` leaves the group; a new `init` replaces it.

Per bucket (`miles.engine.weight_sync.push_weights(..., broadcast_group=...)`):
1. the trainer posts the bucket's metadata (names, dtypes, shapes, byte offsets, size; msgpack, the same
   message as a shared-memory bucket with a `broadcast` buffer) to `POST /update_weights_from_distributed`;
   each engine checks every entry against its parameters exactly as for a shared-memory bucket and stages it.
   A refused bucket is a 400 and nobody enters the broadcast, so nothing was written anywhere;
2. only when every engine staged it, the trainer posts `POST /receive_weights_broadcast` (JSON: group,
   bucket id, size) to each engine and broadcasts one flat buffer; each engine receives it on its worker
   thread, copies it into its parameters and answers.
Two phases because a collective needs every member: an engine that refused a bucket must not leave the others
waiting inside a broadcast. A final flush message commits the weight version, as for the other transports.

No pickle anywhere: control messages are JSON and msgpack with fixed, typed fields; the broadcast carries raw
bytes that are interpreted only through the validated entries. The rendezvous store and the gloo / NCCL
connections have no authentication of their own (torch.distributed has none): on one machine they listen on
loopback only; across machines they belong on the cluster's trusted network (docs/security.md).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

from miles.engine.protocol import ProtocolError
from miles.engine.weight_sync_wire import GROUP_NAME, WeightSyncError

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
MAX_WORLD_SIZE = 1 << 16
MAX_TIMEOUT_SECONDS = 24 * 3600.0
MAX_BROADCAST_BYTES = 1 << 40
_HOST_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


# ---------------------------------------------------------------------------------------------------------
# where a process's weights live (chooses the transport)


def device_identity(device: torch.device | str) -> str:
    """`<host>/<device>`: two processes with the same identity share the memory a weight bucket lives in.

    The host part is the host name and the kernel's boot id (two containers of one host differ by name); the
    device part is `cpu` (shared memory: same host is enough) or the GPU's UUID (CUDA IPC needs the same GPU:
    the ordinals differ between processes with different CUDA_VISIBLE_DEVICES)."""
    device = torch.device(device)
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:  # not Linux: the host name alone
        boot_id = "-"
    host = f"{socket.gethostname()}:{boot_id}"
    if device.type != "cuda":
        return f"{host}/cpu"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"{host}/cuda:{torch.cuda.get_device_properties(index).uuid}"


def split_by_transport(engine_urls: Sequence[str], transport: str, colocated: bool, own_identity: str,
                       engine_identities: Sequence[str]) -> tuple[list[str], list[str]]:
    """(engines reached by shared memory / CUDA IPC, engines reached by broadcast).

    `transport`: `ipc` or `broadcast` for every engine, or `auto`: broadcast for every engine of a
    non-colocated run (trainer and engines sit on separate devices by construction), and under `--colocate`
    shared memory / CUDA IPC for the engines whose memory the trainer's rank 0 shares (the engine on its GPU,
    or, from a trainer in host memory, every engine of its host, which copies the shared-memory file to its own
    device), broadcast for the others (engines on the other GPUs and nodes)."""
    if transport == "ipc":
        return list(engine_urls), []
    if transport == "broadcast" or not colocated:
        return [], list(engine_urls)
    if transport != "auto":
        raise ValueError(f"weight sync transport {transport!r}: expected auto, ipc or broadcast")
    own_host, _, own_device = own_identity.rpartition("/")
    ipc, broadcast = [], []
    for url, identity in zip(engine_urls, engine_identities, strict=True):
        shares = identity == own_identity or (own_device == "cpu" and identity.rpartition("/")[0] == own_host)
        (ipc if shares else broadcast).append(url)
    return ipc, broadcast


# ---------------------------------------------------------------------------------------------------------
# the control messages


@dataclass(frozen=True)
class GroupSpec:
    """`POST /init_weights_update_group`: how an engine joins the trainer's group."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    timeout_seconds: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _json_object(body: bytes, what: str, keys: set[str]) -> dict[str, Any]:
    try:
        raw = json.loads(body)
    except (UnicodeDecodeError, ValueError) as err:
        raise ProtocolError(f"{what}: body is not JSON ({err})") from err
    if not isinstance(raw, dict):
        raise ProtocolError(f"{what}: body must be a JSON object")
    if set(raw) != keys:
        raise ProtocolError(f"{what}: needs exactly the keys {sorted(keys)}; unknown {sorted(set(raw) - keys)}, "
                            f"missing {sorted(keys - set(raw))}")
    return raw


def _int_field(raw: dict, key: str, lo: int, hi: int, what: str) -> int:
    value = raw[key]
    if type(value) is not int or not lo <= value <= hi:  # type(...) is int: a bool is not a number here
        raise ProtocolError(f"{what}: {key} must be an integer in [{lo}, {hi}], got {value!r}"[:300])
    return value


def _group_name_field(raw: dict, what: str) -> str:
    name = raw["group_name"]
    if not isinstance(name, str) or GROUP_NAME.fullmatch(name) is None:
        raise ProtocolError(f"{what}: group_name must match {GROUP_NAME.pattern}, got {name!r}"[:300])
    return name


def check_master_address(address: Any, what: str) -> str:
    """An IP literal or a DNS host name: nothing that could smuggle a path, port or option."""
    if not isinstance(address, str) or not 0 < len(address) <= 253:
        raise ProtocolError(f"{what}: master_address must be an IP address or a host name, got {address!r}"[:300])
    try:
        return ipaddress.ip_address(address).compressed
    except ValueError:
        if _HOST_NAME.fullmatch(address) is None:
            raise ProtocolError(f"{what}: master_address {address!r} is not an IP address or host name"[:300]) from None
        return address


_SPEC_KEYS = {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend", "timeout_seconds"}


def decode_group_spec(body: bytes) -> GroupSpec:
    what = "init_weights_update_group"
    raw = _json_object(body, what, _SPEC_KEYS)
    world_size = _int_field(raw, "world_size", 2, MAX_WORLD_SIZE, what)
    backend = raw["backend"]
    if backend not in BACKENDS:
        raise ProtocolError(f"{what}: backend must be one of {list(BACKENDS)}, got {backend!r}"[:300])
    timeout = raw["timeout_seconds"]
    if type(timeout) not in (int, float) or not 0 < timeout <= MAX_TIMEOUT_SECONDS:
        raise ProtocolError(f"{what}: timeout_seconds must be a number in (0, {MAX_TIMEOUT_SECONDS:.0f}], "
                            f"got {timeout!r}"[:300])
    return GroupSpec(
        master_address=check_master_address(raw["master_address"], what),
        master_port=_int_field(raw, "master_port", 1, 65535, what),
        # rank 0 is the trainer; an engine takes one of the others
        rank_offset=_int_field(raw, "rank_offset", 1, world_size - 1, what),
        world_size=world_size,
        group_name=_group_name_field(raw, what),
        backend=backend,
        timeout_seconds=float(timeout),
    )


def decode_group_name(body: bytes) -> str:
    """`POST /destroy_weights_update_group`: {"group_name"}."""
    return _group_name_field(_json_object(body, "destroy_weights_update_group", {"group_name"}),
                             "destroy_weights_update_group")


@dataclass(frozen=True)
class ReceiveRequest:
    """`POST /receive_weights_broadcast`: take part in the broadcast of staged bucket `bucket` (`size` bytes)."""

    group_name: str
    bucket: int
    size: int


def decode_receive_request(body: bytes) -> ReceiveRequest:
    what = "receive_weights_broadcast"
    raw = _json_object(body, what, {"group_name", "bucket", "size"})
    return ReceiveRequest(_group_name_field(raw, what), _int_field(raw, "bucket", 0, (1 << 63) - 1, what),
                          _int_field(raw, "size", 1, MAX_BROADCAST_BYTES, what))


# ---------------------------------------------------------------------------------------------------------
# the group itself (both sides)


def local_address_towards(host: str) -> str:
    """The address of this machine's interface that reaches `host` (no packet is sent: a UDP `connect` only
    asks the kernel for the route). Loopback for a loopback host."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


class _Group:
    """One member's view of a connected group: its store (kept: NCCL may use it after set-up) and its backend."""

    def __init__(self, store, backend: Any, backend_name: str, rank: int, world_size: int, timeout: timedelta):
        self.store = store
        self.backend = backend
        self.backend_name = backend_name
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0 sends `tensor`, every other member receives into its `tensor`; returns when it is complete."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        options.timeout = self.timeout
        self.backend.broadcast([tensor], options).wait()
        if tensor.is_cuda:
            # NCCL's wait() only orders the current stream after the collective; the caller reuses (trainer) or
            # reads (engine) the buffer right after, so finish it here
            torch.cuda.current_stream(tensor.device).synchronize()

    def close(self) -> None:
        try:
            self.backend.shutdown()
        except RuntimeError as err:  # a member already gone: its sockets are closed either way
            logger.warning("weight broadcast group shutdown: %s", err)
        self.backend = None
        self.store = None


def _connect(master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str,
             timeout: timedelta, device: torch.device, listen_socket: socket.socket | None = None) -> _Group:
    """Join (rank > 0) or host (rank 0, with `listen_socket`) the group; returns once the data path works."""
    if rank == 0:
        assert listen_socket is not None
        # the store serves exactly the socket the caller bound (loopback on one machine), not every interface;
        # it owns the descriptor from here on
        listen_fd = listen_socket.detach()
        try:
            store = dist.TCPStore(master_address, master_port, None, True, timeout=timeout, wait_for_workers=False,
                                  master_listen_fd=listen_fd)
        except BaseException:
            os.close(listen_fd)
            raise
    else:
        store = dist.TCPStore(master_address, master_port, None, False, timeout=timeout)
    store = dist.PrefixStore(f"miles/{group_name}", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        if device.index is not None:
            torch.cuda.set_device(device)  # NCCL binds its communicator to the current device at the first collective
        process_group = dist.ProcessGroupNCCL(store, rank, world_size, options)
    else:
        # _Options is how torch itself hands gloo its devices (distributed_c10d._new_process_group_helper)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        # gloo listens on one interface of each member: the one that reaches the master (loopback on one machine)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(master_address))]
        process_group = dist.ProcessGroupGloo(store, rank, world_size, options)
    group = _Group(store, process_group, backend, rank, world_size, timeout)
    probe = torch.tensor([world_size if rank == 0 else -1], dtype=torch.int64, device=device)
    try:
        group.broadcast(probe)
        if int(probe.item()) != world_size:
            raise RuntimeError(f"weight broadcast group {group_name}: the set-up broadcast carried "
                               f"{int(probe.item())}, expected the world size {world_size}")
    except BaseException:
        group.close()
        raise
    return group


def broadcast_device(backend: str, compute_device: torch.device) -> torch.device:
    """Where a member's bucket buffers live: its GPU for NCCL, the host for gloo."""
    if backend == "nccl":
        if compute_device.type != "cuda":
            raise ProtocolError("backend 'nccl' needs a CUDA device; this engine runs on "
                                f"{compute_device.type} (use gloo)")
        return compute_device
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------------------
# engine side


class BroadcastMember:
    """An engine's membership of the trainer's group: joins on a background thread, then receives buckets on the
    engine's worker thread."""

    def __init__(self, spec: GroupSpec, compute_device: torch.device):
        self.spec = spec
        self.device = broadcast_device(spec.backend, compute_device)
        self.state = "joining"
        self.error: str | None = None
        self.joined_in_seconds: float | None = None
        self.buckets_received = 0
        self._group: _Group | None = None
        self._scratch: torch.Tensor | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._join, name=f"miles-join-{spec.group_name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _join(self) -> None:
        began = time.perf_counter()
        spec = self.spec
        try:
            group = _connect(spec.master_address, spec.master_port, spec.rank_offset, spec.world_size,
                             spec.group_name, spec.backend, timedelta(seconds=spec.timeout_seconds), self.device)
        except Exception as err:  # any failure of the join is reported through /server_info and every later use
            logger.error("joining weight broadcast group %s failed: %s", spec.group_name, err)
            with self._lock:
                self.error = f"{type(err).__name__}: {err}"
                self.state = "failed"
            self._done.set()
            return
        with self._lock:
            if self._closed:  # left before the join finished
                group.close()
            else:
                self._group = group
                self.state = "ready"
                self.joined_in_seconds = time.perf_counter() - began
        logger.info("joined weight broadcast group %s as rank %d of %d (%s) in %.2fs", spec.group_name,
                    spec.rank_offset, spec.world_size, spec.backend, time.perf_counter() - began)
        self._done.set()

    def wait_ready(self, timeout: float) -> _Group:
        if not self._done.wait(timeout):
            raise ProtocolError(f"weight broadcast group {self.spec.group_name} is still joining after {timeout:.0f}s")
        if self._group is None:
            raise ProtocolError(f"weight broadcast group {self.spec.group_name} is {self.state}"
                                + (f": {self.error}" if self.error else ""))
        return self._group

    def receive(self, nbytes: int) -> torch.Tensor:
        """Take part in one broadcast of `nbytes` bytes; returns them (a view of a reused scratch buffer, valid
        until the next receive). Runs on the engine's worker thread."""
        group = self.wait_ready(self.spec.timeout_seconds)
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = None  # free the smaller one before allocating (GPU memory)
            self._scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        received = self._scratch[:nbytes]
        group.broadcast(received)
        self.buckets_received += 1
        return received

    def release_scratch(self) -> None:
        """Drop the receive buffer between updates: it would hold up to a bucket of GPU memory while generating."""
        self._scratch = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            group, self._group = self._group, None
            if self.state != "failed":
                self.state = "closed"
        self._scratch = None
        if group is not None:
            group.close()

    def describe(self) -> dict[str, Any]:
        return {"group_name": self.spec.group_name, "backend": self.spec.backend, "rank": self.spec.rank_offset,
                "world_size": self.spec.world_size, "state": self.state, "error": self.error,
                "joined_in_seconds": self.joined_in_seconds, "buckets_received": self.buckets_received}


# ---------------------------------------------------------------------------------------------------------
# trainer side


class WeightBroadcastGroup:
    """The trainer's rank 0 of a group with the engines at `engine_urls` (engine i is rank i + 1).

    `connect(...)` builds it (see the module doc); `close()` tells the engines to leave and shuts it down. A
    group whose broadcast failed is `broken` and must be closed and built again."""

    def __init__(self, engine_urls: Sequence[str], group: _Group, name: str, device: torch.device,
                 api_key: str | None, timeout: float):
        self.engine_urls = list(engine_urls)
        self.name = name
        self.device = device
        self.backend = group.backend_name
        self.timeout = timeout
        self.broken = False
        self._group: _Group | None = group
        self._api_key = api_key
        self._next_bucket = 0

    @classmethod
    def connect(cls, engine_urls: Sequence[str], *, backend: str | None = None, device: torch.device | str | None = None,
                master_address: str | None = None, timeout: float = 600.0, api_key: str | None = None,
                ) -> "WeightBroadcastGroup":
        """Build the group with these engines; returns once every member passed the set-up broadcast.

        `backend`: nccl when CUDA is available, else gloo. `device`: where the trainer's bucket buffers live
        (the current GPU for nccl, the host for gloo). `master_address`: 127.0.0.1 when every engine URL is on
        loopback, else this node's address (`node_address()`). `timeout`: for the join and for each broadcast."""
        from miles.utils.async_utils import run_sync

        if not engine_urls:
            raise ValueError("a weight broadcast group needs at least one engine")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend not in BACKENDS:
            raise ValueError(f"weight broadcast backend {backend!r}: expected one of {BACKENDS}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        device = torch.device(device)
        if master_address is None:
            master_address = "127.0.0.1" if all(_url_is_loopback(url) for url in engine_urls) else node_address()
        name = f"miles-weights-{secrets.token_hex(8)}"
        world_size = len(engine_urls) + 1
        listen_socket = socket.socket(socket.AF_INET6 if ":" in master_address else socket.AF_INET, socket.SOCK_STREAM)
        try:
            listen_socket.bind((master_address, 0))
            listen_socket.listen(max(64, world_size))
            port = listen_socket.getsockname()[1]
        except OSError:
            listen_socket.close()
            raise
        specs = [GroupSpec(master_address, port, rank, world_size, name, backend, float(timeout))
                 for rank in range(1, world_size)]
        began = time.perf_counter()
        try:
            run_sync(_post_all(engine_urls, "/init_weights_update_group", [s.to_json() for s in specs], api_key,
                               timeout=60.0))
        except BaseException:
            listen_socket.close()
            run_sync(_leave_all(engine_urls, name, api_key))  # engines that did accept must not wait for us
            raise
        try:
            group = _connect(master_address, port, 0, world_size, name, backend, timedelta(seconds=timeout), device,
                             listen_socket=listen_socket)
        except BaseException as err:
            run_sync(_leave_all(engine_urls, name, api_key))
            raise WeightSyncError(f"weight broadcast group with {list(engine_urls)} did not form ({backend}, "
                                  f"master {master_address}:{port}): {type(err).__name__}: {err}") from err
        logger.info("weight broadcast group %s: %d engine(s), %s, master %s:%d, formed in %.2fs", name,
                    len(engine_urls), backend, master_address, port, time.perf_counter() - began)
        return cls(engine_urls, group, name, device, api_key, timeout)

    def next_bucket_id(self) -> int:
        self._next_bucket += 1
        return self._next_bucket

    def broadcast(self, buffer: torch.Tensor) -> None:
        """Send `buffer` (on `self.device`) to every engine; they must be receiving (`/receive_weights_broadcast`)."""
        if self._group is None or self.broken:
            raise RuntimeError(f"weight broadcast group {self.name} is closed or broken")
        try:
            self._group.broadcast(buffer)
        except BaseException:
            self.broken = True
            raise

    def close(self) -> None:
        """Tell every engine to leave (best effort: an engine that died is gone already), then shut down."""
        group, self._group = self._group, None
        if group is None:
            return
        from miles.utils.async_utils import run_sync

        run_sync(_leave_all(self.engine_urls, self.name, self._api_key))
        group.close()


def _url_is_loopback(url: str) -> bool:
    from urllib.parse import urlsplit

    from miles.utils.auth import is_loopback_host

    host = urlsplit(url).hostname
    return host is not None and is_loopback_host(host)


def node_address() -> str:
    """This node's address as the cluster knows it (Ray's node IP). Outside Ray, pass `master_address`."""
    import ray

    if not ray.is_initialized():
        raise ValueError("engines beyond loopback and no Ray to name this node's address: pass master_address")
    return ray.util.get_node_ip_address()


async def _post_all(urls: Sequence[str], path: str, payloads: Sequence[dict], api_key: str | None,
                    timeout: float) -> list[dict]:
    import asyncio

    import aiohttp

    from miles.utils.auth import auth_headers

    headers = {"Content-Type": "application/json", **auth_headers(api_key)}

    async def post(session, url: str, payload: dict) -> dict:
        try:
            async with session.post(f"{url}{path}", data=json.dumps(payload), headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                body = await response.json(content_type=None)
                if response.status != 200:
                    error = body.get("error", body) if isinstance(body, dict) else body
                    raise WeightSyncError(f"engine {url} refused {path}: {error}")
                return body
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            raise WeightSyncError(f"engine {url} unreachable for {path}: {type(err).__name__}: {err}") from err

    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(*(post(session, url, payload) for url, payload in zip(urls, payloads)))


async def _leave_all(urls: Sequence[str], group_name: str, api_key: str | None) -> None:
    """Ask every engine to leave `group_name`; failures are logged (a dead engine cannot answer)."""
    import asyncio

    results = await asyncio.gather(
        *(_post_all([url], "/destroy_weights_update_group", [{"group_name": group_name}], api_key, timeout=30.0)
          for url in urls),
        return_exceptions=True,
    )
    for url, result in zip(urls, results):
        if isinstance(result, BaseException):
            logger.warning("engine %s did not leave weight broadcast group %s: %s", url, group_name, result)
