"""Scale-out end to end on CPU: trainer ranks and engines on separate slots with weight sync by broadcast, and
a run over a two-node Ray cluster (both nodes on this machine) with the trainer and the engine on different
nodes. `--check-weight-sync` makes every sync prove that each engine holds the trainer's weights exactly."""

from __future__ import annotations

import pytest

from test_train_diffusion import base_flags, metrics, run, series  # the sibling module (tests/e2e is on sys.path)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sd3(tiny_checkpoint) -> str:
    return tiny_checkpoint("sd3")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> str:
    from miles.testing.make_prompts import write_prompts

    return write_prompts(str(tmp_path_factory.mktemp("data") / "prompts.jsonl"), count=8)


def test_non_colocated_engines_hold_the_trainers_weights_after_every_sync(sd3, prompts, tmp_path):
    out = tmp_path / "run"
    flags = base_flags(sd3, prompts, out)
    flags[flags.index("--actor-num-gpus-per-node") + 1] = "2"
    flags[flags.index("--num-gpus-per-node") + 1] = "4"
    run([*flags, "--num-rollout", "3", "--rollout-num-gpus", "2", "--check-weight-sync"])
    records = metrics(out)
    assert series(records, "weight_sync/broadcast_engines") == [2.0, 2.0, 2.0]
    assert series(records, "weight_sync/ipc_engines") == [0.0, 0.0, 0.0]
    assert series(records, "weight_sync/checked_engines") == [2.0, 2.0, 2.0]
    assert all(n > 0 for n in series(records, "weight_sync/checked_tensors"))
    assert len(series(records, "train/loss")) == 3
