"""Cost models the planner's simulation runs on: engines, trainer, weight sync, pipeline stages.

Their numbers come from a run's profile (calibrate.py) or a cluster file's preset (cluster.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field


class PlanError(ValueError):
    """Bad planner input: the message names the file and the key."""


@dataclass(frozen=True)
class EngineModel:
    """One rollout engine under continuous batching, as a roofline-shaped decode iteration.

    A decode iteration gives every running sequence one token and takes
        base_s + per_seq_s * running + per_ctx_token_s * (context tokens held by the running)
    (weights read once per iteration; per-sequence compute; KV cache read per held token).
    A new turn first costs its prefill tokens * prefill_per_token_s of engine time.
    `call_s` is a turn's fixed latency outside the engine (client round trip, scheduling).
    """
    base_s: float
    per_seq_s: float = 0.0
    per_ctx_token_s: float = 0.0
    prefill_per_token_s: float = 0.0
    call_s: float = 0.0
    max_running: int = 0          # sequences decoded at once (0 = no limit)
    kv_tokens: int = 0            # KV-cache capacity in tokens (0 = no limit): admission stops past it
    prefix_cache: bool = True     # a later turn prefills only its new tokens (SGLang's radix cache)

    def iter_s(self, running: int, ctx_tokens: float) -> float:
        return self.base_s + self.per_seq_s * running + self.per_ctx_token_s * ctx_tokens


@dataclass(frozen=True)
class TrainerModel:
    """Seconds per update: fixed_s + per_token_s * tokens (tokens: response tokens trained, or all
    tokens of the batch when `all_tokens`; the FLOPs form sets per_token_s = factor * params /
    (gpus * peak * MFU))."""
    fixed_s: float
    per_token_s: float
    all_tokens: bool = False
    source: str = ""

    def step_s(self, prompt_tokens: float, response_tokens: float) -> float:
        tokens = response_tokens + (prompt_tokens if self.all_tokens else 0.0)
        return self.fixed_s + self.per_token_s * tokens


@dataclass(frozen=True)
class SyncModel:
    """Weight sync after each update: fixed_s + bytes / bandwidth (the slowest route's); engines
    stop decoding while it lands."""
    fixed_s: float
    bytes: float = 0.0
    bandwidth_B_s: float = float("inf")
    route: str = ""

    @property
    def seconds(self) -> float:
        return self.fixed_s + self.bytes / self.bandwidth_B_s


@dataclass(frozen=True)
class StageCosts:
    """What sits between the engines and the trainer: reward scoring, the stream's hand-off of a
    finished block to the batcher, and the gate-to-generation latency of a dispatch."""
    reward_fixed_s: float = 0.0
    reward_per_row_s: float = 0.0
    handoff_s: float = 0.0
    dispatch_s: float = 0.0
    reward_workers: int = 1


@dataclass(frozen=True)
class Layout:
    """Where things run: how many engines, and whether they share GPUs with the trainer (colocated:
    generation stops while the trainer updates and syncs)."""
    engines: int = 1
    colocate: bool = False
    description: str = ""


@dataclass(frozen=True)
class Costs:
    engine: EngineModel
    trainer: TrainerModel
    sync: SyncModel
    stages: StageCosts = field(default_factory=StageCosts)
    layout: Layout = field(default_factory=Layout)
    sources: dict = field(default_factory=dict)     # cost -> where its numbers came from
