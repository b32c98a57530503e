"""A run's profile read back: its spans as pandas, per-stage tables, plots, `loongsage profile RUN`.

It needs the `profile` extra (pandas, matplotlib); the planner's calibration reads runs through the same functions.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.profile import SPAN_SCHEMA

DRIVER_ACTORS = ("driver", "trainer", "engines")
STEP_PHASES = ("batcher", "update", "sync")     # a step's window; eval and checkpoints fall outside


class ProfileError(ValueError):
    pass


class ProfileWarning(UserWarning):
    pass


def load_spans(run_dir: str | Path):
    """Every span of a run as a pandas DataFrame (+ `duration_s`, and `t` = start relative to the first span).

    A part that does not read (truncated) or a session without its completion marker (an
    aborted run) gives a ProfileWarning naming the file; the readable spans still load and
    `df.attrs["complete"]` is False.
    """
    d = Path(run_dir) / "profile"
    if not d.is_dir():
        raise ProfileError(f"{d}: no profile directory (is {run_dir} a run directory?)")
    parts = sorted(d.glob("part-*.parquet"))
    if not parts:
        raise ProfileError(f"{d}: empty profile (no part-*.parquet): the run stopped before its first flush")
    tables, complete = [], True
    for p in parts:
        try:
            t = pq.read_table(p)
        except (pa.ArrowInvalid, OSError) as e:
            warnings.warn(f"{p}: unreadable, left out ({e})", ProfileWarning, stacklevel=2)
            complete = False
            continue
        missing = [c for c in SPAN_SCHEMA.names if c not in t.column_names]
        if missing:
            raise ProfileError(f"{p}: not a span file (missing {', '.join(missing)})")
        tables.append(t.select(SPAN_SCHEMA.names).cast(SPAN_SCHEMA))
    if not tables:
        raise ProfileError(f"{d}: no readable span file")
    for session in sorted({p.name.split("-")[1] for p in parts}):
        if not (d / f"_complete-{session}.json").is_file():
            warnings.warn(f"{d}: the run that wrote session {session} did not finish (no _complete-{session}.json): "
                          f"spans after its last flush are missing", ProfileWarning, stacklevel=2)
            complete = False
    df = pa.concat_tables(tables).to_pandas().sort_values(["start", "end"], kind="stable").reset_index(drop=True)
    df["duration_s"] = df["end"] - df["start"]
    df["t"] = df["start"] - df["start"].min()
    df.attrs["complete"] = complete
    df.attrs["t0"] = float(df["start"].min())
    return df


def sink_summaries(run_dir: str | Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((Path(run_dir) / "profile").glob("_complete-*.json"))]


def stage_order(spans) -> list[str]:
    """Stages in pipeline order: map stages by their first call, then the driver phases."""
    first = spans.groupby("stage")["start"].min().sort_values()
    driver = set(spans.loc[spans["actor"].isin(DRIVER_ACTORS), "stage"])
    return [s for s in first.index if s not in driver] + [s for s in first.index if s in driver]


def stage_table(spans):
    """Per stage: actors, calls, rows, tokens, busy/wait seconds, rows/s and tokens/s while busy, busy fraction."""
    s = spans.assign(rows=np.maximum(spans["rows_in"], spans["rows_out"]))
    g = s.groupby("stage")
    t = g.agg(actors=("actor", "nunique"), calls=("start", "size"), rows=("rows", "sum"), tokens=("tokens", "sum"),
              busy_s=("duration_s", "sum"), wait_s=("wait_s", "sum"))
    wall = spans["end"].max() - spans["start"].min()
    t["rows_per_s"] = t["rows"] / t["busy_s"].clip(lower=1e-9)
    t["tokens_per_s"] = t["tokens"] / t["busy_s"].clip(lower=1e-9)
    t["busy_frac"] = t["busy_s"] / (t["actors"] * max(wall, 1e-9))
    return t.loc[stage_order(spans)]


def _merge(intervals) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as sorted, disjoint intervals."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _union(intervals, lo: float, hi: float) -> float:
    """Seconds of [lo, hi] that some (start, end) interval covers."""
    return sum(e - s for s, e in _merge((max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi))


def bubbles(spans, rollouts=None):
    """Per training step: its window (driver waits for data -> update -> sync) and who sat idle in it.

    trainer_idle_s: the window minus the update. rollout_busy_s: generation inside the
    window, from the rollouts' t_dispatch..t_done when given, else from map-stage spans.
    """
    import pandas as pd

    d = spans[(spans["step"] > 0) & spans["stage"].isin(STEP_PHASES)]
    if rollouts is not None and len(rollouts):
        gen = list(zip(rollouts["t_dispatch"], rollouts["t_done"]))
    else:
        m = spans[~spans["actor"].isin(DRIVER_ACTORS)]
        gen = list(zip(m["start"], m["end"]))
    out = []
    for step, g in d.groupby("step"):
        lo, hi = g["start"].min(), g["end"].max()
        update = g.loc[g["stage"] == "update", "duration_s"].sum()
        busy = _union(gen, lo, hi)
        out.append({"step": int(step), "wall_s": hi - lo, "trainer_busy_s": update, "trainer_idle_s": hi - lo - update,
                    "rollout_busy_s": busy, "rollout_idle_s": hi - lo - busy})
    b = pd.DataFrame(out)
    if len(b):
        b["trainer_idle_frac"] = b["trainer_idle_s"] / b["wall_s"].clip(lower=1e-9)
        b["rollout_idle_frac"] = b["rollout_idle_s"] / b["wall_s"].clip(lower=1e-9)
    return b


def queue_depths(spans):
    """Rows waiting in front of each stage over time: out of the stage before it, not yet into it.

    Columns: t (s from the first span), queue (the stage waited for; "update" = the trainer), depth (rows).
    """
    import pandas as pd

    order = [s for s in stage_order(spans) if s not in ("batcher", "sync", "eval")]
    frames = []
    for up, down in zip(order, order[1:]):
        a, b = spans[spans["stage"] == up], spans[spans["stage"] == down]
        ev = pd.concat([pd.DataFrame({"time": a["end"], "delta": a["rows_out"]}),
                        pd.DataFrame({"time": b["start"], "delta": -b["rows_in"]})]).sort_values("time", kind="stable")
        frames.append(pd.DataFrame({"t": ev["time"] - spans["start"].min(), "queue": down,
                                    "depth": ev["delta"].cumsum().clip(lower=0)}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["t", "queue", "depth"])


def throughput(spans, bin_s: float | None = None):
    """Rows/s each stage completed per time bin (`bin_s`, default 1/30 of the run).

    Index t: bin start (s from the first span), every bin present; a column per stage that moves rows.
    """
    wall = spans["end"].max() - spans["start"].min()
    bin_s = bin_s or max(wall / 30, 1e-3)
    k = ((spans["end"] - spans["start"].min()) // bin_s).astype(int)
    s = spans.assign(bin=k, rows=np.maximum(spans["rows_in"], spans["rows_out"]))
    table = s.pivot_table(index="bin", columns="stage", values="rows", aggfunc="sum", fill_value=0)
    table = table.reindex(range(int(k.max()) + 1), fill_value=0) / bin_s
    table.index = table.index * bin_s
    table.index.name = "t"
    return table[[c for c in stage_order(spans) if c in table.columns and table[c].sum() > 0]]


def staleness(rollouts) -> np.ndarray:
    """Per trained token: the version trained at its step (step - 1) minus the version that generated it."""
    out = []
    for step, vs, mask in zip(rollouts["step"], rollouts["token_versions"], rollouts["loss_mask"]):
        v = np.asarray(vs, dtype=np.int64)
        out.append(int(step) - 1 - v[np.asarray(mask, dtype=bool) & (v >= 0)])
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def _axes(ax, size=(9, 4)):
    if ax is not None:
        return ax
    from matplotlib.figure import Figure  # no pyplot: works headless and inside notebooks alike

    return Figure(figsize=size, layout="constrained").add_subplot()


def _colors(stages):
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {s: cmap(i % 10) for i, s in enumerate(stages)}


def plot_gantt(spans, ax=None, rollouts=None):
    """One row per actor, one bar per span, coloured by stage.

    With `rollouts` (t_dispatch, t_done per trained row) a bottom row shows when generation
    actually ran: a rollout call's span also covers time it waited at the window gate.
    """
    from matplotlib.patches import Patch

    order = stage_order(spans)
    colors = _colors(order)
    first_stage = spans.groupby("actor")["stage"].first()
    actors = sorted(first_stage.index, key=lambda a: (order.index(first_stage[a]), a))
    ax = _axes(ax, (10, 0.5 * len(actors) + 2))
    t0 = spans["start"].min()
    for i, a in enumerate(actors):
        g = spans[spans["actor"] == a]
        for stage, h in g.groupby("stage"):
            ax.broken_barh(list(zip(h["start"] - t0, h["duration_s"])), (i - 0.4, 0.8), color=colors[stage])
    rows, handles = dict(enumerate(actors)), [Patch(color=colors[s], label=s) for s in order]
    if rollouts is not None and len(rollouts):
        gen = _merge(zip(rollouts["t_dispatch"], rollouts["t_done"]))
        ax.broken_barh([(s - t0, e - s) for s, e in gen], (-1.4, 0.8), color="0.4")
        rows[-1] = "generation (rows)"
        handles.append(Patch(color="0.4", label="generating"))
    ax.set_yticks(list(rows), list(rows.values()))
    ax.set_xlabel("seconds since the first span")
    ax.set_title("timeline per actor")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1, 1))
    return ax


def plot_throughput(spans, ax=None, bin_s: float | None = None):
    ax = _axes(ax)
    th = throughput(spans, bin_s)
    colors = _colors(stage_order(spans))
    for i, stage in enumerate(th.columns):     # wider lines first: stages in lockstep stay visible
        ax.plot(th.index, th[stage], label=stage, color=colors[stage], drawstyle="steps-post",
                linewidth=max(1.0, 4.0 - 1.0 * i))
    ax.set_xlabel("seconds since the first span")
    ax.set_ylabel("rows / s")
    ax.set_title("stage throughput over time")
    ax.legend()
    return ax


def plot_staleness(rollouts, ax=None):
    ax = _axes(ax, (6, 4))
    s = staleness(rollouts)
    top = int(s.max()) if len(s) else 0
    ax.hist(s, bins=np.arange(-0.5, top + 1.5, 1.0), rwidth=0.8)
    ax.set_xticks(range(top + 1))
    ax.set_xlabel("staleness (trained version - token version)")
    ax.set_ylabel("trained tokens")
    ax.set_title(f"staleness of {len(s)} trained tokens")
    return ax


def plot_bubbles(b, ax=None):
    """Per step: the trainer's busy and idle seconds, stacked."""
    ax = _axes(ax, (8, 4))
    ax.bar(b["step"], b["trainer_busy_s"], label="trainer busy (update)")
    ax.bar(b["step"], b["trainer_idle_s"], bottom=b["trainer_busy_s"], label="trainer idle (bubble)")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("step time: update vs bubble")
    ax.legend()
    return ax


