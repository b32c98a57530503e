"""The `model:` recipe section, apart from stages/model.py so a recipe is checked without torch."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from stages.keys import NONNEG, POSITIVE, between, key, one_of, section


@section("model")
class ModelConfig:
    path: str = key("", 'local HF dir; "" = the built-in tiny model (builtin_* keys below); builtin:NAME '
                        "(builtin_model_dir)")
    dtype: str = key("float32", "dtype the policy is held and trained in", one_of("bfloat16", "float16", "float32"))
    builtin_task: str = key("addition", 'built-in tiny model (used only when path is ""): the task it is warmed up on')
    builtin_digits: int = key(2, "built-in tiny model: digits of the task's operands", POSITIVE)
    hidden_size: int = key(128, "built-in tiny model: hidden size", POSITIVE)
    num_layers: int = key(4, "built-in tiny model: transformer layers", POSITIVE)
    warmup_steps: int = key(300, "built-in tiny model: SFT steps, deliberately partial (~0.2 sampled accuracy), RL "
                                 "does the rest", NONNEG)
    warmup_rows: int = key(1000, "built-in tiny model: SFT rows", POSITIVE)
    warmup_lr: float = key(1e-3, "built-in tiny model: SFT learning rate", POSITIVE)
    warmup_label_smoothing: float = key(0.0, "built-in tiny model: > 0 makes the warmed policy know answers it samples"
                                             " with low confidence", between(0, 1, hi_open=True))
    cache_dir: str = key("~/.cache/loongsage/models", "where built-in tiny models are cached")
    seed: int = key(0, "picks the built-in model (its init and warm-up), as path picks a checkpoint: not run.seed, so "
                        "every run seed starts from one cached model (docs/seeds.md)", NONNEG)


def validate_model_dir(path: str, check_tokenizer: bool = True, key: str = "model.path") -> None:
    """Fail at start, before any actor exists, if the directory `key` names is not usable. check_tokenizer=False:
    the caller loads the tokenizer itself next (load_tokenizer's errors name the directory too)."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{key} {path!r} is not a directory")
    if not (p / "config.json").is_file():
        raise ValueError(f"{key} {path!r} has no config.json (not an HF model directory)")
    if check_tokenizer:
        from stages.tokenizer import load_tokenizer

        load_tokenizer(path)


MIN_HEAD_DIM = 32       # vLLM's CPU attention takes head_dim 32, 64, 80, ...; SGLang's kernels 64 and up


def attention_heads(hidden_size: int) -> tuple[int, int]:
    """(query heads, key/value heads) of a built-in model: 4 and 2 (grouped-query attention, as
    Qwen2), fewer where 4 heads would be narrower than MIN_HEAD_DIM, so every engine can run it."""
    if hidden_size % MIN_HEAD_DIM:
        raise ValueError(f"hidden_size must be a multiple of {MIN_HEAD_DIM} (the narrowest attention head "
                         f"every engine runs), got {hidden_size}")
    heads = max(1, min(4, hidden_size // MIN_HEAD_DIM))
    return heads, max(1, heads // 2)


def cached_model_dir(out: Path, build, what: str, log=print) -> str:
    """`out`, first made by build(tmp) and renamed to it where it is not there yet."""
    if (out / "model.safetensors").is_file():
        return str(out)
    log(f"building {what} (cached at {out}) ...")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    build(tmp)
    try:
        tmp.rename(out)  # atomic publish: a concurrent run never sees a half-written cache
    except OSError:
        if not (out / "model.safetensors").is_file():
            raise
        shutil.rmtree(tmp)  # another process published the same model first: use theirs
    return str(out)
