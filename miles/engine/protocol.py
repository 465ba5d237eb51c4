"""The engine's wire protocol for `POST /rollout/generate` (docs/design.md §4).

One request is one *microgroup*: M samples of one prompt with seeds seed .. seed+M-1. The body is msgpack;
every tensor travels as a msgpack extension holding (dtype name, shape, raw little-endian bytes), so a
response with latents and conditioning costs one memcpy per tensor on each side. Never pickle, never base64
JSON for generate traffic.

A request is decoded defensively (`decode_request`): no msgpack extensions, only known fields, each of its
declared type (a wrong type is a ProtocolError, i.e. a 400, never a crash deeper in), and the engine's
`RequestLimits` on samples, steps, size and frames. A request names no code: the SDE step backend the engine
imports comes from its own start-up flags (`--sde-step-backend-path`), never from the body.

The dataclasses here are the only place that knows the wire layout: `encode_request` / `decode_request` and
`encode_response` / `decode_response` convert both ways; the client turns a `SampleResult` into a
`miles.types.Sample` with `SampleResult.fill_sample`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import msgpack
import torch

from miles.diffusion.mirrored_adamw import AdamWStep
from miles.utils.defaults import DEFAULT_NOISE_LEVEL
from miles.types import GuidanceConfig, Sample

PROTOCOL_VERSION = 4  # 2: a request's conditioning travels once per response; 3: a request may carry an image;
# 4: a request may wait for a weight version
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


@dataclass(frozen=True)
class RequestLimits:
    """The most one generate request may ask of an engine (ServerArgs `--max-*`; 400 beyond)."""

    max_samples: int = 64
    max_steps: int = 1000
    max_image_size: int = 4096  # height and width, pixels
    max_frames: int = 1024
    max_text_chars: int = 65536  # prompt, negative prompt, request id, sde type
    # the whole request, as every field may be at its limit: samples x steps x pixels x frames, and the bytes the
    # answer carries (`response_bytes_bound`)
    max_pixel_steps: int = 1 << 42
    max_response_bytes: int = 4 << 30


def pixel_steps(num_samples: int, num_steps: int, height: int, width: int, num_frames: int) -> int:
    """What a generate request costs the engine: samples x steps x pixels x frames."""
    return num_samples * num_steps * height * width * num_frames


def response_bytes_bound(num_samples: int, height: int, width: int, num_frames: int, num_latents: int) -> int:
    """An upper bound on an answer's size: uint8 RGB images plus the returned latents, counted at one fp32 per
    8x8 pixels and 16 channels (the families' VAEs compress at least that much)."""
    return num_samples * height * width * num_frames * (3 + num_latents)


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
class ConditionImage:
    """A request's input image (image editing, image-to-video): raw RGB bytes, row-major uint8 [H, W, 3].

    It travels as a msgpack bin with its size beside it, never as an encoded file (the engine runs no image
    decoder on what a client sends) and never pickled; `height` and `width` are under the engine's
    `--max-image-size`, so the payload is at most that squared × 3 bytes."""

    height: int
    width: int
    pixels: bytes

    def validate(self) -> None:
        if self.height <= 0 or self.width <= 0:
            raise ProtocolError(f"bad image size {self.height}x{self.width}")
        if len(self.pixels) != self.height * self.width * 3:
            raise ProtocolError(f"image pixels hold {len(self.pixels)} bytes, not {self.height}x{self.width}x3")

    def to_tensor(self) -> torch.Tensor:
        """uint8 [H, W, 3] (a copy the tensor owns)."""
        return torch.frombuffer(bytearray(self.pixels), dtype=torch.uint8).reshape(self.height, self.width, 3)

    @classmethod
    def from_tensor(cls, pixels: torch.Tensor) -> "ConditionImage":
        if pixels.dtype != torch.uint8 or pixels.ndim != 3 or pixels.shape[-1] != 3:
            raise ValueError(f"expected uint8 pixels [H, W, 3], got {pixels.dtype} {tuple(pixels.shape)}")
        height, width = pixels.shape[:2]
        return cls(height=int(height), width=int(width), pixels=pixels.contiguous().numpy().tobytes())


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
    noise_level: float = DEFAULT_NOISE_LEVEL
    sde_type: str = "sde"
    log_prob_no_const: bool = False
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
    image: ConditionImage | None = None  # the prompt row's input image, shared by the request's samples
    rollout_gradient: bool = False  # keep each sample's ∇ log-prob for POST /policy_gradient (rollout_gradients.py)
    # the engine encodes the prompt at once but takes the first step only on weights of this version or later (a
    # rollout sent while the trainer still trains on the previous one; docs/engine.md); None: on the current ones
    after_weight_version: int | None = None

    def validate(self) -> None:
        """Reject requests the denoise loop cannot serve; the message names the field."""
        if self.num_samples < 1:
            raise ProtocolError(f"num_samples must be >= 1, got {self.num_samples}")
        if self.num_steps < 1:
            raise ProtocolError(f"num_steps must be >= 1, got {self.num_steps}")
        if not 0 <= self.seed <= _MAX_SEED - self.num_samples:
            raise ProtocolError(f"seed must be in [0, 2^63 - num_samples], got {self.seed}")
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
        if self.image is not None:
            self.image.validate()
        if self.rollout_gradient and (self.evaluation or not self.sde_step_indices):
            raise ProtocolError("rollout_gradient needs a training request with SDE steps")
        if self.after_weight_version is not None and self.after_weight_version < 0:
            raise ProtocolError(f"after_weight_version must be >= 0, got {self.after_weight_version}")

    def check_limits(self, limits: RequestLimits) -> None:
        """Reject requests larger than this engine serves (each limit is a server flag)."""
        for name, value, limit, flag in (
            ("num_samples", self.num_samples, limits.max_samples, "max-samples-per-request"),
            ("num_steps", self.num_steps, limits.max_steps, "max-num-steps"),
            ("height", self.height, limits.max_image_size, "max-image-size"),
            ("width", self.width, limits.max_image_size, "max-image-size"),
            ("num_frames", self.num_frames, limits.max_frames, "max-num-frames"),
        ):
            if value > limit:
                raise ProtocolError(f"{name} {value} exceeds this engine's limit {limit} (engine flag --{flag}, "
                                    f"--sglang-{flag} in train_diffusion.py)")
        cost = pixel_steps(self.num_samples, self.num_steps, self.height, self.width, self.num_frames)
        if cost > limits.max_pixel_steps:
            raise ProtocolError(f"the request costs {cost} pixel-steps (samples x steps x height x width x frames), "
                                f"over this engine's limit {limits.max_pixel_steps} (engine flag "
                                "--max-request-pixel-steps, --sglang-max-request-pixel-steps in train_diffusion.py)")
        answer = response_bytes_bound(self.num_samples, self.height, self.width, self.num_frames,
                                      len(self.return_latent_indices))
        if answer > limits.max_response_bytes:
            raise ProtocolError(f"the answer would carry up to {answer} bytes, over this engine's limit "
                                f"{limits.max_response_bytes} (engine flag --max-response-bytes, "
                                "--sglang-max-response-bytes in train_diffusion.py)")
        if self.image is not None and max(self.image.height, self.image.width) > limits.max_image_size:
            raise ProtocolError(f"image size {self.image.height}x{self.image.width} exceeds this engine's limit "
                                f"{limits.max_image_size} (engine flag --max-image-size, --sglang-max-image-size in "
                                "train_diffusion.py)")
        for name in ("prompt", "negative_prompt", "sde_type", "request_id"):
            text = getattr(self, name)
            if text is not None and len(text) > limits.max_text_chars:
                raise ProtocolError(f"{name} has {len(text)} characters; the limit is {limits.max_text_chars}")


@dataclass
class SampleResult:
    """What the engine returns for one sample (no batch axes anywhere)."""

    seed: int
    image: torch.Tensor | None  # uint8 [F, H, W, 3]
    latents: dict[int, torch.Tensor]  # step k -> x_k, fp32
    timesteps: torch.Tensor  # [n], the DiT's time input per step
    sigmas: torch.Tensor  # [n + 1], terminal 0
    rollout_log_probs: torch.Tensor  # [len(S)], fp32, aligned with the request's sde_step_indices
    conditioning: dict[str, torch.Tensor]  # the request's prompt: one dict shared by its samples, sent once
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
    timings: dict[str, float] = field(default_factory=dict)  # engine-side seconds: queue, denoise, decode, step clock


def encode_request(request: GenerateRequest) -> bytes:
    body = asdict(request)
    body["guidance"] = asdict(request.guidance)
    body["image"] = None if request.image is None else asdict(request.image)
    body["protocol_version"] = PROTOCOL_VERSION
    return packb(body)


def _check_version(body: Any, what: str) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError(f"{what} body must be a msgpack map")
    version = body.pop("protocol_version", None)
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"{what} protocol_version {version!r}; this side speaks {PROTOCOL_VERSION}")
    return body


