"""`loongsage plan`: simulate a run on a cluster before buying it.

Costs come from a run directory's profile (--calibrate RUN: this machine, these engines) or
from a cluster file's presets (--cluster FILE); with both, the cluster's hardware and the run's
workload shape. Response lengths come from a recording (--lengths RUN/rollouts, the default with
--calibrate) or are parametric (--lengths lognormal:mean=12700,max=32768). CONFIG defaults to the
calibrated run's config.yaml; key=value takes recipe keys, cluster keys or the short names in ALIASES.
--sweep runs every combination and recommends the fastest whose trained tokens stay within
--max-staleness versions.
"""
from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.config import ConfigError, load_config, parse_yaml
from pipeline.planner.calibrate import Calibration, calibrate
from pipeline.planner.cluster import SCHEMA, build_costs, load_cluster
from pipeline.planner.model import Costs, Layout, PlanError
from pipeline.planner.report import line, measured_summary, plot, report_text, simulated_summary
from pipeline.planner.sim import Recipe, Simulation
from pipeline.planner.workload import ParametricLengths, RecordedLengths

ALIASES = {"stale_steps": "rollout.stale_steps", "window": "rollout.window", "partial": "rollout.partial",
           "groups_per_step": "batcher.groups_per_step", "n_samples": "rollout.n_samples",
           "groups_per_batch": "rollout.groups_per_batch", "num_workers": "rollout.num_workers",
           "engines": "layout.engines", "engine_tp": "layout.engine_tp", "colocate": "layout.colocate",
           "model": "layout.model"}
DEFAULT_STEPS = 20


@dataclass
class PlanInput:
    config: str | None = None            # recipe YAML (None: the calibrated run's config.yaml)
    overrides: tuple = ()                 # key=value
    cluster: str | None = None
    calibrate: str | None = None
    lengths: str | None = None
    steps: int = 0                        # 0: min(run.steps, DEFAULT_STEPS)
    seed: int = 0


def _split(overrides, has_cluster: bool) -> tuple[list[str], dict]:
    """key=value pairs -> recipe overrides (section.key=value) and cluster overrides ({key: value})."""
    recipe, cluster = [], {}
    for o in overrides:
        key, eq, value = o.partition("=")
        if not eq:
            raise PlanError(f"override {o!r}: expected key=value")
        if key == "engines" and not has_cluster:
            key = "engine.count"    # on this machine: the recipe's engines
        key = ALIASES.get(key, key)
        if key.split(".")[0] in SCHEMA:
            if not has_cluster:
                raise PlanError(f"override {o!r}: {key} is a cluster-file key; give --cluster FILE")
            cluster[key] = parse_yaml(value, f"override {key}")
        else:
            recipe.append(f"{key}={value}")
    return recipe, cluster


def _lengths(src: str | None, cal: Calibration | None):
    if src:
        return ParametricLengths.parse(src) if ":" in src and not Path(src).exists() else RecordedLengths.open(src)
    if cal is not None:
        return cal.lengths
    raise PlanError("no response lengths: give --lengths RUN/rollouts or --lengths lognormal:mean=...,max=..., "
                    "or --calibrate RUN")


