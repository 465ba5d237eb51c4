"""Model families: one `TrainPipelineConfig` subclass per file, found by key or by checkpoint name.

`resolve_family_name` is the one place that maps a checkpoint to a family; `get_family` returns an instance.
"""

from __future__ import annotations

import importlib
import os

from miles.models.base import FAMILIES, GenerationShape, TrainPipelineConfig, register_family
from miles.utils.errors import MilesUserError

# family key -> module that defines it. Hints live here (not in the family modules) so that resolving a
# family name needs no heavy import.
FAMILY_MODULES: dict[str, str] = {
    "sd3": "miles.models.sd3",
    "flux": "miles.models.flux",
    "qwen_image": "miles.models.qwen_image",
    "wan2_2": "miles.models.wan2_2",
    "ltx": "miles.models.ltx",
    "cosmos3": "miles.models.cosmos3",
}

# Lowercased substrings of a checkpoint name, checked in order (more specific first).
FAMILY_NAME_HINTS: tuple[tuple[str, str], ...] = (
    ("qwen-image", "qwen_image"),
    ("qwen_image", "qwen_image"),
    ("qwenimage", "qwen_image"),
    ("wan2.2", "wan2_2"),
    ("wan2_2", "wan2_2"),
    ("wan2-2", "wan2_2"),
    ("wan22", "wan2_2"),
    ("cosmos3", "cosmos3"),
    ("cosmos-3", "cosmos3"),
    ("cosmos_3", "cosmos3"),
    ("ltx", "ltx"),
    ("flux", "flux"),
    ("stable-diffusion-3", "sd3"),
    ("sd3", "sd3"),
)

FAMILY_ENV_VAR = "MILES_DIFFUSION_MODEL_FAMILY"


def resolve_family_name(hf_checkpoint: str | None, family_flag: str | None) -> str:
    """`--diffusion-model-family`, else $MILES_DIFFUSION_MODEL_FAMILY, else a hint in the checkpoint name."""
    for source, value in (("--diffusion-model-family", family_flag), (FAMILY_ENV_VAR, os.environ.get(FAMILY_ENV_VAR))):
        if value:
            if value not in FAMILY_MODULES:
                raise MilesUserError(
                    f"{source} {value!r} is not a registered family; choose one of {sorted(FAMILY_MODULES)} "
                    "or pass --train-pipeline-config-path for your own"
                )
            return value
    name = (hf_checkpoint or "").rstrip("/").lower()
    for hint, family in FAMILY_NAME_HINTS:
        if hint in name:
            return family
    raise MilesUserError(
        f"cannot tell the model family of --hf-checkpoint {hf_checkpoint!r} from its name; "
        f"pass --diffusion-model-family (one of {sorted(FAMILY_MODULES)})"
    )


def get_family_class(name: str) -> type[TrainPipelineConfig]:
    if name not in FAMILIES:
        importlib.import_module(FAMILY_MODULES[name])
    return FAMILIES[name]


__all__ = [
    "FAMILIES",
    "FAMILY_MODULES",
    "FAMILY_NAME_HINTS",
    "GenerationShape",
    "TrainPipelineConfig",
    "get_family_class",
    "register_family",
    "resolve_family_name",
]
