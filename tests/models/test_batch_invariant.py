"""Bitwise engine/trainer parity (miles/models/batch_invariant.py): the engine's rollout, with requests of
different prompts sharing each denoising step, replayed by the trainer at its own micro-batch size."""

from __future__ import annotations

import pytest
import torch

from miles.backends.fsdp_utils.actor import DiffusionTrainer
from miles.backends.fsdp_utils.spawn import free_port, init_distributed
from miles.testing.tiny_rollout import load_tiny_family, tiny_trainer_config
from miles.backends.fsdp_utils.weight_export import iter_named_tensors
from miles.engine.model_runner import ModelRunner
from miles.engine.patches import apply_patch_groups
from miles.engine.protocol import GenerateRequest
from miles.engine.server_args import ServerArgs
from miles.types import GuidanceConfig, Sample

STEPS = 4
SDE_STEPS = [0, 1, 2]
GUIDANCE = 4.5


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    """(args, family, pipeline) of the tiny SD3, with this process as a one-rank group (gloo; NCCL for CUDA
    tensors where there is a GPU)."""
    init_distributed(0, 1, "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo", free_port())
    args = tiny_trainer_config(tiny_checkpoint("sd3"))
    yield args, *load_tiny_family(args)
    torch.distributed.destroy_process_group()


def rollout(family, pipe, checkpoint: str, tile: int, weights: dict[str, torch.Tensor] | None = None,
            dtype: str = "fp32", size: int = 32, frames: int = 1, device: str = "cpu") -> list[Sample]:
    """Two requests (3 + 2 samples, different prompts) denoised together, one batched forward per step."""
    server_args = ServerArgs(model_path=checkpoint, device=device, dtype=dtype, generator_device="cpu",
                             forward_tile=tile, max_batch_size=64)
    runner = ModelRunner(server_args, loaded=(family, pipe))
    if tile:
        apply_patch_groups(runner.modules, "batch_invariant", family)
    if weights:
        with torch.no_grad():
            for name, param in runner.modules["transformer"].named_parameters():
                param.copy_(weights[f"transformer.{name}"])
    requests = [
        GenerateRequest(prompt=prompt, num_samples=m, seed=seed, num_steps=STEPS, height=size, width=size,
                        num_frames=frames,
                        guidance=GuidanceConfig(guidance_scale=GUIDANCE), noise_level=0.7, debug=True,
                        sde_step_indices=SDE_STEPS, return_latent_indices=sorted({*SDE_STEPS, *(k + 1 for k in SDE_STEPS)}))
        for prompt, m, seed in (("a red cube", 3, 0), ("two cats under a tree", 2, 10))
    ]
    trajectories = [runner.start(request) for request in requests]
    while not trajectories[0].done:
        runner.step(trajectories)
    samples = []
    for trajectory, request in zip(trajectories, requests):
        for result in runner.finish(trajectory).samples:
            sample = result.fill_sample(Sample(prompt=request.prompt), request, 0, None)
            sample.index = len(samples)
            samples.append(sample)
    return samples


def replay(tiny, samples, tile: int, micro_batch_size: int = 3, device: str = "cpu",
           **overrides) -> tuple[dict, DiffusionTrainer]:
    args, family, _ = tiny
    assert tile in (0, micro_batch_size)  # the batch_invariant group forwards in micro-batch tiles
    config = tiny_trainer_config(
        args.model.hf_checkpoint, diffusion_debug_mode=True, debug_skip_optimizer_step=True, micro_batch_size=micro_batch_size,
        rollout_patch_group=["batch_invariant" if tile else "none"], diffusion_guidance_scale=GUIDANCE,
        diffusion_num_steps=STEPS, **overrides,
    )
    assert config.sampling.parity_forward_tile == tile
    trainer = DiffusionTrainer(config, family, device=device)
    trainer.init()
    return trainer.train(0, samples), trainer


def test_rollout_and_training_agree_bitwise_with_mixed_requests(tiny):
    args, family, pipe = tiny
    samples = rollout(family, pipe, args.model.hf_checkpoint, tile=3)
    metrics, _ = replay(tiny, samples, tile=3)
    assert metrics["train/model_output_max_abs_diff"] == 0.0
    assert metrics["train/log_prob_mean_abs_diff"] == 0.0
    assert metrics["train/clipfrac"] == 0.0 and metrics["train/approx_kl"] == 0.0


