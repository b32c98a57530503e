"""Policy model and tokenizer: load a local HF directory, or the built-in tiny one (stages/tasks/models.py).

Engines, the trainer and teachers all load through here so they agree on the tokenizer.
"""
from __future__ import annotations

import torch

from stages.model_config import ModelConfig, validate_model_dir
from stages.tokenizer import load_tokenizer  # noqa: F401 - engines, trainer and teachers load it from here

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(path: str, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    validate_model_dir(path, check_tokenizer=False, key="model directory")
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype]).eval()


def resolve_model_path(cfg: ModelConfig, log=print, check_tokenizer: bool = True) -> str:
    """The directory engines and the trainer load: cfg.path, or a built-in model, built once and cached."""
    if cfg.path and not cfg.path.startswith("builtin:"):
        validate_model_dir(cfg.path, check_tokenizer)
        return cfg.path
    from stages.tasks.models import builtin_model_dir, tiny_model_dir

    if cfg.path:
        return builtin_model_dir(cfg.path.split(":", 1)[1], cfg.cache_dir, log=log)
    return tiny_model_dir(cfg, log=log)
