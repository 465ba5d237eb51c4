"""How fast the engine's VAE decode can be: SD3.5-Medium's decoder on a rollout's final latents, per layout and
compile mode, in one process.

    python bench/bench_vae_decode.py --device cuda                     # 32 images at 512², chunks of 8 and 32
    python bench/bench_vae_decode.py --device cpu --latent-size 8 --images 2 --chunks 1 --layers 1 --modes eager

Why: the documented LoRA iteration decodes its 32 images in ≈ 0.30 s of ≈ 9.6 s on an H100 (bench/RESULTS.md,
thirty-seventh section), on a device that is otherwise busy with the denoising steps, so a faster decode is time
off the iteration. The engine runs the decoder as the plain loop does: bf16, compiled whole
(`compile_vae_decoder`), in chunks of `--sglang-vae-decode-batch-size` (8), its activations in PyTorch's default
(contiguous, NCHW) layout. cuDNN's convolutions on Hopper are written for channels-last (NHWC) tensors; a
contiguous input is transposed around each of them. This times each layout with the decoder eager and compiled,
and says how far channels-last's pixels are from the default's (a convolution's other algorithm sums in another
order; the rewards read these pixels, the log-probs do not).

The decoder is diffusers' `AutoencoderKL` with SD3.5-Medium's config (random bf16 weights: speed does not depend on
values), decoding `x / scaling_factor + shift_factor` to uint8 pixels as the engine does
(miles/models/common.py). The floor is the decoder's FLOPs (counted by torch's FLOP counter) at the measured
dense bf16 matmul peak.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from bench.bench_e2e import measured_peak_tflops  # noqa: E402
from miles.models.common import decode_scaled_latents  # noqa: E402
from miles.testing.real_size import sd35_medium_vae_config, synchronize  # noqa: E402

LAYOUTS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


def build_vae(device: str, dtype: torch.dtype, layers: int | None, layout: str):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    with torch.device(device):
        vae = AutoencoderKL(**sd35_medium_vae_config(layers)).to(dtype).eval().requires_grad_(False)
    return vae.to(memory_format=LAYOUTS[layout])


def decode_all(vae, latents: torch.Tensor, chunk: int, layout: str) -> torch.Tensor:
    """The engine's decode: chunk by chunk, each to uint8 pixels."""
    pieces = []
    for lo in range(0, latents.shape[0], chunk):
        piece = latents[lo : lo + chunk].contiguous(memory_format=LAYOUTS[layout])
        pieces.append(decode_scaled_latents(vae, piece))
    return torch.cat(pieces)


def time_decode(vae, latents: torch.Tensor, chunk: int, layout: str, repeats: int,
                device: str) -> tuple[float, torch.Tensor]:
    """Best wall time of `repeats` decodes after two warm-ups (a compile, then a settled run)."""
    for _ in range(2):
        pixels = decode_all(vae, latents, chunk, layout)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        began = time.perf_counter()
        pixels = decode_all(vae, latents, chunk, layout)
        synchronize(device)
        best = min(best, time.perf_counter() - began)
    return best, pixels


def decoder_tflop(vae, latents: torch.Tensor) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        decode_scaled_latents(vae, latents[:1])
    return counter.get_total_flops() * latents.shape[0] / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--latent-size", type=int, default=64, help="latent side (512 px / 8)")
    parser.add_argument("--chunks", default="8,32", help="comma list of images per decode call")
    parser.add_argument("--modes", default="eager,compiled", help="comma list of eager, compiled")
    parser.add_argument("--layers", type=int, help="layers per decoder block (default: SD3.5-Medium's 2)")
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    dtype = torch.bfloat16 if opts.device == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(1)
    channels = sd35_medium_vae_config()["latent_channels"]
    latents = torch.randn(opts.images, channels, opts.latent_size, opts.latent_size, generator=generator)
    latents = latents.to(opts.device, dtype)
    peak = measured_peak_tflops(opts.device)
    chunks = [int(c) for c in opts.chunks.split(",")]
    print(f"device {torch.cuda.get_device_name() if opts.device == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"{opts.images} images from {opts.latent_size}² latents, {dtype}")
    rows, reference = [], None
    for mode in opts.modes.split(","):
        for layout in LAYOUTS:
            vae = build_vae(opts.device, dtype, opts.layers, layout)
            tflop = decoder_tflop(vae, latents)
            if mode == "compiled":
                vae.decoder.compile(dynamic=False)  # as the engine compiles it (miles/engine/model_runner.py)
            for chunk in chunks:
                seconds, pixels = time_decode(vae, latents, chunk, layout, opts.repeats, opts.device)
                reference = pixels if reference is None else reference
                differ = (pixels.int() - reference.int()).abs()
                rows.append((mode, layout, chunk, seconds, tflop, int(differ.max()),
                             float((differ > 0).float().mean())))
            del vae
    floor = rows[0][4] / peak
    print(f"floor: the decoder's {rows[0][4]:.3g} TFLOP at a measured {peak:.3g} TFLOP/s = {floor * 1e3:.1f} ms\n")
    print("| mode | layout | images per call | ms | ms per image | share of the floor | pixels unlike the first row "
          "(max, share) |")
    print("|---|---|---|---|---|---|---|")
    for mode, layout, chunk, seconds, _, most, share in rows:
        print(f"| {mode} | {layout} | {chunk} | {seconds * 1e3:.1f} | {seconds * 1e3 / opts.images:.2f} | "
              f"{floor / seconds:.0%} | {most}, {share:.2%} |")


if __name__ == "__main__":
    main()
