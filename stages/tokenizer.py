"""Load a model directory's tokenizer, holding only what serves calls. Every process of a run that encodes
or decodes loads it through `load_tokenizer`, so they agree on it; cheaper than `AutoTokenizer.from_pretrained`:

* the Python copies of the vocabulary and merges a transformers 5 BPE tokenizer was built from are let go
  (transfer/compat/transformers_api.py; the Rust tokenizer serves every call) and the freed heap handed back;
* a worker given the class AutoTokenizer picked elsewhere (`tokenizer_class_of`) loads it directly, without
  the torch import AutoTokenizer's reading of the model config pulls in;
* a large tokenizer.json (parsing peaks ~200 MB above what it holds) is parsed by one process of a host at
  a time (a file lock): the processes of a run start together, and so pay that peak once.

This module imports neither torch nor transformers at import time.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import shutil
import tempfile
from pathlib import Path

from stages.keys import import_object
from transfer.compat.transformers_api import drop_build_copies

# tokenizer files larger than this are parsed one process at a time on a host (a 151k-token BPE: 18.6 MB)
LARGE_TOKENIZER_BYTES = 4 * 2 ** 20
LOAD_LOCK = Path(tempfile.gettempdir()) / "loongsage-tokenizer-load.lock"
STAGED_MARK = ".staged-tokenizer"       # in a directory stage_tokenizer wrote


def load_tokenizer(path: str, cls: str = ""):
    """The tokenizer of the model directory `path` (pad = eos when it has no pad token). `cls`: "module:Class",
    the class AutoTokenizer picks for `path` (tokenizer_class_of), loaded without AutoTokenizer; "" = AutoTokenizer."""
    p = Path(path)
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise ValueError(f"model directory {p} has no tokenizer (expected tokenizer.json or tokenizer_config.json)")
    try:
        klass = import_object(cls or "transformers:AutoTokenizer")    # outside the lock: imports hold no tokenizer
        with one_load_at_a_time(p):
            tok = klass.from_pretrained(str(p))
            if tok.pad_token_id is None and tok.eos_token_id is not None:
                tok.pad_token = tok.eos_token
            release_build_copies(tok)       # the parse's freed heap goes back before the next process parses
    except Exception as e:  # noqa: BLE001 - a bad class name, or HF raising any type; the message names the directory
        raise ValueError(f"model directory {p}: cannot load its tokenizer: {e}") from e
    if tok.eos_token_id is None:
        raise ValueError(f"model directory {p}: tokenizer has no eos token")
    return tok


@contextlib.contextmanager
def one_load_at_a_time(path: Path):
    """Hold this host's tokenizer-load lock while the block runs, if `path`'s tokenizer is large."""
    size = sum(f.stat().st_size for f in path.glob("*") if f.name.startswith(("tokenizer", "vocab", "merges"))
               and f.is_file())
    if size < LARGE_TOKENIZER_BYTES:
        yield
        return
    try:
        import fcntl

        fd = os.open(LOAD_LOCK, os.O_RDONLY | os.O_CREAT, 0o666)
    except (ImportError, OSError):      # no flock here, or another user's lock file: load unserialised
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)      # the kernel releases it too if this process dies holding it
        yield
    finally:
        os.close(fd)


def stage_tokenizer(tok, where: str | Path) -> str:
    """`tok` written into `where` as save_pretrained writes it, marked as such: checkpoints copy these
    files (save_tokenizer) instead of loading the tokenizer again to save it."""
    tok.save_pretrained(str(where))
    (Path(where) / STAGED_MARK).touch()
    trim_heap()     # the serialised JSON (~20 MB of Python string for 151k tokens) and its parse's heap
    return str(where)


def save_tokenizer(dst: str | Path, model_dir: str, staged: str = "") -> None:
    """The tokenizer of `model_dir` written into `dst` as save_pretrained writes it: copied from `staged`
    (a stage_tokenizer directory) when this host has it, else loaded and saved. A checkpoint comes at
    the end of an update, when the trainer holds the most; a 151k-token load would add ~250 MB there."""
    if staged and (Path(staged) / STAGED_MARK).is_file():
        for f in Path(staged).iterdir():
            if f.is_file() and f.name != STAGED_MARK:
                shutil.copyfile(f, Path(dst) / f.name)
        return
    load_tokenizer(model_dir).save_pretrained(str(dst))


def tokenizer_class_of(tok) -> str:
    """"module:Class" of a loaded tokenizer, for load_tokenizer(path, cls=...) in another process."""
    return f"{type(tok).__module__}:{type(tok).__qualname__}"


def release_build_copies(tok) -> None:
    """Drop the Python copies a tokenizer was built from and hand the freed heap back to the system."""
    drop_build_copies(tok)
    trim_heap()


def trim_heap() -> None:
    """Collect garbage, then hand the heap glibc keeps for reuse back (a no-op without malloc_trim)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
