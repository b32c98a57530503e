"""The scale planner (pipeline/planner/): its simulation obeys the real window's
properties, reduces to closed forms where one exists, and names what is wrong with bad input."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline.planner.calibrate import calibrate
from pipeline.planner.cluster import build_costs, load_cluster
from pipeline.planner.model import Costs, EngineModel, Layout, PlanError, StageCosts, SyncModel, TrainerModel
from pipeline.planner.plan import PlanInput, simulate, sweep
from pipeline.planner.report import simulated_summary
from pipeline.planner.sim import Recipe, Simulation
from pipeline.planner.workload import ParametricLengths, SampleSpec, turns_of
from pipeline.window import capacity

ROOT = Path(__file__).resolve().parent.parent
H100 = ROOT / "configs" / "clusters" / "h100_64.yaml"


class FixedLengths:
    """A workload whose every sample is the same: the closed forms below need one."""

    def __init__(self, tokens: int, prompt: int = 0, turns: int = 1, tool_s: float = 0.0):
        per = [(tokens, 0, tool_s)] * (turns - 1) + [(tokens, 0, 0.0)]
        self.spec = SampleSpec(prompt, tuple(per))

    def group(self, rng, n):
        return [self.spec] * n

    def describe(self):
        return "fixed"


class RandomLengths:
    """Uniform random lengths: samples finish out of order, which is what the window must survive."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi

    def group(self, rng, n):
        return [SampleSpec(4, ((int(rng.integers(self.lo, self.hi + 1)), 0, 0.0),)) for _ in range(n)]

    def describe(self):
        return "random"


def _costs(engines=1, base_s=0.01, per_seq_s=0.0, train=(0.5, 0.001), sync=0.1, stages=None, **kw):
    return Costs(EngineModel(base_s, per_seq_s, **kw), TrainerModel(*train), SyncModel(sync), stages or StageCosts(),
                 Layout(engines=engines))


# ---- the window -------------------------------------------------------------------------------

def watch_dispatches(sim: Simulation) -> tuple[list[int], list[int]]:
    """What the simulation's real gate holds after each dispatch (its `acquire`, wrapped): R + Q, and the
    spread from the dispatched seq to the oldest uncollected one."""
    in_window, spread = [], []
    acquire = sim.gate.acquire

    async def watched(seqs):
        version = await acquire(seqs)
        s, q = sim.gate.s, seqs[-1]
        in_window.append(s.in_flight + s.buffered)
        spread.append(q - s.min_uncompleted(q))
        return version

    sim.gate.acquire = watched
    return in_window, spread


@pytest.mark.parametrize("window,B,stale,gpb,workers", [
    ("no-window", 2, 0, 1, 4), ("no-window", 3, 1, 1, 8), ("window-gated", 2, 1, 1, 8),
    ("window-gated", 4, 2, 2, 6), ("windowed-fifo", 3, 1, 1, 8), ("windowed-fifo", 2, 2, 1, 8)])
def test_simulated_window_bounds_staleness_like_the_real_gate(window, B, stale, gpb, workers):
    """The properties tests/test_window.py checks on the real gate hold for every simulated step:
    R + Q <= C, a window-gated spread < C, every trained token at most stale_steps versions old,
    each group trained once."""
    recipe = Recipe(B, 3, steps=12, stale_steps=stale, window=window, groups_per_batch=gpb, num_workers=workers)
    costs = _costs(engines=2, base_s=0.002, per_seq_s=0.0005, train=(0.05, 0.0005), sync=0.01)
    sim = Simulation(recipe, costs, RandomLengths(1, 120), seed=B * 10 + stale)
    in_window, spread = watch_dispatches(sim)
    res = sim.run()
    C = capacity(B, stale)
    assert in_window and max(in_window) <= C
    if window == "window-gated":
        assert max(spread) < C
    keys, weights = res.staleness()
    assert keys.min() >= 0 and keys.max() <= stale
    assert weights.sum() > 0
    trained = [g for step in res.trained for g in step]
    assert len(trained) == len(set(trained)) == 12 * B
    assert not set(trained) & set(res.dropped)
    if stale > 0:       # the window did let rollout run ahead: some tokens are one version old
        assert keys.max() >= 1


