"""The `rollout:` recipe section (stages/agentflow/rollout.py runs what it describes).

Apart from the rollout stage, which imports Ray, so a recipe is checked without Ray or torch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from stages.agentflow.sandbox.pool import SandboxConfig
from stages.agentflow.sandbox.tool_service import ToolServiceConfig
from stages.keys import NONNEG, POSITIVE, at_least, between, key, one_of

# what a model call can be part of (stages/agentflow/session.py): rollout.train_segments names some
KINDS = ("main", "compaction", "subagent", "side")


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
                                   " that forks each trajectory's process (stages/agentflow/sandbox/zygote.py)")
    agent_sandbox: str = key("bwrap", '"cmd:" agents each in a bubblewrap jail of their own (docs/sandbox.md; '
                                      "a run is refused where bwrap cannot jail) | none: unjailed, as this user",
                             one_of("bwrap", "none"))
    agent_home: str = key("", "a directory copied into each jailed agent's fresh HOME (harness config); "
                              '"" = an empty HOME')
    agent_binds: tuple = key((), "more host paths a jailed agent may read (relative: to the working directory, else "
                                 "the project root); it sees only the system's programs and libraries and its "
                                 "command's own files")
    agent_env: tuple = key((), "environment a cmd: agent gets beyond its endpoint, PATH, LANG, LC_*, TERM and TZ: "
                               "NAME (from the worker's environment) or NAME=VALUE")
    agent_procs: int = key(256, "processes and threads one jailed agent may hold (its cgroup's pids.max)", POSITIVE)
    agent_memory_mb: int = key(4096, "memory one jailed agent may use, its /tmp included (its cgroup's limit)",
                               POSITIVE)
    agent_tmp_mb: int = key(512, "size of a jailed agent's private /tmp (and /dev/shm)", POSITIVE)
    max_turns: int = key(8, "model turns (proxy calls) per trajectory; 0 = unlimited", NONNEG)
    max_trajectory_tokens: int = key(0, "black-box: completion tokens a trajectory may generate in all (a call's "
                                        "budget is clamped to what is left; spent, it ends as the turn limit ends "
                                        "it); 0 = off", NONNEG)
    max_agents: int = key(0, "agents running at once per worker; 0 = all of a batch (cmd: agents: 16)", NONNEG)
    num_engines: int = key(1, "rollout engine actors", POSITIVE)
    engine: str = key("hf", "hf (embedded torch engine, any CPU) | vllm (`pip install .[vllm]`; `vllm:` section) | "
                            "sglang (GPU; `sglang:` section)", one_of("hf", "vllm", "sglang"))
    engine_threads: int = key(0, "torch threads per engine; 0 = decided by pipeline/resources.py", NONNEG)
    engine_max_rows: int = key(256, "hf engine: rows decoding at once (more wait in its queue)",
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
        if self.agent_home and not os.path.isdir(self.agent_home):
            raise ValueError(f"rollout.agent_home {self.agent_home!r} is not a directory")
        binds = (self.agent_binds,) if isinstance(self.agent_binds, str) else tuple(self.agent_binds)
        object.__setattr__(self, "agent_binds", tuple(_host_path(b) for b in binds))
        env = (self.agent_env,) if isinstance(self.agent_env, str) else tuple(self.agent_env)
        bad = [e for e in env if not isinstance(e, str) or not e.partition("=")[0].isidentifier()]
        if bad:
            raise ValueError(f"rollout.agent_env: {bad[0]!r} is not NAME or NAME=VALUE")
        object.__setattr__(self, "agent_env", env)
        if self.timeout_s <= 0 or self.proxy_max_body_mb <= 0:
            raise ValueError("rollout.timeout_s and rollout.proxy_max_body_mb must be > 0")


def _host_path(p) -> str:
    """An agent_binds entry as an absolute path (relative: to the working directory where it exists there, else
    to the project root, where the shipped recipes' harness installs live); the jail checks it exists."""
    if not isinstance(p, str) or not p:
        raise ValueError(f"rollout.agent_binds: {p!r} is not a path")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.abspath(p if os.path.isabs(p) or os.path.exists(p) else os.path.join(root, p))
