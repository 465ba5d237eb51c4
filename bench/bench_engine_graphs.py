"""How many graphs a compiled engine's `--diffusion-rollout-gradient` step makes dynamo trace, and for how long.

    python -m miles.testing.make_tiny --family sd3 --real-size --out /tmp/sd35m     # SD3.5-Medium's structure
    python bench/bench_engine_graphs.py --checkpoint /tmp/sd35m --backend eager     # dynamo's tracing only
    python bench/bench_engine_graphs.py --checkpoint /tmp/sd35m --backend aot_eager # + AOTAutograd's

One compiled engine (`ModelRunner`, fp32, on the CPU) with rank-32 factors on every LoRA target layer denoises one
sample in two steps, the first with the gradient (the tap of miles/engine/rollout_gradients.py) and the second
without. Each block is `.compile()`d as the engine does, but with `--backend`, so no code is generated and what is
timed is the tracing a launch repeats whatever its caches hold (dynamo's is never cached). Prints the graph count
and torch's compile-time counters. The count is what `N graphs compiled` in an engine's log says on a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="an sd3 pipeline folder (make_tiny --real-size)")
    parser.add_argument("--backend", default="eager", choices=("eager", "aot_eager", "inductor"))
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--rank", type=int, default=32)
    opts = parser.parse_args()

    compile_in_place = nn.Module.compile

    def compile_with_backend(self, *args, **kwargs):
        if opts.backend != "inductor":
            kwargs = {**kwargs, "backend": opts.backend, "mode": None}
        return compile_in_place(self, *args, **kwargs)

    nn.Module.compile = compile_with_backend  # the engine's `block.compile(...)`, with this backend

    from torch._dynamo.utils import calculate_time_spent, counters

    from miles.engine.model_runner import ModelRunner
    from miles.engine.protocol import GenerateRequest
    from miles.engine.server_args import ServerArgs
    from miles.models.sd3 import SD3_LORA_TARGETS
    from miles.testing.tiny_rollout import samples_through_the_engine
    from miles.types import GuidanceConfig

    runner = ModelRunner(ServerArgs(model_path=opts.checkpoint, device="cpu", dtype="fp32", generator_device="cpu",
                                    enable_torch_compile=True, rollout_gradient_tile=1))
    transformer = runner.modules["transformer"]
    generator = torch.Generator().manual_seed(0)
    layers = 0
    for name, layer in transformer.named_modules():
        if name.startswith("transformer_blocks") and name.endswith(SD3_LORA_TARGETS):
            a = 0.01 * torch.randn(opts.rank, layer.in_features, generator=generator)
            runner.rollout_gradients.set_factors("transformer", name, a, torch.zeros(layer.out_features, opts.rank),
                                                 1.0)
            layers += 1
    before = counters["stats"]["unique_graphs"]
    request = GenerateRequest(prompt="a cat", num_samples=1, seed=3, num_steps=2, height=opts.size, width=opts.size,
                              guidance=GuidanceConfig(guidance_scale=1.0), noise_level=0.9, sde_step_indices=[0],
                              rollout_gradient=True, return_images=False)
    began = time.perf_counter()
    samples_through_the_engine(runner, request)
    seconds = time.perf_counter() - began
    spent = {key: round(value, 1) for key, value in calculate_time_spent().items()}
    print(f"{len(transformer.transformer_blocks)} blocks, {layers} tapped layers, backend {opts.backend}: "
          f"{counters['stats']['unique_graphs'] - before} graphs; the two steps took {seconds:.1f} s; "
          f"compile counters (s) {spent}")


if __name__ == "__main__":
    main()
