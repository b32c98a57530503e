"""Recipe config: frozen dataclasses, one per concern, mirrored 1:1 in YAML (`section: {key: value}`).

Each section is defined next to its stage in a module that imports neither torch nor Ray, so a recipe is read
and refused in a fraction of a second. Overrides are `section.key=value` (values parsed as YAML). An unknown
section or key is an error listing the valid ones (a key of the earlier layout names its new place: MOVED), so a
typo never silently runs the default. Every refusal is a ConfigError of one line, a hostile file (too big, not
UTF-8, nested too deep, an alias bomb) included, and no message formats a value whole.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline import seeds
from pipeline.placement import PlacementConfig
from pipeline.trackers import TrackerConfig
from stages.agentflow.config import AgentConfig, ProxyConfig, RolloutConfig, SamplingConfig
from stages.agentflow.engine_config import EngineConfig, SGLangConfig, VLLMConfig
from stages.agentflow.sandbox.pool import SandboxConfig
from stages.agentflow.sandbox.tool_service import ToolServiceConfig
from stages.batcher_config import BatcherConfig
from stages.keys import NONNEG, POSITIVE, check_of, key, one_of, problem, section
from stages.model_config import ModelConfig
from stages.prompts_config import DataConfig
from stages.reward_config import RewardConfig
from stages.teacher.config import TeacherConfig
from stages.transfer_config import TransferConfig
from stages.update.config import AlgorithmConfig, TrainerConfig
from stages.update.megatron.config import MegatronConfig


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class EvalConfig:
    every: int = key(5, "evaluate every N steps (0 = only at start and end)", NONNEG)
    num_prompts: int = key(200, "held-out prompts per evaluation (0 = no evaluation)", NONNEG)
    temperature: float = key(1.0, "sampling temperature of evaluation (the training temperature by default)", NONNEG)
    n_samples: int = key(1, "samples per held-out prompt", POSITIVE)


@dataclass(frozen=True)
class ReplayConfig:
    steps: tuple[int, ...] = key((), "recorded step numbers to train on (empty = all)")
    data_sources: tuple[str, ...] = key((), "data_source values to train on (empty = all)")
    reward_min: float | None = key(None, "inclusive lower bound on a group's mean reward (None = no bound)")
    reward_max: float | None = key(None, "inclusive upper bound on a group's mean reward (None = no bound)")


@section("run")
class RunConfig:
    steps: int = key(40, "training steps (weight versions) to run", POSITIVE)
    seed: int = key(0, "every random choice of the run derives from it (pipeline/seeds.py)", NONNEG)
    ray_address: str = key("", '"" = start local Ray; "auto" or "ray://..." joins a cluster')
    ray_num_cpus: int = key(0, "logical CPUs for local Ray (0 = this machine's count)", NONNEG)
    checkpoint_every: int = key(0, "write a checkpoint every N steps (0 = only at the end)", NONNEG)
    resume_from: str = key("", "a checkpoint dir (RUN/checkpoints/step_N) to continue from, or latest: the run dir's "
                               "newest intact one")
    data_wake: str = key("event", "Ray Data's executor wakes when a task has output (event), or as Ray ships it "
                                  "(ray: every 0.1 s, no patch of its internals)", one_of("event", "ray"))
    node_wait_s: float = key(120.0, "a Ray node holding engines died: seconds to wait for them to be restarted "
                                    "elsewhere before the run stops with a resumable checkpoint", NONNEG)


@dataclass(frozen=True)
class Config:
    run: RunConfig = key(RunConfig, "run-level settings: steps, seed, Ray, checkpoints, resume")
    model: ModelConfig = key(ModelConfig, "the policy model: a local HF directory or the built-in tiny model")
    data: DataConfig = key(DataConfig, "the prompt dataset and its columns")
    rollout: RolloutConfig = key(RolloutConfig, "rollout scheduling: samples per prompt, workers, asynchrony")
    sampling: SamplingConfig = key(SamplingConfig, "what each model call samples: tokens, temperature, top_p")
    agent: AgentConfig = key(AgentConfig, "the agent each sample runs, its limits, the jail of a cmd: agent")
    proxy: ProxyConfig = key(ProxyConfig, "the black-box agents' OpenAI/Anthropic-compatible endpoint")
    engine: EngineConfig = key(EngineConfig, "the rollout engines: kind, count, the hf engine's KV cache")
    sandbox: SandboxConfig = key(SandboxConfig, "code sandbox of the `sandbox` agent")
    tool_service: ToolServiceConfig = key(ToolServiceConfig, "the sandbox agent's remote tool service (sandbox.remote)")
    reward: RewardConfig = key(RewardConfig, "the reward function and its workers")
    batcher: BatcherConfig = key(BatcherConfig, "how collected groups become a training step")
    algorithm: AlgorithmConfig = key(AlgorithmConfig, "the RL objective: preset, advantage, surrogate loss, KL, IS "
                                                      "corrections, distillation")
    trainer: TrainerConfig = key(TrainerConfig, "the optimizer, its schedule and the trainer backend")
    transfer: TransferConfig = key(TransferConfig, "weight transfer from the trainer to the engines (TransferMesh)")
    eval: EvalConfig = key(EvalConfig, "held-out evaluation during the run")
    replay: ReplayConfig = key(ReplayConfig, "which recorded groups `loongsage replay` trains on")
    trackers: TrackerConfig = key(TrackerConfig, "experiment trackers the metrics also go to")
    teacher: TeacherConfig = key(TeacherConfig, "teachers for on-policy distillation")
    megatron: MegatronConfig = key(MegatronConfig, "Megatron-core parallelism; used when trainer.backend=megatron")
    sglang: SGLangConfig = key(SGLangConfig, "SGLang engines; used when engine.kind=sglang")
    vllm: VLLMConfig = key(VLLMConfig, "the vLLM engines; used when engine.kind=vllm (docs/vllm.md)")
    placement: PlacementConfig = key(PlacementConfig, "Ray placement groups on a cluster")


# keys of the earlier layout (one `rollout:` section of six concerns) -> where they are now: refused by name
MOVED = {f"rollout.{k}": f"{s}.{k.removeprefix(s + '_')}" for s, keys in (
    ("sampling", "max_new_tokens max_prompt_tokens temperature top_p"),
    ("proxy", "proxy_host proxy_port proxy_max_body_mb proxy_force_sampling"),
    ("engine", "engine_threads engine_max_rows engine_restarts engine_retries kv_cache_mb"),
    ("agent", "agent_preload agent_home agent_binds agent_env agent_procs agent_memory_mb agent_tmp_mb max_turns "
              "max_trajectory_tokens max_agents timeout_s train_segments")) for k in keys.split()}
MOVED |= {"rollout.agent": "agent.name", "rollout.agent_sandbox": "agent.jail", "rollout.engine": "engine.kind",
          "rollout.num_engines": "engine.count", "rollout.sandbox": "sandbox", "rollout.tool_service": "tool_service"}

MAX_BYTES = 2**20      # a recipe is a few KB of YAML: a bigger file is refused before it is parsed
MAX_DEPTH = 64         # nesting levels: PyYAML composes recursively, so 50,000 levels overflow Python's stack
MAX_VALUES = 10_000    # values of the document as built: an alias counts its anchor's whole value at each use


def _cut(text: str, limit: int = 200) -> str:
    """A recipe's value or key as an error shows it: at most `limit` characters (a value may be huge)."""
    return text if len(text) <= limit else text[:limit] + "..."


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, bounded while it composes, before any value is built: the nesting depth and the
    size with aliases expanded (an alias bomb is a few hundred bytes whose value, walked or formatted, does not
    end); an alias inside its own anchor's value (a cycle) is refused too."""

    def __init__(self, text: str):
        super().__init__(text)
        self.keys: list[str] = []                           # where the composer is, for the error
        self.sizes: dict[yaml.Node, tuple[int, int]] = {}   # composed node -> (values, depth), aliases expanded

    def refuse(self, problem: str, mark) -> None:
        at = _cut("".join(k if k.startswith("[") or not k else "." + k for k in self.keys).lstrip("."), 40)
        raise ConfigError(f"{at + ': ' if at else ''}{problem} (line {mark.line + 1})")

    def compose_node(self, parent, index):
        self.keys.append(f"[{index}]" if isinstance(index, int) else
                         _cut(str(index.value), 40) if isinstance(index, yaml.ScalarNode) else "")
        try:
            if len(self.keys) > MAX_DEPTH:
                self.refuse(f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark)
            alias = self.check_event(yaml.AliasEvent)
            node = super().compose_node(parent, index)
            if alias and node not in self.sizes:        # an anchor still being composed: its own value
                self.refuse("an alias inside its own anchor's value (a cycle)", node.start_mark)
            if not alias:
                self.sizes[node] = self.measure(node)
            return node
        finally:
            self.keys.pop()

    def measure(self, node) -> tuple[int, int]:
        kids = (node.value if isinstance(node, yaml.SequenceNode) else
                [n for kv in node.value for n in kv] if isinstance(node, yaml.MappingNode) else [])
        values = 1 + sum(self.sizes[k][0] for k in kids)
        depth = 1 + max((self.sizes[k][1] for k in kids), default=0)
        if values > MAX_VALUES:
            self.refuse(f"holds more than {MAX_VALUES} values, aliases expanded", node.start_mark)
        if depth > MAX_DEPTH:
            self.refuse(f"nested deeper than {MAX_DEPTH} levels, aliases expanded", node.start_mark)
        return values, depth


