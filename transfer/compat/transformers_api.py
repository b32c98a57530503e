"""transformers internals (pinned in pyproject.toml; checked by tests/test_compat.py)."""
from __future__ import annotations

# attributes transformers' tokenizer classes fill at construction and never read again: the Rust
# tokenizer (`_tokenizer`) was built from them and holds its own copy
BUILD_COPIES = ("_vocab", "_merges")


def drop_build_copies(tok) -> None:
    """Set a fast tokenizer's BUILD_COPIES to None (transformers 5's BPE tokenizers keep them): for a
    151k-token vocabulary they hold ~105 MB. A tokenizer without a Rust one keeps them."""
    if getattr(tok, "_tokenizer", None) is not None:
        for name in BUILD_COPIES:
            if isinstance(getattr(tok, name, None), (dict, list)):
                setattr(tok, name, None)


def cache_kv(cache) -> list[tuple]:
    """(keys, values) per layer of a `DynamicCache`, each [batch, heads, length, head_dim]: its
    `layers[i].keys` / `.values`. The cache has no public API to gather rows or join two batches."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def set_cache_kv(cache, kv: list[tuple]) -> None:
    """Put (keys, values) per layer into a `DynamicCache` (`layers[i].keys` / `.values`), as cache_kv reads them."""
    for layer, (k, v) in zip(cache.layers, kv):
        layer.keys, layer.values = k, v


def forward_kwargs(model) -> tuple[str, dict]:
    """(the name of the model's forward's KV-cache argument, kwargs that make it return the last
    position's logits only). transformers 5 renamed `past_key_values` to `cache` in some models, and
    `logits_to_keep` is not in every forward (asked of the forward itself: a peft wrapper's takes **kwargs)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), (
        {"logits_to_keep": 1} if "logits_to_keep" in params else {})


def attn_implementation(model) -> str | None:
    """The attention implementation a loaded model runs (`config._attn_implementation`: "eager",
    "sdpa", ...); the public `set_attn_implementation` changes it but nothing public reads it."""
    return getattr(model.config, "_attn_implementation", None)
