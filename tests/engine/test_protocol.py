"""The /rollout/generate wire format: round trips, tensor payloads, and every rejection path."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch

from miles.diffusion.mirrored_adamw import AdamWStep
from miles.engine.protocol import (
    AdapterStepAnswer,
    GenerateRequest,
    GenerateResponse,
    PolicyGradientAnswer,
    ProtocolError,
    RequestLimits,
    SampleResult,
    decode_optimizer_state,
    decode_policy_gradient,
    decode_policy_gradient_request,
    decode_request,
    decode_response,
    encode_optimizer_state,
    encode_policy_gradient,
    encode_policy_gradient_request,
    encode_request,
    encode_response,
    packb,
    tensor_from_bytes,
    unpackb,
)
from miles.types import GuidanceConfig, Sample


def _request(**overrides) -> GenerateRequest:
    fields = dict(
        prompt="a red cube",
        num_samples=3,
        seed=17,
        num_steps=6,
        negative_prompt="blurry",
        guidance=GuidanceConfig(guidance_scale=4.5, guidance_scale_2=3.0, true_cfg_scale=None),
        noise_level=0.5,
        sde_type="cps",
        log_prob_no_const=True,
        sde_step_indices=[1, 2],
        return_latent_indices=[1, 2, 3],
        height=32,
        width=48,
        num_frames=5,
        fps=16.0,
        flow_shift=3.0,
        debug=True,
        evaluation=False,
        request_id="abc",
    )
    fields.update(overrides)
    return GenerateRequest(**fields)


def test_request_round_trip_keeps_every_field():
    request = _request()
    assert decode_request(encode_request(request)) == request


def test_request_body_is_msgpack_without_pickle():
    body = encode_request(_request())
    decoded = msgpack.unpackb(body, raw=False)
    assert decoded["prompt"] == "a red cube" and decoded["guidance"]["guidance_scale"] == 4.5
    assert b"\x80\x04" not in body[:2]  # not a pickle stream


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int64, torch.bool]
)
def test_tensors_round_trip_bitwise(dtype):
    generator = torch.Generator().manual_seed(0)
    source = torch.randn(2, 3, 4, generator=generator) * 10
    tensor = source.to(dtype) if dtype != torch.bool else source > 0
    back = unpackb(packb({"t": tensor, "empty": tensor[:0], "scalar": tensor[0, 0, 0]}))
    assert back["t"].dtype == dtype and torch.equal(back["t"], tensor)
    assert back["empty"].shape == (0, 3, 4)
    assert back["scalar"].shape == () and torch.equal(back["scalar"], tensor[0, 0, 0])
    if dtype != torch.bool:
        back["t"].add_(1)  # decoded tensors own writable memory (no read-only buffer warning or error)


def test_non_contiguous_tensor_round_trips():
    tensor = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
    assert torch.equal(unpackb(packb(tensor)), tensor)


def _response() -> GenerateResponse:
    g = torch.Generator().manual_seed(1)
    samples = []
    for b in range(2):
        samples.append(
            SampleResult(
                seed=17 + b,
                image=torch.randint(0, 255, (1, 8, 8, 3), dtype=torch.uint8, generator=g),
                latents={1: torch.randn(4, 2, 2, generator=g), 2: torch.randn(4, 2, 2, generator=g)},
                timesteps=torch.tensor([1000.0, 500.0]),
                sigmas=torch.tensor([1.0, 0.5, 0.0]),
                rollout_log_probs=torch.tensor([-1.5]),
                conditioning={"prompt_embeds": torch.randn(5, 3, generator=g).bfloat16()},
                clean_latents=torch.randn(4, 2, 2, generator=g),
                debug_model_outputs={0: torch.randn(4, 2, 2, generator=g)} if b == 0 else None,
            )
        )
    return GenerateResponse(request_id="abc", weight_version=7, samples=samples, timings={"denoise": 0.1})


def test_response_round_trip_and_fill_sample():
    response = _response()
    back = decode_response(encode_response(response))
    assert back.request_id == "abc" and back.weight_version == 7 and back.timings == {"denoise": 0.1}
    for ours, theirs in zip(response.samples, back.samples):
        assert ours.seed == theirs.seed
        assert torch.equal(ours.image, theirs.image)
        assert set(theirs.latents) == {1, 2}  # integer step keys survive
        for k in ours.latents:
            assert torch.equal(ours.latents[k], theirs.latents[k])
        assert torch.equal(ours.conditioning["prompt_embeds"], theirs.conditioning["prompt_embeds"])
        assert theirs.conditioning["prompt_embeds"].dtype == torch.bfloat16
    assert back.samples[1].debug_model_outputs is None

    request = _request(sde_step_indices=[1], return_latent_indices=[1, 2])
    sample = back.samples[0].fill_sample(Sample(prompt="a red cube"), request, back.weight_version, "http://e:1")
    assert sample.sde_step_indices == [1] and sample.weight_version == 7 and sample.engine_url == "http://e:1"
    assert sample.num_steps == 2 and torch.equal(sample.clean_latents, response.samples[0].clean_latents)


def test_a_requests_shared_conditioning_travels_once():
    response = _response()
    text = {"prompt_embeds": torch.randn(333, 512)}  # 682 KB: the bulk of the response
    for sample in response.samples:
        sample.conditioning = text  # what the engine does: one dict for the request's samples
    data = encode_response(response)
    assert len(data) < 1.2 * text["prompt_embeds"].numel() * 4
    back = decode_response(data)
    assert back.samples[0].conditioning is back.samples[1].conditioning
    assert torch.equal(back.samples[1].conditioning["prompt_embeds"], text["prompt_embeds"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_samples": 0}, "num_samples"),
        ({"num_steps": 0}, "num_steps"),
        ({"sde_step_indices": [6]}, "sde_step_indices"),
        ({"return_latent_indices": [7]}, "return_latent_indices"),
        ({"sde_step_indices": [1, 1]}, "duplicates"),
        ({"height": 0}, "output size"),
    ],
)
def test_invalid_requests_are_rejected_with_the_field_named(overrides, message):
    with pytest.raises(ProtocolError, match=message):
        decode_request(encode_request(_request(**overrides)))


def test_version_unknown_fields_and_garbage_are_rejected():
    body = msgpack.unpackb(encode_request(_request()), raw=False)
    with pytest.raises(ProtocolError, match="protocol_version"):
        decode_request(packb({**body, "protocol_version": 99}))
    with pytest.raises(ProtocolError, match="unknown fields"):
        decode_request(packb({**body, "temperature": 1.0}))
    no_prompt = dict(body)
    del no_prompt["prompt"]
    with pytest.raises(ProtocolError, match="prompt"):
        decode_request(packb(no_prompt))
    with pytest.raises(ProtocolError, match="msgpack"):
        decode_request(b"\xc1not msgpack")
    with pytest.raises(ProtocolError, match="map"):
        decode_response(packb([1, 2]))


def test_bad_tensor_payloads_are_rejected():
    with pytest.raises(ProtocolError, match="does not match"):
        tensor_from_bytes("float32", [2, 2], b"\x00" * 15)
    with pytest.raises(ProtocolError, match="dtype"):
        tensor_from_bytes("complex64", [1], b"\x00" * 8)
    with pytest.raises(ProtocolError, match="cannot travel"):
        packb(torch.zeros(2, dtype=torch.complex64))
    bad_ext = msgpack.packb(msgpack.ExtType(7, b"xx"), use_bin_type=True)
    with pytest.raises(ProtocolError, match="extension"):
        unpackb(bad_ext)


def _body(**overrides) -> bytes:
    body = msgpack.unpackb(encode_request(_request()), raw=False)
    body.update(overrides)
    return packb(body)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_samples": "3"}, "num_samples must be an integer"),
        ({"num_samples": True}, "num_samples must be an integer"),
        ({"num_steps": 6.0}, "num_steps must be an integer"),
        ({"prompt": ["a", "b"]}, "prompt must be a string"),
        ({"noise_level": float("nan")}, "noise_level must be a finite number"),
        ({"debug": 1}, "debug must be true or false"),
        ({"sde_step_indices": [1, "2"]}, "sde_step_indices entry must be an integer"),
        ({"sde_step_indices": {"1": 1}}, "sde_step_indices must be a list"),
        ({"guidance": [4.0]}, "guidance must be a map"),
        ({"guidance": {"guidance_scale": "high"}}, "guidance.guidance_scale must be a finite number"),
        ({"guidance": {"scale_fn": "os.system"}}, "guidance has unknown fields"),
        ({"seed": -1}, "seed must be in"),
        ({"seed": 2**63 - 1}, "seed must be in"),
    ],
)
def test_wrong_types_are_protocol_errors_naming_the_field(overrides, message):
    with pytest.raises(ProtocolError, match=message):
        decode_request(_body(**overrides))


def test_a_module_path_in_the_body_is_rejected_and_the_request_has_no_such_field():
    """The SDE backend comes from the engine's flags: a body naming code to import is refused, not obeyed."""
    assert "sde_backend_path" not in {f.name for f in dataclasses.fields(GenerateRequest)}
    for field_name in ("sde_backend_path", "sde_step_backend_path", "model_backend_path", "pipeline_builder_path"):
        with pytest.raises(ProtocolError, match="unknown fields"):
            decode_request(_body(**{field_name: "os.system"}))