@pytest.mark.parametrize("window", ["no-window", "window-gated"])
def test_masked_tokens_are_not_counted_as_trained_staleness(window):
    """stale_policy=mask with partial rollout: a long sample's tokens from too old a version leave the
    loss; the simulated staleness per trained token counts loss tokens only, as the real run's
    staleness/* does, so it stays within stale_steps (here it read 3 with stale_steps 2 before: 10% of
    the tokens)."""
    recipe = Recipe(2, 3, steps=12, stale_steps=2, window=window, num_workers=8, stale_policy="mask")
    costs = _costs(engines=1, base_s=0.002, per_seq_s=0.0005, train=(0.5, 0.0), sync=0.01)
    res = Simulation(recipe, costs, RandomLengths(1, 2000), seed=2).run()
    assert any(r.masked for r in res.samples)          # masking did happen
    keys, weights = res.staleness()
    assert keys.max() <= 2 and weights.sum() > 0


def test_synchronous_window_trains_fresh_tokens_in_order():
    res = Simulation(Recipe(2, 4, steps=6), _costs(), RandomLengths(1, 50)).run()
    keys, _ = res.staleness()
    assert list(keys) == [0]
    assert [g for step in res.trained for g in step] == list(range(12))


# ---- closed forms -----------------------------------------------------------------------------

def test_zero_latency_infinite_engines_reduce_to_trainer_time():
    B, N, steps = 4, 8, 8
    fixed, per_token, L = 1.5, 0.002, 100
    costs = _costs(engines=1000, base_s=0.0, train=(fixed, per_token), sync=0.0)
    for stale, window in ((0, "no-window"), (1, "window-gated")):
        res = Simulation(Recipe(B, N, steps, stale_steps=stale, window=window), costs, FixedLengths(L)).run()
        s = simulated_summary(res)
        t_train = fixed + per_token * B * N * L
        assert s["step_s"] == pytest.approx(t_train, rel=1e-9)
        assert s["samples_per_s"] == pytest.approx(B * N / t_train, rel=1e-9)
        assert s["trainer_busy"] == pytest.approx(1.0, abs=1e-9)
        assert s["bubble_frac"] == pytest.approx(0.0, abs=1e-9)


def test_one_engine_one_trainer_sync_matches_the_sum_of_phase_times():
    B, N, L, P = 3, 4, 300, 20          # L > the simulation's decode chunk: re-planned intervals add up
    e = dict(base_s=0.004, per_seq_s=0.0003, prefill_per_token_s=1e-5, call_s=0.02)
    st = StageCosts(reward_fixed_s=0.03, reward_per_row_s=0.002, handoff_s=0.05, dispatch_s=0.01)
    train, sync = (0.7, 1e-4), 0.25
    costs = _costs(engines=1, train=train, sync=sync, stages=st, **{k: v for k, v in e.items()})
    res = Simulation(Recipe(B, N, steps=5), costs, FixedLengths(L, prompt=P)).run()
    rows = B * N
    phases = {"dispatch": st.dispatch_s, "call": e["call_s"], "prefill": rows * P * e["prefill_per_token_s"],
              "decode": L * (e["base_s"] + e["per_seq_s"] * rows),
              "reward": st.reward_fixed_s + st.reward_per_row_s * rows, "handoff": st.handoff_s,
              "update": train[0] + train[1] * rows * L, "sync": sync}
    s = simulated_summary(res)
    assert s["step_s"] == pytest.approx(sum(phases.values()), rel=1e-9)
    gen = phases["call"] + phases["prefill"] + phases["decode"]
    assert s["rollout_busy"] == pytest.approx(gen / sum(phases.values()), rel=1e-9)


