"""The code sandbox (stages/agentflow/sandbox.py): real worker processes, real limits, one sandbox per trajectory.

Each bad snippet -- a loop that never ends, a 10 GB allocation, a fork bomb, a write outside
its directory, a stdout flood -- must come back as an error observation within its limit, the
worker must be replaced by a fresh process, the next call must work, and no process may be
left behind (counted over this test's descendants and the sandbox uids). The isolation this
machine allows (network, PID and mount namespaces, own uid) is checked where the probe says
it holds; the trajectory-level test runs the `sandbox` agent on a real engine. The attacker-and-victim
property: whatever one trajectory's code does (poison builtins and modules, plant files, read other
processes' environment, leave processes), no other trajectory's result changes and nothing it writes
is visible to another.
"""
from __future__ import annotations

import asyncio
import os
import time

import pytest

from stages.agentflow.rollout import AgentFlowRollout, RolloutConfig
from stages.agentflow.sandbox import UID_BASE, UID_END, SandboxConfig, SandboxPool, probe_isolation
from stages.agentflow.tools import ToolRegistry
from stages.agentflow.workflows import SandboxAgent

ISO = probe_isolation()
FAST = dict(workers=1, cpu_s=1.0, timeout_s=1.5, memory_mb=256, output_bytes=2048)


def _procs() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, uid) of every process on the machine."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/status") as f:
                    st = dict(line.split(":", 1) for line in f if ":" in line)
                out[int(d)] = (int(st["PPid"]), int(st["Uid"].split()[0]))
            except (OSError, KeyError, ValueError):
                pass
    return out


def sandbox_processes() -> list[int]:
    """Our descendant sandbox processes (unshare, workers), and any process running under a sandbox uid
    (a snippet's child, wherever it went)."""
    procs, me = _procs(), os.getpid()
    mine = {me}
    changed = True
    while changed:
        changed = False
        for pid, (ppid, _) in procs.items():
            if ppid in mine and pid not in mine:
                mine.add(pid)
                changed = True
    mine.discard(me)
    mine = {p for p in mine if _is_sandbox(p)}      # not Ray's workers, which come and go on their own
    return sorted(mine | {p for p, (_, uid) in procs.items() if UID_BASE <= uid < UID_END})


