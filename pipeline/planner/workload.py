"""What a simulated rollout generates: per sample, its prompt and its turns.

A sample is `SampleSpec(prompt_tokens, turns)`, each turn `(gen_tokens, tool_tokens, tool_s)`:
the model decodes gen_tokens, then (except after the last turn) a tool answers after tool_s
seconds with tool_tokens of context. `RecordedLengths` resamples a recorded run's whole groups (a
hard prompt's long samples stay together); `ParametricLengths` draws response lengths from a
log-normal clipped at `max` (a clipped sample is a truncated one) whose clipped mean is `mean`.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.planner.model import PlanError


@dataclass(frozen=True)
class SampleSpec:
    prompt_tokens: int
    turns: tuple          # ((gen_tokens, tool_tokens, tool_s), ...)

    @property
    def response_tokens(self) -> int:
        return sum(g for g, _, _ in self.turns)


def turns_of(mask: list[int]) -> list[list[int]]:
    """A response's loss mask as turns [model tokens, tool tokens]: model runs (1) with the tool runs (0) after them."""
    turns: list[list[int]] = []
    for model, run in itertools.groupby(map(bool, mask)):
        n = sum(1 for _ in run)
        if model:
            turns.append([n, 0])
        elif turns:
            turns[-1][1] += n
    turns = turns or [[0, 0]]
    turns[-1][1] = 0          # nothing is answered after the last model turn
    return turns


def outside_generation_s(stats: dict) -> float:
    """A recorded sample's seconds outside generation (tools, the agent's own work)."""
    return max(0.0, float(stats.get("wall_s") or 0.0) - float(stats.get("gen_s") or 0.0))


def agent_turns(mask: list[int], stats: dict) -> tuple:
    """A recorded row's turns, each gap's wait the sample's time outside generation (agent_stats
    wall_s - gen_s) spread evenly over its gaps: a gap is a tool answer or a user turn, so dividing
    by tool calls would count that time again in every gap without one."""
    turns = turns_of(mask)
    gap_s = outside_generation_s(stats) / (len(turns) - 1) if len(turns) > 1 else 0.0
    return tuple((g, t, gap_s if k < len(turns) - 1 else 0.0) for k, (g, t) in enumerate(turns))


class RecordedLengths:
    """Groups of a recorded run, resampled with replacement."""

    def __init__(self, groups: list[list[SampleSpec]], source: str):
        if not groups:
            raise PlanError(f"{source}: no recorded groups to take lengths from")
        self.groups, self.source = groups, source

    @classmethod
    def open(cls, rollouts_dir: str | Path) -> "RecordedLengths":
        from pipeline.recorder import Recording, RecordingError

        path = Path(rollouts_dir)
        path = path / "rollouts" if (path / "rollouts").is_dir() else path
        try:
            rec = Recording.open(path)
            columns = ["group_id", "sample_idx", "prompt_ids", "response_ids", "loss_mask"]
            if "agent_stats" in rec.read_step(rec.steps[0]).column_names:
                columns.append("agent_stats")
            t = rec.read(columns=columns)
        except RecordingError as e:
            raise PlanError(f"--lengths {rollouts_dir}: {e}") from e
        d = t.to_pydict()
        first: dict = {}      # an agent's later segment rows: the first row stands for the sample
        for i, sample in enumerate(zip(d["step"], d["group_id"], d["sample_idx"])):
            first.setdefault(sample, i)
        stats = d.get("agent_stats") or [None] * len(d["step"])
        by_group: dict = {}
        for (step, g, _), i in first.items():
            spec = SampleSpec(len(d["prompt_ids"][i]), agent_turns(d["loss_mask"][i], stats[i] or {}))
            by_group.setdefault((step, g), []).append(spec)
        return cls(list(by_group.values()), str(path))

    def group(self, rng: np.random.Generator, n: int) -> list[SampleSpec]:
        g = self.groups[rng.integers(len(self.groups))]
        return [g[i % len(g)] for i in range(n)]

    def describe(self) -> str:
        lens = [s.response_tokens for g in self.groups for s in g]
        turns = [len(s.turns) for g in self.groups for s in g]
        return (f"recorded {self.source}: {len(self.groups)} groups, response tokens mean {np.mean(lens):.1f} "
                f"max {max(lens)}, turns mean {np.mean(turns):.2f}")


