"""SFT data (`--loss-type sft_loss`): caption + image/video rows, encoded once into cached latents.

SFT JSONL: one JSON object per line with the caption under `--input-key` and the media path under
`image` or `video` (exactly one). Relative paths resolve against the JSONL file's folder. Supported media:
- `image`: any file PIL opens (converted to RGB);
- `video`: a folder of frame images (sorted by file name), or a file PIL reads frame by frame (GIF,
  animated WebP/PNG, multi-page TIFF). Other containers (mp4, ...) are not read: extract frames first.
Frames are strided by `--sft-frame-stride` (and cut to `--diffusion-output-num-frames` for video
families), resized to cover `--diffusion-height/width` and center-cropped (docs/algorithms.md §7).

Encoding: the family's text encoders (`encode_prompt`, conditional only, §7) and its VAE through
`family.encode_images(pipe, pixels, shape)` (the inverse of the family's `decode`: the posterior mean,
normalised and packed like the family's own latents), from `--sft-encoder-checkpoint` when given, else
`--hf-checkpoint`. Each row's encoding is cached as one file in a folder keyed by the
settings (family, size, stride, frames, encoder checkpoint); the file name hashes the row and its media's
size and modification time, so an epoch (or a rerun) does not re-encode and an edited row is re-encoded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from miles.config.rollout_sections import SftDataConfig
from miles.config.sections import RunConfig
from miles.models.base import GenerationShape
from miles.rollout.jsonl import decoded_lines, json_object
from miles.types import GuidanceConfig, Sample
from miles.utils.errors import MilesUserError
from miles.utils.progress import progress_bar
from miles.utils.safe_load import load_plain

logger = logging.getLogger(__name__)

MEDIA_KEYS = ("image", "video")
# 2: the cache key holds --diffusion-fps, and cosmos3's `encoded_shape` holds the fps (it enters the prompt).
CACHE_FORMAT_VERSION = 2
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif")


@dataclass
class SftRow:
    caption: str
    media_path: str
    media_kind: str  # "image" or "video"
    line: int
    raw: str  # the JSONL line, part of the cache key


def load_sft_rows(path: str, caption_key: str = "input") -> list[SftRow]:
    """Read and check an SFT JSONL file (errors name the file and line)."""
    if not os.path.isfile(path):
        raise MilesUserError(f"SFT data file {path!r} does not exist")
    folder = os.path.dirname(os.path.abspath(path))
    rows: list[SftRow] = []
    for line_number, where, line in decoded_lines(path, ""):
        record = json_object(where, line)
        caption = record.get(caption_key)
        if not isinstance(caption, str) or not caption.strip():
            raise MilesUserError(f"{where}: needs a non-empty caption string under {caption_key!r} (--input-key)")
        kinds = [key for key in MEDIA_KEYS if key in record]
        if len(kinds) != 1:
            raise MilesUserError(f"{where}: needs exactly one of the keys {list(MEDIA_KEYS)}, got {sorted(record)}")
        kind = kinds[0]
        media = record[kind]
        if not isinstance(media, str) or not media:
            raise MilesUserError(f"{where}: {kind!r} must be a path string")
        media_path = media if os.path.isabs(media) else os.path.join(folder, media)
        if not os.path.exists(media_path):
            raise MilesUserError(f"{where}: {kind} {media_path!r} does not exist")
        rows.append(SftRow(caption=caption, media_path=media_path, media_kind=kind, line=line_number, raw=line.strip()))
    if not rows:
        raise MilesUserError(f"SFT data file {path!r} holds no rows")
    return rows


def _read_all_frames(row: SftRow, where: str) -> list[np.ndarray]:
    from PIL import Image, ImageSequence

    try:
        if os.path.isdir(row.media_path):
            names = sorted(name for name in os.listdir(row.media_path) if name.lower().endswith(IMAGE_SUFFIXES))
            if not names:
                raise MilesUserError(f"{where}: video folder {row.media_path!r} holds no frame images")
            return [np.asarray(Image.open(os.path.join(row.media_path, name)).convert("RGB")) for name in names]
        with Image.open(row.media_path) as image:
            if row.media_kind == "image":
                return [np.asarray(image.convert("RGB"))]
            return [np.asarray(frame.convert("RGB")) for frame in ImageSequence.Iterator(image)]
    except MilesUserError:
        raise
    except Exception as err:
        raise MilesUserError(
            f"{where}: cannot read {row.media_kind} {row.media_path!r} ({err}); videos must be frame folders or "
            "files PIL reads frame by frame (GIF, animated WebP/PNG, TIFF)"
        ) from err


def center_crop(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resize (bicubic) so the frame covers height × width, then cut the center."""
    from PIL import Image

    source_h, source_w = frame.shape[:2]
    scale = max(height / source_h, width / source_w)
    resized_h, resized_w = max(height, round(source_h * scale)), max(width, round(source_w * scale))
    image = Image.fromarray(frame)
    if (resized_h, resized_w) != (source_h, source_w):
        image = image.resize((resized_w, resized_h), Image.BICUBIC)
    top, left = (resized_h - height) // 2, (resized_w - width) // 2
    return np.array(image.crop((left, top, left + width, top + height)))  # a writable copy


