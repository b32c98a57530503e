"""Where an offloaded teacher's weights wait, and how they come back: OFFLOADS[device type](files, dtype,
device) gives `fetch() -> {name: tensor on the resident device}`.

* CPU hosts: the weights stay in the teacher's safetensors files; a swap-in maps them and copies
  every tensor into memory the process owns, in chunks (a zero-copy mmap view would make "resident"
  whatever pages the OS kept, fault inside the forward and escape the budget).
* GPU hosts: a pinned CPU copy of every tensor, made once at start; a swap-in is one asynchronous
  host-to-device copy per tensor, at full bus bandwidth.
"""
from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import torch

from stages.model import DTYPES
from stages.teacher.config import TeacherError

_FLOATS = ("F", "BF")       # safetensors dtype names of floating tensors (cast to teacher.dtype when resident)


def weight_files(tid: str, path: str) -> list[Path]:
    """The teacher's safetensors files: model.safetensors, or the shards its index names."""
    p = Path(path)
    single, index = p / "model.safetensors", p / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (p / s).is_file()]
        if missing:
            raise TeacherError(f"teacher {tid!r} ({p}): shard {missing[0]} named by its index is missing")
        return [p / s for s in shards]
    raise TeacherError(f"teacher {tid!r} ({p}): no model.safetensors (teachers are offloaded through their "
                       f"safetensors files; re-save the model with save_pretrained(safe_serialization=True))")


def read_header(tid: str, files: list[Path]) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, file dtype) of every tensor, read from the headers only (no weights)."""
    from safetensors import safe_open

    out = {}
    try:
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                for name in h.keys():
                    s = h.get_slice(name)
                    out[name] = (list(s.get_shape()), s.get_dtype())
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types; name the teacher
        raise TeacherError(f"teacher {tid!r}: cannot read weights {f}: {e}") from e
    return out


def resident_nbytes(header: dict[str, tuple[list[int], str]], dtype: str) -> int:
    """Bytes the teacher occupies when resident in `dtype` (floating tensors are cast to it)."""
    size = DTYPES[dtype].itemsize
    return sum(math.prod(shape) * (size if kind.startswith(_FLOATS) else 1 if kind == "BOOL" else int(kind[1:]) // 8)
               for shape, kind in header.values())


# Pages a swap-in read from the file's map stay in RSS until the map closes: reopening the file
# every CHUNK bytes bounds that transient to CHUNK instead of a whole teacher.
CHUNK = 64 << 20


def _read(files: list[Path], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as h:
            names = list(h.keys())
        while names:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                copied = 0
                while names and copied < CHUNK:
                    name = names.pop(0)
                    t = h.get_tensor(name)
                    # copy=True: own the memory, so closing the map really drops the file pages
                    out[name] = t.to(dtype if t.is_floating_point() else t.dtype, copy=True)
                    copied += t.numel() * t.element_size()
                    del t
    return out


def _pinned(files: list[Path], dtype: str, device: torch.device):
    host = {name: t.pin_memory() for name, t in _read(files, DTYPES[dtype]).items()}

    def fetch() -> dict[str, torch.Tensor]:
        out = {name: t.to(device, non_blocking=True) for name, t in host.items()}
        torch.cuda.current_stream(device).synchronize()   # the forward must not see half-copied weights
        return out
    return fetch


OFFLOADS = {"cpu": lambda files, dtype, device: partial(_read, files, DTYPES[dtype]), "cuda": _pinned}
