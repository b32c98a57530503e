"""The figures of a run, measured or simulated, computed by one function from spans.

`summarize` reads the profiler's span schema, so a real run (load_spans) and a simulated one
(SimResult.spans) are compared on equal terms. Step 1 (start-up: actor pools, model loads) is
left out of both by default.

    samples_per_s, tokens_per_s   trained rows / response tokens over the window from the end of
                                  step `skip` to the end of the last step
    trainer_busy                  update seconds / step-window seconds (spans.bubbles)
    rollout_busy                  seconds some sample was generating / step-window seconds
    bubble_frac                   the trainer's idle share of the step windows
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pipeline.planner.spans import STEP_PHASES, _union, bubbles, load_spans, plot_gantt
from pipeline.recorder import Recording


def summarize(spans, rollouts=None, skip: int = 1) -> dict:
    d = spans[(spans["step"] > 0) & spans["stage"].isin(STEP_PHASES)]
    ends = d.groupby("step")["end"].max().sort_index()
    kept = ends[ends.index > skip]
    if len(kept) == 0 or skip not in ends.index:
        raise ValueError(f"need more than {skip} steps to measure a steady state (have {len(ends)})")
    t0, t1 = float(ends[skip]), float(kept.iloc[-1])
    upd = spans[(spans["stage"] == "update") & (spans["step"] > skip)]
    wall = max(t1 - t0, 1e-12)
    b = bubbles(spans, rollouts)
    b = b[b["step"] > skip]
    w = max(b["wall_s"].sum(), 1e-12)
    return {"steps": int(len(kept)), "window_s": wall, "step_s": wall / len(kept),
            "samples_per_s": float(upd["rows_in"].sum()) / wall, "tokens_per_s": float(upd["tokens"].sum()) / wall,
            "trainer_busy": float(b["trainer_busy_s"].sum()) / w, "rollout_busy": float(b["rollout_busy_s"].sum()) / w,
            "bubble_frac": float(b["trainer_idle_s"].sum()) / w, "t0": t0, "t1": t1}


def simulated_summary(res, skip: int = 1) -> dict:
    """summarize() of a SimResult plus what only a simulation knows in full: per-engine busy
    fractions, staleness distribution, dropped groups, trained-vs-dispatched length bias."""
    rollouts = res.rollouts()
    s = summarize(res.spans, rollouts, skip)
    eb = {name: _union(iv, s["t0"], s["t1"]) / s["window_s"] for name, iv in res.engine_busy.items()}
    keys, weights = res.staleness()
    total = max(weights.sum(), 1e-12)
    trained = [r.response_tokens for r in res.samples if r.step > 0]
    dispatched = [r.response_tokens for r in res.samples]
    s.update({
        "engine_busy": float(np.mean(list(eb.values()))), "engine_busy_each": eb,
        "staleness": {int(k): float(w / total) for k, w in zip(keys, weights)},
        "staleness_mean": float((keys * weights).sum() / total) if len(keys) else 0.0,
        "staleness_max": int(keys.max()) if len(keys) else 0,
        "dropped_groups": len(res.dropped),
        "trained_len_mean": float(np.mean(trained)) if trained else 0.0,
        "dispatched_len_mean": float(np.mean(dispatched)) if dispatched else 0.0,
    })
    s["length_bias"] = s["trained_len_mean"] / max(s["dispatched_len_mean"], 1e-12)
    return s


def measured_summary(run_dir, skip: int = 1) -> dict:
    """summarize() of a real run directory (profile spans + its recording), plus the engines' own
    busy fraction from metrics.jsonl (rollout/busy_frac, weighted by step wall time)."""
    spans = load_spans(run_dir)
    rollouts = Recording.open(Path(run_dir) / "rollouts").read(
        columns=["t_dispatch", "t_done", "token_versions", "loss_mask"]).to_pandas()
    s = summarize(spans, rollouts, skip)
    lines = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steady = [x for x in lines if x.get("step", 0) > skip and "rollout/busy_frac" in x]
    if steady:
        wall = sum(x["step_wall_s"] for x in steady)
        s["engine_busy"] = sum(x["rollout/busy_frac"] * x["step_wall_s"] for x in steady) / max(wall, 1e-12)
    return s


def line(s: dict) -> str:
    return (f"{s['samples_per_s']:.2f} samples/s, {s['tokens_per_s']:.1f} tokens/s, step {s['step_s']:.3f}s, "
            f"trainer busy {s['trainer_busy']:.2f}, rollout busy {s['rollout_busy']:.2f}, "
            f"bubble {s['bubble_frac']:.2f}" + (f", engines busy {s['engine_busy']:.2f}" if "engine_busy" in s else ""))


def report_text(s: dict) -> str:
    stale = ", ".join(f"{k}: {v:.1%}" for k, v in sorted(s["staleness"].items()))
    busy = ", ".join(f"{k} {v:.2f}" for k, v in s["engine_busy_each"].items())
    if len(s["engine_busy_each"]) > 8:
        vals = list(s["engine_busy_each"].values())
        busy = f"min {min(vals):.2f}, mean {np.mean(vals):.2f}, max {max(vals):.2f} over {len(vals)} engines"
    return "\n".join([
        f"throughput     {s['samples_per_s']:.3f} samples/s, {s['tokens_per_s']:.1f} response tokens/s "
        f"({s['steps']} steady steps, {s['step_s']:.3f} s/step)",
        f"busy           trainer {s['trainer_busy']:.2f}, rollout (any generation) {s['rollout_busy']:.2f}; "
        f"engines: {busy}",
        f"bubble         trainer idle {s['bubble_frac']:.1%} of the step windows",
        f"staleness      per trained token: {stale} (mean {s['staleness_mean']:.2f}, max {s['staleness_max']})",
        f"length bias    trained mean {s['trained_len_mean']:.1f} vs dispatched mean {s['dispatched_len_mean']:.1f} "
        f"tokens (x{s['length_bias']:.3f}); groups dropped as too stale: {s['dropped_groups']}",
    ])


def plot(res, path) -> str:
    """The simulated run's Gantt chart (spans.plot_gantt), as a PNG."""
    shown, gen = res.spans, res.rollouts()
    engines = sorted((a for a in shown["actor"].unique() if str(a).startswith("engine")), key=lambda a: int(a[6:]))
    if len(engines) > 16:       # a row per engine stops being readable: keep the first 16
        shown = shown[~shown["actor"].isin(engines[16:])]
    ax = plot_gantt(shown, rollouts=gen if len(gen) else None)
    ax.set_title("simulated timeline per actor")
    ax.figure.savefig(path, dpi=100)
    return str(path)