def test_bf16_engine_and_bf16_trainer_agree_bitwise(tiny):
    """The engine holds its pipeline in bf16 (buffers included); the trainer casts fp32 masters and its buffers."""
    args, family, _ = tiny
    pipe = family.load_pipeline(args.model.hf_checkpoint, torch.bfloat16)
    samples = rollout(family, pipe, args.model.hf_checkpoint, tile=3, dtype="bf16")
    metrics, _ = replay(tiny, samples, tile=3, diffusion_forward_dtype="bf16")
    assert metrics["train/model_output_max_abs_diff"] == 0.0
    assert metrics["train/log_prob_mean_abs_diff"] == 0.0


def test_without_the_group_batching_changes_the_numbers(tiny):
    """The control: engine batches of 5 against trainer micro-batches of 1 do not agree bit for bit."""
    args, family, pipe = tiny
    samples = rollout(family, pipe, args.model.hf_checkpoint, tile=0)
    metrics, _ = replay(tiny, samples, tile=0, micro_batch_size=1)
    if metrics["train/model_output_max_abs_diff"] == 0.0 and _gemm_rows_ignore_the_batch():
        pytest.skip("this CPU's GEMM gives a row the same bits at every batch size (one thread): batching changes "
                    "nothing here for the group to remove")
    assert metrics["train/model_output_max_abs_diff"] > 0.0


def _gemm_rows_ignore_the_batch() -> bool:
    """Whether `F.linear` on 5 samples' rows equals it on each sample's rows alone, at the tiny models' widths."""
    generator = torch.Generator().manual_seed(0)
    for rows, width, out in ((16, 32, 32), (16, 32, 128), (24, 64, 64), (20, 64, 256)):
        x = torch.randn(5 * rows, width, generator=generator)
        weight = torch.randn(out, width, generator=generator)
        alone = torch.cat([torch.nn.functional.linear(part, weight) for part in x.split(rows)])
        if not torch.equal(torch.nn.functional.linear(x, weight), alone):
            return False
    return True


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_lora_trainer_matches_an_engine_running_merged_weights(tiny, dtype):
    """The trainer forms W' once per optimizer step (`lora_merged_once`, one rank); in bf16 from fp32 masters."""
    args, family, pipe = tiny
    if dtype == "bf16":
        pipe = family.load_pipeline(args.model.hf_checkpoint, torch.bfloat16)
    _, trainer = replay(tiny, rollout(family, pipe, args.model.hf_checkpoint, tile=3, dtype=dtype), tile=3,
                        use_lora=True, diffusion_forward_dtype=dtype)
    assert trainer.merge_lora_once
    with torch.no_grad():  # a trained adapter: B != 0, so the merged weight differs from the base
        generator = torch.Generator().manual_seed(3)
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                local = param.to_local()
                local.copy_(torch.randn(local.shape, generator=generator) * 0.05)
    merged = {name: tensor.clone() for name, tensor in iter_named_tensors(trainer)}
    samples = rollout(family, pipe, args.model.hf_checkpoint, tile=3, weights=merged, dtype=dtype)
    metrics = trainer.train(1, samples)
    assert metrics["train/model_output_max_abs_diff"] == 0.0
    assert metrics["train/log_prob_mean_abs_diff"] == 0.0


# (family, tiny variant, size, frames): every family with a text-only task; wan2_2 in its one-transformer TI2V-5B
# layout (two experts need a micro-batch on one side of the boundary).
FAMILIES = [("sd3", None, 32, 1), ("flux", None, 32, 1), ("flux2", None, 32, 1), ("qwen_image", None, 32, 1),
            ("wan2_2", "ti2v_5b", 32, 5), ("ltx", None, 32, 5), ("cosmos3", None, 64, 1),
            ("hunyuan_video", None, 32, 5)]


@pytest.fixture(scope="module")
def family_checkpoint(tmp_path_factory):
    import os

    from miles.testing.make_tiny import build_tiny_pipeline

    root = os.environ.get("MILES_TINY_CACHE") or str(tmp_path_factory.mktemp("tiny-parity"))
    return lambda name, variant: build_tiny_pipeline(name, os.path.join(root, f"tiny-{name}-{variant or 'default'}"),
                                                     variant=variant)


