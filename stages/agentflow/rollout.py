"""AgentFlow rollout stage: prompt rows -> trajectories, by running an agent per sample.

Input columns:  prompt_id, group_id, sample_idx, prompt
Output columns: prompt_ids, response_ids, response_logprobs, loss_mask, token_versions,
                version_start, version_end, status, error, t_dispatch, t_done,
                agent_reward (float, null = none: reward.fn decides), agent_info (JSON),
                transcript (JSON list of {role, content}), agent_stats (struct: turns,
                tool_calls, segments, wall_s, gen_s, fail = ""|timeout|exit|error),
                segment (struct: id, kind, parent, start, agent: the row's place in the
                trajectory's segment tree), segment_stats (struct: segments by kind, prompt
                tokens reused / fresh, bytes of history re-sent; black-box agents)

A trajectory makes one row per segment of a kind in `rollout.train_segments` (default all
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

`rollout.agent` is a built-in name (single_turn, retry, calculator, sandbox), a dotted path to an
Agent class (or to an agent object, e.g. an `@openai_agent` function), or
`cmd:<command line>` for a subprocess black-box agent (stages/agentflow/blackbox.py).
A row's prompt is plain text, or chat messages as a JSON list rendered by the chat template.
"""
from __future__ import annotations

import asyncio
import importlib
import json
import os
import time
import traceback
from dataclasses import dataclass

import pyarrow as pa
import ray

from pipeline.keys import NONNEG, POSITIVE, at_least, between, key, one_of
from stages.agentflow.agent import AgentContext, SingleTurnAgent
from stages.agentflow.blackbox import AgentExit, SubprocessAgent
from stages.agentflow.chat import encode, ensure_chat_template, normalise_messages, render
from stages.agentflow.client import Affinity
from stages.agentflow.limits import PromptLimit
from stages.agentflow.sandbox import SandboxConfig
from stages.agentflow.session import KINDS
from stages.agentflow.tool_service import ToolServiceConfig
from stages.agentflow.workflows import CalculatorAgent, RetryAgent, SandboxAgent
from stages.priority import lower_priority
from stages.schema import with_columns

BUILTIN_AGENTS = {"single_turn": SingleTurnAgent, "retry": RetryAgent, "calculator": CalculatorAgent,
                  "sandbox": SandboxAgent}


