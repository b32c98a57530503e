"""The `rollout:`, `sampling:`, `agent:` and `proxy:` recipe sections (stages/agentflow/rollout.py runs what
they describe; `sandbox:` and `tool_service:` are sandbox/pool.py's and sandbox/tool_service.py's).

Apart from the rollout stage, which imports Ray, so a recipe is checked without Ray or torch.
"""
from __future__ import annotations

import os

from stages.keys import NONNEG, POSITIVE, between, key, one_of, section

# what a model call can be part of (stages/agentflow/session.py): agent.train_segments names some
KINDS = ("main", "compaction", "subagent", "side")


@section("rollout")
class RolloutConfig:
    n_samples: int = key(8, "N: samples per prompt (a group)", POSITIVE)
    num_workers: int = key(1, "rollout worker actors (asyncio inside each)", POSITIVE)
    groups_per_batch: int = key(0, "groups per worker call; 0 = one step's groups", NONNEG)
    stale_steps: float = key(0.0, "how many steps a group may lag the trainer's weights (0 = synchronous on-policy)",
                                  NONNEG)
    window: str = key("no-window", "no-window | window-gated | windowed-fifo | dotted path")
    partial: str = key("interrupt", "at a weight update: interrupt (continue under new weights) | wait",
                                    one_of("interrupt", "wait"))
    partial_mask_old: bool = key(False, "mask tokens generated before the sample's last update out of the loss")
    nice: int = key(0, "niceness of engine and rollout/reward worker processes (0 = as started): > 0 lets the trainer,"
                       " an async run's bottleneck, keep its core", between(0, 19))


@section("sampling")
class SamplingConfig:
    max_new_tokens: int = key(8, "tokens per model turn (and the cap on a proxy call's max_tokens)", POSITIVE)
    max_prompt_tokens: int = key(0, "prompt tokens per model call; 0 = the model's context less one. A longer prompt "
                                    "fails its trajectory (white-box) or gets 400 context_length_exceeded (proxy)",
                                    NONNEG)
    temperature: float = key(1.0, "sampling temperature (0 = greedy)", NONNEG)
    top_p: float = key(1.0, "nucleus sampling: keep the smallest token set with this much probability",
                            between(0, 1, lo_open=True))
    seed: int = key(0, "set from run.seed (pipeline/seeds.py), not a recipe key; per sample: (seed, group, index); "
                       "per turn within it", NONNEG)


@section("agent")
class AgentConfig:
    name: str = key("single_turn", 'built-in name | dotted path | "cmd:<command>" (subprocess black-box)')
    preload: tuple = key((), 'modules a "cmd:python SCRIPT.py" agent imports, loaded once per worker in a zygote'
                             " that forks each trajectory's process (stages/agentflow/sandbox/zygote.py)")
    jail: str = key("bwrap", '"cmd:" agents each in a bubblewrap jail of their own (docs/sandbox.md; '
                             "a run is refused where bwrap cannot jail) | none: unjailed, as this user",
                    one_of("bwrap", "none"))
    home: str = key("", 'a directory copied into each jailed agent\'s fresh HOME (harness config); "" = an empty HOME')
    binds: tuple = key((), "more host paths a jailed agent may read (relative: to the working directory, else "
                           "the project root); it sees only the system's programs and libraries and its "
                           "command's own files")
    env: tuple = key((), "environment a cmd: agent gets beyond its endpoint, PATH, LANG, LC_*, TERM and TZ: "
                         "NAME (from the worker's environment) or NAME=VALUE")
    procs: int = key(256, "processes and threads one jailed agent may hold (its cgroup's pids.max)", POSITIVE)
    memory_mb: int = key(4096, "memory one jailed agent may use, its /tmp included (its cgroup's limit)", POSITIVE)
    tmp_mb: int = key(512, "size of a jailed agent's private /tmp (and /dev/shm)", POSITIVE)
    max_turns: int = key(8, "model turns (proxy calls) per trajectory; 0 = unlimited", NONNEG)
    max_trajectory_tokens: int = key(0, "black-box: completion tokens a trajectory may generate in all (a call's "
                                        "budget is clamped to what is left; spent, it ends as the turn limit ends "
                                        "it); 0 = off", NONNEG)
    max_agents: int = key(0, "agents running at once per worker; 0 = all of a batch (cmd: agents: 16)", NONNEG)
    timeout_s: float = key(300.0, "seconds per trajectory", POSITIVE)
    train_segments: tuple = key(("main", "compaction", "subagent"), "segment kinds that become training rows "
                                                                    "(stages/agentflow/session.py): each segment of "
                                                                    "these kinds is its own row")

    def __post_init__(self):
        for k in ("train_segments", "preload", "binds", "env"):     # a list, or one string
            v = getattr(self, k)
            object.__setattr__(self, k, (v,) if isinstance(v, str) else tuple(v))
        if not self.train_segments or any(k not in KINDS for k in self.train_segments):
            raise ValueError(f"agent.train_segments must name some of {', '.join(KINDS)}, got {self.train_segments!r}")
        if self.preload and not self.name.startswith("cmd:"):
            raise ValueError(f"agent.preload is for 'cmd:python SCRIPT.py' agents, not {self.name!r}")
        if self.home and not os.path.isdir(self.home):
            raise ValueError(f"agent.home {self.home!r} is not a directory")
        bad = [e for e in self.env if not isinstance(e, str) or not e.partition("=")[0].isidentifier()]
        if bad:
            raise ValueError(f"agent.env: {bad[0]!r} is not NAME or NAME=VALUE")
        object.__setattr__(self, "binds", tuple(map(_host_path, self.binds)))


@section("proxy")
class ProxyConfig:
    host: str = key("127.0.0.1", "bind address (loopback unless you mean it)")
    port: int = key(0, "port; 0 = any free port", between(0, 65535))
    max_body_mb: float = key(8.0, "larger request bodies get 413", POSITIVE)
    force_sampling: bool = key(False, "True: the sampling section's temperature/top_p and seeds override an agent's "
                                      "request")


def _host_path(p) -> str:
    """An agent.binds entry as an absolute path (relative: to the working directory where it exists there, else
    to the project root, where the shipped recipes' harness installs live); the jail checks it exists."""
    if not isinstance(p, str) or not p:
        raise ValueError(f"agent.binds: {p!r} is not a path")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.abspath(p if os.path.isabs(p) or os.path.exists(p) else os.path.join(root, p))
