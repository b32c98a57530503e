"""TeacherManager: K frozen teachers, at most a budget of them resident (`max_resident` teachers and/or
`max_resident_bytes`), swapped LRU: before a swap-in the least recently used are evicted until the
newcomer fits, so the budget is never exceeded.

Every teacher's module is built once at start; offloading it swaps each parameter's storage for
an empty placeholder, swapping it in assigns the tensors its offload store fetches (offload.py).
Parameter objects never change, so tied weights stay tied and log-probs stay bit-identical.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stages.model import load_model, load_tokenizer
from stages.teacher.config import TeacherConfig, TeacherError
from stages.teacher.offload import OFFLOADS, read_header, resident_nbytes, weight_files


@dataclass(frozen=True)
class TeacherSpec:
    id: str
    path: str
    files: list[Path]
    names: frozenset[str]    # tensor names in the weight files
    nbytes: int              # resident size in the configured dtype


@dataclass
class Swap:
    """What acquires cost: one call's (TeacherManager.acquire) or, summed, a manager's (its stats)."""
    swaps_in: int = 0
    swaps_out: int = 0
    bytes_in: int = 0
    seconds: float = 0.0        # one acquire's, in and out (the stats sum seconds_in and seconds_out)
    seconds_in: float = 0.0
    seconds_out: float = 0.0
    hits: int = 0
    peak_resident_bytes: int = 0
    history: list[str] = field(default_factory=list)   # "+id" / "-id": swaps in and out, in order


# ---- start-up checks: no weights are loaded here, only headers, configs and tokenizers --------

def _check_tokenizer(tid: str, path: str, student_tok) -> None:
    """A teacher without its own tokenizer shares the student's; one with its own must match it."""
    p = Path(path)
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return
    try:
        tok = load_tokenizer(path)
    except ValueError as e:
        raise TeacherError(f"teacher {tid!r}: {e}") from e
    theirs, ours = tok.get_vocab(), student_tok.get_vocab()
    if theirs != ours:
        diff = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda kv: kv[1])[0][0]
        raise TeacherError(
            f"teacher {tid!r} ({path}): its tokenizer does not match the student's ({len(theirs)} vs {len(ours)} "
            f"tokens; token {diff!r} is id {theirs.get(diff, 'absent')} in the teacher, "
            f"{ours.get(diff, 'absent')} in the student). Teachers score the student's token ids, so they must "
            f"share its vocabulary (stages/tasks/make_teacher.py builds both on one shared vocabulary)")
    if tok.eos_token_id != student_tok.eos_token_id:
        raise TeacherError(f"teacher {tid!r} ({path}): eos id {tok.eos_token_id} != student's "
                           f"{student_tok.eos_token_id}")


def _spec(tid: str, path: str, dtype: str, student_tok) -> TeacherSpec:
    p = Path(path)
    if not p.is_dir():
        raise TeacherError(f"teacher {tid!r}: directory {path!r} does not exist or is not a directory")
    if not (p / "config.json").is_file():
        raise TeacherError(f"teacher {tid!r}: {path} has no config.json (not an HF model directory)")
    _check_tokenizer(tid, path, student_tok)
    files = weight_files(tid, path)
    header = read_header(tid, files)
    return TeacherSpec(tid, path, files, frozenset(header), resident_nbytes(header, dtype))


def check_teachers(cfg: TeacherConfig, student_dir: str, sources=()) -> dict[str, TeacherSpec]:
    """Every start-up check: dirs, weights, tokenizers, budget vs sizes, every source routed."""
    student_tok = load_tokenizer(student_dir)
    specs = {tid: _spec(tid, path, cfg.dtype, student_tok) for tid, path in cfg.teachers.items()}
    if cfg.max_resident_bytes:
        big = max(specs.values(), key=lambda s: s.nbytes)
        if big.nbytes > cfg.max_resident_bytes:
            raise TeacherError(f"teacher.max_resident_bytes={cfg.max_resident_bytes} is smaller than teacher "
                               f"{big.id!r} ({big.nbytes} bytes in {cfg.dtype}): it could never be resident")
    if unrouted := sorted({s for s in sources if not cfg.routes.get(s, cfg.default)}):
        raise TeacherError(f"data_source {', '.join(map(repr, unrouted))} has no teacher: add "
                           f"teacher.routes.<source> or set teacher.default "
                           f"(routed: {', '.join(cfg.routes) or 'none'})")
    return specs


