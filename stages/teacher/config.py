"""The `teacher:` section of a recipe: which teachers exist, who serves which data source, and how
many may be resident at once; empty `teachers`: no teacher stage. What needs no file is checked
here; `manager.check_teachers` checks the rest (directories, weights, tokenizers, budget) at start.
"""
from __future__ import annotations

from stages.keys import NONNEG, POSITIVE, key, one_of, section

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


class TeacherError(ValueError):
    """A teacher set-up problem found at start; the message names the teacher or data source."""


@section("teacher")
class TeacherConfig:
    teachers: dict[str, str] = key({}, "teacher id -> local HF directory (safetensors)")
    routes: dict[str, str] = key({}, "data_source -> teacher id")
    default: str = key("", 'teacher id for a data_source not in routes; "" = such a source is an error')
    max_resident: int = key(0, "teachers resident at once (0 = no limit by count)", NONNEG)
    max_resident_bytes: int = key(0, "bytes of resident teacher weights (0 = no limit by bytes)", NONNEG)
    top_k: int = key(0, "> 0: also write the teacher's top-k per position (GKD-style losses)", NONNEG)
    temperature: float = key(1.0, "teacher log-probs are of logits / temperature", POSITIVE)
    dtype: str = key("float32", "dtype teachers are held and run in (the files may differ)", one_of(*DTYPES))
    device: str = key("auto", "auto = cuda when the actor sees a GPU, else cpu", one_of(*DEVICES))
    micro_batch: int = key(64, "rows per teacher forward pass", POSITIVE)
    logprob_chunk: int = key(256, "response positions whose logits exist at once: the teacher's LM head runs on "
                                  "response positions only, this many at a time (as trainer.logprob_chunk), never on "
                                  "[sequence, vocabulary]; 0 = a micro-batch's positions at once", NONNEG)
    workers: int = key(1, "scoring actors; each holds its own resident set, so the budget is per actor", POSITIVE)

    def __post_init__(self):
        for name in ("teachers", "routes"):
            bad = [(k, v) for k, v in getattr(self, name).items() if not isinstance(v, str) or not v]
            if bad:
                raise TeacherError(f"teacher.{name}.{bad[0][0]} must be a non-empty string, got {bad[0][1]!r}")
        for source, tid in self.routes.items():
            if tid not in self.teachers:
                raise TeacherError(f"teacher.routes.{source} names teacher {tid!r}, which is not in teacher.teachers "
                                   f"(known: {', '.join(self.teachers) or 'none'})")
        if self.default and self.default not in self.teachers:
            raise TeacherError(f"teacher.default {self.default!r} is not in teacher.teachers "
                               f"(known: {', '.join(self.teachers) or 'none'})")

    @property
    def enabled(self) -> bool:
        return bool(self.teachers)

    def route(self, data_source: str) -> str:
        """The teacher id for a data source; TeacherError when neither a route nor a default exists."""
        tid = self.routes.get(data_source, self.default)
        if not tid:
            raise TeacherError(f"data_source {data_source!r} has no teacher: add teacher.routes.{data_source} "
                               f"or set teacher.default (routed sources: {', '.join(self.routes) or 'none'})")
        return tid
