"""The rollout engine's own settings.

`python -m miles.engine` builds its command line from this dataclass, and `train_diffusion.py`
re-registers every field not in `SET_BY_MILES` as `--sglang-<field-name>` (the reference's passthrough).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerArgs:
    # ---- set by miles for each engine it starts (not re-registered) --------------------------------
    model_path: str = field(default="", metadata={"help": "Diffusers pipeline folder or hub id to serve."})
    model_family: str | None = field(default=None, metadata={"help": "Registered family key (sd3, wan2_2, ...)."})
    train_pipeline_config_path: str | None = field(
        default=None, metadata={"help": "Dotted path of a user TrainPipelineConfig class."}
    )
    host: str = field(
        default="127.0.0.1",
        metadata={"help": "Address to bind. Loopback by default; anything wider exposes the engine to the network "
                  "(every request still needs the API key) and logs a warning."},
    )
    port: int = field(default=0, metadata={"help": "Port to bind; 0 picks a free one."})
    base_gpu_id: int = field(default=0, metadata={"help": "First GPU of this engine."})
    tp_size: int = field(default=1, metadata={"help": "GPUs of this engine."})
    random_seed: int = field(default=42, metadata={"help": "Seed of engine-side randomness that no request seeds."})
    dtype: str = field(default="bf16", metadata={"help": "DiT forward dtype: bf16, fp16 or fp32."})
    device: str = field(default="auto", metadata={"help": "cuda, cpu or auto."})
    generator_device: str = field(default="cuda", metadata={"help": "Device of the per-sample noise generators."})

    # ---- tunables, passed through as --sglang-<name> ------------------------------------------------
    max_batch_size: int = field(
        default=32, metadata={"help": "Most samples (before CFG doubling) in one batched DiT forward."}
    )
    batch_wait_ms: float = field(
        default=2.0,
        metadata={"help": "How long the batcher waits for concurrent requests to join a step (again while they keep "
                          "arriving, up to 20 times)."},
    )
    enable_torch_compile: bool = field(default=False, metadata={"help": "torch.compile the DiT forward."})
    torch_compile_mode: str = field(default="default", metadata={"help": "torch.compile mode."})
    attention_backend: str | None = field(
        default=None, metadata={"help": "diffusers set_attention_backend value for the engine's DiT."}
    )
    vae_decode_batch_size: int = field(default=8, metadata={"help": "Samples per VAE decode call."})
    log_level: str = field(default="info", metadata={"help": "Engine log level."})
    # ---- appended by the engine engineer ---------------------------------------------------------------------
    model_backend_path: str | None = field(
        default=None, metadata={"help": "--model-backend-path: user fn(path, dtype) -> pipeline replacing the loader."}
    )
    pipeline_builder_path: str | None = field(
        default=None,
        metadata={"help": "Dotted path of fn(server_args) -> (family, pipeline); replaces loading (benchmarks, tests)."},
    )
    rollout_patch_group: str | None = field(
        default=None, metadata={"help": "--rollout-patch-group: comma-separated numeric-parity patch groups."}
    )
    forward_tile: int = field(
        default=0,
        metadata={"help": "Run every DiT forward on exactly this many samples (the batch_invariant group; 0: off)."},
    )
    rollout_gradient_tile: int = field(
        default=0,
        metadata={"help": "--diffusion-rollout-gradient: keep the LoRA pairs the trainer pushes, so requests may ask "
                  "for each sample's gradient, taken this many samples per forward (the trainer's micro-batch; "
                  "0: off; miles/engine/rollout_gradients.py)."},
    )
    release_buffers_ahead: bool = field(
        default=False,
        metadata={"help": "Pin the host buffers that release_memory_occupation copies the weights into right after "
                  "loading, on a thread of its own (colocated runs on GPUs, whose first iteration always releases; "
                  "the trainer's start-up overlaps it)."},
    )
    url_file: str | None = field(default=None, metadata={"help": "Write the bound URL to this file once serving."})
    sde_step_backend_path: str | None = field(
        default=None,
        metadata={"help": "--sde-step-backend-path: dotted path of the SdeStepBackend subclass for SDE steps (requests "
                  "cannot name one)."},
    )
    # ---- limits on what one request may ask (a request beyond them is a 400) ------------------------------
    max_samples_per_request: int = field(default=64, metadata={"help": "Most samples in one generate request."})
    max_num_steps: int = field(default=1000, metadata={"help": "Most denoising steps in one generate request."})
    max_image_size: int = field(default=4096, metadata={"help": "Largest height or width (pixels) of a request."})
    max_num_frames: int = field(default=1024, metadata={"help": "Most video frames in one generate request."})
    max_request_bytes: int = field(
        default=16 << 20, metadata={"help": "Largest HTTP request body in bytes (larger bodies get 413)."}
    )
    max_request_pixel_steps: int = field(
        default=1 << 42,
        metadata={"help": "Most samples x steps x height x width x frames in one generate request."},
    )
    max_response_bytes: int = field(
        default=4 << 30, metadata={"help": "Most bytes one generate answer may carry (images and latents)."}
    )
    max_queued_requests: int = field(
        default=256,
        metadata={"help": "Most generate requests admitted at once (running or waiting); more get 503 with "
                  "Retry-After, and miles' rollout client retries them."},
    )
    # ---- connections (miles.utils.http_guard) -------------------------------------------------------------------
    connection_read_timeout: float = field(
        default=30.0,
        metadata={"help": "Seconds a new connection has to send a complete request head, and then its body; a "
                  "slower one is closed (a kept-alive connection has 75 s between requests)."},
    )
    max_connections: int = field(
        default=1024,
        metadata={"help": "Most open client connections (lowered to what the file limit allows); more get 503."},
    )
    ulysses_degree: int = field(
        default=0,
        metadata={"help": "How an engine of N > 1 GPUs (--rollout-num-gpus-per-engine) splits its forwards: N = "
                  "sequence parallel (Ulysses) over all N processes, 1 = CFG-parallel (N = 2: the two CFG branches "
                  "on two processes), 0 = auto (CFG-parallel when N = 2 and the family's CFG splits into two "
                  "forwards, sequence parallel otherwise)."},
    )
    crash_after_requests: int = field(
        default=0,
        metadata={"help": "Fault-injection drill: the process dies abruptly when its N-th generate request arrives "
                  "(0 = never)."},
    )
    crash_after_answers: int = field(
        default=0,
        metadata={"help": "Fault-injection drill: the process dies abruptly a moment after it answered its N-th "
                  "generate request, i.e. outside generation (while the trainer trains; 0 = never)."},
    )


# Fields miles fills in itself for every engine; they are not re-registered with the --sglang- prefix.
SET_BY_MILES = frozenset(
    {
        "model_path",
        "model_family",
        "train_pipeline_config_path",
        "host",
        "port",
        "base_gpu_id",
        "tp_size",
        "random_seed",
        "dtype",
        "device",
        "generator_device",
    }
)


# appended by the engine engineer: the new fields miles sets itself
SET_BY_MILES = SET_BY_MILES | {
    "model_backend_path", "pipeline_builder_path", "rollout_patch_group", "forward_tile", "url_file",
    "sde_step_backend_path", "rollout_gradient_tile", "release_buffers_ahead",
}
