"""Shared fixtures: one local Ray instance per test session, one tiny warmed model."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: longer than the default run allows (run with -m slow)")
    config.addinivalue_line("markers", "gpu: needs a CUDA device")


@pytest.fixture(autouse=True, scope="module")
def _fresh_ray_per_module():
    """Each test module starts without Ray: some build their own (multi-raylet) clusters."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    yield


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray (2 logical CPUs) shared by a module's tests."""
    import ray

    from pipeline.cluster import init_ray
    from pipeline.config import load_config

    init_ray(load_config(None, ["run.ray_num_cpus=2"]), 2)
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