def test_limits_bound_every_size_and_are_configurable():
    limits = RequestLimits(max_samples=4, max_steps=8, max_image_size=64, max_frames=2, max_text_chars=10)
    for overrides, message in [
        ({"num_samples": 5}, "num_samples 5 exceeds this engine's limit 4"),
        ({"num_steps": 9}, "num_steps 9 exceeds"),
        ({"height": 96}, "height 96 exceeds"),
        ({"width": 96}, "width 96 exceeds"),
        ({"num_frames": 3}, "num_frames 3 exceeds"),
        ({"prompt": "x" * 11}, "prompt has 11 characters"),
    ]:
        with pytest.raises(ProtocolError, match=message):
            small = dict(num_samples=2, num_steps=6, height=32, width=48, num_frames=1, prompt="short",
                         negative_prompt=None, sde_type="sde", request_id="r")
            decode_request(encode_request(_request(**{**small, **overrides})), limits)
    # the defaults: 64 samples, 1000 steps, 4096 px, 1024 frames
    with pytest.raises(ProtocolError, match="num_samples 65"):
        decode_request(encode_request(_request(num_samples=65)))
    with pytest.raises(ProtocolError, match="num_steps 1001"):
        decode_request(encode_request(_request(num_steps=1001)))
    assert decode_request(encode_request(_request(num_samples=64, height=1024, width=1024))).num_samples == 64
    # every field at its limit at once is refused by the request's total cost (the answer's bytes here)
    with pytest.raises(ProtocolError, match="the answer would carry up to"):
        decode_request(encode_request(_request(num_samples=64, height=4096, width=4096)))
    with pytest.raises(ProtocolError, match="pixel-steps"):
        decode_request(encode_request(_request(num_samples=64, height=4096, width=4096)),
                       RequestLimits(max_pixel_steps=1 << 20))