def parse_yaml(text: str, where: str):
    """YAML text -> its value, bounded (_Loader); any problem is a ConfigError of one line naming `where`."""
    try:
        return _Loader(text).get_single_data()      # its reader refuses control characters as it is made
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"{where}: not valid YAML: {_cut(', '.join(filter(None, (e.context, e.problem))))}{at}") \
            from None
    except (yaml.YAMLError, ValueError, OverflowError) as e:   # a bad character; a date such as 2024-13-01
        raise ConfigError(f"{where}: not valid YAML: {_cut(' '.join(str(e).split()))}") from None


def read_yaml(path: str | Path):
    """A YAML file's value: at most MAX_BYTES of UTF-8, bounded as parse_yaml is; refusals name the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{p}: cannot be read: {e.strerror}") from None
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"{p}: larger than {MAX_BYTES // 2**20} MiB (a recipe is a few KB of YAML)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start})") from None
    return parse_yaml(text, str(p))


# YAML 1.1 (PyYAML) reads a float only with a dot: `5e-5` and `1e3` come back as strings
_FLOAT_TEXT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _coerce(value, typ, where: str):
    """Check/convert one leaf value against its annotated type."""
    origin = typing.get_origin(typ)
    if dataclasses.is_dataclass(typ):
        return _build(typ, value, where)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        return None if value is None else _coerce(value, args[0], where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {_cut(repr(value))}")
        (item,) = typing.get_args(typ)[:1] or (object,)
        return tuple(_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {_cut(repr(value))}")
        return dict(value)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if typ is float and (number or isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip())):
        return float(value)
    if typ is str and number:
        return str(value)
    if typ in (int, float, str, bool) and not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {typ.__name__}, got {_cut(repr(value))}")
    return value


def _build(cls, data, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys, got {_cut(repr(data))}")
    hints, fields = typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:     # a key of the earlier layout is named with its new place
        moved = [f"{where}.{k} is now {MOVED[f'{where}.{k}']}" for k in unknown if f"{where}.{k}" in MOVED]
        raise ConfigError("; ".join(moved) or f"unknown key {where + '.' if where else ''}{_cut(str(unknown[0]), 80)}"
                          f"; valid keys{' of ' + where if where else ''}: {', '.join(fields)}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    for k, v in kwargs.items():
        why = None if dataclasses.is_dataclass(v) else problem(v, check_of(fields[k]))
        if why:
            raise ConfigError(f"{where + '.' if where else ''}{k} must be {why}, got {_cut(repr(v))}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where or 'config'}: {_cut(str(e), 400)}") from e


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg, dict_factory=lambda kv: {k: list(v) if isinstance(v, tuple) else v for k, v in kv})


def apply_override(tree: dict, override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {_cut(repr(override))} is not of the form section.key=value")
    dotted, raw = override.split("=", 1)
    keys = dotted.strip().split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {_cut(dotted, 80)}: {_cut(k, 80)} is not a section")
    node[keys[-1]] = parse_yaml(raw, f"override {_cut(dotted, 80)}") if raw.strip() else ""


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML recipe (or start from defaults), apply `a.b=value` overrides, validate."""
    tree = {} if path is None else read_yaml(path) or {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    for o in overrides:
        apply_override(tree, o)
    for name, _ in seeds.DERIVED:      # a derived seed set by a recipe: an error naming the key, not a no-op
        if isinstance(tree.get(name), dict) and "seed" in tree[name]:
            raise ConfigError(f"{name}.seed is not a recipe key: every seed of a run derives from run.seed "
                              f"(pipeline/seeds.py, docs/seeds.md); set run.seed instead")
    return seeds.resolve(_build(Config, tree, ""))


def check_names(cfg: Config) -> None:
    """What a recipe names outside itself is there (reward.fn and rollout.window import, the model, data and
    teacher paths exist, black-box agents can be jailed as asked): `run` and `config --check` both call it first,
    so --check passes what the run takes."""
    from pipeline.window import make_strategy
    from stages.model_config import validate_model_dir
    from stages.reward import load_reward_fn
    from stages.tasks import get_task
    from stages.teacher import check_recipe

    c = cfg.data
    step_samples, mb = cfg.batcher.groups_per_step * cfg.rollout.n_samples, cfg.trainer.mini_batch_size
    if mb and step_samples % mb:
        raise ConfigError(f"trainer.mini_batch_size={mb} does not divide batcher.groups_per_step x "
                          f"rollout.n_samples = {step_samples}")
    if cfg.engine.kind == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("engine.kind=vllm needs vLLM: pip install -e '.[vllm]' (docs/vllm.md)")
    if cfg.algorithm.distill_coef and cfg.trainer.backend != "torch":
        raise ConfigError("algorithm.distill_coef > 0 needs trainer.backend=torch (the Megatron trainer has no "
                          "distillation term yet)")
    try:
        check_recipe(cfg.teacher, cfg.algorithm)
        load_reward_fn(cfg.reward.fn)
        make_strategy(cfg.rollout.window)
        if cfg.model.path and not cfg.model.path.startswith("builtin:"):
            validate_model_dir(cfg.model.path, check_tokenizer=False)
        for tid, path in cfg.teacher.teachers.items():
            validate_model_dir(path, check_tokenizer=False, key=f"teacher.teachers.{tid}")
        for name, path in (("data.path", c.path), ("data.test_path", c.test_path if cfg.eval.num_prompts else "")):
            if path.startswith("builtin:"):
                get_task(path.split(":", 1)[1], digits=c.builtin_digits)
            elif path and not Path(path).exists():
                raise ValueError(f"{name} {path!r}: no such file or directory")
        from stages.agentflow.sandbox import jail

        if cfg.agent.name.startswith("cmd:"):
            jail.require(cfg.agent)
        if cfg.agent.name == "sandbox" and cfg.sandbox.isolation != "none":
            jail.require_bwrap("sandbox.isolation")
    except ValueError as e:
        raise ConfigError(_cut(" ".join(str(e).split()), 400)) from e     # one line, whatever the user's module said


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(seeds.strip(to_dict(cfg)), sort_keys=False)   # derived seeds: run.seed says it all


def dump_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(dump_yaml(cfg))