def test_async_overlaps_rollout_with_training():
    """Same costs, stale_steps 1: the step takes max(rollout, update) + sync rather than their sum."""
    costs = _costs(engines=1, base_s=0.01, train=(1.0, 0.0), sync=0.05)
    sync_ = simulated_summary(Simulation(Recipe(4, 2, 10), costs, FixedLengths(50)).run())
    async_ = simulated_summary(Simulation(Recipe(4, 2, 10, stale_steps=1, window="window-gated"), costs,
                                          FixedLengths(50)).run())
    assert sync_["step_s"] == pytest.approx(0.5 + 1.0 + 0.05, rel=1e-6)
    assert async_["step_s"] == pytest.approx(1.0 + 0.05, rel=1e-6)


def test_partial_rollout_tags_tokens_with_the_version_they_were_decoded_under():
    """A long sample decoding across a sync: tokens after it carry the new version; with partial=wait
    the sync waits for the engine to drain instead (no sample spans two versions)."""
    recipe = Recipe(1, 2, steps=6, stale_steps=2, window="no-window")
    costs = _costs(engines=1, base_s=0.01, train=(0.3, 0.0), sync=0.02)
    res = Simulation(recipe, costs, RandomLengths(5, 200), seed=3).run()
    assert any(sum(1 for k in r.by_version.values() if k > 0) > 1 for r in res.samples)
    res = Simulation(Recipe(1, 2, 6, stale_steps=2, partial="wait"), costs, RandomLengths(5, 200), seed=3).run()
    assert all(sum(1 for k in r.by_version.values() if k > 0) <= 1 for r in res.samples)


# ---- workloads ---------------------------------------------------------------------------------

def test_parametric_lengths_hit_the_clipped_mean():
    w = ParametricLengths(mean=12700, max=32768, sigma=0.8)
    rng = np.random.default_rng(0)
    lens = [s.response_tokens for _ in range(4000) for s in w.group(rng, 1)]
    assert np.mean(lens) == pytest.approx(12700, rel=0.03)
    assert max(lens) == 32768                       # the clipped tail: truncated samples


def test_turns_from_a_loss_mask():
    assert turns_of([1, 1, 0, 0, 0, 1, 1, 1, 0, 1]) == [[2, 3], [3, 1], [1, 0]]
    assert turns_of([1, 1, 1]) == [[3, 0]]


# ---- the cluster file --------------------------------------------------------------------------

def test_an_agents_time_outside_generation_is_spent_once_across_its_gaps():
    """Three model turns, one tool call, 3 s outside generation: 1.5 s in each of the two gaps (not
    3 s per tool call in every gap), and none of it charged to the engine of its block."""
    import pandas as pd

    from pipeline.planner.calibrate import _outside_generation
    from pipeline.planner.workload import agent_turns

    stats = {"wall_s": 5.0, "gen_s": 2.0, "tool_calls": 1}
    turns = agent_turns([1, 1, 0, 0, 0, 1, 0, 1, 1], stats)
    assert [g for g, _, _ in turns] == [2, 1, 2] and [t for _, t, _ in turns] == [3, 1, 0]
    assert [w for _, _, w in turns] == [1.5, 1.5, 0.0]
    assert sum(w for _, _, w in turns) == pytest.approx(stats["wall_s"] - stats["gen_s"])
    block = pd.DataFrame({"t_done": [1.0, 7.0], "agent_stats": [{"wall_s": 1.0, "gen_s": 1.0}, stats]})
    assert _outside_generation(block) == 3.0                 # the sample that finished last
    assert _outside_generation(block.drop(columns="agent_stats")) == 0.0


def test_cluster_preset_builds_costs_from_its_figures():
    costs = build_costs(load_cluster(H100, {"layout.engines": 16}))
    assert "trainer on 48 GPUs" in costs.layout.description and costs.layout.engines == 16
    assert costs.trainer.per_token_s == pytest.approx(8 * 7.62e9 / (48 * 989e12 * 0.35))
    assert costs.sync.seconds == pytest.approx(1.0 + 7.62e9 * 2 / 50e9)
    big = build_costs(load_cluster(H100, {"layout.model": "qwen2.5-32b", "layout.engines": 8}))
    assert "8 engines x TP4 + trainer on 32 GPUs" in big.layout.description      # the preset's TP4


