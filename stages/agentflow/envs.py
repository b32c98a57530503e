"""Environments for white-box agents: `step(action text) -> Step` (or an awaitable of one), built per
trajectory from its sample and driven by `await ctx.step(env, action)` (stages/agentflow/agent.py). The
rewards add up into the trajectory's agent reward, which the Reward stage uses instead of its reward function.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Step:
    observation: str = ""
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


class RetryEnv:
    """A question with an exact answer; a wrong answer gets the question again.

    Reward `decay ** (attempt - 1)` for the first correct attempt (1, 0.5, 0.25, ...), 0 if
    every attempt fails, so answering right the first time is always best. Works on any
    built-in task row (`prompt`, `answer`) and spells nothing outside the task's alphabet.
    """

    def __init__(self, sample: dict, max_attempts: int = 3, decay: float = 0.5):
        self.question, self.answer = sample["prompt"], str(sample.get("answer", "")).strip()
        self.max_attempts, self.decay = max_attempts, decay
        self.attempts = 0

    def step(self, action: str) -> Step:
        self.attempts += 1
        if action.strip() == self.answer:
            return Step(reward=self.decay ** (self.attempts - 1), done=True, info={"attempts": self.attempts})
        if self.attempts >= self.max_attempts:
            return Step(done=True, info={"attempts": self.attempts})
        return Step(observation=self.question)
