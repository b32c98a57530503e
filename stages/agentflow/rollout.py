"""AgentFlow rollout stage: prompt rows -> trajectories, by running an agent per sample.

Columns: AgentFlowRollout.inputs -> .outputs; agent_reward null = none (reward.fn decides), agent_info and
transcript (a list of {role, content}) are JSON, agent_stats.fail is ""|timeout|exit|error, segment is the
row's place in the trajectory's segment tree, segment_stats is for black-box agents.

A trajectory makes one row per segment of a kind in `agent.train_segments` (default all
three kinds): an append-only conversation is one segment, hence one row; compaction,
subagents and templates that rewrite history make more. The rows share the sample's
group_id, sample_idx and reward; the trainer counts a sample once in its group's
statistics (stages/update/trainer.py: row weights).

Why it exists: every agent, white-box or black-box, reaches the engines through here, so
the window gate, engine affinity, timeouts, turn limits and per-token versions live in
one place. Before generating a group the stage asks the window gate; it never runs ahead
of the staleness bound. Agents run concurrently on one asyncio loop per worker; black-box
agents reach the engines through this worker's proxy (stages/agentflow/proxy.py), which
lives on the same loop. A failing agent marks its own row `failed` and the batch goes on.
A row's prompt is plain text, or chat messages as a JSON list rendered by the chat template.
"""
from __future__ import annotations

import asyncio
import functools
import json
import time
import traceback

import pyarrow as pa
import ray

from stages.agentflow.agent import AgentContext, SingleTurnAgent
from stages.agentflow.blackbox import AgentExit, SubprocessAgent
from stages.agentflow.chat import encode, ensure_chat_template, normalise_messages, render
from stages.agentflow.client import Affinity
from stages.agentflow.config import AgentConfig, ProxyConfig, RolloutConfig, SamplingConfig
from stages.agentflow.engine_config import EngineConfig
from stages.agentflow.limits import PromptLimit
from stages.keys import import_object
from stages.priority import lower_priority
from stages.schema import with_columns


def load_agent(name: str, preload: tuple = ()):
    """An Agent from `agent.name`; every way it can be wrong is a ValueError naming it."""
    from stages.tasks.agents import BUILTIN_AGENTS

    if name in (builtin := {"single_turn": SingleTurnAgent, **BUILTIN_AGENTS}):
        return builtin[name]()
    if name.startswith("cmd:"):
        return SubprocessAgent(name[4:].strip(), preload)
    try:
        obj = import_object(name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"agent.name {name!r} does not import: {e} (built-in agents: "
                         f"{', '.join(builtin)}; or a dotted path, or cmd:<command>)") from e
    agent = obj() if isinstance(obj, type) else obj
    if not asyncio.iscoroutinefunction(getattr(agent, "run", None)):
        raise ValueError(f"agent.name {name!r} is not an Agent: it needs `async def run(self, ctx, sample)`")
    return agent