def _write(tmp_path, edit) -> Path:
    data = yaml.safe_load(H100.read_text())
    edit(data)
    p = tmp_path / "cluster.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_bad_cluster_files_name_the_file_and_the_key(tmp_path):
    p = _write(tmp_path, lambda d: d["interconnect"].update(infiniband_gbps=400))
    with pytest.raises(PlanError, match=r"cluster\.yaml: unknown key interconnect\.infiniband_gbps \(valid: "):
        load_cluster(p)
    p = _write(tmp_path, lambda d: d["interconnect"].update(inter_node_gb_s=-50))
    with pytest.raises(PlanError, match=r"cluster\.yaml: interconnect\.inter_node_gb_s must be >= 0, got -50"):
        load_cluster(p)
    p = _write(tmp_path, lambda d: d["layout"].update(model="llama-405b"))
    with pytest.raises(PlanError, match=r"layout\.model 'llama-405b' is not a preset .*qwen2\.5-7b"):
        load_cluster(p)
    p = _write(tmp_path, lambda d: d["models"]["qwen2.5-7b"]["engine"].update(decode_base_s="fast"))
    with pytest.raises(PlanError, match=r"models\.qwen2\.5-7b\.engine\.decode_base_s must be a number"):
        load_cluster(p)
    with pytest.raises(PlanError, match="no such file"):
        load_cluster(tmp_path / "missing.yaml")
    with pytest.raises(PlanError, match=r"layout\.engines=64 x engine_tp=1 takes all 64 GPUs"):
        build_costs(load_cluster(H100, {"layout.engines": 64}))