def test_request_bodies_carry_no_msgpack_extensions():
    with pytest.raises(ProtocolError, match="no msgpack extensions"):
        decode_request(_body(prompt=torch.zeros(2)))


def _image(height: int = 4, width: int = 6):
    from miles.engine.protocol import ConditionImage

    return ConditionImage.from_tensor(torch.arange(height * width * 3, dtype=torch.uint8).reshape(height, width, 3))


def test_an_input_image_travels_as_raw_bytes_with_its_size():
    request = _request(image=_image())
    decoded = decode_request(encode_request(request))
    assert decoded == request and type(decoded.image.pixels) is bytes
    assert torch.equal(decoded.image.to_tensor(), request.image.to_tensor())
    assert msgpack.unpackb(encode_request(request), raw=False)["image"]["height"] == 4  # a plain map, no extension


@pytest.mark.parametrize(
    "image, message",
    [
        ({"height": 4, "width": 6, "pixels": b"\0" * 71}, "image pixels hold 71 bytes, not 4x6x3"),
        ({"height": 4, "width": 6, "pixels": "x" * 72}, "image.pixels must be binary"),
        ({"height": 4, "width": 6}, "image must be a map of height, width and pixels"),
        ({"height": 4, "width": 6, "pixels": b"", "format": "png"}, "image must be a map"),
        ({"height": True, "width": 6, "pixels": b""}, "image.height must be an integer"),
        ({"height": 0, "width": 6, "pixels": b""}, "bad image size 0x6"),
        ([4, 6, b"\0" * 72], "image must be a map"),
    ],
)
def test_malformed_input_images_are_rejected_naming_the_field(image, message):
    body = msgpack.unpackb(encode_request(_request()), raw=False)
    body["image"] = image
    with pytest.raises(ProtocolError, match=message):
        decode_request(msgpack.packb(body, use_bin_type=True))


