"""The attention shape of a built-in model: heads no narrower than every engine runs.

Its own module because both built-in model families (stages/model.py, stages/qwen_vocab.py) use it and
stages/model.py imports stages/qwen_vocab.py.
"""
from __future__ import annotations

MIN_HEAD_DIM = 32       # vLLM's CPU attention takes head_dim 32, 64, 80, ...; SGLang's kernels 64 and up


def attention_heads(hidden_size: int) -> tuple[int, int]:
    """(query heads, key/value heads) of a built-in model: 4 and 2 (grouped-query attention, as
    Qwen2), fewer where 4 heads would be narrower than MIN_HEAD_DIM, so every engine can run it."""
    if hidden_size % MIN_HEAD_DIM:
        raise ValueError(f"hidden_size must be a multiple of {MIN_HEAD_DIM} (the narrowest attention head "
                         f"every engine runs), got {hidden_size}")
    heads = max(1, min(4, hidden_size // MIN_HEAD_DIM))
    return heads, max(1, heads // 2)
