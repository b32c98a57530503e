"""Shared fixtures: one local Ray instance shared across test modules, one tiny warmed model."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import stages  # noqa: F401  (hides a CUDA torchvision beside the CPU torch before a test imports transformers)

pytest.register_assert_rewrite("tests.support")     # the shared checks' asserts report like a test's own

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: longer than the default run allows (run with -m slow)")
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "harness: the real harness programs against the proxy (run with -m harness "
                                       "after tests/harness/install.sh)")


_SHARED_RAY: dict[str, str] = {}      # the node id of the Ray that ray_session started


def _shared_ray_is_up() -> bool:
    import ray

    return bool(_SHARED_RAY) and ray.get_runtime_context().get_node_id() == _SHARED_RAY["node"]


@pytest.fixture(autouse=True, scope="module")
def _ray_per_module(request):
    """The local Ray that ray_session starts is shared by every module that asks for it (starting
    one costs ~5 s here). A module that builds a cluster of its own (`OWN_RAY = True`) starts with no
    Ray, and so does one after a module that left another Ray up (a controller's or the CLI's own)."""
    import ray

    if ray.is_initialized() and (getattr(request.module, "OWN_RAY", False) or not _shared_ray_is_up()):
        ray.shutdown()
    yield


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray (2 logical CPUs), shared across modules."""
    import ray

    from pipeline.cluster import init_ray
    from pipeline.config import load_config

    if not (ray.is_initialized() and _shared_ray_is_up()):
        if ray.is_initialized():
            ray.shutdown()
        init_ray(load_config(None, ["run.ray_num_cpus=2"]), 2)
        _SHARED_RAY["node"] = ray.get_runtime_context().get_node_id()
    yield ray


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray of the module's own (2 CPUs), shut down after it: for modules whose actors must
    not share a Ray with others (Megatron ranks and their gloo groups)."""
    import ray

    root = str(Path(__file__).resolve().parent.parent)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}})
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny built-in Qwen2 for addition, briefly SFT-warmed (seconds), cached for the session."""
    from stages.model import ModelConfig, resolve_model_path

    cache = tmp_path_factory.mktemp("models")
    return resolve_model_path(ModelConfig(warmup_steps=40, cache_dir=str(cache)), log=lambda *_: None)


@pytest.fixture(scope="session")
def raw_model_dir(tmp_path_factory) -> str:
    """The built-in tiny Qwen2, unwarmed (built in a second): for tests that compare numbers, not answers."""
    from stages.model import ModelConfig, resolve_model_path

    cache = tmp_path_factory.mktemp("raw")
    return resolve_model_path(ModelConfig(warmup_steps=0, cache_dir=str(cache)), log=lambda *_: None)
