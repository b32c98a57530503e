"""Checkpoints you can trust: written atomically with a manifest, verified before a resume.

RUN/checkpoints/step_N is written into a new owner-only hidden directory beside it; every file is
fsynced, `manifest.json` records each file's size and xxh3-128 checksum, then the directory is
renamed into place: a crash or a full disk mid-write never leaves a half-written step_N. A resume
verifies the manifest and that every weight is finite before it trusts a checkpoint.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"step_(\d+)")
_CHUNK = 8 << 20


class CheckpointError(Exception):
    """A checkpoint that cannot be written or trusted; the message is one line for the user."""


def file_digest(path: Path, algorithm: str) -> str:
    """`algorithm`: xxh3_128 (what checkpoints are written with) or sha256 (older manifests)."""
    import xxhash

    h = xxhash.xxh3_128() if algorithm == "xxh3_128" else hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_no_space(e: BaseException) -> bool:
    """ENOSPC, raised here or in the trainer actor (Ray wraps it: its errno may not survive)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(e):
            return True
        e = getattr(e, "cause", None) or e.__cause__
    return False


def write(final: Path, fill: Callable[[Path], None]) -> Path:
    """Write a checkpoint at `final`: `fill(tmp)` writes the files into a new empty directory, which gets
    a manifest, is fsynced and renamed into place. A full disk is a one-line CheckpointError."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    for p in final.parent.glob(".step_*.*-*"):      # left by a writer that died mid-checkpoint (the run
        pid = p.name.rsplit("-", 1)[-1]             # directory's lock means no live one races us)
        if pid.isdigit() and int(pid) != os.getpid():
            shutil.rmtree(p, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", suffix=f"-{os.getpid()}", dir=final.parent))
    try:
        fill(tmp)
        files = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "xxh3_128": file_digest(p, "xxh3_128")}
                 for p in _files(tmp)}
        (tmp / MANIFEST).write_text(json.dumps({"format": 1, "algorithm": "xxh3_128", "files": files}, indent=1))
        for p in [*_files(tmp), tmp / MANIFEST, tmp]:
            _fsync(p)
        old = final.parent / f".{final.name}.old-{os.getpid()}"    # the same step saved again: swapped out first
        if final.exists():
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_no_space(e):
            before = newest_intact(final.parent, verify_weights=False)
            kept = f"; the previous checkpoint {before} is intact (run.resume_from={before})" if before else ""
            raise CheckpointError(f"checkpoint {final}: no space left on device (ENOSPC); nothing of it was "
                                  f"kept{kept}") from None
        raise
    return final


def verify(path: Path, verify_weights: bool = True) -> str | None:
    """Why the checkpoint at `path` cannot be trusted (one phrase naming the file), or None."""
    path = Path(path)
    if not path.is_dir():
        return "no such checkpoint directory"
    problem = _check_manifest(path) if (path / MANIFEST).is_file() else _check_legacy(path)
    return problem or (nonfinite_weights(path) if verify_weights else None)


def _check_manifest(path: Path) -> str | None:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        algorithm, files = manifest["algorithm"], manifest["files"]
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    for name, want in files.items():
        p = path / name
        if not p.is_file():
            return f"{name} is missing"
        size = p.stat().st_size
        if size != want["bytes"]:
            return f"{name} is {size} bytes, the manifest says {want['bytes']} (truncated or partial)"
        if file_digest(p, algorithm) != want[algorithm]:
            return f"{name} does not match its {algorithm} checksum (corrupt)"
    return None


def _check_legacy(path: Path) -> str | None:
    """A checkpoint from before manifests: the zip of trainer_state.pt must read whole (its CRCs)."""
    state = path / "trainer_state.pt"
    if state.is_file():
        try:
            with zipfile.ZipFile(state) as z:
                bad = z.testzip()
        except (zipfile.BadZipFile, OSError):
            return "trainer_state.pt is not a readable archive (truncated or corrupt)"
        if bad:
            return f"trainer_state.pt is corrupt (member {bad})"
    return None


def nonfinite_weights(path: Path) -> str | None:
    """The first safetensors file holding a NaN or infinite weight (or that cannot be read), tensor by tensor."""
    import torch
    from safetensors import SafetensorError, safe_open

    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    t = st.get_tensor(name)
                    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        return f"{f.name} holds non-finite weights (NaN or inf) in {name}"
        except (SafetensorError, OSError, RuntimeError) as e:
            return f"{f.name} cannot be read ({str(e).splitlines()[0][:120]})"
    return None


def steps(root: Path) -> list[tuple[int, Path]]:
    """The step_N checkpoints under `root`, newest first."""
    found = [(int(m.group(1)), p) for p in Path(root).glob("step_*") if (m := STEP_DIR.fullmatch(p.name))]
    return sorted(found, reverse=True)


def newest_intact(root: Path, below: int | None = None, verify_weights: bool = True) -> Path | None:
    for n, p in steps(root):
        if (below is None or n < below) and verify(p, verify_weights) is None:
            return p
    return None


def resolve(resume_from: str, run_dir: Path, log: Callable[[str], None] = print) -> Path:
    """The checkpoint a run resumes from, verified: a path, or `latest` (the run directory's newest intact).
    A path that fails is refused in one line naming the file at fault and the newest intact step before it."""
    if resume_from == "latest":
        root = Path(run_dir) / "checkpoints"
        for _, p in steps(root):
            problem = verify(p)
            if problem is None:
                return p
            log(f"run.resume_from=latest: skipping {p}: {problem}")
        raise CheckpointError(f"run.resume_from=latest: no intact checkpoint in {root}")
    path = Path(resume_from)
    problem = verify(path)
    if problem is None:
        return path
    m = STEP_DIR.fullmatch(path.name)
    before = newest_intact(path.parent, below=int(m.group(1))) if m else None
    hint = (f"; the newest intact checkpoint before it is {before} (run.resume_from={before})" if before
            else "; no intact checkpoint before it")
    raise CheckpointError(f"run.resume_from={path}: {problem}{hint}")


def resume_state(path: Path, model_path: str, lora: bool) -> tuple[dict, str]:
    """A verified checkpoint's resume state: controller.json (the clock and the settled groups), and the
    weights the run's actors start from: the checkpoint's own, or with LoRA the base its adapter was
    trained on (which must be this run's model). A ConfigError names what it lacks."""
    from pipeline.config import ConfigError
    from stages.lora import base_of, is_adapter_dir

    for f in ("adapter_config.json" if lora else "config.json", "trainer_state.pt", "controller.json"):
        if not (path / f).is_file():
            hint = ("; it holds a LoRA adapter: resume it with trainer.lora.enabled=true" if not lora and
                    is_adapter_dir(path) else "; it holds full weights, not a LoRA adapter (trainer.lora.enabled is "
                    "true)" if lora and (path / "config.json").is_file() else "")
            raise ConfigError(f"run.resume_from={path}: not a resumable checkpoint (no {f}){hint}")
    if lora and os.path.realpath(base_of(path)) != os.path.realpath(model_path):
        raise ConfigError(f"run.resume_from={path}: its adapter was trained on {base_of(path)}, this run's model is "
                          f"{model_path} (model.path, or the built-in model's settings)")
    return json.loads((path / "controller.json").read_text()), model_path if lora else str(path)