@dataclass(frozen=True)
class RolloutConfig:
    n_samples: int = key(8, "N: samples per prompt (a group)", POSITIVE)
    max_new_tokens: int = key(8, "tokens per model turn (and the cap on a proxy call's max_tokens)", POSITIVE)
    max_prompt_tokens: int = key(0, "prompt tokens per model call; 0 = the model's context less one. A longer prompt "
                                    "fails its trajectory (white-box) or gets 400 context_length_exceeded (proxy)",
                                    NONNEG)
    temperature: float = key(1.0, "sampling temperature (0 = greedy)", NONNEG)
    top_p: float = key(1.0, "nucleus sampling: keep the smallest token set with this much probability",
                            between(0, 1, lo_open=True))
    agent: str = key("single_turn", 'built-in name | dotted path | "cmd:<command>" (subprocess black-box)')
    agent_preload: tuple = key((), 'modules a "cmd:python SCRIPT.py" agent imports, loaded once per worker in a zygote'
                                   " that forks each trajectory's process (stages/agentflow/zygote.py)")
    agent_sandbox: str = key("auto", '"cmd:" agents in a bubblewrap jail of their own (stages/agentflow/jail.py): '
                                     "auto: where bwrap runs (else a warning) | strict: refuse without | none",
                             one_of("auto", "strict", "none"))
    agent_home: str = key("", "a directory copied into each jailed agent's fresh HOME (harness config); "
                              '"" = an empty HOME')
    agent_binds: tuple = key((), "more host paths a jailed agent may read (its file system is the host's, read-only, "
                                 "less /tmp, /run and the user's home)")
    max_turns: int = key(8, "model turns (proxy calls) per trajectory; 0 = unlimited", NONNEG)
    max_trajectory_tokens: int = key(0, "black-box: completion tokens a trajectory may generate in all (a call's "
                                        "budget is clamped to what is left; spent, it ends as the turn limit ends "
                                        "it); 0 = off", NONNEG)
    max_agents: int = key(0, "agents running at once per worker; 0 = all of a batch", NONNEG)
    num_engines: int = key(1, "rollout engine actors", POSITIVE)
    engine: str = key("hf", "hf (embedded torch engine, any CPU) | vllm (`pip install .[vllm]`; `vllm:` section) | "
                            "sglang (GPU; `sglang:` section)", one_of("hf", "vllm", "sglang"))
    engine_threads: int = key(0, "torch threads per engine; 0 = decided by pipeline/resources.py", NONNEG)
    engine_batching: str = key("continuous", "hf engine: continuous (rows join/leave the running batch between decode "
                                             "steps) | static (one decode loop per call); stages/agentflow/engine.py",
                                             one_of("continuous", "static"))
    engine_max_rows: int = key(256, "hf engine, continuous: rows decoding at once (more wait in its queue)",
                                    at_least(1))
    kv_cache_mb: float = key(1024.0, "hf engine: its KV cache, the memory its running rows may hold (rows x the "
                                     "widest row's context + budget); a request that cannot fit alone fails", POSITIVE)
    num_workers: int = key(1, "rollout worker actors (asyncio inside each)", POSITIVE)
    groups_per_batch: int = key(0, "groups per worker call; 0 = one step's groups", NONNEG)
    stale_steps: float = key(0.0, "how many steps a group may lag the trainer's weights (0 = synchronous on-policy)",
                                  NONNEG)
    window: str = key("no-window", "no-window | window-gated | windowed-fifo | dotted path")
    timeout_s: float = key(300.0, "seconds per trajectory", POSITIVE)
    engine_restarts: int = key(3, "times Ray restarts a dead engine (its groups are re-run); -1 = always", at_least(-1))
    engine_retries: int = key(3, "re-runs of a trajectory whose engine died under it", NONNEG)
    partial: str = key("interrupt", "at a weight update: interrupt (continue under new weights) | wait",
                                    one_of("interrupt", "wait"))
    partial_mask_old: bool = key(False, "mask tokens generated before the sample's last update out of the loss")
    proxy_host: str = key("127.0.0.1", "black-box proxy bind address (loopback unless you mean it)")
    proxy_port: int = key(0, "black-box proxy port; 0 = any free port", between(0, 65535))
    proxy_max_body_mb: float = key(8.0, "larger request bodies get 413", POSITIVE)
    proxy_force_sampling: bool = key(False, "True: the rollout's temperature/top_p and seeds override an agent's "
                                            "request")
    seed: int = key(0, "set from run.seed (pipeline/seeds.py), not a recipe key; per sample: (seed, group, index); "
                       "per turn within it", NONNEG)
    train_segments: tuple = key(("main", "compaction", "subagent"), "segment kinds that become training rows "
                                                                    "(stages/agentflow/session.py): each segment of "
                                                                    "these kinds is its own row")
    sandbox: SandboxConfig = key(SandboxConfig, "code sandbox of the `sandbox` agent")
    tool_service: ToolServiceConfig = key(ToolServiceConfig, "the remote tool service (its latency p50/p99): the "
                                                             "sandbox agent's with sandbox.remote")
    nice: int = key(0, "niceness of engine and rollout/reward worker processes (0 = as started): > 0 lets the trainer,"
                       " an async run's bottleneck, keep its core", between(0, 19))

    def __post_init__(self):
        for k in ("n_samples", "max_new_tokens", "num_engines", "num_workers"):
            if getattr(self, k) <= 0:
                raise ValueError(f"rollout.{k} must be > 0, got {getattr(self, k)}")
        if self.engine_restarts < -1:
            raise ValueError(f"rollout.engine_restarts must be >= -1, got {self.engine_restarts}")
        for k in ("groups_per_batch", "max_turns", "max_agents", "proxy_port", "engine_retries", "max_prompt_tokens",
                  "max_trajectory_tokens"):
            if getattr(self, k) < 0:
                raise ValueError(f"rollout.{k} must be >= 0, got {getattr(self, k)}")
        if self.stale_steps < 0:
            raise ValueError(f"rollout.stale_steps must be >= 0, got {self.stale_steps}")
        if self.engine not in ("hf", "vllm", "sglang"):
            raise ValueError(f"rollout.engine must be hf, vllm or sglang, got {self.engine!r}")
        if self.engine_batching not in ("continuous", "static"):
            raise ValueError(f"rollout.engine_batching must be continuous or static, got {self.engine_batching!r}")
        if self.engine_max_rows < 1:
            raise ValueError(f"rollout.engine_max_rows must be >= 1, got {self.engine_max_rows}")
        if not self.kv_cache_mb > 0:
            raise ValueError(f"rollout.kv_cache_mb must be > 0, got {self.kv_cache_mb}")
        if self.partial not in ("interrupt", "wait"):
            raise ValueError(f"rollout.partial must be interrupt or wait, got {self.partial!r}")
        if self.temperature < 0:
            raise ValueError(f"rollout.temperature must be >= 0, got {self.temperature}")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"rollout.nice must be in 0..19, got {self.nice}")
        kinds = (self.train_segments,) if isinstance(self.train_segments, str) else tuple(self.train_segments)
        bad = [k for k in kinds if k not in KINDS]
        if bad or not kinds:
            raise ValueError(f"rollout.train_segments must name some of {', '.join(KINDS)}, "
                             f"got {self.train_segments!r}")
        object.__setattr__(self, "train_segments", kinds)
        preload = (self.agent_preload,) if isinstance(self.agent_preload, str) else tuple(self.agent_preload)
        if preload and not self.agent.startswith("cmd:"):
            raise ValueError(f"rollout.agent_preload is for 'cmd:python SCRIPT.py' agents, not {self.agent!r}")
        object.__setattr__(self, "agent_preload", preload)
        if self.agent_sandbox not in ("auto", "strict", "none"):
            raise ValueError(f"rollout.agent_sandbox must be auto, strict or none, got {self.agent_sandbox!r}")
        if self.agent_home and not os.path.isdir(self.agent_home):
            raise ValueError(f"rollout.agent_home {self.agent_home!r} is not a directory")
        binds = (self.agent_binds,) if isinstance(self.agent_binds, str) else tuple(self.agent_binds)
        missing = [b for b in binds if not (isinstance(b, str) and os.path.isabs(b) and os.path.exists(b))]
        if missing:
            raise ValueError(f"rollout.agent_binds: {missing[0]!r} is not an absolute path that exists")
        object.__setattr__(self, "agent_binds", binds)
        if self.timeout_s <= 0 or self.proxy_max_body_mb <= 0:
            raise ValueError("rollout.timeout_s and rollout.proxy_max_body_mb must be > 0")