def setup(inp: PlanInput, cal: Calibration | None = None):
    """(Recipe, Costs, workload, Calibration or None) for one plan; `cal` reuses a calibration already made."""
    if inp.cluster is None and inp.calibrate is None:
        raise PlanError("give --calibrate RUN (costs measured on a run) or --cluster FILE (a cluster's presets)")
    try:
        recipe_over, cluster_over = _split(inp.overrides, inp.cluster is not None)
    except ConfigError as e:        # a cluster override's value, refused as a recipe's is
        raise PlanError(str(e)) from e
    if inp.calibrate is not None and cal is None:
        cal = calibrate(inp.calibrate)
    config = inp.config or (str(Path(inp.calibrate) / "config.yaml") if inp.calibrate else None)
    if config is None:
        raise PlanError("no recipe: give CONFIG (e.g. configs/quickstart_async.yaml)")
    try:
        cfg = load_config(config, recipe_over)
    except ConfigError as e:        # its one line names the file where the file is what is wrong
        raise PlanError(str(e)) from e
    if inp.cluster is not None:
        data = load_cluster(inp.cluster, cluster_over)
        costs = build_costs(data)
        if cal is not None and "pipeline" not in data:
            costs = replace(costs, stages=cal.costs.stages,
                            sources=costs.sources | {"stages": cal.costs.sources["stages"]})
    else:
        costs = replace(cal.costs, layout=Layout(engines=cfg.engine.count, description="this machine"))
    steps = inp.steps or min(cfg.run.steps, DEFAULT_STEPS)
    if steps < 2:
        raise PlanError(f"--steps {steps}: need at least 2 (step 1 is start-up, left out of the figures)")
    return Recipe.of(cfg, steps), costs, _lengths(inp.lengths, cal), cal


def simulate(inp: PlanInput, cal: Calibration | None = None):
    recipe, costs, workload, cal = setup(inp, cal)
    res = Simulation(recipe, costs, workload, seed=inp.seed).run()
    return res, simulated_summary(res), (recipe, costs, workload)


def describe(recipe: Recipe, costs: Costs, workload) -> str:
    e, t, s, st = costs.engine, costs.trainer, costs.sync, costs.stages
    return "\n".join([
        f"recipe         B={recipe.groups_per_step} groups x N={recipe.n_samples}, stale_steps={recipe.stale_steps:g}, "
        f"window={recipe.window}, groups_per_batch={recipe.groups_per_batch or recipe.groups_per_step}, "
        f"workers={recipe.num_workers}, partial={recipe.partial}, {recipe.steps} steps",
        f"layout         {costs.layout.description or costs.layout.engines}",
        f"engine         iteration {e.base_s * 1e3:.3f} ms + {e.per_seq_s * 1e6:.2f} us/seq + "
        f"{e.per_ctx_token_s * 1e9:.3f} ns/ctx token; prefill {e.prefill_per_token_s * 1e6:.2f} us/token; call "
        f"{e.call_s * 1e3:.2f} ms; max running {e.max_running or '-'}; KV {e.kv_tokens or '-'} tokens   "
        f"[{costs.sources.get('engine', '')}]",
        f"trainer        {t.fixed_s:.3f} s + {t.per_token_s * 1e6:.3f} us/token "
        f"({'all' if t.all_tokens else 'response'} tokens)   [{t.source or costs.sources.get('trainer', '')}]",
        f"sync           {s.seconds:.3f} s ({s.fixed_s:.3f} s fixed + {s.bytes / 1e9:.2f} GB over {s.route or '-'})",
        f"stages         reward {st.reward_fixed_s * 1e3:.2f} ms + {st.reward_per_row_s * 1e3:.3f} ms/row, hand-off "
        f"{st.handoff_s * 1e3:.1f} ms, dispatch {st.dispatch_s * 1e3:.1f} ms   [{costs.sources.get('stages', '')}]",
        f"lengths        {workload.describe()}",
    ])


# ---- sweeps ---------------------------------------------------------------------------------

def parse_sweep(items) -> list[tuple[str, list[str]]]:
    out = []
    for item in items:
        key, eq, values = item.partition("=")
        vals = [v for v in values.split(",") if v != ""]
        if not eq or not vals:
            raise PlanError(f"--sweep {item!r}: expected KEY=V1,V2,...")
        out.append((key, vals))
    return out


