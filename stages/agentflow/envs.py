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