def read_frames(row: SftRow, height: int, width: int, frame_stride: int = 1, num_frames: int | None = None) -> np.ndarray:
    """uint8 [F, height, width, 3]: frames strided by `frame_stride`, cut to `num_frames`, center-cropped."""
    where = f"line {row.line}"
    frames = _read_all_frames(row, where)[:: max(1, frame_stride)]
    if num_frames is not None and num_frames > 1:
        if len(frames) < num_frames:
            raise MilesUserError(
                f"{where}: video {row.media_path!r} has {len(frames)} frames after --sft-frame-stride {frame_stride}; "
                f"--diffusion-output-num-frames asks for {num_frames}"
            )
        frames = frames[:num_frames]
    return np.stack([center_crop(frame, height, width) for frame in frames])


def _file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def _media_stamp(path: str) -> str:
    if os.path.isdir(path):
        entries = sorted(os.listdir(path))
        return json.dumps([(name, os.path.getsize(os.path.join(path, name)), os.path.getmtime(os.path.join(path, name))) for name in entries])
    return f"{os.path.getsize(path)}:{os.path.getmtime(path)}"


def _hash(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _writable(folder: str) -> bool:
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK)


def sft_cache_folder(settings: SftDataConfig, data_path: str, family_name: str, encoder_path: str) -> str:
    """`<cache root>/<hash of the data file and the encoding settings>`."""
    root = settings.sft_cache_dir or os.path.join(os.path.dirname(os.path.abspath(data_path)), ".miles_sft_cache")
    if not settings.sft_cache_dir and not _writable(root):
        fallback = os.path.join(os.path.expanduser("~"), ".cache", "miles", "sft_cache")
        logger.warning("SFT cache: %s is not writable; caching under %s instead", root, fallback)
        root = fallback
    key = _hash(
        CACHE_FORMAT_VERSION,
        _file_digest(data_path),
        family_name,
        os.path.abspath(encoder_path) if os.path.exists(encoder_path) else encoder_path,
        settings.diffusion_height,
        settings.diffusion_width,
        settings.sft_frame_stride,
        settings.diffusion_output_num_frames,
        settings.diffusion_fps,
    )
    return os.path.join(root, key)


def load_encoder_pipeline(family: Any, path: str, dtype: torch.dtype, device: str | torch.device) -> Any:
    """The family's pipeline without its denoiser(s) when it is a plain diffusers family (encoders only)."""
    if hasattr(family, "pipeline_class") and getattr(family, "model_backend", None) is None:
        skip = {name: None for name in family.trainable_modules}
        try:
            pipe = family.pipeline_class().from_pretrained(path, dtype=dtype, **skip, **family.pipeline_from_pretrained_kwargs())
        except Exception as err:
            raise MilesUserError(f"SFT encoders: cannot load the pipeline at {path!r} (--sft-encoder-checkpoint / --hf-checkpoint): {err}") from err
        pipe.to(device)
        family.configure_pipeline(pipe)
        return pipe
    return family.load_pipeline(path, dtype, device)


