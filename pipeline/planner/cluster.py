"""Cluster files (configs/clusters/*.yaml): GPUs, nodes, interconnect, layout, per-model presets.

Their keys are SCHEMA's below: peak_tflops is dense BF16, interconnect rates are GB/s per GPU
(same_gpu_gb_s: colocated resharding). An unknown key, a negative number, a missing section or a
model that is not a preset is a PlanError naming the file and the key. `build_costs` turns a
checked file into the simulation's cost models: the trainer gets the GPUs the engines leave (all
of them when colocated), a step costs flops_per_param_token * params * tokens / (GPUs * peak * MFU),
a sync moves params * bytes_per_param over the slowest route from the trainer to an engine.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.config import ConfigError, read_yaml
from pipeline.planner.model import Costs, EngineModel, Layout, PlanError, StageCosts, SyncModel, TrainerModel

NUM, INT, BOOL, STR = "number", "integer", "boolean", "string"
ENGINE = {"decode_base_s": NUM, "decode_per_seq_s": NUM, "decode_per_ctx_token_s": NUM, "prefill_per_token_s": NUM,
          "call_s": NUM, "max_running": INT, "kv_tokens": INT, "prefix_cache": BOOL, "tp": INT}
TRAINER = {"mfu": NUM, "flops_per_param_token": NUM, "fixed_s": NUM}
SYNC = {"bytes_per_param": NUM, "fixed_s": NUM}
MODEL = {"params_b": NUM, "engine": ENGINE, "trainer": TRAINER, "sync": SYNC}
GPU = {"peak_tflops": NUM, "hbm_gb": NUM, "hbm_tb_s": NUM}
SCHEMA = {
    "cluster": {"name": STR, "gpu": STR, "nodes": INT, "gpus_per_node": INT},
    "gpus": ("map", GPU),
    "interconnect": {"same_gpu_gb_s": NUM, "intra_node_gb_s": NUM, "inter_node_gb_s": NUM},
    "layout": {"model": STR, "engines": INT, "engine_tp": INT, "colocate": BOOL},
    "pipeline": {"reward_fixed_s": NUM, "reward_per_row_s": NUM, "reward_workers": INT, "handoff_s": NUM,
                 "dispatch_s": NUM},
    "models": ("map", MODEL),
}
REQUIRED = {"cluster": ("gpu", "nodes", "gpus_per_node"), "interconnect": ("intra_node_gb_s", "inter_node_gb_s"),
            "layout": ("model", "engines")}
POSITIVE = {"nodes", "gpus_per_node", "peak_tflops", "params_b", "mfu", "engines", "engine_tp", "tp", "intra_node_gb_s",
            "inter_node_gb_s", "same_gpu_gb_s", "decode_base_s", "flops_per_param_token", "bytes_per_param",
            "reward_workers"}


def _check(node, schema, where: str, file: str) -> None:
    if isinstance(schema, tuple):           # ("map", value schema): any names, each checked
        if not isinstance(node, dict):
            raise PlanError(f"{file}: {where} must be a mapping of names, got {node!r}")
        for name, v in node.items():
            _check(v, schema[1], f"{where}.{name}", file)
        return
    if isinstance(schema, dict):
        if not isinstance(node, dict):
            raise PlanError(f"{file}: {where or 'the file'} must be a mapping, got {node!r}")
        for k, v in node.items():
            if k not in schema:
                raise PlanError(f"{file}: unknown key {where + '.' if where else ''}{k} "
                                f"(valid: {', '.join(schema)})")
            _check(v, schema[k], f"{where}.{k}" if where else k, file)
        return
    leaf = where.rsplit(".", 1)[-1]
    ok = {NUM: isinstance(node, (int, float)) and not isinstance(node, bool),
          INT: isinstance(node, int) and not isinstance(node, bool),
          BOOL: isinstance(node, bool), STR: isinstance(node, str)}[schema]
    if not ok:
        raise PlanError(f"{file}: {where} must be a {schema}, got {node!r}")
    if schema in (NUM, INT):
        if node < 0:
            raise PlanError(f"{file}: {where} must be >= 0, got {node}")
        if leaf in POSITIVE and node == 0:
            raise PlanError(f"{file}: {where} must be > 0, got {node}")


def load_cluster(path: str | Path, overrides: dict | None = None) -> dict:
    """A checked cluster file (a dict), with `section.key=value` overrides applied first."""
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"--cluster {path}: no such file (presets: {', '.join(presets())})")
    try:
        data = read_yaml(path) or {}        # bounded as a recipe is: size, encoding, depth, aliases
    except ConfigError as e:
        raise PlanError(str(e)) from e
    for key, value in (overrides or {}).items():
        *parents, leaf = key.split(".")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise PlanError(f"{path}: override {key}: {p} is not a section")
        node[leaf] = value
    _check(data, SCHEMA, "", str(path))
    for section, keys in REQUIRED.items():
        missing = [k for k in keys if k not in data.get(section, {})]
        if missing:
            raise PlanError(f"{path}: missing {', '.join(f'{section}.{k}' for k in missing)}")
    gpu, model = data["cluster"]["gpu"], data["layout"]["model"]
    if gpu not in data.get("gpus", {}):
        have = ", ".join(data.get("gpus", {})) or "none"
        raise PlanError(f"{path}: cluster.gpu {gpu!r} is not in gpus: (have: {have})")
    if model not in data.get("models", {}):
        raise PlanError(f"{path}: layout.model {model!r} is not a preset in models: "
                        f"(presets: {', '.join(data.get('models', {})) or 'none'})")
    m = data["models"][model]
    for need in ("engine", "trainer", "sync", "engine.decode_base_s", "trainer.mfu", "params_b"):
        part, _, key = need.partition(".")
        if part not in m or key and key not in m[part]:
            raise PlanError(f"{path}: models.{model}.{need} is missing")
    data["_file"] = str(path)
    return data


def presets() -> list[str]:
    root = Path(__file__).resolve().parents[2] / "configs" / "clusters"
    return sorted(str(p.relative_to(root.parents[1])) for p in root.glob("*.yaml"))


def build_costs(data: dict) -> Costs:
    f = data["_file"]
    cl, ic, lay = data["cluster"], data["interconnect"], data["layout"]
    gpu = data["gpus"][cl["gpu"]]
    m = data["models"][lay["model"]]
    total = cl["nodes"] * cl["gpus_per_node"]
    tp = lay.get("engine_tp", m["engine"].get("tp", 1))     # the layout's, else the model preset's
    engines, colocate = lay["engines"], lay.get("colocate", False)
    engine_gpus = engines * tp
    if engine_gpus > total:
        raise PlanError(f"{f}: layout.engines={engines} x engine_tp={tp} = {engine_gpus} GPUs, the cluster has {total}")
    trainer_gpus = total if colocate else total - engine_gpus
    if trainer_gpus <= 0:
        raise PlanError(f"{f}: layout.engines={engines} x engine_tp={tp} takes all {total} GPUs: none left for "
                        f"the trainer (or set layout.colocate: true)")
    e = m["engine"]
    engine = EngineModel(e["decode_base_s"], e.get("decode_per_seq_s", 0.0), e.get("decode_per_ctx_token_s", 0.0),
                         e.get("prefill_per_token_s", 0.0), e.get("call_s", 0.0), e.get("max_running", 0),
                         e.get("kv_tokens", 0), e.get("prefix_cache", True))
    t = m["trainer"]
    params = m["params_b"] * 1e9
    per_token = t.get("flops_per_param_token", 8.0) * params / (trainer_gpus * gpu["peak_tflops"] * 1e12 * t["mfu"])
    trainer = TrainerModel(t.get("fixed_s", 0.0), per_token, all_tokens=True,
                           source=f"{t.get('flops_per_param_token', 8.0):g} x {m['params_b']}B params x tokens / "
                                  f"({trainer_gpus} x {gpu['peak_tflops']} TFLOPS x MFU {t['mfu']})")
    s = m["sync"]
    if colocate:
        route, bw = "same GPU (colocated)", ic.get("same_gpu_gb_s", ic["intra_node_gb_s"])
    elif total <= cl["gpus_per_node"]:
        route, bw = "intra-node", ic["intra_node_gb_s"]
    else:
        route, bw = "inter-node", ic["inter_node_gb_s"]      # engines sit after the trainer's GPUs: some across nodes
    sync = SyncModel(s.get("fixed_s", 0.0), params * s.get("bytes_per_param", 2.0), bw * 1e9, route)
    p = data.get("pipeline", {})
    stages = StageCosts(p.get("reward_fixed_s", 0.0), p.get("reward_per_row_s", 0.0), p.get("handoff_s", 0.0),
                        p.get("dispatch_s", 0.0), p.get("reward_workers", 1))
    layout = Layout(engines, colocate,
                    f"{cl.get('name', Path(f).stem)}: {total} x {cl['gpu']}, {engines} engines x TP{tp}"
                    f"{' colocated with' if colocate else ' +'} trainer on {trainer_gpus} GPUs, model {lay['model']}")
    return Costs(engine, trainer, sync, stages, layout,
                 sources={k: f"{f} (models.{lay['model']})" for k in ("engine", "trainer", "sync")} |
                 {"stages": f"{f} (pipeline)"})
