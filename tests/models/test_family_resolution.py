"""Family detection (names, env var, flag), building the family object, user classes and loaders, and errors."""

from __future__ import annotations

import shutil
import sys
import textwrap

import pytest
import torch

from miles.models import (
    FAMILY_ENV_VAR,
    FAMILY_MODULES,
    FAMILY_NAME_HINTS,
    FAMILY_PIPELINE_CLASSES,
    get_family_class,
    resolve_family_name,
)
from miles.models.common import (
    DiffusersTrainPipelineConfig,
    build_train_pipeline_config,
    check_components,
    combine_cfg,
    vae_output_to_uint8,
)
from miles.models.flux import FluxTrainPipelineConfig
from miles.models.qwen_image import QwenImageTrainPipelineConfig
from miles.models.sd3 import SD3TrainPipelineConfig
from miles.utils.errors import MilesUserError

MY_FAMILIES = {"sd3": SD3TrainPipelineConfig, "flux": FluxTrainPipelineConfig, "qwen_image": QwenImageTrainPipelineConfig}


def make_args(**overrides) -> dict:
    """The keyword arguments of build_train_pipeline_config, unset unless given."""
    values = dict(hf_checkpoint=None, diffusion_model_family=None, train_pipeline_config_path=None,
                  model_backend_path=None)
    values.update(overrides)
    return values


@pytest.fixture(autouse=True)
def no_family_env(monkeypatch):
    monkeypatch.delenv(FAMILY_ENV_VAR, raising=False)


@pytest.mark.parametrize(
    "checkpoint, family",
    [
        ("stabilityai/stable-diffusion-3.5-medium", "sd3"),
        ("stabilityai/stable-diffusion-3-medium-diffusers", "sd3"),
        ("/data/ckpt/my-SD3-finetune/", "sd3"),
        ("black-forest-labs/FLUX.1-dev", "flux"),
        ("black-forest-labs/FLUX.1-schnell", "flux"),
        ("Qwen/Qwen-Image", "qwen_image"),
        ("/models/qwen_image_lora_merged", "qwen_image"),
        ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "wan2_2"),
        ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "wan2_2"),
        ("Wan-AI/Wan2.1-T2V-14B-Diffusers", "wan2_2"),
        ("/models/cosmos-3-finetune", "cosmos3"),
        ("Lightricks/LTX-Video", "ltx"),
    ],
)
def test_family_from_checkpoint_name(checkpoint, family):
    assert resolve_family_name(checkpoint, None) == family


def test_flag_beats_env_var_beats_name(monkeypatch):
    monkeypatch.setenv(FAMILY_ENV_VAR, "flux")
    assert resolve_family_name("stabilityai/stable-diffusion-3.5-medium", None) == "flux"
    assert resolve_family_name("stabilityai/stable-diffusion-3.5-medium", "qwen_image") == "qwen_image"


@pytest.mark.parametrize("source", ["flag", "env"])
def test_unknown_family_is_a_user_error(monkeypatch, source):
    if source == "env":
        monkeypatch.setenv(FAMILY_ENV_VAR, "sd4")
        with pytest.raises(MilesUserError, match=f"{FAMILY_ENV_VAR} 'sd4' is not a registered family"):
            resolve_family_name("x", None)
    else:
        with pytest.raises(MilesUserError, match="--diffusion-model-family 'sd4' is not a registered family"):
            resolve_family_name("x", "sd4")


def test_name_without_hint_is_a_user_error():
    with pytest.raises(MilesUserError, match="cannot tell the model family.*--diffusion-model-family"):
        resolve_family_name("/models/my-diffusion-model", None)


@pytest.mark.parametrize("key", sorted(MY_FAMILIES))
def test_registered_classes_agree_with_the_hint_table(key):
    cls = get_family_class(key)
    assert cls is MY_FAMILIES[key] and cls.family == key
    table_hints = {hint for hint, family in FAMILY_NAME_HINTS if family == key}
    assert set(cls.name_hints) <= table_hints
    for hint in cls.name_hints:
        assert resolve_family_name(f"org/{hint}-model", None) == key
    assert cls.default_lora_target_modules and cls.trainable_modules == ("transformer",)


