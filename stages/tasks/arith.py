"""Digit-string tasks: addition, multiplication by a single digit, string reversal.

Prompts are plain character strings like "37+482=" and answers are exact strings, so an
exact-match reward needs no parsing. Rows are drawn without replacement from the task's
finite pool with a seeded generator, and the test split is disjoint from train.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DIGITS = "0123456789"


@dataclass
class _PoolTask:
    digits: int = 3

    name = "base"
    vocab = DIGITS + "+="

    # subclasses define pool_size() -> int and row(idx) -> {"prompt", "answer"}

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

    def pool_size(self) -> int:
        return (10 ** self.digits) ** 2

    def row(self, idx: int) -> dict:
        a, b = divmod(idx, 10 ** self.digits)
        return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


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
