"""Input images of prompt rows (`"image": path` in a JSONL prompt file, docs/data.md): checked, read, resized.

The rollout reads a group's image once, converts it to RGB and resizes it to the run's output size
(`--diffusion-height/width`, Lanczos, as diffusers' `VaeImageProcessor.resize` does), then sends the raw pixels
in each of the group's requests (`protocol.ConditionImage`). Every sample of a batch therefore carries
conditioning of one shape, and the engine never decodes an image file a client sent.
"""

from __future__ import annotations

import numpy as np
import torch

from miles.engine.protocol import ConditionImage
from miles.utils.errors import MilesUserError


def _open_rgb(path: str, where: str):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB")  # decodes the whole file: a truncated one fails here, not in a rollout
    except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as err:
        raise MilesUserError(f"{where}: input image {path!r} cannot be read as an image ({err})") from None


def check_image_file(path: str, where: str) -> None:
    """A one-line MilesUserError naming `where` (flag file:line) and the path unless the file decodes as an image."""
    _open_rgb(path, where)


def load_condition_image(path: str, height: int, width: int, where: str = "prompt row") -> ConditionImage:
    """The image at `path` as RGB pixels of the output size `height` x `width`."""
    from PIL import Image

    image = _open_rgb(path, where)
    if image.size != (width, height):
        image = image.resize((width, height), resample=Image.LANCZOS)
    return ConditionImage.from_tensor(torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()))
