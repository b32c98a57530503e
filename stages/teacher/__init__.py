"""Teachers for on-policy distillation: routed by data_source, resident within a budget.

    config.py   TeacherConfig (the recipe's `teacher:` section), TeacherError
    offload.py  where an offloaded teacher waits: mmap'd safetensors (CPU) / pinned memory (GPU)
    manager.py  TeacherManager: start-up checks, routing, LRU residency, swap accounting
    scoring.py  TeacherScoring: the pipeline stage writing teacher_logprobs (+ top-k for GKD)

The update stage turns the scores into a training signal (stages/update/distill.py).
The manager's and the scoring stage's names are loaded on first use (PEP 562), so reading a
recipe's `teacher:` section does not import torch.
"""
import importlib

from stages.teacher.config import TeacherConfig, TeacherError

_WHERE = {"TeacherManager": "manager", "check_teachers": "manager", "TeacherScoring": "scoring",
          "teacher_metrics": "scoring"}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'stages.teacher' has no attribute {name!r}")
    return getattr(importlib.import_module(f"stages.teacher.{_WHERE[name]}"), name)


def check_recipe(teacher: TeacherConfig, algorithm) -> None:
    """Cross-section checks the controller runs at start: distillation needs teachers, GKD needs top-k."""
    coef = getattr(algorithm, "distill_coef", 0.0)
    if coef and not teacher.enabled:
        raise TeacherError(f"algorithm.distill_coef={coef} needs teachers: set teacher.teachers "
                           f"(id: local HF directory)")
    if coef and getattr(algorithm, "distill", "pg") == "gkd" and not teacher.top_k:
        raise TeacherError("algorithm.distill=gkd needs the teachers' top-k: set teacher.top_k > 0")


__all__ = ["TeacherConfig", "TeacherError", "TeacherManager", "TeacherScoring", "check_teachers", "check_recipe",
           "teacher_metrics"]
