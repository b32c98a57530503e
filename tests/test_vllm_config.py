"""engine.kind=vllm's settings, checked without vLLM: the default run has no vLLM installed."""
from __future__ import annotations

import importlib.util

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.controller import Controller
from stages.agentflow.vllm_engine import check_lora
from stages.lora import LoraConfig


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="checks the message without vLLM")
def test_without_vllm_the_run_says_what_to_install(tiny_model_dir, tmp_path):
    cfg = load_config("configs/quickstart.yaml", [f"model.path={tiny_model_dir}", "engine.kind=vllm"])
    with pytest.raises(ConfigError, match=r"engine.kind=vllm needs vLLM: pip install -e '.\[vllm\]'"):
        Controller(cfg, tmp_path / "r", log=lambda *_: None)


@pytest.mark.parametrize("override,match", [("vllm.kv_cache_mb=0", "vllm.kv_cache_mb must be >= 1"),
                                            ("engine.kind=vlm", "engine.kind must be one of hf, vllm, sglang")])
def test_bad_vllm_settings_fail_when_the_config_is_read(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config("configs/quickstart.yaml", [override])


def test_lora_settings_vllm_cannot_serve_are_refused():
    check_lora(LoraConfig(enabled=True, rank=8))
    with pytest.raises(ValueError, match="target_regex"):
        check_lora(LoraConfig(enabled=True, target_regex=r".*q_proj"))
    with pytest.raises(ValueError, match="modules_to_save"):
        check_lora(LoraConfig(enabled=True, modules_to_save=("model.norm",)))
