"""What FP8 (e4m3) matmuls would do to the `shapes` base, measured before any FP8 engine exists (issue 26).

    python bench/bench_fp8_numerics.py                       # the shipped 32 px base on the CPU, about a minute
    python bench/bench_fp8_numerics.py --checkpoint .shapes-large --size 128 --device cuda   # the 128 px base

Every linear layer inside the DiT's transformer blocks runs through `torch._scaled_mm` the way Hopper's FP8
kernel would run it: the weight rounded to e4m3 with a scale per output row, the input rounded to e4m3 with a
scale per token, the products accumulated in fp32 and returned in bf16; everything else (embeddings, norms,
attention, the final layer, the text encoders and the VAE) in bf16. Against the same base in fp32, three tables:

1. the velocity's relative error, ‖v − v_fp32‖ / ‖v_fp32‖, on the fp32 trajectories of held-out prompts at every
   step, for the whole model in bf16 and for the FP8 blocks;
2. the held-out score (the eval's prompts and seeds, `miles.tasks.shapes.evaluate`) in fp32, bf16 and FP8;
3. how much of a LoRA update survives when it is merged into the weight and the sum is rounded (what the engine
   does today under `--diffusion-rollout-gradient`, in bf16): an adapter ΔW = B·A of rank 4 and relative size ρ =
   ‖ΔW‖ / ‖W‖ beside each block weight W, in bf16 and in e4m3 with the merged weight's own row scales: its
   survival ⟨round(W + ΔW) − round(W), ΔW⟩ / ‖ΔW‖² (1: the rounded weights move along ΔW by ΔW on average;
   0: the update is lost) and the error of the update as applied, ‖round(W + ΔW) − round(W) − ΔW‖ / ‖ΔW‖.

Nothing here changes how miles runs; docs/status.md says what an FP8 engine would need.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from miles.models.base import GenerationShape  # noqa: E402
from miles.tasks.shapes import PRETRAINED_SD3  # noqa: E402
from miles.tasks.shapes.data import write_prompt_files  # noqa: E402
from miles.tasks.shapes.evaluate import heldout_score, load_pipeline, read_scenes  # noqa: E402
from miles.testing.reference_loop import sample_reference  # noqa: E402
from miles.types import GuidanceConfig  # noqa: E402

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` [rows, k] as e4m3 with one fp32 scale per row (its largest magnitude maps to 448)."""
    scale = t.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def fp8_round(t: torch.Tensor) -> torch.Tensor:
    """`t` rounded to e4m3 with its own row scales, back in fp32."""
    quantized, scale = quantize_rows(t)
    return quantized.float() * scale


class Fp8Linear(nn.Module):
    """A linear layer whose matmul is `torch._scaled_mm` on e4m3 operands (row-wise scales), bf16 out."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight, scale = quantize_rows(linear.weight.detach())
        self.register_buffer("weight_fp8", weight)
        self.register_buffer("weight_scale", scale.reshape(1, -1).contiguous())  # [1, out]
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        quantized, scale = quantize_rows(rows)
        y = torch._scaled_mm(quantized, self.weight_fp8.t(), scale_a=scale, scale_b=self.weight_scale,
                             out_dtype=torch.bfloat16)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


def block_linears(transformer: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(owner, attribute, layer) of every nn.Linear inside the transformer blocks."""
    found = []
    for block in transformer.transformer_blocks:
        for owner in block.modules():
            for name, child in owner.named_children():
                if isinstance(child, nn.Linear):
                    found.append((owner, name, child))
    return found


def to_fp8_blocks(pipe) -> int:
    layers = block_linears(pipe.transformer)
    for owner, name, layer in layers:
        setattr(owner, name, Fp8Linear(layer))
    return len(layers)


