"""`shapes`: a synthetic compositional text-to-image task whose outputs can be checked exactly (docs/shapes.md).

- `spec`: the palette, shapes, prompt kinds (single, counting, two_object, position) and train/held-out split;
- `render`: the procedural renderer (deterministic in scene, size and seed);
- `score`: the GenEval-style scorer (colour segmentation, connected components, shape features), 0/1 and dense;
- `data`: the prompt files (`train.jsonl`, `heldout.jsonl`) and the renderer's images as SFT data;
- `model`, `pretrain`: the small SD3 pipeline and the script that pretrains it by flow matching;
- `evaluate`, `report`: the held-out score in one process, and a run's before/after grid and curve.

The reward is `--rm-type shapes` (miles/rollout/rm_hub/shapes.py). `PRETRAINED_SD3` is the shipped base model,
a `StableDiffusion3Pipeline` folder written by `python -m miles.tasks.shapes.pretrain` on one GPU
(`scripts/shapes_gpu_pretrain.sh`).
"""

import os

PRETRAINED_SD3 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pretrained", "sd3")
