"""Digit-string tasks: addition, multiplication by a single digit, string reversal, and
three-term addition solved with the calculator tool.

Prompts are plain character strings like "37+482=" and answers are exact strings, so an
exact-match reward needs no parsing. Rows are drawn without replacement from the task's
finite pool with a seeded generator, and the test split is disjoint from train.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DIGITS = "0123456789"


@dataclass
class _PoolTask:
    """Subclasses set `name` and `vocab`; by default row idx is `terms` numbers joined by `op` ("12+34=" -> "46"),
    idx's digits in base 10 ** digits, and subclasses may override pool_size() and row(idx)."""
    digits: int = 3
    op, terms = "+", 2

    def pool_size(self) -> int:
        return (10 ** self.digits) ** self.terms

    def row(self, idx: int) -> dict:
        n = 10 ** self.digits
        xs = [idx // n ** k % n for k in reversed(range(self.terms))]
        value = sum(xs) if self.op == "+" else math.prod(xs)
        return {"prompt": self.op.join(map(str, xs)) + "=", "answer": str(value)}

    def make_rows(self, split: str, size: int, seed: int = 0) -> list[dict]:
        """Test rows are the first `test` draws of one fixed permutation; train the rest."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be train or test, got {split!r}")
        n = self.pool_size()
        order = np.random.default_rng(20251202 + self.digits).permutation(n)
        test_n = min(500, n // 10)
        idx = order[:test_n] if split == "test" else order[test_n:]
        if size and size < len(idx):
            idx = np.random.default_rng(seed).choice(idx, size=size, replace=False) if split == "train" else idx[:size]
        return [self.row(int(i)) | {"data_source": self.name} for i in idx]


@dataclass
class AdditionTask(_PoolTask):
    name = "addition"
    vocab = DIGITS + "+="


@dataclass
class MultiplicationTask(_PoolTask):
    name = "multiplication"
    vocab = DIGITS + "*="

    def pool_size(self) -> int:
        return (10 ** self.digits) * 10

    def row(self, idx: int) -> dict:
        a, b = divmod(idx, 10)
        return {"prompt": f"{a}*{b}=", "answer": str(a * b)}


@dataclass
class ReverseTask(_PoolTask):
    name = "reverse"
    vocab = DIGITS + "<="

    def pool_size(self) -> int:
        return 10 ** (self.digits + 1)

    def row(self, idx: int) -> dict:
        s = str(idx).zfill(self.digits + 1)
        return {"prompt": f"{s}<=", "answer": s[::-1]}


@dataclass
class Addition3Task(_PoolTask):
    """Three-term addition, "12+34+56=" -> "102", for the calculator agent (agent.name: calculator).

    Its warm-up demonstrations (`demonstration`) are whole calculator-agent trajectories in
    the stream format of stages/tasks/agents.py: the model copies the first two terms
    as a calculator call, the tool returns their sum, the model adds the third term as a
    second call, the tool returns the total and the model answers it:

        12+34+56= | 12+34= | 46 | +56= | 102 | 102<eos>      prompt | model | tool | model | tool | model

    Only the model's pieces are trained (the tool's results are context, as in RL), so the
    warmed policy learns to call the tool, not to add: it never computes a sum itself.
    """
    name = "addition3"
    vocab = DIGITS + "+="
    terms = 3

    @staticmethod
    def demonstration(row: dict) -> list[tuple[str, bool]]:
        """[(text, trained?), ...] after the prompt; the final <eos> is trained too."""
        a, b, c = (int(x) for x in row["prompt"].rstrip("=").split("+"))
        return [(f"{a}+{b}=", True), (str(a + b), False), (f"+{c}=", True), (str(a + b + c), False),
                (str(a + b + c), True)]