def sweep(inp: PlanInput, axes: list[tuple[str, list[str]]], max_staleness: float = 1, log=print):
    """Every combination of the axes; returns (DataFrame, the recommended row or None)."""
    import pandas as pd

    cal = calibrate(inp.calibrate) if inp.calibrate else None
    rows = []
    for combo in itertools.product(*[[(k, v) for v in vals] for k, vals in axes]):
        over = tuple(inp.overrides) + tuple(f"{k}={v}" for k, v in combo)
        try:
            _, s, _ = simulate(replace(inp, overrides=over), cal)
        except PlanError as e:
            log(f"  {' '.join(f'{k}={v}' for k, v in combo)}: not simulated: {e}")
            continue
        rows.append({**{k: v for k, v in combo}, "samples/s": s["samples_per_s"], "tokens/s": s["tokens_per_s"],
                     "step_s": s["step_s"], "trainer_busy": s["trainer_busy"], "engine_busy": s["engine_busy"],
                     "bubble": s["bubble_frac"], "stale_mean": s["staleness_mean"], "stale_max": s["staleness_max"],
                     "dropped": s["dropped_groups"], "len_bias": s["length_bias"]})
    table = pd.DataFrame(rows)
    if not len(table):
        return table, None
    ok = table[table["stale_max"] <= max_staleness]
    best = ok.loc[ok["samples/s"].idxmax()] if len(ok) else None
    return table, best


# ---- CLI ------------------------------------------------------------------------------------

def cli_plan(args) -> int:
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).exists():
        config, overrides = None, [config] + overrides
    inp = PlanInput(config, tuple(overrides), args.cluster, args.calibrate, args.lengths, args.steps, args.seed)
    try:
        if args.sweep:
            return _cli_sweep(inp, args)
        res, s, (recipe, costs, workload) = simulate(inp)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(describe(recipe, costs, workload))
    print()
    print(report_text(s))
    out = Path(args.out or (Path(args.calibrate) / "plan_report" if args.calibrate else "plan_report"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"gantt          {plot(res, out / 'gantt.png')}")
    if args.calibrate:
        m = measured_summary(args.calibrate)
        print(f"measured       {line(m)}")
        print(f"predicted      {line(s)}")
        print(f"error          samples/s {s['samples_per_s'] / m['samples_per_s'] - 1:+.1%}, trainer busy "
              f"{s['trainer_busy'] - m['trainer_busy']:+.3f}, "
              f"rollout busy {s['rollout_busy'] - m['rollout_busy']:+.3f}")
    return 0


def _cli_sweep(inp: PlanInput, args) -> int:
    import pandas as pd

    recipe, costs, workload, _ = setup(inp)
    print(describe(recipe, costs, workload))
    print()
    axes = parse_sweep(args.sweep)
    table, best = sweep(inp, axes, args.max_staleness)
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    if best is None:
        print(f"no setting keeps trained tokens within {args.max_staleness:g} versions")
        return 1
    print(f"recommended (fastest with staleness <= {args.max_staleness:g}): "
          f"{' '.join(f'{k}={best[k]}' for k, _ in axes)}: {best['samples/s']:.3f} samples/s, "
          f"trainer busy {best['trainer_busy']:.2f}, engines busy {best['engine_busy']:.2f}")
    return 0


def add_subcommand(sub) -> None:
    p = sub.add_parser("plan")
    p.add_argument("config", nargs="?", default=None, help="recipe YAML (default: the calibrated run's config.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value: recipe keys, cluster keys or short names (engines=8)")
    p.add_argument("--calibrate", default=None, metavar="RUN", help="a run directory: costs from its profile")
    p.add_argument("--cluster", default=None, metavar="FILE", help="cluster file, e.g. configs/clusters/h100_64.yaml")
    p.add_argument("--lengths", default=None, metavar="SRC",
                   help="RUN/rollouts, or lognormal:mean=M,max=X[,sigma=S,prompt=P,turns=T,tool_s=..]")
    p.add_argument("--steps", type=int, default=0, help=f"steps to simulate (default min(run.steps, {DEFAULT_STEPS}))")
    p.add_argument("--sweep", nargs="+", default=None, metavar="KEY=V1,V2", help="e.g. stale_steps=0,1,2 engines=4,8")
    p.add_argument("--max-staleness", type=float, default=1, help="the sweep's bound on trained-token staleness")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="where gantt.png goes (default RUN/plan_report or ./plan_report)")
    p.set_defaults(fn=cli_plan)
