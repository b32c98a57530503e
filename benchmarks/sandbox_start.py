"""Per-trajectory cost of the code sandbox: a sandbox per trajectory (now) against persistent workers (before).

The sandbox recipe's pattern (configs/agent_sandbox.yaml): 8 groups x 8 samples = 64 trajectories of
a step run at once in one rollout worker; each runs 1-12 snippets ("37*48*29"-like), a model turn
before each (here a fixed sleep: the engine is not what is measured). Before = the persistent pool
of commit BEFORE (`sandbox.workers` processes shared by every trajectory: the contamination of
issue 39), loaded from git; after = this tree's SandboxPool, a session (a jail) per trajectory.

Prints, per implementation: sandboxes started, ms of start per sandbox (spawn -> ready, wall), ms of
start per trajectory (the sum of starts / trajectories), CPU ms per trajectory of all sandbox
processes (their rusage, snippets included), the wall time of a step, and the mean wait of a
trajectory's first call. Last, the start of a black-box agent process (a script that does nothing):
unjailed, in the agent jail of commit --agents-before, and in this tree's, spawned and forked by the
zygote (stages/agentflow/sandbox/jail.py).

    python benchmarks/sandbox_start.py [--steps 3] [--trajectories 64] [--before 93f8b01] [--agents-only]
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
    p.add_argument("--agents-before", default="cc54a4c", help="the commit whose agent jail is compared")
    p.add_argument("--agents-only", action="store_true", help="only the black-box agent start")
    args = p.parse_args()
    if args.agents_only:
        for row in agent_start_ms(args.agents_before):
            print(row)
        return
    args.workers_before = RECIPE["workers"]
    from stages.agentflow.sandbox.pool import SandboxConfig, SandboxPool

    before = load_before(args.before)
    old = before.SandboxPool(before.SandboxConfig(**RECIPE))
    print(f"isolation now: {SandboxPool(SandboxConfig(**RECIPE)).isolation.describe()}")
    args.old_start_ms = _old_start_ms(before)
    print({"impl": "before: one worker start (unshare, wall ms, median of 5)", "ms": args.old_start_ms})
    for row in (measure("before", old, step_before, args),
                measure("after", SandboxPool(SandboxConfig(**RECIPE)), step_after, args)):
        print(row)
    for row in agent_start_ms(args.agents_before):
        print(row)


def agent_start_ms(before: str, runs: int = 30) -> list[dict]:
    """A black-box agent process (a script that does nothing) started and waited for, per trajectory: unjailed; in
    the agent jail of commit `before` (the host's file system read-only, the host's network); in this tree's jail,
    spawned (own root, network and cgroup, the forwarder) and forked by the zygote. Rounds alternate between them.
    Wall ms from spawn to exit, median and 90th percentile (CPU is not read: rusage does not follow the
    processes of a PID namespace's init that exits first)."""
    from stages.agentflow.config import AgentConfig
    from stages.agentflow.sandbox.agent_jail import Jail, Zygote, end

    d = Path(tempfile.mkdtemp(prefix="jail-before-"))
    (d / "jail.py").write_text(subprocess.run(["git", "-C", str(ROOT), "show", f"{before}:stages/agentflow/jail.py"],
                                              capture_output=True, text=True, check=True).stdout)
    spec = importlib.util.spec_from_file_location("jail_before", d / "jail.py")
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    script = d / "agent.py"        # the zygote forks `python SCRIPT.py` agents only
    script.write_text("pass\n")
    argv = [sys.executable, str(script)]
    jail = Jail(AgentConfig())

    async def connect():
        raise OSError("no proxy: the agent makes no call")

    async def go():
        z = Zygote(())
        z.jail, z.agent_argv = jail, tuple(argv)
        await z._start()

        async def before_():
            fd = old.seccomp_fd()
            p = await asyncio.create_subprocess_exec(*old.agent_argv(argv, os.getcwd(), None, (), fd), pass_fds=(fd,))
            os.close(fd)
            await p.wait()

        async def spawned():
            p = await jail.spawn(argv, {}, 8999, connect, None)
            await p.wait()
            end(p)

        async def forked():
            p = await z.spawn(argv, {"HOME": "/tmp/home"}, 8999, connect)
            await p.wait()
            end(p)

        async def unjailed():
            await (await asyncio.create_subprocess_exec(*argv)).wait()

        ways = {"unjailed": unjailed, f"jail of {before}": before_, "jail, spawned": spawned, "jail, forked": forked}
        wall = {k: [] for k in ways}
        for _ in range(runs):
            for name, start in ways.items():
                t0 = time.perf_counter()
                await start()
                wall[name].append(time.perf_counter() - t0)
        await z.aclose()
        return [{"impl": f"agent start: {k}", "wall_ms": round(1000 * statistics.median(wall[k]), 1),
                 "p90_ms": round(1000 * sorted(wall[k])[int(0.9 * len(wall[k]))], 1)} for k in ways]

    try:
        return asyncio.run(go())
    finally:
        jail.close()


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
