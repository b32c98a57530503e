"""Teachers for on-policy distillation: routed by data_source, resident within a budget; the update
stage turns their scores into a training signal (stages/update/distill.py). The manager's and the
scoring stage's names load on first use (PEP 562), so reading a `teacher:` section imports no torch.
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
    if algorithm.distill_coef and not teacher.enabled:
        raise TeacherError(f"algorithm.distill_coef={algorithm.distill_coef} needs teachers: set teacher.teachers "
                           f"(id: local HF directory)")
    if algorithm.distill_coef and algorithm.distill == "gkd" and not teacher.top_k:
        raise TeacherError("algorithm.distill=gkd needs the teachers' top-k: set teacher.top_k > 0")


__all__ = ["TeacherConfig", "TeacherError", "TeacherManager", "TeacherScoring", "check_teachers", "check_recipe",
           "teacher_metrics"]