def profile_report(run_dir: str | Path, out_dir: str | Path | None = None, log=print) -> dict:
    """Print the per-stage table, bubbles and profiler overhead; write PNG plots (default RUN_DIR/profile_report)."""
    run_dir = Path(run_dir)
    out = Path(out_dir) if out_dir else run_dir / "profile_report"
    out.mkdir(parents=True, exist_ok=True)
    spans = load_spans(run_dir)
    rollouts = _rollouts(run_dir, log)
    table, b = stage_table(spans), bubbles(spans, rollouts)
    fmt = {"busy_s": "{:.2f}".format, "wait_s": "{:.2f}".format, "rows_per_s": "{:.1f}".format,
           "tokens_per_s": "{:.1f}".format, "busy_frac": "{:.1%}".format}
    log(f"per-stage profile of {run_dir} ({len(spans)} spans"
        f"{'' if spans.attrs['complete'] else ', INCOMPLETE: see warnings'})")
    log(table.to_string(formatters=fmt))
    if len(b):
        log("")
        log(_bubble_line(f"step {b['step'].iloc[0]} (with start-up: actor pools, model loads)", b.iloc[:1]))
        if len(b) > 1:
            log(_bubble_line(f"steps {b['step'].iloc[1]}-{b['step'].iloc[-1]} (mean)", b.iloc[1:]))
    wall = spans["end"].max() - spans["start"].min()
    cost = spans["overhead_s"].sum() + sum(s["sink_busy_s"] for s in sink_summaries(run_dir))
    log(f"profiler overhead: {cost * 1e3:.1f} ms recording over {wall:.1f} s of run ({cost / max(wall, 1e-9):.3%})")
    if importlib.util.find_spec("matplotlib") is None:
        log('no plots: matplotlib is not installed (pip install -e ".[profile]")')
        return {"stages": table, "bubbles": b, "plots": {}, "spans": spans}
    plots = {"gantt": plot_gantt(spans, rollouts=rollouts), "throughput": plot_throughput(spans)}
    if len(b):
        plots["bubbles"] = plot_bubbles(b)
    if rollouts is not None:
        plots["staleness"] = plot_staleness(rollouts)
    paths = {name: out / f"{name}.png" for name in plots}
    for name, ax in plots.items():
        ax.figure.savefig(paths[name], dpi=100)
    log("plots: " + ", ".join(str(p) for p in paths.values()))
    return {"stages": table, "bubbles": b, "plots": paths, "spans": spans}


