"""The planner against published sync vs async runs: does it predict the direction and size of their speed-ups?

    python benchmarks/plan_published.py [--cases verl-128,areal-1.5b] [--steps-scale 1.0] [--seed 0]

For each published run below, `loongsage plan`'s simulation (pipeline/planner/: the real Gate, window
strategies and Window, timed by cost models) runs the synchronous and the asynchronous setting
of that run on a cluster file with the run's GPUs and model, and the predicted ratio (async samples/s over
sync samples/s) is printed next to the published one. Nothing here is fitted to a published ratio.

Cases (published figures; "not published" = our assumption, named in the case):

  verl-32 / verl-64 / verl-128   volcengine/verl @b178a3c, verl/experimental/fully_async_policy/README.md,
        "Experiments / Asynchronous Training on 7B Model" (same table in docs/advance/fully_async.md), and
        its script shell/dapo_7b_math_fsdp2_64_64.sh. Qwen2.5-Math-7B, DAPO, 128/64/32 H20 GPUs; batch 512
        prompts x 16 (rollout.n); max response 28K (28 x 1024); prompt up to 2048. Sync: colocated on all
        GPUs, vLLM TP4, old-log-prob pass 53.92/70.26/107.71 s, step 356.30/365.28/790.10 s. Async
        (fully_async_policy, GPUs split rollout:train 64:64/32:32/16:16): staleness_threshold 0.5,
        partial_rollout True, require_batches 4 x ppo_mini_batch_size 32 = 128 prompts per trainer fetch,
        trigger_parameter_sync_step 4 (a sync every 512 prompts), no old-log-prob pass (rollout log-probs);
        step 150.63/189.26/294.77 s. Published speed-up at 400 steps 2.35x/1.92x/2.66x; the step-time
        ratios (compared here) 2.37x/1.93x/2.68x. update_actor per step: sync 113.81/133.41/269.80 s on
        128/64/32 GPUs, async 113.16/156.98/313.81 s on 64/32/16.
  verl-1off-16   volcengine/verl @b178a3c, docs/advance/one_step_off.md, "Experimental Results" (the
        VLLM+FSDP2 rows), and the FSDP2 script of that date (recipe/one_step_off_policy/
        dapo_7b_math_fsdp2_4_12.sh @84b712d). Qwen2.5-Math-7B, DAPO, 16 H20 (2 nodes); batch 516 x 16;
        max response 20,480; vLLM TP2. Sync: colocated on 16 GPUs, step 749 s. Async (one-step-off:
        staleness 1, the next batch generated whole under the previous weights, no partial rollout):
        4 rollout + 12 train GPUs, step 520 s (update_actor 286 s sync, 337 s async). Step ratio 1.44x
        (the page's "+23%" compares total times of runs with different step counts: 19h18m / 749 s vs
        15h34m / 520 s).
  areal-1.5b / areal-7b   inclusionAI/AReaL @820ca49, blog/AReaL_v0_3.md, table 2 ("End-to-end comparison
        between asynchronous AReaL and synchronous AReaL"): R1-Distill-Qwen-1.5B on 16 nodes, 1000 PPO
        steps in 41.0 h sync vs 14.8 h async (2.77x); -7B on 24 nodes, 57.7 h vs 25.4 h (2.27x). Nodes of
        8 x H800 (blog/AReaL_v0_1.md). Not in that table, whose caption says it follows AReaL-boba (v0.2):
        boba's batch 512 x 16 and max generation 27,648 (examples/configs/v0.2-qwen2-math/*-distill/
        ppo-*-gpus-128.yaml @800e8d6; blog/AReaL_v0_2.md: "512 questions ... 16 responses ... 27K tokens";
        the same blog's ablations use 8,192, a shorter alternative);
        staleness eta = 4, 512 concurrent rollouts, recomputed log-probs (benchmark/verl_v0_3_0_post1_76084d3/
        areal_config.yaml) and 3/4 of the GPUs for SGLang TP1 (build_cmd.py). ASSUMPTION: the synchronous
        run is the same system with eta = 0 ("When eta = 0, the system degenerates to the synchronous RL
        setting", blog/AReaL_v0_3.md) on the same GPU split.

No published run gives its mean response length. Each case takes it from its published *synchronous*
run, so the async prediction stays free: where verl publishes the sync step's trainer phases (old-log-prob
+ update_actor seconds), the mean at which the cluster preset's trainer model (its FLOPs form, MFU 0.35)
takes those seconds (closed form, "T"); else (AReaL) the mean whose simulated sync step equals the
published one (secant steps on the mean, "S"; "S!" where the sync step does not pin the mean down because
the longest response's decode alone fills it). The length distribution is the planner's clipped
log-normal with the sigma at which the longest of a sync step's responses is expected at the published
maximum (tail_sigma: the runs set their maximum where their long tail reaches it; --sigma fixes it
instead), prompts 256 tokens (ASSUMPTION). Costs are the cluster files' presets (configs/clusters/
h20_128.yaml, h800_128.yaml; the derivation rules of h100_64.yaml), never changed per case.

What verl's phases say about its workload: at equal trainer seconds per token (the same FSDP2 update in
both modes), update_actor x trainer GPUs puts the fully async runs' trained tokens per step at 0.50 /
0.59 / 0.58x the sync runs' (128 / 64 / 32 GPUs; one-step-off: 0.88x; printed per case). Either the async
runs' responses were about half as long (verl's README: "the number of samples issued each time in
streaming affects the response length during training") or the split-off trainer, with its GPUs to
itself, spends half the GPU-seconds per token; the table cannot tell which. The planner holds the
workload and the trainer's cost per token fixed across modes, so it predicts these cases' ratios without
that factor (its predictions near 1x are the fixed-workload answer).

How the published async settings map onto the simulation's window (modelling choices, not fits):
  * staleness bound at dispatch only: verl (staleness_threshold) and AReaL (eta) bound how far generation
    may run ahead and train every finished sample; LoongSage's batcher also drops a group whose oldest
    token is older than int(stale_steps) versions. Async runs here get a batcher with no such age bound
    (the window's capacity still bounds staleness; the staleness the run reached is printed).
  * verl fully async: its trainer takes 128-prompt fetches and may produce (1 + 0.5) x 512 = 768 prompts
    per parameter version; here a step is one fetch (groups_per_step=128) and the window's capacity is
    those 768 prompts (stale_steps = 768 / 128 - 1 = 5). The simulation syncs after every fetch (verl:
    every 4th); a sync costs the preset's 1.3 s.
  * verl one-step-off: stale_steps=1, the batch dispatched as one block, partial=wait (engines finish
    the batch before the weights change).

The size check is |predicted / published - 1| <= 35%. Each case runs a few steps (the first, start-up,
is left out of the figures), so the whole script takes minutes on a laptop CPU; its wall time is printed.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

ROOT = Path(__file__).resolve().parent.parent
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(ROOT)     # run as a script: the repository first, not this folder (its transfer.py names
    #                             the package); imported (tests/test_plan.py), the importer's path stands

from pipeline.planner.plan import PlanInput, setup  # noqa: E402
from pipeline.planner.report import simulated_summary  # noqa: E402
from pipeline.planner.sim import Simulation  # noqa: E402

RECIPE = ROOT / "configs" / "megatron_sglang_qwen2.5_7b.yaml"   # only its rollout/batcher keys are read,
H20 = ROOT / "configs" / "clusters" / "h20_128.yaml"             # and every case overrides them
H800 = ROOT / "configs" / "clusters" / "h800_128.yaml"
TOLERANCE = 0.35
PROMPT = 256


def tail_sigma(mean: float, max_len: int, n: int) -> float:
    """The log-normal sigma at which the longest of a step's n responses is expected at max_len: the
    published runs set their maximum where their long tail reaches it (AReaL's 27K: "truncation rate
    remained below 5%", blog/AReaL_v0_2.md; DAPO's overlong buffer penalises responses near it). From
    ln(max / mean) = z sigma - sigma^2 / 2 with z the 1 - 1/n normal quantile (the smaller root)."""
    z, gap = NormalDist().inv_cdf(1 - 1 / n), math.log(max_len / mean)
    return z - math.sqrt(max(0.0, z * z - 2 * gap))


@dataclass(frozen=True)
class Mode:
    """One side of a published comparison: planner overrides (recipe and cluster keys) and steps to run."""
    label: str
    overrides: tuple
    steps: int
    dispatch_bound_only: bool = False     # the published system drops no finished sample as too stale
                                          # (a sync run never has one: stale_steps=0 trains fresh tokens)


@dataclass(frozen=True)
class Case:
    name: str
    source: str
    cluster: Path
    nodes: int
    max_len: int
    published_sync_step_s: float          # per published step (batch of the sync run)
    published_sync_train_s: float | None  # the sync step's trainer phases (old log-prob + update), if published
    published_ratio: float                # async throughput / sync throughput, as published
    sync: Mode
    async_: Mode
    samples_per_sync_step: int
    # published update_actor seconds per step, sync and async, and each run's trainer GPUs, where both
    # are published: the trained-token ratio they imply (implied_token_ratio)
    update_s: tuple[float, float] | None = None
    train_gpus: tuple[int, int] | None = None

    def implied_token_ratio(self) -> float | None:
        """Tokens the published async run trained per step over the sync run's, if their trainers spent the
        same GPU-seconds per token: update_actor seconds x trainer GPUs, async over sync (both update only;
        the sync run's old-log-prob pass is a phase of its own). The planner holds the workload fixed across
        modes, so a ratio far from 1 is a workload (or trainer efficiency) change it cannot reproduce."""
        if self.update_s is None:
            return None
        return (self.update_s[1] * self.train_gpus[1]) / (self.update_s[0] * self.train_gpus[0])

    def sigma(self, mean: float, fixed: float | None = None) -> float:
        return fixed if fixed else tail_sigma(mean, self.max_len, self.samples_per_sync_step)

    def lengths(self, mean: float, sigma: float | None = None) -> str:
        return (f"lognormal:mean={mean:.0f},max={self.max_len},sigma={self.sigma(mean, sigma):.3f},"
                f"prompt={PROMPT}")


def _verl_fully_async(gpus: int, sync_step: float, sync_train: float, async_step: float,
                      update_s: tuple[float, float]) -> Case:
    tp4, half = "qwen25-math-7b-tp4", gpus // 2
    common = (f"cluster.nodes={gpus // 8}", f"layout.model={tp4}", "n_samples=16", "window=no-window",
              "groups_per_batch=1")
    return Case(
        f"verl-{gpus}", "verl fully_async_policy/README.md, 7B table", H20, gpus // 8, 28 * 1024, sync_step,
        sync_train, sync_step / async_step,
        Mode(f"colocated sync, {gpus // 4} x TP4 on {gpus}", common + (
            "groups_per_step=512", "stale_steps=0", "num_workers=512", "colocate=true", f"engines={gpus // 4}"),
            steps=4),
        Mode(f"{half}:{half}, stale 0.5, partial", common + (
            "groups_per_step=128", "stale_steps=5", "num_workers=768", "partial=interrupt", "colocate=false",
            f"engines={half // 4}", f"models.{tp4}.trainer.flops_per_param_token=6"),
            steps=13, dispatch_bound_only=True),
        samples_per_sync_step=512 * 16, update_s=update_s, train_gpus=(gpus, half))


def _areal(size: str, nodes: int, sync_h: float, async_h: float) -> Case:
    model, gpus = f"r1-distill-qwen-{size.replace('.', '_')}", nodes * 8
    engines = gpus * 3 // 4
    common = (f"cluster.nodes={nodes}", f"layout.model={model}", "groups_per_step=512", "n_samples=16",
              "window=no-window", "groups_per_batch=1", "num_workers=512", "partial=interrupt",
              "colocate=false", f"engines={engines}")
    split = f"{engines}:{gpus - engines}"
    return Case(
        f"areal-{size}", "AReaL blog/AReaL_v0_3.md, table 2", H800, nodes, 27648, sync_h * 3600 / 1000,
        None, sync_h / async_h,
        Mode(f"{split}, eta 0", common + ("stale_steps=0",), steps=4),
        Mode(f"{split}, eta 4, interruptible", common + ("stale_steps=4",), steps=7, dispatch_bound_only=True),
        samples_per_sync_step=512 * 16)


def _verl_one_step_off() -> Case:
    tp2 = "qwen25-math-7b-tp2"
    common = ("cluster.nodes=2", f"layout.model={tp2}", "groups_per_step=516", "n_samples=16",
              "window=no-window")
    return Case(
        "verl-1off-16", "verl docs/advance/one_step_off.md, FSDP2 rows", H20, 2, 20480, 749.0, 88.0 + 286.0,
        749 / 520,
        Mode("colocated sync, 8 x TP2 on 16", common + (
            "stale_steps=0", "groups_per_batch=1", "num_workers=516", "colocate=true", "engines=8"), steps=4),
        Mode("4 rollout + 12 train, one-step-off", common + (
            "stale_steps=1", "groups_per_batch=516", "num_workers=2", "partial=wait", "colocate=false",
            "engines=2"), steps=5, dispatch_bound_only=True),
        samples_per_sync_step=516 * 16, update_s=(286.0, 337.0), train_gpus=(16, 12))


CASES = {c.name: c for c in (
    _verl_fully_async(32, 790.10, 107.71 + 269.80, 294.77, (269.80, 313.81)),
    _verl_fully_async(64, 365.28, 70.26 + 133.41, 189.26, (133.41, 156.98)),
    _verl_fully_async(128, 356.30, 53.92 + 113.81, 150.63, (113.81, 113.16)), _verl_one_step_off(),
    _areal("1.5b", 16, 41.0, 14.8), _areal("7b", 24, 57.7, 25.4))}


def run_mode(case: Case, mode: Mode, mean: float, steps: int | None = None, seed: int = 0,
             sigma: float | None = None) -> dict:
    """One simulated run of a case's side: the planner's summary (samples/s, busy fractions, staleness).
    sigma None: the tail rule (tail_sigma)."""
    recipe, costs, workload, _ = setup(PlanInput(str(RECIPE), mode.overrides, str(case.cluster),
                                                 lengths=case.lengths(mean, sigma), steps=steps or mode.steps))
    sim = Simulation(recipe, costs, workload, seed=seed)
    if mode.dispatch_bound_only or recipe.stale_steps == 0:
        # the real window without its token-age bound: the published systems bound staleness at dispatch
        # (the window) and train every finished sample; a synchronous run's tokens are all fresh anyway
        sim.window.max_staleness = sys.maxsize
    s = simulated_summary(sim.run())
    if recipe.stale_steps == 0 and s["staleness_max"] != 0:
        raise AssertionError(f"{case.name} {mode.label}: a synchronous run trained stale tokens")
    return s


def sync_step_s(case: Case, mean: float, steps: int = 3, seed: int = 0, sigma: float | None = None) -> float:
    """Simulated seconds per published sync step (its batch) at this mean response length."""
    s = run_mode(case, case.sync, mean, steps, seed, sigma)
    return case.samples_per_sync_step / s["samples_per_s"]


def mean_from_train_s(case: Case) -> float:
    """The mean response length at which the sync run's trainer model (the cluster preset's FLOPs form:
    fixed_s + per-token seconds x prompt and response tokens) takes the published sync trainer seconds."""
    _, costs, _, _ = setup(PlanInput(str(RECIPE), case.sync.overrides, str(case.cluster),
                                     lengths=case.lengths(case.max_len / 4), steps=2))
    t = costs.trainer
    return (case.published_sync_train_s - t.fixed_s) / (t.per_token_s * case.samples_per_sync_step) - PROMPT


def mean_from_step_s(case: Case, seed: int = 0, sigma: float | None = None, tol: float = 0.03,
                     tries: int = 5) -> tuple[float, bool]:
    """The mean response length whose simulated sync step matches the published one (secant steps on
    the mean; the step grows with it). Also whether the mean is identifiable at all: not when a tiny
    mean already gives (90% of) the published step, i.e. the longest response's decode alone fills it."""
    target = case.published_sync_step_s
    lo, hi = case.max_len / 64, 0.6 * case.max_len
    pts = [(m, sync_step_s(case, m, seed=seed, sigma=sigma)) for m in (case.max_len / 16, case.max_len / 6)]
    for _ in range(tries):
        (m0, t0), (m1, t1) = pts[-2], pts[-1]
        if abs(t1 / target - 1) <= tol:
            break
        m = m1 + (target - t1) * (m1 - m0) / (t1 - t0) if t1 != t0 else m1 * target / t1
        m = min(hi, max(lo, m))
        pts.append((m, sync_step_s(case, m, seed=seed, sigma=sigma)))
    mean, step = min(pts, key=lambda p: abs(p[1] / target - 1))
    identifiable = abs(step / target - 1) <= 2 * tol and sync_step_s(case, lo, seed=seed, sigma=sigma) < 0.9 * target
    return mean, identifiable


def calibrate_mean(case: Case, seed: int = 0, sigma: float | None = None) -> tuple[float, str]:
    """No published run gives its mean response length: take it from the published synchronous run, from
    its trainer phases where published (T), else from its step (S; S! where the step does not pin it down:
    see mean_from_step_s). Returns (mean, how)."""
    if case.published_sync_train_s is not None:
        return mean_from_train_s(case), "T"
    mean, ok = mean_from_step_s(case, seed, sigma)
    return mean, "S" if ok else "S!"


def compare(case: Case, mean: float, steps_scale: float = 1.0, seed: int = 0, sigma: float | None = None) -> dict:
    """Sync and async of one case at one mean length: the summaries and the predicted ratio."""
    scale = {m: max(2, round(m.steps * steps_scale)) for m in (case.sync, case.async_)}
    sync = run_mode(case, case.sync, mean, scale[case.sync], seed, sigma)
    async_ = run_mode(case, case.async_, mean, scale[case.async_], seed, sigma)
    return {"sync": sync, "async": async_, "ratio": async_["samples_per_s"] / sync["samples_per_s"]}


def _row(case: Case, mean: float, how: str, out: dict) -> str:
    pred, pub = out["ratio"], case.published_ratio
    err = pred / pub - 1
    s, a = out["sync"], out["async"]
    n = case.samples_per_sync_step       # steps in the sync run's batch: seconds per that many samples
    return (f"{case.name:<13} {case.sync.label:<30} {case.async_.label:<34} {case.max_len:>6} {mean:>6.0f}{how:<2}"
            f"{case.published_sync_step_s:>5.0f}/{n / s['samples_per_s']:<5.0f} "
            f"{case.published_sync_step_s / pub:>5.0f}/{n / a['samples_per_s']:<5.0f} "
            f"{pub:>5.2f}x {pred:>5.2f}x {err:>+5.0%}  "
            f"{s['trainer_busy']:.2f}/{s['engine_busy']:.2f}  {a['trainer_busy']:.2f}/{a['engine_busy']:.2f}  "
            f"{a['staleness_mean']:.2f}/{a['staleness_max']:<2d}  "
            f"{'yes' if (pred > 1) == (pub > 1) else 'NO':<4} {'yes' if abs(err) <= TOLERANCE else 'NO'}")


HEADER = (f"{'case':<13} {'sync (as published)':<30} {'async (as published)':<34} {'max':>6} {'mean*':>8} "
          f"{'sync s p/sim':<11} {'async s p/sim':<11} {'publ':>6} {'pred':>6} {'err':>5}  sync T/E   async T/E  "
          f"stale m/x  dir  +-{TOLERANCE:.0%}")
FOOTER = ("max / mean*: response tokens (max published; mean not published anywhere: T = from the published sync "
          "trainer phases, S = from the published sync step, S! = the sync step does not pin it down: its longest "
          "response alone fills it); sync s / async s: seconds per sync batch, published / simulated; "
          "publ / pred: async over sync samples/s; T/E: trainer / engines busy fraction; "
          "stale m/x: trained-token staleness mean / max in versions (async run).")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    p.add_argument("--steps-scale", type=float, default=1.0, help="scale every case's simulated step count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sigma", type=float, default=None,
                   help="log-normal sigma for every case (default: the tail rule, tail_sigma)")
    args = p.parse_args(argv)
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)}; cases: {', '.join(CASES)}")
    t0 = time.perf_counter()
    rows, misses = [], []
    for name in names:
        case = CASES[name]
        t = time.perf_counter()
        mean, how = calibrate_mean(case, args.seed, args.sigma)
        out = compare(case, mean, args.steps_scale, args.seed, args.sigma)
        rows.append(_row(case, mean, how, out))
        tokens = case.implied_token_ratio()
        print(f"  {name}: mean {mean:.0f} tokens ({how}), sigma {case.sigma(mean, args.sigma):.2f}, "
              f"ratio {out['ratio']:.2f}x, "
              + (f"published update_actor implies the async run trained {tokens:.2f}x the sync run's tokens "
                 f"per step at equal trainer cost, " if tokens is not None else "")
              + f"{time.perf_counter() - t:.0f} s", flush=True)
        if abs(out["ratio"] / case.published_ratio - 1) > TOLERANCE or out["ratio"] <= 1 or how == "S!":
            misses.append(name)
    print(HEADER)
    print("\n".join(rows))
    print(FOOTER)
    print(f"wall time {time.perf_counter() - t0:.0f} s; {len(rows) - len(misses)}/{len(rows)} within "
          f"+-{TOLERANCE:.0%} with the right direction" + (f"; missed: {', '.join(misses)}" if misses else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
