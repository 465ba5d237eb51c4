"""miles: RL post-training for image and video diffusion models."""

__version__ = "0.1.0"
