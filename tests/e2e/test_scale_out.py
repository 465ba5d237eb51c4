"""Scale-out end to end on CPU: trainer ranks and engines on separate slots with weight sync by broadcast, and
a run over a two-node Ray cluster (both nodes on this machine) with the trainer and the engine on different
nodes. `--check-weight-sync` makes every sync prove that each engine holds the trainer's weights exactly."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import pytest

from test_train_diffusion import base_flags, metrics, run, series  # the sibling module (tests/e2e is on sys.path)

from miles.utils.auth import is_loopback_host

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


def test_trainer_and_engine_on_two_nodes_of_a_ray_cluster(sd3, prompts, tmp_path):
    """Two Ray nodes of one CPU slot each: the job's two slots (trainer, engine) must land on different nodes.
    The engine then binds its node's address, and rank 0 serves the weight group there too."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        out = tmp_path / "two-nodes"
        result = run([*base_flags(sd3, prompts, out), "--num-rollout", "1", "--rollout-num-gpus", "1",
                      "--num-gpus-per-node", "2", "--check-weight-sync"], ray_address=cluster.address)
    finally:
        cluster.shutdown()
    placement = re.search(r"trainer ranks 1 on nodes \['(\w+)'\], engines 1 × 1 device\(s\) on nodes \['(\w+)'\]",
                          result.stderr)
    assert placement, result.stderr[-3000:]
    assert placement[1] != placement[2], "trainer and engine share a node"
    engine_url = re.search(r"engines up: \['(http://[^']+)'\]", result.stderr)[1]
    assert not is_loopback_host(urlsplit(engine_url).hostname), engine_url
    records = metrics(out)
    assert series(records, "weight_sync/broadcast_engines") == [1.0]
    assert series(records, "weight_sync/checked_engines") == [1.0]
    assert len(series(records, "rollout/reward_mean")) == 1