@pytest.mark.parametrize("key", sorted(FAMILY_MODULES))
def test_every_family_is_found_by_its_pipeline_class_and_its_hints(key):
    cls = get_family_class(key)
    assert FAMILY_PIPELINE_CLASSES[cls.pipeline_class_name] == key
    table_hints = {hint for hint, family in FAMILY_NAME_HINTS if family == key}
    assert set(cls.name_hints) == table_hints


def test_a_local_folder_resolves_by_its_model_index_before_its_name(tmp_path, tiny_checkpoint):
    unnamed = tmp_path / "my-finetune"
    shutil.copytree(tiny_checkpoint("sd3"), unnamed)
    assert resolve_family_name(str(unnamed), None) == "sd3"
    misleading = tmp_path / "flux-distilled-from-sd3"  # the folder's content, not its name, decides
    unnamed.rename(misleading)
    assert resolve_family_name(str(misleading), None) == "sd3"
    index = misleading / "model_index.json"
    index.write_text(index.read_text().replace("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline"))
    assert resolve_family_name(str(misleading), None) == "flux"  # an unknown class: the name hint
    other = tmp_path / "my-model"
    misleading.rename(other)
    with pytest.raises(MilesUserError, match="its model_index.json names StableDiffusion3Img2ImgPipeline"):
        resolve_family_name(str(other), None)
    index = other / "model_index.json"
    index.write_text("{not json")
    with pytest.raises(MilesUserError, match="cannot read .*model_index.json"):
        resolve_family_name(str(other), None)


def test_build_train_pipeline_config_resolves_the_family(tiny_checkpoint):
    config = build_train_pipeline_config(**make_args(hf_checkpoint=tiny_checkpoint("sd3")))
    assert isinstance(config, SD3TrainPipelineConfig) and config.model_backend is None
    config = build_train_pipeline_config(**make_args(hf_checkpoint="/x/unnamed", diffusion_model_family="flux"))
    assert isinstance(config, FluxTrainPipelineConfig)