def test_bad_plan_inputs_are_named(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("run: {steps: 3}\n")
    with pytest.raises(PlanError, match=rf"--calibrate {run}: no profile directory {run / 'profile'}"):
        calibrate(run)
    with pytest.raises(PlanError, match="give --calibrate RUN .* or --cluster FILE"):
        simulate(PlanInput("configs/quickstart.yaml"))
    with pytest.raises(PlanError, match=r"layout\.engines is a cluster-file key; give --cluster"):
        simulate(PlanInput("configs/quickstart.yaml", ("layout.engines=4",), calibrate=str(run)))
    with pytest.raises(PlanError, match="unknown key 'avg'"):
        ParametricLengths.parse("lognormal:avg=100,max=200")
    with pytest.raises(PlanError, match=r"lengths\.mean \(300.0\) must be below lengths\.max \(200\)"):
        ParametricLengths.parse("lognormal:mean=300,max=200")


# ---- the command line --------------------------------------------------------------------------

CLUSTER_SMALL = ("groups_per_step=8", "n_samples=4", "groups_per_batch=1", "num_workers=64",
                 "window=window-gated", "engines=8")
LENGTHS = "lognormal:mean=2000,max=4096"


def test_plan_cli_prints_the_figures_and_draws_the_gantt(tmp_path, capsys):
    from pipeline.cli import main

    code = main(["plan", "configs/quickstart.yaml", *CLUSTER_SMALL, "stale_steps=1", "--cluster", str(H100),
                 "--lengths", LENGTHS, "--steps", "4", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    for what in ("throughput", "busy", "bubble", "staleness", "length bias", "h100_64: 64 x h100_sxm, 8 engines"):
        assert what in out
    assert (tmp_path / "gantt.png").stat().st_size > 10_000
    assert main(["plan", "configs/quickstart.yaml", "--cluster", str(tmp_path / "nope.yaml"),
                 "--lengths", LENGTHS]) == 2
    assert "nope.yaml: no such file" in capsys.readouterr().err


def test_sweep_recommends_the_fastest_setting_within_the_staleness_bound():
    inp = PlanInput("configs/quickstart.yaml", CLUSTER_SMALL, cluster=str(H100), lengths=LENGTHS, steps=4)
    table, best = sweep(inp, [("stale_steps", ["0", "1"]), ("engines", ["4", "8"])], max_staleness=1, log=print)
    assert len(table) == 4
    assert (table[table["stale_steps"] == "0"]["stale_max"] == 0).all()
    assert best["samples/s"] == table[table["stale_max"] <= 1]["samples/s"].max()
    _, strict = sweep(inp, [("stale_steps", ["0", "1"])], max_staleness=0, log=print)
    assert strict["stale_steps"] == "0"


# ---- validation against real runs (slow: real quickstart and agentic runs) ----------------------
# The agentic recipe's built-in model is warmed once (~10 min here; cached after). Its steps wait on
# the slowest of a group's trajectories, so one run is one draw of a long tail: the plan simulates 40
# steps resampled from the recording (the expected step, not the same draw). A 10-step draw missed the
# expected throughput by 16% once on a quiet machine; 20 steps halve that draw's variance.

@pytest.mark.slow
@pytest.mark.parametrize("recipe,overrides,run_steps,plan_steps", [
    ("quickstart", [], 12, 12),
    ("quickstart_async", [], 12, 12),
    ("agent_sandbox_async", ["rollout.stale_steps=0"], 20, 40),
    ("agent_sandbox_async", [], 20, 40),
], ids=["quickstart", "quickstart_async", "agentic_sync", "agentic_async"])
def test_calibrated_plan_predicts_the_run_it_was_calibrated_on(recipe, overrides, run_steps, plan_steps, tmp_path):
    from pipeline.config import load_config
    from pipeline.controller import run
    from pipeline.planner.report import measured_summary

    run_dir = tmp_path / recipe
    run(load_config(f"configs/{recipe}.yaml", [f"run.steps={run_steps}", "eval.num_prompts=0", *overrides]),
        run_dir, log=print)
    _, predicted, _ = simulate(PlanInput(calibrate=str(run_dir), steps=plan_steps))
    measured = measured_summary(run_dir)
    print(recipe, overrides, "measured", measured, "predicted", predicted)
    assert predicted["samples_per_s"] == pytest.approx(measured["samples_per_s"], rel=0.15)
    assert abs(predicted["trainer_busy"] - measured["trainer_busy"]) <= 0.1
    assert abs(predicted["rollout_busy"] - measured["rollout_busy"]) <= 0.1
    shutil.rmtree(run_dir)


# ---- against published runs (benchmarks/plan_published.py) ------------------------------------

def test_published_areal_run_is_predicted_faster_async_than_sync():
    """AReaL's R1-Distill-Qwen-1.5B on 16 x 8 H800, synchronous (eta 0) vs asynchronous (eta 4,
    interruptible): published 2.77x (blog/AReaL_v0_3.md, table 2). Set up as the benchmark does, at a
    fixed mean length near the one it calibrates on the published sync step (6.1K tokens) and a few
    steps: the direction only (the benchmark prints the size against the published figure)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("plan_published", ROOT / "benchmarks" / "plan_published.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench          # dataclasses look their module up while the file runs
    spec.loader.exec_module(bench)
    out = bench.compare(bench.CASES["areal-1.5b"], mean=6000, steps_scale=0.25)
    assert out["sync"]["staleness_max"] == 0
    assert out["async"]["staleness_max"] >= 1          # the async run did run ahead of the trainer
    assert out["ratio"] > 1


def test_a_plan_runs_inside_a_running_event_loop():
    """A notebook's kernel runs an asyncio loop: the simulation (whose gate is async) runs there too,
    with the same figures as outside one."""
    import asyncio

    inp = PlanInput(config="configs/quickstart_async.yaml", cluster="configs/clusters/h100_64.yaml",
                    lengths="lognormal:mean=500,max=2048", steps=3)

    async def inside():
        return simulate(inp)[1]

    assert asyncio.run(inside())["samples_per_s"] == simulate(inp)[1]["samples_per_s"]
