"""AgentFlow rollout stage: prompt rows -> trajectories, by running an agent per sample.

Input columns:  prompt_id, group_id, sample_idx, prompt
Output columns: prompt_ids, response_ids, response_logprobs, loss_mask, token_versions,
                version_start, version_end, status, error, t_dispatch, t_done

Why it exists: every agent, white-box or black-box, reaches the engines through here, so
the window gate, engine affinity, timeouts and per-token versions live in one place.
Before generating a group the stage asks the window gate; it never runs ahead of the
staleness bound. A failing agent marks its own row `failed` and the batch goes on.
"""
from __future__ import annotations

import asyncio
import importlib
import time
import traceback
from dataclasses import dataclass

import pyarrow as pa
import ray

from pipeline.schema import with_columns
from stages.agentflow.agent import AgentContext, SingleTurnAgent
from stages.agentflow.client import Affinity

BUILTIN_AGENTS = {"single_turn": SingleTurnAgent}


@dataclass(frozen=True)
class RolloutConfig:
    n_samples: int = 8                 # N: samples per prompt (a group)
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    agent: str = "single_turn"         # built-in name or dotted path to an Agent class
    num_engines: int = 1
    engine_threads: int = 0            # torch threads per engine; 0 = decided by pipeline/resources.py
    num_workers: int = 1               # rollout worker actors (asyncio inside each)
    groups_per_batch: int = 0          # groups per worker call; 0 = one step's groups
    stale_steps: float = 0.0           # 0 = synchronous on-policy
    window: str = "no-window"          # no-window | window-gated | windowed-fifo | dotted path
    timeout_s: float = 300.0           # per trajectory
    partial: str = "interrupt"         # at a weight update: interrupt (continue under new weights) | wait
    partial_mask_old: bool = False     # mask tokens generated before the sample's last update out of the loss

    def __post_init__(self):
        for k in ("n_samples", "max_new_tokens", "num_engines", "num_workers"):
            if getattr(self, k) <= 0:
                raise ValueError(f"rollout.{k} must be > 0, got {getattr(self, k)}")
        if self.groups_per_batch < 0:
            raise ValueError(f"rollout.groups_per_batch must be >= 0, got {self.groups_per_batch}")
        if self.stale_steps < 0:
            raise ValueError(f"rollout.stale_steps must be >= 0, got {self.stale_steps}")
        if self.partial not in ("interrupt", "wait"):
            raise ValueError(f"rollout.partial must be interrupt or wait, got {self.partial!r}")
        if self.temperature < 0:
            raise ValueError(f"rollout.temperature must be >= 0, got {self.temperature}")


def load_agent(name: str):
    if name in BUILTIN_AGENTS:
        return BUILTIN_AGENTS[name]()
    mod, _, attr = name.replace(":", ".").rpartition(".")
    try:
        return getattr(importlib.import_module(mod), attr)()
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"rollout.agent {name!r} does not import: {e}") from e


class AgentFlowRollout:
    inputs = ("prompt_id", "group_id", "sample_idx", "prompt")
    outputs = ("prompt_ids", "response_ids", "response_logprobs", "loss_mask", "token_versions",
               "version_start", "version_end", "status", "error", "t_dispatch", "t_done")

    def __init__(self, cfg: RolloutConfig, engines: list, gate=None, model_path: str = ""):
        from stages.model import load_tokenizer

        self.cfg = cfg
        self.gate = gate
        self.tok = load_tokenizer(model_path)
        self.agent = load_agent(cfg.agent)
        self.affinity = Affinity(engines)
        self.sampling = {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "top_p": cfg.top_p,
                         "hold": cfg.partial == "wait"}
        self.loop = asyncio.new_event_loop()

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        if self.gate is not None:
            seqs = sorted({r["group_id"] for r in rows})
            if ray.get(self.gate.acquire.remote(seqs)) < 0:   # window closed: the run is stopping
                return with_columns(batch, _columns([_aborted() for _ in rows]))
        results = self.loop.run_until_complete(self._all(rows))
        return with_columns(batch, _columns(results))

    async def _all(self, rows: list[dict]) -> list[dict]:
        return await asyncio.gather(*(self._one(r) for r in rows))

    async def _one(self, row: dict) -> dict:
        t0 = time.time()
        try:
            prompt_ids = self.tok(row["prompt"], add_special_tokens=False)["input_ids"]
            ctx = AgentContext(self.affinity.for_group(row["group_id"]), self.tok, prompt_ids, dict(self.sampling))
            await asyncio.wait_for(self.agent.run(ctx, row), timeout=self.cfg.timeout_s)
            out = ctx.result() | {"prompt_ids": prompt_ids, "error": ""}
        except asyncio.TimeoutError:
            out = _failed(f"agent timed out after {self.cfg.timeout_s}s")
        except Exception as e:  # noqa: BLE001 - one row fails, never the batch
            out = _failed(f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
        return out | {"t_dispatch": t0, "t_done": time.time()}


def _failed(error: str, status: str = "failed") -> dict:
    return {"prompt_ids": [], "response_ids": [], "response_logprobs": [], "loss_mask": [], "token_versions": [],
            "version_start": -1, "version_end": -1, "status": status, "error": error}


def _aborted() -> dict:
    return _failed("window closed before dispatch", "aborted") | {"t_dispatch": time.time(), "t_done": time.time()}


def _columns(results: list[dict]) -> dict[str, list]:
    return {k: [r[k] for r in results] for k in AgentFlowRollout.outputs}