# ---- the manager -------------------------------------------------------------------------------

class _Teacher:
    def __init__(self, spec: TeacherSpec, dtype: str, device: torch.device):
        self.model = load_model(spec.path, dtype)           # validates that the files load as this model
        self.params = dict(self.model.named_parameters())   # deduplicated: a tied weight appears once
        missing, extra = set(self.params) - spec.names, spec.names - set(self.params)
        if missing or extra:
            raise TeacherError(f"teacher {spec.id!r} ({spec.path}): weight names do not match the model "
                               f"(missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]})")
        self.fetch = OFFLOADS[device.type](spec.files, dtype, device)
        self.drop()
        self.model.to(device)    # moves the (small, computed) buffers; parameters are placeholders now
        self.model.requires_grad_(False)

    def drop(self) -> None:
        for p in self.params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def load(self) -> None:
        tensors = self.fetch()
        for name, p in self.params.items():
            p.data = tensors[name]


class TeacherManager:
    def __init__(self, cfg: TeacherConfig, student_dir: str):
        self.cfg = cfg
        name = cfg.device if cfg.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
        if name == "cuda" and not torch.cuda.is_available():
            raise TeacherError("teacher.device=cuda but this actor sees no CUDA device")
        self.device = torch.device(name, torch.cuda.current_device()) if name == "cuda" else torch.device("cpu")
        self.specs = check_teachers(cfg, student_dir)
        self.teachers = {tid: _Teacher(s, cfg.dtype, self.device) for tid, s in self.specs.items()}
        self.resident: OrderedDict[str, None] = OrderedDict()   # least recently used first
        self.stats = Swap()

    @property
    def resident_bytes(self) -> int:
        return sum(self.specs[t].nbytes for t in self.resident)

    def order(self, tids) -> list[str]:
        """Visit order for one batch: resident teachers first (no swap), then the others."""
        tids = list(dict.fromkeys(tids))
        return [t for t in self.resident if t in tids] + [t for t in tids if t not in self.resident]

    def _fits(self, tid: str) -> bool:
        c = self.cfg
        count_ok = not c.max_resident or len(self.resident) + 1 <= c.max_resident
        bytes_ok = not c.max_resident_bytes or self.resident_bytes + self.specs[tid].nbytes <= c.max_resident_bytes
        return count_ok and bytes_ok

    def acquire(self, tid: str):
        """The teacher's model, resident on the device; (model, Swap) with what it cost."""
        s, swap = self.stats, Swap()
        if tid in self.resident:
            self.resident.move_to_end(tid)
            s.hits += 1
            return self.teachers[tid].model, swap
        t0 = time.perf_counter()
        while self.resident and not self._fits(tid):
            old, _ = self.resident.popitem(last=False)
            self.teachers[old].drop()
            swap.swaps_out += 1
            s.history.append(f"-{old}")
        t1 = time.perf_counter()
        self.teachers[tid].load()
        self.resident[tid] = None
        t2 = time.perf_counter()
        swap.swaps_in, swap.bytes_in, swap.seconds = 1, self.specs[tid].nbytes, t2 - t0
        s.swaps_in, s.swaps_out, s.bytes_in = s.swaps_in + 1, s.swaps_out + swap.swaps_out, s.bytes_in + swap.bytes_in
        s.seconds_out, s.seconds_in = s.seconds_out + t1 - t0, s.seconds_in + t2 - t1
        s.history.append(f"+{tid}")
        s.peak_resident_bytes = max(s.peak_resident_bytes, self.resident_bytes)
        return self.teachers[tid].model, swap
