"""Per-trajectory cost of the code sandbox: a sandbox per trajectory (now) against persistent workers (before).

The sandbox recipe's pattern (configs/agent_sandbox.yaml): 8 groups x 8 samples = 64 trajectories of
a step run at once in one rollout worker; each runs 1-12 snippets ("37*48*29"-like), a model turn
before each (here a fixed sleep: the engine is not what is measured). Before = the persistent pool
of commit BEFORE (`sandbox.workers` processes shared by every trajectory: the contamination of
issue 39), loaded from git; after = this tree's SandboxPool, a session (a jail) per trajectory.

Prints, per implementation: sandboxes started, ms of start per sandbox (spawn -> ready, wall), ms of
start per trajectory (the sum of starts / trajectories), CPU ms per trajectory of all sandbox
processes (their rusage, snippets included), the wall time of a step, and the mean wait of a
trajectory's first call. Last, the start of a black-box agent process (`python -c pass`), unjailed and
in its jail (stages/agentflow/jail.py agent_argv).

    python benchmarks/sandbox_start.py [--steps 3] [--trajectories 64] [--before 93f8b01]
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPE = dict(workers=2, cpu_s=2.0, timeout_s=5.0, memory_mb=512, output_bytes=4096)   # configs/agent_sandbox.yaml


def load_before(commit: str):
    """The sandbox module as it was at `commit` (with its worker beside it)."""
    d = Path(tempfile.mkdtemp(prefix="sandbox-before-"))
    for name in ("sandbox.py", "sandbox_worker.py"):
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:stages/agentflow/{name}"],
                             capture_output=True, text=True, check=True).stdout
        (d / name).write_text(src)
    spec = importlib.util.spec_from_file_location("sandbox_before", d / "sandbox.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod        # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


async def trajectory(run_call, calls: int, model_s: float) -> float:
    """Runs `calls` snippets; returns the wait of its first call."""
    first = 0.0
    for i in range(calls):
        await asyncio.sleep(model_s)
        t0 = time.perf_counter()
        out = await run_call(f"{37 + i}*48*29")
        if i == 0:
            first = time.perf_counter() - t0
        assert out.strip() == str((37 + i) * 48 * 29), out
    return first


async def step_after(pool, calls: list[int], model_s: float) -> list[float]:
    async def one(n):
        async with pool.session() as s:
            s.prestart()        # as the sandbox agent does: the start overlaps the first model turn
            return await trajectory(lambda c: _text(s.run(c)), n, model_s)
    return await asyncio.gather(*(one(n) for n in calls))


async def step_before(pool, calls: list[int], model_s: float) -> list[float]:
    return await asyncio.gather(*(trajectory(lambda c: _text(pool.run(c)), n, model_s) for n in calls))


async def _text(coro) -> str:
    return (await coro).text()


def measure(name: str, pool, step, args) -> dict:
    rng = random.Random(0)
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)

    async def go():
        walls, firsts = [], []
        for _ in range(args.steps):
            calls = [min(12, 1 + int(rng.expovariate(0.5))) for _ in range(args.trajectories)]
            t0 = time.perf_counter()
            firsts += await step(pool, calls, args.model_s)
            walls.append(time.perf_counter() - t0)
        await pool.close()
        return walls, firsts

    walls, firsts = asyncio.run(go())
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    n = args.steps * args.trajectories
    cpu_ms = (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) * 1000
    st = getattr(pool, "stats", {})
    if name == "before":    # its workers start once per run (and again after a breach: none here)
        started, start_s = args.workers_before, args.workers_before * args.old_start_ms / 1000
    else:
        started, start_s = st["sandboxes"], st["start_s"]
    return {"impl": name, "sandboxes": started,
            "start_ms_per_sandbox": round(1000 * start_s / started, 1) if start_s else None,
            "start_ms_per_trajectory": round(1000 * start_s / n, 1) if start_s else None,
            "cpu_ms_per_trajectory": round(cpu_ms / n, 1), "step_wall_s": round(statistics.median(walls), 2),
            "first_call_ms": round(1000 * statistics.mean(firsts), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--trajectories", type=int, default=64)
    p.add_argument("--model-s", type=float, default=0.2, help="the model turn before each snippet (a sleep)")
    p.add_argument("--before", default="93f8b01", help="the commit with the persistent pool")
    args = p.parse_args()
    args.workers_before = RECIPE["workers"]
    from stages.agentflow.sandbox import SandboxConfig, SandboxPool

    before = load_before(args.before)
    old = before.SandboxPool(before.SandboxConfig(**RECIPE))
    print(f"isolation now: {SandboxPool(SandboxConfig(**RECIPE)).isolation.describe()}")
    args.old_start_ms = _old_start_ms(before)
    print({"impl": "before: one worker start (unshare, wall ms, median of 5)", "ms": args.old_start_ms})
    for row in (measure("before", old, step_before, args),
                measure("after", SandboxPool(SandboxConfig(**RECIPE)), step_after, args)):
        print(row)
    print({"impl": "black-box agent process start, median ms", **agent_start_ms()})


def agent_start_ms(runs: int = 20) -> dict:
    """A black-box agent process (`python -c pass`) started and waited for, unjailed and in its jail: median ms."""
    from stages.agentflow.blackbox import make_jail

    argv = [sys.executable, "-c", "pass"]
    jail = make_jail("auto")
    out = {}
    for name, wrap in (("unjailed", None), ("jailed", jail)):
        times = []
        for _ in range(runs):
            cmd, fds = (argv, ()) if wrap is None else wrap.wrap(argv, None)
            t0 = time.perf_counter()
            subprocess.run(cmd, pass_fds=fds, check=True)
            times.append(time.perf_counter() - t0)
            for fd in fds:
                os.close(fd)
        out[name] = round(1000 * statistics.median(times), 1)
    if jail is not None:
        jail.close()
    return out


def _old_start_ms(before) -> float:
    async def go():
        pool = before.SandboxPool(before.SandboxConfig(**{**RECIPE, "workers": 1}))
        t0 = time.perf_counter()
        await pool.start()
        dt = time.perf_counter() - t0
        await pool.close()
        return dt
    return round(1000 * statistics.median(asyncio.run(go()) for _ in range(5)), 1)


if __name__ == "__main__":
    main()
