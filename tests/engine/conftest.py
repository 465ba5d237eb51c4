"""One tiny-SD3 engine process (CPU, fp32) shared by the engine tests of this folder."""

from __future__ import annotations

import pytest

from miles.engine.launcher import launch_engine
from miles.engine.server_args import ServerArgs


def tiny_sd3_server_args(path: str, **overrides) -> ServerArgs:
    fields = dict(model_path=path, model_family="sd3", device="cpu", dtype="fp32", generator_device="cpu",
                  batch_wait_ms=30.0, max_batch_size=16)
    fields.update(overrides)
    return ServerArgs(**fields)


@pytest.fixture(scope="session")
def sd3_path(tiny_checkpoint):
    return tiny_checkpoint("sd3")


@pytest.fixture(scope="session")
def sd3_engine(sd3_path, tmp_path_factory):
    """The engine process; tests that change its weights restore them before they end."""
    process = launch_engine(tiny_sd3_server_args(sd3_path), log_path=str(tmp_path_factory.mktemp("engine") / "engine.log"),
                            startup_timeout=150)
    yield process
    process.stop()


@pytest.fixture(scope="session")
def make_server_args():
    """`make_server_args(path, **overrides)`: the ServerArgs the shared engine runs with, for in-process runners."""
    return tiny_sd3_server_args