USER_MODULE = '''
import torch
from miles.models.base import TrainPipelineConfig
from miles.models.sd3 import SD3TrainPipelineConfig

CALLS = []

class MySD3(SD3TrainPipelineConfig):
    family = "my_sd3"
    default_lora_target_modules = ("attn.to_q", "attn.to_v")

class Incomplete(TrainPipelineConfig):
    family = "incomplete"
    def load_pipeline(self, path, dtype, device="cpu"):
        return None

NOT_A_CLASS = 3

def backend(path, dtype):
    from diffusers import StableDiffusion3Pipeline
    CALLS.append((path, dtype))
    pipe = StableDiffusion3Pipeline.from_pretrained(path, dtype=dtype)
    pipe.loaded_by_user_backend = True
    return pipe

def backend_returning_none(path, dtype):
    return None

def backend_one_arg(path):
    return None
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_miles_plugins.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_miles_plugins"
    sys.modules.pop("my_miles_plugins", None)


def test_train_pipeline_config_path_loads_a_user_class(user_module):
    config = build_train_pipeline_config(**make_args(train_pipeline_config_path=f"{user_module}.MySD3"))
    assert type(config).__name__ == "MySD3" and config.default_lora_target_modules == ("attn.to_q", "attn.to_v")


@pytest.mark.parametrize(
    "attr, message",
    [
        ("NOT_A_CLASS", "must name a subclass of miles.models.base.TrainPipelineConfig"),
        ("Incomplete", r"Incomplete does not implement \['decode', "),
        ("Missing", "has no attribute 'Missing'"),
    ],
)
def test_bad_train_pipeline_config_path_is_a_user_error(user_module, attr, message):
    with pytest.raises(MilesUserError, match=message) as err:
        build_train_pipeline_config(**make_args(train_pipeline_config_path=f"{user_module}.{attr}"))
    assert "--train-pipeline-config-path" in str(err.value)


def test_train_pipeline_config_path_and_family_flag_are_exclusive(user_module):
    with pytest.raises(MilesUserError, match="mutually exclusive"):
        build_train_pipeline_config(
            **make_args(train_pipeline_config_path=f"{user_module}.MySD3", diffusion_model_family="sd3")
        )


def test_model_backend_path_replaces_the_loader(user_module, tiny_checkpoint):
    path = tiny_checkpoint("sd3")
    config = build_train_pipeline_config(**make_args(hf_checkpoint=path, model_backend_path=f"{user_module}.backend"))
    pipe = config.load_pipeline(path, "fp32")
    assert pipe.loaded_by_user_backend and sys.modules[user_module].CALLS == [(path, torch.float32)]
    modules = config.load_modules(path, ["transformer"], torch.float32)
    assert modules["transformer"].config.num_layers == 2


def test_bad_model_backend_is_a_user_error(user_module, tiny_checkpoint):
    with pytest.raises(MilesUserError, match="--model-backend-path .*must accept 2 positional"):
        build_train_pipeline_config(**make_args(hf_checkpoint="sd3", model_backend_path=f"{user_module}.backend_one_arg"))
    config = build_train_pipeline_config(
        **make_args(hf_checkpoint="sd3", model_backend_path=f"{user_module}.backend_returning_none")
    )
    with pytest.raises(MilesUserError, match="returned None"):
        config.load_pipeline(tiny_checkpoint("sd3"), torch.float32)


def test_folder_missing_a_component_names_it(tmp_path, tiny_checkpoint):
    broken = tmp_path / "tiny-sd3-broken"
    shutil.copytree(tiny_checkpoint("sd3"), broken)
    shutil.rmtree(broken / "text_encoder_2")
    family = SD3TrainPipelineConfig()
    with pytest.raises(MilesUserError, match=f"folder '{broken}' is missing the component 'text_encoder_2'"):
        family.load_pipeline(str(broken), torch.float32)
    shutil.rmtree(broken / "transformer")
    with pytest.raises(MilesUserError, match="missing the component 'transformer'"):
        family.load_modules(str(broken), ["transformer"], torch.float32)
    (broken / "model_index.json").unlink()
    with pytest.raises(MilesUserError, match="without model_index.json"):
        check_components(str(broken), ["vae"])


def test_optional_t5_is_not_required_for_sd3():
    assert "text_encoder_3" not in SD3TrainPipelineConfig.required_components
    assert issubclass(SD3TrainPipelineConfig, DiffusersTrainPipelineConfig)


def test_combine_cfg_and_uint8_helpers():
    v_neg = torch.tensor([[[1.0, 0.0]]])
    v_pos = torch.tensor([[[0.0, 2.0]]])
    doubled = torch.cat([v_neg, v_pos])
    torch.testing.assert_close(combine_cfg(doubled, 3.0), torch.tensor([[[-2.0, 6.0]]]))
    renormed = combine_cfg(doubled, 3.0, renormalize=True)
    torch.testing.assert_close(renormed.norm(dim=-1), torch.tensor([[2.0]]))
    torch.testing.assert_close(renormed / renormed.norm(dim=-1, keepdim=True),
                               torch.tensor([[[-2.0, 6.0]]]) / (40 ** 0.5))
    images = torch.tensor([-1.0, -0.999, 0.0, 1.0, 1.5]).view(1, 1, 1, 5).expand(1, 3, 1, 5)
    out = vae_output_to_uint8(images)
    assert out.shape == (1, 1, 1, 5, 3) and out.dtype == torch.uint8
    assert out[0, 0, 0, :, 0].tolist() == [0, 0, 128, 255, 255]
    video = vae_output_to_uint8(torch.zeros(2, 3, 4, 8, 8))
    assert video.shape == (2, 4, 8, 8, 3)