_MAX_SEED = (1 << 63) - 1
_MAX_INDEX_COUNT = 1 << 16  # more step indices than any --max-num-steps; checked before the list is walked


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _as_int(name: str, value: Any) -> int:
    if type(value) is not int:  # not isinstance: True is an int to Python, not a sample count to us
        raise ProtocolError(f"{name} must be an integer, got {_short(value)}")
    return value


def _as_float(name: str, value: Any) -> float:
    if type(value) not in (int, float) or value != value or value in (float("inf"), float("-inf")):
        raise ProtocolError(f"{name} must be a finite number, got {_short(value)}")
    return float(value)


def _as_bool(name: str, value: Any) -> bool:
    if type(value) is not bool:
        raise ProtocolError(f"{name} must be true or false, got {_short(value)}")
    return value


def _as_str(name: str, value: Any) -> str:
    if type(value) is not str:
        raise ProtocolError(f"{name} must be a string, got {_short(value)}")
    return value


def _as_index_list(name: str, value: Any) -> list[int]:
    if type(value) is not list or len(value) > _MAX_INDEX_COUNT:
        raise ProtocolError(f"{name} must be a list of step indices, got {_short(value)}")
    return [_as_int(f"{name} entry", k) for k in value]


def _as_condition_image(name: str, value: Any) -> ConditionImage:
    if type(value) is not dict or set(value) != {"height", "width", "pixels"}:
        raise ProtocolError(f"{name} must be a map of height, width and pixels, got {_short(value)}")
    if type(value["pixels"]) is not bytes:
        raise ProtocolError(f"{name}.pixels must be binary (msgpack bin), got {type(value['pixels']).__name__}")
    return ConditionImage(height=_as_int(f"{name}.height", value["height"]),
                          width=_as_int(f"{name}.width", value["width"]), pixels=value["pixels"])