def probe_family(family_checkpoint, name, variant, size, frames, dtype, device) -> dict:
    """The family's mixed-prompt engine rollout replayed by its trainer, both in `dtype` on `device`, group on."""
    from miles.testing.tiny_rollout import build_tiny_family

    checkpoint = family_checkpoint(name, variant)
    config = tiny_trainer_config(checkpoint, diffusion_height=size, diffusion_width=size,
                                 diffusion_output_num_frames=frames)
    family = build_tiny_family(config)
    pipe = family.load_pipeline(checkpoint, torch.bfloat16 if dtype == "bf16" else torch.float32).to(device)
    samples = rollout(family, pipe, checkpoint, tile=3, dtype=dtype, size=size, frames=frames, device=device)
    metrics, _ = replay((config, family, pipe), samples, tile=3, device=device, diffusion_forward_dtype=dtype,
                        diffusion_height=size, diffusion_width=size, diffusion_output_num_frames=frames)
    return metrics


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("name, variant, size, frames", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_every_family_is_bitwise_on_cpu(tiny, family_checkpoint, name, variant, size, frames, dtype):
    """bf16 covers the parameters diffusers keeps in fp32 at load (Wan's norms, Cosmos 3's time embedder), which
    the group casts on the engine as FSDP does on the trainer."""
    metrics = probe_family(family_checkpoint, name, variant, size, frames, dtype, "cpu")
    # flux in fp32 is the one documented exception (docs/sde-backends.md): velocity within 2.4e-7, log-prob ~4e-9
    near = (name, dtype) == ("flux", "fp32")
    assert metrics["train/model_output_max_abs_diff"] <= (1e-6 if near else 0.0)
    assert metrics["train/log_prob_mean_abs_diff"] <= (1e-8 if near else 0.0)
    assert metrics["train/clipfrac"] == 0.0 and metrics["train/approx_kl"] <= (1e-12 if near else 0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name, variant, size, frames", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_every_family_is_bitwise_in_bf16_on_gpu(tiny, family_checkpoint, name, variant, size, frames):
    """One pinned SDPA kernel per family (flash; memory-efficient where attention is masked)."""
    metrics = probe_family(family_checkpoint, name, variant, size, frames, "bf16", "cuda")
    assert metrics["train/model_output_max_abs_diff"] == 0.0
    assert metrics["train/log_prob_mean_abs_diff"] == 0.0


@pytest.mark.parametrize("name, variant, size, frames", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_a_family_that_declares_no_attention_mask_runs_under_the_flash_pin(
        tiny, family_checkpoint, monkeypatch, name, variant, size, frames):
    """The GPU pin (flash for bf16) forced onto CPU modules: diffusers' flash backend refuses a mask before any
    kernel runs, so a family that masks attention without declaring `attention_uses_mask` fails here, not only
    on a GPU (hunyuan_video did). Families that declare a mask get the memory-efficient kernel, CUDA-only."""
    from miles.backends.fsdp_utils import actor
    from miles.engine import patches
    from miles.models import batch_invariant
    from miles.models import get_family_class

    if get_family_class(name).attention_uses_mask:
        assert batch_invariant.parity_attention_backend(torch.bfloat16, get_family_class(name)) != "_native_flash"
        return
    pinned = []

    def pin_as_on_cuda(modules, dtype, device_type=None, family=None):
        pinned.append(batch_invariant.parity_attention_backend(dtype, family))
        batch_invariant.pin_attention(modules, dtype, "cuda", family=family)

    monkeypatch.setattr(patches, "pin_attention", pin_as_on_cuda)
    monkeypatch.setattr(actor, "pin_attention", pin_as_on_cuda)
    metrics = probe_family(family_checkpoint, name, variant, size, frames, "bf16", "cpu")
    assert pinned and set(pinned) == {"_native_flash"}
    assert metrics["train/model_output_max_abs_diff"] == 0.0


def test_the_pinned_attention_kernel_supports_what_the_family_calls():
    from types import SimpleNamespace

    from miles.models.batch_invariant import parity_attention_backend

    plain, masked, gqa = (SimpleNamespace(attention_uses_mask=m, attention_uses_gqa=g)
                          for m, g in ((False, False), (True, False), (False, True)))
    assert parity_attention_backend(torch.bfloat16, plain) == "_native_flash"
    assert parity_attention_backend(torch.bfloat16, masked) == "_native_efficient"  # flash takes no mask
    assert parity_attention_backend(torch.bfloat16, gqa) == "_native_flash"
    assert parity_attention_backend(torch.float32, plain) == "_native_efficient"  # flash has no fp32 kernel
    assert parity_attention_backend(torch.float32, gqa) == "_native_math"  # efficient has no grouped-query


def _lora_linear(dtype: torch.dtype) -> torch.nn.Module:
    from peft import LoraConfig, inject_adapter_in_model

    from miles.models.batch_invariant import patch_lora_layers

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12))
    model = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["0"]), model)
    model.requires_grad_(False)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.requires_grad_(True)
            param.data.normal_(0, 0.3)
    model[0].base_layer.to(dtype)
    assert patch_lora_layers(model) == 1
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_once_gives_the_per_forward_values_and_gradients(dtype):
    from miles.models.batch_invariant import lora_merged_once

    model = _lora_linear(dtype)
    x = torch.randn(5, 16, dtype=dtype)

    def run():
        out = model(x)
        out.float().square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        model.zero_grad(set_to_none=True)
        return out.detach(), grads

    per_forward, per_forward_grads = run()
    with lora_merged_once(model):
        assert model[0]._miles_merged_weight is not None
        once, once_grads = run()
    assert model[0]._miles_merged_weight is None  # freed on exit
    assert torch.equal(per_forward, once)
    assert all(torch.equal(a, b) for a, b in zip(per_forward_grads, once_grads))