@torch.no_grad()
def velocity_errors(family, pipes: dict, prompts: list[str], size: int, num_steps: int, device: str
                    ) -> dict[str, float]:
    """‖v − v_fp32‖ / ‖v_fp32‖ over every step of the fp32 trajectories of `prompts`."""
    shape, guidance = GenerationShape(size, size), GuidanceConfig(guidance_scale=1.0)
    reference = sample_reference(family, pipes["fp32"], prompts, seeds=list(range(len(prompts))), num_steps=num_steps,
                                 shape=shape, guidance=guidance, decode=False, generator_device=device)
    errors = {name: [0.0, 0.0] for name in pipes if name != "fp32"}
    conditioning = {name: family.encode_conditioning(pipe, prompts, None, guidance, shape=shape)
                    for name, pipe in pipes.items()}
    for k, latents in enumerate(reference.trajectory[:-1]):
        sigma = reference.sigmas[k].expand(len(prompts)).to(device)
        velocities = {}
        for name, pipe in pipes.items():
            dtype = torch.float32 if name == "fp32" else torch.bfloat16
            modules = {m: getattr(pipe, m) for m in family.trainable_modules}
            velocities[name] = family.predict_velocity(modules, latents.to(dtype), sigma, conditioning[name],
                                                       guidance, shape, dtype).float()
        for name in errors:
            errors[name][0] += float((velocities[name] - velocities["fp32"]).pow(2).sum())
            errors[name][1] += float(velocities["fp32"].pow(2).sum())
    return {name: (num / den) ** 0.5 for name, (num, den) in errors.items()}


def merge_survival(transformer: nn.Module, relative: float, generator: torch.Generator
                   ) -> dict[str, tuple[float, float]]:
    """A rank-4 adapter of relative size `relative` merged into every block weight and rounded: (survival, the
    error of the update as applied relative to the update, ‖round(W + ΔW) − round(W) − ΔW‖ / ‖ΔW‖)."""
    totals = {"bf16": [0.0, 0.0, 0.0], "e4m3": [0.0, 0.0, 0.0]}
    for _, _, layer in block_linears(transformer):
        weight = layer.weight.detach().float().cpu()
        a = torch.randn(4, weight.shape[1], generator=generator)
        b = torch.randn(weight.shape[0], 4, generator=generator)
        delta = b @ a
        delta *= relative * weight.norm() / delta.norm()
        for name, rounded in (("bf16", lambda t: t.to(torch.bfloat16).float()), ("e4m3", fp8_round)):
            moved = rounded(weight + delta) - rounded(weight)
            totals[name][0] += float((moved * delta).sum())
            totals[name][1] += float(delta.pow(2).sum())
            totals[name][2] += float((moved - delta).pow(2).sum())
    return {name: (along / size, (off / size) ** 0.5) for name, (along, size, off) in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=PRETRAINED_SD3)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--num-steps", type=int, default=8)
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--velocity-prompts", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="miles-fp8-") as data:
        scenes = read_scenes(write_prompt_files(data)[1])
    family, fp32 = load_pipeline(args.checkpoint, torch.float32)
    _, bf16 = load_pipeline(args.checkpoint, torch.bfloat16)
    _, fp8 = load_pipeline(args.checkpoint, torch.bfloat16)
    pipes = {"fp32": fp32.to(args.device), "bf16": bf16.to(args.device), "fp8": fp8.to(args.device)}
    layers = to_fp8_blocks(pipes["fp8"])
    print(f"{args.checkpoint}: {layers} linear layers of the blocks in FP8 (e4m3, row-wise scales), {args.device}")

    prompts = [prompt for prompt, _ in scenes[: args.velocity_prompts]]
    errors = velocity_errors(family, pipes, prompts, args.size, args.num_steps, args.device)
    print("\n| forward | velocity relative error against fp32 |\n|---|---|")
    for name, error in errors.items():
        print(f"| {'bf16 everywhere' if name == 'bf16' else 'FP8 blocks, bf16 elsewhere'} | {error:.4f} |")

    print(f"\n| forward | held-out correct | dense | ({len(scenes)} prompts × {args.samples_per_prompt}) |"
          "\n|---|---|---|---|")
    for name, pipe in pipes.items():
        dtype = torch.float32 if name == "fp32" else torch.bfloat16
        score = heldout_score(family, pipe, scenes, num_steps=args.num_steps, size=args.size, dtype=dtype,
                              samples_per_prompt=args.samples_per_prompt, generator_device=args.device)
        print(f"| {name} | {score.correct:.3f} | {score.dense:.3f} | |")

    print("\n| adapter size ρ = ‖ΔW‖/‖W‖ | bf16 merge: survival | its error | e4m3 merge: survival | its error |"
          "\n|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for relative in (1e-4, 1e-3, 1e-2, 1e-1):
        survival = merge_survival(pipes["fp32"].transformer, relative, generator)
        print(f"| {relative:g} | " + " | ".join(f"{kept:.3f} | {error:.2f}" for kept, error in survival.values()) + " |")
    print(f"\n{time.perf_counter() - began:.1f} s")


if __name__ == "__main__":
    main()