def _optional(convert):
    return lambda name, value: None if value is None else convert(name, value)


# every field a request may carry, with the converter that checks its wire type
_REQUEST_FIELDS = {
    "prompt": _as_str,
    "num_samples": _as_int,
    "seed": _as_int,
    "num_steps": _as_int,
    "negative_prompt": _optional(_as_str),
    "noise_level": _as_float,
    "sde_type": _as_str,
    "log_prob_no_const": _as_bool,
    "sde_step_indices": _as_index_list,
    "return_latent_indices": _as_index_list,
    "height": _as_int,
    "width": _as_int,
    "num_frames": _as_int,
    "fps": _optional(_as_float),
    "flow_shift": _optional(_as_float),
    "debug": _as_bool,
    "evaluation": _as_bool,
    "return_images": _as_bool,
    "request_id": _as_str,
    "image": _optional(_as_condition_image),
    "rollout_gradient": _as_bool,
    "after_weight_version": _optional(_as_int),
}
_GUIDANCE_FIELDS = {
    "guidance_scale": _as_float,
    "guidance_scale_2": _optional(_as_float),
    "true_cfg_scale": _optional(_as_float),
}
assert set(_REQUEST_FIELDS) | {"guidance"} == {f.name for f in fields(GenerateRequest)}
assert set(_GUIDANCE_FIELDS) == {f.name for f in fields(GuidanceConfig)}