def test_a_suspended_merge_sees_swapped_weights_and_comes_back():
    """What an EMA swap inside a window needs: the swapped weights' own W', then the window's W' again."""
    from miles.models.batch_invariant import lora_merge_suspended, lora_merged_once

    model = _lora_linear(torch.float32)
    x = torch.randn(3, 16)
    lora_b = model[0].lora_B["default"].weight
    with torch.no_grad(), lora_merged_once(model):
        before = model(x)
        saved = lora_b.clone()
        lora_b.mul_(2.0)  # "swap" in other weights
        with lora_merge_suspended(model):
            swapped = model(x)
        lora_b.copy_(saved)
        after = model(x)
        assert not torch.equal(before, swapped)
        assert torch.equal(before, after)
    with torch.no_grad():
        lora_b.mul_(2.0)
        assert torch.equal(model(x), swapped)  # the suspended forward formed the swapped weights' W'


def test_opaque_kernels_leave_the_lora_factors_to_the_compiler():
    """A merged-value LoRA layer's value goes through the opaque kernels; its A and B layers do not (their term
    is `lora - lora.detach()`, exactly 0 in the value), and the value and gradients are the eager ones."""
    from miles.models.opaque_kernels import install_opaque_kernels

    reference, model = _lora_linear(torch.float32), _lora_linear(torch.float32)
    assert install_opaque_kernels(model) == {"linear": 1, "layer_norm": 0, "rms_norm": 0, "lora": 1}  # + base layer
    for factor in (model[0].lora_A["default"], model[0].lora_B["default"]):
        assert "forward" not in vars(factor)  # the class's own forward, not an opaque one
    x = torch.randn(5, 16)
    outputs = []
    for net in (reference, model):
        out = net(x)
        out.square().sum().backward()
        outputs.append((out.detach(), [p.grad for p in net.parameters() if p.requires_grad]))
    assert torch.equal(outputs[0][0], outputs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(outputs[0][1], outputs[1][1]))


def test_a_rollout_gradient_engine_takes_cudnn_attention_on_hopper_only(monkeypatch):
    """Under --diffusion-rollout-gradient no trainer forward reproduces the engine's, so the engine may leave the
    parity pin for the fastest kernel: cuDNN's on Hopper where it runs, the pin everywhere else."""
    from types import SimpleNamespace

    from miles.models import batch_invariant

    plain, masked, gqa = (SimpleNamespace(attention_uses_mask=m, attention_uses_gqa=g)
                          for m, g in ((False, False), (True, False), (False, True)))
    gpu = torch.device("cuda", 0)
    capability = {"major": 9}
    runs = {"ok": True}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (capability["major"], 0))
    monkeypatch.setattr(batch_invariant, "cudnn_attention_runs", lambda device, dtype: runs["ok"])
    choose = batch_invariant.gradient_engine_attention_backend

    assert choose(torch.bfloat16, plain, gpu) == "_native_cudnn"
    assert choose(torch.float16, plain, gpu) == "_native_cudnn"
    assert choose(torch.float32, plain, gpu) is None  # cuDNN's attention is 16-bit
    assert choose(torch.bfloat16, masked, gpu) is None and choose(torch.bfloat16, gqa, gpu) is None
    assert choose(torch.bfloat16, plain, torch.device("cpu")) is None
    for other in (8, 10, 12):  # Ampere, Blackwell: flash is as fast or faster there
        capability["major"] = other
        assert choose(torch.bfloat16, plain, gpu) is None
    capability["major"], runs["ok"] = 9, False  # a cuDNN build that refuses the probe: the pin stays
    assert choose(torch.bfloat16, plain, gpu) is None