def _is_sandbox(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return argv[0].endswith((b"unshare", b"bwrap")) or any(a.endswith((b"sandbox_worker.py", b"worker.py"))
                                                           for a in argv)


def describe(pids) -> list[str]:
    out = []
    for p in pids:
        try:
            with open(f"/proc/{p}/cmdline") as f:
                out.append(f"{p}: {f.read().replace(chr(0), ' ')[:120]}")
        except OSError:
            out.append(f"{p}: gone")
    return out


def run(coro):
    return asyncio.run(coro)


async def _settle(pool: SandboxPool) -> None:
    """Wait for replacements started in the background."""
    for _ in range(200):
        if not pool._spawning:
            return
        await asyncio.sleep(0.05)


BAD = {
    "loop": ("while True:\n    pass", ("timeout", "cpu")),
    "sleep": ("import time\ntime.sleep(60)", ("timeout",)),
    "memory_10gb": ("x = bytearray(10 * 2**30)", ("memory",)),
    "fork_bomb": ("import os\nwhile True:\n    os.fork()", ("fork",)),
    "write_outside": ("open('/etc/loongsage-sandbox-test', 'w').write('x')", ("filesystem",)),
    "file_too_big": ("open('big', 'wb').write(b'x' * (20 << 20))", ("filesystem", "memory")),   # file_mb 16
    "tmp_full": ("for i in range(5):\n    open(f'f{i}', 'wb').write(b'x' * (10 << 20))", ("filesystem", "memory")),
    "stdout_flood": ("import sys\nwhile True:\n    sys.stdout.write('A' * 4096)", ("output",)),
    "raw_fd_flood": ("import os\nwhile True:\n    os.write(1, b'B' * 4096)", ("output",)),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_snippet_is_killed_replaced_and_leaves_nothing(name):
    code, kinds = BAD[name]
    before = sandbox_processes()

    async def go():
        pool = SandboxPool(SandboxConfig(**FAST))
        try:
            async with pool.session() as s:
                assert (await s.run("6*7")).output.strip() == "42"
                first = s.worker.pid
                res = await s.run(code)
                await _settle(pool)
                after = await s.run("6*7")       # the session still serves, from a fresh worker
                return res, first, s.worker.pid, after, dict(pool.stats)
        finally:
            await pool.close()

    res, first, second, after, stats = run(go())
    assert res.kind in kinds, res
    assert res.text().startswith(f"error: sandbox {res.kind} limit"), res.text()
    assert res.replaced and stats["replaced"] == 1 and stats[res.kind] == 1
    assert first != second, "the breaching worker must be replaced by a new process"
    assert after.ok and after.output.strip() == "42"
    limit = FAST["timeout_s"] + 1.0 if res.kind in ("timeout", "cpu") else 1.0
    assert res.wall_s < limit, f"{name}: {res.kind} took {res.wall_s:.2f}s"
    assert len(res.output) <= FAST["output_bytes"]
    assert not os.path.exists("/etc/loongsage-sandbox-test")
    time.sleep(0.2)
    left = sandbox_processes()
    assert left == before, f"a sandbox process outlived its pool: {describe(left)} (before: {describe(before)})"


def test_cpu_limit_stops_a_busy_snippet_before_the_wall_clock():
    async def go():
        pool = SandboxPool(SandboxConfig(workers=1, cpu_s=1.0, timeout_s=60))
        try:
            return await pool.run("while True:\n    pass")
        finally:
            await pool.close()

    res = run(go())
    assert res.kind == "cpu" and res.replaced, res
    assert res.wall_s < 30      # 1-2 CPU seconds; the wall time only stretches when the machine is busy


def test_snippet_results_and_ordinary_errors_keep_the_worker():
    async def go():
        pool = SandboxPool(SandboxConfig(**FAST))
        try:
            async with pool.session() as s:
                a = await s.run("37*48*29")
                pid = s.worker.pid
                b = await s.run("print('partial')\n1/0")
                c = await s.run("x = 3\nprint(x + 1)")
                d = await s.run("x")                      # fresh globals per call
                e = await s.run("def f(:\n")
                return a, b, c, d, e, pid, s.worker.pid
        finally:
            await pool.close()

    a, b, c, d, e, pid, pid_after = run(go())
    assert a.ok and a.output == "51504\n"
    assert b.kind == "error" and "ZeroDivisionError" in b.error and b.output == "partial\n"
    assert b.text().startswith("error: ZeroDivisionError") and not b.replaced
    assert c.output == "4\n"
    assert d.kind == "error" and "NameError" in d.error
    assert e.kind == "error" and "SyntaxError" in e.error
    assert pid == pid_after, "an ordinary exception must not cost a worker"


def test_tool_registry_timeout_kills_the_worker_too():
    """The registry's own timeout cancels the call: the worker it was using is killed, not reused."""
    before = sandbox_processes()

    async def go():
        pool = SandboxPool(SandboxConfig(workers=1, timeout_s=30))
        reg = ToolRegistry([pool.tool()], timeout_s=0.5)
        try:
            t0 = time.perf_counter()
            res = await reg.call("python", {"code": "import time\ntime.sleep(30)"})
            dt = time.perf_counter() - t0
            await _settle(pool)
            return res, dt, await reg.call("python", {"code": "1+1"}), pool.stats["replaced"]
        finally:
            await pool.close()

    res, dt, after, replaced = run(go())
    assert res.startswith("error: tool python timed out") and dt < 3
    assert after == "2\n" and replaced == 1
    time.sleep(0.2)
    assert sandbox_processes() == before


def test_concurrent_calls_each_get_a_sandbox_of_their_own():
    async def go():
        pool = SandboxPool(SandboxConfig(workers=2, timeout_s=5))
        try:
            return await asyncio.gather(*(pool.run(f"{i}*{i}") for i in range(12)))
        finally:
            await pool.close()

    assert [r.output.strip() for r in run(go())] == [str(i * i) for i in range(12)]


def test_a_session_ends_its_worker_and_the_next_session_gets_another():
    async def go():
        pool = SandboxPool(SandboxConfig(**FAST))
        try:
            async with pool.session() as a:
                await a.run("1")
                first = a.worker.proc.pid
            gone = first not in pool.pids()
            async with pool.session() as b:
                await b.run("1")
                return gone, first, b.worker.proc.pid
        finally:
            await pool.close()

    gone, first, second = run(go())
    assert gone and first != second


@pytest.mark.skipif(not ISO.network, reason=f"no network namespace here: {ISO.describe()}")
def test_no_network():
    async def go():
        pool = SandboxPool(SandboxConfig(**FAST))
        try:
            return await pool.run("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)")
        finally:
            await pool.close()

    res = run(go())
    assert res.kind == "error" and "unreachable" in res.error.lower(), res


@pytest.mark.skipif(not (ISO.pid and ISO.private_tmp and ISO.uid), reason=f"not isolated here: {ISO.describe()}")
def test_private_tmp_own_pid_namespace_and_uid():
    marker = f"/tmp/loongsage-host-{os.getpid()}"
    open(marker, "w").close()
    try:
        async def go():
            pool = SandboxPool(SandboxConfig(**FAST))
            try:
                async with pool.session() as s:
                    a = await s.run(f"import os\n(os.path.exists({marker!r}), os.getpid(), os.getuid(), os.getcwd())")
                    b = await s.run("open('left.txt', 'w').write('x')\nimport os\nos.listdir('.')")
                    c = await s.run("import os\nos.listdir('.')")     # emptied between calls
                    return a, b, c
            finally:
                await pool.close()

        a, b, c = run(go())
    finally:
        os.unlink(marker)
    exists, pid, uid, cwd = eval(a.output)
    assert not exists and pid == 1 and uid >= UID_BASE and cwd == "/tmp"
    assert b.output.strip() == "['left.txt']" and c.output.strip() == "[]"


def test_bad_config_names_the_key():
    for kw, key in [({"workers": 0}, "sandbox.workers"), ({"timeout_s": 0}, "sandbox.timeout_s"),
                    ({"isolation": "maybe"}, "sandbox.isolation"), ({"nproc": -1}, "sandbox.nproc")]:
        with pytest.raises(ValueError, match=key):
            SandboxConfig(**kw)


def test_strict_isolation_refuses_what_the_machine_lacks():
    if ISO.complete:
        run(SandboxPool(SandboxConfig(isolation="strict")).close())     # holds here: starts
    else:
        with pytest.raises(RuntimeError, match="isolation=strict"):
            SandboxPool(SandboxConfig(isolation="strict"))


class BreachThenAnswer(SandboxAgent):
    """The `sandbox` agent's own tool path, with snippets the test picks: each bad one, then a good one,
    then a model turn -- the trajectory must go on past every breach."""
    async def run(self, ctx, sample):
        session = self.attach(ctx)
        try:
            for code, _ in BAD.values():
                await self.run_snippet(ctx, code)
            await self.run_snippet(ctx, "2+3")
            await ctx.generate()
        finally:
            await session.close()


@pytest.mark.slow      # an engine actor on Ray: 25-45 s on 2 busy cores
def test_trajectory_goes_on_past_every_breach(ray_session, tiny_model_dir):
    import json

    import ray

    from stages.agentflow.engine import HFEngine
    from stages.schema import table_from_columns

    before = sandbox_processes()
    engine = ray.remote(HFEngine).options(num_cpus=0.1, max_concurrency=4).remote(tiny_model_dir)
    cfg = RolloutConfig(agent="sandbox", max_new_tokens=4, temperature=0.0, max_turns=4,
                        sandbox=SandboxConfig(**FAST))
    stage = AgentFlowRollout(cfg, [engine], None, tiny_model_dir)
    stage.agent = BreachThenAnswer()
    stage.agent.configure(cfg)
    try:
        out = stage(table_from_columns({"prompt_id": ["p0"], "group_id": [0], "sample_idx": [0],
                                        "data_source": ["addition"], "prompt": ["12+34="], "answer": ["46"]}))
        stats = dict(stage.agent.pool.stats)
    finally:
        stage.close()
        ray.kill(engine)
    row = out.to_pylist()[0]
    assert row["status"] == "completed", row["error"]
    errors = json.loads(row["agent_info"])["tool_errors"]
    assert len(errors) == len(BAD) and all(e.startswith("error: sandbox ") for e in errors), errors
    tools = [t["content"] for t in json.loads(row["transcript"]) if t["role"] == "tool"]
    assert tools[-1] == "5=" and all(t in ("?=", "=") for t in tools[:-1]), tools   # a failure reads "?="
    assert row["agent_stats"]["tool_calls"] == len(BAD) + 1 and row["agent_stats"]["turns"] == 1
    assert stats["replaced"] == len(BAD)
    time.sleep(0.2)
    assert sandbox_processes() == before
