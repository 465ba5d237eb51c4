"""The engine's wire protocol for `POST /rollout/generate` (docs/design.md §4).

One request is one *microgroup*: M samples of one prompt with seeds seed .. seed+M-1. The body is msgpack;
every tensor travels as a msgpack extension holding (dtype name, shape, raw little-endian bytes), so a
response with latents and conditioning costs one memcpy per tensor on each side. Never pickle, never base64
JSON for generate traffic.

The dataclasses here are the only place that knows the wire layout: `encode_request` / `decode_request` and
`encode_response` / `decode_response` convert both ways; the client turns a `SampleResult` into a
`miles.types.Sample` with `SampleResult.fill_sample`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import msgpack
import torch

from miles.types import GuidanceConfig, Sample

PROTOCOL_VERSION = 1
CONTENT_TYPE = "application/x-msgpack"
_TENSOR_EXT = 42  # msgpack extension code of a tensor

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class ProtocolError(ValueError):
    """A body that does not follow this protocol (wrong version, missing field, bad tensor payload)."""


# ---- tensors ---------------------------------------------------------------------------------------------


def tensor_to_bytes(tensor: torch.Tensor) -> tuple[str, list[int], bytes]:
    """(dtype name, shape, raw bytes) of a tensor; CUDA tensors are copied to the host first."""
    if tensor.dtype not in _DTYPE_NAMES:
        raise ProtocolError(f"dtype {tensor.dtype} cannot travel in the engine protocol")
    host = tensor.detach().to("cpu").contiguous()
    raw = host.reshape(-1).view(torch.uint8).numpy().tobytes() if host.numel() else b""
    return _DTYPE_NAMES[host.dtype], list(host.shape), raw


def tensor_from_bytes(dtype_name: str, shape: list[int], raw: bytes) -> torch.Tensor:
    if dtype_name not in _DTYPES:
        raise ProtocolError(f"unknown tensor dtype {dtype_name!r} in the body")
    dtype = _DTYPES[dtype_name]
    numel = 1
    for dim in shape:
        numel *= int(dim)
    expected = numel * torch.empty((), dtype=dtype).element_size()
    if len(raw) != expected:
        raise ProtocolError(f"tensor payload of {len(raw)} bytes does not match {dtype_name}{list(shape)}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray: a writable buffer the tensor owns (frombuffer on bytes would alias read-only memory)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        dtype_name, shape, raw = tensor_to_bytes(obj)
        return msgpack.ExtType(_TENSOR_EXT, msgpack.packb([dtype_name, shape, raw], use_bin_type=True))
    raise TypeError(f"cannot encode {type(obj).__name__} in the engine protocol")


def _unpack_ext(code: int, data: bytes) -> Any:
    if code != _TENSOR_EXT:
        raise ProtocolError(f"unknown msgpack extension code {code}")
    dtype_name, shape, raw = msgpack.unpackb(data, raw=False)
    return tensor_from_bytes(dtype_name, shape, raw)


def packb(obj: Any) -> bytes:
    """msgpack with tensors as extensions (also used by the weight-sync control messages)."""
    return msgpack.packb(obj, default=_pack_default, use_bin_type=True)


def unpackb(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, ext_hook=_unpack_ext, raw=False, strict_map_key=False)
    except ProtocolError:
        raise
    except Exception as err:  # msgpack raises several unrelated types for a broken body
        raise ProtocolError(f"body is not valid msgpack: {err}") from err


# ---- messages --------------------------------------------------------------------------------------------


@dataclass
class GenerateRequest:
    """One microgroup: `num_samples` samples of `prompt`, sample b seeded with `seed + b`.

    `sde_step_indices` (S) are the steps taken with the `sde_type` kernel; every other step is an Euler ODE
    step (docs/algorithms.md §3). `return_latent_indices` are the k whose x_k the engine returns (S ∪ (S+1) for
    training, the last index n for NFT). `evaluation` is plain generation: images only.
    """

    prompt: str
    num_samples: int = 1
    seed: int = 0
    num_steps: int = 10
    negative_prompt: str | None = None
    guidance: GuidanceConfig = field(default_factory=GuidanceConfig)
    noise_level: float = 0.7
    sde_type: str = "sde"
    log_prob_no_const: bool = False
    sde_backend_path: str | None = None
    sde_step_indices: list[int] = field(default_factory=list)
    return_latent_indices: list[int] = field(default_factory=list)
    height: int = 512
    width: int = 512
    num_frames: int = 1
    fps: float | None = None
    flow_shift: float | None = None
    debug: bool = False
    evaluation: bool = False
    return_images: bool = True
    request_id: str = ""

    def validate(self) -> None:
        """Reject requests the denoise loop cannot serve; the message names the field."""
        if self.num_samples < 1:
            raise ProtocolError(f"num_samples must be >= 1, got {self.num_samples}")
        if self.num_steps < 1:
            raise ProtocolError(f"num_steps must be >= 1, got {self.num_steps}")
        for name in ("sde_step_indices", "return_latent_indices"):
            values = getattr(self, name)
            limit = self.num_steps if name == "sde_step_indices" else self.num_steps + 1
            bad = [k for k in values if not 0 <= k < limit]
            if bad:
                raise ProtocolError(f"{name} {bad} outside [0, {limit}) for num_steps={self.num_steps}")
            if len(set(values)) != len(values):
                raise ProtocolError(f"{name} {values} has duplicates")
        if self.height <= 0 or self.width <= 0 or self.num_frames <= 0:
            raise ProtocolError(f"bad output size {self.height}x{self.width}x{self.num_frames}")


@dataclass
class SampleResult:
    """What the engine returns for one sample (no batch axes anywhere)."""

    seed: int
    image: torch.Tensor | None  # uint8 [F, H, W, 3]
    latents: dict[int, torch.Tensor]  # step k -> x_k, fp32
    timesteps: torch.Tensor  # [n], the DiT's time input per step
    sigmas: torch.Tensor  # [n + 1], terminal 0
    rollout_log_probs: torch.Tensor  # [len(S)], fp32, aligned with the request's sde_step_indices
    conditioning: dict[str, torch.Tensor]
    clean_latents: torch.Tensor | None  # x_n, fp32
    debug_model_outputs: dict[int, torch.Tensor] | None = None  # step k -> combined velocity, fp32

    def fill_sample(self, sample: Sample, request: GenerateRequest, weight_version: int, engine_url: str | None) -> Sample:
        """Copy this result into a `Sample` (the client's side of the protocol)."""
        sample.seed = self.seed
        sample.image = self.image
        sample.sde_step_indices = list(request.sde_step_indices)
        sample.latents = dict(self.latents)
        sample.timesteps = self.timesteps
        sample.sigmas = self.sigmas
        sample.rollout_log_probs = self.rollout_log_probs
        sample.conditioning = dict(self.conditioning)
        sample.clean_latents = self.clean_latents
        sample.debug_model_outputs = self.debug_model_outputs
        sample.weight_version = weight_version
        sample.engine_url = engine_url
        return sample


@dataclass
class GenerateResponse:
    request_id: str
    weight_version: int
    samples: list[SampleResult]
    timings: dict[str, float] = field(default_factory=dict)  # engine-side seconds: queue, denoise, decode


def encode_request(request: GenerateRequest) -> bytes:
    body = asdict(request)
    body["guidance"] = asdict(request.guidance)
    body["protocol_version"] = PROTOCOL_VERSION
    return packb(body)


def _check_version(body: Any, what: str) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError(f"{what} body must be a msgpack map")
    version = body.pop("protocol_version", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"{what} protocol_version {version!r}; this side speaks {PROTOCOL_VERSION}")
    return body


def decode_request(data: bytes) -> GenerateRequest:
    body = _check_version(unpackb(data), "request")
    known = {f.name for f in fields(GenerateRequest)}
    unknown = set(body) - known
    if unknown:
        raise ProtocolError(f"request has unknown fields {sorted(unknown)}")
    if "prompt" not in body:
        raise ProtocolError("request has no 'prompt'")
    try:
        body["guidance"] = GuidanceConfig(**body.get("guidance", {}))
        request = GenerateRequest(**body)
    except TypeError as err:
        raise ProtocolError(f"bad request fields: {err}") from err
    request.validate()
    return request


def encode_response(response: GenerateResponse) -> bytes:
    body = {
        "protocol_version": PROTOCOL_VERSION,
        "request_id": response.request_id,
        "weight_version": response.weight_version,
        "timings": response.timings,
        # shallow field dicts: dataclasses.asdict would deep-copy every tensor
        "samples": [{f.name: getattr(sample, f.name) for f in fields(SampleResult)} for sample in response.samples],
    }
    return packb(body)


def decode_response(data: bytes) -> GenerateResponse:
    body = _check_version(unpackb(data), "response")
    try:
        samples = [SampleResult(**sample) for sample in body["samples"]]
        return GenerateResponse(
            request_id=body["request_id"],
            weight_version=body["weight_version"],
            samples=samples,
            timings=body.get("timings", {}),
        )
    except (KeyError, TypeError) as err:
        raise ProtocolError(f"bad response body: {err}") from err