@pytest.fixture
def sdpa_priority():
    """The process-wide SDPA priority as it was before the test (an engine built in the test process sets it)."""
    before = torch._C._get_sdp_priority_order()
    yield before
    torch._C._set_sdp_priority_order(before)


def test_route_attention_puts_the_kernel_first_in_the_sdpa_priority(tiny_checkpoint, sdpa_priority):
    """SD3's joint-attention processors call PyTorch's SDPA themselves and ignore diffusers' backend setting, so
    a native backend's kernel goes first in the process's SDPA priority, which PyTorch's CUDA dispatcher follows
    (its CPU dispatcher takes flash where it can, whatever the order: the GPU case below shows the choice)."""
    from diffusers import DiffusionPipeline
    from torch.nn.attention import SDPBackend

    from miles.models.batch_invariant import route_attention

    transformer = DiffusionPipeline.from_pretrained(tiny_checkpoint("sd3")).transformer.eval()
    assert SDPBackend(sdpa_priority[0]).name == "FLASH_ATTENTION"  # PyTorch's default: cuDNN comes last
    route_attention({"transformer": transformer}, "_native_math")
    order = torch._C._get_sdp_priority_order()
    assert order[0] == int(SDPBackend.MATH) and sorted(order) == sorted(sdpa_priority)
    route_attention({"transformer": transformer}, "native")  # diffusers' default backend: no kernel of its own
    assert torch._C._get_sdp_priority_order() == order


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_kernel_put_first_is_the_one_that_runs(sdpa_priority):
    """SD3's processors follow the SDPA priority: the kernel `prefer_sdpa_kernel` puts first is the one PyTorch's
    CUDA dispatcher chooses, at SD3.5-Medium's 64-wide heads and at a 128-wide head's shapes (unrouted, on an H100
    with torch 2.11 it chooses cuDNN for the first and flash for the second)."""
    from torch.nn.attention import SDPBackend

    from miles.models.batch_invariant import gradient_engine_attention_backend, prefer_sdpa_kernel

    device = torch.device("cuda", 0)
    kernels = ["FLASH_ATTENTION"]
    if gradient_engine_attention_backend(torch.bfloat16, None, device):
        kernels.append("CUDNN_ATTENTION")
    for shape in ((2, 24, 1357, 64), (2, 24, 4608, 128)):
        q = torch.randn(*shape, device=device, dtype=torch.bfloat16)
        for kernel in kernels:
            prefer_sdpa_kernel(kernel)
            assert SDPBackend(torch._fused_sdp_choice(q, q, q)).name == kernel


def test_a_rollout_gradient_engine_sets_the_chosen_kernel_unless_told_one(tiny_checkpoint, monkeypatch, sdpa_priority):
    """The wiring: an engine started for --diffusion-rollout-gradient asks for its kernel (here as if on a Hopper
    GPU, where the answer is cuDNN's) and sets it on every attention; an engine without the flag does not ask, and
    --sglang-attention-backend wins over the choice."""
    from torch.nn.attention import SDPBackend

    from miles.engine import model_runner
    from miles.engine.server_args import ServerArgs

    asked = []
    monkeypatch.setattr(model_runner, "gradient_engine_attention_backend",
                        lambda dtype, family, device: asked.append(device) or "_native_cudnn")

    def first_kernel(**extra) -> str:
        torch._C._set_sdp_priority_order(sdpa_priority)
        ModelRunner(ServerArgs(model_path=tiny_checkpoint("sd3"), model_family="sd3", device="cpu", dtype="fp32",
                               generator_device="cpu", **extra))
        return SDPBackend(torch._C._get_sdp_priority_order()[0]).name  # what SD3's processors follow

    assert first_kernel(rollout_gradient_tile=2) == "CUDNN_ATTENTION" and len(asked) == 1
    assert first_kernel() == "FLASH_ATTENTION" and len(asked) == 1  # PyTorch's default, untouched
    assert first_kernel(rollout_gradient_tile=2, attention_backend="_native_math") == "MATH" and len(asked) == 1
