"""Load a model directory's tokenizer, holding only what serves calls.

Every process of a run that encodes or decodes (engines, trainer, rollout and reward workers, the
driver) loads the tokenizer through `load_tokenizer`, so they agree on it. Two things make that
cheaper than a plain `AutoTokenizer.from_pretrained`, measured on Qwen's 151,669-token vocabulary:

* transformers 5's BPE tokenizers (Qwen2Tokenizer and kin) keep the vocabulary and merges they
  were built from as Python objects (`_vocab`, `_merges`: ~72 MB) next to the Rust tokenizer that
  serves every call, and parsing tokenizer.json leaves ~100 MB of freed heap that glibc keeps.
  Both are let go: ~195 MB -> ~45 MB a process.
* `AutoTokenizer` reads the model's config to pick the class, and that import pulls in torch
  (~170 MB and ~3 s a process on 2 cores). A worker that needs only the tokenizer gets the class
  AutoTokenizer picked elsewhere (`tokenizer_class_of`) and loads it directly: the same tokenizer
  (tests/test_tokenizer.py), no torch.

This module imports neither torch nor transformers at import time.
"""
from __future__ import annotations

import ctypes
import gc
import importlib
from pathlib import Path

# attributes transformers' tokenizer classes fill at construction and never read again: the Rust
# tokenizer (`_tokenizer`) was built from them and holds its own copy
_BUILD_COPIES = ("_vocab", "_merges")


def load_tokenizer(path: str, cls: str = ""):
    """The tokenizer of the model directory `path` (pad = eos when it has no pad token).

    `cls`: "module:Class", the class AutoTokenizer picks for `path` (tokenizer_class_of), to load it
    without importing AutoTokenizer; "" = AutoTokenizer."""
    p = Path(path)
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise ValueError(f"model directory {p} has no tokenizer (expected tokenizer.json or tokenizer_config.json)")
    try:
        tok = _tokenizer_class(cls).from_pretrained(str(p))
    except Exception as e:  # noqa: BLE001 - HF raises many types; the message names the directory
        raise ValueError(f"model directory {p}: cannot load its tokenizer: {e}") from e
    if tok.eos_token_id is None:
        raise ValueError(f"model directory {p}: tokenizer has no eos token")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    release_build_copies(tok)
    return tok


def tokenizer_class_of(tok) -> str:
    """"module:Class" of a loaded tokenizer, for load_tokenizer(path, cls=...) in another process."""
    return f"{type(tok).__module__}:{type(tok).__qualname__}"


def _tokenizer_class(cls: str):
    if not cls:
        from transformers import AutoTokenizer

        return AutoTokenizer
    module, _, name = cls.partition(":")
    return getattr(importlib.import_module(module), name)


def release_build_copies(tok) -> None:
    """Drop the Python copies a tokenizer was built from (the Rust tokenizer serves every call) and
    hand the freed heap back to the system."""
    if getattr(tok, "_tokenizer", None) is not None:
        for name in _BUILD_COPIES:
            if isinstance(getattr(tok, name, None), (dict, list)):
                setattr(tok, name, None)
    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """glibc keeps freed heap for reuse; malloc_trim returns what it can to the system (a no-op
    where the C library has no malloc_trim)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