def load_agent(name: str, preload: tuple = ()):
    """An Agent from `rollout.agent`; every way it can be wrong is a ValueError naming it."""
    if name in BUILTIN_AGENTS:
        return BUILTIN_AGENTS[name]()
    if name.startswith("cmd:"):
        return SubprocessAgent(name[4:].strip(), preload)
    mod, _, attr = name.replace(":", ".").rpartition(".")
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"rollout.agent {name!r} does not import: {e} (built-in agents: "
                         f"{', '.join(BUILTIN_AGENTS)}; or a dotted path, or cmd:<command>)") from e
    agent = obj() if isinstance(obj, type) else obj
    if not asyncio.iscoroutinefunction(getattr(agent, "run", None)):
        raise ValueError(f"rollout.agent {name!r} is not an Agent: it needs `async def run(self, ctx, sample)`")
    return agent


ENCODE_CACHE_ROWS = 4096    # prompts kept tokenized per rollout worker
EXTRA_TYPES = ("agent_reward", "agent_info", "transcript", "agent_stats", "segment", "segment_stats",  # optional
               "proxy_notes")


class AgentFlowRollout:
    tasks_in_flight = 1    # one queued call per worker: blocks reach the window gate in stream order
    inputs = ("prompt_id", "group_id", "sample_idx", "prompt")
    outputs = ("prompt_ids", "response_ids", "response_logprobs", "loss_mask", "token_versions",
               "version_start", "version_end", "status", "error", "t_dispatch", "t_done", *EXTRA_TYPES)

    def __init__(self, cfg: RolloutConfig, engines: list, gate=None, model_path: str = "", tokenizer_class: str = ""):
        """tokenizer_class: the class AutoTokenizer picks for model_path (stages/tokenizer.py), so that
        this worker loads it without importing torch."""
        from stages.agentflow.proxy import Proxy
        from stages.tokenizer import load_tokenizer

        lower_priority(cfg.nice)
        self.cfg = cfg
        self.gate = gate
        self.tok = ensure_chat_template(load_tokenizer(model_path, tokenizer_class))
        self.limit = PromptLimit.for_model(model_path, self.tok, cfg.max_prompt_tokens)
        self.agent = load_agent(cfg.agent, cfg.agent_preload)
        if hasattr(self.agent, "configure"):    # an agent with settings in this config (rollout.sandbox)
            self.agent.configure(cfg)
        self.affinity = Affinity(engines)
        self.sampling = {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "top_p": cfg.top_p,
                         "hold": cfg.partial == "wait"}
        self.loop = asyncio.new_event_loop()
        self._encoded: dict[str, list[int]] = {}     # prompt text -> ids: a group's N samples share one prompt
        # started on first use, on self.loop: it serves while a batch runs, which is when agents call it
        self.proxy = Proxy(self.tok, cfg.proxy_host, cfg.proxy_port, int(cfg.proxy_max_body_mb * 2 ** 20),
                           cfg.proxy_force_sampling, self.limit)

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        if self.gate is not None:
            seqs = sorted({r["group_id"] for r in rows})
            if ray.get(self.gate.acquire.remote(seqs)) < 0:   # window closed: the run is stopping
                return _table(batch, [[_aborted()] for _ in rows])
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
        return (self.cfg.seed * 1_000_003 + int(row["group_id"]) * 1009 + int(row["sample_idx"])) % (2**63)

    def _context(self, row: dict) -> AgentContext:
        messages = _chat_prompt(row["prompt"])
        text = render(self.tok, messages) if messages else row["prompt"]
        self.limit.check_text(text)     # a hopeless prompt fails its row before it is tokenized
        return AgentContext(self.affinity.for_group(row["group_id"]), self.tok, self._encode(text),
                            dict(self.sampling, seed=self._seed(row)), prompt_text=text, messages=messages,
                            max_turns=self.cfg.max_turns, proxy=self.proxy, limit=self.limit,
                            max_tokens=self.cfg.max_trajectory_tokens)

    def _encode(self, text: str) -> list[int]:
        ids = self._encoded.get(text)
        if ids is None:
            if len(self._encoded) >= ENCODE_CACHE_ROWS:
                self._encoded.clear()
            ids = self._encoded[text] = encode(self.tok, text)
        return ids      # AgentContext copies it

    async def _one(self, row: dict, limit: asyncio.Semaphore) -> list[dict]:
        """One trajectory (a row per trained segment). If its engine dies meanwhile, it is run again from the
        start (same seed) once the engine is back: nothing half-made by a dead engine reaches training."""
        client = self.affinity.for_group(row["group_id"])
        for attempt in range(self.cfg.engine_retries + 1):
            lost = client.lost
            out = await self._attempt(row, limit)
            if client.lost == lost or out[0]["status"] != "failed" or attempt == self.cfg.engine_retries:
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
                                               f"(rollout.train_segments={list(self.cfg.train_segments)}; it made "
                                               f"{', '.join(s.kind for s in ctx.tree)})")]
        common = _agent_columns(ctx, fail, time.time() - t0) | {"t_dispatch": t_dispatch, "t_done": time.time()}
        return [out | common for out in outs]


def _chat_prompt(prompt: str) -> list[dict] | None:
    """A prompt that is a JSON list of chat messages; None for plain text."""
    if not prompt.lstrip().startswith("["):
        return None
    try:
        messages = json.loads(prompt)
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


def _aborted() -> dict:
    now = time.time()
    return _failed("window closed before dispatch", "aborted") | _agent_columns(None, "", 0.0) | {
        "t_dispatch": now, "t_done": now}


def _table(batch: pa.Table, results: list[list[dict]]) -> pa.Table:
    """The batch with the stage's columns set, typed by the trajectory schema: an input row is repeated
    once per segment row its trajectory made."""
    if any(len(r) != 1 for r in results):
        batch = batch.take([i for i, r in enumerate(results) for _ in r])
    flat = [row for r in results for row in r]
    return with_columns(batch, {k: [r[k] for r in flat] for k in AgentFlowRollout.outputs})