def _reject_extension(code: int, data: bytes) -> Any:
    raise ProtocolError(f"a generate request carries no msgpack extensions (got code {code})")


def decode_request(data: bytes, limits: RequestLimits | None = None) -> GenerateRequest:
    """Parse, type-check and validate one request body (ProtocolError names the first bad field)."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_reject_extension)
    except ProtocolError:
        raise
    except Exception as err:  # msgpack raises several unrelated types for a broken body
        raise ProtocolError(f"body is not valid msgpack: {type(err).__name__}: {err}") from err
    body = _check_version(raw, "request")
    unknown = set(body) - set(_REQUEST_FIELDS) - {"guidance"}
    if unknown:
        raise ProtocolError(f"request has unknown fields {sorted(map(str, unknown))}")
    if "prompt" not in body:
        raise ProtocolError("request has no 'prompt'")
    values = {name: _REQUEST_FIELDS[name](name, value) for name, value in body.items() if name != "guidance"}
    guidance = body.get("guidance", {})
    if type(guidance) is not dict:
        raise ProtocolError(f"guidance must be a map, got {_short(guidance)}")
    unknown = set(guidance) - set(_GUIDANCE_FIELDS)
    if unknown:
        raise ProtocolError(f"guidance has unknown fields {sorted(map(str, unknown))}")
    values["guidance"] = GuidanceConfig(
        **{name: _GUIDANCE_FIELDS[name](f"guidance.{name}", value) for name, value in guidance.items()}
    )
    request = GenerateRequest(**values)
    request.validate()
    request.check_limits(limits or RequestLimits())
    return request


def encode_response(response: GenerateResponse) -> bytes:
    # The samples of a request share their prompt's conditioning (one dict): it travels once, not once per sample
    # (at SD3.5 size that is 333 x 4096 text features per branch, most of a response's bytes).
    shared = response.samples[0].conditioning if response.samples else None
    if shared is not None and any(sample.conditioning is not shared for sample in response.samples):
        shared = None
    per_sample = [f.name for f in fields(SampleResult) if not (shared is not None and f.name == "conditioning")]
    body = {
        "protocol_version": PROTOCOL_VERSION,
        "request_id": response.request_id,
        "weight_version": response.weight_version,
        "timings": response.timings,
        "conditioning": shared,
        # shallow field dicts: dataclasses.asdict would deep-copy every tensor
        "samples": [{name: getattr(sample, name) for name in per_sample} for sample in response.samples],
    }
    return packb(body)


def decode_response(data: bytes) -> GenerateResponse:
    body = _check_version(unpackb(data), "response")
    try:
        shared = body.get("conditioning")
        samples = [SampleResult(**({"conditioning": shared} if shared is not None else {}), **sample)
                   for sample in body["samples"]]
        return GenerateResponse(
            request_id=body["request_id"],
            weight_version=body["weight_version"],
            samples=samples,
            timings=body.get("timings", {}),
        )
    except (KeyError, TypeError) as err:
        raise ProtocolError(f"bad response body: {err}") from err


# ---- POST /policy_gradient (miles/engine/rollout_gradients.py) -----------------------------------------------
# The request names the samples' coefficients c_b = −clip(A_b)/P by seed and may name `into`: a buffer of the
# asking trainer's by reference (a shared-memory file or a CUDA IPC handle, as the map `encode_buffer_ref` of
# miles/engine/weight_sync_wire.py writes; the server decodes it there). With `into` the engine adds its Σ_b c_b·G_b
# into that buffer (fp32, its pieces one after another) and the answer carries only the pieces' names and shapes;
# without it the answer carries the tensors.
# With `into`, the request may also carry `step` (the trainer's AdamW settings for this step, `AdamWStep`) and
# `weight_version`: the engine then steps its adapter too (miles/engine/adapter_step.py) and the answer's `step`
# says how it went (`AdapterStepAnswer`).


@dataclass(frozen=True)
class PolicyGradientAnswer:
    samples: int  # how many of the asked samples this engine held
    gradient: dict[str, torch.Tensor] | None = None  # by name (no `into`)
    layout: list[tuple[str, tuple[int, ...]]] | None = None  # the pieces added into `into`, in buffer order
    wait_seconds: float = 0.0  # the request waiting for the engine's worker thread (a step or an encoding there)
    sum_seconds: float = 0.0  # forming Σ_b c_b·G_b (reading any sums still spilled to the host) and adding it
    step: AdapterStepAnswer | None = None  # the engine's own optimizer step, when the request carried one


@dataclass(frozen=True)
class AdapterStepAnswer:
    """The engine's optimizer step (miles/engine/adapter_step.py). `outcome`: stepped (the weights moved to the
    request's weight version), skipped (a non-finite gradient: the weights are unchanged and still move to that
    version, as the trainer skips too) or no_state (the engine's moments are not the trainer's: nothing changed).
    `grad_norm`: ‖g‖ as the engine measured it, which the trainer's step uses too; `checksum`: the new factors'
    `bits_checksum` (stepped only)."""

    outcome: str
    grad_norm: float
    checksum: int = 0
    seconds: float = 0.0


_STEP_FIELDS = ("lr", "beta1", "beta2", "eps", "weight_decay", "clip", "count")
_STEP_OUTCOMES = ("stepped", "skipped", "no_state")


@dataclass(frozen=True)
class PolicyGradientRequest:
    coefficients: dict[int, float]  # c_b by seed
    into: Any = None  # the raw `into` map (for `decode_buffer_ref`) or None
    step: AdamWStep | None = None  # with `into` only
    weight_version: int = 0  # the engine's version after `step`


def encode_policy_gradient_request(coefficients: dict[int, float], into: dict | None = None,
                                   step: AdamWStep | None = None, weight_version: int = 0) -> bytes:
    seeds = list(coefficients)
    body = {"seeds": seeds, "coefficients": [float(coefficients[s]) for s in seeds],
            "protocol_version": PROTOCOL_VERSION}
    if into is not None:
        body["into"] = into
    if step is not None:
        body["step"] = {name: getattr(step, name) for name in _STEP_FIELDS}
        body["weight_version"] = int(weight_version)
    return packb(body)


def decode_policy_gradient_request(data: bytes) -> PolicyGradientRequest:
    body = _check_version(unpackb(data), "policy_gradient request")
    seeds, coefficients = body.get("seeds"), body.get("coefficients")
    if not set(body) <= {"seeds", "coefficients", "into", "step", "weight_version"} or type(seeds) is not list \
            or type(coefficients) is not list or len(seeds) != len(coefficients) or len(seeds) > _MAX_INDEX_COUNT:
        raise ProtocolError("policy_gradient request: expected equal lists 'seeds' and 'coefficients'")
    by_seed = {_as_int("seeds[]", s): _as_float("coefficients[]", c) for s, c in zip(seeds, coefficients)}
    raw_step, step = body.get("step"), None
    if raw_step is not None:
        if type(raw_step) is not dict or set(raw_step) != set(_STEP_FIELDS) or body.get("into") is None:
            raise ProtocolError(f"policy_gradient request: 'step' must map {list(_STEP_FIELDS)} and comes with "
                                "'into'")
        values = {name: _as_float(f"step.{name}", raw_step[name]) for name in _STEP_FIELDS if name != "count"}
        count = _as_int("step.count", raw_step["count"])
        if count < 1 or not 0 <= values["beta1"] < 1 or not 0 <= values["beta2"] < 1 or values["eps"] <= 0:
            raise ProtocolError(f"policy_gradient request: step settings out of range {_short(raw_step)}")
        step = AdamWStep(count=count, **values)
    return PolicyGradientRequest(by_seed, body.get("into"), step,
                                 _as_int("weight_version", body.get("weight_version", 0)))


def _float_or_nonfinite(name: str, value: Any) -> float:
    if type(value) not in (int, float):  # a norm may be inf or nan: the step was skipped
        raise ProtocolError(f"{name} must be a number, got {_short(value)}")
    return float(value)


def encode_policy_gradient(answer: PolicyGradientAnswer) -> bytes:
    body: dict[str, Any] = {"samples": answer.samples, "protocol_version": PROTOCOL_VERSION,
                            "wait_seconds": float(answer.wait_seconds), "sum_seconds": float(answer.sum_seconds)}
    if answer.gradient is not None:
        body["gradient"] = answer.gradient
    if answer.layout is not None:
        body["layout"] = [[name, list(shape)] for name, shape in answer.layout]
    if answer.step is not None:
        body["step"] = {"outcome": answer.step.outcome, "grad_norm": float(answer.step.grad_norm),
                        "checksum": int(answer.step.checksum), "seconds": float(answer.step.seconds)}
    return packb(body)


def decode_policy_gradient(data: bytes) -> PolicyGradientAnswer:
    body = _check_version(unpackb(data), "policy_gradient response")
    gradient, layout, samples = body.get("gradient"), body.get("layout"), body.get("samples")
    if type(samples) is not int or (gradient is None) == (layout is None):
        raise ProtocolError("policy_gradient response: expected 'samples' and one of 'gradient' or 'layout'")
    if gradient is not None and (type(gradient) is not dict or not all(
            type(k) is str and isinstance(v, torch.Tensor) and v.dtype == torch.float32 for k, v in gradient.items())):
        raise ProtocolError("policy_gradient response: 'gradient' must map names to fp32 tensors")
    if layout is not None:
        if type(layout) is not list or not all(
                type(piece) is list and len(piece) == 2 and type(piece[0]) is str and type(piece[1]) is list
                and all(type(d) is int and d >= 0 for d in piece[1]) for piece in layout):
            raise ProtocolError("policy_gradient response: 'layout' must be a list of [name, shape]")
        layout = [(name, tuple(shape)) for name, shape in layout]
    wait, total = body.get("wait_seconds", 0.0), body.get("sum_seconds", 0.0)
    raw_step, step = body.get("step"), None
    if raw_step is not None:
        if type(raw_step) is not dict or set(raw_step) != {"outcome", "grad_norm", "checksum", "seconds"} \
                or raw_step["outcome"] not in _STEP_OUTCOMES:
            raise ProtocolError(f"policy_gradient response: 'step' must be an outcome {list(_STEP_OUTCOMES)} with "
                                "grad_norm, checksum and seconds")
        step = AdapterStepAnswer(raw_step["outcome"], _float_or_nonfinite("step.grad_norm", raw_step["grad_norm"]),
                                 _as_int("step.checksum", raw_step["checksum"]),
                                 _as_float("step.seconds", raw_step["seconds"]))
    return PolicyGradientAnswer(samples, gradient, layout, _as_float("wait_seconds", wait),
                                _as_float("sum_seconds", total), step)


# ---- POST /optimizer_state (miles/engine/adapter_step.py) -----------------------------------------------------
# The trainer's AdamW moments after its step `count`, for an engine that steps the adapter itself: `into` names a
# buffer of the trainer's (as above) holding exp_avg then exp_avg_sq, fp32 in the engine's layout order.


def encode_optimizer_state(count: int, into: dict) -> bytes:
    return packb({"count": int(count), "into": into, "protocol_version": PROTOCOL_VERSION})


def decode_optimizer_state(data: bytes) -> tuple[int, Any]:
    """(the step count, the raw `into` map)."""
    body = _check_version(unpackb(data), "optimizer_state request")
    if set(body) != {"count", "into"}:
        raise ProtocolError("optimizer_state request: expected 'count' and 'into'")
    count = _as_int("count", body["count"])
    if count < 0:
        raise ProtocolError(f"optimizer_state request: count {count} < 0")
    return count, body["into"]
