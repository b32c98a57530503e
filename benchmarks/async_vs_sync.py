"""Synchronous vs fully asynchronous, same recipe, same resources, one invocation.

    python benchmarks/async_vs_sync.py [--steps 40] [--rounds 3] [key=value ...]

Each round runs the recipe (configs/quickstart_async.yaml) twice: synchronous
(`stale_steps=0`, no window) and fully asynchronous (`stale_steps=1`, window-gated).
Rounds alternate which mode goes first, so a drift in the machine's speed (a shared VM)
hits both modes alike. Prints per run the trained samples/s (steady state: the first
step, which includes start-up, is left out), each resource's busy fraction and the final
eval accuracy; then each round's async/sync ratio and their median.

On Linux it also reads the machine's CPU time (/proc/stat) over the same steady-state steps:
each mode's CPU seconds per step and the fraction of all cores kept busy. Both modes do the
same work per step, so no schedule of the async run's per-step CPU can beat
`sync wall per step x cores / async CPU per step`: that ceiling is printed per round.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)     # the repository first; not this folder (its transfer.py names the package)

from pipeline.config import load_config  # noqa: E402
from pipeline.controller import run  # noqa: E402
from pipeline.metrics import read_metrics  # noqa: E402

MODES = {"sync": ["rollout.stale_steps=0", "rollout.window=no-window"],
         "async": ["rollout.stale_steps=1"]}


def machine_cpu_s() -> float | None:
    """CPU seconds all cores have spent busy since boot (Linux /proc/stat), or None elsewhere."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class CpuWindow(threading.Thread):
    """Machine CPU time and wall time between the end of a run's first step and its last one:
    the same steady-state steps the throughput is taken over."""

    def __init__(self, metrics: Path, steps: int):
        super().__init__(daemon=True)
        self.metrics, self.steps, self.marks, self.stop = metrics, steps, {}, threading.Event()
        self.start()

    def _trained(self) -> int:
        try:
            return self.metrics.read_text().count('"train/loss"')
        except OSError:
            return 0

    def run(self) -> None:
        while not self.stop.wait(0.01):
            n = self._trained()
            for mark in (1, self.steps):
                if n >= mark and mark not in self.marks:
                    self.marks[mark] = (time.monotonic(), machine_cpu_s(), n)

    def result(self) -> tuple[float | None, float | None]:
        """(machine CPU seconds per steady-state step, fraction of all cores busy), or Nones."""
        self.stop.set()
        self.join()
        a, b = self.marks.get(1), self.marks.get(self.steps)
        if a is None or b is None or a[1] is None or b[2] <= a[2]:
            return None, None
        cpu = b[1] - a[1]
        return cpu / (b[2] - a[2]), cpu / (b[0] - a[0]) / os.cpu_count()


def one(mode: str, steps: int, extra: list[str], out: str) -> dict:
    cfg = load_config(ROOT / "configs" / "quickstart_async.yaml", [f"run.steps={steps}", "eval.every=0",
                                                                   *MODES[mode], *extra])
    cpu = CpuWindow(Path(out) / "metrics.jsonl", steps)
    summary = run(cfg, out, log=lambda *_: None)
    steps_m = [m for m in read_metrics(out) if "train/loss" in m][1:]
    wall = sum(m["step_wall_s"] for m in steps_m)
    cpu_step, machine_busy = cpu.result()
    return {"wall_per_step": wall / len(steps_m), "cpu_per_step": cpu_step, "machine_busy": machine_busy,
            "samples_per_s": sum(m["rollout/samples"] for m in steps_m) / wall,
            "rollout_busy": statistics.mean(m["rollout/busy_frac"] for m in steps_m),
            "trainer_busy": statistics.mean(m["trainer/busy_frac"] for m in steps_m),
            "staleness_max": max(m["staleness/max"] for m in steps_m),
            "final_accuracy": summary["final"].get("eval/accuracy"), "threads": summary["threads"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    head = ("round", "mode", "samples/s", "rollout busy", "trainer busy", "max stale", "final acc",
            "CPU ms/step", "cores busy", "threads eng/trn")
    print(f"{head[0]:<6} {head[1]:<6} {head[2]:>10} {head[3]:>13} {head[4]:>13} {head[5]:>10} {head[6]:>10} "
          f"{head[7]:>12} {head[8]:>11} {head[9]:>16}")
    ratios, async_busy, ceilings = [], [], []
    with tempfile.TemporaryDirectory() as root:
        for k in range(a.rounds):
            res = {}
            for mode in (("sync", "async") if k % 2 == 0 else ("async", "sync")):
                r = res[mode] = one(mode, a.steps, a.overrides, f"{root}/{k}-{mode}")
                acc, cpu, busy = r["final_accuracy"], r["cpu_per_step"], r["machine_busy"]
                print(f"{k + 1:<6} {mode:<6} {r['samples_per_s']:>10.1f} {r['rollout_busy']:>13.2f} "
                      f"{r['trainer_busy']:>13.2f} {r['staleness_max']:>10} "
                      f"{'-' if acc is None else f'{acc:.3f}':>10} {'-' if cpu is None else f'{cpu * 1e3:.0f}':>12} "
                      f"{'-' if busy is None else f'{busy:.2f}':>11} "
                      f"{','.join(map(str, r['threads']['engines'])) + '/' + str(r['threads']['trainer']):>16}",
                      flush=True)
            ratios.append(res["async"]["samples_per_s"] / res["sync"]["samples_per_s"])
            async_busy.append(max(res["async"]["rollout_busy"], res["async"]["trainer_busy"]))
            if res["async"]["cpu_per_step"]:
                # async can at best keep every core busy on its own per-step CPU
                ceilings.append(res["sync"]["wall_per_step"] * os.cpu_count() / res["async"]["cpu_per_step"])
    print("async/sync throughput ratio per round: " + ", ".join(f"{x:.2f}x" for x in ratios))
    if ceilings:
        print(f"ceiling per round ({os.cpu_count()} cores, sync wall x cores / async CPU per step): "
              + ", ".join(f"{x:.2f}x" for x in ceilings))
    print(f"median ratio: {statistics.median(ratios):.2f}x; busier resource in async: "
          f"{min(async_busy):.2f}-{max(async_busy):.2f}")


if __name__ == "__main__":
    main()
