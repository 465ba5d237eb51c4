"""miles: RL post-training for image and video diffusion models."""

__version__ = "0.1.0"

import logging as _logging

# Without torchvision (not a dependency) transformers falls back to its PIL image processors, which miles uses on
# purpose, and says so in a warning once per process (each trainer rank, engine and reward worker): only errors of
# that import machinery are worth a line.
_logging.getLogger("transformers.utils.import_utils").setLevel(_logging.ERROR)
