"""Ray internals (pinned in pyproject.toml; checked by tests/test_compat.py)."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def pushed_errors_to(callback):
    """While the block runs, Ray's error listener thread hands each pushed error to
    `callback(data: dict, ignore_prefix: bool = False)` (data's "lines", "pid") instead of printing it:
    it calls `ray._private.worker.print_to_stdstream`, looked up at each call, which is replaced; Ray
    has no public hook for those lines. A Ray without it prints them as before."""
    from ray._private import worker

    printer = getattr(worker, "print_to_stdstream", None)
    if printer is not None:
        worker.print_to_stdstream = callback
    try:
        yield
    finally:
        if printer is not None:
            worker.print_to_stdstream = printer