def test_an_input_image_larger_than_the_engine_serves_is_refused():
    body = encode_request(_request(image=_image(80, 2)))
    with pytest.raises(ProtocolError, match="image size 80x2 exceeds this engine's limit 64"):
        decode_request(body, RequestLimits(max_image_size=64))
    assert decode_request(body, RequestLimits(max_image_size=80)).image.height == 80


def test_a_policy_gradient_answer_carries_the_engines_wait_and_sum_seconds():
    answer = PolicyGradientAnswer(2, layout=[("a", (3, 4))], wait_seconds=0.25, sum_seconds=0.125)
    assert decode_policy_gradient(encode_policy_gradient(answer)) == answer
    body = msgpack.unpackb(encode_policy_gradient(answer))
    body["wait_seconds"] = float("nan")
    with pytest.raises(ProtocolError, match="wait_seconds must be a finite number"):
        decode_policy_gradient(msgpack.packb(body))


def test_a_policy_gradient_request_may_carry_the_step_the_engine_takes_itself():
    step = AdamWStep(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, clip=1.0, count=7)
    into = {"kind": "shm"}
    asked = decode_policy_gradient_request(encode_policy_gradient_request({3: -0.5}, into, step, weight_version=8))
    assert asked.coefficients == {3: -0.5} and asked.into == into and asked.step == step and asked.weight_version == 8
    assert decode_policy_gradient_request(encode_policy_gradient_request({3: 1.0})).step is None
    body = msgpack.unpackb(encode_policy_gradient_request({3: 1.0}, into, step, 8))
    for field, value, message in (("count", 0, "out of range"), ("beta2", 1.0, "out of range"),
                                  ("lr", float("inf"), "step.lr must be a finite number")):
        with pytest.raises(ProtocolError, match=message):
            decode_policy_gradient_request(msgpack.packb({**body, "step": {**body["step"], field: value}}))
    with pytest.raises(ProtocolError, match="comes with 'into'"):  # the step needs the trainer's shared buffer
        decode_policy_gradient_request(msgpack.packb({k: v for k, v in body.items() if k != "into"}))
    answer = PolicyGradientAnswer(1, layout=[("a", (2,))], step=AdapterStepAnswer("skipped", float("inf"), 0, 0.5))
    decoded = decode_policy_gradient(encode_policy_gradient(answer))
    assert decoded.step.outcome == "skipped" and decoded.step.grad_norm == float("inf")
    body = msgpack.unpackb(encode_policy_gradient(answer))
    with pytest.raises(ProtocolError, match="outcome"):
        decode_policy_gradient(msgpack.packb({**body, "step": {**body["step"], "outcome": "maybe"}}))
    assert decode_optimizer_state(encode_optimizer_state(4, into)) == (4, into)
    with pytest.raises(ProtocolError, match="count -1 < 0"):
        decode_optimizer_state(encode_optimizer_state(-1, into))
