"""Built-in tasks: deterministic synthetic prompt sets with exact answers, offline.

A task is a small object with `name`, `make_rows(split, size, seed) -> list[dict]`
(each row has `prompt` and `answer`) and `vocab` (the characters its prompts and answers
use). `data.path: builtin:NAME` reads a task instead of a file. A task may also define
`demonstration(row) -> [(text, trained?), ...]`: the built-in model's SFT warm-up then
learns that multi-turn trajectory (e.g. tool calls and results) instead of the bare answer.
"""
from __future__ import annotations

from stages.tasks.arith import Addition3Task, AdditionTask, MultiplicationTask, ReverseTask
from stages.tasks.code import ProductTask

TASKS = {t.name: t for t in (AdditionTask, Addition3Task, MultiplicationTask, ReverseTask, ProductTask)}


def get_task(name: str, **kwargs):
    if name not in TASKS:
        raise ValueError(f"unknown built-in task {name!r}; built-in tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name](**kwargs)
