"""Video samples as real video files: H.264 MP4 through PyAV (the `av` package, FFmpeg's libraries).

`write_video(frames, path, fps)` encodes uint8 [F, H, W, 3] frames; odd sizes are padded by one black pixel
(H.264's 4:2:0 needs even ones). Without PyAV installed it returns None and the run says once how to install it
(`pip install av`, in requirements.txt and the `video` extra); the grids still show each video's first frame.
"""

from __future__ import annotations

import logging
import os

import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_FPS = 8
_missing_reported = False


def write_video(frames: np.ndarray, path: str, fps: float | None = None) -> str | None:
    """Encode `frames` (uint8 [F, H, W, 3]) to an MP4 at `path` (written whole, then renamed); returns the path."""
    global _missing_reported
    try:
        import av
    except ImportError:
        if not _missing_reported:
            logger.info("PyAV is not installed (pip install av): video samples are shown by their first frame only")
            _missing_reported = True
        return None
    frames = np.asarray(frames, dtype=np.uint8)
    _, height, width, _ = frames.shape
    padded = np.zeros((frames.shape[0], height + height % 2, width + width % 2, 3), dtype=np.uint8)
    padded[:, :height, :width] = frames
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temp = f"{path}.tmp.mp4"
    with av.open(temp, "w") as container:
        stream = container.add_stream("libx264", rate=int(round(fps or DEFAULT_FPS)))
        stream.width, stream.height, stream.pix_fmt = padded.shape[2], padded.shape[1], "yuv420p"
        for frame in padded:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())  # flush the encoder's delayed frames
    os.replace(temp, path)
    return path