def build_sft_samples(
    settings: SftDataConfig,
    family: Any | None = None,
    pipe: Any | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    batch_size: int = 8,
) -> list[Sample]:
    """Every row of `--prompt-data` as a Sample with `clean_latents` and `conditioning`, from the cache when
    possible. `family`/`pipe` default to the run's family and its encoders."""
    from miles.models.common import build_train_pipeline_config, conditioning_unbatch

    data_path = settings.prompt_data
    if not data_path:
        raise MilesUserError("--loss-type sft_loss needs --prompt-data (an SFT JSONL of captions and image/video paths)")
    rows = load_sft_rows(data_path, settings.input_key)
    family = family or build_train_pipeline_config(**settings.family_source)
    encoder_path = settings.sft_encoder_checkpoint or settings.hf_checkpoint
    folder = sft_cache_folder(settings, data_path, getattr(family, "family", type(family).__name__), encoder_path)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        raise MilesUserError(f"SFT cache: cannot create {folder!r}: {err}") from err
    row_files = [os.path.join(folder, f"{_hash(row.raw, _media_stamp(row.media_path))}.pt") for row in rows]
    missing = [i for i, file in enumerate(row_files) if not os.path.exists(file)]
    if missing:
        logger.info("SFT: encoding %d of %d rows into %s", len(missing), len(rows), folder)
        pipe = pipe or load_encoder_pipeline(family, encoder_path, dtype, device)
        num_frames = settings.diffusion_output_num_frames if getattr(family, "is_video", False) else None
        shape = GenerationShape(
            height=settings.diffusion_height,
            width=settings.diffusion_width,
            num_frames=num_frames or 1,
            fps=settings.diffusion_fps,  # as the trainer's shape: Cosmos 3 writes it into the prompt
        )
        stride = settings.sft_frame_stride
        bar = progress_bar(len(missing), "SFT: encoding rows", unit="row")
        for start in range(0, len(missing), batch_size):
            chunk = missing[start : start + batch_size]
            pixels = torch.from_numpy(
                np.stack([read_frames(rows[i], settings.diffusion_height, settings.diffusion_width, stride, num_frames)
                          for i in chunk])
            )
            try:
                latents = family.encode_images(pipe, pixels, shape)
            except RuntimeError as err:  # e.g. mixed frame counts or a size the VAE cannot take
                raise MilesUserError(f"{data_path}: encoding lines {[rows[i].line for i in chunk]} failed: {err}") from err
            captions = [rows[i].caption for i in chunk]
            conditioning = family.encode_prompt(pipe, captions, None, GuidanceConfig(guidance_scale=1.0), shape=shape)
            for i, latent, cond in zip(chunk, latents, conditioning_unbatch(conditioning)):
                record = {
                    "clean_latents": latent.detach().cpu().contiguous(),
                    "conditioning": {key: value.detach().cpu().contiguous() for key, value in cond.items()},
                }
                temporary = row_files[i] + ".tmp"
                torch.save(record, temporary)
                os.replace(temporary, row_files[i])  # atomic: a crash never leaves a half-written cache entry
            bar.update(len(chunk))
        bar.close()
    samples = []
    for index, (row, file) in enumerate(zip(rows, row_files)):
        # A damaged entry is one line naming the file; deleting it makes the next run encode that row again.
        record = load_plain(file, f"SFT cache of {data_path}:{row.line} (--sft-cache-dir; delete the file to re-encode)")
        samples.append(
            Sample(
                prompt=row.caption,
                index=index,
                group_index=index,
                metadata={"source": data_path, "line": row.line, "media": row.media_path},
                clean_latents=record["clean_latents"],
                conditioning=record["conditioning"],
            )
        )
    return samples


class SftDataSource:
    """Epochs over the encoded SFT samples in a seeded permutation per epoch (`--rollout-seed` + epoch), with
    the position in `state_dict()` for resume — the same contract as the rollout data source."""

    def __init__(self, settings: SftDataConfig, samples: Sequence[Sample]):
        if not samples:
            raise MilesUserError("SFT data: no samples")
        self.samples = list(samples)
        # Samples per rollout, as in RL: --rollout-batch-size × --n-samples-per-prompt (1 for SFT, usually).
        self.batch_size = settings.rollout_batch_size * settings.n_samples_per_prompt
        self.seed = settings.rollout_seed
        self.epoch = 0
        self.offset = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.samples), generator=generator).tolist()

    def get_samples(self, num_samples: int) -> list[Sample]:
        batch = []
        while len(batch) < num_samples:
            if self.offset == len(self.samples):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            batch.append(self.samples[self._order[self.offset]])
            self.offset += 1
        return batch

    def next_batch(self, rollout_id: int | None = None) -> list[Sample]:
        """The next `batch_size` samples as fresh copies (the trainer may annotate them), indexed 0..B−1."""
        batch = [dataclasses.replace(sample, index=position) for position, sample in enumerate(self.get_samples(self.batch_size))]
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "num_samples": len(self.samples)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), min(int(state["offset"]), len(self.samples))
        self._order = self._epoch_order(self.epoch)

    def __len__(self) -> int:
        return len(self.samples)


def build_sft_dataset(config: RunConfig) -> SftDataSource:
    """Encode (or read from the cache) every SFT row, then serve them epoch by epoch (`next_batch`).

    Encodes in this process on its GPU when it has one (in `--diffusion-forward-dtype` there, fp32 on CPU);
    the encoder pipeline is freed once the cache is complete.
    """
    from miles.models.common import parse_dtype

    device = "cuda" if torch.cuda.is_available() else "cpu"
    settings = config.sft_data
    dtype = parse_dtype(settings.diffusion_forward_dtype) if device == "cuda" else torch.float32
    samples = build_sft_samples(settings, device=device, dtype=dtype, batch_size=settings.sft_encode_batch_size)
    if device == "cuda":
        torch.cuda.empty_cache()
    return SftDataSource(settings, samples)
