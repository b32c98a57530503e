"""Reward functions for tests/test_hardening_reward.py, in a module that imports only the
standard library: a reward worker process imports it, and its start-up is part of what the
tests time."""
from __future__ import annotations

import os
import time


def sleep_forever(prompt, response, answer, row):
    time.sleep(10 ** 6)


def hang_on_13(prompt, response, answer, row):
    if response == "13":
        time.sleep(10 ** 6)
    return float(response == answer)


def non_finite(prompt, response, answer, row):
    """NaN / inf in every form a reward fn can return them, and a finite reward for "2"."""
    return {"11": float("nan"), "12": float("inf"), "13": {"reward": float("-inf"), "note": "x"},
            "14": "1.5"}.get(response, 1.0)


def crash_on_13(prompt, response, answer, row):
    if response == "13":
        os._exit(7)     # the worker process dies mid-row
    return 0.5


def seed_echo(prompt, response, answer, row):
    """Reports the seed a reward fn is handed (tests/test_seeds.py)."""
    return {"reward": 0.0, "seed": row["seed"]}
