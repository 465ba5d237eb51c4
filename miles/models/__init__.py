"""Model families: one `TrainPipelineConfig` subclass per file, found by key, by the checkpoint's pipeline class
or by its name.

`resolve_family_name` is the one place that maps a checkpoint to a family; `get_family` returns an instance.
"""

from __future__ import annotations

import importlib
import json
import os

from miles.models.base import FAMILIES, GenerationShape, TrainPipelineConfig, register_family
from miles.utils.errors import MilesUserError

# family key -> module that defines it. Hints live here (not in the family modules) so that resolving a
# family name needs no heavy import.
FAMILY_MODULES: dict[str, str] = {
    "sd3": "miles.models.sd3",
    "flux": "miles.models.flux",
    "flux_kontext": "miles.models.flux_kontext",
    "flux2": "miles.models.flux2",
    "qwen_image": "miles.models.qwen_image",
    "qwen_image_edit": "miles.models.qwen_image_edit",
    "wan2_2": "miles.models.wan2_2",
    "ltx": "miles.models.ltx",
    "cosmos3": "miles.models.cosmos3",
    "hunyuan_video": "miles.models.hunyuan_video",
}

# The diffusers pipeline class a local checkpoint's model_index.json names (`_class_name`) -> family key; each
# family's `pipeline_class_name`. A folder of another class (e.g. WanImageToVideoPipeline) falls through to the
# name hints, and the family it selects refuses it with its own message.
FAMILY_PIPELINE_CLASSES: dict[str, str] = {
    "StableDiffusion3Pipeline": "sd3",
    "FluxPipeline": "flux",
    "FluxKontextPipeline": "flux_kontext",  # FLUX.1-Kontext image editing: every prompt row carries an image
    "Flux2Pipeline": "flux2",
    "QwenImagePipeline": "qwen_image",
    "QwenImageEditPipeline": "qwen_image_edit",  # image editing: every prompt row carries an image
    "WanPipeline": "wan2_2",  # Wan 2.1 T2V and Wan 2.2: one pipeline class, one family
    "LTXPipeline": "ltx",
    "LTX2Pipeline": "ltx",  # LTX-2: the ltx family reads the generation from the same class name
    "LTX2ImageToVideoPipeline": "ltx",  # LTX-2 saved for image-to-video: the same components
    "Cosmos3OmniPipeline": "cosmos3",
    "HunyuanVideo15Pipeline": "hunyuan_video",
}

# Lowercased substrings of a checkpoint name, checked in order (more specific first).
FAMILY_NAME_HINTS: tuple[tuple[str, str], ...] = (
    ("qwen-image-edit", "qwen_image_edit"),  # before "qwen-image": Qwen-Image-Edit names contain it
    ("qwen_image_edit", "qwen_image_edit"),
    ("qwenimageedit", "qwen_image_edit"),
    ("qwen-image", "qwen_image"),
    ("qwen_image", "qwen_image"),
    ("qwenimage", "qwen_image"),
    ("wan2.2", "wan2_2"),
    ("wan2_2", "wan2_2"),
    ("wan2-2", "wan2_2"),
    ("wan22", "wan2_2"),
    ("wan2.1", "wan2_2"),  # Wan 2.1 T2V (1.3B, 14B) is the wan2_2 family's single-expert layout
    ("wan2_1", "wan2_2"),
    ("wan2-1", "wan2_2"),
    ("wan21", "wan2_2"),
    ("cosmos3", "cosmos3"),
    ("cosmos-3", "cosmos3"),
    ("cosmos_3", "cosmos3"),
    ("ltx", "ltx"),
    ("hunyuanvideo", "hunyuan_video"),  # HunyuanVideo-1.5 (the family refuses other Hunyuan pipelines)
    ("hunyuan_video", "hunyuan_video"),
    ("hunyuan-video", "hunyuan_video"),
    ("kontext", "flux_kontext"),  # before "flux": FLUX.1-Kontext names contain it
    ("flux.2", "flux2"),  # before "flux": FLUX.2 names contain it
    ("flux2", "flux2"),
    ("flux-2", "flux2"),
    ("flux_2", "flux2"),
    ("flux", "flux"),
    ("stable-diffusion-3", "sd3"),
    ("sd3", "sd3"),
)

FAMILY_ENV_VAR = "MILES_DIFFUSION_MODEL_FAMILY"


def pipeline_class_of(hf_checkpoint: str | None) -> str | None:
    """`_class_name` of a local checkpoint folder's model_index.json; None for a hub id or a folder without one."""
    if not hf_checkpoint or not os.path.isdir(hf_checkpoint):
        return None
    index_path = os.path.join(hf_checkpoint, "model_index.json")
    if not os.path.isfile(index_path):
        return None  # loading reports the missing file with the component check
    try:
        with open(index_path) as f:
            return json.load(f).get("_class_name")
    except (OSError, ValueError, AttributeError) as err:
        raise MilesUserError(f"--hf-checkpoint {hf_checkpoint!r}: cannot read {index_path}: {err}") from err


def resolve_family_name(hf_checkpoint: str | None, family_flag: str | None) -> str:
    """`--diffusion-model-family`, else $MILES_DIFFUSION_MODEL_FAMILY, else the pipeline class in a local folder's
    model_index.json, else a hint in the checkpoint name."""
    for source, value in (("--diffusion-model-family", family_flag), (FAMILY_ENV_VAR, os.environ.get(FAMILY_ENV_VAR))):
        if value:
            if value not in FAMILY_MODULES:
                raise MilesUserError(
                    f"{source} {value!r} is not a registered family; choose one of {sorted(FAMILY_MODULES)} "
                    "or pass --train-pipeline-config-path for your own"
                )
            return value
    pipeline_class = pipeline_class_of(hf_checkpoint)
    if pipeline_class in FAMILY_PIPELINE_CLASSES:
        return FAMILY_PIPELINE_CLASSES[pipeline_class]
    name = (hf_checkpoint or "").rstrip("/").lower()
    for hint, family in FAMILY_NAME_HINTS:
        if hint in name:
            return family
    holds = f" (its model_index.json names {pipeline_class})" if pipeline_class else ""
    raise MilesUserError(
        f"cannot tell the model family of --hf-checkpoint {hf_checkpoint!r}{holds} from its pipeline class or its "
        f"name; pass --diffusion-model-family (one of {sorted(FAMILY_MODULES)})"
    )


def get_family_class(name: str) -> type[TrainPipelineConfig]:
    if name not in FAMILIES:
        importlib.import_module(FAMILY_MODULES[name])
    return FAMILIES[name]


__all__ = [
    "FAMILIES",
    "FAMILY_MODULES",
    "FAMILY_NAME_HINTS",
    "FAMILY_PIPELINE_CLASSES",
    "GenerationShape",
    "TrainPipelineConfig",
    "get_family_class",
    "pipeline_class_of",
    "register_family",
    "resolve_family_name",
]