class AgentFlowRollout:
    tasks_in_flight = 1    # one queued call per worker: blocks reach the window gate in stream order
    inputs = ("prompt_id", "group_id", "sample_idx", "prompt")
    outputs = ("prompt_ids", "response_ids", "response_logprobs", "loss_mask", "token_versions",
               "version_start", "version_end", "status", "error", "t_dispatch", "t_done", "agent_reward", "agent_info",
               "transcript", "agent_stats", "segment", "segment_stats", "proxy_notes")
    sections = ("rollout", "sampling", "agent", "proxy", "engine", "sandbox", "tool_service")   # its keywords

    def __init__(self, engines: list, gate=None, model_path: str = "", tokenizer_class: str = "", *,
                 rollout=RolloutConfig(), sampling=SamplingConfig(), agent=AgentConfig(), proxy=ProxyConfig(),
                 engine=EngineConfig(), sandbox=None, tool_service=None):
        """tokenizer_class: the class AutoTokenizer picks for model_path (stages/tokenizer.py), so that
        this worker loads it without importing torch. The keywords are the recipe's `sections`."""
        from stages.agentflow.proxy import Proxy
        from stages.tokenizer import load_tokenizer

        lower_priority(rollout.nice)
        self.cfg, self.gate, self.seed, self.retries = agent, gate, sampling.seed, engine.retries
        self.tok = ensure_chat_template(load_tokenizer(model_path, tokenizer_class))
        self.limit = PromptLimit.for_model(model_path, self.tok, sampling.max_prompt_tokens)
        self.agent = load_agent(agent.name, agent.preload)
        if hasattr(self.agent, "configure"):    # an agent with settings of its own (the sandbox and the jail's)
            self.agent.configure(agent, sandbox, tool_service)
        self.affinity = Affinity(engines)
        self.sampling = {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                         "top_p": sampling.top_p, "hold": rollout.partial == "wait"}
        self.loop = asyncio.new_event_loop()
        # prompt text -> ids, 4096 prompts kept (AgentContext copies them): a group's N samples share one prompt
        self._encode = functools.lru_cache(4096)(functools.partial(encode, self.tok))
        # started on first use, on self.loop: it serves while a batch runs, which is when agents call it
        self.proxy = Proxy(self.tok, proxy.host, proxy.port, int(proxy.max_body_mb * 2 ** 20), proxy.force_sampling,
                           self.limit)

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        if self.gate is not None:
            seqs = sorted({r["group_id"] for r in rows})
            if ray.get(self.gate.acquire.remote(seqs)) < 0:   # window closed: the run is stopping
                now = time.time()
                aborted = _failed("window closed before dispatch", "aborted") | _agent_columns(None, "", 0.0)
                return _table(batch, [[aborted | {"t_dispatch": now, "t_done": now}]] * len(rows))
        return _table(batch, self.loop.run_until_complete(self._all(rows)))

    def close(self) -> None:
        self.loop.run_until_complete(self.proxy.stop())
        if hasattr(self.agent, "aclose"):
            self.loop.run_until_complete(self.agent.aclose())

    async def _all(self, rows: list[dict]) -> list[list[dict]]:
        limit = asyncio.Semaphore(self.cfg.max_agents or len(rows) or 1)
        return await asyncio.gather(*(self._one(r, limit) for r in rows))

    def _seed(self, row: dict) -> int:
        """Each sample draws from its own stream: a resumed or replayed run samples the same tokens."""
        return (self.seed * 1_000_003 + int(row["group_id"]) * 1009 + int(row["sample_idx"])) % (2**63)

    def _context(self, row: dict) -> AgentContext:
        messages = _chat_prompt(row["prompt"])
        text = render(self.tok, messages) if messages else row["prompt"]
        self.limit.check_text(text)     # a hopeless prompt fails its row before it is tokenized
        return AgentContext(self.affinity.for_group(row["group_id"]), self.tok, self._encode(text),
                            dict(self.sampling, seed=self._seed(row)), prompt_text=text, messages=messages,
                            max_turns=self.cfg.max_turns, proxy=self.proxy, limit=self.limit,
                            max_tokens=self.cfg.max_trajectory_tokens)

    async def _one(self, row: dict, limit: asyncio.Semaphore) -> list[dict]:
        """One trajectory (a row per trained segment). If its engine dies meanwhile, it is run again from the
        start (same seed) once the engine is back: nothing half-made by a dead engine reaches training."""
        client = self.affinity.for_group(row["group_id"])
        for attempt in range(self.retries + 1):
            lost = client.lost
            out = await self._attempt(row, limit)
            if client.lost == lost or out[0]["status"] != "failed" or attempt == self.retries:
                break
            await asyncio.sleep(min(2.0 ** attempt, 10.0))   # the engine is restarting
        return out

    async def _attempt(self, row: dict, limit: asyncio.Semaphore) -> list[dict]:
        t_dispatch = time.time()
        async with limit:
            t0, ctx, fail = time.time(), None, ""
            try:
                ctx = self._context(row)
                await asyncio.wait_for(self.agent.run(ctx, row), timeout=self.cfg.timeout_s)
                outs = [r | {"error": ""} for r in ctx.results(self.cfg.train_segments)]
            except asyncio.TimeoutError:
                fail, outs = "timeout", [_failed(f"agent timed out after {self.cfg.timeout_s}s{_tail(ctx)}")]
            except Exception as e:  # noqa: BLE001 - one row fails, never the batch
                if ctx is not None and ctx.turn_limited:
                    # the turn limit ended the agent, however it then ended: keep what it made, as truncated
                    outs = [r | {"status": "truncated", "error": f"stopped by the turn limit: {type(e).__name__}: {e}"}
                            for r in ctx.results(self.cfg.train_segments)]
                elif isinstance(e, AgentExit):
                    fail, outs = "exit", [_failed(f"{e}{_tail(ctx)}")]
                else:
                    fail, outs = "error", [_failed(f"{type(e).__name__}: {e}{_tail(ctx)}\n"
                                                   f"{traceback.format_exc(limit=3)}")]
            if not outs:        # every segment is of a kind this recipe does not train
                fail, outs = "error", [_failed(f"the trajectory has no segment of a trained kind "
                                               f"(agent.train_segments={list(self.cfg.train_segments)}; it made "
                                               f"{', '.join(s.kind for s in ctx.tree)})")]
        common = _agent_columns(ctx, fail, time.time() - t0) | {"t_dispatch": t_dispatch, "t_done": time.time()}
        return [out | common for out in outs]


def _chat_prompt(prompt: str) -> list[dict] | None:
    """A prompt that is a JSON list of chat messages; None for plain text."""
    try:
        messages = json.loads(prompt) if prompt.lstrip().startswith("[") else None
    except ValueError:
        return None
    return normalise_messages(messages) if isinstance(messages, list) and messages and isinstance(messages[0], dict) \
        else None


def _tail(ctx) -> str:
    return f"\n--- agent stderr (tail) ---\n{ctx.detail}" if ctx is not None and ctx.detail else ""


def _agent_columns(ctx, fail: str, wall_s: float) -> dict:
    ok = ctx is not None and not fail
    return {"agent_reward": ctx.reward if ok else None, "agent_info": json.dumps(ctx.info if ok else {}),
            "transcript": json.dumps(ctx.transcript if ok else []),
            "agent_stats": {"turns": ctx.turns if ctx else 0, "tool_calls": ctx.tool_calls if ctx else 0,
                            "segments": ctx.segments if ctx else 0, "wall_s": wall_s,
                            "gen_s": ctx.gen_s if ctx else 0.0, "fail": fail},
            "segment_stats": (ctx.segment_stats or None) if ok else None,
            "proxy_notes": (ctx.proxy_notes or None) if ctx else None}


def _failed(error: str, status: str = "failed") -> dict:
    return {"prompt_ids": [], "response_ids": [], "response_logprobs": [], "loss_mask": [], "token_versions": [],
            "version_start": -1, "version_end": -1, "status": status, "error": error, "segment": None}


def _table(batch: pa.Table, results: list[list[dict]]) -> pa.Table:
    """The batch with the stage's columns set, typed by the trajectory schema: an input row is repeated
    once per segment row its trajectory made."""
    if any(len(r) != 1 for r in results):
        batch = batch.take([i for i, r in enumerate(results) for _ in r])
    flat = [row for r in results for row in r]
    return with_columns(batch, {k: [r[k] for r in flat] for k in AgentFlowRollout.outputs})
