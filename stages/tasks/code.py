"""Three-factor products ("37*48*29=" -> "51504"), solved by running code in the sandbox.

The tiny model cannot multiply in its head; it can copy. The built-in `sandbox` agent
(stages/tasks/agents.py: SandboxAgent) reads a model turn ending in ";" as a Python
snippet, runs it in the sandbox (stages/agentflow/sandbox/pool.py) and appends its output and "="
(or "?=" when the snippet failed); the model's next turn is its answer. A wrong answer gets
the question again, up to `max_attempts` attempts, reward 1, 1/2, 1/4, ... for the first right
one (stages/tasks/agents.py: RetryEnv), so trajectories run from 1 to max_attempts attempts:

    37*48*29= | 37*48*29; | 51504= | 51504<eos>                              one attempt
    37*48*29= | 37*46*29; | 49358= | 49358<eos> | 37*48*29= | 37*48*29; | 51504= | 51504<eos>

Warm-up demonstrations (`demonstration`) are such trajectories: with probability 1/2 one to
three failed attempts first (a mis-copied factor, its true product, that product answered),
then the right one. Only the right attempt's model pieces are trained; the failed attempts are
context, so the policy learns to recover after a wrong answer, never to make the mistake.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from stages.tasks.arith import DIGITS, _PoolTask


@dataclass
class ProductTask(_PoolTask):
    name = "product"
    vocab = DIGITS + "*=;?"
    op, terms = "*", 3
    context = 512          # model context of the built-in model: room for 12 attempts of 3 two-digit factors

    @staticmethod
    def demonstration(row: dict) -> list[tuple[str, bool]]:
        """[(text, trained?), ...] after the prompt; the final <eos> is trained too."""
        factors = row["prompt"].rstrip("=").split("*")
        rng = np.random.default_rng(zlib.crc32(row["prompt"].encode()))
        demo: list[tuple[str, bool]] = []
        fails = int(rng.integers(1, 4)) if rng.random() < 0.5 else 0
        for _ in range(fails):
            wrong = list(factors)
            i = int(rng.integers(len(wrong)))
            wrong[i] = str((int(wrong[i]) + int(rng.integers(1, 10))) % 10 ** len(wrong[i]))
            value = str(int(np.prod([int(x) for x in wrong])))
            # eos ends an answer turn inside the stream, as the engine's turn does
            demo += [(f"{'*'.join(wrong)};", False), (f"{value}=", False), (value + "<eos>", False),
                     (row["prompt"], False)]
        answer = row["answer"]
        return demo + [(f"{'*'.join(factors)};", True), (f"{answer}=", False), (answer, True)]