def _bubble_line(label: str, b) -> str:
    wall = b["wall_s"].sum()
    return (f"{label}: wall {b['wall_s'].mean():.2f}s, trainer idle {b['trainer_idle_s'].mean():.2f}s "
            f"({b['trainer_idle_s'].sum() / wall:.1%}), rollout idle {b['rollout_idle_s'].mean():.2f}s "
            f"({b['rollout_idle_s'].sum() / wall:.1%})")


def _rollouts(run_dir: Path, log):
    from pipeline.recorder import Recording, RecordingError

    try:
        return Recording.open(run_dir / "rollouts").read(
            columns=["token_versions", "loss_mask", "t_dispatch", "t_done"]).to_pandas()
    except RecordingError as e:
        log(f"(no staleness plot: {e})")
        return None


def cli_profile(args) -> int:
    try:
        profile_report(args.run_dir, args.out)
    except ProfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:      # pandas: the per-stage table is built with it
        print(f'error: loongsage profile needs {e.name} (pip install -e ".[profile]")', file=sys.stderr)
        return 2
    return 0


def add_subcommand(sub) -> None:
    p = sub.add_parser("profile")
    p.add_argument("run_dir", help="a run directory")
    p.add_argument("--out", default=None, help="where the PNGs go (default RUN_DIR/profile_report)")
    p.set_defaults(fn=cli_profile)
