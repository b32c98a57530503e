"""What does the always-on profiler cost? Two measurements, printed as ratios.

1. Per stage call: a profiled stage against the same stage unprofiled, in this process,
   spans going to a SpanSink actor exactly as in a run (fire-and-forget actor calls).
2. A real run (configs/quickstart.yaml by default, short): every span carries the time its
   actor spent recording the previous span (overhead_s) and the sink reports its own busy
   time; their sum is compared with the run's step time (the sum of the steps' windows:
   waiting for data, update, weight sync). The per-call cost times the spans per step gives
   a second, independent bound.

    python benchmarks/profile_overhead.py                              # quickstart, 3 steps
    python benchmarks/profile_overhead.py --config configs/quickstart_async.yaml run.steps=4
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)     # the repository first; not this folder (its transfer.py names the package)

import pyarrow as pa  # noqa: E402

from pipeline.cluster import init_ray  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.controller import Controller  # noqa: E402
from pipeline.planner.spans import bubbles, load_spans, sink_summaries  # noqa: E402
from pipeline.profile import Profiler, profiled  # noqa: E402


class Identity:
    """A stage that does nothing, so the difference is the profiler alone."""

    def __call__(self, batch: pa.Table) -> pa.Table:
        return batch


def per_call_cost(tmp: Path, calls: int, rows: int = 128, tokens: int = 6) -> tuple[float, float]:
    """Seconds per call of Identity, plain and profiled, on a batch shaped like one rollout block."""
    batch = pa.table({"group_id": pa.array([i // 8 for i in range(rows)], pa.int64()),
                      "response_ids": pa.array([[1] * tokens] * rows, pa.list_(pa.int32()))})
    prof = Profiler(tmp)
    plain, timed = Identity(), profiled(Identity, prof)()
    out = []
    for stage in (plain, timed, plain, timed):          # interleaved: the machine's load drifts
        t0 = time.perf_counter()
        for _ in range(calls):
            stage(batch)
        out.append((time.perf_counter() - t0) / calls)
    prof.close()
    return min(out[0], out[2]), min(out[1], out[3])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "quickstart.yaml"))
    p.add_argument("--calls", type=int, default=2000, help="calls per arm of the per-call measurement")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cfg = load_config(args.config, ["run.steps=3", "eval.num_prompts=0", *args.overrides])
    init_ray(cfg, cfg.run.ray_num_cpus or os.cpu_count())
    with tempfile.TemporaryDirectory() as tmp:
        plain, timed = per_call_cost(Path(tmp) / "micro", args.calls)
        cost = timed - plain
        print(f"per stage call: plain {plain * 1e6:.1f} us, profiled {timed * 1e6:.1f} us "
              f"-> {cost * 1e6:.1f} us recorded per span")
        run = Path(tmp) / "run"
        ctl = Controller(cfg, run, log=lambda *_: None)
        try:
            ctl.run()
        finally:
            ctl.stop()
        spans = load_spans(run)
        b = bubbles(spans)
        if b.empty:
            print("no driver spans in the profile: the controller does not record them (hook not wired)")
            return 1
        step_s = b["wall_s"].sum()
        summaries = sink_summaries(run)
        in_spans, sink = spans["overhead_s"].sum(), sum(s["sink_busy_s"] for s in summaries)
        start = sum(s.get("sink_start_s", 0.0) for s in summaries)
        first = spans.groupby("actor")["overhead_s"].apply(lambda o: o.iloc[1] if len(o) > 1 else 0.0).sum()
        recorded, per_step = in_spans + sink, len(spans) / len(b)
    print(f"run: {Path(args.config).name} {' '.join(args.overrides)}: {len(b)} steps, "
          f"mean step {step_s / len(b):.2f} s, {per_step:.1f} spans per step")
    print(f"profiler time recorded in the run: {recorded * 1e3:.2f} ms over {step_s:.1f} s of steps "
          f"= {recorded / step_s:.4%} of step time")
    print(f"  of which: in the actors {in_spans * 1e3:.2f} ms ({first * 1e3:.2f} ms on each actor's first send, "
          f"which connects it to the sink), in the sink actor (Parquet writes, its own process) {sink * 1e3:.2f} ms")
    print(f"  once, before the first step: the sink's Parquet writer warm-up {start * 1e3:.0f} ms")
    print(f"bound from the per-call cost: {per_step:.1f} spans x {cost * 1e6:.0f} us / {step_s / len(b):.2f} s "
          f"= {per_step * cost / (step_s / len(b)):.4%} of step time (budget: 2%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