def _clipped_lognormal_mean(mu: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for X ~ LogNormal(mu, sigma)."""
    z = (math.log(cap) - mu) / sigma
    phi = 0.5 * (1 + math.erf((z - sigma) / math.sqrt(2)))
    tail = 0.5 * (1 - math.erf(z / math.sqrt(2)))
    return math.exp(mu + sigma ** 2 / 2) * phi + cap * tail


@dataclass(frozen=True)
class ParametricLengths:
    mean: float
    max: int
    sigma: float = 0.8
    prompt: int = 256
    turns: int = 1
    tool_tokens: int = 0
    tool_s: float = 0.0

    def __post_init__(self):
        for k in ("mean", "max", "sigma", "prompt", "turns"):
            if getattr(self, k) <= 0:
                raise PlanError(f"lengths.{k} must be > 0, got {getattr(self, k)}")
        for k in ("tool_tokens", "tool_s"):
            if getattr(self, k) < 0:
                raise PlanError(f"lengths.{k} must be >= 0, got {getattr(self, k)}")
        if self.mean >= self.max:
            raise PlanError(f"lengths.mean ({self.mean}) must be below lengths.max ({self.max})")
        lo, hi = -20.0, math.log(self.max) + 5 * self.sigma
        for _ in range(100):        # bisection: the clipped mean grows with mu
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _clipped_lognormal_mean(mid, self.sigma, self.max) < self.mean else (lo, mid)
        object.__setattr__(self, "_mu", (lo + hi) / 2)

    @classmethod
    def parse(cls, text: str) -> "ParametricLengths":
        """`lognormal:mean=12700,max=32768[,sigma=0.8,prompt=256,turns=1,tool_tokens=0,tool_s=0]`"""
        kind, _, args = text.partition(":")
        if kind != "lognormal":
            raise PlanError(f"--lengths {text!r}: expected RUN/rollouts or lognormal:mean=...,max=...")
        kw = {}
        names = set(cls.__dataclass_fields__)
        for part in filter(None, args.split(",")):
            k, eq, v = part.partition("=")
            if not eq or k not in names:
                raise PlanError(f"--lengths {text!r}: unknown key {k!r} (keys: {', '.join(sorted(names))})")
            try:
                kw[k] = float(v) if k in ("mean", "sigma", "tool_s") else int(float(v))
            except ValueError:
                raise PlanError(f"--lengths {text!r}: {k}={v!r} is not a number") from None
        missing = [k for k in ("mean", "max") if k not in kw]
        if missing:
            raise PlanError(f"--lengths {text!r}: missing {', '.join(missing)}")
        return cls(**kw)

    def _one(self, rng: np.random.Generator) -> SampleSpec:
        total = int(min(self.max, max(1, round(rng.lognormal(self._mu, self.sigma)))))
        per = max(1, total // self.turns)
        gens = [per] * (self.turns - 1) + [max(1, total - per * (self.turns - 1))]
        turns = tuple((g, self.tool_tokens if i < self.turns - 1 else 0, self.tool_s if i < self.turns - 1 else 0.0)
                      for i, g in enumerate(gens))
        return SampleSpec(self.prompt, turns)

    def group(self, rng: np.random.Generator, n: int) -> list[SampleSpec]:
        return [self._one(rng) for _ in range(n)]

    def describe(self) -> str:
        return (f"log-normal responses: clipped mean {self.mean:.0f}, max {self.max}, sigma {self.sigma}, "
                f"prompt {self.prompt}, turns {self.turns}")
