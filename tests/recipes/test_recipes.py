"""Every recipe in recipes/ builds a command line that train_diffusion.py accepts (`--dry-run`), with its fields
taken from the environment as a user would set them, on the tiny checkpoint of its family."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from miles.testing.make_tiny import build_tiny_pipeline

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(p for p in (REPO / "recipes").glob("*.py") if p.name != "common.py")


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"recipe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RECIPE


def test_there_is_a_recipe_per_family_and_task():
    names = {path.stem for path in RECIPES}
    assert {"sd35m_pickscore", "sd35m_ocr", "sd35m_nft", "flux_pickscore", "qwen_image_ocr", "wan2_2_ti2v5b",
            "ltx_video", "cosmos3_image", "flux_kontext_edit", "qwen_image_edit"} <= names


def test_fields_come_from_the_environment_and_blocks_join_in_order():
    recipe = load(REPO / "recipes" / "sd35m_pickscore.py").with_environment(
        {"MILES_SCRIPT_NUM_GPUS": "4", "MILES_SCRIPT_MODEL_PATH": "/ckpt", "MILES_SCRIPT_DRY_RUN": "1",
         "MILES_SCRIPT_EXTRA_ARGS": "--lr 1e-5", "MILES_SCRIPT_SAVE_DIR": "/runs/a"})
    flags = recipe.flags()
    assert flags[flags.index("--hf-checkpoint") + 1] == "/ckpt"
    assert flags[flags.index("--actor-num-gpus-per-node") + 1] == "4"
    assert flags[flags.index("--save") + 1] == flags[flags.index("--load") + 1] == "/runs/a"
    assert flags[-3:] == ["--lr", "1e-5", "--dry-run"]  # extra flags come last, so they win
    assert flags.index("--colocate") < flags.index("--rm-type") < flags.index("--fsdp-torch-compile")


def test_external_ray_submits_a_job(monkeypatch):
    recipe = load(REPO / "recipes" / "sd35m_ocr.py").with_environment({"MILES_SCRIPT_EXTERNAL_RAY": "1"})
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    command = recipe.command()
    assert command[:3] == ["ray", "job", "submit"] and "train_diffusion.py" in command
    monkeypatch.delenv("RAY_ADDRESS")
    with pytest.raises(SystemExit, match="RAY_ADDRESS"):
        recipe.command()


FAMILY_OF = {"sd35m": "sd3", "flux2": "flux2", "flux": "flux", "qwen_image": "qwen_image", "wan2_2": "wan2_2",
             "ltx": "ltx", "cosmos3": "cosmos3", "hunyuan_video": "hunyuan_video"}  # first matching prefix wins


def test_paths_are_resolved_from_where_the_user_stands(tmp_path):
    recipe = load(REPO / "recipes" / "sd35m_ocr.py").with_environment(
        {"MILES_SCRIPT_PROMPT_DATA": "data/mine.jsonl", "MILES_SCRIPT_OUTPUT_DIR": "runs/ocr"}).resolved(str(tmp_path))
    flags = recipe.flags()
    assert flags[flags.index("--prompt-data") + 1] == str(tmp_path / "data" / "mine.jsonl")
    assert flags[flags.index("--output-dir") + 1] == str(tmp_path / "runs" / "ocr")
    # the checkpoints live under the output folder; a hub id stays a hub id
    assert flags[flags.index("--save") + 1] == str(tmp_path / "runs" / "ocr" / "checkpoints")
    assert flags[flags.index("--hf-checkpoint") + 1] == "stabilityai/stable-diffusion-3.5-medium"


def test_every_recipe_has_an_explicit_length_and_eval_cadence():
    for path in RECIPES:
        flags = load(path).flags()
        assert {"--num-rollout", "--eval-interval", "--save-interval", "--eval-prompt-data"} <= set(flags), path.stem


# The papers' schedules, per rollout (one of their epochs): prompts x images per prompt, optimizer steps.
PAPER_GEOMETRY = {"sd35m_pickscore": ("48", "24", "2"), "sd35m_ocr": ("48", "24", "2"), "sd35m_nft": ("48", "24", "1")}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_passes_dry_run_on_its_familys_tiny_checkpoint(path, tiny_checkpoint, tmp_path):
    family = next(f for prefix, f in FAMILY_OF.items() if path.stem.startswith(prefix))
    checkpoint = tiny_checkpoint(family)
    if family == "sd3":  # SD3's learnt position table bounds the output size: the wide one spans the recipes' 512 px
        checkpoint = build_tiny_pipeline("sd3", str(tmp_path / "tiny-sd3-wide"), variant="wide")
    env = {**os.environ, "MILES_SCRIPT_MODEL_PATH": checkpoint, "MILES_SCRIPT_NUM_GPUS": "1",
           "MILES_SCRIPT_DRY_RUN": "1", "MILES_SCRIPT_OUTPUT_DIR": str(tmp_path / "out"),
           "MILES_SCRIPT_SAVE_DIR": str(tmp_path / "ckpt"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, cwd=REPO,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "batch geometry" in result.stdout.lower() or "global batch" in result.stdout
    flags = load(path).flags()
    num_rollout = flags[flags.index("--num-rollout") + 1]
    assert re.search(rf"^    rollouts +{num_rollout}   \(--num-rollout\)$", result.stdout, re.M), result.stdout[-2000:]
    assert re.search(r"^    evals before rollouts \(--eval-interval\) +0, ", result.stdout, re.M)
    if path.stem in PAPER_GEOMETRY:
        prompts, group, steps = PAPER_GEOMETRY[path.stem]
        assert re.search(rf"prompts \(--rollout-batch-size\) +{prompts}\n.*--n-samples-per-prompt\) +{group}\n",
                         result.stdout)
        assert re.search(rf"/ optimizer steps \(--num-steps-per-rollout\) +{steps}\n", result.stdout)
